"""Train-loss deviation of each run from a baseline run, averaged over windows of steps.

Reads the ``metrics_<recipe>.csv`` files that ``tools/train_moe.py`` / ``tools/compare_runs.py``
write (one row per optimizer step, ``lm_loss`` column) from one or more folders; every
recipe must have seen the same batches at a given step (same seed and data order). Each
cell is the mean over the window's steps of ``lm_loss / lm_loss_base - 1``::

    python tools/loss_windows.py bench/results/train_compare_h200_2gpu_3000steps \\
        bench/results/ablation_h200_2gpu_3000steps --window 1000
"""

import argparse
import csv
import statistics
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

from moe_train.curve_files import open_metrics  # noqa: E402


def read_losses(folders):
    """``{recipe: {step: lm_loss}}`` of every metrics_*.csv (or .csv.gz) in ``folders`` (first
    one wins)."""
    runs = {}
    for folder in folders:
        names = {p.name[len("metrics_"):].split(".csv")[0]
                 for p in Path(folder).glob("metrics_*.csv*")}
        for name in sorted(names - set(runs)):
            with open_metrics(Path(folder) / f"metrics_{name}.csv") as f:
                runs[name] = {int(r["step"]): float(r["lm_loss"]) for r in csv.DictReader(f)}
    return runs


def window_deviations(run, base, window):
    """``[(first step, last step, mean relative deviation, n steps)]`` per window."""
    last = max(set(run) & set(base))
    out = []
    for first in range(1, last + 1, window):
        steps = [s for s in range(first, min(first + window, last + 1)) if s in run and s in base]
        if steps:
            out.append((first, steps[-1], statistics.mean(run[s] / base[s] - 1 for s in steps),
                        len(steps)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+")
    p.add_argument("--base", default="bf16", help="recipe the others are compared with")
    p.add_argument("--window", type=int, default=1000, help="steps per window")
    args = p.parse_args(argv)
    runs = read_losses(args.folders)
    if args.base not in runs:
        raise SystemExit(f"no metrics_{args.base}.csv in {args.folders}; found {sorted(runs)}")
    base = runs.pop(args.base)
    rows = {name: window_deviations(run, base, args.window) for name, run in runs.items()}
    windows = next(iter(rows.values()), [])
    print("| recipe | " + " | ".join(f"steps {a}-{b}" for a, b, _, _ in windows) + " |")
    print("|---|" + "---|" * len(windows))
    for name, cells in rows.items():
        print(f"| {name} | " + " | ".join(f"{100 * d:+.2f}%" for _, _, d, _ in cells) + " |")


if __name__ == "__main__":
    main()
