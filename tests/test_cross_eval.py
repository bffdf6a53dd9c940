"""tools/cross_eval.py: a recipe's held-out gap split into its weights' and its forward's."""

import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import cross_eval  # noqa: E402
from moe_train.seeds import group  # noqa: E402
from moe_train.metrics import RunResult, read_outputs, write_outputs  # noqa: E402


def _result(name, seed, heldout):
    summary = {"recipe": name, "layer": "FP4MoE", "seed": seed, "steps": 4,
               "heldout_loss": heldout}
    rows = [{"step": s, "lm_loss": 3.0} for s in range(1, 5)]
    return RunResult(recipe=name, layer="FP4MoE", fp4_moe={}, steps=rows,
                     evals=[(4, heldout)], summary=summary)


def _write(folder, result):
    write_outputs([result], folder, "table")
    return str(folder)


# per seed: bf16's own loss; fp4's weights under bf16 (x1.01, x1.02); fp4's forward
# (x1.004 on fp4's weights, x1.003 on bf16's)
BASE = {1: 2.0, 2: 2.2}
WEIGHTS = {1: 1.01, 2: 1.02}


def _layout(tmp_path, own_check=1.0):
    runs, cross = [], tmp_path / "cross"
    for seed, base in BASE.items():
        fp4_w = base * WEIGHTS[seed]
        runs.append(_write(tmp_path / f"bf16_seed{seed}", _result("bf16", seed, base)))
        runs.append(_write(tmp_path / f"fp4_seed{seed}", _result("fp4", seed, fp4_w * 1.004)))
        for run, as_recipe, loss in ((f"fp4_seed{seed}", "bf16", fp4_w),
                                     (f"fp4_seed{seed}", "fp4", fp4_w * 1.004 * own_check),
                                     (f"bf16_seed{seed}", "fp4", base * 1.003),
                                     (f"bf16_seed{seed}", "bf16", base)):
            name = f"{run}_as_{as_recipe}"
            _write(cross / name, _result(name, seed, loss))
    return runs, cross


def test_gap_splits_into_weights_and_numerics(tmp_path):
    runs, cross = _layout(tmp_path)
    cross_eval.main([*runs, "--cross", str(cross), "--out", str(tmp_path / "out")])
    data = json.loads((tmp_path / "out" / "cross_eval.json").read_text())
    fp4 = data["gaps"]["fp4"]
    assert fp4["weights"]["mean"] == pytest.approx(0.015)
    assert fp4["weights"]["per_seed"] == {"1": pytest.approx(0.01), "2": pytest.approx(0.02)}
    assert fp4["numerics"]["mean"] == pytest.approx(0.004)
    assert fp4["numerics"]["stderr"] == pytest.approx(0.0, abs=1e-12)
    assert fp4["numerics_on_bf16_weights"]["mean"] == pytest.approx(0.003)
    totals = [w * 1.004 - 1 for w in WEIGHTS.values()]
    assert fp4["total"]["mean"] == pytest.approx(sum(totals) / len(totals))
    assert data["check"] == pytest.approx(0.0, abs=1e-12)
    assert "+1.50% +- 0.50% (2)" in (tmp_path / "out" / "cross_eval.md").read_text()


def test_check_reports_an_own_recipe_evaluation_that_differs(tmp_path):
    runs, cross = _layout(tmp_path, own_check=1.001)
    gaps, check = cross_eval.split_gaps(*_grouped(runs, cross))
    assert check == pytest.approx(0.001)


def test_a_missing_evaluation_leaves_its_seed_out(tmp_path):
    runs, cross = _layout(tmp_path)
    shutil.rmtree(cross / "fp4_seed2_as_bf16")
    gaps, _ = cross_eval.split_gaps(*_grouped(runs, cross))
    assert list(gaps["fp4"]["weights"]["per_seed"]) == [1]
    assert gaps["fp4"]["weights"]["stderr"] is None
    assert len(gaps["fp4"]["total"]["per_seed"]) == 2


def _grouped(runs, cross):
    grouped = group([r for d in runs for r in read_outputs(d)])
    return grouped, cross_eval.read_cross(cross, grouped)
