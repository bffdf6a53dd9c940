"""tools/branches.py: a branch's loss against its trunk's at the same steps, over branches."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import branches  # noqa: E402
from moe_train.metrics import RunResult, write_outputs  # noqa: E402


def _run(recipe, seed, first, last, scale, schedule=40, evals=()):
    rows = [{"step": s, "lm_loss": scale * 5.0 / s, "probe": False, "step_time_s": 0.1,
             "tokens": 1024} for s in range(first, last + 1)]
    summary = {"recipe": recipe, "layer": "FP4MoE", "seed": seed, "steps": last,
               "steps_run": last - first + 1, "schedule_steps": schedule}
    return RunResult(recipe=recipe, layer="FP4MoE", fp4_moe={}, steps=rows,
                     evals=list(evals), summary=summary)


def _write(tmp_path, run, name):
    write_outputs([run], tmp_path / name, "table")
    return str(tmp_path / name)


def test_branches_against_their_trunks(tmp_path):
    trunks = [_write(tmp_path, _run("bf16", s, 1, 40, 1.0 + s, evals=[(20, 3.0), (30, 2.0)]),
                     f"trunk{s}") for s in (1, 2)]
    dev = {(1, 10): 0.01, (1, 20): 0.03, (2, 10): 0.02, (2, 20): 0.04}
    dirs = [_write(tmp_path, _run("fp4", s, k + 1, k + 10, (1.0 + s) * (1 + d),
                                  evals=[(k + 10, 2.0 * (1 + d))]), f"fp4_{s}_{k}")
            for (s, k), d in dev.items()]
    out = branches.main(["--trunks", *trunks, "--branches", *dirs, "--last", "5",
                         "--out", str(tmp_path / "b")])
    e = out["fp4"]
    assert e["n"] == 4
    assert e["train"]["mean"] == pytest.approx(0.025)
    assert e["train_by_start"] == pytest.approx({10: 0.015, 20: 0.035})
    # held-out only where the trunk evaluated at the branch's end (step 20: 3.0; 30: 2.0)
    assert e["heldout"]["n"] == 4
    assert sorted(r[3] for r in e["samples"]) == pytest.approx(
        sorted([2.02 / 3 - 1, 2.04 / 3 - 1, 2.06 / 2 - 1, 2.08 / 2 - 1]))
    table = (tmp_path / "b" / "branches.md").read_text()
    assert "| fp4 | +2.50% +- " in table and "from step 20" in table


def test_branches_refuse_a_missing_trunk_and_another_schedule(tmp_path):
    trunk = _write(tmp_path, _run("bf16", 1, 1, 40, 1.0), "trunk")
    lost = _write(tmp_path, _run("fp4", 2, 11, 20, 1.0), "lost")
    with pytest.raises(ValueError, match=r"seed 2\) has no trunk among the seeds \[1\]"):
        branches.main(["--trunks", trunk, "--branches", lost, "--out", str(tmp_path / "x")])
    short = _write(tmp_path, _run("fp4", 1, 11, 20, 1.0, schedule=20), "short")
    with pytest.raises(ValueError, match="pass the trunk's --steps as the branch's --schedule-steps"):
        branches.main(["--trunks", trunk, "--branches", short, "--out", str(tmp_path / "x")])


def test_branches_by_window_from_the_branch_point(tmp_path):
    trunks = [_write(tmp_path, _run("bf16", s, 1, 40, 1.0), f"trunk{s}") for s in (1, 2)]
    dirs = []
    for s, dev in ((1, (0.01, 0.03)), (2, (0.03, 0.05))):
        run = _run("fp4", s, 11, 20, 1.0)
        for row in run.steps:                     # steps 11-15 off by dev[0], 16-20 by dev[1]
            row["lm_loss"] *= 1 + dev[row["step"] > 15]
        dirs.append(_write(tmp_path, run, f"fp4_{s}"))
    branches.main(["--trunks", *trunks, "--branches", *dirs, "--window", "5",
                   "--out", str(tmp_path / "b")])
    got = json.loads((tmp_path / "b" / "windows.json").read_text())["fp4 from 10"]
    assert [(a, b, n) for a, b, _, _, n in got] == [(11, 15, 2), (16, 20, 2)]
    assert [m for _, _, m, _, _ in got] == pytest.approx([0.02, 0.04])
    assert [e for _, _, _, e, _ in got] == pytest.approx([0.01, 0.01])
    assert "| fp4 | +2.00% +- 1.00 | +4.00% +- 1.00 |" in (tmp_path / "b" / "windows.md").read_text()


def test_branches_against_both_bf16_draws(tmp_path):
    trunks = [_write(tmp_path, _run("bf16", s, 1, 40, 1.0, evals=[(20, 2.0)]), f"trunk{s}")
              for s in (1, 2)]
    devs = {("bf16_twin", 1): -0.02, ("bf16_twin", 2): 0.04, ("fp4", 1): 0.01, ("fp4", 2): 0.05}
    dirs = [_write(tmp_path, _run(r, s, 11, 20, 1 + d, evals=[(20, 2.0 * (1 + d))]), f"{r}_{s}")
            for (r, s), d in devs.items()]
    args = ["--trunks", *trunks, "--branches", *dirs, "--out", str(tmp_path / "b")]
    got = branches.main(args + ["--twin", "bf16_twin", "--plot"])["against_bf16_pair"]
    want = [1.01 / 0.99 - 1, 1.05 / 1.02 - 1]     # against (trunk + twin) / 2, per seed
    assert list(got) == ["fp4"]
    for key in ("train", "heldout"):
        assert got["fp4"][key]["n"] == 2
        assert got["fp4"][key]["mean"] == pytest.approx(sum(want) / 2)
    assert "Against both bf16 draws" in (tmp_path / "b" / "branches.md").read_text()
    assert (tmp_path / "b" / "branches.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="--twin bf16_lr1001: no branch of that recipe"):
        branches.main(args + ["--twin", "bf16_lr1001"])
