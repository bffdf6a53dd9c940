"""CI version of the main job: tools/train_moe.py on 2 CPU ranks through the deepspeed launcher.

A few steps of the README's command (FP4 recipe, the stdlib corpus) with a tiny model: it
must finish, its loss must fall, and the bytes it reports per all-to-all must be the sizes
of the recipe's wire formats. A second pair of runs checks that ``--load`` continues the
loss curve of the run that saved the checkpoint, step for step.
"""

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "ds_config_examples" / "fp4_moe.json"
TINY = ["--layers", "1", "--hidden", "128", "--heads", "4", "--experts", "4", "--ffn", "128",
        "--seq-len", "64", "--micro-batch", "8", "--eval-batches", "2", "--no-progress"]


pytestmark = pytest.mark.slow  # multi-process DeepSpeed runs (about a minute in all)


@pytest.fixture(scope="module")
def launch_env():
    """The environment for launches, with DeepSpeed's CPU comm op built once beforehand
    (two ranks JIT-building it at the same time can fail, DEEPSPEED.md)."""
    from tests.dist_utils import build_shm_comm
    build_shm_comm()
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(env, *args, ranks=2):
    """Run ``deepspeed --num_gpus ranks tools/train_moe.py args``; returns its stdout."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks),
           "--master_port", str(_free_port()), str(REPO / "tools" / "train_moe.py"),
           "--deepspeed_config", str(CONFIG), *TINY, *args]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _summary(out_dir):
    (run,) = json.loads((Path(out_dir) / "summary.json").read_text())
    return run


def _losses(out_dir, name="fp4"):
    lines = (Path(out_dir) / f"metrics_{name}.csv").read_text().splitlines()
    head = lines[0].split(",")
    rows = [dict(zip(head, line.split(","))) for line in lines[1:]]
    return {int(r["step"]): float(r["lm_loss"]) for r in rows}


def _unigram_entropy():
    """Entropy (nats) of the training split's byte frequencies."""
    sys.path.insert(0, str(REPO / "tools"))
    from moe_train.data import load_corpus
    counts = torch.bincount(load_corpus()[0].long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return -(p * p.log()).sum().item()


def _row_bytes(fmt, m):
    from ds_fp4 import formats
    return {"mxfp4": formats.mxfp4_row_bytes(m), "fp8": formats.fp8_row_bytes(m),
            "bf16": m * torch.bfloat16.itemsize}[fmt]


def test_main_job_finishes_and_learns(launch_env, tmp_path):
    stdout = train(launch_env, "--steps", "30", "--eval-interval", "15", "--out", str(tmp_path),
                   "--profile")
    run = _summary(tmp_path)
    profile = (tmp_path / "profile_fp4.txt").read_text()   # --profile: the fourth step's ops
    assert "Self CPU time total" in profile and "aten::mm" in profile
    losses = _losses(tmp_path)
    assert sorted(losses) == list(range(1, 31))
    first, last = losses[1], sum(losses[s] for s in range(26, 31)) / 5
    # An untrained model is near uniform over bytes (ln 256 = 5.55 nats). After 30 steps the
    # loss must be below the corpus' byte-frequency entropy (about 3.25 nats), which no
    # model that ignores the context can reach.
    assert first > 5.0 and last < _unigram_entropy(), (first, last)
    assert math.isfinite(run["heldout_loss"]) and run["heldout_loss"] < 5.0
    assert [s for s, _ in run["evals"]] == [15, 30]
    assert run["layer"] == "FP4MoE" and run["world_size"] == 2 and run["ep_size"] == 2
    assert "| fp4 | FP4MoE |" in stdout  # the table is printed
    # Bytes per all-to-all: every wire moves the same [E, C, M] rows in its own format.
    from ds_fp4.config import FP4MoEConfig
    cfg = FP4MoEConfig.from_ds_config(str(CONFIG))
    m = 128
    fmt = {"dispatch_fwd": cfg.dispatch, "combine_fwd": cfg.combine,
           "dispatch_bwd": cfg.grad, "combine_bwd": cfg.grad}
    rows = {k: run[f"a2a_{k}_bytes"] / _row_bytes(str(f), m) for k, f in fmt.items()}
    assert len(set(rows.values())) == 1 and next(iter(rows.values())) > 0, rows
    assert float(next(iter(rows.values()))).is_integer(), rows


def test_resume_continues_the_loss_curve(launch_env, tmp_path):
    ckpt = tmp_path / "ckpt"
    train(launch_env, "--steps", "8", "--eval-interval", "0", "--save", str(ckpt),
          "--save-interval", "4", "--out", str(tmp_path / "full"))
    assert (ckpt / "step4").is_dir() and (ckpt / "step8").is_dir()
    train(launch_env, "--steps", "8", "--eval-interval", "0", "--load", str(ckpt),
          "--load-tag", "step4", "--out", str(tmp_path / "resumed"))
    full, resumed = _losses(tmp_path / "full"), _losses(tmp_path / "resumed")
    assert sorted(resumed) == [5, 6, 7, 8]
    # Same batches, same random numbers, same weights and optimizer state: same losses.
    for step in resumed:
        assert resumed[step] == pytest.approx(full[step], rel=1e-6, abs=0), (step, full, resumed)
    assert _summary(tmp_path / "resumed")["heldout_loss"] == pytest.approx(
        _summary(tmp_path / "full")["heldout_loss"], rel=1e-6)


def test_bf16_start_runs_bf16_then_resumes_the_recipe(launch_env, tmp_path):
    """``fp4_moe.bf16_start_steps: 4``: steps 1-4 are the bf16 recipe's, steps 5-8 those of
    the fp4 recipe resumed from the bf16 run's step-4 checkpoint (the branches of
    bench/results/branches_h200_1gpu, in one run)."""
    cfg = json.loads(CONFIG.read_text())
    cfg["fp4_moe"]["bf16_start_steps"] = 4
    started = tmp_path / "fp4_bf16start.json"
    started.write_text(json.dumps(cfg))
    common = ["--steps", "8", "--eval-interval", "0", "--run-name", "run"]
    ckpt = tmp_path / "ckpt"
    train(launch_env, *common, "--recipe", "bf16", "--save", str(ckpt), "--save-interval", "4",
          "--out", str(tmp_path / "bf16"))
    train(launch_env, *common, "--recipe", "fp4", "--load", str(ckpt), "--load-tag", "step4",
          "--out", str(tmp_path / "branch"))
    train(launch_env, *common, "--recipe", str(started), "--out", str(tmp_path / "started"))
    bf16, branch, got = (_losses(tmp_path / d, "run") for d in ("bf16", "branch", "started"))
    assert sorted(got) == list(range(1, 9)) and sorted(branch) == [5, 6, 7, 8]
    assert {s: got[s] for s in range(1, 5)} == {s: bf16[s] for s in range(1, 5)}
    assert {s: got[s] for s in branch} == branch
    assert any(branch[s] != bf16[s] for s in branch)      # the recipe acts from step 5 on


def _routes_and_received(run, fmt, m):
    """``(routes sent, rows received)`` per step from one run's all-to-all bytes, checking
    that each is a whole number of rows of its wire's format."""
    sent = {"dispatch_fwd": fmt["dispatch_fwd"], "combine_bwd": fmt["combine_bwd"]}
    received = {"combine_fwd": fmt["combine_fwd"], "dispatch_bwd": fmt["dispatch_bwd"]}
    rows = {k: run[f"a2a_{k}_bytes"] / _row_bytes(f, m) for k, f in {**sent, **received}.items()}
    assert all(float(v).is_integer() and v > 0 for v in rows.values()), rows
    assert rows["dispatch_fwd"] == rows["combine_bwd"], rows     # the routes, there and back
    assert rows["combine_fwd"] == rows["dispatch_bwd"], rows     # what this rank's experts got
    return rows["dispatch_fwd"], rows["combine_fwd"]


def test_autoep_main_job_bf16_and_fp4(launch_env, tmp_path):
    """``--moe autoep``: a Qwen3-MoE through DeepSpeed's AutoEP (dropless), bf16 and the FP4
    recipe in one --compare run; every route crosses the dispatch in its recipe's format."""
    stdout = train(launch_env, "--moe", "autoep", "--compare", "bf16,fp4", "--steps", "8",
                   "--eval-interval", "0", "--out", str(tmp_path))
    runs = {r["recipe"]: r for r in json.loads((tmp_path / "summary.json").read_text())}
    assert runs["bf16"]["layer"] == "FP4AutoEPMoELayer (off)"
    assert runs["fp4"]["layer"] == "FP4AutoEPMoELayer"
    assert "| fp4 | FP4AutoEPMoELayer |" in stdout and "| bf16 |" in stdout
    assert (tmp_path / "compare.png").is_file()
    m, routes = 128, 1 * 8 * 64 * 2                # layers x micro batch x seq x top-2
    formats = {"bf16": dict.fromkeys(("dispatch_fwd", "combine_fwd", "dispatch_bwd",
                                      "combine_bwd"), "bf16"),
               "fp4": {"dispatch_fwd": "mxfp4", "combine_fwd": "bf16", "dispatch_bwd": "fp8",
                       "combine_bwd": "fp8"}}
    for name, run in runs.items():
        losses = _losses(tmp_path, name)
        assert sorted(losses) == list(range(1, 9)) and all(map(math.isfinite, losses.values()))
        assert losses[1] > 5.0 and sum(losses[s] for s in (6, 7, 8)) / 3 < losses[1] - 0.5, losses
        assert math.isfinite(run["heldout_loss"]) and run["heldout_loss"] < 5.0
        sent, _ = _routes_and_received(run, formats[name], m)
        assert sent == routes, (name, run)
        # 4 experts of 3 [128, 128] matrices, 2 on each rank: counted whole
        assert run["expert_params"] == 4 * 3 * 128 * 128 and run["params"] > run["expert_params"]
    # MXFP4 dispatch: K/2 + K/32 bytes a row where bf16 moves 2K
    assert runs["fp4"]["a2a_dispatch_fwd_bytes"] * 64 == runs["bf16"]["a2a_dispatch_fwd_bytes"] * 17
