"""tools/bf16_start_check.py: a bf16-start run against bf16, before and after the switch."""

import csv
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import bf16_start_check  # noqa: E402


def _curve(tmp_path, name, loss_of_step, steps=20):
    path = tmp_path / f"metrics_{name}.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", "lm_loss", "step_time_s"])
        w.writeheader()
        for s in range(1, steps + 1):
            w.writerow({"step": s, "lm_loss": loss_of_step(s), "step_time_s": 0.1})
    return str(path)


def test_a_run_that_switches_at_n_passes(tmp_path, capsys):
    bf16 = _curve(tmp_path, "bf16", lambda s: 5.0 / s)
    start = _curve(tmp_path, "start", lambda s: 5.0 / s if s <= 10 else 5.0 / s + 0.01)
    assert bf16_start_check.main([bf16, start, "--switch", "10"]) == 0
    assert "verdict: ok" in capsys.readouterr().out


def test_a_run_that_differs_before_n_fails(tmp_path):
    bf16 = _curve(tmp_path, "bf16", lambda s: 5.0 / s)
    start = _curve(tmp_path, "start", lambda s: 5.0 / s + (0.01 if s == 3 else 0.0) + (s > 10))
    assert bf16_start_check.main([bf16, start, "--switch", "10"]) == 1


def test_a_run_that_never_switches_fails(tmp_path):
    bf16 = _curve(tmp_path, "bf16", lambda s: 5.0 / s)
    same = _curve(tmp_path, "same", lambda s: 5.0 / s)
    assert bf16_start_check.main([bf16, same, "--switch", "10"]) == 1


def test_a_rerun_that_drifts_makes_a_drift_inconclusive(tmp_path):
    """GPU runs: when bf16's own rerun drifts before N, so may the bf16 start."""
    def drift(s):
        return 5.0 / s + (1e-4 * s if s >= 5 else 0.0)
    bf16 = _curve(tmp_path, "bf16", lambda s: 5.0 / s)
    rerun = _curve(tmp_path, "rerun", drift)
    start = _curve(tmp_path, "start", lambda s: drift(s) + (0.01 if s > 10 else 0.0))
    exact = _curve(tmp_path, "exact", lambda s: 5.0 / s + (0.01 if s > 10 else 0.0))
    assert bf16_start_check.main([bf16, start, "--switch", "10", "--rerun", rerun]) == 2
    assert bf16_start_check.main([bf16, exact, "--switch", "10", "--rerun", rerun]) == 0
    steady = _curve(tmp_path, "steady", lambda s: 5.0 / s)   # a rerun that does not drift
    assert bf16_start_check.main([bf16, start, "--switch", "10", "--rerun", steady]) == 1
