"""FP8 GEMMs for AutoEP's ``GroupedExperts``, fed straight from the received MXFP4 rows.

AutoEP hands its experts one ``[N, H]`` buffer whose rows are grouped by local expert
(``counts`` rows each, on the device, then alignment padding). Here every GEMM kind is one
grouped launch over those contiguous segments (``ds_fp4.ops.grouped_gemm``; the segment
offsets stay on the device: no host sync, no loop over experts):

forward:   x: received MXFP4 rows -> FP8 1x128 (``mxfp4_rows_to_fp8``, exact), or bf16 -> FP8
           z = x @ [w1; w3]^T     grouped 1x128 x 128x128, bf16 out (zeros after the groups)
           h = silu(z_gate) * z_up -> FP8 1x128 (``ops.segment_quant``, "swiglu")
           y = h @ w2^T           grouped
kept:      the received rows themselves (or x in the cache format) and z in the cache format
backward:  dh = dy @ w2, dz = dh * swiglu'(z), dx = dz @ [w1; w3]   grouped
           dW = (rows of each expert)^T (rows of each expert)        K-grouped, both
           operands FP8 1x128 along tokens: each operand's rows are first placed into
           segments padded to 128 rows (so that no 128-token scale group spans two
           experts), transposed and quantized in one pass each.

The math is the legacy layer's ``FP8Experts`` (equal segments give the same bytes; the CPU
tests check it); the weights stay AutoEP's ``w1``/``w3``/``w2`` parameters.
"""

import torch
from torch.nn import functional as F

from ds_fp4 import formats, ops
# the legacy FP8 experts' activation and cache helpers: one definition of each
from ds_fp4.moe.fp8_experts import _act, _act_grad, _dense_z, _encode_cache, _grad_dtype
from ds_fp4.ops.grouped_gemm import k_grouped_gemm_fp8_nt, m_grouped_gemm_fp8_nt

__all__ = ["fp8_experts_problem", "run_fp8_experts"]

G = formats.FP8_GROUP
_CACHES = ("mxfp4", "fp8", "bf16")


def fp8_experts_problem(experts) -> str:
    """Why FP8 GEMMs cannot run AutoEP's ``experts`` ('' when they can)."""
    if getattr(experts, "activation", "swiglu") != "swiglu":
        return f"the experts' activation is {experts.activation!r} (FP8 experts run swiglu)"
    e, ffn, hidden = experts.w1.shape
    bad = [f"{name} = {size}" for name, size in (("hidden", hidden), ("ffn", ffn)) if size % G]
    if bad:
        return (f"{' and '.join(bad)} must be multiples of {G} (128x128 FP8 weight tiles); "
                f"round them up to multiples of {G}")
    return ""


def run_fp8_experts(experts, x, counts, rows=None, cache="mxfp4", rounding="rceil",
                    exactness=None):
    """AutoEP's experts on ``x`` with FP8 GEMMs.

    Arguments:
        experts: AutoEP's ``GroupedExperts`` (``w1``/``w3`` ``[E, F, H]``, ``w2``
            ``[E, H, F]``, swiglu).
        x: ``[N, H]`` rows grouped by expert (the autograd input; only a shape and dtype
            when ``rows`` is given).
        counts: int ``[E]`` rows per expert, on ``x``'s device; rows past their sum are
            padding (their outputs are zeros).
        rows: uint8 ``[N, H/2 + H/32]``, the same rows as packed MXFP4 (the received
            payload), or None.
        cache: ``"mxfp4"``/``"fp8"``/``"bf16"``: how z (and x, without ``rows``) is kept.
        rounding: MXFP4 scale rule for what is quantized here.
        exactness: int64 ``[3]`` counters (``ds_fp4.moe.exactness``) that the direct
            conversion of ``rows`` adds to, or None. (The weight-gradient operands are
            quantized from dequantized rows here, not converted directly: not counted.)
    Returns:
        ``[N, H]`` in ``x``'s dtype.
    """
    if cache not in _CACHES:
        raise ValueError(f"cache must be one of {_CACHES}; got {cache!r}")
    return _Function.apply(x, rows, counts, cache, rounding, exactness, experts.w1,
                           experts.w3, experts.w2)


# ---- layouts ------------------------------------------------------------------------------


def _offsets(counts):
    """int32 ``[E + 1]`` row offsets of the groups, on the device."""
    return F.pad(counts.to(torch.int32).cumsum(0, dtype=torch.int32), (1, 0))


def _padded_layout(counts, n):
    """Where each row goes when every group is padded to a multiple of 128 rows.

    Returns:
        ``(pos int64 [n], col_offsets int32 [E + 1], rows)``: row i's new position (padding
        rows after the groups go to ``rows``, a scratch row), the padded groups' offsets,
        and the padded height (a bound that needs no host sync).
    """
    counts = counts.to(torch.int64)
    ends = counts.cumsum(0)
    padded = (counts + G - 1) // G * G
    pends = padded.cumsum(0)
    r = torch.arange(n, device=counts.device)
    g = torch.searchsorted(ends, r, right=True).clamp_max(counts.numel() - 1)
    rows = -(-(n + counts.numel() * (G - 1)) // G) * G
    pos = torch.where(r < ends[-1], (pends - padded)[g] + r - (ends - counts)[g], rows)
    return pos, F.pad(pends.to(torch.int32), (1, 0)), rows


def _columns(t, layout):
    """FP8 1x128 along tokens of ``t [N, K]`` in the padded layout: ``[K, rows]`` and
    scales ``[K, rows/128]``."""
    pos, _, rows = layout
    buf = t.new_zeros(rows + 1, t.shape[1]).index_copy_(0, pos, t)
    return ops.quantize_fp8(buf[:rows].t().contiguous())


def _tiles(weights_a, weights_b=None, transpose=False):
    """128x128 tiles of each expert's ``[a; b]`` (or ``a``): ``[E, N, K]`` and scales."""
    if weights_b is None:
        return ops.tile_quant(list(weights_a.unbind(0)), 1, transpose)
    pairs = [w for pair in zip(weights_a.unbind(0), weights_b.unbind(0)) for w in pair]
    return ops.tile_quant(pairs, 2, transpose)


# ---- the autograd Function ------------------------------------------------------------------


class _Function(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, rows, counts, cache, rounding, exactness, w1, w3, w2):
        n, hidden = x.shape
        ctx.meta = (cache, x.dtype, hidden, w1.shape[1])
        offs = _offsets(counts)
        if rows is not None:
            x_op = ops.mxfp4_rows_to_fp8(rows, hidden, exactness)
            kept_x, ctx.x_format = rows, "mxfp4"
        else:
            x_op = ops.quantize_fp8(x.contiguous())
            kept_x = _encode_cache(x.to(torch.bfloat16), cache, rounding)
            ctx.x_format = cache
        z = m_grouped_gemm_fp8_nt(*x_op, *_tiles(w1, w3), offsets=offs)
        del x_op
        kept_z = _encode_cache(z, cache, rounding)
        (hq, hs), _ = ops.segment_quant(z, 1, n, row=True, source="swiglu")
        del z
        y = m_grouped_gemm_fp8_nt(hq, hs[0].t(), *_tiles(w2), offsets=offs)
        ctx.save_for_backward(kept_z, kept_x, counts, offs, w1, w3, w2)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        kept_z, kept_x, counts, offs, w1, w3, w2 = ctx.saved_tensors
        cache, dtype, hidden, ffn = ctx.meta
        dy = dy.contiguous()
        dh = m_grouped_gemm_fp8_nt(*ops.quantize_fp8(dy), *_tiles(w2, transpose=True),
                                   offsets=offs)
        z = _dense_z(kept_z, cache, 2 * ffn)
        dz = _act_grad(z, dh, "swiglu")
        del dh
        dx = None
        if ctx.needs_input_grad[0]:
            dx = m_grouped_gemm_fp8_nt(*ops.quantize_fp8(dz), *_tiles(w1, w3, transpose=True),
                                       offsets=offs).to(dtype)
        grads = [None, None, None]
        if any(ctx.needs_input_grad[6:]):   # w1, w3, w2
            grads = _weight_grads(dy, dz, z, _dense_z(kept_x, ctx.x_format, hidden), counts,
                                  ffn, w1.dtype)
        return (dx, None, None, None, None, None, *grads)


def _weight_grads(dy, dz, z, x, counts, ffn, dtype):
    """``[dw1, dw3, dw2]`` from the rows of each expert, K-grouped over tokens."""
    layout = _padded_layout(counts, dy.shape[0])
    wdtype = _grad_dtype(dtype)
    d13 = k_grouped_gemm_fp8_nt(*_columns(dz, layout), *_columns(x, layout),
                                col_offsets=layout[1], out_dtype=wdtype)
    d2 = k_grouped_gemm_fp8_nt(*_columns(dy, layout), *_columns(_act(z, "swiglu"), layout),
                               col_offsets=layout[1], out_dtype=wdtype)
    return [d13[:, :ffn].to(dtype), d13[:, ffn:].to(dtype), d2.to(dtype)]
