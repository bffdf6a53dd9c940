"""FP8 E4M3 128x128 weight tiles (FORMATS.md power-of-two tile scales): the PyTorch
quantizer and, for the FP8 experts, one kernel launch for all experts' weights.

- ``quantize_fp8_tiles(*weights, transpose)``, ``quantize_fp8_tile_groups`` and
  ``dequantize_fp8_tiles``: pure PyTorch, any device.
- ``tile_quant(weights, per_group, transpose)``: the tiles of ``len(weights)`` same-shape
  weights, grouped ``per_group`` at a time into one ``[per_group * R, C]`` operand per group
  (e.g. an expert's gate and up), in one launch of ``fp8_tiles.cu``; ``tile_quant_ref`` is
  its twin (``quantize_fp8_tile_groups``), same arguments, same bytes.
  ``tile_quant_stacked(stacks, transpose)``: the same for weights held as ``[G, R, C]``
  tensors (AutoEP's experts), without a Python list of per-expert views. CUDA tensors run the
  kernel where ``ds_fp4.ops.backend.uses_kernels`` says so (``set_kernels``), else the twin.
"""

import math

import torch

from ds_fp4 import formats as F
from ds_fp4.ops import _cuda_loader as L
from ds_fp4.ops import backend, checks
from ds_fp4.ops.reference import fp8_exponent

__all__ = ["quantize_fp8_tiles", "quantize_fp8_tile_groups", "dequantize_fp8_tiles",
           "check_fp8_tiles", "tile_quant", "tile_quant_stacked", "tile_quant_ref"]

G = F.FP8_GROUP                      # the side of a 128x128 weight tile
_SUFFIX = L.DTYPE_SUFFIX
_tables = {}         # (device index, pointers) -> (device int64 table, pinned host copy)
# Tables kept: each MoE layer's FP8 experts use two (first-layer and down weights; their
# transposes read the same addresses), and the calls cycle through the layers in order, so
# with fewer tables kept than a model has, first in first out would miss on every call
# (then a pinned upload each). 1024 cover 512 MoE layers; an entry holds 8 bytes per local
# weight twice (device and pinned host copy).
_TABLES_KEPT = 1024


# ---- the PyTorch quantizer ---------------------------------------------------------------


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
    check_fp8_tiles("data", "scales", data, scales)
    tiles = _tile_view(data.to(torch.float32)) * scales.to(torch.float32)[:, None, :, None]
    return tiles.flatten(2).flatten(0, 1).to(dtype)


def check_fp8_tiles(name, sname, data, scales):
    """Raise unless ``data`` (named ``name``) is float8 ``[N, K]`` in 128x128 tiles with
    float32 ``scales`` (``sname``) ``[N/128, K/128]``."""
    checks.dtype(name, data, (F.FP8_DTYPE,))
    checks.dtype(sname, scales, (torch.float32,))
    checks.matrix(name, data)
    checks.multiple(name, data.shape[0], G, "its first dimension N")
    checks.multiple(name, data.shape[1], G)
    want = (data.shape[0] // G, data.shape[1] // G)
    if tuple(scales.shape) != want:
        raise ValueError(f"{sname} must be [N/128, K/128] = {want} for {name} "
                         f"{tuple(data.shape)}; got {tuple(scales.shape)}")


# ---- all experts' weights in one launch --------------------------------------------------


def _check_tiles_args(weights, per_group):
    """Raise unless ``weights`` and ``per_group`` are ``tile_quant``'s; returns the weights'
    addresses, or None when one of them is not contiguous."""
    if not weights or per_group < 1 or len(weights) % per_group:
        raise ValueError(f"tile_quant needs a non-empty list of weights whose length is a "
                         f"multiple of per_group = {per_group}; got {len(weights)}")
    addresses = _check_alike("weights", weights, "[R, C]")
    first = weights[0]
    if first.dtype not in _SUFFIX:
        raise TypeError(f"weights must be bfloat16, float16 or float32; got {first.dtype}")
    if first.shape[0] % G or first.shape[1] % G:
        raise ValueError(f"weights [R, C] need R and C multiples of {G}; got "
                         f"{tuple(first.shape)}")
    return addresses


def _check_alike(name, tensors, layout):
    """Each of ``tensors`` (``name[i]``) a tensor of ``layout``'s rank (e.g. ``"[R, C]"``)
    with the shape, dtype and device of the first. Returns their addresses, or None when
    one of them is not contiguous: one loop over the weights (48 a call at 16 experts,
    four calls a step) for the checks and the kernel's pointer table."""
    first, dims = tensors[0], layout.count(",") + 1
    shape, dtype, device = first.shape, first.dtype, first.device
    addresses = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            raise ValueError(f"{name}[{i}] must be a {dims}-D tensor {layout}")
        if t.shape != shape or t.dtype != dtype or t.device != device:
            raise ValueError(f"{name}[{i}] must share shape, dtype and device with {name}[0]: "
                             f"{tuple(t.shape)} {t.dtype} {t.device} vs {tuple(shape)} "
                             f"{dtype} {device}")
        if addresses is not None:
            if t.is_contiguous():
                addresses.append(t.data_ptr())
            else:
                addresses = None
    return addresses


def tile_quant_ref(weights, per_group, transpose=False):
    """The PyTorch twin of ``tile_quant`` (same arguments, same bytes)."""
    _check_tiles_args(weights, per_group)
    groups = [tuple(weights[i:i + per_group]) for i in range(0, len(weights), per_group)]
    done = quantize_fp8_tile_groups(groups, transpose=transpose)
    return torch.stack([d for d, _ in done]), torch.stack([s for _, s in done])


def tile_quant(weights, per_group, transpose=False):
    """FP8 128x128 tiles of groups of weights, all in one launch.

    Arguments:
        weights: list of ``len = G * per_group`` tensors ``[R, C]``, bf16/fp16/fp32, same
            shape, dtype and device, ``R % 128 == C % 128 == 0``; group g is
            ``weights[g*per_group:(g+1)*per_group]`` stacked along R.
        per_group: weights per group (2 for an expert's gate and up, 1 for down).
        transpose: quantize each group's transpose (data-gradient GEMM operand).
    Returns:
        data: float8_e4m3fn ``[G, per_group*R, C]`` (``[G, C, per_group*R]`` if transpose).
        scales: float32 ``[G, per_group*R/128, C/128]`` (its per-group transpose if
            transpose); a tile holding NaN/Inf has scale NaN and all bytes E4M3 NaN.
    """
    addresses = _check_tiles_args(weights, per_group)
    first = weights[0]
    if not backend.uses_kernels(first) or addresses is None \
            or not _fits_grid(len(weights), first.shape[0]):
        return tile_quant_ref(weights, per_group, transpose)
    table = _pointer_table(first.device.index, tuple(addresses))
    return _launch_tiles(first, len(weights), per_group, table, transpose)


def tile_quant_stacked(stacks, transpose=False):
    """``tile_quant`` of weights held stacked, as AutoEP holds its experts' parameters.

    Arguments:
        stacks: a tuple of tensors ``[G, R, C]`` (same shape, dtype and device, as
            ``tile_quant``'s weights); group g is ``[s[g] for s in stacks]``.
        transpose: as for ``tile_quant``.
    Returns:
        ``tile_quant([s[g] for g in range(G) for s in stacks], len(stacks), transpose)``,
        the same bytes, without the per-expert views and their checks on every call.
    """
    _check_stacks(stacks)
    first = stacks[0]
    n, (r, c) = len(stacks), first.shape[1:]
    if not backend.uses_kernels(first) or not all(s.is_contiguous() for s in stacks) \
            or not _fits_grid(first.shape[0] * n, r):
        return tile_quant([s[g] for g in range(first.shape[0]) for s in stacks], n, transpose)
    pitch = r * c * first.element_size()   # bytes from one expert's weight to the next's
    bases = [s.data_ptr() for s in stacks]
    table = _pointer_table(first.device.index, tuple(
        b + g * pitch for g in range(first.shape[0]) for b in bases))
    return _launch_tiles(first[0], first.shape[0] * n, n, table, transpose)


def _check_stacks(stacks):
    if not isinstance(stacks, (tuple, list)) or not stacks:
        raise ValueError("tile_quant_stacked needs a non-empty tuple of [G, R, C] tensors")
    _check_alike("stacks", stacks, "[G, R, C]")
    first = stacks[0]
    if first.shape[0] == 0:
        raise ValueError("tile_quant_stacked needs at least one group: stacks[0] has G = 0")
    _check_tiles_args([first[0]], 1)


def _fits_grid(n_weights, rows):
    return n_weights <= L.GRID_YZ_MAX and rows // G <= L.GRID_YZ_MAX


def _launch_tiles(first, n_weights, per_group, table, transpose):
    """One launch of ``fp8_tiles.cu`` over ``n_weights`` weights shaped like ``first``
    (``[R, C]``), read through the device pointer ``table``."""
    r, c = first.shape
    groups = n_weights // per_group
    n = per_group * r
    shape = (groups, c, n) if transpose else (groups, n, c)
    data = torch.empty(shape, dtype=F.FP8_DTYPE, device=first.device)
    scales = torch.empty((groups,) + ((c // G, n // G) if transpose else (n // G, c // G)),
                         dtype=torch.float32, device=first.device)
    tiles = (n // G) * (c // G)
    if transpose:
        strides = (c * n, r, n, tiles, r // G, 1, n // G)
    else:
        strides = (n * c, r * c, c, tiles, (r // G) * (c // G), c // G, 1)
    out_g, out_j, out_pitch, sc_g, sc_j, sc_r, sc_c = (L.i64(s) for s in strides)
    name = f"fp8_tiles_{_SUFFIX[first.dtype]}" + ("_t" if transpose else "")
    args = (L.ptr(table), L.i64(c), L.u32(per_group), L.ptr(data),
            out_g, out_j, out_pitch, L.ptr(scales), sc_g, sc_j, sc_r, sc_c)
    L.launch(first.device, "fp8_tiles", name, (c // G, r // G, n_weights), args)
    return data, scales


def _pointer_table(index, addresses):
    """A device int64 table of weight ``addresses`` on CUDA device ``index``, cached
    (parameters rarely move); filled from pinned memory without a device synchronization."""
    key = (index, addresses)
    hit = _tables.get(key)
    if hit is None:
        host = torch.tensor(addresses, dtype=torch.int64).pin_memory()
        hit = (host.to(torch.device("cuda", index), non_blocking=True), host)
        if len(_tables) >= _TABLES_KEPT:
            _tables.pop(next(iter(_tables)))
        _tables[key] = hit
    L.hold_while_captured(torch.device("cuda", index), hit)    # the table and its source
    return hit[0]
