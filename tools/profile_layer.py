"""Where a layer's forward+backward spends GPU time: kernels grouped by name, per step.

For each variant of ``tools/bench_moe_layer.py`` at one config (one GPU), a few warm-up
steps, then ``--steps`` profiled forward+backward steps (torch.profiler, CUDA activity).
Per variant: the step's wall time, the summed kernel time (GPU busy), and the kernels by
total time per step, so a slow recipe shows which of its launches cost what::

    python tools/profile_layer.py --config dsv3-e32-top2 \
        --variants autoep-bf16,autoep-fp4-fp8experts --out /tmp/profile_layer

With ``--gaps`` the profile also records the host (CPU activity, which slows the host a
little) and lists where the GPU sat idle between kernels, put on the host op that launched
the kernel after each gap (``bench_lib.gpu_gaps``): for a layer whose wall time is above its
GPU busy time. ``--sync-steps`` starts each profiled step from a synchronized GPU, as
``tools/bench_moe_layer.py`` times steps (without it the host runs ahead after a few steps
and the gaps of a step's start do not show). It also lists the host's time per autograd
Function forward and per backward node (``gpu_gaps.host_pieces``), profiler overhead
included.

Writes ``<out>.json`` and ``<out>.md`` (GPU, versions and date) and prints the tables.
"""

import argparse
import gc
import gzip
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as tdist

import bench_common
import bench_moe_layer as B
from bench_lib import gpu_gaps
from bench_lib.moe_layer_variants import CONFIGS, clear_grads, inputs, make_layer, variant_section
from moe_train.launch import init_one_process, local_device

TOP = 25   # kernels listed per variant
TOP_GAPS = 12   # launching ops and single gaps listed per variant (--gaps)


def kernel_times(layer, x, dy, args, trace_path=None):
    """``({kernel name: (us per step, launches per step)}, wall ms per step, gaps)`` of
    ``args.steps`` steps. On a CPU (the tests' smoke run) the "kernels" are the CPU ops,
    inclusive times. ``gaps``: None, or with ``args.gaps`` on CUDA ``_trace_gaps`` of the
    profiled steps (``args.stack``: with Python frames, which slow the host more;
    ``args.sync_steps``: each step from a synchronized start, as the layer benchmark times
    them; ``trace_path``: the trace kept, gzipped)."""
    from torch.profiler import ProfilerActivity, profile
    cuda, steps = x.is_cuda, args.steps
    activities = [ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]
    if cuda and args.gaps:
        activities.append(ProfilerActivity.CPU)
    with profile(activities=activities, with_stack=cuda and args.gaps and args.stack) as prof:
        B._sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            clear_grads(layer, x)
            layer(x)[0].backward(dy)
            if args.sync_steps:
                B._sync()
        B._sync()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    per = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        # device_time: us of this kernel
        per[e.name][0] += (e.device_time if cuda else e.cpu_time_total) / steps
        per[e.name][1] += 1 / steps
    return {k: tuple(v) for k, v in per.items()}, wall, _trace_gaps(prof, steps, trace_path) \
        if cuda and args.gaps else None


def _trace_gaps(prof, steps, keep=None):
    """``(gpu_gaps.gaps, gpu_gaps.long_calls)`` of a finished profile (through its exported
    Chrome trace; ``keep``: a path to write it to, gzipped)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        if keep:
            with open(path, "rb") as f, gzip.open(keep, "wb") as g:
                shutil.copyfileobj(f, g)
    return (gpu_gaps.gaps(trace), gpu_gaps.long_calls(trace, steps=steps),
            gpu_gaps.host_pieces(trace, steps=steps))


def _gap_report(found, calls, steps, pieces=()):
    """The JSON/markdown entry of one variant's gaps, long host calls and host pieces
    (``gpu_gaps.host_pieces``), per step."""
    summary, gaps = found
    return {"span_us": summary["span_us"] / steps, "busy_us": summary["busy_us"] / steps,
            "idle_us": summary["idle_us"] / steps,
            "by_launcher": [{"op": op, "idle_us": us, "gaps": n}
                            for op, us, n in gpu_gaps.by_launcher(gaps, steps)[:TOP_GAPS]],
            "largest": sorted(gaps, key=lambda g: -g["idle_us"])[:TOP_GAPS],
            "long_calls": [{"call": c, "op": op, "where": w, "us": us, "calls": n}
                           for c, op, w, us, n in calls[:TOP_GAPS]],
            "host_pieces": [{"name": name, "calls": n, "median_us": med, "us": us}
                            for name, n, med, us in pieces[:TOP_GAPS]]}


def profile_variant(cfg, variant, args, device):
    layer = make_layer(cfg, variant, variant_section(variant), 1, args.seed, device)
    x, dy = inputs(cfg, args.seed, device)
    for _ in range(args.warmup):
        clear_grads(layer, x)
        layer(x)[0].backward(dy)
    keep = f"{args.out}-{variant}.trace.json.gz" if args.keep_traces else None
    kernels, wall, found = kernel_times(layer, x, dy, args, keep)
    del layer, x, dy
    gc.collect()
    torch.cuda.empty_cache()
    busy = sum(us for us, _ in kernels.values()) / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:TOP]
    result = {"variant": variant, "wall_ms": wall, "gpu_busy_ms": busy,
              "launches": sum(n for _, n in kernels.values()),
              "kernels": [{"name": k, "us": us, "launches": n} for k, (us, n) in top]}
    if found is not None:
        gaps, calls, pieces = found
        result["gaps"] = _gap_report(gaps, calls, args.steps, pieces)
    return result


def markdown(env, config, results):
    lines = [bench_common.environment_line(env), "", f"# GPU time per step by kernel: {config}",
             "", "| variant | wall ms | GPU busy ms | launches |", "|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['wall_ms']:.2f} | {r['gpu_busy_ms']:.2f} | "
              f"{r['launches']:.0f} |" for r in results]
    for r in results:
        lines += ["", f"## {r['variant']}", "", "| us per step | launches | kernel |",
                  "|---|---|---|"]
        lines += [f"| {k['us']:,.0f} | {k['launches']:.0f} | `{k['name'][:110]}` |"
                  for k in r["kernels"]]
        if "gaps" in r:
            lines += _gap_lines(r["gaps"])
    return "\n".join(lines) + "\n"


def _gap_lines(g):
    lines = ["", f"GPU per step: span {g['span_us']:,.0f} us, busy {g['busy_us']:,.0f}, idle "
             f"{g['idle_us']:,.0f} (gaps of {gpu_gaps.MIN_GAP_US:g} us or more below, by the host "
             f"op that launched the kernel after them)", "", "| idle us per step | gaps | "
             f"launched by |",
             "|---|---|---|"]
    lines += [f"| {b['idle_us']:,.0f} | {b['gaps']:.1f} | `{b['op'][:100]}` |"
              for b in g["by_launcher"]]
    lines += ["", "| largest gaps, us | queued us | launched by | before | after |",
              "|---|---|---|---|---|"]
    for x in g["largest"]:
        queued = "-" if x["queued_us"] is None else f"{x['queued_us']:,.0f}"
        where = f" @ {x['where']}" if x.get("where") else ""
        lines.append(f"| {x['idle_us']:,.0f} | {queued} | `{(x['launched_by'] + where)[:160]}` | "
                     f"`{x['before'][:40]}` | `{x['after'][:40]}` |")
    lines += ["", f"| host calls of {gpu_gaps.MIN_CALL_US:g} us or more: us per step | calls | "
              "call | op @ Python |", "|---|---|---|---|"]
    lines += [f"| {c['us']:,.0f} | {c['calls']:.1f} | `{c['call']}` | "
              f"`{(c['op'] + (' @ ' + c['where'] if c['where'] else ''))[:160]}` |"
              for c in g["long_calls"]]
    lines += ["", "| host us per step | calls | median us a call | autograd Function or "
              "backward node |", "|---|---|---|---|"]
    lines += [f"| {p['us']:,.0f} | {p['calls']:.1f} | {p['median_us']:,.0f} | `{p['name']}` |"
              for p in g.get("host_pieces", ())]
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="dsv3-e32-top2", choices=list(CONFIGS))
    p.add_argument("--variants", default="autoep-bf16,autoep-fp4,autoep-fp4-fp8experts")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=str(bench_common.RESULTS / "profile_layer"))
    p.add_argument("--gaps", action="store_true",
                   help="also profile the host and list the GPU's idle gaps (CUDA only)")
    p.add_argument("--stack", action="store_true",
                   help="with --gaps: name the Python frames around each launch (slower host)")
    p.add_argument("--sync-steps", action="store_true",
                   help="synchronize after each profiled step, as the layer benchmark times "
                   "steps (without it the host gets ahead of the GPU after a few steps)")
    p.add_argument("--keep-traces", action="store_true",
                   help="with --gaps: keep each variant's Chrome trace (<out>-<variant>"
                   ".trace.json.gz)")
    args = p.parse_args()
    init_one_process()   # without a GPU (the tests' smoke run) it lists CPU ops, not kernels
    device = local_device()
    results = [profile_variant(CONFIGS[args.config], v, args, device)
               for v in args.variants.split(",")]
    env = bench_common.environment()
    text = markdown(env, args.config, results)
    bench_common.write_report(args.out, {"env": env, "config": args.config, "results": results},
                              text)
    print(text)
    tdist.barrier()


if __name__ == "__main__":
    main()
