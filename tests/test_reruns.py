"""tools/reruns.py: where reruns of one seed part, and recipes against several baseline runs."""

import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import reruns  # noqa: E402
from moe_train.metrics import RunResult, write_outputs  # noqa: E402


def _run(tmp_path, name, recipe, seed, losses, lr=1e-3, first=1):
    rows = [{"step": first + i, "lm_loss": v, "lr": lr, "probe": False, "step_time_s": 0.1,
             "tokens": 1024} for i, v in enumerate(losses)]
    summary = {"recipe": recipe, "layer": "FP4MoE", "seed": seed, "steps": first + len(losses) - 1}
    write_outputs([RunResult(recipe=recipe, layer="FP4MoE", fp4_moe={}, steps=rows, evals=[],
                             summary=summary)], tmp_path / name, "table")
    return str(tmp_path / name)


def test_reruns_part_and_recipes_against_the_references_mean(tmp_path):
    base = [5.0, 4.0, 3.0, 2.0, 1.0, 1.0]
    dirs = [_run(tmp_path, "a1", "bf16", 1, base),
            _run(tmp_path, "a2", "bf16", 1, base[:4] + [1.1, 1.2]),        # parts at step 5
            _run(tmp_path, "tw", "bf16_lr1001", 1, [5.0, 4.0, 3.0, 2.0, 0.9, 0.9], lr=1.001e-3),
            _run(tmp_path, "b1", "bf16", 2, base),
            _run(tmp_path, "b2", "bf16", 2, base),                        # repeats exactly
            _run(tmp_path, "f1", "fp4", 1, [5.0, 4.0, 3.0, 2.0, 1.2, 1.2]),
            _run(tmp_path, "f2", "fp4", 2, [5.0, 4.0, 3.0, 2.0, 0.95, 1.05]),
            _run(tmp_path, "br", "fp4", 2, [1.0], first=6)]               # a branch: left out
    summary, diffs = reruns.main([*dirs, "--reference", "bf16", "bf16_lr1001", "--first", "5",
                                  "--last", "6", "--out", str(tmp_path / "out")])
    assert sorted(diffs) == [("bf16", 1, 5), ("bf16", 2, None)]   # the twin's LR differs
    ref1 = statistics.mean([1.0, 1.15, 0.9])
    assert summary["references"]["per_seed"][1] == pytest.approx(
        [1.0 / ref1 - 1, 1.15 / ref1 - 1, 0.9 / ref1 - 1])
    assert summary["references"]["spread"][2] == 0.0
    fp4 = summary["fp4"]
    assert fp4["per_seed"] == pytest.approx({1: 1.2 / ref1 - 1, 2: 0.0})
    assert fp4["mean"] == pytest.approx((1.2 / ref1 - 1) / 2) and fp4["n"] == 2
    text = (tmp_path / "out" / "reruns.md").read_text()
    assert "| bf16 | 1 | 1 | 5 |" in text and "| bf16 | 2 | 1 | none |" in text


def test_reruns_need_two_references_per_seed_and_the_window_steps(tmp_path):
    one = [_run(tmp_path, "a", "bf16", 1, [2.0, 1.0]), _run(tmp_path, "f", "fp4", 1, [2.0, 1.0])]
    with pytest.raises(ValueError, match=r"seed 1 has 1 reference run\(s\) over steps 1-2"):
        reruns.main([*one, "--first", "1", "--last", "2", "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit):
        reruns.main([*one, "--first", "3", "--last", "2", "--out", str(tmp_path / "o")])
