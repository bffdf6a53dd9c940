"""Put runs of ``tools/train_moe.py`` made separately side by side, as ``--compare`` does.

``--compare bf16,fp8,fp4`` runs the recipes one after another in one job. On a machine with
room to spare (a small model leaves a GPU mostly idle) the recipes can instead run at the
same time, each as its own job with its own ``--recipe`` and ``--out``; this script then
reads those folders and writes the same table, CSVs, summary and PNG::

    python tools/compare_runs.py runs/bf16 runs/fp8 runs/fp4 --out runs/compare

Each folder holds what one run wrote under ``--out`` (summary.json, metrics_*.csv). The
runs should share the model, data, seed and step count; the script says so when they
do not. Times per step of runs that shared GPUs are not comparable with solo runs.

``--seeds``: the folders hold runs of several seeds (``--seed``), each recipe once per seed
with the bf16 run of every seed among them; written under ``--out``: ``seeds.md`` /
``seeds.json`` (each recipe's deviation from the bf16 run of the same seed: mean, standard
error, every seed's value), ``seeds_paired.json`` (every two recipes, paired by seed: the
difference of their deviations, also a second table in ``seeds.md``) and ``seeds.png`` (one
band per recipe over the steps)::

    python tools/compare_runs.py runs/*_seed* --seeds --out runs/seeds

``--twin NAME`` adds a second bf16 run per seed (``train_moe.py --run-name NAME`` with a
change too small to matter, e.g. ``--lr`` 0.1% higher): its row is the baseline's own
scatter, and every recipe is also measured against the mean of the two baseline runs.

``--pool A,B`` (repeatable) adds the per-seed mean of those recipes' deviations: a gap they
share, resolved with fewer seeds where their draws do not move together.
"""

import argparse
import json
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

from moe_train.metrics import read_outputs, write_outputs  # noqa: E402
from moe_train.report import add_deviations, format_table, plot_compare  # noqa: E402
from moe_train import seeds as seeds_mod  # noqa: E402

# Summary fields that must agree for the loss curves to be comparable.
SAME_RUN = ("world_size", "ep_size", "params", "expert_params", "steps")


def merge(dirs, seeds=False):
    """The ``RunResult``s of every folder in ``dirs``, in order, with fresh deviations
    (``seeds``: recipes may repeat, once per seed)."""
    results = [r for d in dirs for r in read_outputs(d)]
    if not results:
        raise ValueError("no runs found: give folders that train_moe.py --out wrote")
    names = [r.recipe for r in results]
    if len(set(names)) != len(names) and not seeds:
        raise ValueError(f"two runs have the same recipe name: {names}; give each its own "
                         f"(runs of several seeds: add --seeds)")
    first = results[0].summary
    same = SAME_RUN if seeds else SAME_RUN + ("seed",)
    for r in results[1:]:
        differ = [k for k in same if r.summary.get(k) != first.get(k)]
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
    p.add_argument("--seeds", action="store_true",
                   help="runs of several seeds: deviations from bf16 per seed, mean and error")
    p.add_argument("--twin", default=None,
                   help="with --seeds: the recipe name of a second bf16 run per seed (e.g. "
                        "train_moe.py --run-name bf16_lr1001 --lr 0.001001): the baseline's "
                        "own scatter, and deviations against both baseline runs' mean")
    p.add_argument("--pool", action="append", default=[], metavar="A,B",
                   help="with --seeds: also the per-seed mean of these recipes' deviations "
                        "(a gap they share; repeatable)")
    args = p.parse_args(argv)
    if (args.twin or args.pool) and not args.seeds:
        p.error("--twin and --pool compare runs of several seeds: add --seeds")
    results = merge(args.dirs, args.seeds)
    if args.seeds:
        return write_seeds(results, Path(args.out), args.twin,
                           [pool.split(",") for pool in args.pool])
    base = add_deviations([r.summary for r in results])
    table = format_table([r.summary for r in results], base)
    write_outputs(results, args.out, table)
    plot_compare(results, Path(args.out) / "compare.png", base)
    print(table)
    return results


def write_seeds(results, out, twin=None, pools=()):
    """``seeds.md``, ``seeds.json``, ``seeds_paired.json`` (recipe against recipe, paired by
    seed), with ``pools`` ``seeds_pooled.json`` (the per-seed mean of each list of recipes),
    and ``seeds.png`` under ``out``; returns the deviations."""
    runs = seeds_mod.group(results)
    devs = seeds_mod.deviations(runs, twin)
    pairs = seeds_mod.paired(devs, twin)
    pooled = {"mean of " + ", ".join(names): seeds_mod.pooled(devs, names) for names in pools}
    table = seeds_mod.format_seed_table(devs, twin)
    if pairs:
        table += "\n\n" + seeds_mod.format_paired_table(pairs)
    if pooled:
        table += "\n\n" + seeds_mod.format_pooled_table(pooled)
    out.mkdir(parents=True, exist_ok=True)
    (out / "seeds.md").write_text(table + "\n")
    (out / "seeds.json").write_text(json.dumps(devs, indent=2) + "\n")
    (out / "seeds_paired.json").write_text(json.dumps(pairs, indent=2) + "\n")
    if pooled:
        (out / "seeds_pooled.json").write_text(json.dumps(pooled, indent=2) + "\n")
    seeds_mod.plot_seed_bands(runs, out / "seeds.png")
    print(table)
    return devs


if __name__ == "__main__":
    main()
