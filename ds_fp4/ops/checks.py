"""Argument checks shared by the reference ops and the CUDA kernels.

CuPy checks no kernel argument, so every op validates here first; each message names the
argument, what it got and what was expected.
"""

import torch

from ds_fp4 import formats as F


def tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def dtype(name, t, allowed):
    tensor(name, t)
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} must have dtype {names}; got {str(t.dtype).replace('torch.', '')}")


def float_tensor(name, t):
    """A tensor of any floating-point dtype (the routes' gates)."""
    tensor(name, t)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor; got {t.dtype}")


def int_vector(name, t, n, device, what):
    """A device tensor of offsets or counts: int32/int64, 1-D with ``n`` entries (``what``
    says which), on ``device``."""
    dtype(name, t, (torch.int32, torch.int64))
    if t.dim() != 1 or t.numel() != n:
        raise ValueError(f"{name} must be 1-D with {what}; got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the operands on {device}")


def float_input(name, t):
    dtype(name, t, F.FLOAT_INPUT_DTYPES)
    if t.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension (the quantized one, K)")


def matrix(name, t):
    if t.dim() != 2:
        raise ValueError(
            f"{name} must be 2-D [M, K]; got shape {tuple(t.shape)} (reshape to (-1, K) first)")


def multiple(name, size, unit, what="its last dimension K"):
    if size % unit:
        raise ValueError(
            f"{name}: {what} = {size} is not a multiple of {unit}; pad it to a multiple of {unit}")


def int_at_least(name, value, least, what=""):
    """``value``: a Python int (not a bool) of at least ``least``; ``what`` (e.g. " (the
    experts' slots)") follows the bound in the message."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}{what}; got {value!r}")


def routes(name, t, rows_name, rows):
    """``t``: a ``[k, S]`` tensor of routes, S = ``rows`` (the rows of ``rows_name``)."""
    if t.dim() != 2 or t.shape[1] != rows:
        raise ValueError(f"{name} must be [k, S] with S = {rows_name}'s {rows} rows; got "
                         f"shape {tuple(t.shape)}")


def same_shape(name, t, like_name, like):
    if t.shape != like.shape:
        raise ValueError(f"{name} must have {like_name}' shape {tuple(like.shape)}; got "
                         f"{tuple(t.shape)}")


def same_device(**tensors):
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must be on one device; got {listing}")


def row_index(name, index, device):
    """``index``: int64, 1-D, on ``device`` (its values are the op's business)."""
    dtype(name, index, (torch.int64,))
    if index.dim() != 1:
        raise ValueError(f"{name} must be 1-D (one source row per output row); got shape "
                         f"{tuple(index.shape)} (flatten it first)")
    if index.device != device:
        raise ValueError(f"{name} is on {index.device}, the rows on {device}")


def row_scale(name, scale, index, device):
    """``scale``: None, or float32 ``[R]`` on ``device`` beside an ``index`` of R rows."""
    if scale is None:
        return
    if index is None:
        raise ValueError(f"{name} comes with index (the gathered rows' factors)")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 \
            or tuple(scale.shape) != (index.numel(),) or scale.device != device:
        raise ValueError(f"{name} must be float32 [{index.numel()}] (one factor per index "
                         f"entry) on {device}; got {getattr(scale, 'dtype', type(scale).__name__)} "
                         f"{tuple(getattr(scale, 'shape', ()))}")


def out_dtype(dtype_arg):
    if dtype_arg is None:
        return torch.bfloat16
    if dtype_arg not in F.FLOAT_INPUT_DTYPES:
        raise TypeError(f"dtype must be one of bfloat16, float16, float32; got {dtype_arg}")
    return dtype_arg


def out(value, want, device):
    """Check an op's ``out=``: None, or one tensor per output (a tuple for several) of the
    shapes and dtypes in ``want`` (``[(shape, dtype), ...]``) on ``device``; any strides.
    Returns the tensors as a tuple, or None."""
    if value is None:
        return None
    outs = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if len(outs) != len(want):
        raise ValueError(f"out must be {len(want)} tensor(s), one per output; got {len(outs)}")
    for i, (t, (shape, dt)) in enumerate(zip(outs, want)):
        name = "out" if len(want) == 1 else f"out[{i}]"
        tensor(name, t)
        if tuple(t.shape) != tuple(shape) or t.dtype != dt or t.device != device:
            raise ValueError(f"{name} must be {dt} {tuple(shape)} on {device}; got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    return outs


def rounding(value):
    if value not in F.MX_ROUNDINGS:
        raise ValueError(f"rounding must be one of {F.MX_ROUNDINGS}; got {value!r}")


def mxfp4_pair(data, scales):
    """Check an MXFP4 (data, scales) pair; return K."""
    dtype("data", data, (torch.uint8,))
    dtype("scales", scales, (torch.uint8,))
    same_device(data=data, scales=scales)
    if data.dim() < 1 or data.shape[:-1] != scales.shape[:-1] \
            or data.shape[-1] != scales.shape[-1] * (F.MX_BLOCK // 2):
        raise ValueError(
            f"data [..., K/2] and scales [..., K/32] do not match: data {tuple(data.shape)}, "
            f"scales {tuple(scales.shape)}")
    return data.shape[-1] * 2


def mxfp4_matrix_for_fp8(data, scales):
    """Check an MXFP4 pair ``[M, K/2]``, ``[M, K/32]`` that becomes FP8 1x128; return K."""
    k = mxfp4_pair(data, scales)
    matrix("data", data)
    multiple("data", k, F.FP8_GROUP, "K (2 * its last dimension)")
    return k


def fp8_pair(data, scales):
    """Check an FP8 1x128 (data [M, K], scales [M, K/128]) pair; return (M, K)."""
    dtype("data", data, (F.FP8_DTYPE,))
    dtype("scales", scales, (torch.float32,))
    same_device(data=data, scales=scales)
    matrix("data", data)
    m, k = data.shape
    multiple("data", k, F.FP8_GROUP)
    if tuple(scales.shape) != (m, k // F.FP8_GROUP):
        raise ValueError(
            f"scales must have shape [M, K/128] = {(m, k // F.FP8_GROUP)} for data "
            f"{tuple(data.shape)}; got {tuple(scales.shape)}")
    return m, k


# Packed row formats (FORMATS.md "Wire/cache packing"): bytes per unit, elements per unit.
ROW_FORMATS = {"MXFP4": (F.MXFP4_ROW_UNIT, F.MX_BLOCK), "FP8": (F.FP8_ROW_UNIT, F.FP8_GROUP)}


def _row_k(fmt, width):
    """K of a ``width``-byte row in ``fmt``, or None when no row of ``fmt`` is that wide."""
    unit, elems = ROW_FORMATS[fmt]
    return width // unit * elems if width % unit == 0 else None


def packed_rows(name, rows, fmt, k=None):
    """Check a packed uint8 row buffer of ``fmt`` (``"MXFP4"`` or ``"FP8"``); return K.

    Widths that are multiples of 17 * 129 = 2193 bytes fit both formats (2193 bytes: MXFP4
    rows of K = 4128 or FP8 rows of K = 2176), so rows handed to the wrong function would
    decode silently into the wrong shape. For such a width the caller must say K (``k``);
    without it this raises, naming both readings. ``k`` given: the width must be its row.
    """
    dtype(name, rows, (torch.uint8,))
    unit, elems = ROW_FORMATS[fmt]
    width = rows.shape[-1] if rows.dim() else None
    got = None if width is None else _row_k(fmt, width)
    if got is None:
        raise ValueError(
            f"{name}: last dimension {tuple(rows.shape)[-1:]} must be a multiple of {unit} bytes "
            f"(one packed row of K elements is {unit} bytes per {elems} elements)")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or k != got:
            raise ValueError(
                f"{name}: rows of {width} bytes are {fmt} rows of K = {got} elements, not "
                f"k = {k!r} (a {fmt} row of K elements is K * {unit} / {elems} bytes); pass "
                f"the rows' own K, or these may be rows of another format")
        return got
    other = next(f for f in ROW_FORMATS if f != fmt)
    other_k = _row_k(other, width)
    if other_k is not None:
        raise ValueError(
            f"{name}: a row of {width} bytes fits two formats: {fmt} rows of K = {got} or "
            f"{other} rows of K = {other_k} elements. Pass k={got} if these are {fmt} rows "
            f"(k = the elements per row, e.g. the hidden size); {other} rows need the "
            f"{other} function")
    return got


def offsets(offsets_t, rows, device):
    """Check segment offsets ([G+1], non-decreasing, 0 .. rows); return them as a list.

    ``offsets_t`` is an int32/int64 tensor on the CPU or on ``device``, or a list/tuple of
    ints. Host offsets (a list or a CPU tensor) spare a CUDA caller the device sync that
    reading a GPU tensor costs; the output width depends on them, so they are read anyway.
    """
    if isinstance(offsets_t, (list, tuple)):
        if not all(isinstance(v, int) for v in offsets_t):
            raise TypeError("offsets given as a list must hold Python ints")
        values = list(offsets_t)
    else:
        dtype("offsets", offsets_t, (torch.int32, torch.int64))
        if offsets_t.device.type != "cpu" and offsets_t.device != device:
            raise ValueError(f"offsets must be on the CPU or on {device} like data; "
                             f"got {offsets_t.device}")
        if offsets_t.dim() != 1:
            raise ValueError(f"offsets must be 1-D [G+1]; got shape {tuple(offsets_t.shape)}")
        values = offsets_t.tolist()
    if not values:
        raise ValueError("offsets must hold at least one value (G + 1 >= 1)")
    if values[0] != 0 or values[-1] != rows:
        raise ValueError(
            f"offsets must start at 0 and end at T = {rows} (the rows of data); "
            f"got {values[0]} .. {values[-1]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"offsets must be non-decreasing; got {values}")
    return values


def counts(value, device):
    """Check an optional exactness counter: None, or int64 ``[3]`` (``F.EXACTNESS_COUNTS``),
    contiguous, on ``device`` (the kernels add to it in place)."""
    if value is None:
        return
    dtype("counts", value, (torch.int64,))
    n = len(F.EXACTNESS_COUNTS)
    if tuple(value.shape) != (n,) or not value.is_contiguous():
        raise ValueError(f"counts must be a contiguous int64 tensor of shape ({n},) "
                         f"({', '.join(F.EXACTNESS_COUNTS)}); got shape {tuple(value.shape)}"
                         f"{'' if value.is_contiguous() else ', not contiguous'}")
    if value.device != device:
        raise ValueError(f"counts is on {value.device}, data on {device}; put the counters "
                         f"on the data's device")
