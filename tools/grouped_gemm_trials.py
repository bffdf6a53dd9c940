"""Trial variants of the grouped FP8 GEMM kernels, timed beside the shipped ones (GPU only).

A workbench for issue 18: each variant computes what ``ds_fp4.ops.grouped_gemm_triton``'s
kernels compute (checked against the shipped kernel's output, relative Frobenius error),
with one change to the kernel's structure:

- ``u2``: two 128-wide K blocks per loop iteration, two independent dots, so that the scale
  promotion of the first (CUDA cores) can run while the tensor cores do the second.
- ``dfr``: the promotion deferred by one iteration (the previous block's product is scaled
  after the next block's dot is issued).
- ``tma``: the shipped structure with the operands loaded through device-side tensor
  descriptors (TMA).
- ``p1``, ``p2``: ``tma`` on a persistent grid of 1 or 2 programs per multiprocessor
  (weight gradients); ``p2f`` with the loop nest flattened, ``p1ws`` warp-specialized.
- ``gw<S>``: the Gluon kernel of ``wgrad_gluon_trial`` with S stages.
- ``shipx``: the shipped weight-gradient kernel with fixed-width groups (fused nest and
  TMA store where it ships them).

Times are GPU medians (L2 flushed) in TFLOP/s next to bf16 ``torch._grouped_mm``::

    python tools/grouped_gemm_trials.py --out /tmp/trials
"""

import argparse
import itertools

import torch
import triton
import triton.language as tl

import bench_common
import bench_grouped_gemm as bg
from ds_fp4.ops import grouped_gemm_triton as gt

BK = 128


# ---- K-grouped (weight gradients): out[g] = a[:, cols of g] @ b[:, cols of g]^T --------------

@triton.jit
def _k_trial(a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, coff_ptr, M, N, C,
             s_am, s_asm, s_asc, s_bn, s_bsn, s_bsc, s_og, s_om,
             MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    grp = tl.program_id(1)
    tiles_m = tl.cdiv(M, BM)
    tm = pid % tiles_m
    tn = pid // tiles_m
    c0 = tl.multiple_of(tl.load(coff_ptr + grp), BK)
    c1 = tl.load(coff_ptr + grp + 1)
    nkb = (c1 - c0) // BK
    rm = tm * BM + tl.arange(0, BM)
    rn = tn * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    mask_m = rm < M
    mask_n = rn < N
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * s_am + (c0 + ks)[None, :]
    b_ptrs = b_ptr + rn.to(tl.int64)[None, :] * s_bn + (c0 + ks)[:, None]
    as_ptrs = as_ptr + rm * s_asm + (c0 // BK) * s_asc
    bs_ptrs = bs_ptr + rn * s_bsn + (c0 // BK) * s_bsc
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if MODE == 1:   # u2: two K blocks an iteration
        for kb in range(0, nkb // 2):
            a0 = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b0 = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
            a1 = tl.load(a_ptrs + BK, mask=mask_m[:, None], other=0.0)
            b1 = tl.load(b_ptrs + BK, mask=mask_n[None, :], other=0.0)
            sa0 = tl.load(as_ptrs + (2 * kb) * s_asc, mask=mask_m, other=0.0)
            sb0 = tl.load(bs_ptrs + (2 * kb) * s_bsc, mask=mask_n, other=0.0)
            sa1 = tl.load(as_ptrs + (2 * kb + 1) * s_asc, mask=mask_m, other=0.0)
            sb1 = tl.load(bs_ptrs + (2 * kb + 1) * s_bsc, mask=mask_n, other=0.0)
            d0 = tl.dot(a0, b0)
            d1 = tl.dot(a1, b1)
            acc += d0 * (sa0[:, None] * sb0[None, :])
            acc += d1 * (sa1[:, None] * sb1[None, :])
            a_ptrs += 2 * BK
            b_ptrs += 2 * BK
        if nkb % 2 == 1:
            a0 = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b0 = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
            sa0 = tl.load(as_ptrs + (nkb - 1) * s_asc, mask=mask_m, other=0.0)
            sb0 = tl.load(bs_ptrs + (nkb - 1) * s_bsc, mask=mask_n, other=0.0)
            acc += tl.dot(a0, b0) * (sa0[:, None] * sb0[None, :])
    else:   # dfr: scale the previous block's product after issuing this block's dot
        prev = tl.zeros((BM, BN), dtype=tl.float32)
        psa = tl.zeros((BM,), dtype=tl.float32)
        psb = tl.zeros((BN,), dtype=tl.float32)
        for kb in range(0, nkb):
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
            sa = tl.load(as_ptrs + kb * s_asc, mask=mask_m, other=0.0)
            sb = tl.load(bs_ptrs + kb * s_bsc, mask=mask_n, other=0.0)
            d = tl.dot(a, b)
            acc += prev * (psa[:, None] * psb[None, :])
            prev = d
            psa = sa
            psb = sb
            a_ptrs += BK
            b_ptrs += BK
        acc += prev * (psa[:, None] * psb[None, :])
    out_ptrs = out_ptr + grp.to(tl.int64) * s_og + rm.to(tl.int64)[:, None] * s_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _k_tma(a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, coff_ptr, M, N, C,
           s_am, s_asm, s_asc, s_bn, s_bsn, s_bsc, s_og, s_om,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    grp = tl.program_id(1)
    tiles_m = tl.cdiv(M, BM)
    tm = pid % tiles_m
    tn = pid // tiles_m
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, C], strides=[s_am, 1],
                                       block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, C], strides=[s_bn, 1],
                                       block_shape=[BN, BK])
    c0 = tl.multiple_of(tl.load(coff_ptr + grp), BK)
    c1 = tl.load(coff_ptr + grp + 1)
    nkb = (c1 - c0) // BK
    rm = tm * BM + tl.arange(0, BM)
    rn = tn * BN + tl.arange(0, BN)
    mask_m = rm < M
    mask_n = rn < N
    as_ptrs = as_ptr + rm * s_asm + (c0 // BK) * s_asc
    bs_ptrs = bs_ptr + rn * s_bsn + (c0 // BK) * s_bsc
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, nkb):
        a = a_desc.load([tm * BM, c0 + kb * BK])
        b = b_desc.load([tn * BN, c0 + kb * BK])
        sa = tl.load(as_ptrs + kb * s_asc, mask=mask_m, other=0.0)
        sb = tl.load(bs_ptrs + kb * s_bsc, mask=mask_n, other=0.0)
        acc += tl.dot(a, b.T) * (sa[:, None] * sb[None, :])
    out_ptrs = out_ptr + grp.to(tl.int64) * s_og + rm.to(tl.int64)[:, None] * s_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def k_trial(variant, a, sa, b, sb, out, coff, bm, bn, warps, stages, group_cols=None):
    m, c = a.shape
    n = b.shape[0]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), out.shape[0])
    args = (a, sa, b, sb, out, coff, m, n, c, a.stride(0), *sa.stride(), b.stride(0),
            *sb.stride(), out.stride(0), out.stride(1))
    if variant.startswith("p"):   # the compiled kernel (registers, spills, shared memory)
        return k_ptma(variant, a, sa, b, sb, out, coff, bm, bn, warps, stages, group_cols)
    if variant == "tma":
        _k_tma[grid](*args, BM=bm, BN=bn, BK=BK, num_warps=warps, num_stages=stages)
    else:
        _k_trial[grid](*args, MODE={"u2": 1, "dfr": 2}[variant], BM=bm, BN=bn, BK=BK,
                       num_warps=warps, num_stages=stages)


@triton.jit
def _k_ptma(a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, coff_ptr, M, N, C, G,
            s_am, s_asm, s_asc, s_bn, s_bsn, s_bsc, s_og, s_om, PROGS, GROUP_COLS,
            FLAT: tl.constexpr, WS: tl.constexpr, INNER_STAGES: tl.constexpr,
            TMA_OUT: tl.constexpr, FIXED: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Persistent ``tma``: PROGS programs walk the (group, tile) list. INNER_STAGES not
    None: the K loop's own stages, with which ``tl.range`` pipelines the scale loads too
    (by default only the loads that feed a dot are). TMA_OUT: the epilogue
    stores through a descriptor over ``out`` as ``[G * M, N]`` (M a multiple of BM). FIXED:
    every group has GROUP_COLS columns, so the K loop's trip count is the same for every
    tile and ``flatten`` can fuse the loop nest."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, C], strides=[s_am, 1],
                                       block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, C], strides=[s_bn, 1],
                                       block_shape=[BN, BK])
    if TMA_OUT:
        o_desc = tl.make_tensor_descriptor(out_ptr, shape=[G * M, N], strides=[s_om, 1],
                                           block_shape=[BM, BN])
    tiles_m = tl.cdiv(M, BM)
    per_group = tiles_m * tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), per_group * G, PROGS, flatten=FLAT,
                         warp_specialize=WS):
        grp = tile // per_group
        local = tile % per_group
        tm = local % tiles_m
        tn = local // tiles_m
        if FIXED:
            c0 = grp * GROUP_COLS
            nkb = GROUP_COLS // BK
        else:
            c0 = tl.multiple_of(tl.load(coff_ptr + grp), BK)
            nkb = (tl.load(coff_ptr + grp + 1) - c0) // BK
        rm = tm * BM + tl.arange(0, BM)
        rn = tn * BN + tl.arange(0, BN)
        mask_m = rm < M
        mask_n = rn < N
        as_ptrs = as_ptr + rm * s_asm + (c0 // BK) * s_asc
        bs_ptrs = bs_ptr + rn * s_bsn + (c0 // BK) * s_bsc
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in tl.range(0, nkb, num_stages=INNER_STAGES):
            a = a_desc.load([tm * BM, c0 + kb * BK])
            b = b_desc.load([tn * BN, c0 + kb * BK])
            sa = tl.load(as_ptrs + kb * s_asc, mask=mask_m, other=0.0)
            sb = tl.load(bs_ptrs + kb * s_bsc, mask=mask_n, other=0.0)
            acc += tl.dot(a, b.T) * (sa[:, None] * sb[None, :])
        if TMA_OUT:
            o_desc.store([grp * M + tm * BM, tn * BN], acc.to(out_ptr.dtype.element_ty))
        else:
            out_ptrs = out_ptr + grp.to(tl.int64) * s_og + rm.to(tl.int64)[:, None] * s_om \
                + rn[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
                     mask=mask_m[:, None] & mask_n[None, :])


SMS = 132


# persistent variants: (programs per SM, flatten, warp_specialize, K-loop stages (None: the
# kernel's), TMA-store epilogue, fixed group width) -- bench/NOTES_wgrad.md section 3
PERSISTENT = {"p1": (1, False, False, None, False, False),
              "p2": (2, False, False, None, False, False),
              "p2f": (2, True, False, None, False, False),
              "p1ws": (1, False, True, None, False, False),
              "p2s": (2, False, False, 3, False, False),        # S: scale loads pipelined
              "p3": (3, False, False, None, False, False),      # P3: 3 programs per SM
              "p2e": (2, False, False, None, True, False),      # TMA-store epilogue
              "p2x": (2, True, False, None, False, True),       # F: fixed widths, nest fused
              "p2xe": (2, True, False, None, True, True),       # F + TMA store
              "p2sxe": (2, True, False, 3, True, True)}         # S + F + TMA store


def k_ptma(variant, a, sa, b, sb, out, coff, bm, bn, warps, stages, group_cols=None,
           programs=None):
    """``group_cols``: every group's width, which the fixed-width variants need (the
    benchmark's groups are equal); ``programs``: the grid instead of the SMs' share (the
    interpreter)."""
    m, c = a.shape
    n = b.shape[0]
    per_sm, flat, ws, inner, tma_out, fixed = PERSISTENT[variant]
    if tma_out and (m % bm or not out.is_contiguous()):
        raise ValueError(f"{variant}: the TMA-store epilogue needs M % BM == 0 and a "
                         f"contiguous out (M {m}, BM {bm})")
    if fixed and not group_cols:
        raise ValueError(f"{variant}: pass group_cols, the groups' one width")
    progs = programs or SMS * per_sm
    return _k_ptma[(progs,)](a, sa, b, sb, out, coff, m, n, c, out.shape[0], a.stride(0), *sa.stride(),
                      b.stride(0), *sb.stride(), out.stride(0), out.stride(1), progs,
                      group_cols or 0, FLAT=flat, WS=ws, INNER_STAGES=inner, TMA_OUT=tma_out,
                      FIXED=fixed, BM=bm, BN=bn, BK=BK, num_warps=warps, num_stages=stages)


# ---- M-grouped (forward, data gradients): out[rows of g] = a[rows of g] @ w[g]^T -------------

@triton.jit
def _m_trial(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, group_rows,
             s_am, s_asm, s_ask, s_wg, s_wn, s_wsg, s_wsn, s_wsk, s_om,
             MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Fixed-size groups (the timing case); BN == BK: one weight scale per K block."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    per_m = tl.cdiv(group_rows, BM)
    grp = pid // (per_m * tiles_n)
    local = pid % (per_m * tiles_n)
    tm = local % per_m
    tn = local // per_m
    rm = grp * group_rows + tm * BM + tl.arange(0, BM)
    rn = tn * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    mask_m = tm * BM + tl.arange(0, BM) < group_rows
    g64 = grp.to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    as_ptrs = as_ptr + rm * s_asm
    ws_ptrs = ws_ptr + g64 * s_wsg + (tn * BN // BK) * s_wsn
    if MODE == 3:   # tma
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[s_am, 1],
                                           block_shape=[BM, BK])
        w_desc = tl.make_tensor_descriptor(w_ptr + g64 * s_wg, shape=[N, K], strides=[s_wn, 1],
                                           block_shape=[BN, BK])
        for kb in range(0, tl.cdiv(K, BK)):
            a = a_desc.load([grp * group_rows + tm * BM, kb * BK])
            w = w_desc.load([tn * BN, kb * BK])
            sa = tl.load(as_ptrs + kb * s_ask, mask=mask_m, other=0.0)
            if BN == BK:
                sw = tl.load(ws_ptrs + kb * s_wsk)
                acc += tl.dot(a, w.T) * (sa * sw)[:, None]
            else:   # several weight tiles across: one scale per column
                swc = tl.load(ws_ptr + g64 * s_wsg + (rn // BK) * s_wsn + kb * s_wsk)
                acc += tl.dot(a, w.T) * (sa[:, None] * swc[None, :])
    else:           # u2
        a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * s_am + ks[None, :]
        w_ptrs = w_ptr + g64 * s_wg + rn.to(tl.int64)[None, :] * s_wn + ks[:, None]
        for kb in range(0, tl.cdiv(K, 2 * BK)):
            a0 = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            w0 = tl.load(w_ptrs)
            a1 = tl.load(a_ptrs + BK, mask=mask_m[:, None], other=0.0)
            w1 = tl.load(w_ptrs + BK)
            s0 = tl.load(as_ptrs + 2 * kb * s_ask, mask=mask_m, other=0.0) \
                * tl.load(ws_ptrs + 2 * kb * s_wsk)
            s1 = tl.load(as_ptrs + (2 * kb + 1) * s_ask, mask=mask_m, other=0.0) \
                * tl.load(ws_ptrs + (2 * kb + 1) * s_wsk)
            d0 = tl.dot(a0, w0)
            d1 = tl.dot(a1, w1)
            acc += d0 * s0[:, None]
            acc += d1 * s1[:, None]
            a_ptrs += 2 * BK
            w_ptrs += 2 * BK
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * s_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & (rn < N)[None, :])


def m_trial(variant, a, sa, w, ws, out, group_rows, bm, bn, warps, stages):
    m, k = a.shape
    g, n, _ = w.shape
    grid = (g * triton.cdiv(group_rows, bm) * triton.cdiv(n, bn),)
    _m_trial[grid](a, sa, w, ws, out, m, n, k, group_rows, a.stride(0), sa.stride(0),
                   sa.stride(1), *w.stride()[:2], *ws.stride(), out.stride(0),
                   MODE={"u2": 1, "tma": 3}[variant], BM=bm, BN=bn, BK=BK,
                   num_warps=warps, num_stages=stages)


# ---- the sweep ----------------------------------------------------------------------------

CONFIGS = [(128, 128, 8, 3), (64, 128, 4, 3), (64, 256, 8, 3), (64, 256, 8, 4),
           (128, 256, 8, 3), (64, 128, 4, 2)]
# configs of the shipped kernel ("ship": ds_fp4.ops.grouped_gemm_triton as it is when this
# runs; in runs 1 and 2 that was the pointer-load kernel, which took BN 256 too)
SHIP_CONFIGS = [(128, 128, 8, 3), (64, 128, 4, 3)]


def kernel_info(handle):
    """Registers, spills, shared memory, warps and ``scf.for`` loops left in the TTGIR
    (1 = the persistent nest fused) of a launch's compiled kernel, or None."""
    if not hasattr(handle, "n_regs"):
        return None
    return {"regs": handle.n_regs, "spills": handle.n_spills,
            "shared_kb": round(handle.metadata.shared / 1024, 1),
            "warps": handle.metadata.num_warps,
            "scf_for": handle.asm.get("ttgir", "").count("scf.for")}


def run_case(along, groups, rows, k, n, dev, variants, configs=CONFIGS):
    flop = 2 * groups * rows * k * n
    tf = lambda fn: flop / bench_common.median_ms(fn) / 1e9  # noqa: E731
    row = {"case": f"{groups} x {rows}", "along": along, "k": k, "n": n}
    if along == "k":
        o = bg.k_operands(groups, rows, k, n, dev)
        ends = o["coff"][1:]
        row["bf16"] = tf(lambda: torch._grouped_mm(o["dz"], o["x"].t(), offs=ends))
        ship = lambda cfg: gt.launch_k_grouped(o["a"], o["sa"], o["b"], o["sb"], o["out"],  # noqa
                                               o["coff"], False, cfg)

        def trial(v, c):
            if v == "shipx":   # the shipped kernel with fixed-width groups (group_cols)
                return gt.launch_k_grouped(o["a"], o["sa"], o["b"], o["sb"], o["out"], None,
                                           False, group_cols=rows)
            if v.startswith("gw"):   # the Gluon trial kernel, "gw<STAGES>"
                import wgrad_gluon_trial as wg
                return wg.launch(o["a"], o["sa"], o["b"], o["sb"], o["out"], o["coff"],
                                 stages=int(v[2:]))
            return k_trial(v, o["a"], o["sa"], o["b"], o["sb"], o["out"], o["coff"], *c,
                           group_cols=rows)
    else:
        o = bg.m_operands(groups, rows, k, n, dev)
        a, sa, wq, ws, offs, out = (o[key] for key in ("a", "sa", "wq", "ws", "offs", "out"))
        wt = o["w"].transpose(-2, -1)
        row["bf16"] = tf(lambda: torch._grouped_mm(o["x"], wt, offs=offs[1:]))
        ship = lambda cfg: gt.launch_m_grouped(a, sa, wq, ws, out, offs, None, False, cfg)  # noqa
        trial = lambda v, c: m_trial(v, a, sa, wq, ws, out, rows, *c)  # noqa
    ship(triton.Config({"BM": 128, "BN": 128}, num_warps=8, num_stages=3))
    ref = o["out"].float().clone()
    pairs = [("ship", c) for c in SHIP_CONFIGS] + list(itertools.product(variants, configs))
    for variant, cfg in pairs:
        name = f"{variant} {cfg}"
        try:
            if variant == "ship":
                c = triton.Config({"BM": cfg[0], "BN": cfg[1]}, num_warps=cfg[2],
                                  num_stages=cfg[3])
                fn = lambda c=c: ship(c)  # noqa: E731
            else:
                fn = lambda v=variant, c=cfg: trial(v, c)  # noqa: E731
            o["out"].fill_(float("nan"))
            info = kernel_info(fn())
            err = bench_common.rel_err(o["out"].float(), ref)
            row[name] = round(tf(fn), 1) if err < 1e-3 else f"wrong {err:.1e}"
            if info:
                row.setdefault("kernels", {})[name] = info
        except Exception as e:   # a config that does not compile or fit: say so
            row[name] = f"{type(e).__name__}: {str(e)[:60]}"
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="32x640,16x2560,8x4096")
    p.add_argument("--kinds", default="wgrad_gate_up,wgrad_down,fwd_gate_up,fwd_down")
    p.add_argument("--variants", default=None,
                   help="K-grouped variants (default: tma,p1,p2,p2f,p1ws; more in PERSISTENT)")
    p.add_argument("--configs", default=None,
                   help="BM,BN,warps,stages[;...] instead of the sweep's CONFIGS")
    p.add_argument("--out", default="/tmp/grouped_gemm_trials")
    args = p.parse_args()
    configs = CONFIGS if args.configs is None else [
        tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
    dev = torch.device("cuda")
    kinds = bg.kinds(7168, 2048)
    rows = []
    for case, kind in itertools.product(args.cases.split(","), args.kinds.split(",")):
        g, r = (int(v) for v in case.split("x"))
        k, n, along = kinds[kind]
        k_variants = (args.variants or "tma,p1,p2,p2f,p1ws").split(",")
        variants = k_variants if along == "k" else ["tma"]
        row = run_case(along, g, r, k, n, dev, variants, configs)
        row["kind"] = kind
        rows.append(row)
        best = max((v, key) for key, v in row.items() if isinstance(v, float) and key != "bf16")
        print(f"{case:8s} {kind:14s} bf16 {row['bf16']:6.1f}  best {best[0]:6.1f} {best[1]}",
              flush=True)
        torch.cuda.empty_cache()
    env = bench_common.environment()
    bench_common.write_report(args.out, {"rows": rows, "environment": env}, markdown(rows, env))


def markdown(rows, env):
    """One line per case, kind, variant and config: TFLOP/s and the ratio to bf16's."""
    lines = [bench_common.environment_line(env), "",
             "# Grouped FP8 GEMM trial variants vs bf16 _grouped_mm (GPU time, TFLOP/s)", "",
             "| case | kind | bf16 | variant | BM, BN, warps, stages | TFLOP/s | vs bf16 | "
             "regs / spills / smem KB / warps / scf.for |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for key, v in r.items():
            name, _, cfg = key.partition(" ")
            if not cfg.startswith("("):
                continue
            val = f"{v:.0f} | {v / r['bf16']:.2f}" if isinstance(v, float) else f"{v[:40]} | -"
            k = r.get("kernels", {}).get(key)
            info = " / ".join(str(k[f]) for f in ("regs", "spills", "shared_kb", "warps",
                                                  "scf_for")) if k else "-"
            lines.append(f"| {r['case']} | {r['kind']} | {r['bf16']:.0f} | {name} | "
                         f"{cfg.strip('()')} | {val} | {info} |")
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
