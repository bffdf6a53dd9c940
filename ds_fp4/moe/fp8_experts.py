"""DeepSpeed's local experts with FP8 GEMMs, fed straight from the MXFP4 dispatch payload.

``FP8Experts`` replaces ``deepspeed.moe.experts.Experts`` when every expert is a
``SwiGLUExpert``. The weights stay ordinary parameters (DeepSpeed's optimizer, ZeRO and
checkpoints see nothing new); they are quantized to FP8 in 128x128 tiles on every use.

Per local expert e (T = ep * C token slots, padding slots included):

forward:   x (MXFP4 rows -> ``mxfp4_rows_to_fp8``, or bf16 -> ``quantize_fp8``; 1x128)
           z = x @ [gate; up]^T          FP8 GEMM 1x128 x 128x128 -> bf16
           h = silu(z_gate) * z_up       (or gelu(z)) -> ``quantize_fp8`` (1x128)
           y = h @ down^T                FP8 GEMM 1x128 x 128x128 -> bf16
kept:      the MXFP4 rows as received (no copy; bf16 input: x in the cache format) and z in
           the cache format (MXFP4 by default); weights are re-quantized in backward
backward:  dh = dy @ down, dx = dz @ [gate; up]        FP8 dgrad GEMMs (1x128 x 128x128)
           d down = dy^T h, d[gate; up] = dz^T x      FP8 wgrad GEMMs, both operands 1x128
                                                      along tokens; x^T from
                                                      ``mxfp4_to_fp8_colwise``
Hopper's ``scaled_mm`` has no grouped blockwise GEMM, so the experts run in a loop.
"""

import dataclasses
import math
import warnings

import torch
from torch.nn import functional as F
from deepspeed.moe.experts import Experts

from ds_fp4 import formats
from ds_fp4 import ops
from ds_fp4.moe.expert import SwiGLUExpert
from ds_fp4.moe.fp8_gemm import (gemm_fp8_nt_1x128_1x128, gemm_fp8_nt_1x128_128x128,
                                 native_blockwise_supported, quantize_fp8_tile_groups)

__all__ = ["FP8Experts", "fp8_experts_supported", "CACHE_FORMATS"]

CACHE_FORMATS = ("mxfp4", "fp8", "bf16")
G = formats.FP8_GROUP


def fp8_experts_supported(device=None):
    """Whether ``FP8Experts`` runs its GEMMs on FP8 tensor cores on ``device``.

    Arguments:
        device: ``torch.device``/string/index; None: the current CUDA device.
    Returns:
        bool: True on CUDA sm_90 (Hopper) with a torch whose ``nn.functional.scaled_mm``
        has the blockwise (1x128, 128x128) recipes. torch implements those recipes for
        sm_90 only, so sm_89 and sm_100 answer False: FP8Experts still runs there, through
        dequantized operands (same function, no speed-up).
    """
    if device is None:
        if not torch.cuda.is_available():
            return False
        device = torch.device("cuda", torch.cuda.current_device())
    return native_blockwise_supported(device)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the autograd Function needs to know besides the tensors."""
    activation: str          # "swiglu" | "gelu"
    bias: bool
    cache: str               # how z (and x, without rows) is kept for backward
    rounding: str            # MXFP4 scale rule for what this module quantizes itself
    n_local: int
    hidden: int
    ffn: int

    @property
    def n_first(self):       # first-layer weights per expert: gate, up (or up)
        return 2 if self.activation == "swiglu" else 1

    @property
    def n_params(self):
        return (self.n_first + 1) * (2 if self.bias else 1)


def _expert_params(expert):
    layers = ([expert.gate] if expert.activation == "swiglu" else []) + [expert.up, expert.down]
    params = [layer.weight for layer in layers]
    if expert.up.bias is not None:
        params += [layer.bias for layer in layers]
    return params


# ---- pieces of the math ----------------------------------------------------------------


def _swiglu(z):
    gate, up = z.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(torch.bfloat16)


def _swiglu_grad(z, dh):
    gate, up = z.float().chunk(2, dim=-1)
    dh, sig = dh.float(), torch.sigmoid(gate)
    d_gate = dh * up * sig * (1 + gate * (1 - sig))
    return torch.cat((d_gate, dh * gate * sig), dim=-1).to(torch.bfloat16)


def _gelu(z):
    return F.gelu(z.float()).to(torch.bfloat16)


def _gelu_grad(z, dh):
    z = z.float()
    cdf = 0.5 * (1 + torch.erf(z * math.sqrt(0.5)))
    pdf = torch.exp(-0.5 * z * z) * (1 / math.sqrt(2 * math.pi))
    return (dh.float() * (cdf + z * pdf)).to(torch.bfloat16)


_ACT = {"swiglu": (_swiglu, _swiglu_grad), "gelu": (_gelu, _gelu_grad)}
_compiled = {}


def _fused(fn, *tensors):
    """Run ``fn`` (elementwise, float32 math, one bf16 rounding) on CUDA as one fused kernel
    through ``torch.compile`` when that works, else eagerly (same math, more passes)."""
    if not tensors[0].is_cuda or _compiled.get(fn, True) is None:
        return fn(*tensors)
    try:
        if fn not in _compiled:
            _compiled[fn] = torch.compile(fn, dynamic=None)
        return _compiled[fn](*tensors)
    except Exception as err:  # no triton / no compiler: say so once, keep going eagerly
        warnings.warn(f"ds_fp4 FP8 experts: torch.compile of {fn.__name__} failed "
                      f"({type(err).__name__}: {err}); running it eagerly", RuntimeWarning)
        _compiled[fn] = None
        return fn(*tensors)


def _act(z, activation):
    """bf16 ``z [T, 2F]`` (gate | up) or ``[T, F]`` -> bf16 ``h [T, F]``, float32 math."""
    return _fused(_ACT[activation][0], z)


def _act_grad(z, dh, activation):
    """``dh * d act / d z`` in float32, returned as bf16 ``[T, 2F]`` (or ``[T, F]``)."""
    return _fused(_ACT[activation][1], z, dh)


def _colwise_fp8(x, padded):
    """``[T, K]`` -> FP8 1x128 of its zero-padded transpose ``[K, padded]`` (along tokens)."""
    if padded == x.shape[0]:
        return ops.quantize_fp8(x.t().contiguous())
    xt = x.new_zeros(x.shape[1], padded)
    xt[:, :x.shape[0]] = x.t()
    return ops.quantize_fp8(xt)


def _padded_tokens(t):
    return -(-t // G) * G


def _encode_cache(z, cache, rounding):
    if cache == "mxfp4":
        return ops.quantize_mxfp4_rows(z, rounding)
    if cache == "fp8":
        return ops.quantize_fp8_rows(z)
    return z


def _decode_cache(c, cache):
    if cache == "mxfp4":
        return ops.dequantize_mxfp4_rows(c, torch.bfloat16)
    if cache == "fp8":
        return ops.dequantize_fp8_rows(c, torch.bfloat16)
    return c


def _expert_forward(xq, xs, weights, biases, plan):
    """One expert's forward from its FP8 input; returns bf16 ``(z, y)``."""
    (w1q, w1s), (w2q, w2s) = quantize_fp8_tile_groups([weights[:-1], weights[-1:]])
    z = gemm_fp8_nt_1x128_128x128(xq, xs, w1q, w1s)
    if biases:
        z = z + torch.cat(biases[:-1]).to(z.dtype)
    hq, hs = ops.quantize_fp8(_act(z, plan.activation))
    y = gemm_fp8_nt_1x128_128x128(hq, hs, w2q, w2s)
    if biases:
        y = y + biases[-1].to(y.dtype)
    return z, y


def _expert_backward(dy, z, x_colwise, weights, plan, need):
    """One expert's backward: ``dy [T, H]``, cached ``z`` -> ``(dx, weight grads, bias grads)``.

    ``x_colwise`` is a callable giving the input's FP8 1x128 transpose ``[H, P]``; ``need``
    says which gradients to make (``"x"``, ``"w"``, ``"b"``).
    """
    h = _act(z, plan.activation)       # recomputed from the cache: never kept
    dyq, dys = ops.quantize_fp8(dy)
    groups = [weights[-1:]] + ([weights[:-1]] if "x" in need else [])
    transposed = quantize_fp8_tile_groups(groups, transpose=True)
    dz = _act_grad(z, gemm_fp8_nt_1x128_128x128(dyq, dys, *transposed[0]), plan.activation)
    dx = None
    if "x" in need:
        dx = gemm_fp8_nt_1x128_128x128(*ops.quantize_fp8(dz), *transposed[1])
    dws = dbs = None
    if "w" in need:
        padded = _padded_tokens(dy.shape[0])
        dw2 = gemm_fp8_nt_1x128_1x128(*_colwise_fp8(dy, padded), *_colwise_fp8(h, padded))
        dw1 = gemm_fp8_nt_1x128_1x128(*_colwise_fp8(dz, padded), *x_colwise())
        dws = list(dw1.chunk(plan.n_first, dim=0)) + [dw2]
    if "b" in need:
        dbs = list(dz.float().sum(0).chunk(plan.n_first)) + [dy.float().sum(0)]
    return dx, dws, dbs


# ---- the autograd Function ---------------------------------------------------------------


class _FP8ExpertsFunction(torch.autograd.Function):
    """``[ep, n_local, C, H]`` -> same, all local experts; see the module docstring."""

    @staticmethod
    def forward(ctx, inputs, rows, plan, *params):
        ep, n, cap, hidden = inputs.shape
        tokens = ep * cap
        per = plan.n_params
        ctx.plan, ctx.shape, ctx.dtype = plan, tuple(inputs.shape), inputs.dtype
        ctx.param_meta = [(p.dtype, p.shape) for p in params]
        if tokens == 0:
            ctx.x_kind, ctx.n_x = "empty", 0
            return inputs.new_zeros(inputs.shape)
        if rows is None and plan.cache == "mxfp4":
            rows = ops.quantize_mxfp4_rows(inputs, plan.rounding)
            fed_from_rows = False
        else:
            fed_from_rows = rows is not None
        kept_x, kept_z, outs = [], [], []
        for e in range(n):
            weights = list(params[e * per:e * per + plan.n_first + 1])
            biases = list(params[e * per + plan.n_first + 1:(e + 1) * per])
            if fed_from_rows:
                xq, xs = ops.mxfp4_rows_to_fp8(rows[:, e].reshape(tokens, -1))
            else:
                x = inputs[:, e].reshape(tokens, hidden)
                xq, xs = ops.quantize_fp8(x)
                if plan.cache == "fp8":
                    kept_x += [xq, xs]
                elif plan.cache == "bf16":
                    kept_x.append(x.to(torch.bfloat16))
            z, y = _expert_forward(xq, xs, weights, biases, plan)
            kept_z.append(_encode_cache(z, plan.cache, plan.rounding))
            outs.append(y.view(ep, cap, hidden))
        if rows is not None:
            kept_x = [rows]           # the received payload itself, not a copy
        ctx.x_kind = "rows" if rows is not None else plan.cache
        ctx.n_x = len(kept_x)
        ctx.save_for_backward(*kept_x, *kept_z, *params)
        return torch.stack(outs, dim=1).to(inputs.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        plan, (ep, n, cap, hidden) = ctx.plan, ctx.shape
        tokens, per = ep * cap, plan.n_params
        need_x = ctx.needs_input_grad[0]
        if ctx.x_kind == "empty":
            grads = [torch.zeros(s, dtype=d, device=grad_out.device) for d, s in ctx.param_meta]
            return (torch.zeros_like(grad_out, dtype=ctx.dtype) if need_x else None,
                    None, None, *grads)
        saved = ctx.saved_tensors
        kept_x, kept_z = saved[:ctx.n_x], saved[ctx.n_x:ctx.n_x + n]
        params = saved[ctx.n_x + n:]
        x_colwise = _x_colwise_source(ctx.x_kind, kept_x, n, tokens, hidden)
        grad_params, dxs = [], []
        for e in range(n):
            weights = list(params[e * per:e * per + plan.n_first + 1])
            need = {"x"} if need_x else set()
            if any(ctx.needs_input_grad[3 + e * per + i] for i in range(plan.n_first + 1)):
                need.add("w")
            if plan.bias and any(ctx.needs_input_grad[3 + e * per + plan.n_first + 1:
                                                      3 + (e + 1) * per]):
                need.add("b")
            dy = grad_out[:, e].reshape(tokens, hidden).contiguous()
            z = _decode_cache(kept_z[e], plan.cache)
            dx, dws, dbs = _expert_backward(dy, z, lambda e=e: x_colwise(e), weights, plan, need)
            if need_x:
                dxs.append(dx.view(ep, cap, hidden))
            grad_params += _param_grads(dws, dbs, ctx.param_meta[e * per:(e + 1) * per], plan)
        grad_in = torch.stack(dxs, dim=1).to(ctx.dtype) if need_x else None
        return (grad_in, None, None, *grad_params)


def _param_grads(dws, dbs, meta, plan):
    """Gradients in the parameters' dtypes (None where not needed), in parameter order."""
    nw = plan.n_first + 1
    grads = [None] * len(meta)
    for i, g in enumerate(dws or []):
        grads[i] = g.to(meta[i][0])
    for i, g in enumerate(dbs or []):
        grads[nw + i] = g.to(meta[nw + i][0])
    return grads


def _x_colwise_source(kind, kept_x, n, tokens, hidden):
    """A function ``e -> (data [H, P], scales [H, P/128])``: expert e's input, FP8 1x128 along
    tokens, from what forward kept."""
    padded = _padded_tokens(tokens)
    if kind == "rows":
        # All experts in one conversion, on first use: expert-major rows (a view when
        # ep == 1), one ragged segment of ep*C slots per expert (its padding slots included),
        # each padded to a multiple of 128 columns.
        converted = []

        def slice_of(e):
            if not converted:
                (rows,) = kept_x
                rows = rows.transpose(0, 1).reshape(n * tokens, rows.shape[-1])
                offsets = torch.arange(n + 1, dtype=torch.int32, device=rows.device) * tokens
                converted.extend(ops.mxfp4_to_fp8_colwise(*ops.split_mxfp4_rows(rows), offsets))
            data, scales = converted
            return (data[:, e * padded:(e + 1) * padded],
                    scales[:, e * padded // G:(e + 1) * padded // G])
        return slice_of
    if kind == "fp8":
        return lambda e: _colwise_fp8(
            ops.dequantize_fp8(kept_x[2 * e], kept_x[2 * e + 1], torch.bfloat16), padded)
    return lambda e: _colwise_fp8(kept_x[e], padded)


# ---- the module ------------------------------------------------------------------------------


class FP8Experts(Experts):
    """DeepSpeed ``Experts`` whose ``SwiGLUExpert``s run with FP8 GEMMs (see module docstring).

    Build it from an existing ``Experts`` with ``FP8Experts.from_experts`` (the very same
    parameter objects and names), or like ``Experts``.

    Arguments:
        expert: a ``SwiGLUExpert`` (copied ``num_local_experts`` times, as ``Experts`` does).
        num_local_experts, expert_group_name: as for ``Experts``.
        cache: how the SwiGLU input z (and the expert input, when it does not arrive as
            MXFP4 rows) is kept for backward: ``"mxfp4"`` (default), ``"fp8"`` or ``"bf16"``.
        scale_rounding: MXFP4 scale rule (``"rceil"``/``"floor"``) for what it quantizes.
    """

    def __init__(self, expert, num_local_experts=1, expert_group_name=None, cache="mxfp4",
                 scale_rounding="rceil"):
        super().__init__(expert, num_local_experts, expert_group_name)
        self._configure(cache, scale_rounding)

    @classmethod
    def from_experts(cls, experts, cache="mxfp4", scale_rounding="rceil"):
        """An ``FP8Experts`` over the same expert modules (same parameters, same state_dict keys).

        Arguments:
            experts: a ``deepspeed.moe.experts.Experts`` whose experts are ``SwiGLUExpert``s.
            cache, scale_rounding: as for the constructor.
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
        new._configure(cache, scale_rounding)
        return new

    def _configure(self, cache, scale_rounding):
        if cache not in CACHE_FORMATS:
            raise ValueError(f"cache must be one of {CACHE_FORMATS}; got {cache!r}")
        if scale_rounding not in formats.MX_ROUNDINGS:
            raise ValueError(f"scale_rounding must be one of {formats.MX_ROUNDINGS}; got "
                             f"{scale_rounding!r}")
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
        self.plan = _Plan(first.activation, key[3], cache, scale_rounding,
                          self.num_local_experts, first.hidden, first.ffn)

    def forward(self, inputs):
        """``inputs [ep, n_local, C, hidden]`` -> ``[ep, n_local, C, hidden]`` in its dtype.

        If ``inputs`` carries ``ds_fp4_rows`` (uint8 ``[ep, n_local, C, hidden/2 +
        hidden/32]``, packed MXFP4 rows), only those rows are read (``inputs`` may be a
        stride-0 placeholder) and they, not a copy, are kept for backward; the gradient for
        ``inputs`` is dense, of its shape and dtype.
        """
        rows = getattr(inputs, "ds_fp4_rows", None)
        self._check_inputs(inputs, rows)
        params = [p for ex in self.deepspeed_experts for p in _expert_params(ex)]
        return _FP8ExpertsFunction.apply(inputs, rows, self.plan, *params)

    def _check_inputs(self, inputs, rows):
        if not isinstance(inputs, torch.Tensor) or inputs.dim() != 4:
            raise ValueError(f"inputs must be a 4-D tensor [ep, n_local, C, hidden]; got "
                             f"{getattr(inputs, 'shape', type(inputs).__name__)}")
        if inputs.dtype not in formats.FLOAT_INPUT_DTYPES:
            raise TypeError(f"inputs must be bfloat16, float16 or float32; got {inputs.dtype}")
        want = (self.num_local_experts, self.plan.hidden)
        if (inputs.shape[1], inputs.shape[3]) != want:
            raise ValueError(f"inputs [ep, n_local, C, hidden] must have n_local, hidden = "
                             f"{want}; got {tuple(inputs.shape)}")
        if rows is None:
            return
        row_shape = (*inputs.shape[:3], formats.mxfp4_row_bytes(self.plan.hidden))
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 \
                or tuple(rows.shape) != row_shape:
            raise ValueError(
                f"inputs.ds_fp4_rows must be uint8 {row_shape} (packed MXFP4 rows); got "
                f"{getattr(rows, 'dtype', None)} {tuple(getattr(rows, 'shape', ()))}")
        if rows.device != inputs.device:
            raise ValueError(f"inputs.ds_fp4_rows is on {rows.device}, inputs on {inputs.device}")
