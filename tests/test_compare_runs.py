"""tools/compare_runs.py: runs written separately come back whole and compare as --compare does."""

import gzip
import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import compare_runs  # noqa: E402
import loss_windows  # noqa: E402
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


def test_gzipped_curves_read_back_as_written(tmp_path):
    run = _run("fp4", 1.0)
    out = _write(tmp_path, run)
    csv_path = out / "metrics_fp4.csv"
    with csv_path.open("rb") as f, gzip.open(str(csv_path) + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    csv_path.unlink()
    (back,) = read_outputs(out)
    assert back.steps == run.steps
    losses = loss_windows.read_losses([out])
    assert losses == {"fp4": {r["step"]: r["lm_loss"] for r in run.steps}}


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


# ---- --seeds: deviations per seed, mean, standard error, bands ---------------------------

def _seeded(recipe, seed, loss_scale, steps=40):
    run = _run(recipe, loss_scale, steps)
    run.summary["seed"] = seed
    return run


def _write_seeded(tmp_path, run):
    out = tmp_path / f"{run.recipe}_seed{run.summary['seed']}"
    write_outputs([run], out, "table")
    return str(out)


def test_seeds_merge_per_seed_deviations_mean_and_error(tmp_path):
    scale = {1: 1.01, 2: 1.02, 3: 1.03}      # fp4's loss / bf16's, per seed
    dirs = [_write_seeded(tmp_path, _seeded("bf16", s, 1.0 + s)) for s in scale]
    dirs += [_write_seeded(tmp_path, _seeded("fp4", s, (1.0 + s) * k)) for s, k in scale.items()]
    devs = compare_runs.main([*dirs, "--seeds", "--out", str(tmp_path / "seeds")])
    d = devs["fp4"]
    assert d["seeds"] == [1, 2, 3]
    for key in ("train", "heldout"):
        assert d[key]["per_seed"] == pytest.approx([0.01, 0.02, 0.03])
        assert d[key]["mean"] == pytest.approx(0.02)
        assert d[key]["stderr"] == pytest.approx(0.01 / 3 ** 0.5)   # s.d. 0.01 over sqrt(3)
        assert d[key]["seeds_for_target_se"] == 16                    # (0.01 / 0.0025)^2
    table = (tmp_path / "seeds" / "seeds.md").read_text()
    assert "| fp4 | 1, 2, 3 | +2.00% +- 0.58% | +1.00%, +2.00%, +3.00% |" in table
    assert table.splitlines()[2].endswith("| 16 / 16 |")
    assert (tmp_path / "seeds" / "seeds.png").stat().st_size > 0


def test_seeds_twin_is_the_baselines_scatter_and_a_second_baseline(tmp_path):
    twin = {1: 1.02, 2: 0.98}                 # the twin's loss / bf16's, per seed
    fp4 = {1: 1.03, 2: 1.01}
    dirs = [_write_seeded(tmp_path, _seeded("bf16", s, 1.0 + s)) for s in twin]
    dirs += [_write_seeded(tmp_path, _seeded("bf16_lr1001", s, (1.0 + s) * k))
             for s, k in twin.items()]
    dirs += [_write_seeded(tmp_path, _seeded("fp4", s, (1.0 + s) * k)) for s, k in fp4.items()]
    out = str(tmp_path / "seeds")
    devs = compare_runs.main([*dirs, "--seeds", "--twin", "bf16_lr1001", "--out", out])
    assert devs["bf16_lr1001"]["train"]["per_seed"] == pytest.approx([0.02, -0.02])
    assert "vs_pair" not in devs["bf16_lr1001"]
    pair = [fp4[s] / ((1 + twin[s]) / 2) - 1 for s in (1, 2)]     # 1.03/1.01 - 1, 1.01/0.99 - 1
    for key in ("train", "heldout"):
        assert devs["fp4"][key]["per_seed"] == pytest.approx([0.03, 0.01])
        assert devs["fp4"]["vs_pair"][key]["per_seed"] == pytest.approx(pair)
    table = (tmp_path / "seeds" / "seeds.md").read_text()
    assert "| (the baseline's own scatter) |" in table
    assert f"{100 * sum(pair) / 2:+.2f}% +- " in table.splitlines()[3]
    with pytest.raises(ValueError, match="--twin bf16_x: no such recipe"):
        compare_runs.main([*dirs, "--seeds", "--twin", "bf16_x", "--out", out])
    with pytest.raises(SystemExit):
        compare_runs.main([*dirs, "--twin", "bf16_lr1001", "--out", out])


def test_seeds_recipes_paired_by_seed(tmp_path):
    # fp4 and fp8 against each other on the seeds both ran (bf16's own loss cancels); the
    # twin is the baseline's scatter, not a recipe to pair
    fp4, fp8, twin = {1: 1.03, 2: 1.01, 3: 1.02}, {1: 1.01, 2: 1.02}, {1: 1.0, 2: 1.0, 3: 1.0}
    dirs = [_write_seeded(tmp_path, _seeded("bf16", s, 1.0 + s)) for s in fp4]
    for name, scale in (("fp4", fp4), ("fp8", fp8), ("bf16_lr1001", twin)):
        dirs += [_write_seeded(tmp_path, _seeded(name, s, (1.0 + s) * k))
                 for s, k in scale.items()]
    out = tmp_path / "seeds"
    compare_runs.main([*dirs, "--seeds", "--twin", "bf16_lr1001", "--out", str(out)])
    pairs = json.loads((out / "seeds_paired.json").read_text())
    assert list(pairs) == ["fp4 - fp8"]
    row = pairs["fp4 - fp8"]
    assert row["seeds"] == [1, 2]
    for key in ("train", "heldout"):
        assert row[key]["per_seed"] == pytest.approx([0.02, -0.01])
        assert row[key]["mean"] == pytest.approx(0.005)
        assert row[key]["stderr"] == pytest.approx(0.015)        # s.d. 0.0212 over sqrt 2
    assert "| fp4 - fp8 | 1, 2 | +0.50% +- 1.50% | +0.50% +- 1.50% |" in \
        (out / "seeds.md").read_text()


def test_seeds_pool_is_the_per_seed_mean_of_recipes(tmp_path):
    # fp4 and fp8 draws that do not move together: their per-seed mean spreads less
    fp4, fp8 = {1: 1.03, 2: 1.00, 3: 1.02}, {1: 1.00, 2: 1.03, 3: 1.01}
    dirs = [_write_seeded(tmp_path, _seeded("bf16", s, 1.0 + s)) for s in fp4]
    for name, scale in (("fp4", fp4), ("fp8", fp8)):
        dirs += [_write_seeded(tmp_path, _seeded(name, s, (1.0 + s) * k))
                 for s, k in scale.items()]
    out = tmp_path / "seeds"
    compare_runs.main([*dirs, "--seeds", "--pool", "fp4,fp8", "--out", str(out)])
    row = json.loads((out / "seeds_pooled.json").read_text())["mean of fp4, fp8"]
    assert row["seeds"] == [1, 2, 3]
    for key in ("train", "heldout"):
        assert row[key]["per_seed"] == pytest.approx([0.015, 0.015, 0.015])
        assert row[key]["mean"] == pytest.approx(0.015)
        assert row[key]["stderr"] == pytest.approx(0.0, abs=1e-12)
    assert "| mean of fp4, fp8 | 1, 2, 3 | +1.50% +- 0.00% | +1.50% +- 0.00% |" in \
        (out / "seeds.md").read_text()
    with pytest.raises(ValueError, match="--pool needs two or more recipes"):
        compare_runs.main([*dirs, "--seeds", "--pool", "fp4,fp9", "--out", str(out)])
    with pytest.raises(SystemExit):
        compare_runs.main([*dirs, "--pool", "fp4,fp8", "--out", str(out)])


def test_seeds_train_loss_is_the_mean_of_the_last_five_percent():
    from moe_train import seeds
    run = _seeded("fp4", 1, 1.0, steps=40)            # lm_loss = 5 / step
    assert seeds.tail_loss(run) == pytest.approx((5 / 39 + 5 / 40) / 2)   # 2 of 40 steps


def test_seeds_needed_for_the_target_error_never_below_the_seeds_run():
    from moe_train import seeds
    assert seeds.seeds_for(None, 1) is None
    assert seeds.seeds_for(0.005, 5) == 20          # 5 x (0.005 / 0.0025)^2
    assert seeds.seeds_for(0.001, 5) == 5           # already below the target


def test_seeds_refuse_missing_bf16_seed_and_repeats(tmp_path):
    base = _write_seeded(tmp_path, _seeded("bf16", 1, 1.0))
    other = _write_seeded(tmp_path, _seeded("fp4", 2, 1.0))
    with pytest.raises(ValueError, match=r"recipe fp4 has seeds \[2\] without a bf16 run"):
        compare_runs.main([base, other, "--seeds", "--out", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="two runs have the same recipe name.*--seeds"):
        compare_runs.merge([base, base])
    with pytest.raises(ValueError, match="two runs of recipe bf16 with seed 1"):
        compare_runs.main([base, base, "--seeds", "--out", str(tmp_path / "x")])
    # without --seeds, runs of different seeds do not compare
    fp4_seed2 = _write_seeded(tmp_path, _seeded("fp4", 2, 1.01))
    with pytest.raises(ValueError, match="seed"):
        compare_runs.merge([base, fp4_seed2])
