"""Reruns of one seed (issue 16): how far apart runs of the same settings end, and each
recipe's loss against the mean of several baseline runs instead of one.

On the GPU two runs of one seed, recipe and settings do not repeat each other: their losses
part after some steps (kernels that sum in no fixed order, e.g. atomics), and the runs then
drift apart like runs of two seeds' noise. So one baseline run per seed is one draw; the
mean of several (reruns, and bf16 twins) is a better reference, and their spread is the
floor under any recipe's per-seed deviation. For every seed this reads all runs given
(train_moe.py --out folders: full runs, trunks, branches' trunks), and writes

- the first step at which two runs of the same recipe name, LR and schedule differ;
- over steps ``--first`` to ``--last``: each reference run's mean train loss against the
  references' mean (their spread), and every other recipe's against it, mean +- standard
  error over seeds.

::

    python tools/reruns.py runs/*/ --reference bf16 bf16_lr1001 --first 751 --last 1000 \\
        --out results/reruns
"""

import argparse
import itertools
import json
import statistics
from collections import defaultdict
from pathlib import Path

import bench_common  # noqa: F401  (puts the checkout on sys.path)
from moe_train.metrics import read_outputs
from moe_train.seeds import mean_and_stderr


def window_loss(run, first, last):
    """The mean train loss over steps ``first``..``last``; every one of them must be there."""
    losses = {s["step"]: s["lm_loss"] for s in run.steps}
    missing = [s for s in range(first, last + 1) if s not in losses]
    if missing:
        raise ValueError(f"run {run.recipe} (seed {run.summary.get('seed')}) lacks steps "
                         f"{missing[0]}..{missing[-1]} of --first {first} --last {last}")
    return statistics.mean(losses[s] for s in range(first, last + 1))


def first_difference(a, b):
    """The first step both runs recorded at which their train losses differ (None: none)."""
    la = {s["step"]: s["lm_loss"] for s in a.steps}
    return next((s["step"] for s in b.steps if s["step"] in la and la[s["step"]] != s["lm_loss"]),
                None)


def _same_lr(a, b):
    """Whether the runs' LRs agree at every step both recorded (same peak and schedule;
    summaries written before they recorded ``lr`` and ``schedule_steps`` lack them)."""
    la = {s["step"]: s["lr"] for s in a.steps}
    return all(la[s["step"]] == s["lr"] for s in b.steps if s["step"] in la)


def repeats(runs):
    """``[(recipe, seed, first differing step)]`` for each pair of runs of one recipe name and
    seed that start at step 1 and ran the same LR at every step."""
    by = defaultdict(list)
    for r in runs:
        if r.steps and r.steps[0]["step"] == 1:
            by[r.recipe, r.summary.get("seed")].append(r)
    return [(recipe, seed, first_difference(a, b))
            for (recipe, seed), group in sorted(by.items(), key=lambda kv: str(kv[0]))
            for a, b in itertools.combinations(group, 2) if _same_lr(a, b)]


def against_references(runs, references, first, last):
    """Per seed, the references' mean window loss; the references' own deviations from it,
    and each other recipe's (its runs' mean), as ``{recipe: {seed: [deviations]}}``."""
    by_seed = defaultdict(lambda: defaultdict(list))
    for r in runs:
        if r.steps and r.steps[0]["step"] <= first and r.steps[-1]["step"] >= last:
            by_seed[r.summary.get("seed")][r.recipe].append(window_loss(r, first, last))
    out = defaultdict(dict)
    for seed, recipes in sorted(by_seed.items()):
        refs = [v for name in references for v in recipes.get(name, [])]
        if len(refs) < 2:
            raise ValueError(f"seed {seed} has {len(refs)} reference run(s) over steps "
                             f"{first}-{last} among {sorted(recipes)}: give at least two")
        mean = statistics.mean(refs)
        out["references"][seed] = [v / mean - 1 for v in refs]
        for name, vals in recipes.items():
            if name not in references:
                out[name][seed] = [statistics.mean(vals) / mean - 1]
    return dict(out)


def summarize(devs):
    """Per recipe: per-seed deviations, their mean +- standard error over seeds; for the
    references, each seed's spread (sample standard deviation) and the mean spread."""
    out = {}
    for name, per_seed in devs.items():
        if name == "references":
            spread = {s: statistics.stdev(v) for s, v in per_seed.items()}
            out[name] = {"per_seed": per_seed, "spread": spread,
                         "mean_spread": statistics.mean(spread.values())}
        else:
            vals = [v[0] for v in per_seed.values()]
            mean, err = mean_and_stderr(vals)
            out[name] = {"per_seed": {s: v[0] for s, v in per_seed.items()},
                         "mean": mean, "stderr": err, "n": len(vals)}
    return out


def format_tables(summary, diffs, references, first, last):
    lines = ["Runs of the same recipe, LR, schedule and seed: the first step their losses differ",
             "", "| recipe | seed | pairs | first differing step, each pair |", "|---|---|---|---|"]
    pairs = defaultdict(list)
    for r, s, d in diffs:
        pairs[r, s].append("none" if d is None else str(d))
    lines += [f"| {r} | {s} | {len(v)} | {', '.join(v)} |" for (r, s), v in pairs.items()]
    ref = summary["references"]
    lines += ["", f"Train loss over steps {first}-{last} against the mean of each seed's "
              f"reference runs ({', '.join(references)}):", "",
              "| | per seed | mean +- standard error |", "|---|---|---|"]
    lines.append("| reference runs' spread (s.d.) | "
                 + ", ".join(f"{s}: {100 * v:.2f}%" for s, v in ref["spread"].items())
                 + f" | {100 * ref['mean_spread']:.2f}% (mean) |")
    for name, e in summary.items():
        if name != "references":
            err = "" if e["stderr"] is None else f" +- {100 * e['stderr']:.2f}%"
            lines.append(f"| {name} | " + ", ".join(f"{s}: {100 * v:+.2f}%"
                                                     for s, v in e["per_seed"].items())
                         + f" | {100 * e['mean']:+.2f}%{err} (n {e['n']}) |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", help="train_moe.py --out folders")
    p.add_argument("--reference", nargs="+", default=["bf16"],
                   help="recipe names (run names) whose runs are draws of the baseline")
    p.add_argument("--first", type=int, required=True, help="first step of the window")
    p.add_argument("--last", type=int, required=True, help="last step of the window")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if not 1 <= args.first <= args.last:
        p.error(f"--first {args.first} --last {args.last}: give 1 <= first <= last")
    runs = [r for d in args.dirs for r in read_outputs(d)]
    summary = summarize(against_references(runs, args.reference, args.first, args.last))
    diffs = repeats(runs)
    text = format_tables(summary, diffs, args.reference, args.first, args.last)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reruns.md").write_text(text + "\n")
    (out / "reruns.json").write_text(json.dumps(
        {"window": [args.first, args.last], "reference": args.reference, "summary": summary,
         "first_differing_step": [list(d) for d in diffs]}, indent=2) + "\n")
    print(text)
    return summary, diffs


if __name__ == "__main__":
    main()
