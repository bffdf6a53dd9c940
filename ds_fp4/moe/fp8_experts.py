"""DeepSpeed's local experts with FP8 GEMMs, fed straight from the MXFP4 dispatch payload.

``FP8Experts`` replaces ``deepspeed.moe.experts.Experts`` when every expert is a
``SwiGLUExpert``. The weights stay ordinary parameters (DeepSpeed's optimizer, ZeRO and
checkpoints see nothing new); they are quantized to FP8 in 128x128 tiles on every use, or
once per optimizer step with ``weight_cache`` (``ds_fp4.moe.weight_cache``).
The passes it runs, for all local experts at once, are ``ds_fp4.moe.fp8_expert_passes``;
here are the module, its configuration and the autograd Function that runs the passes
eagerly or as CUDA graphs (``ds_fp4.moe.expert_graphs``).
"""

import torch
from deepspeed.moe.experts import Experts

from ds_fp4 import env, formats
from ds_fp4.config import Format, Kernels, ScaleRounding, choice
from ds_fp4.moe.alltoall import kernel_scope
from ds_fp4.moe.expert import SwiGLUExpert
from ds_fp4.moe.expert_graphs import ExpertGraphs
from ds_fp4.moe.fp8_expert_passes import G, _Backward, _backward_pass, _forward_pass, _Plan
from ds_fp4.moe.weight_cache import TileCache
from ds_fp4.ops import checks
from ds_fp4.ops.grouped_gemm import grouped_fp8_supported

__all__ = ["FP8Experts", "fp8_experts_supported", "CACHE_FORMATS"]

CACHE_FORMATS = tuple(fmt.value for fmt in Format)


def fp8_experts_supported(device=None):
    """Whether ``FP8Experts`` runs its GEMMs on FP8 tensor cores on ``device``.

    Arguments:
        device: ``torch.device``/string/index; None: the current CUDA device.
    Returns:
        bool: True on CUDA sm_90 (Hopper) with Triton (``grouped_fp8_supported``).
        Elsewhere FP8Experts still runs, through dequantized operands where the GPU has
        no FP8 tensor cores (same function, no speed-up).
    """
    if device is None:
        if not torch.cuda.is_available():
            return False
        device = torch.device("cuda", torch.cuda.current_device())
    return grouped_fp8_supported(device)


_LAYERS = {"swiglu": ("gate", "up", "down"), "gelu": ("up", "down")}


def _expert_params(expert):
    """An expert's weights, then its biases if it has them, read from the modules' own
    dicts: ``nn.Module`` attribute lookups cost ~6 us an expert on a host CPU, ~0.2 ms a
    forward at 32 experts. A layer whose weight is not a plain parameter (a
    parametrization) is read through its attributes."""
    modules = expert._modules
    layers = [modules[name] for name in _LAYERS[expert.activation]]
    try:
        weights = [layer._parameters["weight"] for layer in layers]
        biases = [layer._parameters["bias"] for layer in layers]
    except KeyError:
        weights, biases = [layer.weight for layer in layers], [layer.bias for layer in layers]
    return weights + biases if biases[0] is not None else weights


# ---- the autograd Function ---------------------------------------------------------------

_NOT_DIFFERENTIABLE = (None,) * 6   # the Function's arguments between inputs and params


class _FP8ExpertsFunction(torch.autograd.Function):
    """``[ep, n_local, C, H]`` -> same, all local experts (``fp8_expert_passes``), both
    passes in the plan's ``kernels`` mode. ``rows``: the input's packed MXFP4 rows or None;
    ``graphs``: an ``ExpertGraphs`` that replays captured passes, or None (eager);
    ``donate``: the output's gradient may take the input's (``donated_grad``; in the
    passes that run eagerly: ``ExpertGraphs.backward`` turns it off for captured ones);
    ``used``, ``gather``: None or ``FP8Experts.forward``'s (eager passes only)."""

    @staticmethod
    def forward(ctx, inputs, rows, plan, graphs, donate, used, gather, *params):
        ep, _, cap, _ = inputs.shape
        ctx.graphs, ctx.dtype = graphs, inputs.dtype
        ctx.donate, ctx.used, ctx.gather = donate, used, gather
        ctx.param_dtypes = tuple(p.dtype for p in params)
        ctx.plan, ctx.shape = plan, tuple(inputs.shape)
        if ep * cap == 0:
            ctx.x_kind = "empty"
            ctx.save_for_backward(*params)
            return inputs.new_zeros(inputs.shape)
        # MXFP4 rows are kept both when they arrived and when an MXFP4 cache made them
        ctx.x_kind = "rows" if rows is not None or plan.cache == "mxfp4" else plan.cache
        args = (inputs, rows, plan, *params)
        with kernel_scope(plan.kernels):
            if graphs is None:
                y, kept_z, *kept_x = _forward_pass(
                    *args, used=used, gather=None if gather is None else (gather.tokens,
                                                                          gather.source))
            else:
                y, kept_z, *kept_x = graphs.forward(_forward_pass, args, rows)
        ctx.save_for_backward(kept_z, *kept_x, *params)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.x_kind == "empty":
            grads = [torch.zeros_like(p) for p in ctx.saved_tensors]
            return (torch.zeros_like(grad_out, dtype=ctx.dtype) if ctx.needs_input_grad[0]
                    else None, *_NOT_DIFFERENTIABLE, *grads)
        needs = (ctx.needs_input_grad[0], *ctx.needs_input_grad[1 + len(_NOT_DIFFERENTIABLE):])
        # (dy, source, slot_gates) where the decode left them with the experts' GatheredSlots
        grad_rows = None if ctx.gather is None else ctx.gather.handed_grad(grad_out,
                                                                            "FP8Experts")
        how = _Backward(ctx.plan, ctx.shape, ctx.dtype, ctx.x_kind, needs, ctx.param_dtypes,
                        ctx.donate and grad_rows is None)
        args = (how, grad_out, *ctx.saved_tensors)
        with kernel_scope(ctx.plan.kernels):
            if ctx.graphs is None:
                grads = _backward_pass(*args, used=ctx.used, grad_rows=grad_rows)
            else:
                grads = ctx.graphs.backward(_backward_pass, args)
        return (grads[0], *_NOT_DIFFERENTIABLE, *grads[1:])


# ---- the module ------------------------------------------------------------------------------


class FP8Experts(Experts):
    """DeepSpeed ``Experts`` whose ``SwiGLUExpert``s run with FP8 GEMMs (see module docstring).

    Build it from an existing ``Experts`` with ``FP8Experts.from_experts`` (the very same
    parameter objects and names), or like ``Experts``.

    Arguments:
        expert: a ``SwiGLUExpert`` (copied ``num_local_experts`` times, as ``Experts`` does).
        num_local_experts, expert_group_name: as for ``Experts``.
        cache: a ``Format`` (or its name): how the SwiGLU input z (and the expert input,
            when it does not arrive as MXFP4 rows) is kept for backward: ``"mxfp4"``
            (default), ``"fp8"`` or ``"bf16"``.
        activation_cache: a ``Format`` (or its name) for z alone, or None (as ``cache``):
            ``fp4_moe.activation_cache``.
        scale_rounding: a ``ScaleRounding`` (or ``"rceil"``/``"floor"``): the MXFP4 scale
            rule for what it quantizes.
        graphs: replay the CUDA passes as captured CUDA graphs (``ds_fp4.moe.expert_graphs``:
            far less host time per step, memory per distinct captured pass, shared by the
            modules of the same sizes): True, False, or ``"auto"`` (only passes with small
            GEMMs, within a memory budget).
        kernels: a ``Kernels`` mode (or its name) for every op of the forward and backward
            passes, or None (the process setting, ``ops.set_kernels``).
        weight_cache: keep the FP8 weight tiles from one optimizer step to the next
            (``ds_fp4.moe.weight_cache``; ``fp4_moe.fp8_weight_cache``). Not with graphs
            true; with ``"auto"`` no pass is captured.

    Attribute ``donate_grad`` (default False): the input's gradient may be written into the
    output's (one ``[slots, hidden]`` buffer less at the backward's peak). Only for an owner
    whose next op's backward makes that gradient fresh for the experts alone: ``FP4MoE``
    sets it (its decode and combine do).
    """

    donate_grad = False

    def __init__(self, expert, num_local_experts=1, expert_group_name=None, cache="mxfp4",
                 scale_rounding="rceil", graphs=False, kernels=None, activation_cache=None,
                 weight_cache=False):
        super().__init__(expert, num_local_experts, expert_group_name)
        self._configure(cache, scale_rounding, graphs, kernels, activation_cache, weight_cache)

    @classmethod
    def from_experts(cls, experts, cache="mxfp4", scale_rounding="rceil", graphs=False,
                     kernels=None, activation_cache=None, weight_cache=False):
        """An ``FP8Experts`` over the same expert modules (same parameters, same state_dict keys).

        Arguments:
            experts: a ``deepspeed.moe.experts.Experts`` whose experts are ``SwiGLUExpert``s.
            cache, scale_rounding, graphs, kernels, activation_cache, weight_cache: as for
                the constructor.
        Returns:
            ``FP8Experts``; ``experts`` itself is left untouched (and shares its parameters).
        """
        if not isinstance(experts, Experts):
            raise TypeError(f"experts must be a deepspeed.moe.experts.Experts; got "
                            f"{type(experts).__name__}")
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.deepspeed_experts = experts.deepspeed_experts
        new.num_local_experts = experts.num_local_experts
        new.train(experts.training)
        new._configure(cache, scale_rounding, graphs, kernels, activation_cache, weight_cache)
        return new

    def _configure(self, cache, scale_rounding, graphs, kernels, activation_cache=None,
                   weight_cache=False):
        # the layer hands over its config's enums as they are; names are read here
        cache = choice(Format, cache, "cache")
        z_cache = None if activation_cache is None \
            else choice(Format, activation_cache, "activation_cache")
        scale_rounding = choice(ScaleRounding, scale_rounding, "scale_rounding")
        kernels = None if kernels is None else choice(Kernels, kernels, "kernels")
        experts = list(self.deepspeed_experts)
        for i, ex in enumerate(experts):
            if not isinstance(ex, SwiGLUExpert):
                raise TypeError(
                    f"FP8Experts runs ds_fp4.moe.expert.SwiGLUExpert experts; expert {i} is "
                    f"{type(ex).__name__}: build the MoE with expert=SwiGLUExpert(...) or "
                    f"keep DeepSpeed's Experts (fp8_experts: false)")
        first = experts[0]
        key = (first.hidden, first.ffn, first.activation, first.up.bias is not None)
        if any((ex.hidden, ex.ffn, ex.activation, ex.up.bias is not None) != key
               for ex in experts):
            raise ValueError("all local experts must share hidden, ffn, activation and bias")
        for name, size in (("hidden", first.hidden), ("ffn", first.ffn)):
            if size % G:
                raise ValueError(f"FP8 expert GEMMs use 128x128 weight tiles: {name} = {size} "
                                 f"must be a multiple of {G}")
        if graphs not in (True, False, "auto"):
            raise ValueError(f"graphs must be true, false or \"auto\"; got {graphs!r}")
        if weight_cache not in (True, False):
            raise ValueError(f"weight_cache must be true or false; got {weight_cache!r}")
        if weight_cache and graphs is True:
            raise ValueError("weight_cache (fp4_moe.fp8_weight_cache) needs graphs \"auto\" "
                             "or off (fp4_moe.expert_graphs): a captured pass would replay the "
                             "tiles it was captured with")
        tiles = TileCache() if weight_cache else None
        self.plan = _Plan(first.activation, key[3], cache, scale_rounding,
                          self.num_local_experts, first.hidden, first.ffn,
                          env.expert_gemms_mode(), kernels, z_cache=z_cache, tiles=tiles)
        # "auto" with the weight cache: no graphs (the cache is what the user asked for)
        self.graphs = ExpertGraphs(graphs == "auto", first.hidden, first.ffn) \
            if graphs and not weight_cache else None

    def forward(self, inputs, rows=None, used=None, gather=None):
        """All local experts on their token slots.

        Arguments:
            inputs: ``[ep, n_local, C, hidden]`` bf16/fp16/fp32, the autograd input; with
                ``rows`` only its shape and dtype are read (it may be a stride-0
                placeholder, as the FP4MoE dispatch hands it over).
            rows: None, or uint8 ``[ep, n_local, C, hidden/2 + hidden/32]``: the same
                slots as packed MXFP4 rows (the received dispatch payload,
                ``A2AHandle.take_rows``), which the forward converts directly to FP8 and
                keeps, not a copy, for backward.
            used: None, or int32/int64 ``[n_local]`` on inputs' device: expert e's slots
                from ``used[e]`` on are capacity padding, zero rows here whose outputs are
                never read (so their output gradients are zeros too): the grouped GEMMs
                skip them. Read only where it holds whatever the experts compute from a
                zero row, zero: one rank's slots (ep 1), no bias, eager passes.
            gather: None, or where ``reads_gathered(inputs.shape, inputs.device)``, a
                ``routing.GatheredSlots`` (``tokens [S, hidden]``, ``source`` int64
                ``[n_local * C]``): slot j's row is ``tokens[source[j]]``, a zero row where
                ``source[j]`` is -1 (``routing.encode_gathered``). The quantizers read the
                tokens' rows in place and ``inputs`` (a stride-0 placeholder) only gives
                the shape, so the slot buffer is never made; so does the backward where
                ``routing.decode`` got the same object.
        Returns:
            ``[ep, n_local, C, hidden]`` in ``inputs``' dtype; the gradient for ``inputs``
            is dense, of its shape and dtype.
        """
        self._check_inputs(inputs, rows, used)
        params = [p for ex in self.deepspeed_experts for p in _expert_params(ex)]
        graphs = self._graphs_for(inputs.shape, inputs.device)
        if graphs is not None or inputs.shape[0] != 1 or self.plan.bias:
            used = None
        if gather is not None:
            self._check_gather(inputs, rows, gather)
        return _FP8ExpertsFunction.apply(inputs, rows, self.plan, graphs, self.donate_grad,
                                         used, gather, *params)

    def _graphs_for(self, shape, device):
        """The ``ExpertGraphs`` that would capture or replay a pass of ``shape``, or None."""
        if device.type == "cuda" and self.graphs is not None and self.graphs.may_capture(shape):
            return self.graphs
        return None

    def reads_gathered(self, shape, device):
        """Whether ``forward`` takes ``gather`` for inputs of ``shape`` on ``device``: eager
        passes at ep 1, without biases, the input kept as MXFP4 or FP8 (a bf16 cache keeps
        the slots' rows themselves)."""
        return (shape[0] == 1 and not self.plan.bias and self.plan.cache != Format.BF16
                and self._graphs_for(shape, device) is None)

    def _check_gather(self, inputs, rows, gather):
        if rows is not None or not self.reads_gathered(inputs.shape, inputs.device):
            raise ValueError("gather is for inputs without rows that reads_gathered(shape, "
                             "device) accepts (ep 1, no biases, an MXFP4 or FP8 cache, eager "
                             "passes); pass the slots' rows as inputs and gather=None here")
        tokens, source = gather.tokens, gather.source
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 \
                or tokens.shape[1] != self.plan.hidden or tokens.dtype != inputs.dtype \
                or tokens.device != inputs.device:
            raise ValueError(f"gather's tokens must be [S, {self.plan.hidden}] "
                             f"{inputs.dtype} on {inputs.device}")
        checks.row_index("gather's source", source, inputs.device)
        if source.numel() != inputs.shape[1] * inputs.shape[2]:
            raise ValueError(f"gather's source needs one entry per slot "
                             f"({inputs.shape[1] * inputs.shape[2]}); got {source.numel()}")

    def _check_inputs(self, inputs, rows, used=None):
        if not isinstance(inputs, torch.Tensor) or inputs.dim() != 4:
            raise ValueError(f"inputs must be a 4-D tensor [ep, n_local, C, hidden]; got "
                             f"{getattr(inputs, 'shape', type(inputs).__name__)}")
        if inputs.dtype not in formats.FLOAT_INPUT_DTYPES:
            raise TypeError(f"inputs must be bfloat16, float16 or float32; got {inputs.dtype}")
        want = (self.num_local_experts, self.plan.hidden)
        if (inputs.shape[1], inputs.shape[3]) != want:
            raise ValueError(f"inputs [ep, n_local, C, hidden] must have n_local, hidden = "
                             f"{want}; got {tuple(inputs.shape)}")
        if used is not None:
            checks.int_vector("used", used, self.num_local_experts, inputs.device,
                              f"n_local = {self.num_local_experts} entries")
        if rows is None:
            return
        row_shape = (*inputs.shape[:3], formats.mxfp4_row_bytes(self.plan.hidden))
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 \
                or tuple(rows.shape) != row_shape:
            raise ValueError(
                f"rows must be uint8 {row_shape} (packed MXFP4 rows of inputs); got "
                f"{getattr(rows, 'dtype', None)} {tuple(getattr(rows, 'shape', ()))}")
        if rows.device != inputs.device:
            raise ValueError(f"rows are on {rows.device}, inputs on {inputs.device}")
