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


def _heldout(result):
    return result.evals[-1][1] if result.evals else None


def _deviation_stats(per):
    """``per_seed`` (None where unknown), mean, standard error and the seeds the target needs."""
    known = [v for v in per if v is not None]
    mean, err = mean_and_stderr(known) if known else (None, None)
    return {"per_seed": per, "mean": mean, "stderr": err,
            "seeds_for_target_se": seeds_for(err, len(known))}


def deviations(runs, twin=None):
    """Per recipe but bf16: ``{"seeds": [...], "train": {...}, "heldout": {...}}`` where each
    of train/heldout holds ``per_seed`` (relative deviations), ``mean`` and ``stderr``.

    ``twin``: the name of a second baseline run per seed that differs from bf16 by a change
    too small to matter (e.g. ``--lr`` 0.1% higher). Its own row is then the baseline's
    scatter, and every other recipe also gets ``vs_pair``: the same statistics against the
    mean of the two baseline runs of each seed (half the baseline's variance).
    """
    if twin is not None and twin not in runs:
        raise ValueError(f"--twin {twin}: no such recipe among {sorted(runs)}")
    out = {}
    for recipe, by_seed in runs.items():
        if recipe == BASE:
            continue
        seeds = sorted(by_seed)
        row = {"seeds": seeds}
        pair = twin is not None and recipe != twin
        for key, value in (("train", tail_loss), ("heldout", _heldout)):
            row[key] = _deviation_stats([_ratio(value, by_seed[s], [runs[BASE][s]])
                                         for s in seeds])
            if pair:
                row.setdefault("vs_pair", {})[key] = _deviation_stats(
                    [_ratio(value, by_seed[s], [runs[BASE][s], runs[twin].get(s)])
                     for s in seeds])
        out[recipe] = row
    return out


def _by_seed(row, key):
    """``{seed: deviation}`` of one recipe's ``deviations`` row for ``key``."""
    return dict(zip(row["seeds"], row[key]["per_seed"]))


def paired(devs, twin=None):
    """Recipe against recipe, paired by seed, for every two recipes of ``devs`` but the twin
    (in ``devs``' order): ``{"a - b": {"seeds": [...], "train": {...}, "heldout": {...}}}``
    with, per seed both ran, the difference of their deviations from that seed's bf16 run
    (whose own scatter cancels), its mean and standard error."""
    names = [r for r in devs if r != twin]
    out = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            seeds = [s for s in devs[a]["seeds"] if s in devs[b]["seeds"]]
            if not seeds:
                continue
            row = {"seeds": seeds}
            for key in ("train", "heldout"):
                da, db = (_by_seed(devs[r], key) for r in (a, b))
                row[key] = _deviation_stats([None if da[s] is None or db[s] is None
                                             else da[s] - db[s] for s in seeds])
            out[f"{a} - {b}"] = row
    return out


def pooled(devs, names):
    """The per-seed mean of the deviations of the recipes ``names`` (over the seeds all of
    them ran): ``{"seeds": [...], "train": {...}, "heldout": {...}}`` as ``deviations``.

    Recipes that share most of their numerics (fp8 and fp4) may each sit a few standard
    errors from bf16; their per-seed mean has less spread than either where their draws do
    not move together, so it can resolve a gap common to them that neither resolves alone.
    """
    missing = [n for n in names if n not in devs]
    if missing or len(names) < 2:
        raise ValueError(f"--pool needs two or more recipes among {sorted(devs)}; got {names}")
    seeds = [s for s in devs[names[0]]["seeds"] if all(s in devs[n]["seeds"] for n in names)]
    row = {"seeds": seeds}
    for key in ("train", "heldout"):
        per = [_by_seed(devs[n], key) for n in names]
        row[key] = _deviation_stats([None if any(d[s] is None for d in per)
                                     else sum(d[s] for d in per) / len(per) for s in seeds])
    return row


def _ratio(value, run, baselines):
    """``value(run)`` over the mean of ``value`` of the baseline runs, less 1 (None if any
    is missing)."""
    want = [value(b) for b in baselines if b is not None]
    got = value(run)
    if got is None or len(want) < len(baselines) or not all(want):
        return None
    return got / (sum(want) / len(want)) - 1


def _pct(v):
    return "-" if v is None else f"{100 * v:+.2f}%"


def format_seed_table(devs, twin=None):
    """Markdown: one row per recipe, mean +- standard error and every seed's value (with
    ``twin``, a last column against the mean of bf16 and the twin)."""
    head = ["recipe", "seeds", "train: mean +- s.e.", "train per seed", "held-out: mean +- s.e.",
            "held-out per seed", f"seeds for s.e. {TARGET_SE:.2%} (train / held-out)"]
    if twin:
        head.append(f"vs the mean of {BASE} and {twin}: train / held-out")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for recipe, row in devs.items():
        cells = [recipe, ", ".join(map(str, row["seeds"]))]
        for key in ("train", "heldout"):
            d = row[key]
            cells += [_pct_err(d), ", ".join(_pct(v) for v in d["per_seed"])]
        cells.append(" / ".join(str(row[k]["seeds_for_target_se"] or "-")
                                for k in ("train", "heldout")))
        if twin:
            cells.append("(the baseline's own scatter)" if recipe == twin else
                         " / ".join(_pct_err(row["vs_pair"][k]) for k in ("train", "heldout")))
        lines.append("| " + " | ".join(cells) + " |")
    note = (f" The twin ({twin}) is a second {BASE} run per seed with a change too small to "
            f"matter: its deviation is the scatter any recipe's carries from the {BASE} run "
            f"alone; the last column measures against both runs' mean.") if twin else ""
    return "\n".join(lines) + (
        f"\n\nRelative deviation from the {BASE} run of the same seed: train loss averaged "
        f"over the last {TAIL:.0%} of steps, final held-out loss; s.e. = sample standard "
        f"deviation over seeds / sqrt(n); the seeds that would bring it to {TARGET_SE:.2%} at "
        f"the same spread: n (s.e. / {TARGET_SE:.2%})^2." + note)


def _rows_table(first, rows, note):
    """Markdown: one row per entry of ``rows`` (``{name: {"seeds", "train", "heldout"}}``)."""
    head = [first, "seeds", "train: mean +- s.e.", "held-out: mean +- s.e."]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in rows.items():
        lines.append(f"| {name} | {', '.join(map(str, row['seeds']))} | "
                     f"{_pct_err(row['train'])} | {_pct_err(row['heldout'])} |")
    return "\n".join(lines) + "\n\n" + note


def format_paired_table(pairs):
    """Markdown: one row per pair of recipes (``paired``)."""
    return _rows_table("recipes, paired by seed", pairs,
                       "The difference of two recipes' deviations from the bf16 run of each "
                       "seed both ran; s.e. as above.")


def format_pooled_table(pools):
    """Markdown: one row per pool of recipes (``pooled``)."""
    return _rows_table("recipes, mean per seed", pools,
                       "The mean, per seed, of the recipes' deviations from the bf16 run of "
                       "that seed; s.e. as above.")


def _pct_err(d):
    err = "" if d["stderr"] is None else f" +- {100 * d['stderr']:.2f}%"
    return _pct(d["mean"]) + err


def deviation_curve(result, base, window):
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


def plot_bands(bands, title, path):
    """PNG of ``bands`` (``[(label, curves)]``, each curve ``{step: %}``): per band the mean of
    its curves as a line and their min-max as a shaded band, over the steps all have."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 5))
    for label, curves in bands:
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        mean = [sum(c[s] for c in curves) / len(curves) for s in steps]
        line, = ax.plot(steps, mean, label=label)
        ax.fill_between(steps, [min(c[s] for c in curves) for s in steps],
                        [max(c[s] for c in curves) for s in steps],
                        color=line.get_color(), alpha=0.25)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set(title=title, xlabel="step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_seed_bands(runs, path):
    """PNG: per recipe, the band (min to max over seeds) and mean of the train loss deviation
    from bf16 (moving mean over 5% of the steps) against the step."""
    bands = []
    for recipe, by_seed in runs.items():
        if recipe == BASE:
            continue
        curves = []
        for seed, r in by_seed.items():
            window = max(1, round(len(r.steps) * TAIL))
            curves.append(dict(zip(*deviation_curve(r, runs[BASE][seed], window))))
        bands.append((f"{recipe} (mean of {len(curves)} seeds)", curves))
    plot_bands(bands, f"train loss relative to {BASE} of the same seed, % (moving mean over "
                      f"{TAIL:.0%} of the steps; band: min-max over seeds)", path)
