"""Time the FP8 experts' six GEMM kinds one by one: bf16 against FP8 blockwise (GPU only).

For ``n`` local experts of ``T`` token slots (hidden H, ffn F, SwiGLU), the GEMMs of one
forward+backward are, per expert (``out = a @ b^T`` shapes as ``[M, K] x [N, K]``):

    fwd_gate_up    [T, H]  x [2F, H]     fwd_down       [T, F]  x [H, F]
    dgrad_down     [T, H]  x [F, H]      dgrad_gate_up  [T, 2F] x [H, 2F]
    wgrad_gate_up  [2F, T] x [H, T]      wgrad_down     [H, T]  x [F, T]

Each kind is issued for all ``n`` experts: in bf16 as autograd's ``Linear`` would
(``torch.mm``), and in FP8 through ``gemm_fp8_nt_many`` (what ``FP8Experts`` calls; 1x128 x
128x128 or 1x128 x 1x128 scales), serially and round-robin over 2 and 4 CUDA streams, and as
one GEMM of ``n`` times the rows (the bound a grouped GEMM would approach). Times are the
GPU's alone: the host issues everything while the GPU sleeps first. Host issue time is
reported beside them. Writes ``<out>.json`` and ``<out>.md``::

    python tools/bench_expert_gemms.py --experts 32 --tokens 640
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds_fp4 import ops  # noqa: E402
from ds_fp4.moe.fp8_gemm import gemm_fp8_nt_many, quantize_fp8_tiles  # noqa: E402

SLEEP_CYCLES = 5 * 10**8   # keeps the GPU busy while the host issues a whole case


def kinds(hidden, ffn, tokens):
    """``{kind: (M, K, N, weight recipe)}``: out [M, N] = a [M, K] @ b [N, K]^T."""
    return {
        "fwd_gate_up": (tokens, hidden, 2 * ffn, "128x128"),
        "fwd_down": (tokens, ffn, hidden, "128x128"),
        "dgrad_down": (tokens, hidden, ffn, "128x128"),
        "dgrad_gate_up": (tokens, 2 * ffn, hidden, "128x128"),
        "wgrad_gate_up": (2 * ffn, tokens, hidden, "1x128"),
        "wgrad_down": (hidden, tokens, ffn, "1x128"),
    }


def fp8_operands(n, m, k, nn, recipe, device):
    """Per expert FP8 ``a [m, k]`` (1x128) and ``b [nn, k]`` (``recipe``) with scales."""
    a, sa, b, sb = [], [], [], []
    for _ in range(n):
        q, s = ops.quantize_fp8(torch.randn(m, k, device=device, dtype=torch.bfloat16))
        a.append(q)
        sa.append(s)
        w = torch.randn(nn, k, device=device, dtype=torch.bfloat16)
        q, s = quantize_fp8_tiles(w) if recipe == "128x128" else ops.quantize_fp8(w)
        b.append(q)
        sb.append(s)
    return a, sa, b, sb


def bf16_calls(kind, n, m, k, nn, device):
    """Per expert closures issuing the bf16 GEMM in autograd's layout for ``kind``."""
    r = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16)  # noqa: E731
    calls = []
    for _ in range(n):
        if kind.startswith("fwd"):       # x [T, K] @ W[N, K]^T
            x, w = r(m, k), r(nn, k)
            calls.append(lambda x=x, w=w: torch.mm(x, w.t()))
        elif kind.startswith("dgrad"):   # dy [T, K] @ W [K, N]
            dy, w = r(m, k), r(k, nn)
            calls.append(lambda dy=dy, w=w: torch.mm(dy, w))
        else:                            # dz^T [M, T] @ x [T, N]
            dz, x = r(k, m), r(k, nn)
            calls.append(lambda dz=dz, x=x: torch.mm(dz.t(), x))
    return calls


def queued_ms(issue, reps):
    """Median GPU ms of ``issue()`` issued behind a sleep, and the host issue ms (work on
    side streams counts: ``gemm_fp8_nt_many`` joins them back to the current stream)."""
    main = torch.cuda.current_stream()
    gpu, host = [], []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        t0 = time.perf_counter()
        issue()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record(main)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    return statistics.median(gpu[1:]), statistics.median(host[1:])


def fp8_issue(ops_, recipe, streams=1):
    """The experts' call: ``gemm_fp8_nt_many`` over ``streams`` CUDA streams."""
    a, sa, b, sb = ops_
    return lambda: gemm_fp8_nt_many(a, sa, b, sb, recipe_b=recipe, streams=streams)


def bench_kind(kind, shape, n, device, reps):
    m, k, nn, recipe = shape
    flop = 2 * n * m * k * nn
    row = {"M x K x N": f"{m}x{k}x{nn}", "GFLOP (all experts)": flop / 1e9}
    calls = bf16_calls(kind, n, m, k, nn, device)
    row["bf16 ms"], row["bf16 host ms"] = queued_ms(lambda: [c() for c in calls], reps)
    calls = None   # free the bf16 operands before the FP8 ones are made
    operands = fp8_operands(n, m, k, nn, recipe, device)
    row["fp8 ms"], row["fp8 host ms"] = queued_ms(fp8_issue(operands, recipe), reps)
    for count in (2, 4):
        row[f"fp8 {count} streams ms"], _ = queued_ms(fp8_issue(operands, recipe, count), reps)
    del operands
    # One GEMM with n times the rows: the efficiency a grouped GEMM could approach.
    big = fp8_operands(1, n * m, k, nn, recipe, device)
    row["fp8 one GEMM ms"], _ = queued_ms(fp8_issue(big, recipe), reps)
    row["bf16 TFLOP/s"] = flop / row["bf16 ms"] / 1e9
    row["fp8 TFLOP/s"] = flop / row["fp8 ms"] / 1e9
    return row


def markdown(report):
    rows = report["kinds"]
    cols = list(next(iter(rows.values())))
    lines = [f"# Expert GEMMs by kind: bf16 vs FP8 blockwise ({report['environment']['gpu']})",
             "", ", ".join(f"{k} {v}" for k, v in report["environment"].items()), "",
             f"{report['experts']} experts x {report['tokens']} token slots, hidden "
             f"{report['hidden']}, ffn {report['ffn']}; GPU ms are the GPU's alone (issued "
             "behind a sleep), median of the reps.", "",
             "| kind | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for kind, row in rows.items():
        cells = [v if isinstance(v, str) else f"{v:.2f}" for v in row.values()]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines.append("| all | " + " | ".join(
        f"{sum(r[c] for r in rows.values()):.2f}" if c.endswith("ms") else ""
        for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=640)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "expert_gemms_h200"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_expert_gemms.py times GPU kernels: it needs a CUDA GPU")
    import host_overhead
    device = torch.device("cuda")
    report = {"environment": host_overhead.environment(), "experts": args.experts,
              "tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn, "kinds": {}}
    for kind, shape in kinds(args.hidden, args.ffn, args.tokens).items():
        report["kinds"][kind] = bench_kind(kind, shape, args.experts, device, args.reps)
        print(kind, json.dumps(report["kinds"][kind]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
