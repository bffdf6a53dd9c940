"""The data-format contract (FORMATS.md) in plain PyTorch: the readable specification.

Every CUDA kernel in ``ds_fp4.ops.cuda`` must equal these functions byte for byte. They run
on CPU and CUDA tensors of any strides. Each rule of FORMATS.md appears once, in the
helper named for it; arithmetic that must be exact is done in float64 or on integer bits.
Every op takes ``out=``, as the kernels do: None, or tensors of the outputs' shapes and
dtypes (one per output, any strides) that receive the result and are returned.
"""

import math

import torch

from ds_fp4 import formats as F
from ds_fp4.ops import checks
from ds_fp4.ops.rows import (e8m0_from_pow2, join_rows, pow2, pow2_from_e8m0, split_fp8_rows,
                             split_mxfp4_rows, split_mxfp4_rows_for_fp8)

# ---- shared rules ------------------------------------------------------------------------


def _into(out, result):
    """``result`` (a tensor or a tuple), or copied into ``out`` (checked) and that returned."""
    results = result if isinstance(result, tuple) else (result,)
    outs = checks.out(out, [(r.shape, r.dtype) for r in results], results[0].device)
    if outs is None:
        return result
    for o, r in zip(outs, results):
        o.copy_(r)
    return outs if isinstance(result, tuple) else outs[0]


def smallest_pow2_exponent(amax, vmax):
    """Smallest integer ``e`` with ``amax <= vmax * 2**e``, for finite ``amax > 0``.

    With ``amax = m * 2**E`` (frexp, ``m`` in [0.5, 1)) and ``vmax = vm * 2**ve``, the answer
    is ``E - ve`` when ``m <= vm`` and ``E - ve + 1`` otherwise: exact, no log2 rounding.
    """
    mant, exp = torch.frexp(amax.to(torch.float64))
    vm, ve = math.frexp(vmax)
    return torch.where(mant <= vm, exp - ve, exp - ve + 1).to(torch.int32)


def block_amax(blocks):
    """Per block (last dim) ``(amax of the finite values, whether every value is finite)``."""
    finite = torch.isfinite(blocks)
    amax = torch.where(finite, blocks.abs(), 0).amax(dim=-1)
    return amax, finite.all(dim=-1)


# ---- MXFP4 ---------------------------------------------------------------------------


def mx_exponent(amax, rounding):
    """The block scale exponent ``e`` of FORMATS.md (``rceil`` or ``floor``), clamped."""
    if rounding == "rceil":      # smallest e with amax <= 6 * 2^e: nothing clips
        e = smallest_pow2_exponent(amax, F.E2M1_MAX)
    else:                        # OCP MX v1.0: floor(log2 amax) - emax of E2M1 (2)
        e = torch.frexp(amax.to(torch.float64))[1] - 1 - 2
    e = torch.where(amax == 0, F.MX_EXP_MIN, e)
    return e.clamp(F.MX_EXP_MIN, F.MX_EXP_MAX)


def e2m1_code(x):
    """Round ``x`` (already divided by its scale) to the E2M1 grid, ties to even; saturating.

    Returns the 4-bit codes as uint8; the sign bit is kept for zeros and for values that
    round to zero.
    """
    v = x.abs()
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, tie_rounds_up in F.E2M1_MIDPOINTS:
        mag += (v >= midpoint) if tie_rounds_up else (v > midpoint)
    return mag | torch.signbit(x).to(torch.uint8) * F.E2M1_SIGN_BIT


def pack_nibbles(codes):
    """Element 2j in the low nibble, element 2j+1 in the high nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(data):
    return torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)


def quantize_mxfp4(x, rounding="rceil", out=None):
    """bf16/fp16/fp32 -> MXFP4 (FORMATS.md "MXFP4 tensor").

    Arguments:
        x: ``[..., K]`` bfloat16/float16/float32, ``K % 32 == 0``, any strides.
        rounding: ``"rceil"`` (default) or ``"floor"`` block-scale rule.
    Returns:
        data: uint8 ``[..., K/2]``, two E2M1 codes per byte.
        scales: uint8 ``[..., K/32]``, one E8M0 byte per block of 32 (255: NaN/Inf block).
    """
    checks.float_input("x", x)
    checks.multiple("x", x.shape[-1], F.MX_BLOCK)
    checks.rounding(rounding)
    blocks = x.to(torch.float64).unflatten(-1, (-1, F.MX_BLOCK))
    amax, finite = block_amax(blocks)
    e = mx_exponent(amax, rounding)
    codes = e2m1_code(blocks * pow2(-e).unsqueeze(-1))
    codes = torch.where(finite.unsqueeze(-1), codes, 0)
    scales = torch.where(finite, e + F.E8M0_BIAS, F.E8M0_NAN).to(torch.uint8)
    return _into(out, (pack_nibbles(codes.flatten(-2)), scales))


def dequantize_mxfp4(data, scales, dtype=None, out=None):
    """MXFP4 -> ``dtype`` (default bf16): value(code) * 2^(b-127); NaN for scale byte 255.

    Arguments:
        data: uint8 ``[..., K/2]``; scales: uint8 ``[..., K/32]``.
        dtype: bfloat16 (default), float16 or float32.
    Returns:
        ``[..., K]`` of ``dtype`` (exact; values beyond the dtype's range become +-Inf).
    """
    checks.mxfp4_pair(data, scales)
    dtype = checks.out_dtype(dtype)
    codes = unpack_nibbles(data).unflatten(-1, (-1, F.MX_BLOCK)).long()
    table = torch.tensor(F.E2M1_VALUES, dtype=torch.float64, device=data.device)
    values = table[codes & 7] * torch.where(codes & F.E2M1_SIGN_BIT > 0, -1.0, 1.0)
    scale = pow2_from_e8m0(scales).to(torch.float64)
    return _into(out, (values * scale.unsqueeze(-1)).flatten(-2).to(dtype))


# ---- FP8 E4M3 1x128 ------------------------------------------------------------------


def fp8_exponent(amax):
    """Power-of-two scale exponent: smallest e with amax <= 448 * 2^e, clamped; 0 for amax 0."""
    e = smallest_pow2_exponent(amax, F.E4M3_MAX)
    e = torch.where(amax == 0, 0, e)
    return e.clamp(F.FP8_EXP_MIN, F.FP8_EXP_MAX)


def e4m3_round(v):
    """RNE to E4M3, saturating at +-448 (``v`` already divided by its scale, float64)."""
    return v.clamp(-F.E4M3_MAX, F.E4M3_MAX).to(F.FP8_DTYPE)


def quantize_fp8_groups(x):
    """``[M, K]`` -> (FP8 data ``[M, K]``, float32 scales ``[M, K/128]``, contiguous)."""
    groups = x.to(torch.float64).unflatten(-1, (-1, F.FP8_GROUP))
    amax, finite = block_amax(groups)
    e = fp8_exponent(amax)
    data = e4m3_round(groups * pow2(-e).unsqueeze(-1))
    nan_byte = torch.tensor(F.E4M3_NAN, dtype=torch.uint8, device=x.device).view(F.FP8_DTYPE)
    data = torch.where(finite.unsqueeze(-1), data.view(torch.uint8), nan_byte.view(torch.uint8))
    scales = torch.where(finite, pow2(e), math.nan).to(torch.float32)
    return data.flatten(-2).view(F.FP8_DTYPE), scales


def colmajor(scales):
    """Store ``[M, G]`` scales contiguous as ``[G, M]``; hand out the transpose view.

    The strides are set explicitly: ``(1, M)`` even where a size-1 dimension would let
    ``contiguous()`` keep other strides, since ``scaled_mm`` checks them.
    """
    m, g = scales.shape
    out = torch.empty_strided((m, g), (1, max(m, 1)), dtype=scales.dtype, device=scales.device)
    return out.copy_(scales)


def quantize_fp8(x, out=None):
    """bf16/fp16/fp32 -> FP8 E4M3 with 1x128 power-of-two scales (FORMATS.md).

    Arguments:
        x: ``[M, K]`` bfloat16/float16/float32, ``K % 128 == 0``, any strides.
    Returns:
        data: float8_e4m3fn ``[M, K]`` (a NaN/Inf group: every byte 0x7F).
        scales: float32 ``[M, K/128]`` with strides ``(1, M)`` (NaN for a NaN/Inf group).
    """
    checks.float_input("x", x)
    checks.matrix("x", x)
    checks.multiple("x", x.shape[-1], F.FP8_GROUP)
    data, scales = quantize_fp8_groups(x)
    return _into(out, (data, colmajor(scales)))


def dequantize_fp8(data, scales, dtype=None, out=None):
    """FP8 1x128 -> ``dtype`` (default bf16): data * scale per group.

    Arguments:
        data: float8_e4m3fn ``[M, K]``; scales: float32 ``[M, K/128]`` (any strides).
    Returns:
        ``[M, K]`` of ``dtype``.
    """
    checks.fp8_pair(data, scales)
    dtype = checks.out_dtype(dtype)
    groups = data.to(torch.float64).unflatten(-1, (-1, F.FP8_GROUP))
    return _into(out, (groups * scales.to(torch.float64).unsqueeze(-1)).flatten(-2).to(dtype))


# ---- MXFP4 -> FP8 ----------------------------------------------------------------------


# ---- exactness counts ------------------------------------------------------------------

def _nonzero_codes(data):
    """Per element of MXFP4 ``data [..., K/2]``: whether its code is nonzero (not +-0)."""
    return (unpack_nibbles(data) & (F.E2M1_SIGN_BIT - 1)) != 0


def count_exactness(counts, scale_bytes, nonzero, nan):
    """Add the exactness counts of groups to ``counts`` (see ``EXACTNESS_DOC``).

    Arguments:
        counts: int64 ``[3]``, added to in place (no host sync).
        scale_bytes: uint8/int ``[..., n]``: the E8M0 byte of each of a group's n members
            (elements or whole blocks, last dimension).
        nonzero: bool ``[..., n]``: whether the member holds a nonzero code.
        nan: bool ``[...]``: whether the group's output is NaN.
    """
    b = scale_bytes.to(torch.int16)
    largest = torch.where(nonzero, b, -1).amax(dim=-1)
    smallest = torch.where(nonzero, b, F.E8M0_NAN + 1).amin(dim=-1)
    inexact = ~nan & (largest - smallest > F.MXFP4_TO_FP8_EXACT_SPREAD)
    total = torch.tensor(nan.numel(), dtype=torch.int64, device=counts.device)
    counts += torch.stack([inexact.sum(), nan.sum(), total]).to(counts.device)


def _count_rows(counts, data, scales, out_scales):
    """Exactness counts of ``mxfp4_to_fp8``: a group's members are its 4 MX blocks."""
    m, k = data.shape[0], 2 * data.shape[1]
    groups = (m, k // F.FP8_GROUP, F.FP8_GROUP // F.MX_BLOCK)
    nonzero = _nonzero_codes(data).view(m, k // F.MX_BLOCK, F.MX_BLOCK).any(dim=-1)
    count_exactness(counts, scales.reshape(groups), nonzero.view(groups),
                    torch.isnan(out_scales))


def mxfp4_to_fp8(data, scales, counts=None, out=None):
    """MXFP4 ``[M, K]`` -> FP8 1x128, defined as ``quantize_fp8(dequantize_mxfp4(...))``.

    The dequantized values are exact in float32 except those >= 2^128 (scale byte >= 253 with
    a large code), which overflow to Inf and so make their 128-group a NaN group.

    Arguments:
        data: uint8 ``[M, K/2]``; scales: uint8 ``[M, K/32]``; ``K % 128 == 0``.
        counts: None (default: nothing counted) or int64 ``[3]`` on data's device, added
            to in place, per output 128-group (one row's 4 MX blocks): [0] inexact groups,
            [1] NaN groups, [2] all groups. NaN: the group's output scale is NaN (a scale
            byte 255, or a value >= 2^128). Inexact: a finite group with a nonzero block
            (a code other than +-0) whose scale byte is more than 14
            (``MXFP4_TO_FP8_EXACT_SPREAD``) below the largest scale byte among the group's
            nonzero blocks, i.e. outside FORMATS.md's exactness guarantee (such a group may
            still convert exactly). All-zero blocks never count, whatever their scale byte;
            a NaN group counts as NaN only.
    Returns:
        as ``quantize_fp8``.
    """
    checks.mxfp4_matrix_for_fp8(data, scales)  # errors name data/scales, not the inner x
    checks.counts(counts, data.device)
    result = quantize_fp8(dequantize_mxfp4(data, scales, torch.float32))
    if counts is not None:
        _count_rows(counts, data, scales, result[1])
    return _into(out, result)


def mxfp4_to_fp8_colwise(data, scales, offsets, counts=None, out=None):
    """MXFP4 token rows -> FP8 1x128 along tokens, transposed, per ragged segment.

    Segment g (rows ``offsets[g]:offsets[g+1]``, length L_g) is zero-padded to
    P_g = ceil(L_g/128)*128 rows, transposed to ``[K, P_g]`` and quantized along its rows;
    segments are laid side by side from column ``sum_{h<g} P_h``.

    Arguments:
        data: uint8 ``[T, K/2]``; scales: uint8 ``[T, K/32]``; ``K % 128 == 0``.
        offsets: ``[G+1]`` non-decreasing, from 0 to T: an int32/int64 tensor on the CPU or
            on data's device, or a list of ints (host offsets spare a CUDA caller a sync).
        counts: as for ``mxfp4_to_fp8``, where a group is 128 tokens of one feature
            (a column of the output) and its members are elements, each with its own
            token's scale byte: inexact when a nonzero element's byte is more than 14 below
            the largest byte among the group's nonzero elements. Padding rows are zeros and
            never count; [2] adds K * sum P_g / 128.
    Returns:
        data: float8_e4m3fn ``[K, sum P_g]``.
        scales: float32 ``[K, sum P_g / 128]`` with strides ``(1, K)``.
    """
    k = checks.mxfp4_matrix_for_fp8(data, scales)
    bounds = checks.offsets(offsets, data.shape[0], data.device)
    checks.counts(counts, data.device)
    result = quantize_fp8(_segment_columns(dequantize_mxfp4(data, scales, torch.float32),
                                           bounds))
    if counts is not None:
        b = scales.repeat_interleave(F.MX_BLOCK, dim=1)            # each element's byte
        members = (k, result[1].shape[1], F.FP8_GROUP)
        count_exactness(counts, _segment_columns(b, bounds).reshape(members),
                        _segment_columns(_nonzero_codes(data), bounds).reshape(members),
                        torch.isnan(result[1]))
    return _into(out, result)


def _segment_columns(x, bounds):
    """Rows ``x [T, K]`` -> ``[K, sum P_g]``: each segment zero padded to P_g rows,
    transposed, side by side (the column-wise layout)."""
    columns = []
    for start, end in zip(bounds, bounds[1:]):
        padded = -(end - start) // F.FP8_GROUP * -F.FP8_GROUP
        segment = x.new_zeros(padded, x.shape[1])
        segment[: end - start] = x[start:end]
        columns.append(segment.t())
    return torch.cat(columns, dim=1) if columns else x.new_zeros(x.shape[1], 0)


# ---- packed rows (wire / cache layout) ---------------------------------------------------


def quantize_mxfp4_rows(x, rounding="rceil", out=None, index=None):
    """``[..., K]`` -> uint8 ``[..., K/2 + K/32]``: each row's data bytes, then its scale bytes.
    ``index`` (int64 ``[R]``, x ``[M, K]``): the rows ``gather_rows_or_zeros(x, index)``."""
    if index is not None:
        checks.matrix("x", x)
        checks.row_index("index", index, x.device)
        x = gather_rows_or_zeros(x, index)
    return _into(out, join_rows(*quantize_mxfp4(x, rounding)))


def dequantize_mxfp4_rows(rows, dtype=None, k=None, out=None):
    """uint8 ``[..., K/2 + K/32]`` packed MXFP4 rows -> ``dtype`` (default bf16) ``[..., K]``.

    ``k``: the rows' K, required where the width also fits FP8 rows (``split_mxfp4_rows``).
    """
    return dequantize_mxfp4(*split_mxfp4_rows(rows, k), dtype, out)


def mxfp4_rows_to_fp8(rows, k=None, counts=None, out=None):
    """uint8 ``[M, K/2 + K/32]`` packed MXFP4 rows -> FP8 1x128, as ``mxfp4_to_fp8``
    (``counts`` too)."""
    return mxfp4_to_fp8(*split_mxfp4_rows_for_fp8(rows, k), counts, out)


def gather_rows_or_zeros(x, index):
    """``x[index]``, a zero row where an index is outside ``[0, M)``."""
    inside = (index >= 0) & (index < x.shape[0])
    rows = x.index_select(0, torch.where(inside, index, 0))
    return rows.masked_fill(~inside[:, None], 0)


def gathered_rows(x, index, scale=None):
    """The rows a gathering kernel reads: ``gather_rows_or_zeros(x, index)``, each row read
    times ``scale`` (float32 ``[R]``, or None) rounded to x's dtype; a zero row stays zero
    whatever its scale (an unused slot's gate may be any value, NaN included)."""
    rows = gather_rows_or_zeros(x, index)
    if scale is None:
        return rows
    inside = (index >= 0) & (index < x.shape[0])
    return (rows.float() * torch.where(inside, scale, 1.0)[:, None]).to(x.dtype)


def quantize_fp8_rows(x, out=None, index=None, scale=None):
    """``[M, K]`` -> uint8 ``[M, K + K/128]``: E4M3 bytes, then one E8M0 byte per group.
    ``index`` (int64 ``[R]``): the rows ``gather_rows_or_zeros(x, index)`` instead; ``scale``
    (float32 ``[R]``, with ``index``): those rows times it, rounded to x's dtype."""
    checks.row_scale("scale", scale, index, x.device)
    if index is not None:
        checks.row_index("index", index, x.device)
        x = gathered_rows(x, index, scale)
    data, scales = quantize_fp8(x)
    return _into(out, join_rows(data.view(torch.uint8), e8m0_from_pow2(scales)))


def dequantize_fp8_rows(rows, dtype=None, k=None, out=None):
    """uint8 ``[M, K + K/128]`` packed FP8 rows -> ``dtype`` (default bf16) ``[M, K]``.

    ``k``: the rows' K, required where the width also fits MXFP4 rows (``split_fp8_rows``).
    """
    return dequantize_fp8(*split_fp8_rows(rows, k), dtype, out)
