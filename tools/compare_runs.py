"""Put runs of ``tools/train_moe.py`` made separately side by side, as ``--compare`` does.

``--compare bf16,fp8,fp4`` runs the recipes one after another in one job. On a machine with
room to spare (a small model leaves a GPU mostly idle) the recipes can instead run at the
same time, each as its own job with its own ``--recipe`` and ``--out``; this script then
reads those folders and writes the same table, CSVs, summary and PNG::

    python tools/compare_runs.py runs/bf16 runs/fp8 runs/fp4 --out runs/compare

Each folder holds what one run wrote under ``--out`` (summary.json, metrics_*.csv). The
runs should share the model, data, seed and step count; the script says so when they
do not. Times per step of runs that shared GPUs are not comparable with solo runs.
"""

import argparse
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

from moe_train.metrics import read_outputs, write_outputs  # noqa: E402
from moe_train.report import add_deviations, format_table, plot_compare  # noqa: E402

# Summary fields that must agree for the loss curves to be comparable.
SAME_RUN = ("world_size", "ep_size", "params", "expert_params", "steps")


def merge(dirs):
    """The ``RunResult``s of every folder in ``dirs``, in order, with fresh deviations."""
    results = [r for d in dirs for r in read_outputs(d)]
    if not results:
        raise ValueError("no runs found: give folders that train_moe.py --out wrote")
    names = [r.recipe for r in results]
    if len(set(names)) != len(names):
        raise ValueError(f"two runs have the same recipe name: {names}; give each its own")
    first = results[0].summary
    for r in results[1:]:
        differ = [k for k in SAME_RUN if r.summary.get(k) != first.get(k)]
        if differ:
            raise ValueError(f"run {r.recipe} differs from {results[0].recipe} in {differ}: "
                             f"its loss curve is not comparable")
    for r in results:  # deviations are recomputed against this set's bf16 run
        for key in [k for k in r.summary if "_rel_dev_vs_" in k]:
            del r.summary[key]
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", help="folders written by train_moe.py --out")
    p.add_argument("--out", required=True, help="folder for the combined table, CSVs and PNG")
    args = p.parse_args(argv)
    results = merge(args.dirs)
    base = add_deviations([r.summary for r in results])
    table = format_table([r.summary for r in results], base)
    write_outputs(results, args.out, table)
    plot_compare(results, Path(args.out) / "compare.png", base)
    print(table)
    return results


if __name__ == "__main__":
    main()
