"""Triton kernels of the grouped FP8 GEMMs with DeepSeek-V3 block scaling.

Imported only when a grouped GEMM runs on CUDA tensors (or under ``TRITON_INTERPRET=1``,
which the CPU tests use): Triton ships with every CUDA build of torch, not with the CPU one.

Both kernels accumulate in float32 and apply the scales once per 128-wide K block
(``acc += dot(a_blk, b_blk) * sa * sb``, DeepSeek-V3's promotion), so their results equal
float32 math on the dequantized operands to float32 rounding. The public functions, their
argument checks and the pure-PyTorch twins are in ``ds_fp4.ops.grouped_gemm``.

Why Triton and not a CuPy RawKernel: Triton emits Hopper's wgmma (QGMMA for FP8) and its
software pipelining from these ~40 lines, which a hand-written CUDA C kernel would need
inline PTX, shared-memory swizzles and a pipeline of its own to match.
"""

import functools
import os

import triton
import triton.language as tl

from ds_fp4 import formats

G = formats.FP8_GROUP


def _interpreted():
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _configs(kinds):
    """Autotuning candidates from ``(BM, BN, warps, stages)``; one when interpreted."""
    if _interpreted():
        kinds = [(32, 128, 4, 1)]
    return [triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in kinds]


# (BM, BN, warps, stages). Two accumulators (the running sum and the K block's product)
# live in registers: 128 x 256 and 256 x 128 tiles spill or lose (203-384 TFLOP/s with 16
# warps), 4-stage pipelines gain nothing; these led every kind on an H200
# (bench/results/grouped_gemm_h200.md, every candidate timed).
_M_GROUPED = ((128, 128, 8, 3), (64, 128, 4, 3))
_K_GROUPED = ((128, 128, 8, 3), (64, 128, 4, 3))


@triton.jit
def _find_group(offs_ptr, tile, n_groups, n_rows, tiles_n, BM: tl.constexpr):
    """``(group, first row, end row, tile along M, tile along N)`` of program ``tile``.

    The programs of one group are consecutive, M fastest, so the programs in flight share a
    group's weight panel and rows in L2. Past the last group come the tiles of the rows
    after it (``offsets[G]`` to ``M``: group -2, written as zeros), then group -1 (nothing).
    """
    grp = -1
    row0 = 0
    end = 0
    local = 0
    count = 0
    before = 0
    for i in range(n_groups):
        lo = tl.load(offs_ptr + i)
        hi = tl.load(offs_ptr + i + 1)
        tiles_m = tl.cdiv(hi - lo, BM)
        n_tiles = tiles_m * tiles_n
        hit = (tile >= before) & (tile < before + n_tiles)
        grp = tl.where(hit, i, grp)
        row0 = tl.where(hit, lo, row0)
        end = tl.where(hit, hi, end)
        local = tl.where(hit, tile - before, local)
        count = tl.where(hit, tiles_m, count)
        before += n_tiles
    tail0 = tl.load(offs_ptr + n_groups)
    tail_m = tl.cdiv(n_rows - tail0, BM)
    tail = (grp < 0) & (tile >= before) & (tile < before + tail_m * tiles_n)
    grp = tl.where(tail, -2, grp)
    row0 = tl.where(tail, tail0, row0)
    end = tl.where(tail, n_rows, end)
    local = tl.where(tail, tile - before, local)
    count = tl.where(tail, tail_m, count)
    count = tl.maximum(count, 1)
    return grp, row0, end, local % count, local // count


@triton.jit
def _m_grouped_kernel(
        a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, offs_ptr,
        M, N, K, n_groups, group_rows,
        s_am, s_ak, s_asg, s_ask, s_asm,
        s_wg, s_wn, s_wk, s_wsg, s_wsn, s_wsk,
        s_om, s_on,
        FIXED: tl.constexpr, SCALES_PER_GROUP: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``out[rows of g] = a[rows of g] @ w[g]^T``; a 1x128, w 128x128 tiles, bf16 out."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    if FIXED:   # groups of group_rows rows each: the group follows from the tile index
        per_group = tl.cdiv(group_rows, BM) * tiles_n
        grp = pid // per_group
        local = pid % per_group
        row0 = grp * group_rows
        end = row0 + group_rows
        tile_m = local % tl.cdiv(group_rows, BM)
        tile_n = local // tl.cdiv(group_rows, BM)
        grp = tl.where(grp < n_groups, grp, -1)
    else:
        grp, row0, end, tile_m, tile_n = _find_group(offs_ptr, pid, n_groups, M, tiles_n, BM)
    if grp == -1:
        return
    first = row0 + tile_m * BM          # the tile's first row, first column
    col0 = tile_n * BN
    local_m = tl.arange(0, BM)          # tile-local offsets stay 32-bit; bases are 64-bit
    local_n = tl.arange(0, BN)
    mask_m = first + local_m < end
    mask_n = col0 + local_n < N
    ks = tl.arange(0, BK)
    g64 = tl.maximum(grp, 0).to(tl.int64)   # the zero tail reads group 0's tiles (unused)
    a_ptrs = a_ptr + first.to(tl.int64) * s_am + (local_m[:, None] * s_am + ks[None, :] * s_ak)
    w_ptrs = w_ptr + g64 * s_wg + col0.to(tl.int64) * s_wn \
        + (local_n[None, :] * s_wn + ks[:, None] * s_wk)
    srow0 = first - row0 if SCALES_PER_GROUP else first
    as_ptrs = as_ptr + g64 * s_asg + srow0.to(tl.int64) * s_asm + local_m * s_asm
    # BN == 128 spans one weight tile: one scale per K block, folded into the row scales
    ws_ptrs = ws_ptr + g64 * s_wsg + (col0 // BK) * s_wsn
    ws_cols = ws_ptrs + (local_n // BK) * s_wsn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_blocks = tl.where(grp >= 0, tl.cdiv(K, BK), 0)   # the zero tail multiplies nothing
    for kb in range(0, k_blocks):
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[None, :], other=0.0)
        sa = tl.load(as_ptrs + kb * s_ask, mask=mask_m, other=0.0)
        if BN == BK:
            sw = tl.load(ws_ptrs + kb * s_wsk)
            acc += tl.dot(a, w) * (sa * sw)[:, None]
        else:
            sw = tl.load(ws_cols + kb * s_wsk, mask=mask_n, other=0.0)
            acc += tl.dot(a, w) * (sa[:, None] * sw[None, :])
        a_ptrs += BK * s_ak
        w_ptrs += BK * s_wk
    out_ptrs = out_ptr + first.to(tl.int64) * s_om + col0 * s_on \
        + (local_m[:, None] * s_om + local_n[None, :] * s_on)
    acc = tl.where(grp >= 0, acc, 0.0)   # rows after the last group: zeros
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _k_grouped_kernel(
        a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, coff_ptr,
        M, N, group_cols,
        s_ag, s_am, s_ac, s_asg, s_asm, s_asc,
        s_bg, s_bn, s_bc, s_bsg, s_bsn, s_bsc,
        s_og, s_om, s_on,
        FIXED: tl.constexpr, A_CONCAT: tl.constexpr, B_CONCAT: tl.constexpr,
        ACCUMULATE: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``out[g] (+)= a[g] @ b[g]^T`` over group g's columns ``coff[g]:coff[g+1]`` (or
    ``g * group_cols`` onwards when FIXED): the token dimension, padded to multiples of 128;
    both operands 1x128 along it."""
    pid = tl.program_id(0)
    grp = tl.program_id(1)
    tiles_m = tl.cdiv(M, BM)
    tile_m = pid % tiles_m
    tile_n = pid // tiles_m
    if FIXED:   # group_cols columns per group
        c0 = grp * group_cols
        c1 = c0 + group_cols
    else:
        c0 = tl.load(coff_ptr + grp)
        c1 = tl.load(coff_ptr + grp + 1)
    # segment starts are multiples of 128: telling the compiler keeps the loads vectorized
    c0 = tl.multiple_of(c0, BK)
    local_m = tl.arange(0, BM)
    local_n = tl.arange(0, BN)
    mask_m = tile_m * BM + local_m < M
    mask_n = tile_n * BN + local_n < N
    ks = tl.arange(0, BK)
    g64 = grp.to(tl.int64)
    a_c0 = c0 if A_CONCAT else 0
    b_c0 = c0 if B_CONCAT else 0
    a_ptrs = a_ptr + g64 * s_ag + (tile_m * BM).to(tl.int64) * s_am + a_c0.to(tl.int64) * s_ac \
        + (local_m[:, None] * s_am + ks[None, :] * s_ac)
    b_ptrs = b_ptr + g64 * s_bg + (tile_n * BN).to(tl.int64) * s_bn + b_c0.to(tl.int64) * s_bc \
        + (local_n[None, :] * s_bn + ks[:, None] * s_bc)
    as_ptrs = as_ptr + g64 * s_asg + (tile_m * BM).to(tl.int64) * s_asm \
        + (a_c0 // BK) * s_asc + local_m * s_asm
    bs_ptrs = bs_ptr + g64 * s_bsg + (tile_n * BN).to(tl.int64) * s_bsn \
        + (b_c0 // BK) * s_bsc + local_n * s_bsn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, (c1 - c0) // BK):
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        sa = tl.load(as_ptrs + kb * s_asc, mask=mask_m, other=0.0)
        sb = tl.load(bs_ptrs + kb * s_bsc, mask=mask_n, other=0.0)
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        a_ptrs += BK * s_ac
        b_ptrs += BK * s_bc
    out_ptrs = out_ptr + g64 * s_og + (tile_m * BM).to(tl.int64) * s_om + (tile_n * BN) * s_on \
        + (local_m[:, None] * s_om + local_n[None, :] * s_on)
    mask = mask_m[:, None] & mask_n[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _tuned(kernel_name):
    """The autotuned launcher of a kernel, made on first use (autotuning runs per key)."""
    if kernel_name == "m":
        return triton.autotune(_configs(_M_GROUPED), key=["N", "K", "FIXED"])(_m_grouped_kernel)
    # restore_value: the timing runs must not accumulate into a caller's gradient
    return triton.autotune(_configs(_K_GROUPED), key=["M", "N", "FIXED", "ACCUMULATE"],
                           restore_value=["out_ptr"])(_k_grouped_kernel)


def _launcher(name, config):
    """The autotuned kernel, or with ``config`` (a ``triton.Config``) that config alone."""
    if config is None:
        return _tuned(name), {}
    kernel = _m_grouped_kernel if name == "m" else _k_grouped_kernel
    return kernel, {**config.kwargs, "num_warps": config.num_warps,
                    "num_stages": config.num_stages}


def configs(name):
    """The autotuning candidates of kernel ``"m"`` or ``"k"`` (``triton.Config`` list)."""
    return _configs(_M_GROUPED if name == "m" else _K_GROUPED)


def launch_m_grouped(a, a_scales, w, w_scales, out, offsets, group_rows, scales_per_group,
                     config=None):
    """Launch ``_m_grouped_kernel`` (arguments checked by the caller); ``config``: one
    ``triton.Config`` instead of autotuning (benchmarks and tests).

    ``a_scales`` is indexed ``(group, K block, row)`` with the strides given by
    ``scales_per_group``: True -> a ``[G, K/128, rows]`` tensor of per-group rows, False ->
    a ``[K/128, M]``-strided view over all rows (group stride 0).
    """
    n_groups, n, k = w.shape
    m = a.shape[0]
    if scales_per_group:
        s_asg, s_ask, s_asm = a_scales.stride()
    else:
        s_asm, s_ask = a_scales.stride()
        s_asg = 0
    fixed = offsets is None

    def grid(meta):
        tiles_n = triton.cdiv(n, meta["BN"])
        if fixed:
            return (n_groups * triton.cdiv(group_rows, meta["BM"]) * tiles_n,)
        # sum_g ceil(L_g / BM) + the zero tail <= ceil(M / BM) + G + 1, without reading the
        # offsets on the host
        return ((triton.cdiv(m, meta["BM"]) + n_groups + 1) * tiles_n,)

    kernel, meta = _launcher("m", config)
    kernel[grid](
        a, a_scales, w, w_scales, out, offsets if offsets is not None else a_scales,
        m, n, k, n_groups, group_rows if fixed else 0,
        a.stride(0), a.stride(1), s_asg, s_ask, s_asm,
        *w.stride(), *w_scales.stride(), out.stride(0), out.stride(1),
        FIXED=fixed, SCALES_PER_GROUP=scales_per_group, BK=G, **meta)


def _grouped_strides(t, concat):
    """``(group, row, column)`` strides of a grouped operand: ``[G, R, C]`` tensors keep
    theirs; a 2-D ``[R, sum C]`` operand (groups side by side) has group stride 0."""
    if concat:
        return (0, *t.stride())
    return t.stride()


def launch_k_grouped(a, a_scales, b, b_scales, out, col_offsets, accumulate, config=None,
                     group_cols=None):
    """Launch ``_k_grouped_kernel``; ``a``/``b`` are ``[G, R, P]`` or ``[R, sum P]``; groups
    from device ``col_offsets`` or, when it is None, ``group_cols`` columns each."""
    a_cat, b_cat = a.dim() == 2, b.dim() == 2
    n_groups, m, n = out.shape

    def grid(meta):
        return (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]), n_groups)

    kernel, meta = _launcher("k", config)
    kernel[grid](
        a, a_scales, b, b_scales, out, col_offsets if col_offsets is not None else out, m, n,
        group_cols or 0, *_grouped_strides(a, a_cat), *_grouped_strides(a_scales, a_cat),
        *_grouped_strides(b, b_cat), *_grouped_strides(b_scales, b_cat),
        *out.stride(), FIXED=col_offsets is None, A_CONCAT=a_cat, B_CONCAT=b_cat,
        ACCUMULATE=bool(accumulate), BK=G,
        **meta)
