"""The tables and the markdown report of ``tools/bench_moe_layer.py``."""

from bench_common import fmt, markdown_table
from bench_lib.moe_layer_variants import (BASELINE, CAPACITY_FACTOR, GROUPED, RECIPE_VARIANTS,
                                          baselines)


def _ratio(a, b):
    return None if a is None or not b else a / b


def layer_table(results):
    """Main table; ratios are to DeepSpeed's bf16 layer of the same config."""
    base = {r["config"]: r for r in results if r["variant"] == BASELINE}
    grouped = {r["config"]: r for r in results if r["variant"] == GROUPED}
    autoep_base = baselines({r["variant"] for r in results}).get("autoep")
    autoep = {r["config"]: r for r in results if r["variant"] == autoep_base}
    head = ["config", "variant", "experts", "rel err out / dx / dW", "fwd+bwd ms", "tokens/s/GPU", "time vs DS",
            "time vs grouped bf16", "vs AutoEP bf16 (time / kept)",
            "kept MB", "kept vs DS", "fwd peak MB", "held between steps MB", "dispatch KiB fwd/bwd", "dispatch fwd vs DS",
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
        rows.append([r["config"], r["variant"], r.get("experts", "-"), _errors(r),
                     f"{r['fwd_bwd_ms']:.2f}", f"{r['tokens_per_s_per_gpu']:,.0f}", fmt(t, ".2f"),
                     fmt(tg, ".2f"), vs_autoep,
                     fmt(r["kept_mb"], ",.1f"), fmt(k, ".2f"), fmt(r["fwd_peak_mb"], ",.1f"),
                     fmt(_held_mb(r), ",.0f"),
                     f"{a['dispatch_fwd'] / 1024:,.0f} / {a['dispatch_bwd'] / 1024:,.0f}", fmt(d, ".3f"),
                     f"{a['combine_fwd'] / 1024:,.0f} / {a['combine_bwd'] / 1024:,.0f}", target])
    return markdown_table(head, rows)


def _errors(r):
    """Relative errors against the family's baseline, "-" where none was computed."""
    return " / ".join(fmt(r[k], ".1e") for k in ("rel_err_out", "rel_err_dx", "rel_err_dw"))


def _held_mb(r):
    """What a variant holds from one step to the next besides parameters and gradients:
    its CUDA graphs' pools and its FP8 weight tiles (``fp4_moe.fp8_weight_cache``)."""
    graphs = r["graph_reserved_mb"] if "+graphs" in r["experts"] else 0.0
    return (graphs or 0.0) + r.get("weight_cache_mb", 0.0)


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


def markdown(env, args, results, kernels, proj):
    """The report: a header with the environment and the method, the three tables and a
    warning where the bytes differ from the wire formats' sizes."""
    bad = [f"{r['config']}/{r['variant']}" for r in results if not r["bytes_match_formats"]]
    remote = f"{args.gpus_per_node} ranks per node" if args.gpus_per_node else "every peer on another node"
    return "\n\n".join([
        f"# MoE layer benchmark: {env['device']}, {env['ranks']} rank(s), EP {env['ranks']}\n\n"
        f"torch {env['torch']}, deepspeed {env['deepspeed']}, {env['date']}. Per rank; bf16 model; "
        f"capacity factor {CAPACITY_FACTOR}; bytes are each rank's all_to_all_single input "
        f"({results[0]['bytes_source']}). fwd+bwd ms: median over {args.rounds} rounds (the "
        f"variants of a config interleaved) of the median of {args.iters} steps after "
        f"{args.warmup} warm-up steps; every round is in the JSON. kept: what the forward "
        f"leaves allocated for the backward, less its output where autograd does not save "
        f"it (then the model's residual add holds it, not the backward; `output_mb` in the "
        f"JSON); peaks include the output. Errors (relative, Frobenius) and the AutoEP "
        f"ratios are against the family's bf16 baseline: DeepSpeed's layer, or "
        f"{baselines({r['variant'] for r in results}).get('autoep', 'AutoEP bf16')} for the "
        f"AutoEP rows; \"-\" where it was not run.",
        layer_table(results),
        "Wire-format kernels on the dispatch buffer:\n\n" + kernel_table(kernels, results),
        f"Projected all-to-all time at {args.bw_gbs:g} GB/s per GPU ({remote}): pack + bytes "
        f"off-node / bandwidth + unpack, per layer and step:\n\n" + projection_table(proj),
    ] + ([f"WARNING: bytes differ from the wire formats' sizes for {', '.join(bad)}"] if bad else []))
