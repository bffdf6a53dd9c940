"""Where the host's time goes when ds_fp4 issues GPU work (a diagnostic, GPU only).

A layer is host-bound when the host takes longer to issue its kernels than the GPU takes to
run them. This measures, with the GPU kept busy by a long sleep kernel so that no launch
ever waits for it:

- the host time per call of single launches: a torch elementwise op, a bare CuPy
  RawKernel launch, ds_fp4 ops through their checks and the loader, one FP8 fused
  quantizer, one blockwise ``scaled_mm`` (the expert GEMM's call), each on tiny tensors;
- a cProfile of the host side of the FP8 experts' forward and backward at the benchmark
  size (``tools/bench_experts.py``'s case c), sorted by own time;
- with ``--layer CONFIG`` (a ``tools/bench_moe_layer.py`` config, any number of ranks):
  the host time to issue one layer forward+backward and its cProfile, for DeepSpeed's
  layer and for the paper's recipe; with ``--breakdown`` instead of the profiles, its host
  time by function (``bench_lib.host_breakdown``); with ``--memory-breakdown``, what is live at
  the step's forward and backward memory peaks, by allocation site.

Writes ``<out>.json``, ``<out>.md`` (with GPU, versions and date) and ``<out>_cprofile.txt``::

    python tools/host_overhead.py --out /tmp/host_overhead
    deepspeed --num_gpus 2 tools/host_overhead.py --layer small --out /tmp/host_layer
"""

import argparse
import cProfile
import functools
import io
import json
import pstats
import time
from pathlib import Path

import torch
from deepspeed.accelerator import get_accelerator

import bench_common  # first: it puts the checkout on sys.path (tools/ is, run by path)
import bench_experts
from bench_lib.moe_layer_variants import clear_grads
from ds_fp4 import ops
from ds_fp4.moe.fp8_gemm_loop import gemm_fp8_nt_1x128_128x128
from ds_fp4.ops import _cuda_loader as L
from ds_fp4.ops.grouped_gemm import k_grouped_gemm_fp8_nt, m_grouped_gemm_fp8_nt

CALLS = 200            # launches per measurement: far below the GPU's pending-launch limit
SLEEP_CYCLES = 2 * 10**9   # ~1 s at H200 clocks: the GPU is busy for every measurement


def host_us_per_call(fn, calls=CALLS):
    """Median over 3 rounds of the host microseconds per ``fn()`` while the GPU is busy."""
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(3):
        torch.cuda._sleep(SLEEP_CYCLES // 10)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[1]


def bare_cupy_launch():
    """A no-op CuPy kernel launched on torch's stream, without ds_fp4's wrappers."""
    import cupy
    kernel = cupy.RawKernel(r'extern "C" __global__ void noop(float* p) {}', "noop")
    stream = L.cupy_stream(cupy, torch.cuda.current_device())
    buf = torch.zeros(1, device="cuda")
    arg = L.ptr(buf)
    return lambda: kernel((1,), (32,), (arg,), stream=stream)


def single_calls():
    dev = torch.device("cuda")
    x = torch.randn(128, 128, device=dev, dtype=torch.bfloat16)
    rows = ops.quantize_mxfp4_rows(x)
    q, s = ops.quantize_fp8(x)
    wq, ws = ops.quantize_fp8_tiles(x)
    z = torch.randn(128, 256, device=dev, dtype=torch.bfloat16)
    cases = {
        "torch add_ (elementwise)": lambda: x.add_(0),
        "cupy RawKernel no-op": bare_cupy_launch(),
        "ops.quantize_fp8": lambda: ops.quantize_fp8(x),
        "ops.quantize_mxfp4_rows": lambda: ops.quantize_mxfp4_rows(x),
        "ops.mxfp4_rows_to_fp8": lambda: ops.mxfp4_rows_to_fp8(rows),
        "ops.mxfp4_to_fp8_colwise (host offsets)": lambda: ops.mxfp4_to_fp8_colwise(
            *ops.split_mxfp4_rows(rows), [0, 128]),
        "ops.tile_quant (1 weight)": lambda: ops.tile_quant([x], 1),
        "ops.segment_quant swiglu row": lambda: ops.segment_quant(
            z, 1, 128, True, False, source="swiglu"),
        "gemm_fp8_nt_1x128_128x128 (checked)": lambda: gemm_fp8_nt_1x128_128x128(q, s, wq, ws),
        "m_grouped_gemm_fp8_nt (1 group, Triton)": lambda: m_grouped_gemm_fp8_nt(
            q, s, wq[None], ws[None], group_rows=128),
        "k_grouped_gemm_fp8_nt (1 group, Triton)": lambda: k_grouped_gemm_fp8_nt(
            q[None], s[None], q[None], s[None], group_cols=128),
    }
    cases.update(call_chain(q, s))
    return {name: host_us_per_call(fn) for name, fn in cases.items()}


def call_chain(q, s):
    """The layers of one grouped GEMM call apart (what each costs of the whole): its checks,
    the launcher without them, the TMA descriptors, the Triton launch alone."""
    import triton
    from ds_fp4.ops import grouped_gemm as gg
    from ds_fp4.ops import grouped_gemm_triton as gt
    w, ws = q[None], torch.ones(1, 1, 1, device=q.device)
    out = torch.empty(128, 128, dtype=torch.bfloat16, device=q.device)
    desc = (gt._descriptor(q, (gt.BM, 128)), gt._descriptor(w, (128, 128)))
    s_asm, s_ask = s.stride()   # as launch_m_grouped passes them
    grid = (triton.cdiv(128, gt.BM),)
    raw = lambda: gt._m_grouped_kernel[grid](  # noqa: E731
        desc[0], s, desc[1], ws, out, s, s, 128, 128, 128, 1, 128, 0, s_ask, s_asm,
        *ws.stride(), *out.stride(), FIXED=True, SCALES_PER_GROUP=False, USED=False, BM=gt.BM,
        BN=128, BK=128, num_warps=gt.WARPS, num_stages=gt.STAGES)
    return {
        "  m_grouped: its checks": lambda: gg._check_m_grouped(q, s, w, ws, None, 128),
        "  m_grouped: _use_kernel": lambda: gg._use_kernel(q, s, w, ws),
        "  m_grouped: torch.empty out": lambda: torch.empty(128, 128, dtype=torch.bfloat16,
                                                            device=q.device),
        "  m_grouped: launcher (no checks)": lambda: gt.launch_m_grouped(
            q, s, w, ws, out, None, 128, False),
        "  m_grouped: 2 TMA descriptors": lambda: (gt._descriptor(q, (gt.BM, 128)),
                                                   gt._descriptor(w, (128, 128))),
        "  m_grouped: Triton launch alone": raw,
    }


def write_report(out, report, texts, title):
    """``out``.json (``report`` with the environment), .md (a table per entry of ``report``)
    and, when there are ``texts`` (``--issue-only`` has none), _cprofile.txt."""
    env = bench_common.environment()
    md = [f"# {title}", "", bench_common.environment_line(env), ""]
    for name, table in report.items():
        md += [bench_common.markdown_table([name, ""], [[k, f"{v:.1f}"] for k, v in table.items()]),
               ""]
    bench_common.write_report(out, {"environment": env, **report}, "\n".join(md))
    if texts:
        Path(out).with_name(Path(out).name + "_cprofile.txt").write_text("\n".join(texts))


def profile_host(fn, reps):
    """cProfile of ``reps`` calls of ``fn`` (synchronizing after each): the top 40 functions
    by own time, then ds_fp4's top 60 by cumulative time (where its host time goes)."""
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    for _ in range(reps):
        prof.enable()
        fn()
        prof.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats("ds_fp4", 60)
    return text.getvalue()


def experts_step(args):
    """fwd+bwd of bench_experts' case c at the benchmark size."""
    argv = ["--hidden", str(args.hidden), "--ffn", str(args.ffn), "--experts", str(args.experts),
            "--tokens", str(args.tokens)]
    a = bench_experts.build_parser().parse_args(argv)
    from deepspeed.moe.experts import Experts
    from ds_fp4.moe.expert import SwiGLUExpert
    dev = torch.device("cuda")
    experts = Experts(SwiGLUExpert(a.hidden, a.ffn), a.experts).to(dev, torch.bfloat16)
    x = torch.randn(1, a.experts, a.tokens, a.hidden, device=dev, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    rows = ops.quantize_mxfp4_rows(x)
    module, make_input = bench_experts.make_case("c-fp8-from-mxfp4", experts, x, rows)

    def step():
        module(*make_input()).backward(dy)
    return step


LAYER_VARIANTS = "deepspeed-bf16,fp4moe-bf16,fp4-bf16experts,fp4-eager,fp4"
# CUDA runtime calls counted per step: synchronizations make the host wait for the GPU
# (in a host-bound layer each one drains the queue of launched work); copies wait only
# when they go to pageable host memory, which the profiler does not tell apart.
_COUNTED_CALLS = {"Synchronize": "sync calls", "cudaMemcpy": "copy calls",
                  "cuMemcpyDtoH": "copy calls"}


def layer_steps(config, variants=("deepspeed-bf16", "fp4")):
    """``{variant: fwd+bwd step function}`` for one bench_moe_layer config on this rank."""
    from bench_lib.moe_layer_variants import CONFIGS, inputs, make_layer, variant_section
    cfg = CONFIGS[config]
    steps = {}
    for variant in variants:   # any bench_moe_layer variant: AutoEP's, the grouped bf16 one
        layer = make_layer(cfg, variant, variant_section(variant),
                           torch.distributed.get_world_size(), 0, torch.device("cuda"))
        x, dy = inputs(cfg, 0, torch.device("cuda"))
        steps[variant] = functools.partial(layer_step, layer, x, dy)
    return steps


def layer_step(layer, x, dy):
    """One fwd+bwd from cleared gradients, as ``tools/bench_moe_layer.py`` times it."""
    clear_grads(layer, x)
    layer(x)[0].backward(dy)


def host_issue_ms(step, reps=10):
    """Median host milliseconds to issue ``step`` from a synchronized start (no sync inside
    is counted as issue time too: the host then waits for the GPU)."""
    sync = get_accelerator().synchronize   # as bench_moe_layer times steps (CPU: nothing)
    times = []
    for _ in range(reps + 2):
        torch.distributed.barrier()
        sync()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
        sync()
    return sorted(times[2:])[reps // 2]


def _kernel_intervals(events):
    """(start us, end us, name) of every GPU kernel among the profiler's ``events``."""
    out = []
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.time_range.start, e.time_range.end, e.name))
    return out


def _union_us(intervals):
    """Microseconds covered by at least one of ``intervals``."""
    total, end = 0.0, float("-inf")
    for a, b in sorted((a, b) for a, b, _ in intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def trace_step(step, reps=3):
    """torch.profiler over ``reps`` steps: per step, wall ms, launches, GPU kernel time
    (communication kernels apart: they also count time spent waiting for the peer) and
    the synchronizing and copying CUDA calls; plus the top host ops by own time."""
    from torch.profiler import ProfilerActivity, profile
    step()
    torch.cuda.synchronize()
    torch.distributed.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / reps
    events = prof.events()
    kernels = _kernel_intervals(events)
    comm = [k for k in kernels if "nccl" in k[2].lower()]
    compute = [k for k in kernels if "nccl" not in k[2].lower()]
    waits = {}
    for e in events:
        kind = next((k for w, k in _COUNTED_CALLS.items() if w in e.name), None)
        if kind and e.device_type == torch.autograd.DeviceType.CPU:
            waits[f"{kind}: {e.name}"] = waits.get(f"{kind}: {e.name}", 0) + 1
    summary = {"wall ms (profiled)": wall,
               "kernels": len(kernels) / reps,
               "compute kernels GPU ms": _union_us(compute) / 1e3 / reps,
               "communication kernels GPU ms": _union_us(comm) / 1e3 / reps,
               **{k: v / reps for k, v in sorted(waits.items())}}
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    return summary, table + "\n" + kernel_table(kernels, reps), prof


def kernel_table(kernels, reps, top=25):
    """The ``top`` GPU kernels by total time per step: calls and ms per step, share."""
    totals = {}
    for a, b, name in kernels:
        calls, us = totals.get(name, (0, 0.0))
        totals[name] = (calls + 1, us + b - a)
    whole = sum(us for _, us in totals.values()) or 1.0
    lines = ["GPU kernels by time per step (calls, ms, share of all kernel time):"]
    for name, (calls, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"{calls / reps:7.1f} {us / reps / 1e3:8.3f} ms {us / whole:6.1%}  "
                     f"{name[:110]}")
    return "\n".join(lines)


def memory_breakdown(step, path):
    """What is live at one step's forward and backward memory peaks (the allocator's
    history, ``moe_train.memory_history``) into ``path``; returns the peak's top sites."""
    from moe_train.memory_history import recorded
    layer, x, dy = step.args
    step()   # warm: tables, caches and compiled kernels are not the step's
    clear_grads(layer, x)
    with recorded(path) as mark:
        mark("forward")
        y = layer(x)[0]
        mark("backward")
        y.backward(dy)
    del y
    with open(path) as f:
        report = json.load(f)
    lines = [f"{mb:9.1f} MB {n:4d}x  {ours}  <- {inner}"
             for ours, inner, mb, n in report["peak"]["sites"]]
    return report, "\n".join(lines)


def breakdown(step, steps=10):
    """Host time of ``steps`` steps by function (``bench_lib.host_breakdown``): the layer's
    own modules, DeepSpeed's MoE code, Triton's launcher and the autograd engine, each step
    from a synchronized start (the host never waits for a full launch queue)."""
    import triton
    from bench_lib.host_breakdown import HostBreakdown
    extra = [(triton.runtime.jit.JITFunction, "run"), (torch.autograd, "backward")]
    try:   # the compiled kernel's launcher: what of JITFunction.run is the launch itself
        from triton.backends.nvidia.driver import CudaLauncher
        extra.append((CudaLauncher, "__call__"))
    except ImportError:
        pass
    with HostBreakdown(["ds_fp4", "deepspeed.moe", "deepspeed.ops.triton_ops", "moe_train"],
                       extra) as hb:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        hb.reset()
        wall = 0.0
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            wall += time.perf_counter() - t0
        torch.cuda.synchronize()
    return wall * 1e3 / steps, hb.text(steps)


def find_syncs(step):
    """``{Python call site: times}`` of the calls in one ``step`` that synchronize with the
    GPU (``torch.cuda.set_sync_debug_mode``): in a host-bound layer each drains the queue."""
    import traceback
    import warnings
    step()
    torch.cuda.synchronize()
    sites = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}({f.name})"
                            for f in frames[-4:][::-1])
        key = f"{str(message)[:60]} at {where}"
        sites[key] = sites.get(key, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sites


def layer_main(args):
    from moe_train.launch import init_one_process
    init_one_process()
    report, traces, texts, peaks = {}, {}, [], {}
    rank0 = torch.distributed.get_rank() == 0
    for variant, step in layer_steps(args.layer, args.variants.split(",")).items():
        if args.memory_breakdown:
            mem, sites = memory_breakdown(step, f"{args.out}_{variant}_memory.json")
            phases = {p: round(v["during_step_mb"], 1) for p, v in mem["phases"].items()}
            peaks.update({f"{variant}, {p}": mb for p, mb in phases.items()})
            texts.append(f"==== {args.layer} / {variant}: peak {mem['peak']['during_step_mb']:.1f}"
                         f" MB above the step's start (phase peaks {phases}); live then:\n"
                         + sites)
            continue   # memory only: its history slows the step, so no timings with it
        report[variant] = host_issue_ms(step)
        if args.issue_only:
            continue
        if args.breakdown:
            ms, text = breakdown(step)
            texts.append(f"==== {args.layer} / {variant}: host issue {report[variant]:.2f} ms "
                         f"({ms:.2f} ms with the wrappers), by function\n" + text)
            continue
        if args.find_syncs:
            syncs = find_syncs(step)
            texts.append(f"==== {args.layer} / {variant}: {sum(syncs.values())} synchronizing "
                         f"calls in one step\n" + "\n".join(f"{n:4d}  {k}" for k, n in syncs.items()))
        texts.append(f"==== {args.layer} / {variant}: host issue {report[variant]:.2f} ms\n"
                     + profile_host(step, args.reps))
        traces[variant], table, prof = trace_step(step)
        texts.append(f"==== {args.layer} / {variant}: torch.profiler, 3 steps\n"
                     + json.dumps(traces[variant], indent=1) + "\n" + table)
        if rank0 and args.chrome_trace:
            prof.export_chrome_trace(f"{args.out}_{variant}_trace.json")
    if rank0:
        title = f"one fwd+bwd of {args.layer} ({torch.distributed.get_world_size()} ranks)"
        tables = {f"host issue ms, {title}": report} if report else {}
        if peaks:
            tables[f"MB allocated above the step's start at each phase's peak, {title}"] = peaks
        for variant, summary in traces.items():
            tables[f"{variant}: profiled step"] = summary
        what = "Memory" if args.memory_breakdown else "Host time"
        write_report(args.out, tables, texts, f"{what} of one MoE layer forward+backward")
        print(json.dumps({"host issue ms": report, "profiled": traces}, indent=1))
    torch.distributed.barrier()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="/tmp/host_overhead")
    p.add_argument("--layer", default=None, help="a bench_moe_layer.py config to profile")
    p.add_argument("--variants", default=LAYER_VARIANTS,
                   help="with --layer: bench_moe_layer.py variants to profile")
    p.add_argument("--chrome-trace", action="store_true",
                   help="with --layer: also write <out>_<variant>_trace.json (rank 0)")
    p.add_argument("--find-syncs", action="store_true",
                   help="with --layer: list the calls of a step that synchronize with the GPU")
    p.add_argument("--memory-breakdown", action="store_true",
                   help="with --layer: what is live at one step's memory peaks "
                        "(<out>_<variant>_memory.json)")
    p.add_argument("--breakdown", action="store_true",
                   help="with --layer: host time by function (bench_lib.host_breakdown) "
                        "instead of cProfile and the profiler")
    p.add_argument("--issue-only", action="store_true",
                   help="with --layer: only the host issue time per variant (a few seconds each)")
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_overhead.py measures GPU launches: it needs a CUDA GPU")
    if args.layer:
        return layer_main(args)
    calls = single_calls()
    for name, us in calls.items():
        print(f"{name:45s} {us:8.1f} us/call", flush=True)
    text = profile_host(experts_step(args), args.reps)
    write_report(args.out, {"host us per call (GPU busy, tiny tensors)": calls}, [text],
                 "Host time per launch")
    print(text[:6000])


if __name__ == "__main__":
    main()
