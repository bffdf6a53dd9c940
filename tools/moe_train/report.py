"""The end of a run: deviations from the bf16 run, the summary table and the ``--compare`` PNG."""

from bench_common import fmt, markdown_table  # noqa: F401 - memory.py takes them from here

from .metrics import A2A_KINDS, PHASES


def add_deviations(summaries):
    """Relative loss deviation of each run from the bf16 run (or the first), in place.

    Returns:
        The recipe name of the run the deviations are relative to.
    """
    base = next((s for s in summaries if s["recipe"] == "bf16"), summaries[0])
    for s in summaries:
        for key in ("train_loss", "heldout_loss"):
            ok = s[key] is not None and base[key]
            s[f"{key}_rel_dev_vs_{base['recipe']}"] = (s[key] - base[key]) / base[key] if ok else None
    return base["recipe"]


def _kib(v):
    return "-" if v is None else f"{v / 1024:,.1f}"


def _phases(s):
    """Peak MB of the profiled step's phases, "fwd / bwd / step" ("-" where not measured:
    on CPU, or in a summary written before they were)."""
    return " / ".join(fmt(s.get(f"peak_mem_{p}_mb"), ",.0f") for p in PHASES)


def format_table(summaries, base):
    """The end-of-run table (markdown), one row per recipe, and a note on the units."""
    compare = len(summaries) > 1
    head = ["recipe", "layer", "train loss", "held-out loss"]
    head += [f"vs {base} (train / held-out)"] if compare else []
    head += ["tokens/s/GPU", "step ms", "peak mem MB (first100/last100)",
             "peak MB fwd/bwd/step", "kept fwd MB", "dispatch KiB fwd/bwd", "combine KiB fwd/bwd"]
    rows = []
    for s in summaries:
        dt, dh = s[f"train_loss_rel_dev_vs_{base}"], s[f"heldout_loss_rel_dev_vs_{base}"]
        dev = [f"{fmt(dt and dt * 100, '+.2f')}% / {fmt(dh and dh * 100, '+.2f')}%"] if compare else []
        rows.append([
            s["recipe"], s["layer"], fmt(s["train_loss"], ".4f"), fmt(s["heldout_loss"], ".4f"),
            *dev, fmt(s["tokens_per_s_per_gpu"], ",.0f"), fmt(s["step_time_ms"], ".1f"),
            f"{s['peak_mem_mb']:,.0f} ({s['peak_mem_first100_mb']:,.0f}/{s['peak_mem_last100_mb']:,.0f})",
            _phases(s), fmt(s["kept_for_backward_mb"], ",.1f"),
            f"{_kib(s['a2a_dispatch_fwd_bytes'])} / {_kib(s['a2a_dispatch_bwd_bytes'])}",
            f"{_kib(s['a2a_combine_fwd_bytes'])} / {_kib(s['a2a_combine_bwd_bytes'])}",
        ])
    notes = (f"Per rank and optimizer step; bytes are what each rank hands to all_to_all_single, "
             f"summed over layers. Memory: {summaries[0]['memory_kind']}"
             + (" (process-wide on CPU; no per-phase peaks)." if summaries[0]["memory_kind"] == "RSS"
                else "; per phase: the allocated peak within the forward, the backward and "
                     "the optimizer step of the profiled step."))
    return markdown_table(head, rows) + "\n\n" + notes


def _smooth(values, alpha=0.05):
    out, acc = [], None
    for v in values:
        acc = v if acc is None else (1 - alpha) * acc + alpha * v
        out.append(acc)
    return out


def _plot_losses(ax, results, base):
    """Top row: train loss, its deviation from ``base`` (both EMA-smoothed), held-out loss."""
    ref = next(r for r in results if r.recipe == base)
    ref_curve = dict(zip([s["step"] for s in ref.steps], _smooth([s["lm_loss"] for s in ref.steps])))
    for r in results:
        steps = [s["step"] for s in r.steps]
        curve = _smooth([s["lm_loss"] for s in r.steps])
        ax[0].plot(steps, curve, label=r.recipe)
        dev = [(st, 100 * (v / ref_curve[st] - 1)) for st, v in zip(steps, curve) if st in ref_curve]
        if dev:
            ax[1].plot(*zip(*dev), label=r.recipe)
        ax[2].plot(*zip(*r.evals), marker="o", label=r.recipe)
    ax[0].set(title="train loss (EMA 0.05)", xlabel="step", ylabel="nats/byte")
    ax[1].set(title=f"train loss (EMA) relative to {base}, %", xlabel="step")
    ax[1].axhline(0, color="gray", lw=0.5)
    ax[2].set(title="held-out loss", xlabel="step", ylabel="nats/byte")


def _plot_bars(ax, results):
    """Bottom row: peak memory, memory kept for backward and all-to-all bytes per recipe."""
    names, x = [r.recipe for r in results], list(range(len(results)))
    kind = results[0].summary["memory_kind"]
    for i, (key, label) in enumerate([("peak_mem_first100_mb", "first 100 steps"),
                                      ("peak_mem_last100_mb", "last 100 steps")]):
        ax[0].bar([j + 0.4 * i for j in x], [r.summary[key] for r in results], 0.4, label=label)
    ax[0].set(title=f"peak memory per rank, MB ({kind})", xticks=[j + 0.2 for j in x])
    ax[1].bar(x, [r.summary["kept_for_backward_mb"] or 0 for r in results], 0.5)
    ax[1].set(title="forward memory kept for backward, MB per rank", xticks=x)
    for i, a2a in enumerate(A2A_KINDS):
        vals = [(r.summary[f"a2a_{a2a}_bytes"] or 0) / 2**20 for r in results]
        ax[2].bar([j + 0.2 * i for j in x], vals, 0.2, label=a2a)
    ax[2].set(title="all-to-all MiB per rank per step", xticks=[j + 0.3 for j in x])
    for a in ax:
        a.set_xticklabels(names)


def plot_compare(results, path, base):
    """PNG at ``path``: loss curves, deviation from ``base``, memory and all-to-all bytes per recipe."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(2, 3, figsize=(17, 9))
    _plot_losses(ax[0], results, base)
    _plot_bars(ax[1], results)
    devs = [(r.recipe, r.summary[f"heldout_loss_rel_dev_vs_{base}"]) for r in results if r.recipe != base]
    devs = ", ".join(f"{name} {fmt(d if d is None else d * 100, '+.2f')}%" for name, d in devs)
    fig.suptitle(f"final held-out loss relative to {base}: {devs}" if devs else "")
    for a in (ax[0, 0], ax[0, 1], ax[0, 2], ax[1, 0], ax[1, 2]):
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
