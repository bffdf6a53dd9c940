"""The FP8 experts' forward and backward passes, as pure functions of tensors.

What ``ds_fp4.moe.fp8_experts.FP8Experts`` runs (and what its CUDA graphs capture): all
local experts at once, ``[ep, n_local, C, H]`` in and out. Per local expert e (T = ep * C
token slots, padding slots included):

forward:   x (MXFP4 rows -> ``mxfp4_rows_to_fp8``, or bf16 -> FP8; 1x128)
           z = x @ [gate; up]^T          FP8 GEMM 1x128 x 128x128 -> bf16
           h = silu(z_gate) * z_up       (or gelu(z)) -> FP8 1x128 (float32 math, h rounded
                                         to bf16 first)
           y = h @ down^T                FP8 GEMM 1x128 x 128x128 -> bf16
kept:      the MXFP4 rows as received (no copy; bf16 input: x in the cache format) and z in
           the activation cache format (default: the cache's, MXFP4); weights are
           re-quantized in backward
backward:  dh = dy @ down, dx = dz @ [gate; up]        FP8 dgrad GEMMs (1x128 x 128x128)
           d down = dy^T h, d[gate; up] = dz^T x      FP8 wgrad GEMMs, both operands 1x128
                                                      along tokens; x^T from
                                                      ``mxfp4_to_fp8_colwise``
Every step runs once for all local experts, in expert-major layouts: the quantizations
(``ds_fp4.ops.fp8_tiles``: all weights' tiles in one launch; ``ds_fp4.ops.fp8_segments``:
dy, dz and h quantized along features and along tokens from one read, SwiGLU and its
gradient computed on the way in)
and each GEMM kind, as one grouped FP8 GEMM launch (``ds_fp4.ops.grouped_gemm``) or,
for experts of at least ``LOOP_MACS`` multiply-adds a GEMM, one cuBLASLt call per expert
(``ds_fp4.moe.fp8_gemm_loop``), whichever measured faster on an H200.
"""

import dataclasses
import math
from typing import Optional

import torch
from torch.nn import functional as F

from ds_fp4 import formats
from ds_fp4 import ops
from ds_fp4.config import Format, Kernels, ScaleRounding
from ds_fp4.moe import weight_cache
from ds_fp4.moe.compiled import fused
from ds_fp4.moe.fp8_gemm_loop import gemm_fp8_nt_many, native_blockwise_supported
from ds_fp4.ops import fp8_segments
from ds_fp4.ops.grouped_gemm import k_grouped_fixed_unchecked, m_grouped_fixed_unchecked

G = formats.FP8_GROUP
# Expert size (rows x hidden x ffn, multiply-adds of one GEMM of one expert) from which the
# GEMMs run per expert through cuBLASLt instead of as one grouped Triton launch per kind
# (DS_FP4_EXPERT_GEMMS=auto): cuBLASLt's kernels are faster on large GEMMs, where the ~45 us
# of host time per call hides behind them. Measured in one run on an H200 at hidden 7168,
# ffn 2048 (bench/results/grouped_experts_h200): grouped faster at 640 rows (layer 18.75 vs
# 22.39 ms) and 1280 (11.54 vs 13.77), the loop at 2560 (21.86 vs 26.42) and 4096 (experts
# alone 10.48 vs 13.68 ms): 2048 rows of that expert. Small experts with many rows stay
# grouped: at hidden 512, ffn 512 and 5120 rows the loop's 48 calls a step cost the layer
# more host time than its GPU time (bench/results/loop_rule_h200).
LOOP_ROWS = 2048
LOOP_MACS = LOOP_ROWS * 7168 * 2048


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the passes need to know besides the tensors."""
    activation: str          # "swiglu" | "gelu"
    bias: bool
    cache: Format            # how x (without rows) and, by default, z are kept for backward
    rounding: ScaleRounding  # MXFP4 scale rule for what this module quantizes itself
    n_local: int
    hidden: int
    ffn: int
    gemms: str = "auto"      # DS_FP4_EXPERT_GEMMS when the module was configured
    kernels: Optional[Kernels] = None   # ops.kernels mode of both passes; None: the process's
    # the owning layer's exactness counters (ds_fp4.moe.exactness), passed to the MXFP4 ->
    # FP8 conversions; not part of the plan's identity (it keys captured graphs, which bake
    # in the counters' address: set once, before the first forward, and zeroed in place)
    counts: object = dataclasses.field(default=None, compare=False, repr=False)
    z_cache: Optional[Format] = None    # how z is kept, when not as ``cache``
    # the owning module's ``weight_cache.TileCache`` (``fp4_moe.fp8_weight_cache``) or None:
    # not part of the plan's identity either
    tiles: object = dataclasses.field(default=None, compare=False, repr=False)

    def tile_quant(self, weights, per_group, transpose=False):
        """The weights' FP8 tiles: made now, or held by the module's tile cache."""
        return weight_cache.tile_quant(self.tiles, weights, per_group, transpose)

    @property
    def z_format(self) -> Format:
        return self.z_cache or self.cache

    @property
    def n_first(self):       # first-layer weights per expert: gate, up (or up)
        return 2 if self.activation == "swiglu" else 1

    @property
    def n_params(self):
        return (self.n_first + 1) * (2 if self.bias else 1)


# ---- pieces of the math ----------------------------------------------------------------


def _gelu(z):
    return F.gelu(z.float()).to(torch.bfloat16)


def _gelu_grad(z, dh):
    z = z.float()
    cdf = 0.5 * (1 + torch.erf(z * math.sqrt(0.5)))
    pdf = torch.exp(-0.5 * z * z) * (1 / math.sqrt(2 * math.pi))
    return (dh.float() * (cdf + z * pdf)).to(torch.bfloat16)


_ACT = {"swiglu": (fp8_segments.swiglu_ref, fp8_segments.swiglu_grad_ref),
        "gelu": (_gelu, _gelu_grad)}
def _act(z, activation):
    """bf16 ``z [T, 2F]`` (gate | up) or ``[T, F]`` -> bf16 ``h [T, F]``, float32 math."""
    return fused(_ACT[activation][0], z)


def _act_grad(z, dh, activation):
    """``dh * d act / d z`` in float32, returned as bf16 ``[T, 2F]`` (or ``[T, F]``)."""
    return fused(_ACT[activation][1], z, dh)


def _padded_tokens(t):
    return -(-t // G) * G


def _encode_cache(z, cache, rounding, index=None):
    """``z`` in the cache format; with ``index`` (MXFP4 or FP8 only), the rows of z that it
    names, a zero row outside (``quantize_*_rows``' ``index``). A bf16 cache is z itself."""
    if cache == "mxfp4":
        return ops.quantize_mxfp4_rows(z, rounding, index=index)
    if cache == "fp8":
        return ops.quantize_fp8_rows(z, index=index)
    return z


def _keep_z(z, fmt, rounding):
    """``(z's copy for backward, the z the forward computes h from)``.

    A copy in FP8 is also what the forward reads, so that h, and the backward's act'(z) and h
    (the down weights' gradient operand), come from one z: the gradient is then that of the
    forward that ran. Over 15 seeds x 3000 steps on one H200 (bench/results/
    converge_h200_1gpu_5seeds_3000steps), fp4 with z kept in FP8 moved the held-out loss
    +0.73% from bf16's when the forward read bf16 z and +0.00% +- 0.42% when it read the
    copy; the fp8 recipe +0.55% and +0.46% +- 0.28% (a gain not resolved). An MXFP4 copy is
    not read: on one layer against float32 it tripled the output's error (0.070 -> 0.185,
    tools/grad_numerics.py; FP8: 0.070 -> 0.080), and fed to the forward in training it put
    fp4's held-out loss +1.51% +- 0.40% above the defaults'.
    """
    kept = _encode_cache(z, fmt, rounding)
    if fmt != Format.FP8:
        return kept, z
    return kept, _dense_z(kept, fmt, z.shape[-1])


def _dense_z(kept_z, cache, width):
    """The cached SwiGLU/GELU input as bf16 ``[n*T, width]`` (width: 2F or F)."""
    if cache == "mxfp4":
        return ops.dequantize_mxfp4_rows(kept_z, torch.bfloat16, width)
    if cache == "fp8":
        return ops.dequantize_fp8_rows(kept_z, torch.bfloat16, width)
    return kept_z


# ---- layouts: all local experts at once, expert-major ------------------------------------


def _expert_major(t, n, tokens):
    """``[ep, n, C, X]`` -> ``[n * ep*C, X]``, expert e's ep*C slots contiguous (a view when
    ep == 1), with unit stride along X."""
    t = t.transpose(0, 1).reshape(n * tokens, t.shape[-1])
    return t if t.stride(-1) == 1 and t.stride(0) >= t.shape[-1] else t.contiguous()


def _slab_cols(q):
    """``segment_quant``'s ``col`` output as K-grouped operands: data ``[n, K, P]`` and
    scales ``[n, K, P/128]`` (a view of the stored ``[n, P/128, K]``)."""
    data, scales = q
    return data, scales.transpose(1, 2)


def _to_slots(y, shape):
    """Expert-major ``[n * ep*C, H]`` -> ``[ep, n, C, H]`` (a view when ep == 1)."""
    ep, n, cap, hidden = shape
    if ep == 1:
        return y.view(shape)
    return y.view(n, ep, cap, hidden).transpose(0, 1).contiguous()


def donated_grad(grad, dtype, donate):
    """``grad`` when the input's gradient may be written into it, else None.

    The data-gradient GEMM's output has the shape of the output's gradient: written there,
    the pass needs one ``[rows, hidden]`` buffer less at its memory peak (the last weight
    gradient, with every weight gradient live), where autograd would otherwise hold both.
    Only when the caller donates it (``donate``: a layer whose next op's backward makes the
    gradient fresh for this pass alone: a gather or an all-to-all receive, never shared with
    another branch of the graph), outside double backward, and when it is bf16 (what the
    GEMM writes), the input's ``dtype``, contiguous and the whole of its storage."""
    if not donate or torch.is_grad_enabled() or grad.requires_grad:
        return None
    if grad.dtype != torch.bfloat16 or dtype != torch.bfloat16 or not grad.is_contiguous():
        return None
    if grad.untyped_storage().nbytes() != grad.numel() * grad.element_size():
        return None
    return grad


def _grad_dtype(dtype):
    """The weight gradients' dtype from the GEMM: the parameters' own when it can write it."""
    return dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32


# ---- the GEMMs: one grouped launch per kind, or one cuBLASLt call per expert ---------------


def _per_expert(t, rows, plan):
    """Whether a pass with ``rows`` rows (tokens) per expert takes the cuBLASLt loop."""
    if plan.gemms == "grouped":
        return False
    if plan.gemms != "loop" and rows * plan.hidden * plan.ffn < LOOP_MACS:
        return False   # decided by size, before the device query (~11 us a call)
    return native_blockwise_supported(t.device)


def _m_gemm(a, a_scales, w, w_scales, tokens, plan, out=None, used=None):
    """``a [n*T, K] @ w[e]^T`` per expert's T rows -> bf16 ``[n*T, N]`` (into ``out``, a
    contiguous bf16 ``[n*T, N]``, when given); ``a_scales`` ``[n*T, K/128]`` or
    ``[n, K/128, T]`` (see ``m_grouped_gemm_fp8_nt``). ``used``: None, or int ``[n]``: expert
    e's rows from ``used[e]`` on are zeros (the grouped kernel skips them)."""
    if not _per_expert(a, tokens, plan):
        return m_grouped_fixed_unchecked(a, a_scales, w, w_scales, tokens, out, used)
    n = w.shape[0]
    if a_scales.dim() == 2:   # one copy into [n, K/128, T]: each expert's scales (1, T)-strided
        a_scales = a_scales.t().reshape(-1, n, tokens).transpose(0, 1).contiguous()
    if out is None:
        out = torch.empty(a.shape[0], w.shape[1], dtype=torch.bfloat16, device=a.device)
    gemm_fp8_nt_many(list(a.view(n, tokens, -1).unbind(0)), [s.t() for s in a_scales.unbind(0)],
                     list(w.unbind(0)), list(w_scales.unbind(0)),
                     out=list(out.view(n, tokens, -1).unbind(0)))
    return out


def _k_gemm(a, a_scales, b, b_scales, cols, dtype, plan, used=None):
    """Weight gradients ``[n, M, N]``: ``a`` slabs ``[n, M, P]``, ``b`` slabs or side by
    side ``[N, n*P]``, contracted over each expert's P = ``cols`` token columns (``used``:
    as for ``_m_gemm``, along the columns)."""
    if not _per_expert(a, cols, plan):
        return k_grouped_fixed_unchecked(a, a_scales, b, b_scales, cols, dtype, used)
    n = a.shape[0]
    if b.dim() == 2:
        b = [b[:, e * cols:(e + 1) * cols] for e in range(n)]
        b_scales = [b_scales[:, e * cols // G:(e + 1) * cols // G] for e in range(n)]
    out = torch.empty(n, a.shape[1], b[0].shape[0], dtype=dtype, device=a.device)
    gemm_fp8_nt_many(list(a.unbind(0)), list(a_scales.unbind(0)), list(b), list(b_scales),
                     recipe_b="1x128", out=list(out.unbind(0)), out_dtype=dtype)
    return out


def _split_params(params, plan):
    """``(first-layer weights, e-major then gate/up; down weights; per-expert bias tuples)``."""
    per, nf = plan.n_params, plan.n_first
    first = [params[e * per + i] for e in range(plan.n_local) for i in range(nf)]
    down = [params[e * per + nf] for e in range(plan.n_local)]
    biases = [tuple(params[e * per + nf + 1:(e + 1) * per]) for e in range(plan.n_local)]
    return first, down, biases


# ---- forward pieces ------------------------------------------------------------------------


def _first_gemms(x_op, first, biases, plan, tokens, used=None):
    """z = x @ [gate; up]^T (+ bias) for every expert: bf16 ``[n*T, n_first*F]``."""
    w = plan.tile_quant(first, plan.n_first)
    z = _m_gemm(*x_op, *w, tokens, plan, used=used)
    if plan.bias:
        b = torch.stack([torch.cat(bs[:-1]) for bs in biases]).to(z.dtype)
        z.view(plan.n_local, tokens, -1).add_(b[:, None])
    return z


def _act_quant(z_src, plan, tokens, row, col):
    """FP8 1x128 of h = act(z) for every expert (``segment_quant``'s ``(row, col)``);
    ``z_src``: bf16 z, or its MXFP4 cache rows (SwiGLU reads those directly)."""
    if plan.activation == "swiglu":
        return fp8_segments.segment_quant(z_src, plan.n_local, tokens, row, col, source="swiglu")
    z = _dense_z(z_src, "mxfp4", plan.n_first * plan.ffn) if z_src.dtype == torch.uint8 \
        else z_src
    return fp8_segments.segment_quant(_act(z, plan.activation), plan.n_local, tokens, row, col)


def _second_gemms(h_op, down, biases, plan, shape, used=None):
    """y = h @ down^T (+ bias), bf16 ``[ep, n, C, H]``."""
    tokens = shape[0] * shape[2]
    y = _to_slots(_m_gemm(*h_op, *plan.tile_quant(down, 1), tokens, plan, used=used), shape)
    if plan.bias:
        y.add_(torch.stack([bs[-1] for bs in biases]).to(y.dtype)[None, :, None, :])
    return y


# ---- backward pieces -----------------------------------------------------------------------


def _down_dgrad(dy_row, down, plan, tokens, used=None):
    """dh = dy @ down for every expert: bf16 ``[n*T, F]``."""
    return _m_gemm(*dy_row, *plan.tile_quant(down, 1, transpose=True), tokens, plan, used=used)


def _act_grad_quant(z_src, dh, plan, tokens, row, col, dense):
    """dz = dh * act'(z), quantized ``(row, col)`` as ``segment_quant``; plus dz itself in
    bf16 when ``dense`` (bias gradients), else None."""
    if plan.activation == "swiglu" and not dense:
        if not (row or col):
            return None, None, None
        return (*fp8_segments.segment_quant(z_src, plan.n_local, tokens, row, col,
                                            source="swiglu_grad", dh=dh), None)
    z = _dense_z(z_src, "mxfp4", plan.n_first * plan.ffn) if z_src.dtype == torch.uint8 \
        else z_src
    dz = _act_grad(z, dh, plan.activation)
    if not (row or col):
        return None, None, dz
    return (*fp8_segments.segment_quant(dz, plan.n_local, tokens, row, col), dz)


def _first_dgrad(dz_row, first, plan, shape, into=None, scratch=None, used=None):
    """dx = dz @ [gate; up] for every expert, bf16 ``[ep, n, C, H]``: written into ``into``
    (``[ep, n, C, H]``, contiguous) when given, through ``scratch`` (a dead contiguous
    ``[n*ep*C, H]`` buffer) for the expert-major result when ep > 1."""
    tokens = shape[0] * shape[2]
    w = plan.tile_quant(first, plan.n_first, transpose=True)
    if into is None:
        return _to_slots(_m_gemm(*dz_row, *w, tokens, plan, used=used), shape)
    ep, n, cap, hidden = shape
    if ep == 1 or n == 1:   # expert-major is the slots' own order
        return _m_gemm(*dz_row, *w, tokens, plan, out=into.view(n * tokens, hidden),
                       used=used).view(shape)
    y = _m_gemm(*dz_row, *w, tokens, plan, out=scratch, used=used)
    return into.copy_(y.view(n, ep, cap, hidden).transpose(0, 1))


def _x_colwise(kind, kept_x, n, tokens, hidden, counts=None):
    """The input, FP8 1x128 along tokens (each expert's tokens zero padded to P columns),
    made from what forward kept: ``(data, scales)`` either side by side ``[H, n*P]`` /
    ``[H, n*P/128]`` (from MXFP4 rows) or as slabs ``[n, H, P]`` / ``[n, H, P/128]``."""
    if kind == "rows":
        # One conversion for all experts: one ragged segment of ep*C slots per expert (its
        # padding slots included), each padded to a multiple of 128 columns.
        (rows,) = kept_x
        em = _expert_major(rows, n, tokens)
        offsets = [g * tokens for g in range(n + 1)]     # host offsets: no device sync
        return ops.mxfp4_to_fp8_colwise(*ops.split_mxfp4_rows(em, hidden), offsets, counts)
    if kind == "fp8":
        xq, xs = kept_x
        x = ops.dequantize_fp8(xq, xs.transpose(1, 2).reshape(n * tokens, -1), torch.bfloat16)
    else:
        (x,) = kept_x
    return _slab_cols(fp8_segments.segment_quant(x, n, tokens, row=False, col=True)[1])


def _down_wgrad(dy_col, z_src, plan, tokens, dtype, used=None):
    """The down weights' gradients ``[n, H, F]`` in ``dtype``: dy^T h per expert."""
    h_col = _act_quant(z_src, plan, tokens, row=False, col=True)[1]
    return _k_gemm(*_slab_cols(dy_col), *_slab_cols(h_col), _padded_tokens(tokens), dtype,
                   plan, used)


def _first_wgrad(dz_col, plan, x_kind, kept_x, tokens, dtype, used=None):
    """The first-layer weights' gradients ``[n, n_first*F, H]`` in ``dtype``: dz^T x."""
    x_col = _x_colwise(x_kind, kept_x, plan.n_local, tokens, plan.hidden, plan.counts)
    return _k_gemm(*_slab_cols(dz_col), *x_col, _padded_tokens(tokens), dtype, plan, used)


def _bias_grads(dz, dy, plan, tokens):
    d1 = dz.view(plan.n_local, tokens, -1).float().sum(1)
    d2 = dy.reshape(plan.n_local, tokens, -1).float().sum(1)
    return [list(d1[e].chunk(plan.n_first)) + [d2[e]] for e in range(plan.n_local)]


# ---- one pass, as pure functions of tensors (what a CUDA graph captures) ---------------------


def _forward_pass(inputs, rows, plan, *params, used=None, gather=None):
    """``(y, kept_z, *kept_x)`` for all local experts: y in ``inputs``' dtype, kept_z the
    SwiGLU/GELU input in the cache format, kept_x what backward reads of the input (the
    ``rows`` tensor itself when given; ``inputs`` is then only a shape). ``used``: None, or
    (ep 1, no bias) int ``[n]``: expert e's slots from ``used[e]`` on are zero rows, which
    stay zeros through every GEMM (the grouped kernels skip them). ``gather``: None, or
    (ep 1, MXFP4 or FP8 cache) ``(tokens, source)``: the slots' rows are the tokens' rows
    ``source`` names (``FP8Experts.forward``), read in place; ``inputs`` is only a shape."""
    ep, n, cap, hidden = inputs.shape
    tokens = ep * cap
    first, down, biases = _split_params(params, plan)
    if rows is not None:
        x_op = ops.mxfp4_rows_to_fp8(_expert_major(rows, n, tokens), hidden, plan.counts)
        kept_x = [rows]           # the received payload itself, not a copy
    elif gather is not None:
        src, index = gather
        x_op = fp8_segments.segment_quant(src, n, tokens, row=True, index=index)[0]
        kept_x = [_encode_cache(src, "mxfp4", plan.rounding, index).view(ep, n, cap, -1)] \
            if plan.cache == "mxfp4" else list(x_op)
    else:
        # bf16 in: the GEMM reads x's own FP8; backward reads x as the cache format
        x = _expert_major(inputs, n, tokens)
        x_op = fp8_segments.segment_quant(x, n, tokens, row=True)[0]
        if plan.cache == "mxfp4":
            kept_x = [ops.quantize_mxfp4_rows(inputs, plan.rounding)]
        else:
            kept_x = list(x_op) if plan.cache == "fp8" else [x.to(torch.bfloat16)]
    z = _first_gemms(x_op, first, biases, plan, tokens, used)
    del x_op
    kept_z, z = _keep_z(z, plan.z_format, plan.rounding)
    h_op = _act_quant(z, plan, tokens, row=True, col=False)[0]
    del z
    y = _second_gemms(h_op, down, biases, plan, inputs.shape, used)
    return (y.to(inputs.dtype), kept_z, *kept_x)


@dataclasses.dataclass(frozen=True)
class _Backward:
    """What the backward pass needs besides tensors (hashable: it keys captured graphs)."""
    plan: _Plan
    shape: tuple              # [ep, n_local, C, hidden]
    dtype: torch.dtype        # the input's
    x_kind: str               # "rows" | the cache format (how kept_x holds the input)
    needs: tuple              # ctx.needs_input_grad of (inputs, *params)
    param_dtypes: tuple       # the parameters' dtypes
    donate: bool = False      # grad_out may take the input's gradient (``donated_grad``)


def _backward_pass(how, grad_out, kept_z, *rest, used=None, grad_rows=None):
    """``(grad_in or None, *param grads or None)`` from ``grad_out`` and what forward kept
    (``rest`` = kept_x then the parameters); ``used`` as for ``_forward_pass`` (grad_out's
    rows there are zeros too). ``grad_rows``: None, or (ep 1, no bias, no donation)
    ``(dy [S, H], source, slot_gates)``: grad_out's slot j is ``dy[source[j]] *
    slot_gates[j]`` in grad_out's dtype, zeros where ``source[j]`` is -1, read in place
    (``routing.GatheredSlots``); grad_out is then only a placeholder."""
    plan, shape, n = how.plan, how.shape, how.plan.n_local
    tokens, per = shape[0] * shape[2], plan.n_params
    n_x = len(rest) - len(how.param_dtypes)
    kept_x, params = rest[:n_x], rest[n_x:]
    first, down, _ = _split_params(params, plan)
    need_x, flags = how.needs[0], how.needs[1:]
    nw = plan.n_first + 1
    # parameter j of an expert is a weight when j % per < nw (without biases: every one)
    need_w = any(f for j, f in enumerate(flags) if j % per < nw) if plan.bias else any(flags)
    need_b = plan.bias and any(f for j, f in enumerate(flags) if j % per >= nw)
    if grad_rows is None:
        dy = _expert_major(grad_out, n, tokens)
        # the input's gradient goes into grad_out once dy is read (bias gradients read it last)
        into = donated_grad(grad_out, how.dtype, how.donate and need_x and not need_b)
        dy_row, dy_col = fp8_segments.segment_quant(dy, n, tokens, row=True, col=need_w)
    else:
        src, index, scale = grad_rows
        dy = into = None
        dy_row, dy_col = fp8_segments.segment_quant(src, n, tokens, row=True, col=need_w,
                                                    index=index, scale=scale)
    # z decoded once to bf16 for the SwiGLU-backward quantizers: their MXFP4-reading
    # variants measured slower than decode + bf16 source on the H200 (NOTES_experts.md)
    z_src = _dense_z(kept_z, plan.z_format, plan.n_first * plan.ffn)
    wdtype = _grad_dtype(how.param_dtypes[0])
    # The down weights' gradients first: dy's and h's columns are then gone before the
    # first layer's, when every weight gradient is live (the pass's memory peak).
    dw2 = _down_wgrad(dy_col, z_src, plan, tokens, wdtype, used) if need_w else None
    del dy_col
    dh = _down_dgrad(dy_row, down, plan, tokens, used)
    del dy_row
    dz_row, dz_col, dz = _act_grad_quant(z_src, dh, plan, tokens, need_x, need_w, need_b)
    del dh, z_src
    # dy, when an expert-major copy of grad_out (ep > 1), is dead by now: the GEMM writes
    # there, then into grad_out in the slots' order
    scratch = dy if into is not None and dy.data_ptr() != grad_out.data_ptr() else None
    grad_in = _first_dgrad(dz_row, first, plan, shape, into, scratch, used).to(how.dtype) \
        if need_x else None
    del scratch
    del dz_row
    wgrads = None
    if need_w:
        dw1 = _first_wgrad(dz_col, plan, how.x_kind, kept_x, tokens, wdtype, used)
        # per expert: its gate's and up's (or up's) rows of dw1, then dw2 (views; two
        # unbinds instead of a chunk per expert)
        nf = plan.n_first
        firsts = dw1.reshape(n * nf, dw1.shape[1] // nf, dw1.shape[2]).unbind(0)
        wgrads = [[*firsts[e * nf:(e + 1) * nf], d2] for e, d2 in enumerate(dw2.unbind(0))]
    del dz_col
    bgrads = _bias_grads(dz, dy, plan, tokens) if need_b else None
    return (grad_in, *_param_grads(wgrads, bgrads, how.param_dtypes, plan))


def _param_grads(wgrads, bgrads, dtypes, plan):
    """Every parameter's gradient in its dtype (None where not computed), in parameter
    order, from per-expert lists of weight and bias gradients (or None)."""
    nw, nb = plan.n_first + 1, plan.n_params - plan.n_first - 1
    grads = []
    for e in range(plan.n_local):
        grads += wgrads[e] if wgrads else [None] * nw
        grads += bgrads[e] if bgrads else [None] * nb
    # ``Tensor.to`` costs ~3-4 us of host time even when it returns ``g`` itself (48
    # gradients a step at 16 experts): only where the dtypes differ
    return [g if g is None or g.dtype == dtype else g.to(dtype) for g, dtype in zip(grads, dtypes)]
