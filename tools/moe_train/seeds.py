"""Runs of several seeds merged (issue 16): each recipe's loss deviation from the bf16 run
of the same seed, its mean over seeds, standard error and every seed's value, and a PNG with
one band per recipe (min to max over seeds) of the deviation over the steps.

Per seed s and recipe r (bf16 run b of the same seed, same steps):

- train: the mean ``lm_loss`` over the last 5% of steps (at least one), ``r / b - 1``;
- held-out: the final held-out loss, ``r / b - 1``.

The standard error is the seeds' sample standard deviation over sqrt(n) (None for one seed).
"""

import math
from collections import defaultdict

TAIL = 0.05        # share of the last steps whose train loss is averaged
BASE = "bf16"
TARGET_SE = 0.0025  # issue 16 asks for a standard error below 0.25%


def _seed(result):
    seed = result.summary.get("seed")
    if seed is None:
        raise ValueError(f"run {result.recipe} has no seed in its summary.json (written before "
                         f"train_moe.py recorded it): rerun it, or compare single runs without "
                         f"--seeds")
    return seed


def group(results):
    """``{recipe: {seed: RunResult}}``; every recipe needs the bf16 run of each of its seeds."""
    runs = defaultdict(dict)
    for r in results:
        seed = _seed(r)
        if seed in runs[r.recipe]:
            raise ValueError(f"two runs of recipe {r.recipe} with seed {seed}: give each "
                             f"seed's run once")
        runs[r.recipe][seed] = r
    if BASE not in runs:
        raise ValueError(f"no {BASE} run among {sorted(runs)}: deviations are measured "
                         f"against the bf16 run of the same seed")
    for recipe, by_seed in runs.items():
        missing = sorted(set(by_seed) - set(runs[BASE]))
        if missing:
            raise ValueError(f"recipe {recipe} has seeds {missing} without a {BASE} run")
    return dict(runs)


def tail_loss(result, share=TAIL):
    """The mean train loss over the last ``share`` of the run's steps."""
    losses = [s["lm_loss"] for s in result.steps]
    if not losses:
        raise ValueError(f"run {result.recipe} (seed {_seed(result)}) recorded no steps")
    n = max(1, round(len(losses) * share))
    return sum(losses[-n:]) / n


def mean_and_stderr(values):
    """``(mean, standard error)``; the error is None for fewer than two values."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def seeds_for(stderr, n, target=TARGET_SE):
    """How many seeds would bring the standard error to ``target``, if the seeds' spread stays
    what ``n`` seeds with ``stderr`` showed (None without a spread)."""
    if stderr is None:
        return None
    return max(n, math.ceil(n * (stderr / target) ** 2 - 1e-9))   # 16.000001 is 16


def deviations(runs):
    """Per recipe but bf16: ``{"seeds": [...], "train": {...}, "heldout": {...}}`` where each
    of train/heldout holds ``per_seed`` (relative deviations), ``mean`` and ``stderr``."""
    out = {}
    for recipe, by_seed in runs.items():
        if recipe == BASE:
            continue
        seeds = sorted(by_seed)
        row = {"seeds": seeds}
        for key, value in (("train", tail_loss),
                           ("heldout", lambda r: r.evals[-1][1] if r.evals else None)):
            per = []
            for s in seeds:
                got, want = value(by_seed[s]), value(runs[BASE][s])
                per.append(None if got is None or not want else got / want - 1)
            known = [v for v in per if v is not None]
            mean, err = mean_and_stderr(known) if known else (None, None)
            row[key] = {"per_seed": per, "mean": mean, "stderr": err,
                        "seeds_for_target_se": seeds_for(err, len(known))}
        out[recipe] = row
    return out


def _pct(v):
    return "-" if v is None else f"{100 * v:+.2f}%"


def format_seed_table(devs):
    """Markdown: one row per recipe, mean +- standard error and every seed's value."""
    lines = ["| recipe | seeds | train: mean +- s.e. | train per seed | held-out: mean +- s.e. "
             "| held-out per seed | seeds for s.e. " f"{TARGET_SE:.2%} (train / held-out) |",
             "|---|---|---|---|---|---|---|"]
    for recipe, row in devs.items():
        cells = [recipe, ", ".join(map(str, row["seeds"]))]
        for key in ("train", "heldout"):
            d = row[key]
            err = "" if d["stderr"] is None else f" +- {100 * d['stderr']:.2f}%"
            cells += [_pct(d["mean"]) + err, ", ".join(_pct(v) for v in d["per_seed"])]
        cells.append(" / ".join(str(row[k]["seeds_for_target_se"] or "-")
                                for k in ("train", "heldout")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + (
        f"\n\nRelative deviation from the {BASE} run of the same seed: train loss averaged "
        f"over the last {TAIL:.0%} of steps, final held-out loss; s.e. = sample standard "
        f"deviation over seeds / sqrt(n); the seeds that would bring it to {TARGET_SE:.2%} at "
        f"the same spread: n (s.e. / {TARGET_SE:.2%})^2.")


def _deviation_curve(result, base, window):
    """``(steps, % deviation)`` of the train loss (moving mean over ``window`` steps)."""
    def smooth(r):
        loss = [s["lm_loss"] for s in r.steps]
        out, acc = {}, 0.0
        for i, v in enumerate(loss):
            acc += v - (loss[i - window] if i >= window else 0.0)
            if i >= window - 1:
                out[r.steps[i]["step"]] = acc / window
        return out
    got, want = smooth(result), smooth(base)
    steps = sorted(set(got) & set(want))
    return steps, [100 * (got[s] / want[s] - 1) for s in steps]


def plot_seed_bands(runs, path):
    """PNG: per recipe, the band (min to max over seeds) and mean of the train loss deviation
    from bf16 (moving mean over 5% of the steps) against the step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 5))
    for recipe, by_seed in runs.items():
        if recipe == BASE:
            continue
        curves = []
        for seed, r in by_seed.items():
            window = max(1, round(len(r.steps) * TAIL))
            curves.append(dict(zip(*_deviation_curve(r, runs[BASE][seed], window))))
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        lo = [min(c[s] for c in curves) for s in steps]
        hi = [max(c[s] for c in curves) for s in steps]
        mean = [sum(c[s] for c in curves) / len(curves) for s in steps]
        line, = ax.plot(steps, mean, label=f"{recipe} (mean of {len(curves)} seeds)")
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.25)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set(title=f"train loss relative to {BASE} of the same seed, % (moving mean over "
                 f"{TAIL:.0%} of the steps; band: min-max over seeds)", xlabel="step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
