"""Split each recipe's held-out gap to bf16 into what its weights and what its forward
numerics make (issue 16), from runs evaluated under other recipes.

``tools/device/gpu_converge.sh`` with ``CROSS="bf16 fp8 fp4"`` saves every run's final
checkpoint and evaluates it under each of those recipes (``train_moe.py --eval-only
--load``) into ``<cross>/<run>_as_<recipe>``. For seed s, L(R -> E) is the held-out loss of
recipe R's final weights evaluated with recipe E's forward (one GPU: FP8 GEMMs for fp8 and
fp4; the MXFP4 copies only act in backward, so at EP 1 fp4 and fp8 evaluate alike):

- total    = L(R -> R) / L(bf16 -> bf16) - 1   (what ``compare_runs.py --seeds`` reports)
- weights  = L(R -> bf16) / L(bf16 -> bf16) - 1   (R's weights under bf16's forward)
- numerics = L(R -> R) / L(R -> bf16) - 1   (R's forward on R's weights)
- numerics on bf16's weights = L(bf16 -> R) / L(bf16 -> bf16) - 1

``total`` is ``(1 + weights) (1 + numerics) - 1``. The two numerics terms compare two
forwards on the same weights: they carry none of the seed-to-seed scatter of training, so
few seeds resolve them. Every run is also evaluated under its own recipe: that loss must be
the run's own final held-out loss (``check``: the largest relative difference).

    python tools/cross_eval.py runs/*_seed* --cross runs/cross --out runs/cross_eval
"""

import argparse
import json
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

from moe_train.metrics import read_outputs  # noqa: E402
from moe_train.seeds import BASE, group, mean_and_stderr  # noqa: E402

TERMS = ("total", "weights", "numerics", "numerics_on_bf16_weights")


def read_cross(cross_dir, runs):
    """``{(recipe, seed, eval recipe): held-out loss}`` of the folders ``<run>_as_<recipe>``
    under ``cross_dir`` whose run is among ``runs`` (``{recipe: {seed: RunResult}}``)."""
    names = {f"{recipe}_seed{seed}": (recipe, seed)
             for recipe, by_seed in runs.items() for seed in by_seed}
    losses = {}
    for folder in sorted(Path(cross_dir).iterdir()):
        if not (folder / "summary.json").is_file() or "_as_" not in folder.name:
            continue
        run, as_recipe = folder.name.rsplit("_as_", 1)
        if run not in names:
            continue
        (result,) = read_outputs(folder)
        losses[(*names[run], as_recipe)] = result.evals[-1][1]
    return losses


def split_gaps(runs, losses):
    """``{recipe: {term: {"per_seed": {seed: value}, "mean", "stderr"}}}`` for every recipe
    but bf16, over the seeds whose needed evaluations are all there; plus ``check``."""
    own = {(r, s): res.evals[-1][1] for r, by in runs.items() for s, res in by.items()}
    check = max((abs(losses[(r, s, r)] / own[(r, s)] - 1) for (r, s) in own
                 if (r, s, r) in losses), default=None)
    out = {}
    for recipe, by_seed in runs.items():
        if recipe == BASE:
            continue
        per = {t: {} for t in TERMS}
        for seed in sorted(by_seed):
            base = own[(BASE, seed)]
            as_bf16 = losses.get((recipe, seed, BASE))
            bf16_as = losses.get((BASE, seed, recipe))
            per["total"][seed] = own[(recipe, seed)] / base - 1
            if as_bf16 is not None:
                per["weights"][seed] = as_bf16 / base - 1
                per["numerics"][seed] = own[(recipe, seed)] / as_bf16 - 1
            if bf16_as is not None:
                per["numerics_on_bf16_weights"][seed] = bf16_as / base - 1
        out[recipe] = {}
        for term, values in per.items():
            mean, err = mean_and_stderr(list(values.values())) if values else (None, None)
            out[recipe][term] = {"per_seed": values, "mean": mean, "stderr": err}
    return out, check


def _cell(stats):
    if stats["mean"] is None:
        return "-"
    err = f" +- {100 * stats['stderr']:.2f}%" if stats["stderr"] is not None else ""
    return f"{100 * stats['mean']:+.2f}%{err} ({len(stats['per_seed'])})"


def format_table(gaps, check):
    lines = ["| recipe | total | weights (under bf16) | numerics (own weights) | "
             "numerics (bf16's weights) |", "|---|---|---|---|---|"]
    for recipe, terms in gaps.items():
        lines.append(f"| {recipe} | " + " | ".join(_cell(terms[t]) for t in TERMS) + " |")
    lines += ["", "Held-out loss against the bf16 run of the same seed: mean +- standard "
              "error (seeds).", "check (a run under its own recipe against its own final "
              "held-out loss, largest relative difference): "
              + ("-" if check is None else f"{check:.2e}")]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="the runs' --out folders (<recipe>_seed<S>)")
    p.add_argument("--cross", required=True, help="the folder of <run>_as_<recipe> evaluations")
    p.add_argument("--out", required=True, help="folder for cross_eval.md / cross_eval.json")
    args = p.parse_args(argv)
    runs = group([r for d in args.runs for r in read_outputs(d)])
    gaps, check = split_gaps(runs, read_cross(args.cross, runs))
    table = format_table(gaps, check)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cross_eval.md").write_text(table + "\n")
    (out / "cross_eval.json").write_text(json.dumps({"gaps": gaps, "check": check}, indent=1))
    print(table)


if __name__ == "__main__":
    main()
