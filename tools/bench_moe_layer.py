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
- ``autoep-bf16``, ``autoep-fp4``, ``autoep-fp4-fp8experts``: DeepSpeed AutoEP's dropless
  layer (a one-block Qwen3-MoE of the same sizes, its own random weights;
  ``tools/moe_train/autoep_layer.py``) as it is, with the paper's recipe, and with the
  recipe and ``"fp8_experts": true`` (grouped FP8 GEMMs inside AutoEP). Their errors are
  against ``autoep-bf16``; ``vs AutoEP`` is their time and kept memory over its.
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
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist

# Run by path: make the moe_train package beside this file importable (it shares the main
# job's all-to-all counter, memory probe, seeds, process setup and recipe reader); importing
# it also puts the checkout on sys.path, so that `import ds_fp4` works.
TOOLS = Path(__file__).resolve().parent
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402

from moe_train import REPO  # noqa: E402
from moe_train.data import mix_seed  # noqa: E402
from moe_train.launch import local_device, quiet_deepspeed, single_process_env  # noqa: E402
from moe_train.metrics import A2A_KINDS, AllToAllCounter, measure_kept_for_backward  # noqa: E402
from moe_train.model import make_expert  # noqa: E402
from moe_train.recipes import recipe_section  # noqa: E402
from moe_train.report import fmt, markdown_table  # noqa: E402

from ds_fp4.config import Format  # noqa: E402
from ds_fp4.moe.alltoall import row_bytes  # noqa: E402

# Layer sizes. tokens = tokens per rank; capacity factor 1.25 throughout (H200.md baselines).
CONFIGS = {
    "tiny": dict(hidden=256, experts=8, k=2, ffn=512, tokens=512),
    "small": dict(hidden=1024, experts=8, k=2, ffn=1024, tokens=4096),
    "h4096-e16-top2": dict(hidden=4096, experts=16, k=2, ffn=2048, tokens=8192),
    "dsv3-e8-top2": dict(hidden=7168, experts=8, k=2, ffn=2048, tokens=8192),
    "dsv3-e16-top8": dict(hidden=7168, experts=16, k=8, ffn=2048, tokens=4096),
    "dsv3-e32-top2": dict(hidden=7168, experts=32, k=2, ffn=2048, tokens=8192),
}
DEFAULT_CONFIGS = {"cpu": "tiny", "gpu": "small,h4096-e16-top2,dsv3-e16-top8,dsv3-e32-top2"}
ALL_BF16 = {"enabled": True, "dispatch": "bf16", "combine": "bf16", "grad": "bf16",
            "cache": "bf16", "fp8_experts": False}
VARIANTS = ("deepspeed-bf16", "grouped-bf16", "fp4moe-bf16", "fp8", "fp4", "fp4-eager",
            "fp4-graphs", "fp4-grouped", "fp4-loop", "fp4-bf16experts", "autoep-bf16",
            "autoep-fp4", "autoep-fp4-fp8experts")
AUTOEP = "autoep-bf16"     # the AutoEP variants' baseline (same weights among them)
GEMM_MODES = {"-grouped": "grouped", "-loop": "loop"}   # variant suffix: DS_FP4_EXPERT_GEMMS
DEFAULT_VARIANTS = ("deepspeed-bf16", "grouped-bf16", "fp4moe-bf16", "fp8", "fp4", "fp4-eager",
                    "fp4-bf16experts")
GROUPED = "grouped-bf16"
NO_FP8_EXPERTS = "-bf16experts"   # variant suffix: the recipe with "fp8_experts": false
GRAPHS = {"-graphs": True, "-eager": False}   # variant suffixes: "expert_graphs" forced
RECIPE_VARIANTS = ("fp4", "fp4-eager", "fp4-graphs", "fp4-grouped", "fp4-loop")
BASELINE = "deepspeed-bf16"
CAPACITY_FACTOR = 1.25
# Which ds_config field gives the wire format of each all-to-all.
A2A_FORMAT_KEY = {"dispatch_fwd": "dispatch", "combine_fwd": "combine",
                  "dispatch_bwd": "grad", "combine_bwd": "grad"}


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--seed", type=int, default=0)
    return p


# --------------------------------------------------------------------------- layers

def variant_section(variant):
    """The ``fp4_moe`` section of a variant, or None for DeepSpeed's own layer."""
    if variant in (BASELINE, GROUPED, AUTOEP):
        return None
    if variant == "autoep-fp4":
        return recipe_section("fp4")
    if variant == "autoep-fp4-fp8experts":
        return {**recipe_section("fp4"), "fp8_experts": True}
    if variant == "fp4moe-bf16":
        return dict(ALL_BF16)
    if variant.endswith(NO_FP8_EXPERTS):
        return {**recipe_section(variant[:-len(NO_FP8_EXPERTS)]), "fp8_experts": False}
    for suffix, graphs in GRAPHS.items():
        if variant.endswith(suffix):
            return {**recipe_section(variant[:-len(suffix)]), "expert_graphs": graphs}
    for suffix in GEMM_MODES:
        if variant.endswith(suffix):
            return recipe_section(variant[:-len(suffix)])
    return recipe_section(variant)


def gemm_mode(variant):
    """``DS_FP4_EXPERT_GEMMS`` for a variant (read when its FP8 experts are made)."""
    return next((m for s, m in GEMM_MODES.items() if variant.endswith(s)), "auto")


def wire_formats(section):
    """``{a2a kind: format}`` of a variant (bf16 everywhere for DeepSpeed's layer)."""
    if section is None or not section.get("enabled", True):
        return {kind: "bf16" for kind in A2A_KINDS}
    from ds_fp4.config import FP4MoEConfig
    cfg = FP4MoEConfig.from_section(section)
    return {kind: str(getattr(cfg, A2A_FORMAT_KEY[kind])) for kind in A2A_KINDS}


def build_layer(cfg, section, ep_size, seed, device):
    """A bf16 MoE layer on ``device`` with the same weights for every variant."""
    torch.manual_seed(seed)
    # Experts are made on the device (DeepSpeed deep-copies this one): 1e9 parameters of
    # DeepSeek-like sizes would take seconds to initialize on the host.
    expert = make_expert(cfg["hidden"], cfg["ffn"]).to(device=device, dtype=torch.bfloat16)
    layer = MoE(hidden_size=cfg["hidden"], expert=expert,
                num_experts=cfg["experts"], ep_size=ep_size, k=cfg["k"],
                capacity_factor=CAPACITY_FACTOR, eval_capacity_factor=CAPACITY_FACTOR,
                min_capacity=4, drop_tokens=True, top2_2nd_expert_sampling=False)
    local = layer.deepspeed_moe.experts.deepspeed_experts
    ep_rank = tdist.get_rank() % ep_size
    for j, expert in enumerate(local):  # distinct experts, independent of the EP size
        g = torch.Generator(device=device).manual_seed(mix_seed(seed, ep_rank * len(local) + j))
        for _, param in sorted(expert.named_parameters()):
            w = torch.randn(param.shape, generator=g, device=device) * param.shape[-1] ** -0.5
            param.data.copy_(w)
    if section is not None:  # FP4MoE in place: same parameter objects
        import ds_fp4
        ds_fp4.convert(layer, config=section)
    layer = layer.to(device=device, dtype=torch.bfloat16)
    layer.set_deepspeed_parallelism()
    return layer


def capture_capacity(layer):
    """Wrap the gate so that the capacity C of the latest forward is kept in a dict (the
    dropless layer has none: C stays the baseline's)."""
    seen = {}
    if not hasattr(layer, "deepspeed_moe"):
        return seen
    gate = layer.deepspeed_moe.gate
    forward = gate.forward

    def wrapped(*a, **kw):
        out = forward(*a, **kw)
        seen["C"] = int(out[1])
        return out

    gate.forward = wrapped
    return seen


# --------------------------------------------------------------------------- measurements

def _sync():
    get_accelerator().synchronize()


def _clear_grads(layer, x):
    x.grad = None
    for p in layer.parameters():
        p.grad = None


def check_and_count(layer, x, dy, counter):
    """One forward+backward with the all-to-alls counted.

    Returns:
        ``(y, dx, dw, bytes)``: the output and input gradient (fp32 copies), ``{parameter
        name: gradient}`` and ``{a2a kind: bytes this rank sent}``.
    """
    _clear_grads(layer, x)
    counter.begin()
    counter.phase = "fwd"
    y = layer(x)[0]
    counter.phase = "bwd"
    y.backward(dy)
    counter.phase = None
    sent = counter.take()
    dw = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach().float(), x.grad.detach().float(), dw, sent


def measure_memory(layer, x, dy):
    """Memory of one step, MB: kept for backward, forward peak, forward+backward peak.

    Peaks are measured on GPUs only (None on CPU); "kept" on CPU comes from the profiler.
    """
    _clear_grads(layer, x)
    acc = get_accelerator()
    if acc.device_name() == "cpu":
        y, kept = measure_kept_for_backward(lambda: layer(x)[0])
        y.backward(dy)
        return {"kept_mb": kept, "fwd_peak_mb": None, "fwd_bwd_peak_mb": None}
    _sync()
    gc.collect()
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    y = layer(x)[0]
    _sync()
    kept, fwd_peak = acc.memory_allocated() - before, acc.max_memory_allocated() - before
    y.backward(dy)
    _sync()
    mb = 2**20
    return {"kept_mb": kept / mb, "fwd_peak_mb": fwd_peak / mb,
            "fwd_bwd_peak_mb": (acc.max_memory_allocated() - before) / mb}


def experts_label(layer):
    """The expert module that ran, ``+graphs`` where it replays captured CUDA graphs."""
    if hasattr(layer, "layer"):      # AutoEP (moe_train.autoep_layer.AutoEPAdapter)
        cfg = getattr(layer.layer, "fp4_config", None)
        fp8 = cfg is not None and cfg.enabled and cfg.fp8_experts is True
        return "AutoEP FP8 grouped" if fp8 else "AutoEP GroupedExperts"
    if not hasattr(layer, "deepspeed_moe"):
        return "torch._grouped_mm"
    experts = layer.deepspeed_moe.experts
    graphs = getattr(experts, "graphs", None)
    return type(experts).__name__ + ("+graphs" if graphs is not None and graphs.captures else "")


def capture_graphs(layer, x, dy):
    """One more fwd+bwd, in which ``expert_graphs`` captures its passes where it does (the
    first step ran them eagerly); returns the memory this step newly reserved, MB (the
    graphs' private pools; ~0 without graphs)."""
    acc = get_accelerator()
    _sync()
    before = acc.memory_reserved() if acc.device_name() != "cpu" else None
    _clear_grads(layer, x)
    layer(x)[0].backward(dy)
    _sync()
    return None if before is None else (acc.memory_reserved() - before) / 2**20


def time_steps(layer, x, dy, warmup, iters):
    """Median forward+backward time in ms over ``iters`` steps, the slowest rank's."""
    times = []
    for i in range(warmup + iters):
        _clear_grads(layer, x)
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

def _rel_err(a, b):
    """``||a - b|| / ||b||``, the largest over ranks."""
    e = ((a - b).norm() / b.norm().clamp_min(1e-30)).double().reshape(1)
    tdist.all_reduce(e, op=tdist.ReduceOp.MAX)
    return e.item()


def _rel_err_dict(a, b):
    """Relative error of all gradients together, ``||a - b|| / ||b||`` over matching names."""
    if set(a) != set(b):
        raise RuntimeError(f"parameters differ from the baseline's: {sorted(set(a) ^ set(b))}")
    num = sum(((a[n].float() - b[n].float()) ** 2).sum() for n in b)
    den = sum((b[n].float() ** 2).sum() for n in b)
    e = (num.sqrt() / den.sqrt().clamp_min(1e-30)).double().reshape(1)
    tdist.all_reduce(e, op=tdist.ReduceOp.MAX)
    return e.item()


def _inputs(cfg, seed, device):
    g = torch.Generator().manual_seed(mix_seed(seed, tdist.get_rank()))
    shape = (cfg["tokens"], cfg["hidden"])
    x = torch.randn(shape, generator=g).to(device, torch.bfloat16).requires_grad_()
    return x, torch.randn(shape, generator=g).to(device, torch.bfloat16)


def bench_variant(name, cfg, variant, args, device, ref):
    """Measure one variant of one config; ``ref`` holds the baseline's ``(y, dx)`` or None."""
    ep = tdist.get_world_size()
    section = variant_section(variant)
    if variant.startswith("autoep"):
        from moe_train import autoep_layer
        layer = autoep_layer.build(cfg, section, ep, args.seed, device)
    else:
        layer = build_layer(cfg, section, ep, args.seed, device)
    if variant == GROUPED:
        from moe_train.grouped_bf16 import GroupedBF16MoE
        layer = GroupedBF16MoE.from_deepspeed(layer).to(device)
    cap = capture_capacity(layer)
    cap.setdefault("C", ref[3] if ref else 0)
    x, dy = _inputs(cfg, args.seed, device)
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
        "bytes_source": "measured" if ep > 1 else "computed (EP 1 moves nothing)",
        "a2a_bytes": {k: sent[k] for k in A2A_KINDS} if ep > 1 else computed,
        "a2a_bytes_computed": computed,
        "rel_err_out": _rel_err(y, ref[0]) if ref else 0.0,
        "rel_err_dx": _rel_err(dx, ref[1]) if ref else 0.0,
        "rel_err_dw": _rel_err_dict(dw, ref[2]) if ref and variant != GROUPED else 0.0,
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
    refs = {}   # the baseline of each family of layers: DeepSpeed's, AutoEP's
    for variant in variants:
        family = "autoep" if variant.startswith("autoep") else "legacy"
        r, out, states[variant] = bench_variant(name, cfg, variant, args, device,
                                                refs.get(family))
        if variant in (BASELINE, AUTOEP):
            refs[family] = out
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


# --------------------------------------------------------------------------- tables

def _ratio(a, b):
    return None if a is None or not b else a / b


def layer_table(results):
    """Main table; ratios are to DeepSpeed's bf16 layer of the same config."""
    base = {r["config"]: r for r in results if r["variant"] == BASELINE}
    grouped = {r["config"]: r for r in results if r["variant"] == GROUPED}
    autoep = {r["config"]: r for r in results if r["variant"] == AUTOEP}
    head = ["config", "variant", "experts", "rel err out / dx / dW", "fwd+bwd ms", "tokens/s/GPU", "time vs DS",
            "time vs grouped bf16", "vs AutoEP bf16 (time / kept)",
            "kept MB", "kept vs DS", "fwd peak MB", "graph pools MB", "dispatch KiB fwd/bwd", "dispatch fwd vs DS",
            "combine KiB fwd/bwd",
            "targets (<=0.27x bytes, <=0.7x kept, <=0.6x DS time, <=1x grouped time)"]
    rows = []
    for r in results:
        b = base.get(r["config"])
        gb = grouped.get(r["config"])
        t = _ratio(r["fwd_bwd_ms"], b and b["fwd_bwd_ms"])
        tg = _ratio(r["fwd_bwd_ms"], gb and gb["fwd_bwd_ms"])
        ab = autoep.get(r["config"]) if r["variant"].startswith("autoep") else None
        vs_autoep = "-" if ab is None else (f"{fmt(_ratio(r['fwd_bwd_ms'], ab['fwd_bwd_ms']), '.2f')}"
                                            f" / {fmt(_ratio(r['kept_mb'], ab['kept_mb']), '.2f')}")
        k = _ratio(r["kept_mb"], b and b["kept_mb"])
        d = _ratio(r["a2a_bytes"]["dispatch_fwd"], b and b["a2a_bytes"]["dispatch_fwd"])
        target = "-"
        if r["variant"] in RECIPE_VARIANTS and None not in (t, k, d):
            checks = (d <= 0.27, k <= 0.7, t <= 0.6) + (() if tg is None else (tg <= 1.0,))
            target = " ".join("ok" if ok else "MISS" for ok in checks)
        a = r["a2a_bytes"]
        rows.append([r["config"], r["variant"], r.get("experts", "-"), f"{r['rel_err_out']:.1e} / {r['rel_err_dx']:.1e} / {r['rel_err_dw']:.1e}",
                     f"{r['fwd_bwd_ms']:.2f}", f"{r['tokens_per_s_per_gpu']:,.0f}", fmt(t, ".2f"),
                     fmt(tg, ".2f"), vs_autoep,
                     fmt(r["kept_mb"], ",.1f"), fmt(k, ".2f"), fmt(r["fwd_peak_mb"], ",.1f"),
                     fmt(r["graph_reserved_mb"] if "+graphs" in r["experts"] else 0.0, ",.0f"),
                     f"{a['dispatch_fwd'] / 1024:,.0f} / {a['dispatch_bwd'] / 1024:,.0f}", fmt(d, ".3f"),
                     f"{a['combine_fwd'] / 1024:,.0f} / {a['combine_bwd'] / 1024:,.0f}", target])
    return markdown_table(head, rows)


def kernel_table(kernels, results):
    head = ["config", "rows x hidden", "format", "pack us", "unpack us"]
    shapes = {r["config"]: (r["a2a_rows"], r["hidden"]) for r in results}
    rows = [[c, f"{shapes[c][0]} x {shapes[c][1]}", f, f"{k['pack_us']:.1f}", f"{k['unpack_us']:.1f}"]
            for c, per in kernels.items() for f, k in per.items() if f != "bf16"]
    return markdown_table(head, rows)


def projection_table(proj):
    base = {(p["config"], p["ep"]): p for p in proj if p["variant"] == BASELINE}
    head = ["config", "variant", "EP", "dispatch fwd us", "dispatch bwd us", "all 4 a2a us", "a2a vs DS"]
    rows = []
    for p in proj:
        b = base.get((p["config"], p["ep"]))
        rows.append([p["config"], p["variant"], p["ep"], f"{p['dispatch_fwd_us']:,.0f}",
                     f"{p['dispatch_bwd_us']:,.0f}", f"{p['all_a2a_us']:,.0f}",
                     fmt(_ratio(p["all_a2a_us"], b and b["all_a2a_us"]), ".2f")])
    return markdown_table(head, rows)


def environment():
    acc = get_accelerator()
    on_gpu = acc.device_name() != "cpu"
    return {"device": torch.cuda.get_device_name() if on_gpu and torch.cuda.is_available() else platform.processor() or "cpu",
            "ranks": tdist.get_world_size(), "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


# --------------------------------------------------------------------------- main

def main(argv=None):
    args = build_parser().parse_args(argv)
    single_process_env()
    quiet_deepspeed()
    acc = get_accelerator()
    on_gpu = acc.device_name() != "cpu"
    if on_gpu:
        acc.set_device(args.local_rank)
    deepspeed.init_distributed(dist_backend=acc.communication_backend_name())
    device = local_device()
    args.warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 1)
    args.iters = args.iters if args.iters is not None else (20 if on_gpu else 3)
    args.rounds = args.rounds if args.rounds is not None else (3 if on_gpu else 1)
    names = (args.configs or DEFAULT_CONFIGS["gpu" if on_gpu else "cpu"]).split(",")
    variants = args.variants.split(",")
    variants = sorted(variants, key=lambda v: (v != BASELINE, v != AUTOEP))  # baselines first
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"bench_moe_layer_{tag}_{env['ranks']}rank"
    bad = [f"{r['config']}/{r['variant']}" for r in results if not r["bytes_match_formats"]]
    remote = f"{args.gpus_per_node} ranks per node" if args.gpus_per_node else "every peer on another node"
    md = "\n\n".join([
        f"# MoE layer benchmark: {env['device']}, {env['ranks']} rank(s), EP {env['ranks']}\n\n"
        f"torch {env['torch']}, deepspeed {env['deepspeed']}, {env['date']}. Per rank; bf16 model; "
        f"capacity factor {CAPACITY_FACTOR}; bytes are each rank's all_to_all_single input "
        f"({results[0]['bytes_source']}). fwd+bwd ms: median over {args.rounds} rounds (the "
        f"variants of a config interleaved) of the median of {args.iters} steps after "
        f"{args.warmup} warm-up steps; every round is in the JSON.",
        layer_table(results),
        "Wire-format kernels on the dispatch buffer:\n\n" + kernel_table(kernels, results),
        f"Projected all-to-all time at {args.bw_gbs:g} GB/s per GPU ({remote}): pack + bytes "
        f"off-node / bandwidth + unpack, per layer and step:\n\n" + projection_table(proj),
    ] + ([f"WARNING: bytes differ from the wire formats' sizes for {', '.join(bad)}"] if bad else []))
    stem.with_suffix(".json").write_text(json.dumps(
        {"environment": env, "args": vars(args), "results": results, "kernels": kernels,
         "projection": proj}, indent=2) + "\n")
    stem.with_suffix(".md").write_text(md + "\n")
    print(f"written {stem}.json and {stem}.md\n\n{md}", flush=True)


if __name__ == "__main__":
    main()
