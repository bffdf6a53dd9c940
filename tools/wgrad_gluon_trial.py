"""Trial (not shipped): a Gluon kernel of the K-grouped FP8 weight gradient on Hopper.

Same contract as ``_k_grouped_kernel`` in ``ds_fp4.ops.grouped_gemm_triton``:
``out[g] (+)= a[g] @ b[g]^T`` over group g's token columns, both operands 1x128 along them,
scales applied per 128-wide K block with float32 accumulation. Correct on an H200 (the
GPU tests' shapes) but not faster than the Triton kernel there (0.92-1.17x bf16 in its best
config against 0.99-1.18x, bench/results/wgrad_trials_h200/), so it is kept here as the
starting point of the next attempt, not in ``ds_fp4/ops``.

Why try a second kernel: in Triton the promotion ``acc += dot * (sa * sb)`` waits for each K
block's wgmma, so the tensor cores idle while the CUDA cores scale (bench/NOTES_wgrad.md).
Gluon (Triton's explicit dialect) lets the kernel say what the compiler would not:

- a warp-specialized CTA, one per multiprocessor: a 1-warp producer that TMA-loads A and B
  into a ring of ``STAGES`` shared-memory stages ahead of use, across tile boundaries; and
  two consumer warpgroups that share each stage's B tile (128 x 128) and own 64 rows each
  of the 128-row A tile (DeepGEMM's cooperative layout: half the L2 traffic for B per FLOP
  of a 64-row tile);
- in each consumer, a K block's wgmma is waited on and then scaled into the accumulator;
  the other warpgroup's wgmma keeps the tensor cores busy meanwhile. (A variant that split
  B in two 64-column halves, to scale one half while the other half's wgmma ran, was no
  faster: ``gl`` in the results, code at commit 13075f6.)

Not run on the CPU (Gluon has no interpreter); a CPU test compiles it for sm_90 when the
installed Triton can.
"""

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ds_fp4 import formats
from ds_fp4.ops import grouped_gemm_triton as gt

# Triton 3.7 renamed the TMA load (3.6 ships with torch 2.11, 3.9 with 2.13)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

BK = gl.constexpr(formats.FP8_GROUP)   # one scale block along the token (K) dimension
BN = gl.constexpr(128)      # one B tile per stage, shared by both consumers
BH = gl.constexpr(64)       # rows of A per consumer warpgroup (wgmma's M atom x 4 warps)
BM = gl.constexpr(128)      # rows of a tile: two consumers
STAGES = 5   # the best of 3-6 in call 3
_HALF0, _HALF1 = gl.constexpr(0), gl.constexpr(1)   # which consumer


@gluon.jit
def _tile(t, tiles_m, per_group, coff_ptr, group_cols, FIXED: gl.constexpr):
    """``(group, tile along M, tile along N, first column, end column)`` of tile ``t``
    (M fastest within a group's N tile, as in the Triton kernel)."""
    grp = t // per_group
    local = t % per_group
    if FIXED:
        c0 = grp * group_cols
        c1 = c0 + group_cols
    else:
        c0 = gl.load(coff_ptr + grp)
        c1 = gl.load(coff_ptr + grp + 1)
    return grp, local % tiles_m, local // tiles_m, c0, c1


@gluon.jit
def _producer(a_desc, b_desc, sa_desc, sb_desc, a_smem, b_smem, sa_smem, sb_smem, ready, empty,
              coff_ptr, M, N, n_groups, group_cols, a_group_rows, b_group_rows, s_asg, s_asc,
              s_bsg, s_bsc, FIXED: gl.constexpr, A_CONCAT: gl.constexpr,
              B_CONCAT: gl.constexpr, STAGES: gl.constexpr):
    """One warp: TMA loads of each K block's A halves, B tile and their scale vectors into
    the ring, as far ahead as free stages allow, across tiles."""
    tiles_m = gl.cdiv(M, BM)
    per_group = tiles_m * gl.cdiv(N, BN)
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes \
        + 2 * sa_desc.block_type.nbytes + sb_desc.block_type.nbytes
    count = 0
    for t in range(gl.program_id(0), per_group * n_groups, gl.num_programs(0)):
        grp, tile_m, tile_n, c0, c1 = _tile(t, tiles_m, per_group, coff_ptr, group_cols,
                                            FIXED)
        a_row = grp * a_group_rows + tile_m * BM
        b_row = grp * b_group_rows + tile_n * BN
        # the scale tables are read as flat arrays (unit stride along the rows)
        sa_at = grp * s_asg + (c0 * A_CONCAT // BK) * s_asc + tile_m * BM
        sb_at = grp * s_bsg + (c0 * B_CONCAT // BK) * s_bsc + tile_n * BN
        for kb in range((c1 - c0) // BK):
            s = count % STAGES
            # a stage is free once both consumers arrived; the first pass waits on nothing
            mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            col_a = c0 * A_CONCAT + kb * BK
            col_b = c0 * B_CONCAT + kb * BK
            for h in gl.static_range(2):
                _tma_load(a_desc, [a_row + h * BH, col_a], bar, a_smem.index(2 * s + h))
                _tma_load(sa_desc, [sa_at + kb * s_asc + h * BH], bar, sa_smem.index(2 * s + h))
            _tma_load(b_desc, [b_row, col_b], bar, b_smem.index(s))
            _tma_load(sb_desc, [sb_at + kb * s_bsc], bar, sb_smem.index(s))
            count += 1


@gluon.jit
def _promote(acc, part, sa, sb):
    return acc + part * (sa[:, None] * sb[None, :])


@gluon.jit
def _consumer(a_smem, b_smem, sa_smem, sb_smem, ready, empty, out_ptr, coff_ptr, M, N,
                    n_groups, group_cols, s_og, s_om, s_on, HALF: gl.constexpr,
                    FIXED: gl.constexpr, ACCUMULATE: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: rows ``HALF * 64`` onwards of each 128-row tile, one 64 x 128 product
    per K block, waited on before it is scaled (DeepGEMM's order: the other warpgroup's
    wgmma keeps the tensor cores busy meanwhile)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BN, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma)
    zero = gl.zeros([BH, BN], gl.float32, mma)
    tiles_m = gl.cdiv(M, BM)
    per_group = tiles_m * gl.cdiv(N, BN)
    count = 0
    for t in range(gl.program_id(0), per_group * n_groups, gl.num_programs(0)):
        grp, tile_m, tile_n, c0, c1 = _tile(t, tiles_m, per_group, coff_ptr, group_cols,
                                            FIXED)
        acc = zero
        for kb in range((c1 - c0) // BK):
            s = count % STAGES
            mbarrier.wait(ready.index(s), (count // STAGES) & 1)
            cur = warpgroup_mma(a_smem.index(2 * s + HALF), b_smem.index(s).permute((1, 0)),
                                zero, use_acc=False, is_async=True)
            sa = sa_smem.index(2 * s + HALF).load(rows_layout)
            sb = sb_smem.index(s).load(cols_layout)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(cur,))
            mbarrier.arrive(empty.index(s), count=1)
            acc = _promote(acc, part, sa, sb)
            count += 1
        rows = tile_m * BM + HALF * BH + gl.arange(0, BH, layout=rows_layout)
        cols = tile_n * BN + gl.arange(0, BN, layout=cols_layout)
        _store(out_ptr, acc, grp, rows, cols, M, N, s_og, s_om, s_on, ACCUMULATE)


@gluon.jit
def _store(out_ptr, acc, grp, rows, cols, M, N, s_og, s_om, s_on, ACCUMULATE: gl.constexpr):
    ptrs = out_ptr + grp.to(gl.int64) * s_og + rows.to(gl.int64)[:, None] * s_om \
        + cols[None, :] * s_on
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if ACCUMULATE:
        acc += gl.load(ptrs, mask=mask, other=0.0).to(gl.float32)
    gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _k_grouped_ws_kernel(a_desc, b_desc, sa_desc, sb_desc, out_ptr, coff_ptr, M, N, n_groups,
                         group_cols, a_group_rows, b_group_rows, s_asg, s_asc, s_bsg, s_bsc,
                         s_og, s_om, s_on, FIXED: gl.constexpr, A_CONCAT: gl.constexpr,
                         B_CONCAT: gl.constexpr, ACCUMULATE: gl.constexpr,
                         STAGES: gl.constexpr):
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, BH, BK], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    sa_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BH], sa_desc.layout)
    sb_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BN], sb_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)   # one arrive per consumer warpgroup
    gl.warp_specialize([
        (_consumer, (a_smem, b_smem, sa_smem, sb_smem, ready, empty, out_ptr, coff_ptr, M, N,
                     n_groups, group_cols, s_og, s_om, s_on, _HALF0, FIXED, ACCUMULATE,
                     STAGES)),
        (_consumer, (a_smem, b_smem, sa_smem, sb_smem, ready, empty, out_ptr, coff_ptr, M, N,
                     n_groups, group_cols, s_og, s_om, s_on, _HALF1, FIXED, ACCUMULATE,
                     STAGES)),
        (_producer, (a_desc, b_desc, sa_desc, sb_desc, a_smem, b_smem, sa_smem, sb_smem,
                     ready, empty, coff_ptr, M, N, n_groups, group_cols, a_group_rows,
                     b_group_rows, s_asg, s_asc, s_bsg, s_bsc, FIXED, A_CONCAT, B_CONCAT,
                     STAGES)),
    ], [4, 1], [232, 40])


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _flat(scales):
    """The scale table as the flat float32 array it sits in (the kernel indexes it)."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(scales.shape, scales.stride()))
    return torch.as_strided(scales, (max(span, 1),), (1,))


def usable(a_scales, b_scales, a_strides, b_strides):
    """True when the scale tables suit the kernel's 1-D TMA loads: float32, unit stride along
    the rows, 16-byte aligned bases."""
    return all(s.dtype == torch.float32 and s.data_ptr() % 16 == 0 and st[1] == 1
               for s, st in ((a_scales, a_strides), (b_scales, b_strides)))


def _descriptor(t, block, dtype):
    layout = gl.NVMMASharedLayout.get_default_for(list(block), dtype)
    return TensorDescriptor.from_tensor(t, list(block), layout)


def launch(a, a_scales, b, b_scales, out, col_offsets, accumulate=False, group_cols=None,
           stages=STAGES):
    """``grouped_gemm_triton.launch_k_grouped``'s arguments; one CTA per multiprocessor."""
    a_cat, a_strides, a_group_rows = gt.k_operand_layout(a, a_scales)
    b_cat, b_strides, b_group_rows = gt.k_operand_layout(b, b_scales)
    if not usable(a_scales, b_scales, a_strides, b_strides):
        raise ValueError("the scale tables need float32, unit stride along the rows and "
                         "16-byte aligned bases")
    a2, b2 = gt._rows_view(a), gt._rows_view(b)
    n_groups, m, n = out.shape
    tiles = n_groups * triton.cdiv(m, BM.value) * triton.cdiv(n, BN.value)
    programs = max(1, min(tiles, _multiprocessors(a2.device.index or 0)))
    bh, bk = BH.value, BK.value
    _k_grouped_ws_kernel[(programs,)](
        _descriptor(a2, (bh, bk), gl.float8e4nv), _descriptor(b2, (BN.value, bk), gl.float8e4nv),
        _descriptor(_flat(a_scales), (bh,), gl.float32),
        _descriptor(_flat(b_scales), (BN.value,), gl.float32), out,
        col_offsets if col_offsets is not None else out, m, n, n_groups, group_cols or 0,
        a_group_rows, b_group_rows, a_strides[0], a_strides[2], b_strides[0], b_strides[2],
        *out.stride(), FIXED=col_offsets is None, A_CONCAT=a_cat, B_CONCAT=b_cat,
        ACCUMULATE=bool(accumulate), STAGES=stages, num_warps=4)
