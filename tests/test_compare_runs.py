"""tools/compare_runs.py: runs written separately come back whole and compare as --compare does."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import compare_runs  # noqa: E402
from moe_train.metrics import A2A_KINDS, RunResult, read_outputs, write_outputs  # noqa: E402


def _run(recipe, loss_scale, steps=6):
    rows = [{"step": s, "lm_loss": 5.0 * loss_scale / s, "probe": s == 1, "step_time_s": 0.1,
             "tokens": 1024} for s in range(1, steps + 1)]
    summary = {"recipe": recipe, "layer": "FP4MoE", "world_size": 2, "ep_size": 2,
               "params": 1000, "expert_params": 800, "steps": steps, "steps_run": steps,
               "train_loss": 1.0 * loss_scale, "heldout_loss": 2.0 * loss_scale,
               "step_time_ms": 100.0, "tokens_per_s_per_gpu": 10240.0, "memory_kind": "allocated",
               "peak_mem_mb": 10.0, "peak_mem_first100_mb": 10.0, "peak_mem_last100_mb": 10.0,
               "kept_for_backward_mb": 1.5, **{f"a2a_{k}_bytes": 4096 for k in A2A_KINDS}}
    return RunResult(recipe=recipe, layer="FP4MoE", fp4_moe={"dispatch": recipe}, steps=rows,
                     evals=[(3, 2.5 * loss_scale), (steps, 2.0 * loss_scale)], summary=summary)


def _write(tmp_path, run):
    out = tmp_path / run.recipe
    write_outputs([run], out, "table")
    return out


def test_outputs_read_back_as_written(tmp_path):
    run = _run("fp4", 1.0)
    (back,) = read_outputs(_write(tmp_path, run))
    assert back.steps == run.steps          # ints, floats and bools come back as such
    assert back.evals == run.evals and back.summary == run.summary
    assert (back.recipe, back.layer, back.fp4_moe) == (run.recipe, run.layer, run.fp4_moe)


def test_merged_runs_deviate_from_bf16(tmp_path):
    dirs = [str(_write(tmp_path, _run("fp4", 1.01))), str(_write(tmp_path, _run("bf16", 1.0)))]
    results = compare_runs.main([*dirs, "--out", str(tmp_path / "cmp")])
    fp4 = next(r for r in results if r.recipe == "fp4")
    assert fp4.summary["heldout_loss_rel_dev_vs_bf16"] == pytest.approx(0.01)
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 0
    assert "+1.00% / +1.00%" in (tmp_path / "cmp" / "summary.md").read_text()


def test_runs_of_other_shapes_are_refused(tmp_path):
    other = _run("fp4", 1.0, steps=8)
    dirs = [str(_write(tmp_path, _run("bf16", 1.0))), str(_write(tmp_path, other))]
    with pytest.raises(ValueError, match="steps"):
        compare_runs.merge(dirs)
