"""Benchmark the local experts alone: bf16 experts against FP8 experts (issue 5).

DeepSeek-V3-like sizes by default (hidden 7168, ffn 2048, 8 local experts, 4096 token
slots each, SwiGLU, bf16 weights), input ``[1, n_local, C, hidden]`` as DeepSpeed's
``Experts`` gets it. Cases:

- ``a-bf16``: ``deepspeed.moe.experts.Experts`` with bf16 ``SwiGLUExpert``s (the baseline).
- ``b-fp8-from-bf16``: ``FP8Experts`` fed bf16 (``quantize_fp8`` per expert), cache fp8.
- ``b2-fp8-from-bf16-cache-mxfp4``: the same with the MXFP4 cache (x and z kept as MXFP4).
- ``c-fp8-from-mxfp4``: ``FP8Experts`` fed the MXFP4 rows of the dispatch through the direct
  conversion (``inputs.ds_fp4_rows``), cache mxfp4 (the paper's recipe).

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
import datetime
import importlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deepspeed.moe.experts import Experts  # noqa: E402

from ds_fp4 import ops  # noqa: E402
from ds_fp4.ops import backend, fp8_segments, fp8_tiles  # noqa: E402
from ds_fp4.moe.expert import SwiGLUExpert  # noqa: E402
from ds_fp4.moe.fp8_experts import FP8Experts, fp8_experts_supported  # noqa: E402

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
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "experts_h200"))
    p.add_argument("--seed", type=int, default=0)
    return p


# ---- the cases ---------------------------------------------------------------------------


class _Handoff(torch.autograd.Function):
    """A stride-0 placeholder that carries the rows, as the FP4MoE dispatch hands it over;
    the gradient FP8Experts computes for it is made and then dropped here (as the dispatch
    backward would consume it), so that no extra reduction is timed."""

    @staticmethod
    def forward(ctx, anchor, shape):
        return anchor.new_zeros(()).expand(shape)

    @staticmethod
    def backward(ctx, grad):
        return None, None


def make_case(name, experts, x, rows):
    """``(module, make_input)``: ``make_input()`` returns a fresh forward input."""
    if name == "a-bf16":
        return experts, lambda: x.detach().requires_grad_(True)
    if name.startswith("b"):
        cache = "mxfp4" if "mxfp4" in name else "fp8"
        return (FP8Experts.from_experts(experts, cache=cache),
                lambda: x.detach().requires_grad_(True))
    anchor = torch.zeros((), dtype=x.dtype, device=x.device, requires_grad=True)

    def make_input():
        feed = _Handoff.apply(anchor, tuple(x.shape))
        feed.ds_fp4_rows = rows
        return feed
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
        y = module(make_input())
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
    y = module(feed)
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
            y = module(feed)
            marks[1].record()
            y.backward(dy)
            marks[2].record()
            h = (time.perf_counter() - t0) * 1e3
            sync(device)
            f, b = marks[0].elapsed_time(marks[1]), marks[1].elapsed_time(marks[2])
        else:
            t0 = time.perf_counter()
            y = module(feed)
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
        y = module(feed)
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


def _same(a, b):
    """Byte-equal outputs (tuples elementwise; NaN equals NaN)."""
    if isinstance(a, tuple):
        return len(a) == len(b) and all(map(_same, a, b))
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    elif a.is_floating_point():
        a, b = a.nan_to_num(-1.0), b.nan_to_num(-1.0)
    return torch.equal(a, b)


def check_kernels(device):
    """Run every op FP8Experts uses once on CUDA and compare it byte for byte with the
    reference; on a mismatch or an error fall back to the reference ops (and say so)."""
    if device.type != "cuda":
        return "cpu: reference ops"
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(300, 2048, device=device, generator=g).to(torch.bfloat16)
    offsets = torch.tensor([0, 100, 100, 300], dtype=torch.int32, device=device)

    def run():
        rows = ops.quantize_mxfp4_rows(x)
        return (rows, ops.mxfp4_rows_to_fp8(rows), ops.quantize_fp8(x),
                ops.quantize_fp8_rows(x), ops.dequantize_mxfp4_rows(rows),
                ops.dequantize_fp8_rows(ops.quantize_fp8_rows(x)),
                ops.mxfp4_to_fp8_colwise(*ops.split_mxfp4_rows(rows), offsets))
    try:
        got = run()
        with ops.kernels("reference"):
            want = run()
        bad = [i for i, (a, b) in enumerate(zip(got, want)) if not _same(a, b)]
        if not bad:
            return f"{ops.get_kernels()}: the ops FP8Experts uses match the reference byte for byte"
        reason = f"outputs {bad} differ from the reference"
    except Exception as err:  # a kernel that fails must not stop the GEMM measurements
        reason = f"{type(err).__name__}: {err}"
    ops.set_kernels("reference")
    return f"reference (CUDA kernels rejected: {reason}); FP8 timings include slow ops"


def check_fused(device):
    """Compare the experts' tile and segment quantizers (``ds_fp4.ops.fp8_tiles``,
    ``fp8_segments``) with their PyTorch twins once (weight tiles and plain activations byte
    for byte; SwiGLU sources up to exp()'s last bit: <= 1e-4 of the bytes); on a mismatch or
    an error run every op on the reference (and say so)."""
    if device.type != "cuda" or not backend.uses_kernels(torch.empty(0, device=device)):
        return "fused kernels not used (CPU, reference ops or no CuPy): PyTorch twins"
    g = torch.Generator(device=device).manual_seed(1)
    ws = [torch.randn(256, 384, device=device, generator=g).to(torch.bfloat16)
          for _ in range(4)]
    x = torch.randn(600, 512, device=device, generator=g).to(torch.bfloat16)
    dh = torch.randn(600, 256, device=device, generator=g).to(torch.bfloat16)
    checks = {
        "tiles": lambda f: f(ws, 2, False), "tiles_t": lambda f: f(ws, 2, True),
        "plain": lambda f: f(x, 2, 300, True, True),
        "swiglu": lambda f: f(x, 2, 300, True, True, source="swiglu"),
        "swiglu_grad": lambda f: f(x, 2, 300, True, True, source="swiglu_grad", dh=dh)}
    try:
        bad = []
        for name, call in checks.items():
            kernel, twin = ((fp8_tiles.tile_quant, fp8_tiles.tile_quant_ref) if "tiles" in name
                            else (fp8_segments.segment_quant, fp8_segments.segment_quant_ref))
            got, want = call(kernel), call(twin)
            pairs = [(got, want)] if "tiles" in name else list(zip(got, want))
            for a, b in pairs:
                differ = (a[0].view(torch.uint8) != b[0].view(torch.uint8)).float().mean().item()
                limit = 1e-4 if "swiglu" in name else 0.0
                if differ > limit or not _same(a[1], b[1]):
                    bad.append(f"{name} ({differ:.2e} of the bytes differ)")
        if not bad:
            return "fused kernels match their twins (SwiGLU sources: <= 1e-4 of the bytes)"
        reason = ", ".join(bad)
    except Exception as err:  # a kernel that fails must not stop the measurements
        reason = f"{type(err).__name__}: {err}"
    ops.set_kernels("reference")
    return f"reference (fused kernels rejected: {reason}); FP8 timings include slow ops"


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def correctness(experts, x, rows, dy):
    """Relative errors of the FP8 cases' output, input gradient and one weight gradient
    against the bf16 experts (on the same bf16 input, and on the dequantized MXFP4 rows)."""
    def run(module, feed_input, feed_rows=None):
        clear_grads(module)
        xin = feed_input.detach().requires_grad_(True)
        feed = xin
        if feed_rows is not None:
            feed = xin * 1
            feed.ds_fp4_rows = feed_rows
        y = module(feed)
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
                     "y": rel(got[0], ref[0]), "dx": rel(got[1], ref[1]),
                     "d_down0": rel(got[2], ref[2])}
    out["mxfp4-input-vs-bf16-input"] = {"y": rel(ref_mx[0], ref_x[0])}
    clear_grads(experts)
    return out


# ---- report ------------------------------------------------------------------------------


def environment(device):
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "kernels_mode": ops.get_kernels(), "fp8_tensor_cores": fp8_experts_supported(device)}
    try:
        importlib.import_module("ds_fp4.ops.cuda")
        env["ds_fp4_cuda_kernels"] = "importable"
    except Exception as err:  # report, never hide, why the reference ops ran
        env["ds_fp4_cuda_kernels"] = f"not importable: {type(err).__name__}: {err}"
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   capability=".".join(map(str, torch.cuda.get_device_capability(device))))
    else:
        env["gpu"] = "none (CPU)"
    try:
        import deepspeed
        env["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    return env


def markdown(report):
    cfg, env, res = report["config"], report["environment"], report["results"]
    lines = [
        f"# Local experts fwd+bwd: bf16 vs FP8 ({env['gpu']})", "",
        f"hidden {cfg['hidden']}, ffn {cfg['ffn']}, {cfg['experts']} local experts x "
        f"{cfg['tokens']} token slots, SwiGLU, bf16 weights; torch {env['torch']}, "
        f"ds_fp4 kernels: {env['kernels_mode']} ({env['ds_fp4_cuda_kernels']}); "
        f"{env['date']}; median of {cfg['iters']} after {cfg['warmup']} warm-up.", "",
        "| case | fwd ms | bwd ms | fwd+bwd ms | host issue ms | TFLOP/s | speed-up vs a | "
        "saved MB | saved / a | held after fwd MB | peak MB | GEMM / other CUDA ms | "
        "queued fwd+bwd ms | queued speed-up vs a |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = res.get("a-bf16")
    for name, r in res.items():
        speed = f"{base['total_ms'] / r['total_ms']:.2f}x" if base else "-"
        saved = f"{r['saved_MB'] / base['saved_MB']:.2f}" if base else "-"
        held = "-" if r["held_after_fwd_MB"] is None else f"{r['held_after_fwd_MB']:.0f}"
        peak = "-" if r["peak_MB"] is None else f"{r['peak_MB']:.0f}"
        br = r.get("breakdown")
        brs = "-" if not br else f"{br['gemm_ms']:.2f} / {br['other_ms']:.2f}"
        q = r.get("queued_total_ms")
        qs = "-" if q is None else f"{q:.2f}"
        qspeed = (f"{base['queued_total_ms'] / q:.2f}x"
                  if q is not None and base and base.get("queued_total_ms") else "-")
        lines.append(f"| {name} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['total_ms']:.2f} | "
                     f"{r.get('host_issue_ms', float('nan')):.2f} | {r['tflops']:.0f} | {speed} | {r['saved_MB']:.0f} | {saved} | {held} | "
                     f"{peak} | {brs} | {qs} | {qspeed} |")
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
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    if "targets" in report:
        print(json.dumps(report["targets"]))


if __name__ == "__main__":
    main()
