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

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ds_fp4 import formats

G = formats.FP8_GROUP


def _interpreted():
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# One config for every kind and size: BM 64 x BN 128 tiles (BN = one weight tile), 4 warps,
# 3 pipeline stages, operands through TMA descriptors, and for the weight gradients a
# persistent grid of 2 programs per multiprocessor. On an H200, at 32 x 640, 16 x 2560 and
# 8 x 4096 rows, these beat pointer loads, 128 x 128 / 64 x 256 / 128 x 256 tiles, 2-4
# stages, two K blocks per iteration, deferred promotion and warp specialization on every
# kind but one, where 128 x 128 was 0.6% ahead
# (bench/results/grouped_gemm_trials_h200_run{1,2}.md). The interpreter takes small tiles
# through ``config``.
BM, WARPS, STAGES = 64, 4, 3
_PROGRAMS_PER_SM = 2
_FLAT_MAX_K_BLOCKS = 8   # fixed-width weight gradients: see launch_k_grouped


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
        a_desc, as_ptr, w_desc, ws_ptr, out_ptr, offs_ptr, used_ptr,
        M, N, K, n_groups, group_rows,
        s_asg, s_ask, s_asm, s_wsg, s_wsn, s_wsk, s_om, s_on,
        FIXED: tl.constexpr, SCALES_PER_GROUP: tl.constexpr, USED: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``out[rows of g] = a[rows of g] @ w[g]^T``; a 1x128, w 128x128 tiles, bf16 out.

    ``a_desc``: ``[M, K]``, ``w_desc``: ``[G * N, K]`` (the groups' weights stacked), blocks
    ``[BM, BK]`` / ``[BN, BK]``. A tile's rows past its group read the next group's rows
    (or TMA's zeros past M): they only reach output rows that the store masks off.
    USED (FIXED only): group g's rows from ``used[g]`` on are zeros in a; a tile wholly
    past it stores zeros without its K loop.
    """
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
    g = tl.maximum(grp, 0)              # the zero tail reads group 0's scales (unused)
    srow0 = first - row0 if SCALES_PER_GROUP else first
    as_ptrs = as_ptr + g.to(tl.int64) * s_asg + srow0.to(tl.int64) * s_asm + local_m * s_asm
    # BN == BK: the N tile is one weight tile, one scale per K block (folded into the rows')
    ws_ptrs = ws_ptr + g.to(tl.int64) * s_wsg + tile_n * s_wsn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_blocks = tl.where(grp >= 0, tl.cdiv(K, BK), 0)   # the zero tail multiplies nothing
    if USED:
        k_blocks = tl.where(first - row0 < tl.load(used_ptr + g).to(tl.int32), k_blocks, 0)
    for kb in range(0, k_blocks):
        a = a_desc.load([first, kb * BK])
        w = w_desc.load([g * N + col0, kb * BK])
        sa = tl.load(as_ptrs + kb * s_ask, mask=mask_m, other=0.0)
        sw = tl.load(ws_ptrs + kb * s_wsk)
        acc += tl.dot(a, w.T) * (sa * sw)[:, None]
    out_ptrs = out_ptr + first.to(tl.int64) * s_om + col0 * s_on \
        + (local_m[:, None] * s_om + local_n[None, :] * s_on)
    acc = tl.where(grp >= 0, acc, 0.0)   # rows after the last group: zeros
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & (col0 + local_n < N)[None, :])


@triton.jit
def _k_grouped_kernel(
        a_desc, as_ptr, b_desc, bs_ptr, out_ptr, coff_ptr, used_ptr,
        M, N, n_groups, group_cols, a_group_rows, b_group_rows, programs,
        s_asg, s_asm, s_asc, s_bsg, s_bsn, s_bsc, s_og, s_om, s_on, out_desc,
        split_m, out2_delta,
        FIXED: tl.constexpr, A_CONCAT: tl.constexpr, B_CONCAT: tl.constexpr,
        ACCUMULATE: tl.constexpr, FLAT: tl.constexpr, TMA_OUT: tl.constexpr,
        SPLIT: tl.constexpr, USED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        BK: tl.constexpr):
    """``out[g] (+)= a[g] @ b[g]^T`` over group g's columns ``coff[g]:coff[g+1]`` (or
    ``g * group_cols`` onwards when FIXED): the token dimension, padded to multiples of 128;
    both operands 1x128 along it.

    Persistent: ``programs`` programs walk the (group, N tile, M tile) list, M fastest, so
    that a short group's tiles (few K blocks each) do not pay a program's start-up each.
    ``a_desc``/``b_desc``: ``[rows, columns]`` views, group g's rows from
    ``g * a_group_rows`` (0 for operands whose groups sit side by side along the columns).

    SPLIT: rows from ``split_m`` on (a multiple of BM) go to a second output of the same
    strides, ``out2_delta`` elements from ``out`` (e.g. the gate's and the up projection's
    gradients, each its own tensor, from one launch).

    FLAT (FIXED groups only: the K loop's trip count must be the same for every tile):
    ``flatten`` fuses the loop nest, so the next tile's loads are issued while this tile
    finishes; TMA_OUT: the tile is stored through ``out_desc`` (``out`` as ``[G * M, N]``,
    M a multiple of BM).

    USED (FIXED, not FLAT): group g's columns from ``used[g]`` on are zeros in both
    operands; the K loop stops at the block holding the last used column.
    """
    tiles_m = tl.cdiv(M, BM)
    per_group = tiles_m * tl.cdiv(N, BN)
    local_m = tl.arange(0, BM)
    local_n = tl.arange(0, BN)
    for tile in tl.range(tl.program_id(0), per_group * n_groups, programs, flatten=FLAT):
        grp = tile // per_group
        tile_m = tile % per_group % tiles_m
        tile_n = tile % per_group // tiles_m
        if FIXED:   # group_cols columns per group
            c0 = grp * group_cols
            c1 = c0 + group_cols
        else:
            c0 = tl.load(coff_ptr + grp)
            c1 = tl.load(coff_ptr + grp + 1)
        a_c0 = c0 if A_CONCAT else 0
        b_c0 = c0 if B_CONCAT else 0
        rows_m = tile_m * BM + local_m
        rows_n = tile_n * BN + local_n
        as_ptrs = as_ptr + grp.to(tl.int64) * s_asg + rows_m * s_asm + (a_c0 // BK) * s_asc
        bs_ptrs = bs_ptr + grp.to(tl.int64) * s_bsg + rows_n * s_bsn + (b_c0 // BK) * s_bsc
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        n_kb = group_cols // BK if FIXED else (c1 - c0) // BK   # FIXED: loop-invariant
        if USED:
            n_kb = tl.minimum(n_kb, tl.cdiv(tl.load(used_ptr + grp).to(tl.int32), BK))
        for kb in range(0, n_kb):
            a = a_desc.load([grp * a_group_rows + tile_m * BM, a_c0 + kb * BK])
            b = b_desc.load([grp * b_group_rows + tile_n * BN, b_c0 + kb * BK])
            sa = tl.load(as_ptrs + kb * s_asc, mask=rows_m < M, other=0.0)
            sb = tl.load(bs_ptrs + kb * s_bsc, mask=rows_n < N, other=0.0)
            acc += tl.dot(a, b.T) * (sa[:, None] * sb[None, :])
        if TMA_OUT:
            out_desc.store([grp * M + tile_m * BM, tile_n * BN], acc.to(out_ptr.dtype.element_ty))
        else:
            out_ptrs = out_ptr + grp.to(tl.int64) * s_og + rows_m.to(tl.int64)[:, None] * s_om \
                + rows_n[None, :] * s_on
            if SPLIT:   # the second output's rows start again at 0
                second = (tile_m * BM >= split_m).to(tl.int64)
                out_ptrs += second * (out2_delta - split_m.to(tl.int64) * s_om)
            mask = (rows_m < M)[:, None] & (rows_n < N)[None, :]
            if ACCUMULATE:
                acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---- launchers -----------------------------------------------------------------------------


def _rows_view(t):
    """``t`` (``[R, C]`` or ``[G, R, C]``) as a 2-D ``[rows, C]`` view a TMA descriptor takes
    (unit last stride, 16-byte aligned base and row stride); a copy only where it is not."""
    t2 = t.reshape(-1, t.shape[-1])
    if t2.stride(-1) != 1 or t2.stride(0) % 16 or t2.data_ptr() % 16:
        t2 = t2.contiguous()
    return t2


def _descriptor(t, block):
    return TensorDescriptor.from_tensor(_rows_view(t), list(block))


@functools.lru_cache(maxsize=None)
def _programs(device_index):
    """Programs of the persistent kernel: two per multiprocessor (measured best)."""
    return _PROGRAMS_PER_SM * torch.cuda.get_device_properties(device_index).multi_processor_count


def _config(config):
    """``(BM, launch options)`` of ``config`` (a ``triton.Config``) or the default; BN is
    always one weight tile, 128."""
    if config is None:
        return BM, {"num_warps": WARPS, "num_stages": STAGES}
    return config.kwargs["BM"], {"num_warps": config.num_warps, "num_stages": config.num_stages}


def launch_m_grouped(a, a_scales, w, w_scales, out, offsets, group_rows, scales_per_group,
                     config=None, rows_used=None):
    """Launch ``_m_grouped_kernel`` (arguments checked by the caller); ``config``: a
    ``triton.Config`` with ``BM`` instead of the default (benchmarks and tests);
    ``rows_used``: int ``[G]`` or None (``m_grouped_gemm_fp8_nt``).

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
    bm, opts = _config(config)
    tiles_n = triton.cdiv(n, G)
    if fixed:
        grid = (n_groups * triton.cdiv(group_rows, bm) * tiles_n,)
    else:   # sum_g ceil(L_g / BM) + the zero tail <= ceil(M / BM) + G + 1, without reading
        grid = ((triton.cdiv(m, bm) + n_groups + 1) * tiles_n,)   # the offsets on the host
    _m_grouped_kernel[grid](
        _descriptor(a, (bm, G)), a_scales, _descriptor(w, (G, G)), w_scales, out,
        offsets if offsets is not None else a_scales,
        rows_used if rows_used is not None else a_scales,
        m, n, k, n_groups, group_rows if fixed else 0,
        s_asg, s_ask, s_asm, *w_scales.stride(), out.stride(0), out.stride(1),
        FIXED=fixed, SCALES_PER_GROUP=scales_per_group, USED=fixed and rows_used is not None,
        BM=bm, BN=G, BK=G, **opts)


def _grouped_strides(t, concat):
    """``(group, row, column)`` strides of a grouped operand's scales: ``[G, R, C]`` keep
    theirs; a 2-D ``[R, sum C]`` one (groups side by side) has group stride 0."""
    if concat:
        return (0, *t.stride())
    return t.stride()


def k_operand_layout(t, scales):
    """``(concat, scales' (group, row, column) strides, rows per group)`` of a K-grouped
    operand: ``[R, sum P]`` (groups side by side: rows per group 0) or ``[G, R, P]``."""
    concat = t.dim() == 2
    return concat, _grouped_strides(scales, concat), 0 if concat else t.shape[1]


def launch_k_grouped(a, a_scales, b, b_scales, out, col_offsets, accumulate, config=None,
                     group_cols=None, out2=None, cols_used=None):
    """Launch ``_k_grouped_kernel``; ``a``/``b`` are ``[G, R, P]`` or ``[R, sum P]``; groups
    from device ``col_offsets`` or, when it is None, ``group_cols`` columns each. ``out2``:
    None, or a tensor of ``out``'s shape and strides that takes rows ``M/2`` on (``out``
    then holds the first half: M is ``2 * out.shape[1]``). ``cols_used``: int ``[G]`` or
    None (``k_grouped_gemm_fp8_nt``), read where the loop nest is not fused."""
    a_cat, a_strides, a_rows = k_operand_layout(a, a_scales)
    b_cat, b_strides, b_rows = k_operand_layout(b, b_scales)
    n_groups, m, n = out.shape
    split = out2 is not None
    if split:
        m *= 2
    delta = 0 if not split else (out2.data_ptr() - out.data_ptr()) // out.element_size()
    bm, opts = _config(config)
    tiles = n_groups * triton.cdiv(m, bm) * triton.cdiv(n, G)
    programs = tiles if _interpreted() else min(tiles, _programs(a.device.index or 0))
    fixed = col_offsets is None
    # Fused nest + TMA-store epilogue for fixed groups of few K blocks, where a tile's fixed
    # cost weighs most: at 640 columns (5 blocks) +7-8%, at 2560 and 4096 4-8% slower, on
    # an H200 (bench/results/wgrad_trials_h200, call 4)
    flat = fixed and 0 < (group_cols or 0) <= _FLAT_MAX_K_BLOCKS * G   # (0: not tried fused)
    # (out itself as the descriptor's tensor: _rows_view must not copy it)
    tma_out = flat and not split and not accumulate \
        and m % bm == 0 and out.is_contiguous() and n % 16 == 0 and out.data_ptr() % 16 == 0
    out_desc = TensorDescriptor.from_tensor(out.view(-1, n), [bm, G]) if tma_out else None
    _k_grouped_kernel[(programs,)](
        _descriptor(a, (bm, G)), a_scales, _descriptor(b, (G, G)), b_scales, out,
        col_offsets if col_offsets is not None else out,
        cols_used if cols_used is not None else out, m, n, n_groups, group_cols or 0,
        a_rows, b_rows, programs, *a_strides, *b_strides, *out.stride(), out_desc,
        m // 2 if split else m, delta,
        FIXED=fixed, A_CONCAT=a_cat, B_CONCAT=b_cat, ACCUMULATE=bool(accumulate), FLAT=flat,
        TMA_OUT=tma_out, SPLIT=split, USED=fixed and not flat and cols_used is not None,
        BM=bm, BN=G, BK=G, **opts)

