"""Checks a run with ``fp4_moe.bf16_start_steps = N`` against a bf16 run of the same seed
(``tools/device/gpu_bf16_start.sh``): its first N steps must train as bf16 does (the same
loss at each step) and the steps after must not (the recipe is on), at the recipe's speed.

Prints, for steps 1..N and N+1..end, the largest relative loss difference and the median
step time of each run, and a verdict; exit status 1 when the check fails::

    python tools/bf16_start_check.py runs/bf16/metrics_bf16.csv \
        runs/fp4_start/metrics_fp4_start.csv --switch 100
"""

import argparse
import csv
import statistics
import sys

import bench_common  # noqa: F401  (puts the checkout on sys.path)
from moe_train.curve_files import open_metrics

# Steps 1..N run the same layer on the same bytes; GPU reductions with atomics (index_add in
# the backward) may still differ in the last bits, which a few steps amplify only slightly.
SAME_LOSS_REL = 1e-3


def _rows(path):
    with open_metrics(path) as f:
        return {int(r["step"]): r for r in csv.DictReader(f)}


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def compare(bf16, start, switch):
    """``(report lines, ok)`` for the curves ``{step: row}`` of the two runs."""
    common = sorted(set(bf16) & set(start))
    before = [s for s in common if s <= switch]
    after = [s for s in common if s > switch]
    if not before or not after:
        return [f"need steps on both sides of {switch}; have {common[:1]}..{common[-1:]}"], False
    lines, ok = [], True
    for label, steps in (("1..N (bf16 start)", before), ("N+1.. (recipe)", after)):
        diffs = [_rel(float(start[s]["lm_loss"]), float(bf16[s]["lm_loss"])) for s in steps]
        t_b = statistics.median(float(bf16[s]["step_time_s"]) for s in steps[1:] or steps)
        t_s = statistics.median(float(start[s]["step_time_s"]) for s in steps[1:] or steps)
        lines.append(f"steps {label}: {len(steps)} steps, largest relative loss difference "
                     f"{max(diffs):.2e}, median step {t_b * 1e3:.1f} ms (bf16) vs "
                     f"{t_s * 1e3:.1f} ms (bf16 start)")
        if steps is before:
            ok &= max(diffs) <= SAME_LOSS_REL
        else:
            ok &= max(diffs) > 0   # the recipe changes the numbers from the first step on
    lines.append("verdict: " + ("ok" if ok else "FAILED") + f" (1..N within {SAME_LOSS_REL:g} "
                 "of bf16; after N, different)")
    return lines, ok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bf16", help="metrics CSV of the bf16 run")
    p.add_argument("start", help="metrics CSV of the run with bf16_start_steps")
    p.add_argument("--switch", type=int, required=True, help="its bf16_start_steps")
    args = p.parse_args(argv)
    lines, ok = compare(_rows(args.bf16), _rows(args.start), args.switch)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
