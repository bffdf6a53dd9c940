"""Benchmark the local experts alone: bf16 experts against FP8 experts (issue 5).

DeepSeek-V3-like sizes by default (hidden 7168, ffn 2048, 8 local experts, 4096 token
slots each, SwiGLU, bf16 weights), input ``[1, n_local, C, hidden]`` as DeepSpeed's
``Experts`` gets it. Cases:

- ``a-bf16``: ``deepspeed.moe.experts.Experts`` with bf16 ``SwiGLUExpert``s (the baseline).
- ``b-fp8-from-bf16``: ``FP8Experts`` fed bf16 (``quantize_fp8`` per expert), cache fp8.
- ``b2-fp8-from-bf16-cache-mxfp4``: the same with the MXFP4 cache (x and z kept as MXFP4).
- ``c-fp8-from-mxfp4``: ``FP8Experts`` fed the MXFP4 rows of the dispatch through the direct
  conversion (``FP8Experts(inputs, rows)``), cache mxfp4 (the paper's recipe).

(The case ``c0-fp8-from-mxfp4-unfused``, the fused weight-tile and activation quantizers
switched off for their PyTorch twins, was measured at 2.3x c's time on an H200; it went with
that switch: one setting, ``ops.set_kernels``, now governs every kernel.)

First a correctness check (relative errors against the bf16 experts), then per case the
median forward, backward and forward+backward times (CUDA events), TFLOP/s, the bytes
autograd keeps for backward (saved-tensor hooks, parameters excluded), the memory the
allocator still holds after forward (output excluded) and the peak over forward+backward,
and a CUDA-time breakdown (GEMM kernels vs the rest) from one profiled iteration. Writes
``<out>.json`` and ``<out>.md`` (default ``bench/results/experts_h200``)::

    python tools/bench_experts.py                     # on the GPU
    python tools/bench_experts.py --hidden 256 --ffn 256 --experts 2 --tokens 256  # CPU smoke
"""

import argparse
import importlib
import json
import statistics
import time
from pathlib import Path

import torch

import bench_common  # first: it puts the checkout on sys.path (tools/ is, run by path)
from bench_common import fmt, markdown_table, rel_err
from bench_lib.kernel_checks import check_fused, check_kernels
from deepspeed.moe.experts import Experts

from ds_fp4 import ops
from ds_fp4.ops import fp8_segments
from ds_fp4.moe.expert import SwiGLUExpert
from ds_fp4.moe.fp8_experts import FP8Experts, fp8_experts_supported

CASES = ("a-bf16", "b-fp8-from-bf16", "b2-fp8-from-bf16-cache-mxfp4", "c-fp8-from-mxfp4")
MB = 2 ** 20
GEMM_KERNEL_MARKS = ("gemm", "sm90_xmma", "cutlass", "nvjet", "xmma")
TOP_KERNELS = 15


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8, help="local experts")
    p.add_argument("--tokens", type=int, default=4096, help="token slots per expert (C)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--no-profile", action="store_true", help="skip the CUDA-time breakdown")
    p.add_argument("--trace-case", default="c-fp8-from-mxfp4",
                   help="case whose profiler tables (CPU and CUDA time per op) are written to "
                        "<out>_profile.txt; empty: none")
    p.add_argument("--out", default=str(bench_common.RESULTS / "experts_h200"))
    p.add_argument("--seed", type=int, default=0)
    return p


# ---- the cases ---------------------------------------------------------------------------


class _Handoff(torch.autograd.Function):
    """A stride-0 placeholder beside the rows, as the FP4MoE dispatch hands them over;
    the gradient FP8Experts computes for it is made and then dropped here (as the dispatch
    backward would consume it), so that no extra reduction is timed."""

    @staticmethod
    def forward(ctx, anchor, shape):
        return anchor.new_zeros(()).expand(shape)

    @staticmethod
    def backward(ctx, grad):
        return None, None


def make_case(name, experts, x, rows):
    """``(module, make_input)``: ``make_input()`` returns fresh forward arguments."""
    if name == "a-bf16":
        return experts, lambda: (x.detach().requires_grad_(True),)
    if name.startswith("b"):
        cache = "mxfp4" if "mxfp4" in name else "fp8"
        return (FP8Experts.from_experts(experts, cache=cache),
                lambda: (x.detach().requires_grad_(True),))
    anchor = torch.zeros((), dtype=x.dtype, device=x.device, requires_grad=True)

    def make_input():
        return _Handoff.apply(anchor, tuple(x.shape)), rows
    return FP8Experts.from_experts(experts, cache="mxfp4"), make_input


# ---- measurements ------------------------------------------------------------------------


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clear_grads(module):
    for p in module.parameters():
        p.grad = None


def saved_bytes(module, make_input):
    """Bytes of the distinct storages autograd keeps for backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(*make_input())
    del y
    return sum(storages.values())


def allocator_memory(module, make_input, dy, device):
    """(held after forward minus the output, peak over fwd+bwd), bytes above the start."""
    if device.type != "cuda":
        return None, None
    clear_grads(module)
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    feed = make_input()
    y = module(*feed)
    sync(device)
    held = torch.cuda.memory_allocated(device) - base - y.untyped_storage().nbytes()
    y.backward(dy)
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del y, feed
    clear_grads(module)
    return held, peak


# GPU cycles of the sleep that queued timing puts first (~50 ms at the H200's ~2 GHz):
# longer than the host needs to issue any case's forward and backward.
QUEUE_SLEEP_CYCLES = 100_000_000


def time_case(module, make_input, dy, device, warmup, iters, queued=False):
    """Median (forward, backward, total, host issue) milliseconds; host issue: the host's
    time from calling forward to backward's return, before any synchronization (when it is
    close to the total, the host, not the GPU, sets the pace).

    ``queued``: the GPU first sleeps while the host issues the whole forward and backward,
    so the times are the GPU's alone, without waits for the host: what a layer sees when
    the host runs ahead of the GPU, as in a training step with no synchronization in it.
    """
    fwd, bwd, tot, host = [], [], [], []
    for i in range(warmup + iters):
        clear_grads(module)
        feed = make_input()
        sync(device)
        if device.type == "cuda":
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            if queued:
                torch.cuda._sleep(QUEUE_SLEEP_CYCLES)
            t0 = time.perf_counter()
            marks[0].record()
            y = module(*feed)
            marks[1].record()
            y.backward(dy)
            marks[2].record()
            h = (time.perf_counter() - t0) * 1e3
            sync(device)
            f, b = marks[0].elapsed_time(marks[1]), marks[1].elapsed_time(marks[2])
        else:
            t0 = time.perf_counter()
            y = module(*feed)
            t1 = time.perf_counter()
            y.backward(dy)
            t2 = time.perf_counter()
            f, b, h = (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t2 - t0) * 1e3
        if i >= warmup:
            fwd.append(f)
            bwd.append(b)
            tot.append(f + b)
            host.append(h)
        del y, feed
    return (statistics.median(fwd), statistics.median(bwd), statistics.median(tot),
            statistics.median(host))


def cuda_breakdown(module, make_input, dy, device, trace=None):
    """CUDA kernel time of one fwd+bwd, ms: GEMM kernels, everything else; with ``trace``
    (a path) the profiler's per-op tables (host CPU time and CUDA time) are written there."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    clear_grads(module)
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace else [])
    feed = make_input()
    sync(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        y = module(*feed)
        y.backward(dy)
        sync(device)
        wall = (time.perf_counter() - t0) * 1e3
    if trace:
        Path(trace).write_text(
            f"one profiled fwd+bwd, wall {wall:.2f} ms\n\nby self CPU time:\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45)
            + "\n\nby CUDA time:\n"
            + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30) + "\n")
    gemm = other = 0.0
    kernels = []
    cpu = getattr(torch.autograd, "DeviceType", None)
    for ev in prof.key_averages():
        if cpu is not None and getattr(ev, "device_type", None) == cpu.CPU:
            continue     # host-side ops (traced case): their device time is their kernels'
        us = getattr(ev, "self_device_time_total", None)
        if us is None:
            us = getattr(ev, "self_cuda_time_total", 0.0)
        if us <= 0:
            continue
        kernels.append((us, ev.count, ev.key[:100]))
        if any(mark in ev.key.lower() for mark in GEMM_KERNEL_MARKS):
            gemm += us
        else:
            other += us
    clear_grads(module)
    top = [{"ms": us / 1e3, "calls": n, "kernel": name}
           for us, n, name in sorted(kernels, reverse=True)[:TOP_KERNELS]]
    return {"gemm_ms": gemm / 1e3, "other_ms": other / 1e3, "profiled_wall_ms": wall,
            "top_kernels": top}


def correctness(experts, x, rows, dy):
    """Relative errors of the FP8 cases' output, input gradient and one weight gradient
    against the bf16 experts (on the same bf16 input, and on the dequantized MXFP4 rows)."""
    def run(module, feed_input, feed_rows=None):
        clear_grads(module)
        xin = feed_input.detach().requires_grad_(True)
        y = module(xin) if feed_rows is None else module(xin, feed_rows)
        y.backward(dy)
        w = module.deepspeed_experts[0].down.weight.grad.clone()
        return y.detach(), xin.grad, w

    x_mx = ops.dequantize_mxfp4_rows(rows)
    ref_x, ref_mx = run(experts, x), run(experts, x_mx)
    out = {}
    for name, cache, feed_rows, ref in (("b-fp8-from-bf16", "fp8", None, ref_x),
                                        ("c-fp8-from-mxfp4", "mxfp4", rows, ref_mx)):
        got = run(FP8Experts.from_experts(experts, cache=cache), x, feed_rows)
        out[name] = {"ref": "bf16 experts on " + ("x" if feed_rows is None else
                                                  "the dequantized MXFP4 rows"),
                     "y": rel_err(got[0], ref[0]), "dx": rel_err(got[1], ref[1]),
                     "d_down0": rel_err(got[2], ref[2])}
    out["mxfp4-input-vs-bf16-input"] = {"y": rel_err(ref_mx[0], ref_x[0])}
    clear_grads(experts)
    return out


# ---- report ------------------------------------------------------------------------------


def environment(device):
    """``bench_common.environment`` with the kernel setting, whether the GPU has FP8 tensor
    cores, whether ds_fp4's CUDA kernels import, and CUDA's version and capability."""
    env = dict(bench_common.environment(libraries=("deepspeed",)), kernels_mode=ops.get_kernels(),
               fp8_tensor_cores=fp8_experts_supported(device))
    try:
        importlib.import_module("ds_fp4.ops.cuda")
        env["ds_fp4_cuda_kernels"] = "importable"
    except Exception as err:  # report, never hide, why the reference ops ran
        env["ds_fp4_cuda_kernels"] = f"not importable: {type(err).__name__}: {err}"
    if device.type == "cuda":
        env.update(cuda=torch.version.cuda,
                   capability=".".join(map(str, torch.cuda.get_device_capability(device))))
    return env


def markdown(report):
    cfg, env, res = report["config"], report["environment"], report["results"]
    lines = [
        f"# Local experts fwd+bwd: bf16 vs FP8 ({env['gpu']})", "",
        f"hidden {cfg['hidden']}, ffn {cfg['ffn']}, {cfg['experts']} local experts x "
        f"{cfg['tokens']} token slots, SwiGLU, bf16 weights; torch {env['torch']}, "
        f"ds_fp4 kernels: {env['kernels_mode']} ({env['ds_fp4_cuda_kernels']}); "
        f"{env['date']}; median of {cfg['iters']} after {cfg['warmup']} warm-up.", "",
    ]
    head = ["case", "fwd ms", "bwd ms", "fwd+bwd ms", "host issue ms", "TFLOP/s", "speed-up vs a",
            "saved MB", "saved / a", "held after fwd MB", "peak MB", "GEMM / other CUDA ms",
            "queued fwd+bwd ms", "queued speed-up vs a"]
    rows = []
    base = res.get("a-bf16")
    for name, r in res.items():
        br = r.get("breakdown")
        q = r.get("queued_total_ms")
        qspeed = (f"{base['queued_total_ms'] / q:.2f}x"
                  if q is not None and base and base.get("queued_total_ms") else "-")
        rows.append([name, f"{r['fwd_ms']:.2f}", f"{r['bwd_ms']:.2f}", f"{r['total_ms']:.2f}",
                     f"{r.get('host_issue_ms', float('nan')):.2f}", f"{r['tflops']:.0f}",
                     f"{base['total_ms'] / r['total_ms']:.2f}x" if base else "-",
                     f"{r['saved_MB']:.0f}",
                     f"{r['saved_MB'] / base['saved_MB']:.2f}" if base else "-",
                     fmt(r["held_after_fwd_MB"], ".0f"), fmt(r["peak_MB"], ".0f"),
                     "-" if not br else f"{br['gemm_ms']:.2f} / {br['other_ms']:.2f}",
                     fmt(q, ".2f"), qspeed])
    lines.append(markdown_table(head, rows))
    lines += ["", "fwd+bwd ms: from a synchronized start, the host issuing as the GPU runs (the "
              "host's waits count). queued: the host issued everything while the GPU slept "
              "first, so the time is the GPU's alone (a layer inside a step with no "
              "synchronization).", "", "Correctness (relative Frobenius error):", ""]
    for name, c in report["correctness"].items():
        lines.append(f"- {name}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float)
                                               else f"{k}: {v}" for k, v in c.items()))
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = build_parser().parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    n, cap, h, f = args.experts, args.tokens, args.hidden, args.ffn
    experts = Experts(SwiGLUExpert(h, f), n).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, h ** -0.5)
    x = torch.randn(1, n, cap, h, device=device, dtype=torch.bfloat16)
    dy = torch.randn(1, n, cap, h, device=device, dtype=torch.bfloat16)
    kernel_check = check_kernels(device)    # first: it may switch to the reference ops
    fused_check = check_fused(device)
    rows = ops.quantize_mxfp4_rows(x)       # the dispatch payload the experts receive
    report = {"config": {k: getattr(args, k) for k in
                         ("hidden", "ffn", "experts", "tokens", "warmup", "iters")},
              "environment": dict(environment(device), kernel_check=kernel_check,
                                         fused_check=fused_check),
              "correctness": correctness(experts, x, rows, dy), "results": {}}
    print(json.dumps(report["environment"]), flush=True)
    print(json.dumps(report["correctness"]), flush=True)
    flops = 18 * n * cap * h * f      # 3 GEMMs forward (gate+up as 2), twice that backward
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.cases.split(","):
        module, make_input = make_case(name, experts, x, rows)
        fwd, bwd, tot, host = time_case(module, make_input, dy, device, args.warmup,
                                        args.iters)
        queued = (time_case(module, make_input, dy, device, args.warmup, args.iters,
                            queued=True) if device.type == "cuda" else None)
        held, peak = allocator_memory(module, make_input, dy, device)
        trace = (str(out.with_name(out.name + "_profile.txt"))
                 if name == args.trace_case else None)
        report["results"][name] = {
            "fwd_ms": fwd, "bwd_ms": bwd, "total_ms": tot, "host_issue_ms": host,
            "queued_fwd_ms": queued and queued[0], "queued_bwd_ms": queued and queued[1],
            "queued_total_ms": queued and queued[2],
            "tflops": flops / tot / 1e9,
            "saved_MB": saved_bytes(module, make_input) / MB,
            "held_after_fwd_MB": None if held is None else held / MB,
            "peak_MB": None if peak is None else peak / MB,
            "breakdown": None if args.no_profile else cuda_breakdown(
                module, make_input, dy, device, trace)}
        print(name, json.dumps(report["results"][name]), flush=True)
    report["fused_kernel_choices"] = {f"{name} grid {list(grid)}": choice for (_, name, grid), choice
                                      in fp8_segments.kernel_choices().items()}
    print(json.dumps({"fused_kernel_choices": report["fused_kernel_choices"]}), flush=True)
    res = report["results"]
    if "a-bf16" in res and "c-fp8-from-mxfp4" in res:
        a, c = res["a-bf16"], res["c-fp8-from-mxfp4"]
        report["targets"] = {
            "c_speedup_vs_a": a["total_ms"] / c["total_ms"], "c_speedup_vs_a_target": 1.3,
            "c_saved_over_a": c["saved_MB"] / a["saved_MB"], "c_saved_over_a_target": 0.4}
        if "b-fp8-from-bf16" in res:
            report["targets"]["c_speedup_vs_b"] = res["b-fp8-from-bf16"]["total_ms"] / c["total_ms"]
    bench_common.write_report(out, report, markdown(report))
    print(markdown(report))
    if "targets" in report:
        print(json.dumps(report["targets"]))


if __name__ == "__main__":
    main()
