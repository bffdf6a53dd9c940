"""The 128x128 weight-tile quantizer of the FP8 experts, in PyTorch (the twin of
``fp8_fused.tile_quant``'s kernel), and whether a device runs the grouped FP8 GEMMs.

The GEMMs themselves are ``ds_fp4.ops.grouped_gemm`` (one launch per GEMM kind for all
local experts).
"""

import functools
import importlib.util
import math

import torch

from ds_fp4 import formats as F
from ds_fp4.ops import checks
from ds_fp4.ops.reference import fp8_exponent

__all__ = ["quantize_fp8_tiles", "quantize_fp8_tile_groups", "dequantize_fp8_tiles",
           "grouped_fp8_supported"]

G = F.FP8_GROUP                      # the side of a 128x128 weight tile


# ---- 128x128 weight tiles ------------------------------------------------------------


def _tile_view(w):
    """``[N, K]`` (any strides) -> ``[N/128, 128, K/128, 128]`` view."""
    return w.unflatten(1, (-1, G)).unflatten(0, (-1, G))


def _scales_from_amax(amax):
    """Power-of-two scales for tile amaxes (float32, any shape).

    Returns:
        scales: 2^e, e the smallest integer with amax <= 448 * 2^e, clamped to [-126, 127];
            1.0 for an all-zero tile; NaN for a tile holding NaN or +-Inf.
        inverse: exactly 1 / scales (powers of two; 2^-127 is a float32 subnormal).
    """
    e = fp8_exponent(amax)
    # 2^e from its exponent bits: exact, and normal for every e in [-126, 127].
    scales = ((e.to(torch.int32) + 127) << 23).view(torch.float32)
    scales = torch.where(torch.isfinite(amax), scales, math.nan)
    return scales, 1.0 / scales


def _tile_amax(w):
    """max |x| per 128x128 tile, float32 ``[N/128 * K/128]`` (row-major over tiles).

    One read of ``w`` and no |w| temporary; NaN propagates and Inf stays Inf.
    """
    return torch.linalg.vector_norm(_tile_view(w), ord=math.inf, dim=(1, 3)).float().flatten()


def _check_weights(weights):
    if not weights:
        raise ValueError("quantize_fp8_tiles needs at least one weight [N, K]")
    first = weights[0]
    for i, w in enumerate(weights):
        name = f"weights[{i}]"
        checks.float_input(name, w)
        checks.matrix(name, w)
        checks.multiple(name, w.shape[0], G, "its first dimension N")
        checks.multiple(name, w.shape[1], G)
        if w.shape[1] != first.shape[1] or w.dtype != first.dtype or w.device != first.device:
            raise ValueError(
                f"{name} must share K, dtype and device with weights[0]: got {tuple(w.shape)} "
                f"{w.dtype} {w.device} vs {tuple(first.shape)} {first.dtype} {first.device}")


def quantize_fp8_tiles(*weights, transpose=False):
    """Quantize weights to FP8 E4M3 with 128x128 power-of-two tile scales (FORMATS.md).

    Several weights are quantized as their concatenation along N (tiles never span two of
    them, since every N is a multiple of 128), without materializing the concatenation.

    Arguments:
        *weights: one or more ``[N_i, K]`` bfloat16/float16/float32, ``N_i % 128 == 0``,
            ``K % 128 == 0``, same K, dtype and device; any strides.
        transpose: return the tiles of the transposed concatenation ``[K, sum N_i]``
            (for data-gradient GEMMs, which contract over N). The values are the same:
            tiles are square, so transposing and quantizing commute.
    Returns:
        data: float8_e4m3fn ``[sum N_i, K]`` (``[K, sum N_i]`` if ``transpose``), contiguous.
            Elements of a NaN tile are E4M3 NaN.
        scales: float32 ``[sum N_i / 128, K / 128]`` (its transpose if ``transpose``),
            contiguous; NaN for a tile holding NaN or +-Inf.
    """
    return quantize_fp8_tile_groups([weights], transpose)[0]


def quantize_fp8_tile_groups(groups, transpose=False):
    """``[quantize_fp8_tiles(*group, transpose=transpose) for group in groups]``, with the
    scale arithmetic (a dozen small kernels) done once for all groups.

    Arguments:
        groups: a list of tuples of weights; each tuple as ``quantize_fp8_tiles``'s
            ``weights`` (groups may differ in K and dtype, must share the device).
        transpose: as for ``quantize_fp8_tiles``.
    Returns:
        a list of ``(data, scales)``, one per group.
    """
    for group in groups:
        _check_weights(group)
    flat = [w for group in groups for w in group]
    checks.same_device(**{f"weights[{i}]": w for i, w in enumerate(flat)})
    all_scales, all_inverse = _scales_from_amax(torch.cat([_tile_amax(w) for w in flat]))
    # bf16/fp32 times a power of two is exact (fp16 cannot hold 2^-127..2^126: use fp32).
    compute = {w.dtype: torch.float32 if w.dtype == torch.float16 else w.dtype for w in flat}
    inverses = {d: all_inverse.to(d) for d in set(compute.values())}
    out, tile = [], 0
    for group in groups:
        n, k = sum(w.shape[0] for w in group), group[0].shape[1]
        tiles = n // G * (k // G)
        scales = all_scales[tile:tile + tiles].view(n // G, k // G)
        data = torch.empty((k, n) if transpose else (n, k), dtype=F.FP8_DTYPE,
                           device=flat[0].device)
        row = 0
        for w in group:
            rows, dtype = w.shape[0], compute[w.dtype]
            inverse = inverses[dtype][tile:tile + rows // G * (k // G)].view(rows // G, k // G)
            src = w.to(dtype)
            if transpose:
                dst, src, inverse = data[:, row:row + rows], src.t(), inverse.t()
            else:
                dst = data[row:row + rows]
            _mul_to_fp8(_tile_view(src), inverse[:, None, :, None], _tile_view(dst))
            row, tile = row + rows, tile + rows // G * (k // G)
        out.append((data, scales.t().contiguous() if transpose else scales))
    return out


def _mul_to_fp8(x, multiplier, out):
    """``out = fp8(x * multiplier)``; one pass where torch casts on store (it does on CPU)."""
    try:
        torch.mul(x, multiplier, out=out)
    except RuntimeError:   # a build that will not cast a float product into a float8 output
        out.copy_(x * multiplier)


def dequantize_fp8_tiles(data, scales, dtype=torch.float32):
    """FP8 128x128 tiles -> ``dtype``: ``data [N, K]`` times its tile's scale ``[N/128, K/128]``."""
    _check_tiles("data", "scales", data, scales)
    tiles = _tile_view(data.to(torch.float32)) * scales.to(torch.float32)[:, None, :, None]
    return tiles.flatten(2).flatten(0, 1).to(dtype)


def _check_tiles(name, sname, data, scales):
    checks.dtype(name, data, (F.FP8_DTYPE,))
    checks.dtype(sname, scales, (torch.float32,))
    checks.matrix(name, data)
    checks.multiple(name, data.shape[0], G, "its first dimension N")
    checks.multiple(name, data.shape[1], G)
    want = (data.shape[0] // G, data.shape[1] // G)
    if tuple(scales.shape) != want:
        raise ValueError(f"{sname} must be [N/128, K/128] = {want} for {name} "
                         f"{tuple(data.shape)}; got {tuple(scales.shape)}")


# ---- where the grouped FP8 GEMMs run on tensor cores --------------------------------------


@functools.lru_cache(maxsize=None)
def _hopper(device_index):
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def grouped_fp8_supported(device):
    """True when the experts' grouped FP8 GEMMs run on FP8 tensor cores on ``device``.

    Arguments:
        device: a ``torch.device``, a device string/index, or a tensor (its device).
    Returns:
        bool: a CUDA sm_90 (Hopper) device and an importable Triton (the kernels'
        compiler). The kernels also run on sm_89, but only Hopper has been measured, so
        ``fp8_experts: auto`` turns them on there only.
    """
    if isinstance(device, torch.Tensor):
        device = device.device
    device = torch.device(device) if not isinstance(device, torch.device) else device
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if importlib.util.find_spec("triton") is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _hopper(index)
