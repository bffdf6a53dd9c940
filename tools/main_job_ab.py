"""The main job's speed and peak memory under ds_config variants, from the ``summary.json``
of runs that ``tools/device/gpu_main_job_ab.sh`` made, one process each, in interleaved
rounds (a device host's speed drifts between calls and within one: compare inside a call).

Run folders are named ``<model>__<config>__<recipe>__r<round>``. The table gives, per model,
config and recipe, the median over rounds of the step time (each run's own median step after
the first five, the main job's ``step_time_ms``), tokens/s per GPU and the peak allocated memory, and each recipe's
tokens/s against bf16 under the same config (the ``example`` config's where that has none)::

    python tools/main_job_ab.py RUNS_DIR --out DIR     # DIR/main_job_ab.md and .json

Runs of several calls pool into one table: name each folder, and rename a config where the
same name meant another setting then (``DIR@old=new,...``). ``--bf16-from NAME`` pools the
bf16 runs of every config into NAME's, for configs that differ only in the ``fp4_moe``
section (which a bf16 run ignores)::

    python tools/main_job_ab.py call1/runs@example=eager,graphs=auto call3/runs@example=auto \
        --bf16-from auto
"""

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def collect(*runs_dirs, bf16_from=None):
    """``{(model, config, recipe): [summary, ...]}`` over the run folders' summaries.

    Each of ``runs_dirs`` is a folder, or ``folder@old=new,...`` to rename its configs;
    ``bf16_from``: pool every config's bf16 runs under that config name."""
    runs = defaultdict(list)
    for spec in runs_dirs:
        folder, _, renames = str(spec).partition("@")
        rename = dict(pair.split("=", 1) for pair in renames.split(",") if pair)
        found = sorted(Path(folder).glob("*__*__*__r*/summary.json"))
        if not found:
            raise SystemExit(f"{folder}: no <model>__<config>__<recipe>__r<round>/summary.json")
        for path in found:
            model, config, recipe, _ = path.parent.name.split("__")
            config = rename.get(config, config)
            if bf16_from and recipe == "bf16":
                config = bf16_from
            runs[(model, config, recipe)].append(json.loads(path.read_text())[0])
    return runs


def medians(runs):
    """One row per (model, config, recipe): medians over its rounds and every round's value."""
    rows = []
    for (model, config, recipe), summaries in sorted(runs.items()):
        step = [s["step_time_ms"] for s in summaries]
        rows.append({"model": model, "config": config, "recipe": recipe, "rounds": len(step),
                     "step_ms": statistics.median(step), "step_ms_rounds": step,
                     "tokens_per_s": statistics.median(s["tokens_per_s_per_gpu"] for s in summaries),
                     "peak_mb": max(s["peak_mem_mb"] for s in summaries)})
    bf16 = {(r["model"], r["config"]): r["tokens_per_s"] for r in rows if r["recipe"] == "bf16"}
    only = defaultdict(list)   # a model's bf16 rows: with one (pooled), it serves every config
    for (model, _), tokens in bf16.items():
        only[model].append(tokens)
    for r in rows:   # a config without a bf16 run (graphs: it changes fp4 only): the example's
        model = r["model"]
        base = bf16.get((model, r["config"]), bf16.get((model, "example")))
        if base is None and len(only[model]) == 1:
            base = only[model][0]
        r["tokens_vs_bf16"] = r["tokens_per_s"] / base if base else None
    return rows


def table(rows):
    lines = ["| model | ds_config | recipe | step ms (median; every round) | tokens/s/GPU | vs bf16, same config | peak MB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        rounds = ", ".join(f"{v:.1f}" for v in r["step_ms_rounds"])
        ratio = f"{r['tokens_vs_bf16']:.3f}x" if r["tokens_vs_bf16"] else "-"
        lines.append(f"| {r['model']} | {r['config']} | {r['recipe']} | {r['step_ms']:.1f} ({rounds}) | "
                     f"{r['tokens_per_s']:,.0f} | {ratio} | {r['peak_mb']:,.0f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs_dirs", nargs="+", metavar="RUNS_DIR[@old=new,...]")
    p.add_argument("--bf16-from", default=None,
                   help="pool the bf16 runs of all configs under this config name")
    p.add_argument("--out", default=None, help="folder for main_job_ab.md and main_job_ab.json")
    args = p.parse_args()
    rows = medians(collect(*args.runs_dirs, bf16_from=args.bf16_from))
    text = table(rows)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "main_job_ab.md").write_text(text + "\n")
        (out / "main_job_ab.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
