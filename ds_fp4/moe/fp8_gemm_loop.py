"""Per-expert FP8 GEMMs through torch's blockwise ``scaled_mm`` (cuBLASLt, Hopper only).

The experts' other GEMM path beside the grouped Triton kernels of
``ds_fp4.ops.grouped_gemm``: one cuBLASLt call per expert and GEMM kind. Each call costs
the host ~40-50 us, but cuBLASLt's blockwise kernels run large GEMMs faster on the GPU
(~1200 TFLOP/s over the six kinds at 8 experts x 4096 rows on an H200,
bench/results/grouped_experts_h200, against 473-807 for the grouped kernels when the
threshold was set: bench/results/grouped_gemm_h200.md; 536-902 since they load through TMA,
bench/results/tma_grouped_h200, threshold not re-measured), so ``FP8Experts`` takes this
path for large experts (``fp8_expert_passes.LOOP_MACS``).

``gemm_fp8_nt_1x128_128x128``: activations (1x128 groups along K) times a weight in 128x128
tiles; ``gemm_fp8_nt_1x128_1x128``: both operands 1x128 along K (weight gradients, K =
tokens); ``gemm_fp8_nt_many``: a list of same-shape GEMMs checked once. Without blockwise
``scaled_mm`` (CPU, other GPUs) they compute the same function through the dequantized
operands in float32.
"""

import functools

import torch

from ds_fp4 import formats as F
from ds_fp4 import ops
from ds_fp4.ops import checks
from ds_fp4.ops.fp8_tiles import check_fp8_tiles, dequantize_fp8_tiles

__all__ = ["gemm_fp8_nt_1x128_128x128", "gemm_fp8_nt_1x128_1x128", "gemm_fp8_nt_many",
           "native_blockwise_supported"]

G = F.FP8_GROUP
# cuBLASLt reads a 128x128 scale matrix with its K/128 side padded to a multiple of 4.
_SCALED_MM_K_TILE_ALIGN = 4
# Rows of the 1x128 operand are padded to a multiple of this before calling scaled_mm.
_SCALED_MM_M_ALIGN = 4


# ---- checks ----------------------------------------------------------------------------


def _check_1x128(name, sname, data, scales):
    checks.dtype(name, data, (F.FP8_DTYPE,))
    checks.dtype(sname, scales, (torch.float32,))
    checks.matrix(name, data)
    checks.multiple(name, data.shape[1], G)
    want = (data.shape[0], data.shape[1] // G)
    if tuple(scales.shape) != want:
        raise ValueError(f"{sname} must be [M, K/128] = {want} for {name} "
                         f"{tuple(data.shape)}; got {tuple(scales.shape)}")


def _check_pair(a, b, out_dtype):
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a [M, K] and b [N, K] must share K; got a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}")
    checks.same_device(a=a, b=b)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32; got {out_dtype}")


# ---- torch.nn.functional.scaled_mm -----------------------------------------------------


def _member(enum, *names):
    for name in names:
        if hasattr(enum, name):
            return getattr(enum, name)
    return None


@functools.lru_cache(maxsize=None)
def _scaled_mm_api():
    """``(scaled_mm, BlockWise1x128, BlockWise128x128, NO_SWIZZLE)`` or None.

    The enum members are spelled ``BlockWise1x128`` in recent torch and ``Blockwise_1x128``
    in some earlier builds; both are accepted.
    """
    nnf = torch.nn.functional
    fn, scaling = getattr(nnf, "scaled_mm", None), getattr(nnf, "ScalingType", None)
    if fn is None or scaling is None:
        return None
    r1x128 = _member(scaling, "BlockWise1x128", "Blockwise_1x128")
    r128x128 = _member(scaling, "BlockWise128x128", "Blockwise_128x128")
    if r1x128 is None or r128x128 is None:
        return None
    swizzle = getattr(nnf, "SwizzleType", None)
    no_swizzle = _member(swizzle, "NO_SWIZZLE", "NoSwizzle") if swizzle is not None else None
    return fn, r1x128, r128x128, no_swizzle


@functools.lru_cache(maxsize=None)
def _native_on(device_index):
    # torch implements the blockwise FP8 recipes with cuBLASLt on sm_90 only.
    return torch.cuda.get_device_capability(device_index)[0] == 9


def native_blockwise_supported(device):
    """True when FP8 GEMMs with 1x128/128x128 scales run on tensor cores on ``device``.

    Arguments:
        device: a ``torch.device``, a device string/index, or a tensor (its device).
    Returns:
        bool: a CUDA sm_90 device and a torch with blockwise ``nn.functional.scaled_mm``.
    """
    if isinstance(device, torch.Tensor):
        device = device.device
    device = torch.device(device) if not isinstance(device, torch.device) else device
    if device.type != "cuda" or not torch.cuda.is_available() or _scaled_mm_api() is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _native_on(index)


def _outer_major(scales):
    """1x128 scales ``[M, G]`` with exactly the strides ``(1, M)`` that scaled_mm checks
    (``.t().contiguous().t()`` would keep other strides on size-1 dimensions)."""
    m, g = scales.shape
    if scales.stride() == (1, m):
        return scales
    out = torch.empty_strided((m, g), (1, m), dtype=scales.dtype, device=scales.device)
    return out.copy_(scales)


def _tile_scales_for_b(scales):
    """128x128 scales ``[N/128, K/128]`` -> ``[round_up(K/128, 4), N/128]``, strides (1, that)."""
    kt = scales.shape[1]
    padded = -(-kt // _SCALED_MM_K_TILE_ALIGN) * _SCALED_MM_K_TILE_ALIGN
    if padded == kt and scales.is_contiguous():
        return scales.t()
    out = scales.new_ones(scales.shape[0], padded)   # the padding is never read
    out[:, :kt] = scales
    return out.t()


def _unit_inner_stride(t):
    """``t [R, C]`` with unit stride along C (a row slice or a column slice of a wider
    row-major matrix stays a view: cuBLASLt takes its leading dimension)."""
    return t if t.stride(1) == 1 and t.stride(0) >= max(1, t.shape[1]) else t.contiguous()


@functools.lru_cache(maxsize=None)
def _has_scaled_mm_out():
    return hasattr(torch, "_scaled_mm_v2") and hasattr(torch.ops.aten._scaled_mm_v2, "out")


def _scaled_mm_out_fn():
    """``torch._scaled_mm_v2`` when it has the ``out=`` overload, else None."""
    return torch._scaled_mm_v2 if _has_scaled_mm_out() else None


_out_broken = False    # set when the out= overload once refused a call: copy from then on
_strided_b_ok = True   # cleared when scaled_mm once refused a column slice as b


def _gemm_into(fn, a, b_t, a_scales, recipe_a, b_scales, recipe_b, no_swizzle, out):
    """``scaled_mm`` written straight into ``out`` when torch supports it; True if done."""
    global _out_broken
    out_fn = _scaled_mm_out_fn()
    if out is None or _out_broken or out_fn is None or fn is not getattr(
            torch.nn.functional, "scaled_mm", None) or out.stride(1) != 1:
        return False
    swizzle = [no_swizzle.value] if no_swizzle is not None else []
    try:
        out_fn(a, b_t, [a_scales], [recipe_a.value], swizzle, [b_scales], [recipe_b.value],
               swizzle, None, out.dtype, [], False, out=out)
    except (RuntimeError, TypeError):   # a torch whose out= path rejects these operands
        _out_broken = True
        return False
    return True


def _native_gemm(a, a_scales, recipe_a, b, b_scales, recipe_b, out_dtype, out=None):
    fn, _, _, no_swizzle = _scaled_mm_api()
    m = a.shape[0]
    pad = -m % _SCALED_MM_M_ALIGN
    if pad:   # keep the scale matrix's leading dimension (M floats) 16-byte aligned
        a = torch.cat((a.view(torch.uint8), a.new_zeros(pad, a.shape[1]).view(torch.uint8)))
        a = a.view(F.FP8_DTYPE)
        a_scales = torch.cat((a_scales, a_scales.new_ones(pad, a_scales.shape[1])))
    global _strided_b_ok
    a, a_scales = a.contiguous(), _outer_major(a_scales)
    b_t = (_unit_inner_stride(b) if _strided_b_ok else b.contiguous()).t()
    if not pad and _gemm_into(fn, a, b_t, a_scales, recipe_a, b_scales, recipe_b, no_swizzle,
                              out):
        return out
    # Lists, one scale per operand: what every version of the signature accepts.
    kwargs = {"output_dtype": out_dtype}
    if no_swizzle is not None:
        kwargs.update(swizzle_a=[no_swizzle], swizzle_b=[no_swizzle])
    try:
        res = fn(a, b_t, [a_scales], [recipe_a], [b_scales], [recipe_b], **kwargs)
    except RuntimeError:
        if b_t.t().is_contiguous():
            raise
        _strided_b_ok = False         # this torch wants b dense: copy column slices from now on
        res = fn(a, b.contiguous().t(), [a_scales], [recipe_a], [b_scales], [recipe_b], **kwargs)
    res = res[:m] if pad else res
    if out is None:
        return res
    out.copy_(res)
    return out


# ---- the GEMMs --------------------------------------------------------------------------


def _check_out(out, a, b, out_dtype):
    if out is None:
        return
    want = (a.shape[0], b.shape[0])
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != out_dtype \
            or out.device != a.device or out.stride(-1) != 1:
        raise ValueError(f"out must be {out_dtype} {want} on {a.device} with unit inner stride; "
                         f"got {getattr(out, 'dtype', None)} {tuple(getattr(out, 'shape', ()))}")


def _finish(res, out):
    if out is None:
        return res
    out.copy_(res)
    return out


def _empty_result(a, b, out_dtype):
    return torch.zeros(a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)


def gemm_fp8_nt_1x128_128x128(a, a_scales, w, w_scales, out_dtype=torch.bfloat16, out=None):
    """``a @ w^T`` with ``a`` in 1x128 groups and ``w`` in 128x128 tiles (forward, dgrad).

    Arguments:
        a: float8_e4m3fn ``[M, K]``, row-major; a_scales: float32 ``[M, K/128]`` (any strides).
        w: float8_e4m3fn ``[N, K]``; w_scales: float32 ``[N/128, K/128]`` (any strides).
        out_dtype: bfloat16 (default) or float32.
        out: optional ``[M, N]`` tensor of ``out_dtype`` with unit inner stride to write
            into (the GEMM writes it directly where torch allows, else through a copy).
    Returns:
        ``[M, N]`` of ``out_dtype`` (``out`` if given): sum_k a[m,k] sa[m,k/128] w[n,k]
        sw[n/128,k/128], accumulated in float32 (tensor cores on sm_90, float32 matmul
        elsewhere).
    """
    _check_1x128("a", "a_scales", a, a_scales)
    check_fp8_tiles("w", "w_scales", w, w_scales)
    _check_pair(a, w, out_dtype)
    _check_out(out, a, w, out_dtype)
    if a.shape[0] == 0:
        return _finish(_empty_result(a, w, out_dtype), out)
    if native_blockwise_supported(a.device):
        _, r1x128, r128x128, _ = _scaled_mm_api()
        return _native_gemm(a, a_scales, r1x128, w, _tile_scales_for_b(w_scales), r128x128,
                            out_dtype, out)
    a32 = ops.dequantize_fp8(a, a_scales, torch.float32)
    return _finish((a32 @ dequantize_fp8_tiles(w, w_scales).t()).to(out_dtype), out)


def gemm_fp8_nt_1x128_1x128(a, a_scales, b, b_scales, out_dtype=torch.bfloat16, out=None):
    """``a @ b^T`` with both operands in 1x128 groups along K (weight gradients, K = tokens).

    Arguments:
        a: float8_e4m3fn ``[M, K]``; a_scales: float32 ``[M, K/128]`` (any strides).
        b: float8_e4m3fn ``[N, K]`` (may be a column slice of a wider matrix: read in
            place); b_scales: float32 ``[N, K/128]`` (any strides).
        out_dtype: bfloat16 (default) or float32.
        out: optional ``[M, N]`` output, as for ``gemm_fp8_nt_1x128_128x128``.
    Returns:
        ``[M, N]`` of ``out_dtype`` (``out`` if given), accumulated in float32.
    """
    _check_1x128("a", "a_scales", a, a_scales)
    _check_1x128("b", "b_scales", b, b_scales)
    _check_pair(a, b, out_dtype)
    _check_out(out, a, b, out_dtype)
    if a.shape[0] == 0 or b.shape[0] == 0:
        return _finish(_empty_result(a, b, out_dtype), out)
    if native_blockwise_supported(a.device):
        _, r1x128, _, _ = _scaled_mm_api()
        return _native_gemm(a, a_scales, r1x128, b, _outer_major(b_scales), r1x128, out_dtype,
                            out)
    a32 = ops.dequantize_fp8(a, a_scales, torch.float32)
    b32 = ops.dequantize_fp8(b, b_scales, torch.float32)
    return _finish((a32 @ b32.t()).to(out_dtype), out)


def _fast_loop_ok(a, out):
    """Whether gemm_fp8_nt_many may call torch._scaled_mm_v2 directly for ``a``'s shape."""
    api = _scaled_mm_api()
    return (api is not None and native_blockwise_supported(a.device)
            and api[0] is getattr(torch.nn.functional, "scaled_mm", None)
            and hasattr(torch, "_scaled_mm_v2") and a.shape[0] % _SCALED_MM_M_ALIGN == 0
            and (out is None or (not _out_broken and _scaled_mm_out_fn() is not None)))


def gemm_fp8_nt_many(a, a_scales, b, b_scales, recipe_b="128x128", out=None,
                     out_dtype=torch.bfloat16):
    """``[a[g] @ b[g]^T for g]``: several same-shape GEMMs (one per local expert), checked
    once and issued with little host work each.

    Arguments:
        a, a_scales: lists of float8_e4m3fn ``[M, K]`` and float32 ``[M, K/128]``, as for the
            single GEMMs (all the same shape).
        b, b_scales: lists of float8_e4m3fn ``[N, K]`` and their scales: ``[N/128, K/128]``
            with ``recipe_b="128x128"`` (as ``gemm_fp8_nt_1x128_128x128``), ``[N, K/128]``
            with ``"1x128"`` (as ``gemm_fp8_nt_1x128_1x128``).
        out: optional list of ``[M, N]`` outputs of ``out_dtype`` (unit inner stride).
        out_dtype: bfloat16 (default) or float32.
    Returns:
        list of ``[M, N]`` results (the ``out`` tensors when given), equal to the single
        GEMMs' results.
    """
    if recipe_b not in ("128x128", "1x128"):
        raise ValueError(f"recipe_b must be '128x128' or '1x128'; got {recipe_b!r}")
    count = len(a)
    if len(a_scales) != count or len(b) != count or len(b_scales) != count or (
            out is not None and len(out) != count):
        raise ValueError("a, a_scales, b, b_scales (and out) must be lists of one length")
    single = gemm_fp8_nt_1x128_128x128 if recipe_b == "128x128" else gemm_fp8_nt_1x128_1x128
    outs = out if out is not None else [None] * count
    if count == 0:
        return []
    key = _signature(a[0], a_scales[0], b[0], b_scales[0], recipe_b, outs[0], out_dtype)
    fast = _fast_loop_ok(a[0], out)
    results, begin = [], 0
    if not (fast and key is not None and key in _checked):   # new kind: checked GEMM first
        results.append(single(a[0], a_scales[0], b[0], b_scales[0], out_dtype, outs[0]))
        if key is not None:
            _checked.add(key)
        begin = 1
    shapes = (a[0].shape, a_scales[0].shape, b[0].shape, b_scales[0].shape)
    api = _scaled_mm_api() or (None, None, None, None)
    for g in range(begin, count):
        if not fast or (a[g].shape, a_scales[g].shape, b[g].shape, b_scales[g].shape) != shapes:
            results.append(single(a[g], a_scales[g], b[g], b_scales[g], out_dtype, outs[g]))
        else:
            results.append(_fast_gemm(a[g], a_scales[g], b[g], b_scales[g], recipe_b, outs[g],
                                      out_dtype, *api[1:], single))
    return results


# Signatures of gemm_fp8_nt_many calls whose first GEMM passed the checked path: later calls
# of the same kind skip it (its checks cost more host time than the GEMM launch itself).
_checked = set()


def _signature(a, a_scales, b, b_scales, recipe_b, out, out_dtype):
    """What the single GEMM's checks depend on, for one GEMM of a gemm_fp8_nt_many call."""
    parts = [recipe_b, out_dtype]
    for t in (a, a_scales, b, b_scales):
        if not isinstance(t, torch.Tensor):
            return None               # not a tensor: never cached, the checked path says why
        parts += [t.dtype, tuple(t.shape), t.device]
    if out is not None:
        if not isinstance(out, torch.Tensor):
            return None
        parts += [out.dtype, tuple(out.shape), out.device, out.stride(-1)]
    return tuple(parts)


def _fast_gemm(a, a_scales, b, b_scales, recipe_b, out, out_dtype, r1x128, r128x128,
               no_swizzle, single):
    """One GEMM of gemm_fp8_nt_many straight through torch._scaled_mm_v2 (shapes already
    checked); any refusal falls back to the checked single GEMM."""
    global _out_broken
    b_t = (_unit_inner_stride(b) if _strided_b_ok else b.contiguous()).t()
    if recipe_b == "128x128":
        sb, rb = _tile_scales_for_b(b_scales), r128x128
    else:
        sb, rb = _outer_major(b_scales), r1x128
    swizzle = [no_swizzle.value] if no_swizzle is not None else []
    args = (a.contiguous(), b_t, [_outer_major(a_scales)], [r1x128.value], swizzle, [sb],
            [rb.value], swizzle, None, out_dtype, [], False)
    try:
        if out is None:
            return torch._scaled_mm_v2(*args)
        return torch._scaled_mm_v2(*args, out=out)
    except (RuntimeError, TypeError):
        if out is not None:
            _out_broken = True
        return single(a, a_scales, b, b_scales, out_dtype, out)
