"""The CUDA kernels behind ``ds_fp4.ops``: same names and signatures as
``ds_fp4.ops.reference``, equal to it byte for byte (FORMATS.md).

Each function validates its arguments with the reference's own checks (``checks``), views
its operands as 2-D rows with a byte row stride (so slices and the halves of a packed row
buffer run in place, without copies), allocates the outputs (or writes ``out=``: tensors of
the outputs' shapes and dtypes with unit last stride, FP8 scales of any strides; the
column-wise scales as returned, ``(1, K)``) and launches one kernel of the ``.cu`` sources
beside this file on torch's current stream. Importing this module imports CuPy (through
``_cuda_loader``) only when a kernel is first launched.
"""

import functools

import torch

from ds_fp4 import formats as F
from ds_fp4.ops import _cuda_loader as L
from ds_fp4.ops import checks
from ds_fp4.ops.rows import split_mxfp4_rows, split_mxfp4_rows_for_fp8

_SUFFIX = L.DTYPE_SUFFIX
_COLWISE_TILE_FEATURES = F.FP8_GROUP    # TILE_FEATURES of mxfp4_to_fp8_colwise.cu


def _rows(t):
    """``t [..., C]`` as a 2-D ``[M, C]`` tensor with unit last stride (a view when possible)."""
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() > 2:
        t = t.reshape(-1, t.shape[-1])   # a view unless the leading dims cannot merge
    return t


def _row_bytes(t):
    return t.stride(0) * t.element_size()


def _outputs(out, device, *want, any_strides=()):
    """``out`` checked against ``want`` (``(shape, dtype)`` per output; unit last stride
    except at the indices ``any_strides``), or new contiguous tensors; a tuple either way."""
    given = checks.out(out, want, device)
    if given is None:
        return tuple(torch.empty(shape, dtype=dt, device=device) for shape, dt in want)
    for i, t in enumerate(given):
        if i not in any_strides and t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"out[{i}] needs unit stride along its last dimension; got "
                             f"strides {t.stride()}")
    return given


def _out_rows(t):
    """An output as 2-D rows ``[M, C]`` that the kernel writes through (a view, never a copy)."""
    t = t.unsqueeze(0) if t.dim() == 1 else t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as err:
        raise ValueError(f"out {tuple(t.shape)} with strides {t.stride()} is not rows of one "
                         f"stride; pass a tensor whose leading dimensions merge") from err


def _flat_launch(device, module, name, n, per_row, args_before, args_after=()):
    """Launch ``name`` over ``n`` work items (``per_row`` per row) with the row divider."""
    if n == 0:
        return
    if n >= 2 ** 31:
        raise ValueError(f"{name}: {n} work items exceed 2^31; split the tensor along its rows")
    m, p = L.fast_div(per_row)
    args = (*args_before, L.u32(n), L.u32(per_row), m, p, *args_after)
    L.launch(device, module, name, L.blocks_for(n), args)


# ---- MXFP4 ---------------------------------------------------------------------------


def _quantize_mxfp4_into(x, rounding, data_ptr, data_row_bytes, scales_ptr, scales_row_bytes,
                         index=None):
    """``index``: None, or int64 ``[R]`` (contiguous): output row r from x's row index[r]."""
    x2 = _rows(x)
    k = x2.shape[1]
    rows = x2.shape[0] if index is None else index.numel()
    name = f"mxfp4_quantize_{_SUFFIX[x.dtype]}_{rounding}" + ("" if index is None else "_gather")
    _flat_launch(x.device, "mxfp4_quant", name, rows * (k // F.MX_BLOCK), k // F.MX_BLOCK,
                 (L.ptr(x2), L.i64(_row_bytes(x2)), L.u64(data_ptr), L.i64(data_row_bytes),
                  L.u64(scales_ptr), L.i64(scales_row_bytes)),
                 () if index is None else (L.ptr(index), L.i64(x2.shape[0])))


def _check_mxfp4_input(x, rounding):
    checks.float_input("x", x)
    checks.multiple("x", x.shape[-1], F.MX_BLOCK)
    checks.rounding(rounding)


def quantize_mxfp4(x, rounding="rceil", out=None):
    """bf16/fp16/fp32 ``[..., K]`` -> MXFP4 ``(data uint8 [..., K/2], scales uint8 [..., K/32])``.

    Arguments:
        x: ``[..., K]`` bfloat16/float16/float32 CUDA tensor, ``K % 32 == 0``, any strides.
        rounding: ``"rceil"`` (default) or ``"floor"``.
        out: None, or ``(data, scales)`` to write (see the module docstring).
    Returns:
        data: uint8 ``[..., K/2]``; scales: uint8 ``[..., K/32]`` (255: NaN/Inf block).
    """
    _check_mxfp4_input(x, rounding)
    k, lead = x.shape[-1], tuple(x.shape[:-1])
    data, scales = _outputs(out, x.device, ((*lead, k // 2), torch.uint8),
                            ((*lead, k // F.MX_BLOCK), torch.uint8))
    d2, s2 = _out_rows(data), _out_rows(scales)
    _quantize_mxfp4_into(x, rounding, d2.data_ptr(), _row_bytes(d2), s2.data_ptr(),
                         _row_bytes(s2))
    return data, scales


def quantize_mxfp4_rows(x, rounding="rceil", out=None, index=None):
    """``[..., K]`` -> packed MXFP4 rows uint8 ``[..., K/2 + K/32]`` in one pass.

    Arguments:
        x: as ``quantize_mxfp4``; rounding: ``"rceil"`` or ``"floor"``; out: None or the rows.
        index: None, or int64 ``[R]`` (x then ``[M, K]``): the ``R`` rows ``x[index]`` (a
            zero row where an index is outside ``[0, M)``), read in place by the kernel.
    Returns:
        uint8 ``[..., K/2 + K/32]`` (``[R, ...]`` with ``index``): each row's data bytes,
        then its E8M0 scale bytes.
    """
    _check_mxfp4_input(x, rounding)
    k = x.shape[-1]
    lead = tuple(x.shape[:-1])
    if index is not None:
        checks.matrix("x", x)
        checks.row_index("index", index, x.device)
        lead, index = (index.numel(),), index.contiguous()
    (rows,) = _outputs(out, x.device, ((*lead, F.mxfp4_row_bytes(k)), torch.uint8))
    r2 = _out_rows(rows)
    _quantize_mxfp4_into(x, rounding, r2.data_ptr(), _row_bytes(r2), r2.data_ptr() + k // 2,
                         _row_bytes(r2), index)
    return rows


def dequantize_mxfp4(data, scales, dtype=None, out=None):
    """MXFP4 ``(data [..., K/2], scales [..., K/32])`` -> ``dtype`` (default bf16) ``[..., K]``.

    Arguments:
        data: uint8 ``[..., K/2]``; scales: uint8 ``[..., K/32]`` (row-strided views allowed).
        dtype: bfloat16 (default), float16 or float32; out: None or the ``[..., K]`` output.
    Returns:
        ``[..., K]`` of ``dtype``: value(code) * 2^(b-127), exact; +-Inf beyond range; NaN
        for scale byte 255.
    """
    k = checks.mxfp4_pair(data, scales)
    dtype = checks.out_dtype(dtype)
    (result,) = _outputs(out, data.device, ((*data.shape[:-1], k), dtype))
    _dequantize_mxfp4_into(_rows(data), _rows(scales), _out_rows(result))
    return result


def _dequantize_mxfp4_into(d2, s2, out2):
    k = 2 * d2.shape[1]
    _flat_launch(d2.device, "mxfp4_quant", f"mxfp4_dequantize_{_SUFFIX[out2.dtype]}",
                 d2.shape[0] * (k // 8), k // 8,
                 (L.ptr(d2), L.i64(_row_bytes(d2)), L.ptr(s2), L.i64(_row_bytes(s2)),
                  L.ptr(out2), L.i64(_row_bytes(out2))))


def dequantize_mxfp4_rows(rows, dtype=None, k=None, out=None):
    """uint8 ``[..., K/2 + K/32]`` packed MXFP4 rows -> ``dtype`` (default bf16) ``[..., K]``."""
    return dequantize_mxfp4(*split_mxfp4_rows(rows, k), dtype, out)


# ---- FP8 E4M3 1x128 --------------------------------------------------------------------


def _fp8_outputs(out, m, k, device):
    """FP8 1x128 ``(data [M, K], scales [M, K/128])``: ``out`` checked, or new tensors with
    the scales stored as ``[K/128, M]`` (strides ``(1, M)``), as the reference's."""
    want = (((m, k), F.FP8_DTYPE), ((m, k // F.FP8_GROUP), torch.float32))
    if out is not None:
        return _outputs(out, device, *want, any_strides=(1,))
    return (torch.empty(m, k, dtype=F.FP8_DTYPE, device=device),
            torch.empty_strided((m, k // F.FP8_GROUP), (1, max(m, 1)), dtype=torch.float32,
                                device=device))


def _check_fp8_input(x):
    checks.float_input("x", x)
    checks.matrix("x", x)
    checks.multiple("x", x.shape[-1], F.FP8_GROUP)


def _quantize_fp8_into(x, data_ptr, data_row_bytes, scales_ptr, s_row, s_group, e8m0):
    x2 = _rows(x)
    m, k = x2.shape
    name = f"fp8_quantize_{_SUFFIX[x.dtype]}" + ("_e8m0" if e8m0 else "")
    _flat_launch(x.device, "fp8_quant", name, m * (k // 32), k // 32,
                 (L.ptr(x2), L.i64(_row_bytes(x2)), L.u64(data_ptr), L.i64(data_row_bytes),
                  L.u64(scales_ptr), L.i64(s_row), L.i64(s_group)))


def quantize_fp8(x, out=None):
    """bf16/fp16/fp32 ``[M, K]`` -> FP8 E4M3 with 1x128 power-of-two scales.

    Arguments:
        x: ``[M, K]`` bfloat16/float16/float32 CUDA tensor, ``K % 128 == 0``, any strides.
        out: None, or ``(data, scales)`` to write (see the module docstring).
    Returns:
        data: float8_e4m3fn ``[M, K]`` (a NaN/Inf group: every byte 0x7F).
        scales: float32 ``[M, K/128]`` with strides ``(1, M)`` (NaN for a NaN/Inf group).
    """
    _check_fp8_input(x)
    data, scales = _fp8_outputs(out, *x.shape, x.device)
    _quantize_fp8_into(x, data.data_ptr(), _row_bytes(data), scales.data_ptr(),
                       scales.stride(0), scales.stride(1), e8m0=False)
    return data, scales


def quantize_fp8_rows(x, out=None, index=None, scale=None):
    """``[M, K]`` -> packed FP8 rows uint8 ``[M, K + K/128]`` (E4M3 bytes, then E8M0 scales).
    ``index``: None, or int64 ``[R]``: the rows ``x[index]`` (zeros outside ``[0, M)``),
    read in place by the kernel; ``scale`` (with ``index``): None, or float32 ``[R]``, row
    r's values times ``scale[r]`` rounded to x's dtype, as that scaled copy would hold."""
    _check_fp8_input(x)
    m, k = x.shape
    checks.row_scale("scale", scale, index, x.device)
    if index is not None:
        checks.row_index("index", index, x.device)
    r = m if index is None else index.numel()
    (rows,) = _outputs(out, x.device, ((r, F.fp8_row_bytes(k)), torch.uint8))
    pitch = _row_bytes(rows)
    if index is None:
        _quantize_fp8_into(x, rows.data_ptr(), pitch, rows.data_ptr() + k, pitch, 1, e8m0=True)
        return rows
    x2, index = _rows(x), index.contiguous()
    scale = None if scale is None else scale.contiguous()
    _flat_launch(x.device, "fp8_quant", f"fp8_quantize_{_SUFFIX[x.dtype]}_e8m0_gather",
                 r * (k // 32), k // 32,
                 (L.ptr(x2), L.i64(_row_bytes(x2)), L.u64(rows.data_ptr()), L.i64(pitch),
                  L.u64(rows.data_ptr() + k), L.i64(pitch), L.i64(1)),
                 (L.ptr(index), L.i64(m), L.u64(0) if scale is None else L.ptr(scale)))
    return rows


def _dequantize_fp8_launch(data2, scales_ptr, s_row, s_group, e8m0, dtype, out):
    m, k = data2.shape
    (result,) = _outputs(out, data2.device, ((m, k), dtype))
    name = f"fp8_dequantize_{_SUFFIX[dtype]}" + ("_e8m0" if e8m0 else "")
    _flat_launch(data2.device, "fp8_quant", name, m * (k // 8), k // 8,
                 (L.ptr(data2), L.i64(_row_bytes(data2)), L.u64(scales_ptr), L.i64(s_row),
                  L.i64(s_group), L.ptr(result), L.i64(_row_bytes(result))))
    return result


def dequantize_fp8(data, scales, dtype=None, out=None):
    """FP8 1x128 ``(data [M, K], scales [M, K/128])`` -> ``dtype`` (default bf16) ``[M, K]``.

    Arguments:
        data: float8_e4m3fn ``[M, K]``; scales: float32 ``[M, K/128]`` (any strides).
        out: None or the ``[M, K]`` output.
    Returns:
        ``[M, K]`` of ``dtype``: data * scale, rounded once to float32 then to ``dtype``.
    """
    checks.fp8_pair(data, scales)
    dtype = checks.out_dtype(dtype)
    d2 = _rows(data).view(torch.uint8)
    return _dequantize_fp8_launch(d2, scales.data_ptr(), scales.stride(0), scales.stride(1),
                                  False, dtype, out)


def dequantize_fp8_rows(rows, dtype=None, k=None, out=None):
    """uint8 ``[M, K + K/128]`` packed FP8 rows -> ``dtype`` (default bf16) ``[M, K]``."""
    k = checks.packed_rows("rows", rows, "FP8", k)
    checks.matrix("rows", rows)
    dtype = checks.out_dtype(dtype)
    r2 = _rows(rows)
    return _dequantize_fp8_launch(r2[:, :k], r2.data_ptr() + k, r2.stride(0), 1, True, dtype,
                                  out)


# ---- MXFP4 -> FP8 ----------------------------------------------------------------------


def mxfp4_to_fp8(data, scales, counts=None, out=None):
    """MXFP4 ``[M, K]`` -> FP8 1x128, bit for bit ``quantize_fp8(dequantize_mxfp4(., f32))``.

    Arguments:
        data: uint8 ``[M, K/2]``; scales: uint8 ``[M, K/32]``; ``K % 128 == 0``.
        counts: None or int64 ``[3]`` on data's device: the kernel adds its inexact, NaN
            and total 128-group counts, exactly as ``reference.mxfp4_to_fp8`` defines them
            (a few atomics per CTA; no extra pass, no sync; outputs unchanged).
        out: None, or ``(data, scales)`` to write (see the module docstring).
    Returns:
        data: float8_e4m3fn ``[M, K]``; scales: float32 ``[M, K/128]`` strides ``(1, M)``.
    """
    k = checks.mxfp4_matrix_for_fp8(data, scales)
    checks.counts(counts, data.device)
    d2, s2 = _rows(data), _rows(scales)
    result, oscales = _fp8_outputs(out, d2.shape[0], k, data.device)
    _mxfp4_to_fp8_into(d2, s2, result, oscales, counts)
    return result, oscales


def _mxfp4_to_fp8_into(d2, s2, out, oscales, counts=None):
    """Launch the plain kernel, or with ``counts`` its counting instance (which takes it)."""
    m, k = out.shape
    name, extra = ("mxfp4_to_fp8_rows", ()) if counts is None else \
        ("mxfp4_to_fp8_rows_counted", (L.ptr(counts),))
    _flat_launch(d2.device, "mxfp4_to_fp8", name, m * (k // F.MX_BLOCK), k // F.MX_BLOCK,
                 (L.ptr(d2), L.i64(_row_bytes(d2)), L.ptr(s2), L.i64(_row_bytes(s2)),
                  L.ptr(out), L.i64(_row_bytes(out)), L.ptr(oscales), L.i64(oscales.stride(0)),
                  L.i64(oscales.stride(1))), extra)


def mxfp4_rows_to_fp8(rows, k=None, counts=None, out=None):
    """uint8 ``[M, K/2 + K/32]`` packed MXFP4 rows -> FP8 1x128, as ``mxfp4_to_fp8``
    (``counts`` and ``out`` too)."""
    return mxfp4_to_fp8(*split_mxfp4_rows_for_fp8(rows, k), counts, out)


def _segment_tiles(bounds):
    """Per 128-token output tile: (first row, end of its segment, output column)."""
    tiles, col = [], 0
    for start, end in zip(bounds, bounds[1:]):
        for t0 in range(start, end, F.FP8_GROUP):
            tiles += [t0, end, col]
            col += F.FP8_GROUP
    return tiles, col


@functools.lru_cache(maxsize=64)
def _tile_table(device, bounds):
    """``(device tile table, width, its host copy)`` of a segment layout, made once per
    (device, bounds). Uploaded from pinned memory without a device sync: a dropless layer's
    row count, and so its layout, can change at every step (AutoEP with EP > 1), and a
    pageable upload would wait for the GPU each time. The entry keeps the host copy alive
    for as long as the table."""
    tiles, width = _segment_tiles(bounds)
    if not tiles:
        return None, width, None
    host = torch.tensor(tiles, dtype=torch.int32)
    if device.type != "cuda":
        return host.to(device), width, host
    host = host.pin_memory()
    return host.to(device, non_blocking=True), width, host


def mxfp4_to_fp8_colwise(data, scales, offsets, counts=None, out=None):
    """MXFP4 token rows in ragged segments -> FP8 1x128 along tokens, transposed.

    Arguments:
        data: uint8 ``[T, K/2]``; scales: uint8 ``[T, K/32]``; ``K % 128 == 0``.
        offsets: ``[G+1]`` non-decreasing, 0 .. T: an int32/int64 tensor (CPU or data's
            device) or a list of ints. They are read on the host (the output width depends
            on them): pass a list or CPU tensor to avoid a device sync.
        counts: None or int64 ``[3]`` on data's device: adds the inexact, NaN and total
            column groups, as ``reference.mxfp4_to_fp8_colwise`` defines them.
        out: None, or ``(data, scales)`` to write, the scales a ``(1, K)``-strided view
            as returned (the kernel writes them ``[sum P_g / 128, K]``).
    Returns:
        data: float8_e4m3fn ``[K, sum P_g]`` (P_g = L_g rounded up to 128, zero padded).
        scales: float32 ``[K, sum P_g / 128]`` with strides ``(1, K)``.
    """
    k = checks.mxfp4_matrix_for_fp8(data, scales)
    bounds = checks.offsets(offsets, data.shape[0], data.device)
    checks.counts(counts, data.device)
    table, width, host = _tile_table(data.device, tuple(bounds))
    if table is not None:
        L.hold_while_captured(data.device, (table, host))
    result, oscales = _colwise_outputs(out, k, width, data.device)
    if table is not None and k:
        _colwise_into(_rows(data), _rows(scales), table, result, oscales, counts)
    return result, oscales.t()


def _colwise_outputs(out, k, width, device):
    """``(data [K, W], scales [W/128, K])`` from ``out`` (scales given as their transpose)."""
    want = (((k, width), F.FP8_DTYPE), ((k, width // F.FP8_GROUP), torch.float32))
    if out is None:
        return (torch.empty(k, width, dtype=F.FP8_DTYPE, device=device),
                torch.empty(width // F.FP8_GROUP, k, dtype=torch.float32, device=device))
    data, scales = _outputs(out, device, *want, any_strides=(1,))
    if scales.numel() > 1 and not scales.t().is_contiguous():
        raise ValueError(f"out[1] must be the scales' (1, K) layout, as returned (the "
                         f"transpose of a contiguous [W/128, K]); got strides {scales.stride()}")
    return data, scales.t()


def _colwise_into(d2, s2, table, out, oscales, counts=None):
    """Launch over the tiles of ``table`` (int32 [n, 3]) into ``out [K, W]``, ``oscales
    [W/128, K]``. CTAs: token tiles (fastest, so that the CTAs in flight fill whole output
    rows) x K/128 feature tiles. With ``counts``: the counting instance of the kernel."""
    k = out.shape[0]
    grid = (table.numel() // 3, k // _COLWISE_TILE_FEATURES)
    if grid[1] > L.GRID_YZ_MAX:
        raise ValueError(f"mxfp4_to_fp8_colwise: grid {grid} exceeds {L.GRID_YZ_MAX} in y; "
                         f"split the call along K")
    name, extra = ("mxfp4_to_fp8_colwise", ()) if counts is None else \
        ("mxfp4_to_fp8_colwise_counted", (L.ptr(counts),))
    L.launch(d2.device, "mxfp4_to_fp8_colwise", name, grid,
             (L.ptr(d2), L.i64(_row_bytes(d2)), L.ptr(s2), L.i64(_row_bytes(s2)),
              L.ptr(table), L.ptr(out), L.i64(_row_bytes(out)), L.ptr(oscales), L.u32(k),
              *extra))
