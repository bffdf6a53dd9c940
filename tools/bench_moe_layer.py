"""Benchmark one MoE layer: DeepSpeed's own bf16 layer against FP4MoE recipes.

For each layer size and variant: a correctness check against DeepSpeed's layer (relative
error of the output, the input gradient and the parameter gradients), then forward+backward time, tokens/s per
GPU, forward peak and kept-for-backward memory, and the bytes each rank hands to each
all-to-all. From the bytes and the measured wire-format kernel times it projects the
all-to-all time at inter-node bandwidth (default 48 GB/s per GPU, a 400 Gb/s NIC) for
EP 8, 16 and 32. Run on any number of ranks (the expert-parallel size is the world size)::

    python tools/bench_moe_layer.py                                  # 1 GPU (or CPU)
    deepspeed --num_gpus 2 tools/bench_moe_layer.py                  # 2 GPUs, EP 2

Writes ``bench/results/bench_moe_layer_<device>_<N>rank.{json,md}`` (``--out`` to change)
and prints the tables last. Variants:

- ``deepspeed-bf16``: ``deepspeed.moe.layer.MoE`` as it is (the baseline).
- ``fp4moe-bf16``: FP4MoE with every wire and the cache in bf16 (the layer's overhead).
- ``fp8``: the ``fp4_moe`` section of ``ds_config_examples/fp8_moe.json`` (DeepSeek-V3 style).
- ``fp4``: the section of ``ds_config_examples/fp4_moe.json`` (the paper's recipe).
- ``fp4-bf16experts``: the paper's recipe with ``"fp8_experts": false`` (DeepSpeed's bf16
  experts), to separate what the wires and the cache save from what the FP8 GEMMs do.
- ``grouped-bf16``: what a user would pick instead on one GPU, a dropless bf16 layer on
  ``torch._grouped_mm`` with the same router and expert weights
  (``tools/moe_train/grouped_bf16.py``; EP 1 only). Dropless, so its output differs from
  the capacity-bound layers' where they drop tokens.
- ``autoep-bf16``, ``autoep-fp4``, ``autoep-fp4-actfp8``, ``autoep-fp4-fp8experts``:
  DeepSpeed AutoEP's dropless layer (a one-block Qwen3-MoE of the same sizes, its own
  random weights; ``tools/moe_train/autoep_layer.py``) as it is, with the paper's recipe,
  with the recipe and ``"activation_cache": "fp8"`` (AutoEP's bf16 experts keep their
  activations in FP8), and with the recipe and ``"fp8_experts": true`` (grouped FP8 GEMMs
  inside AutoEP). Their errors are against ``autoep-bf16``; ``vs AutoEP`` is their time
  and kept memory over its. ``autoep-bf16-fused``, ``autoep-fp4-fused``,
  ``autoep-fp4-fp8experts-fused``: the same with AutoEP's Triton combine
  (``expert_parallel.combine_impl: fused_weighted_sum``, CUDA only), the faster baseline.
- ``fp4-monitor``, ``autoep-fp4-fp8experts-monitor``: the recipe with
  ``"monitor_exactness": true``, whose conversion kernels count the inexact groups (the
  counters' cost beside ``fp4`` / ``autoep-fp4-fp8experts``).
- ``fp4-grouped`` / ``fp4-loop``: the paper's recipe with the FP8 experts' GEMMs forced to
  one grouped launch per kind / one cuBLASLt call per expert (``DS_FP4_EXPERT_GEMMS``;
  ``fp4`` chooses by rows per expert).
- ``fp4-eager`` / ``fp4-graphs``: the paper's recipe with ``"expert_graphs"`` false / true
  (``fp4`` has the example's ``auto``: CUDA graphs of the FP8 experts' passes where their
  GEMMs are small; ``experts`` then reads ``FP8Experts+graphs``). Same bytes, less host
  time; the memory the step that captures reserves is in the JSON as ``graph_reserved_mb``.

The ``experts`` column names the expert module that ran (``FP8Experts`` where
``fp8_experts`` resolved to on, else DeepSpeed's ``Experts``).
"""

import argparse
import gc
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as tdist

# Run by path, so tools/ is on sys.path: bench_common (which puts the checkout on sys.path,
# for `import ds_fp4`), this benchmark's parts in bench_lib and the moe_train package (the
# main job's all-to-all counter, memory probe, seeds, process setup and recipe reader).
import bench_common
from deepspeed.accelerator import get_accelerator

from bench_lib import moe_layer_tables
from bench_lib.moe_layer_variants import (CONFIGS, GROUPED, VARIANTS, baselines,
                                          capture_capacity, clear_grads, experts_label,
                                          family, gemm_mode, inputs, make_layer,
                                          variant_section, wire_formats)
from moe_train.launch import init_one_process, local_device
from moe_train.metrics import A2A_KINDS, AllToAllCounter, measure_kept_for_backward

from ds_fp4.config import Format
from ds_fp4.moe.alltoall import row_bytes

DEFAULT_CONFIGS = {"cpu": "tiny", "gpu": "small,h4096-e16-top2,dsv3-e16-top8,dsv3-e32-top2"}
DEFAULT_VARIANTS = ("deepspeed-bf16", "grouped-bf16", "fp4moe-bf16", "fp8", "fp4", "fp4-eager",
                    "fp4-bf16experts")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # passed by the deepspeed launcher; the rank's device comes from LOCAL_RANK (init_one_process)
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--configs", default=None,
                   help=f"comma-separated names from {', '.join(CONFIGS)} (default: "
                        f"{DEFAULT_CONFIGS['gpu']} on GPUs, {DEFAULT_CONFIGS['cpu']} on CPU)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"any of {','.join(VARIANTS)}")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations (5 GPU, 1 CPU)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations per round (20 GPU, 3 CPU)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of timing, variants interleaved; the median round counts "
                        "(3 GPU, 1 CPU)")
    p.add_argument("--bw-gbs", type=float, default=48.0,
                   help="inter-node bandwidth per GPU for the projection, GB/s")
    p.add_argument("--gpus-per-node", type=int, default=0,
                   help="ranks that share a node over NVLink in the projection (0: all remote)")
    p.add_argument("--out", default=str(bench_common.RESULTS))
    p.add_argument("--seed", type=int, default=0)
    return p


# --------------------------------------------------------------------------- measurements

def _sync():
    get_accelerator().synchronize()


def check_and_count(layer, x, dy, counter):
    """One forward+backward with the all-to-alls counted.

    Returns:
        ``(y, dx, dw, bytes)``: the output and input gradient (fp32 copies), ``{parameter
        name: gradient}`` and ``{a2a kind: bytes this rank sent}``.
    """
    clear_grads(layer, x)
    counter.begin()
    counter.phase = "fwd"
    y = layer(x)[0]
    counter.phase = "bwd"
    y.backward(dy)
    counter.phase = None
    sent = counter.take()
    dw = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach().float(), x.grad.detach().float(), dw, sent


def _forward(layer, x):
    """``(y, bytes)``: the forward's output, and its bytes where autograd does not save it.

    Such an output is the forward's result, not memory kept for backward: in a model the
    residual add that consumes it saves nothing. A layer whose last op saves its output
    (a sigmoid would) keeps it, and then it counts."""
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)[0]
    storage = y.untyped_storage()
    return y, 0 if storage.data_ptr() in saved else storage.nbytes()


def measure_memory(layer, x, dy):
    """Memory of one step, MB: kept for backward (what the forward leaves allocated, less
    an output autograd does not save: ``_forward``), forward peak, forward+backward peak.

    Peaks are measured on GPUs only (None on CPU); "kept" on CPU comes from the profiler.
    """
    clear_grads(layer, x)
    acc = get_accelerator()
    mb = 2**20
    if acc.device_name() == "cpu":
        (y, out), kept = measure_kept_for_backward(lambda: _forward(layer, x))
        y.backward(dy)
        return {"kept_mb": kept - out / mb, "output_mb": out / mb, "fwd_peak_mb": None,
                "fwd_bwd_peak_mb": None}
    _sync()
    gc.collect()
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    y, out = _forward(layer, x)
    _sync()
    kept, fwd_peak = acc.memory_allocated() - before - out, acc.max_memory_allocated() - before
    y.backward(dy)
    _sync()
    return {"kept_mb": kept / mb, "output_mb": out / mb, "fwd_peak_mb": fwd_peak / mb,
            "fwd_bwd_peak_mb": (acc.max_memory_allocated() - before) / mb}


def capture_graphs(layer, x, dy):
    """One more fwd+bwd, in which ``expert_graphs`` captures its passes where it does (the
    first step ran them eagerly); returns the memory this step newly reserved, MB (the
    graphs' private pools; ~0 without graphs)."""
    acc = get_accelerator()
    _sync()
    before = acc.memory_reserved() if acc.device_name() != "cpu" else None
    clear_grads(layer, x)
    layer(x)[0].backward(dy)
    _sync()
    return None if before is None else (acc.memory_reserved() - before) / 2**20


def time_steps(layer, x, dy, warmup, iters):
    """Median forward+backward time in ms over ``iters`` steps, the slowest rank's."""
    times = []
    for i in range(warmup + iters):
        clear_grads(layer, x)
        tdist.barrier()
        _sync()
        t0 = time.perf_counter()
        layer(x)[0].backward(dy)
        _sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    med = torch.tensor(sorted(times)[len(times) // 2], dtype=torch.float64, device=local_device())
    tdist.all_reduce(med, op=tdist.ReduceOp.MAX)
    return med.item()


def _time_op(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return (time.perf_counter() - t0) / iters * 1e6


def wire_kernel_us(fmt, rows, hidden, device, warmup, iters):
    """Measured time (us) to pack ``[rows, hidden]`` bf16 into ``fmt`` and to unpack it.

    Returns:
        ``{"pack_us", "unpack_us"}``; 0 for bf16 (a bf16 model's tensor travels as it is).
    """
    if fmt == "bf16":
        return {"pack_us": 0.0, "unpack_us": 0.0}
    from ds_fp4 import ops
    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    pack, unpack = {"mxfp4": (ops.quantize_mxfp4_rows, ops.dequantize_mxfp4_rows),
                    "fp8": (ops.quantize_fp8_rows, ops.dequantize_fp8_rows)}[fmt]
    packed = pack(x)
    return {"pack_us": _time_op(lambda: pack(x), warmup, iters),
            "unpack_us": _time_op(lambda: unpack(packed), warmup, iters)}


# --------------------------------------------------------------------------- one config

def _max_over_ranks(v):
    e = torch.tensor([v], dtype=torch.float64, device=local_device())
    tdist.all_reduce(e, op=tdist.ReduceOp.MAX)
    return e.item()


def _rel_err(a, b):
    """``||a - b|| / ||b||``, the largest over ranks."""
    return _max_over_ranks(bench_common.rel_err(a, b))


def _rel_err_dict(a, b):
    """Relative error of all gradients together, ``||a - b|| / ||b||`` over matching names."""
    if set(a) != set(b):
        raise RuntimeError(f"parameters differ from the baseline's: {sorted(set(a) ^ set(b))}")
    num = sum(((a[n].float() - b[n].float()) ** 2).sum() for n in b)
    den = sum((b[n].float() ** 2).sum() for n in b)
    return _max_over_ranks((num.sqrt() / den.sqrt().clamp_min(1e-30)).item())


def weight_cache_mb(layer):
    """MB of FP8 weight tiles the layer holds between steps (``fp4_moe.fp8_weight_cache``;
    the steps here leave them in place: outside ``kept_mb`` and the peaks, which count
    from the memory allocated before a step)."""
    from ds_fp4.moe.weight_cache import TileCache
    held = {}
    for m in layer.modules():
        for c in (getattr(getattr(m, "plan", None), "tiles", None), getattr(m, "fp4_tiles", None)):
            if isinstance(c, TileCache):
                held[id(c)] = c
    return sum(c.nbytes() for c in held.values()) / 2**20


def bench_variant(name, cfg, variant, args, device, ref):
    """Measure one variant of one config; ``ref`` holds the baseline's ``(y, dx)`` or None."""
    ep = tdist.get_world_size()
    section = variant_section(variant)
    layer = make_layer(cfg, variant, section, ep, args.seed, device)
    cap = capture_capacity(layer)
    cap.setdefault("C", ref[3] if ref else 0)
    x, dy = inputs(cfg, args.seed, device)
    os.environ["DS_FP4_EXPERT_GEMMS"] = gemm_mode(variant)   # the first forward makes them
    try:
        with AllToAllCounter() as counter:
            y, dx, dw, sent = check_and_count(layer, x, dy, counter)
    finally:
        os.environ.pop("DS_FP4_EXPERT_GEMMS")
    graph_mb = capture_graphs(layer, x, dy)
    mem = measure_memory(layer, x, dy)
    fmts = wire_formats(section)
    # dropless layers send each route once; DeepSpeed's sends every capacity slot
    rows = cfg["tokens"] * cfg["k"] if variant.startswith("autoep") else cfg["experts"] * cap["C"]
    computed = {k: rows * row_bytes(Format(fmts[k]), cfg["hidden"]) for k in A2A_KINDS}
    result = {
        "config": name, **cfg, "variant": variant, "layer": type(layer).__name__,
        "experts": experts_label(layer),
        "fp4_moe": section, "wire_formats": fmts, "capacity": cap["C"], "a2a_rows": rows,
        **mem,
        "graph_reserved_mb": graph_mb,
        "weight_cache_mb": weight_cache_mb(layer),
        "bytes_source": "measured" if ep > 1 else "computed (EP 1 moves nothing)",
        "a2a_bytes": {k: sent[k] for k in A2A_KINDS} if ep > 1 else computed,
        "a2a_bytes_computed": computed,
        # None where there is nothing to compare with (a baseline, or its family's baseline
        # not asked for; the grouped layer's weights are laid out differently)
        "rel_err_out": _rel_err(y, ref[0]) if ref else None,
        "rel_err_dx": _rel_err(dx, ref[1]) if ref else None,
        "rel_err_dw": _rel_err_dict(dw, ref[2]) if ref and variant != GROUPED else None,
    }
    result["bytes_match_formats"] = result["a2a_bytes"] == computed
    return result, (y, dx, dw, cap["C"]), (layer, x, dy)


def time_in_rounds(states, args):
    """``{variant: [median ms per round]}``: every round times every variant once, in turn,
    so that a slow spell of a shared host slows all variants alike."""
    rounds = {variant: [] for variant in states}
    for _ in range(args.rounds):
        for variant, (layer, x, dy) in states.items():
            rounds[variant].append(time_steps(layer, x, dy, args.warmup, args.iters))
    return rounds


def bench_config(name, cfg, variants, args, device):
    """All variants of one config (baseline first) plus the wire kernels' times."""
    results, states = [], {}
    if tdist.get_world_size() > 1 and GROUPED in variants:
        print(f"{GROUPED} runs on one rank only (no all-to-all): left out at EP "
              f"{tdist.get_world_size()}", flush=True)
        variants = [v for v in variants if v != GROUPED]
    refs = {}   # the baseline's outputs of each family of layers: DeepSpeed's, AutoEP's
    base = baselines(variants)
    for variant in variants:
        fam = family(variant)
        r, out, states[variant] = bench_variant(name, cfg, variant, args, device, refs.get(fam))
        if variant == base.get(fam):
            refs[fam] = out
        results.append(r)
    rounds = time_in_rounds(states, args)
    for r in results:
        r["fwd_bwd_ms_rounds"] = rounds[r["variant"]]
        r["fwd_bwd_ms"] = statistics.median(rounds[r["variant"]])
        r["tokens_per_s_per_gpu"] = cfg["tokens"] / r["fwd_bwd_ms"] * 1e3
    del states
    gc.collect()
    get_accelerator().empty_cache()
    rows = results[0]["a2a_rows"]
    fmts = sorted({f for r in results for f in r["wire_formats"].values()})
    kernels = {f: wire_kernel_us(f, rows, cfg["hidden"], device, args.warmup, args.iters) for f in fmts}
    return results, kernels


def project(results, kernels, ep_sizes, bw_gbs, gpus_per_node):
    """All-to-all time (us) per variant and EP size at ``bw_gbs`` GB/s per GPU.

    Per all-to-all: pack kernel + the bytes that leave the node / bandwidth + unpack kernel.
    A rank's buffer stays the same size as EP grows (tokens per GPU fixed), and (n-1)/n of
    it goes to other ranks ((n - gpus_per_node)/n off-node when ranks share a node).
    """
    out = []
    for r in results:
        for n in ep_sizes:
            local = gpus_per_node if gpus_per_node else 1
            remote = max(0, n - local) / n
            t = {}
            for kind in A2A_KINDS:
                k = kernels[r["config"]][r["wire_formats"][kind]]
                wire = r["a2a_bytes"][kind] * remote / (bw_gbs * 1e3)  # bytes / (GB/s) -> us
                t[kind] = k["pack_us"] + wire + k["unpack_us"]
            out.append({"config": r["config"], "variant": r["variant"], "ep": n,
                        "dispatch_fwd_us": t["dispatch_fwd"], "dispatch_bwd_us": t["dispatch_bwd"],
                        "all_a2a_us": sum(t.values())})
    return out


def environment():
    """``bench_common.environment`` with ``device`` (the GPU, or the CPU's name) in place
    of ``gpu`` and the number of ranks."""
    env = bench_common.environment(libraries=("deepspeed",))
    gpu = env.pop("gpu")
    on_gpu = get_accelerator().device_name() != "cpu" and torch.cuda.is_available()
    return {"device": gpu if on_gpu else platform.processor() or "cpu",
            "ranks": tdist.get_world_size(), **env}


# --------------------------------------------------------------------------- main

def main(argv=None):
    args = build_parser().parse_args(argv)
    init_one_process()
    on_gpu = get_accelerator().device_name() != "cpu"
    device = local_device()
    args.warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 1)
    args.iters = args.iters if args.iters is not None else (20 if on_gpu else 3)
    args.rounds = args.rounds if args.rounds is not None else (3 if on_gpu else 1)
    names = (args.configs or DEFAULT_CONFIGS["gpu" if on_gpu else "cpu"]).split(",")
    variants = args.variants.split(",")
    first = baselines(variants).values()
    variants = sorted(variants, key=lambda v: v not in first)   # baselines first
    unknown = [n for n in names if n not in CONFIGS] + [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown config/variant {unknown}; configs: {list(CONFIGS)}, variants: {list(VARIANTS)}")
    world = tdist.get_world_size()
    results, kernels = [], {}
    for name in names:
        if CONFIGS[name]["experts"] % world:
            raise ValueError(f"config {name}: {CONFIGS[name]['experts']} experts do not split over {world} ranks")
        res, kernels[name] = bench_config(name, CONFIGS[name], variants, args, device)
        results += res
    proj = project(results, kernels, (8, 16, 32), args.bw_gbs, args.gpus_per_node)
    report(args, results, kernels, proj)
    tdist.barrier()


def report(args, results, kernels, proj):
    """Rank 0 writes JSON + markdown under ``args.out`` and prints the tables last."""
    if tdist.get_rank() != 0:
        return
    env = environment()
    tag = "cpu" if "cpu" in get_accelerator().device_name() else env["device"].split()[-1].lower()
    stem = Path(args.out) / f"bench_moe_layer_{tag}_{env['ranks']}rank"
    md = moe_layer_tables.markdown(env, args, results, kernels, proj)
    bench_common.write_report(stem, {"environment": env, "args": vars(args), "results": results,
                                     "kernels": kernels, "projection": proj}, md)
    print(f"written {stem}.json and {stem}.md\n\n{md}", flush=True)


if __name__ == "__main__":
    main()
