"""FP4MoE: DeepSpeed's MoE layer with MXFP4 dispatch, FP8 gradients and an MXFP4 input cache.

``FP4MoE`` is a ``deepspeed.moe.layer.MoE`` (same constructor, outputs, parameter names and
state_dict keys) whose inner ``MOELayer`` is an ``FP4MOELayer``: DeepSpeed 0.19.x's forward
with the two ``_AllToAll.apply`` calls replaced by ``wire_all_to_all`` (formats from the
``fp4_moe`` config) and the experts run under the activation cache. Existing layers are
converted in place by swapping their classes (``to_fp4``), which keeps every parameter
object, so optimizers, ZeRO and MoE checkpoints see DeepSpeed's own layer.
"""

import contextlib
import logging

import torch
from deepspeed.moe.experts import Experts
from deepspeed.moe.layer import MoE
from deepspeed.moe.sharded_moe import (FIRST_ALLTOALL_TIMER, MOE_TIMER, SECOND_ALLTOALL_TIMER,
                                       MOELayer)
from deepspeed.utils import groups
from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

from ds_fp4 import formats as F
from ds_fp4.config import Format, FP4MoEConfig
from ds_fp4.moe.alltoall import A2AHandle, kernel_scope, wire_all_to_all, wire_plans
from ds_fp4.moe import bf16_start, exactness, fp8_experts, gate_linear
from ds_fp4.moe.cache import (ExpertInputCache, GateInputCopy, kept_format,
                             others_hooks_active, route_output_format)
from ds_fp4.moe.expert import SwiGLUExpert
from ds_fp4.moe.gate_graphs import GateGraphs
from ds_fp4.moe.gate_scan import RowScanCumsum

try:  # the sparse dispatch helpers of DeepSpeed >= 0.19.4, whose forward FP4MOELayer follows
    from deepspeed.moe.sharded_moe import _route_slots  # noqa: F401  (ops.encode_routes' twin)
except ImportError as err:  # pragma: no cover - depends on the installed DeepSpeed
    raise ImportError("ds_fp4.moe needs deepspeed>=0.19.4,<0.20 (MOELayer with sparse routes); "
                      f"upgrade with `pip install 'deepspeed>=0.19.4,<0.20'` ({err})") from err

from ds_fp4.moe import routing  # noqa: E402  (needs the helpers checked just above)

logger = logging.getLogger(__name__)


# ---- construction-time checks ---------------------------------------------------------

def _formats_in_use(cfg: FP4MoEConfig, ep_size: int):
    """``{option name: Format}`` of the formats a layer of this ep_size will apply."""
    used = {"cache": cfg.cache}
    if ep_size > 1:  # with one rank nothing is sent, so no wire format applies
        used.update(dispatch=cfg.dispatch, combine=cfg.combine, grad=cfg.grad)
    return used


def check_hidden(cfg: FP4MoEConfig, hidden: int, ep_size: int) -> None:
    """Raise ValueError when ``hidden`` cannot be packed in a format the config uses.

    MXFP4 needs ``hidden % 32 == 0`` (one scale per 32 elements), FP8 1x128 ``% 128``. The
    message names every offending option and both ways out.
    """
    if not cfg.enabled:
        return
    unit = {Format.MXFP4: F.MX_BLOCK, Format.FP8: F.FP8_GROUP}
    bad = [(option, fmt, unit[fmt]) for option, fmt in _formats_in_use(cfg, ep_size).items()
           if fmt in unit and hidden % unit[fmt]]
    if bad:
        need = max(u for _, _, u in bad)
        what = ", ".join(f"fp4_moe.{o} = '{f}' needs a multiple of {u}" for o, f, u in bad)
        options = " and ".join(f"fp4_moe.{o}" for o, _, _ in bad)
        raise ValueError(
            f"FP4MoE: hidden_size {hidden} cannot be packed: {what} ({F.MX_BLOCK} elements "
            f"share an MXFP4 scale, {F.FP8_GROUP} an FP8 scale). Use a hidden size that is a "
            f"multiple of {need} (e.g. {-(-hidden // need) * need}), or set {options} to 'bf16'.")


def _fp8_size_problem(experts) -> str:
    """Why SwiGLU experts of these sizes cannot run FP8 GEMMs, or '' when they can.

    FP8 expert GEMMs use 128x128 weight tiles, so hidden and ffn must be multiples of 128.
    Checked here, when the layer is built, rather than by FP8Experts at the first forward.
    """
    named = {(name, size) for e in experts.deepspeed_experts
             for name, size in (("hidden", e.hidden), ("ffn", e.ffn)) if size % F.FP8_GROUP}
    if not named:
        return ""
    bad = sorted(f"{name} = {size}" for name, size in named)
    fixes = sorted({f"{size} -> {-(-size // F.FP8_GROUP) * F.FP8_GROUP}" for _, size in named})
    return (f"the SwiGLU experts' {', '.join(bad)} must be multiples of {F.FP8_GROUP} (FP8 "
            f"expert GEMMs use {F.FP8_GROUP}x{F.FP8_GROUP} weight tiles; e.g. "
            f"{', '.join(fixes)})")


def _fp8_experts_problem(experts, cfg: FP4MoEConfig, device):
    """``(why FP8 experts are not used here or '', warn)``.

    ``fp8_experts: true`` needs SwiGLUExpert experts (on GPUs without FP8 GEMMs FP8Experts
    still runs, through dequantized operands) and raises otherwise; ``auto`` also needs
    ``fp8_experts_supported(device)``. ``device`` None skips that. Both need hidden and ffn
    to be multiples of 128 (``_fp8_size_problem``). ``warn``: the reason is worth a warning
    under ``auto`` (sizes that keep a device able to run FP8 experts off them); the other
    reasons are what ``auto`` is for.
    """
    required = cfg.fp8_experts is True
    warn = False
    if isinstance(experts, fp8_experts.FP8Experts):
        why = ""
    elif not all(isinstance(e, SwiGLUExpert) for e in experts.deepspeed_experts):
        why = "the experts are not ds_fp4.moe.expert.SwiGLUExpert modules"
    elif not required and device is not None and not fp8_experts.fp8_experts_supported(device):
        why = f"FP8 expert GEMMs are not supported on {device}"
    else:
        why = _fp8_size_problem(experts)
        warn = bool(why)
    if why and required:
        raise ValueError(f"fp4_moe.fp8_experts = true but {why}; set it to \"auto\" or false")
    return why, warn


def _check(moe: MoE, cfg: FP4MoEConfig) -> int:
    """Raise ValueError, before any change, when ``moe`` cannot run with ``cfg``; returns
    the layer's hidden size."""
    inner = moe.deepspeed_moe
    hidden = inner.gate.wg.weight.shape[1]
    check_hidden(cfg, hidden, inner.ep_size)
    if inner.use_tutel and cfg.enabled:
        raise ValueError("FP4MoE does not support use_tutel=True; build the layer with "
                         "use_tutel=False or set fp4_moe.enabled to false")
    if cfg.enabled and cfg.fp8_experts is True:
        _fp8_experts_problem(inner.experts, cfg, None)
    return hidden


# ---- the inner layer ------------------------------------------------------------------

def _row_scan_for(tokens):
    """Whether the gate's slot counting runs as a row scan: on CUDA, where torch's
    outer-dimension scan of the gate's mask was measured slow (gate_scan.py)."""
    return tokens.is_cuda


class FP4MOELayer(MOELayer):
    """DeepSpeed's ``MOELayer`` with wire-format all-to-alls and the expert-input cache.

    Built by ``to_fp4`` from an existing ``MOELayer`` (class swap), never directly.
    Attributes set there: ``fp4_config`` (``FP4MoEConfig``), ``hidden_size``,
    ``last_handles`` (the ``A2AHandle`` of the latest dispatch and combine, for bytes),
    ``fp4_exactness`` (an ``exactness.ExactnessCounter`` with ``monitor_exactness`` on,
    else None) and, after each forward, ``cached_views`` (saved views of the experts' input
    that the cache took over: one per local expert for a Linear-first expert; 0 means no
    saving).
    With ``fp4_config.enabled`` false, or during ``bf16_start_steps``, ``forward`` is
    DeepSpeed's own.
    """

    def fp4_setup(self, cfg: FP4MoEConfig, hidden: int) -> None:
        """(Re)configure with a config that ``_check`` accepted for this layer."""
        self.fp4_config = cfg
        self.hidden_size = hidden
        self._plans = wire_plans(cfg)
        self._fp8_on = None  # decided on the first forward, when the device is known
        self._plain_experts()
        self.last_handles = (None, None)
        self.cached_views = 0
        self.fp4_exactness = exactness.ExactnessCounter() \
            if cfg.enabled and cfg.monitor_exactness else None
        # DeepSpeed's gating function replayed from CUDA graphs (gate_graphs.py): its host
        # time at any size, a few MB a layer
        self.gate_graphs = GateGraphs() if cfg.enabled and cfg.expert_graphs is not False \
            else None

    # -- FP8 experts (issue 5) -------------------------------------------------------------

    def _plain_experts(self):
        """Undo an earlier FP8Experts swap (same expert modules) so a new config decides."""
        if isinstance(self.experts, fp8_experts.FP8Experts):
            plain = Experts.__new__(Experts)
            torch.nn.Module.__init__(plain)
            plain.deepspeed_experts = self.experts.deepspeed_experts
            plain.num_local_experts = self.experts.num_local_experts
            plain.train(self.experts.training)
            self.experts = plain

    def _resolve_fp8_experts(self, device) -> bool:
        cfg = self.fp4_config
        if self._fp8_on is None:
            self._fp8_on = False
            if cfg.fp8_experts is not False:
                why, warn = _fp8_experts_problem(self.experts, cfg, device)
                if why:
                    (logger.warning if warn else logger.info)(
                        "FP4MoE: fp4_moe.fp8_experts = \"auto\" keeps DeepSpeed's bf16 experts "
                        "here: %s", why)
                if not why:
                    if not isinstance(self.experts, fp8_experts.FP8Experts):
                        self.experts = fp8_experts.FP8Experts.from_experts(
                            self.experts, cache=cfg.cache, scale_rounding=cfg.scale_rounding,
                            graphs=cfg.expert_graphs, kernels=cfg.kernels,
                            activation_cache=cfg.z_cache, weight_cache=cfg.fp8_weight_cache)
                    # the decode's (or the combine's) backward makes the experts' output
                    # gradient fresh: it may take their input's
                    self.experts.donate_grad = True
                    self._fp8_on = True
        return self._fp8_on

    # -- forward ---------------------------------------------------------------------------

    def forward(self, *input, **kwargs):
        cfg = self.fp4_config
        if not cfg.enabled:
            return super().forward(*input, **kwargs)
        if bf16_start.in_bf16_start(self):
            # DeepSpeed's experts too, also after a rollback to a checkpoint before the step
            self._plain_experts()
            self._fp8_on = None
            return super().forward(*input, **kwargs)
        if bwc_tensor_model_parallel_world_size(groups.mpu) > 1:
            raise NotImplementedError(
                "FP4MoE does not support tensor-parallel models (groups.mpu with tensor "
                "parallel size > 1) yet; set fp4_moe.enabled to false for this model")
        self._timer_start(MOE_TIMER)
        x = input[0]
        m = x.shape[-1]
        tokens = x.reshape(-1, m)
        used_token = input[1] if len(input) > 1 else None
        self.l_aux, cap, n_exp, indices, locations, gates, self.exp_counts = self._gate(
            tokens, used_token)
        cap = int(cap)  # one host sync, as DeepSpeed does

        fp8 = self._resolve_fp8_experts(x.device)
        if fp8:  # here, outside any graph capture: the counters exist before a capture
            exactness.attach(self.experts, self.fp4_exactness, x.device)
        # The slots' rows read from the tokens through the slots' source map, where their
        # only reader can (the dispatch's packing, EP 1's FP8 experts): the [E, C, M] slot
        # buffer is never made
        gather = None
        if self._reads_gathered(fp8, cap, m, x.device):
            dispatched, slots, used, source = routing.encode_gathered(
                tokens, indices, locations, n_exp, cap)
            gather = routing.GatheredSlots(tokens.detach(), source)
        else:
            dispatched, slots, used = routing.encode(tokens, indices, locations, n_exp, cap)
        self._timer_start(FIRST_ALLTOALL_TIMER)
        expert_in, dispatch, cache = self._dispatch(dispatched, fp8, gather)
        self.time_falltoall = self._timer_stop(FIRST_ALLTOALL_TIMER, self.time_falltoall)

        # at EP 1 the experts skip each one's capacity padding (zero rows, outputs unread)
        used = used if fp8 and self.ep_size == 1 else None
        expert_out = self._run_experts(expert_in, dispatch, cache, used,
                                       gather if self.ep_size == 1 else None)
        if gather is not None:   # read: what the backward keeps of it is the source map
            gather.tokens = None

        # Where the slots' gradient's only reader can read dy's rows times the slots' gates
        # through the source map (EP 1's gathered experts, the combine's FP8 gradient wire),
        # the decode's backward hands those over instead of making it
        back = gather if gates.dtype == torch.float32 and (
            self.ep_size == 1 or self._plans[1].backward == Format.FP8) else None
        self._timer_start(SECOND_ALLTOALL_TIMER)
        combined, combine = self._combine(expert_out.reshape(n_exp, cap, m), back)
        self.time_salltoall = self._timer_stop(SECOND_ALLTOALL_TIMER, self.time_salltoall)
        self.last_handles = (dispatch, combine)

        # the routes' outputs the decode keeps for the gates' gradient: FP8 rows
        fp8_routes = route_output_format(cfg.z_cache, m) == Format.FP8
        with kernel_scope(self._plans[0].kernels):
            out = routing.decode(combined.view(n_exp * cap, m), slots, gates, tokens.size(0),
                                 fp8_routes, back)
        self.time_moe = self._timer_stop(MOE_TIMER, self.time_moe)
        return out.reshape(x.shape)

    def _gate(self, tokens, used_token):
        """DeepSpeed's gate (sparse routes), its slot counting as a row scan on CUDA
        (``RowScanCumsum``: the same integers; torch's CPU scan is not the slow one) and its
        gating function replayed from CUDA graphs where it can be (``gate_graphs``), keeping
        its float32 copy of a bf16/fp16 input as the input (``GateInputCopy``). On CUDA
        with a bf16 input its float32 Linear runs as split bf16 GEMMs (``gate_linear``)."""
        # Someone else's saved-tensor hooks (torch.utils.checkpoint's non-reentrant
        # recompute, which matches the tensors a forward saves; offloading) must see the
        # gate's tensors, which a replayed gate keeps inside its graph: eager then.
        graphs = None if others_hooks_active() else self.gate_graphs
        with RowScanCumsum(graphs) if _row_scan_for(tokens) else contextlib.nullcontext():
            if gate_linear.applies(self.gate, tokens):
                return gate_linear.gate(self.gate, tokens, used_token)
            if tokens.dtype not in (torch.bfloat16, torch.float16) or not torch.is_grad_enabled():
                return self.gate(tokens, used_token, True, False)
            copy = GateInputCopy(tokens)
            with copy.hooks():
                return self.gate(copy.upcast, used_token, True, False)

    def _cache_format(self, dtype):
        return kept_format(self.fp4_config.cache, dtype)

    def _reads_gathered(self, fp8, cap, m, device):
        """Whether the slots' rows go to their reader through the source map: the
        dispatch's packing on an MXFP4 or FP8 wire (EP > 1), FP8 experts that take it
        (EP 1, ``FP8Experts.reads_gathered``)."""
        if self.ep_size > 1:
            return self.fp4_config.dispatch != Format.BF16
        return fp8 and self.experts.reads_gathered((1, self.num_local_experts, cap, m), device)

    def _dispatch(self, x, fp8: bool, gather=None):
        """``x [E, C, M]`` -> ``(experts' input [ep, n_local, C, M], handle, cache)``; the
        handle holds the received MXFP4 rows for FP8 experts (``hand_off``) until they
        take them. ``gather``: None, or the ``routing.GatheredSlots`` when x is
        ``encode_gathered``'s placeholder."""
        e, c, m = x.shape
        ep, n_local = self.ep_size, self.num_local_experts
        cfg, plan = self.fp4_config, self._plans[0]
        # The layout follows the config only (not grad mode), so that a no-grad forward
        # (DeepSpeed's reentrant checkpointing) computes exactly what its replay does.
        cache_fmt = None if fp8 else self._cache_format(x.dtype)
        keep = cache_fmt is not None and torch.is_grad_enabled()
        if ep == 1:
            if gather is None:   # (a placeholder stays one: contiguous() would fill it)
                x = x.contiguous()  # [1, n_local, C, M]: each expert's chunk is contiguous
            cache = ExpertInputCache(x, cache_fmt, plan.rounding, kernels=plan.kernels) \
                if keep else None
            return x.view(ep, n_local, c, m), None, cache
        handle = A2AHandle(plan, self.ep_group, ep, n_local,
                           expert_major=cache_fmt is not None,
                           hand_off=fp8 and cfg.dispatch == Format.MXFP4,
                           keep_rows=keep and cache_fmt == cfg.dispatch, gather=gather)
        y = wire_all_to_all(x, handle)
        if handle.hand_off:  # y is a placeholder: the experts read the rows
            return y, handle, None
        if cache_fmt is None:
            return y.view(ep, n_local, c, m), handle, None
        base = y.transpose(0, 1)  # the contiguous expert-major buffer behind y
        cache = ExpertInputCache(base, cache_fmt, plan.rounding, rows=handle.take_rows(),
                                 kernels=plan.kernels) if keep else None
        return y, handle, cache

    def _run_experts(self, expert_in, dispatch, cache, used=None, gather=None):
        if cache is not None:
            with cache.hooks():
                out = self.experts(expert_in)
        elif dispatch is not None and dispatch.hand_off:
            out = self.experts(expert_in, dispatch.take_rows())  # FP8Experts keep them
        elif used is not None or gather is not None:
            out = self.experts(expert_in, used=used, gather=gather)
        else:
            out = self.experts(expert_in)
        self.cached_views = 0 if cache is None else cache.packed_views
        return out

    def _combine(self, x, grad_gather=None):
        """Experts' outputs ``x [E, C, M]`` -> ``([E, C, M] at the tokens' ranks, handle)``;
        ``grad_gather``: the decode's ``GatheredSlots`` (the backward packs from it)."""
        if self.ep_size == 1:
            return x.contiguous(), None
        handle = A2AHandle(self._plans[1], self.ep_group, self.ep_size, self.num_local_experts,
                           grad_gather=grad_gather)
        return wire_all_to_all(x, handle), handle

    # -- DeepSpeed's timers (wall_clock_breakdown) ---------------------------------------

    def _timer_start(self, name):
        if self.wall_clock_breakdown:
            self.timers(name).start()

    def _timer_stop(self, name, previous):
        if not self.wall_clock_breakdown:
            return previous
        self.timers(name).stop()
        return self.timers(name).elapsed(reset=False)


# ---- the outer layer ------------------------------------------------------------------

class FP4MoE(MoE):
    """``deepspeed.moe.layer.MoE`` with FP4 all-to-alls: the same arguments plus ``fp4_config``.

    Arguments:
        *args, **kwargs: those of ``deepspeed.moe.layer.MoE`` (hidden_size, expert,
            num_experts, ep_size, k, capacity_factor, ..., drop_tokens, use_rts, ...).
        fp4_config: the ``fp4_moe`` section (dict, ``FP4MoEConfig``, a whole ds_config or
            its path). None: the defaults (the paper's recipe) until ``ds_fp4.initialize``,
            ``configure`` or ``convert`` apply a ds_config's section; an explicit config is
            kept by those.

    ``forward(hidden_states, used_token=None)`` returns ``(output, l_aux, exp_counts)``.
    Raises ValueError at construction when hidden_size cannot be packed in a format the
    config uses (MXFP4: multiple of 32; FP8: of 128).
    """

    def __init__(self, *args, fp4_config=None, **kwargs):
        super().__init__(*args, **kwargs)
        to_fp4(self, fp4_config, explicit=fp4_config is not None)

    @property
    def fp4_config(self) -> FP4MoEConfig:
        return self.deepspeed_moe.fp4_config


_MIXED = {}


def _fp4_class(cls, base, fp4_cls):
    """``fp4_cls`` for ``base`` itself; for a user subclass of ``base``, a class deriving
    from both (so the user's overrides stay), made once per subclass."""
    if issubclass(cls, fp4_cls):
        return cls
    if cls is base:
        return fp4_cls
    if cls not in _MIXED:
        _MIXED[cls] = type(f"FP4{cls.__name__}", (fp4_cls, cls), {"__module__": cls.__module__})
    return _MIXED[cls]


def to_fp4(moe: MoE, config=None, explicit: bool = True) -> MoE:
    """Turn a ``deepspeed.moe.layer.MoE`` into an ``FP4MoE`` in place (weights kept).

    Arguments:
        moe: a DeepSpeed MoE layer (or an FP4MoE, which is reconfigured).
        config: anything ``FP4MoEConfig.from_ds_config`` takes; None: defaults.
        explicit: remember the config as given by the user (``convert`` will not replace it).
    Returns:
        ``moe`` itself, now an ``FP4MoE``.
    Raises:
        ValueError naming the key, before any change, when the layer cannot run the config.
    """
    if not isinstance(moe, MoE):
        raise TypeError(f"to_fp4 expects a deepspeed.moe.layer.MoE; got {type(moe).__name__}")
    convert_layers([moe], FP4MoEConfig.from_ds_config(config), explicit)
    return moe


def convert_layers(layers, cfg: FP4MoEConfig, explicit: bool = False) -> None:
    """``to_fp4`` of every layer with one validated config: all are checked first, so that
    all are converted or none."""
    hiddens = [_check(moe, cfg) for moe in layers]
    for moe, hidden in zip(layers, hiddens):
        inner = moe.deepspeed_moe
        inner.__class__ = _fp4_class(type(inner), MOELayer, FP4MOELayer)
        inner.fp4_setup(cfg, hidden)
        moe.__class__ = _fp4_class(type(moe), MoE, FP4MoE)
        moe._fp4_explicit = explicit
