"""The grouped FP8 GEMMs (ds_fp4.ops.grouped_gemm) against bf16 ``torch._grouped_mm``.

For each experts x rows case (default: 32 x 640, 16 x 2560, 8 x 4096 at hidden 7168, ffn
2048, SwiGLU) and each of the experts' six GEMM kinds, it checks the grouped kernel against
its float32 twin, then times (GPU time, median, L2 flushed): bf16 ``torch._grouped_mm`` in
the layout it wants (the baseline a dropless bf16 layer calls), FP8 row-wise
``torch._scaled_grouped_mm`` (a bound: coarser scaling than DeepSeek-V3's), and ours.
Writes ``<out>.json`` and ``<out>.md``::

    python tools/bench_grouped_gemm.py --out bench/results/grouped_gemm_h200
"""

import argparse

import torch

import bench_common  # first: it puts the checkout on sys.path (tools/ is, run by path)
from bench_common import rel_err
from ds_fp4 import ops
from ds_fp4.ops.fp8_tiles import quantize_fp8_tiles
from ds_fp4.ops import grouped_gemm as gg


def kinds(hidden, ffn):
    """``{kind: (K, N, grouped along)}`` of ``out [rows, N] = a [rows, K] @ b [N, K]^T``;
    for the weight gradients (along "k") ``out [K, N]`` contracted over the rows."""
    return {"fwd_gate_up": (hidden, 2 * ffn, "m"), "fwd_down": (ffn, hidden, "m"),
            "dgrad_down": (hidden, ffn, "m"), "dgrad_gate_up": (2 * ffn, hidden, "m"),
            "wgrad_gate_up": (2 * ffn, hidden, "k"), "wgrad_down": (hidden, ffn, "k")}


def m_operands(groups, rows, k, n, dev):
    """An M-grouped kind's operands: bf16 ``x`` [G*rows, K] and ``w`` [G, N, K], their FP8
    forms (``a``, ``sa``; ``wq``, ``ws`` in 128x128 tiles), the row offsets and ``out``."""
    x = torch.randn(groups * rows, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(groups, n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    a, sa = ops.quantize_fp8(x)
    tiles = [quantize_fp8_tiles(w[g]) for g in range(groups)]
    return dict(x=x, w=w, a=a, sa=sa, wq=torch.stack([t[0] for t in tiles]),
                ws=torch.stack([t[1] for t in tiles]),
                offs=torch.arange(groups + 1, device=dev, dtype=torch.int32) * rows,
                out=torch.empty(groups * rows, n, device=dev, dtype=torch.bfloat16))


def k_operands(groups, rows, k, n, dev):
    """A K-grouped (weight-gradient) kind's operands: bf16 ``dz`` [K, G*rows] and ``x``
    [N, G*rows], their FP8 forms along the rows, the column offsets and ``out`` [G, K, N]."""
    dz = torch.randn(k, groups * rows, device=dev, dtype=torch.bfloat16)
    x = torch.randn(n, groups * rows, device=dev, dtype=torch.bfloat16)
    (a, sa), (b, sb) = ops.quantize_fp8(dz), ops.quantize_fp8(x)
    return dict(dz=dz, x=x, a=a, sa=sa, b=b, sb=sb,
                coff=torch.arange(groups + 1, device=dev, dtype=torch.int32) * rows,
                out=torch.empty(groups, k, n, device=dev, dtype=torch.bfloat16))


def m_case(groups, rows, k, n, dev):
    """The timed closures of an M-grouped kind and our relative error against the twin."""
    o = m_operands(groups, rows, k, n, dev)
    x, w, a, sa, wq, ws, offs, out = (o[key] for key in ("x", "w", "a", "sa", "wq", "ws",
                                                         "offs", "out"))
    ref = gg.m_grouped_gemm_fp8_nt_ref(a, sa, wq, ws, offsets=offs.cpu())
    ends = offs[1:].contiguous()
    wt = w.transpose(-2, -1)
    calls = {"bf16 _grouped_mm": lambda: torch._grouped_mm(x, wt, offs=ends),
             "ours": lambda: gg.m_grouped_gemm_fp8_nt(a, sa, wq, ws, offsets=offs, out=out)}
    try:   # row-wise FP8 (one scale per row and per weight column): the library's bound
        w8 = w.to(torch.float8_e4m3fn).transpose(-2, -1)
        s_row = torch.ones(groups * rows, device=dev)
        s_col = torch.ones(groups, n, device=dev)
        calls["fp8 row-wise _scaled_grouped_mm"] = lambda: torch._scaled_grouped_mm(
            a, w8, s_row, s_col, offs=ends, out_dtype=torch.bfloat16)
        calls["fp8 row-wise _scaled_grouped_mm"]()
    except Exception as err:  # not on this torch/GPU: leave the column empty
        print("row-wise FP8 grouped GEMM unavailable:", type(err).__name__, err)
        calls.pop("fp8 row-wise _scaled_grouped_mm", None)
    check = gg.m_grouped_gemm_fp8_nt(a, sa, wq, ws, offsets=offs)
    return calls, rel_err(check, ref)


def k_case(groups, rows, k, n, dev):
    """The timed closures of a K-grouped kind (out [G, K, N] over each group's rows) and
    our relative error against the twin."""
    o = k_operands(groups, rows, k, n, dev)
    dz, x, a, sa, b, sb, coff, out = (o[key] for key in ("dz", "x", "a", "sa", "b", "sb",
                                                         "coff", "out"))
    ref = gg.k_grouped_gemm_fp8_nt_ref(a, sa, b, sb, coff.cpu())
    ends = coff[1:].contiguous()
    calls = {"bf16 _grouped_mm": lambda: torch._grouped_mm(dz, x.t(), offs=ends),
             "ours": lambda: gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, coff, out=out)}
    check = gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, coff, out_dtype=torch.bfloat16)
    return calls, rel_err(check, ref)


def bench(groups, rows, hidden, ffn, dev):
    results = []
    for kind, (k, n, along) in kinds(hidden, ffn).items():
        make = m_case if along == "m" else k_case
        calls, err = make(groups, rows, k, n, dev)
        flop = 2 * groups * rows * k * n
        row = {"case": f"{groups} x {rows}", "kind": kind, "rel err vs twin": err}
        for name, fn in calls.items():
            ms = bench_common.median_ms(fn)
            row[f"{name} us"] = ms * 1e3
            row[f"{name} TFLOP/s"] = flop / ms / 1e9
        row["ours / bf16"] = row["ours TFLOP/s"] / row["bf16 _grouped_mm TFLOP/s"]
        print(row, flush=True)
        results.append(row)
        del calls
        torch.cuda.empty_cache()
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--cases", default="32x640,16x2560,8x4096", help="experts x rows, ...")
    p.add_argument("--out", default=str(bench_common.RESULTS / "grouped_gemm_h200"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_grouped_gemm.py times GPU kernels: it needs a CUDA GPU")
    dev = torch.device("cuda")
    rows = []
    for case in args.cases.split(","):
        g, r = (int(v) for v in case.split("x"))
        rows += bench(g, r, args.hidden, args.ffn, dev)
    cols = ["case", "kind", "rel err vs twin", "bf16 _grouped_mm TFLOP/s", "ours TFLOP/s",
            "ours / bf16", "fp8 row-wise _scaled_grouped_mm TFLOP/s", "ours us",
            "bf16 _grouped_mm us"]
    for r in rows:
        r["rel err vs twin"] = f"{r['rel err vs twin']:.1e}"
        r["ours / bf16"] = f"{r['ours / bf16']:.2f}"
    env = bench_common.environment()
    text = (f"{bench_common.environment_line(env)}\n\n"
            f"# Grouped FP8 GEMMs vs bf16 _grouped_mm (GPU time)\n\nhidden {args.hidden}, ffn "
            f"{args.ffn}\n\n" + bench_common.markdown_table(cols, bench_common.cells(rows, cols))
            + "\n")
    bench_common.write_report(args.out, {"hidden": args.hidden, "ffn": args.ffn, "rows": rows,
                                         "environment": env}, text)
    print(text)


if __name__ == "__main__":
    main()
