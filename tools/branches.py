"""Branches of a run (issue 16): a recipe's loss against the trunk it branched from, at the
same steps, over many short branches.

Two bf16 runs of one seed that differ by nothing that matters (``--lr`` 0.1% higher) end
3000 steps 0.9% apart (bench/results/converge_h200_1gpu_5seeds_3000steps): the runs drift,
and every recipe's deviation carries that drift. A branch resumes a trunk's checkpoint with
another recipe and runs a few hundred steps on the trunk's LR schedule (``train_moe.py
--load TRUNK/ckpt --load-tag stepK --steps K+L --schedule-steps TRUNK_STEPS``), so it has
little time to drift. Each branch gives one sample: the mean train loss over its last
``--last`` steps against the trunk's over the same steps (and the held-out loss at its end
where the trunk evaluated at that step). A bf16 branch with ``--lr`` 0.1% higher (which
replaces the checkpoint's peak LR) measures the drift that is left.

Trunks are bf16 runs (one per seed, ``--save-interval`` checkpoints); a branch's trunk is
the one of its seed. Writes ``branches.md`` and ``branches.json`` under ``--out``; ``--twin
NAME`` adds each recipe against the mean of both bf16 draws (trunk and twin branch)::

    python tools/branches.py --trunks runs/trunk_seed* --branches runs/branch_* --out runs/branches
"""

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import bench_common  # noqa: F401  (puts the checkout on sys.path)
from moe_train.metrics import read_outputs
from moe_train.seeds import deviation_curve, mean_and_stderr, plot_bands


def _one(folder):
    results = read_outputs(folder)
    if len(results) != 1:
        raise ValueError(f"{folder} holds {len(results)} runs; give one run's --out folder")
    return results[0]


def branch_sample(branch, trunk, last):
    """``(start step, train deviation, held-out deviation or None)`` of one branch."""
    losses = {s["step"]: s["lm_loss"] for s in trunk.steps}
    steps = [s for s in branch.steps if s["step"] in losses][-last:]
    if not steps:
        raise ValueError(f"branch {branch.recipe} (seed {branch.summary['seed']}) shares no "
                         f"step with its trunk's metrics")
    train = (statistics.mean(s["lm_loss"] for s in steps)
             / statistics.mean(losses[s["step"]] for s in steps) - 1)
    end = branch.steps[-1]["step"]
    trunk_evals = dict(trunk.evals)
    heldout = None
    if branch.evals and end in trunk_evals and branch.evals[-1][0] == end:
        heldout = branch.evals[-1][1] / trunk_evals[end] - 1
    return branch.steps[0]["step"] - 1, train, heldout


def branch_windows(branch, trunk, window):
    """``[(first step, last step, train deviation)]`` over the branch in windows of ``window``
    steps from its first: how the deviation grows after the branch point."""
    losses = {s["step"]: s["lm_loss"] for s in trunk.steps}
    steps = [s for s in branch.steps if s["step"] in losses]
    out = []
    for i in range(0, len(steps), window):
        part = steps[i:i + window]
        out.append((part[0]["step"], part[-1]["step"],
                    statistics.mean(s["lm_loss"] for s in part)
                    / statistics.mean(losses[s["step"]] for s in part) - 1))
    return out


def collect(trunk_dirs, branch_dirs, last, window=None, curves=None):
    """``({recipe: [(seed, start, train, heldout)]}, {(recipe, start): [branch_windows of
    each seed]})``, checked against each trunk's settings; the second is empty without
    ``window``. ``curves``, a dict, gets ``{(recipe, start): [{step: % train deviation,
    moving mean over ``last`` steps}]}``."""
    trunks = {}
    for folder in trunk_dirs:
        t = _one(folder)
        trunks[t.summary["seed"]] = t
    samples, windows = defaultdict(list), defaultdict(list)
    for folder in branch_dirs:
        b = _one(folder)
        seed = b.summary["seed"]
        if seed not in trunks:
            raise ValueError(f"branch {folder} (seed {seed}) has no trunk among the seeds "
                             f"{sorted(trunks)}")
        trunk = trunks[seed]
        if b.summary.get("schedule_steps") != trunk.summary.get("schedule_steps"):
            raise ValueError(f"branch {folder} ran a {b.summary.get('schedule_steps')}-step "
                             f"LR schedule, its trunk {trunk.summary.get('schedule_steps')}: "
                             f"pass the trunk's --steps as the branch's --schedule-steps")
        sample = branch_sample(b, trunk, last)
        samples[b.recipe].append((seed, *sample))
        if window:
            windows[b.recipe, sample[0]].append(branch_windows(b, trunk, window))
        if curves is not None:
            curves.setdefault((b.recipe, sample[0]), []).append(
                dict(zip(*deviation_curve(b, trunk, last))))
    return dict(samples), dict(windows)


def plot_branches(curves, last, path):
    """PNG: per recipe and branch point, the train loss deviation from the trunk (moving
    mean over ``last`` steps) against the step, mean and min-max over seeds."""
    bands = [(f"{recipe} from step {start} ({len(runs)} seeds)", runs) for (recipe, start), runs
             in sorted(curves.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
    plot_bands(bands, f"train loss relative to the bf16 trunk, % (moving mean over {last} "
                      f"steps; band: min-max over seeds)", path)


def summarize_windows(windows):
    """``{(recipe, start): [(first, last, mean, stderr, n)]}`` over the seeds' branches,
    window by window (windows that not every branch reached are left out)."""
    out = {}
    for key, runs in windows.items():
        rows = []
        for cells in zip(*runs):
            mean, err = mean_and_stderr([c[2] for c in cells])
            rows.append((cells[0][0], cells[0][1], mean, err, len(cells)))
        out[key] = rows
    return out


def format_windows(summary, window):
    lines, prev = [], None
    for (recipe, start), rows in sorted(summary.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if start != prev:   # one table per branch point
            prev = start
            title = (f"Branches from step {start}, train deviation per {window} steps "
                     f"(mean +- standard error over seeds):")
            lines += ([""] if lines else []) + [
                title, "", "| recipe | " + " | ".join(f"{a}-{b}" for a, b, *_ in rows) + " |",
                "|---|" + "---|" * len(rows)]
        cells = [f"{100 * m:+.2f}%" + ("" if e is None else f" +- {100 * e:.2f}")
                 for _, _, m, e, _ in rows]
        lines.append(f"| {recipe} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summarize(samples):
    """Per recipe: n, mean +- standard error of the train and held-out deviations, and the
    train deviation's mean per start step."""
    out = {}
    for recipe, rows in samples.items():
        entry = {"n": len(rows), "samples": [list(r) for r in rows]}
        for i, key in ((2, "train"), (3, "heldout")):
            vals = [r[i] for r in rows if r[i] is not None]
            mean, err = mean_and_stderr(vals) if vals else (None, None)
            entry[key] = {"mean": mean, "stderr": err, "n": len(vals)}
        by_start = defaultdict(list)
        for r in rows:
            by_start[r[1]].append(r[2])
        entry["train_by_start"] = {k: statistics.mean(v) for k, v in sorted(by_start.items())}
        out[recipe] = entry
    return out


def against_twin(samples, twin):
    """Per recipe: its deviation against the mean of the two bf16 draws of each branch point
    (the trunk and the ``twin`` branch), ``(1 + d) / (1 + d_twin / 2) - 1``, train and
    held-out, mean +- standard error over the (seed, start) points that have both. The
    trunk alone is one draw of bf16's drift; the pair halves it."""
    draws = {(r[0], r[1]): r for r in samples.get(twin, [])}
    if not draws:
        raise ValueError(f"--twin {twin}: no branch of that recipe; the recipes are "
                         f"{sorted(samples)}")
    out = {}
    for recipe, rows in samples.items():
        if recipe == twin:
            continue
        pairs = [(r, draws[r[0], r[1]]) for r in rows if (r[0], r[1]) in draws]
        entry = {}
        for i, key in ((2, "train"), (3, "heldout")):
            vals = [(1 + r[i]) / (1 + d[i] / 2) - 1 for r, d in pairs
                    if r[i] is not None and d[i] is not None]
            mean, err = mean_and_stderr(vals) if vals else (None, None)
            entry[key] = {"mean": mean, "stderr": err, "n": len(vals)}
        out[recipe] = entry
    return out


def format_twin(paired, twin):
    lines = [f"Against both bf16 draws (the trunk and the `{twin}` branch, averaged):", "",
             "| recipe | train | held-out at the branch's end |", "|---|---|---|"]
    lines += [f"| {r} | {_pct(e['train'])} | {_pct(e['heldout'])} |" for r, e in paired.items()]
    return "\n".join(lines)


def _pct(d):
    if d["mean"] is None:
        return "-"
    err = "" if d["stderr"] is None else f" +- {100 * d['stderr']:.2f}%"
    return f"{100 * d['mean']:+.2f}%{err} (n {d['n']})"


def format_table(summary, last):
    starts = sorted({k for e in summary.values() for k in e["train_by_start"]})
    lines = ["| recipe | train | held-out at the branch's end | "
             + " | ".join(f"from step {s}" for s in starts) + " |",
             "|---|---|---|" + "---|" * len(starts)]
    for recipe, e in summary.items():
        by = [f"{100 * e['train_by_start'][s]:+.2f}%" if s in e["train_by_start"] else "-"
              for s in starts]
        lines.append(f"| {recipe} | {_pct(e['train'])} | {_pct(e['heldout'])} | "
                     + " | ".join(by) + " |")
    return "\n".join(lines) + (
        f"\n\nEach branch against its trunk (the bf16 run of its seed) at the same steps: mean "
        f"train loss over the branch's last {last} steps, relative; held-out loss at the "
        f"branch's end where the trunk evaluated there. Mean +- standard error over every "
        f"(seed, start) branch; the last columns: the train deviation's mean per start step.")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trunks", nargs="+", required=True, help="the trunks' --out folders")
    p.add_argument("--branches", nargs="+", required=True, help="the branches' --out folders")
    p.add_argument("--last", type=int, default=50, help="steps at each branch's end averaged")
    p.add_argument("--window", type=int, default=None,
                   help="also the deviation per WINDOW steps over each branch (windows.md)")
    p.add_argument("--twin", default=None,
                   help="a bf16 branch recipe (e.g. bf16_lr1001): also each recipe against the "
                        "mean of the trunk and this branch")
    p.add_argument("--plot", action="store_true",
                   help="also branches.png: each recipe's deviation from its trunk over steps")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.window is not None and args.window < 1:
        p.error(f"--window {args.window}: give a positive number of steps, e.g. 50")
    curves = {} if args.plot else None
    samples, windows = collect(args.trunks, args.branches, args.last, args.window, curves)
    summary = summarize(samples)
    table = format_table(summary, args.last)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.twin:
        paired = against_twin(samples, args.twin)
        table += "\n\n" + format_twin(paired, args.twin)
        summary = {**summary, "against_bf16_pair": paired}
    (out / "branches.md").write_text(table + "\n")
    (out / "branches.json").write_text(json.dumps(summary, indent=2) + "\n")
    if curves:
        plot_branches(curves, args.last, out / "branches.png")
    print(table)
    if windows:
        by_window = summarize_windows(windows)
        text = format_windows(by_window, args.window)
        (out / "windows.md").write_text(text + "\n")
        (out / "windows.json").write_text(json.dumps(
            {f"{r} from {k}": rows for (r, k), rows in by_window.items()}, indent=2) + "\n")
        print("\n" + text)
    return summary


if __name__ == "__main__":
    main()
