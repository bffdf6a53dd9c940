"""The main job keeps what a user saved and catches mistakes before the first step (issue 15).

``tools/train_moe.py``'s ``main`` runs in-process on a pool of two gloo ranks (a launch
through the deepspeed launcher costs ~15 s; a run here 1-3 s), on a tiny model. Two launches
check what only the command line shows: the exit status and the message printed once.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_utils import TINY_TRAIN_ARGS, DistPool, build_shm_comm, cpu_env

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "tools"
TINY = TINY_TRAIN_ARGS

pytestmark = pytest.mark.slow  # multi-process DeepSpeed runs
cpu_env()


def _train_moe():
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    import train_moe
    return train_moe


def _main(argv):
    """``train_moe.main(TINY + argv)`` on a pool rank, as a picklable dict."""
    try:
        results = _train_moe().main(TINY + argv)
    except Exception as err:  # noqa: BLE001 - the test reads what was raised
        return {"error": type(err).__name__, "message": str(err),
                "exit_code": getattr(err, "exit_code", None)}
    r = results[0]
    return {"summary": r.summary, "losses": [s["lm_loss"] for s in r.steps],
            "lrs": [s["lr"] for s in r.steps], "evals": r.evals}


def _eval_twice(argv):
    """Evaluate one engine twice from different random states; also return whether the
    training RNG came out of ``evaluate`` as it went in."""
    tm = _train_moe()
    from moe_train.data import load_corpus
    from moe_train.launch import local_device
    from moe_train.recipes import finish_config
    args = tm.build_parser().parse_args(TINY + argv)
    cfg = finish_config(tm.setup(args), args)
    engine, _ = tm.build_engine(args, cfg, args.ep_size)
    _, heldout, _ = load_corpus(None)
    losses = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        losses.append(tm.evaluate(engine, heldout, args, local_device()))
    after = torch.rand(3)
    torch.manual_seed(2)
    untouched = torch.equal(after, torch.rand(3))
    engine.destroy()
    return losses, untouched


@pytest.fixture(scope="module")
def pool():
    p = DistPool(2)
    yield p
    p.close()


def run(pool, *argv):
    """Both ranks' results of ``_main``; an error must be the same on both."""
    got = pool.run(_main, list(map(str, argv)))
    assert ("error" in got[0]) == ("error" in got[1]), got
    return got


def error_of(pool, *argv):
    got = run(pool, *argv)
    assert "error" in got[0], f"the run was not refused: {got[0].get('losses')}"
    assert got[0]["error"] in ("RunError", "Diverged"), got[0]
    return got[0]


@pytest.fixture(scope="module")
def saved(pool, tmp_path_factory):
    """A finished 8-step run that saved step4 and step8, and its results."""
    root = tmp_path_factory.mktemp("saved")
    got = run(pool, "--steps", 8, "--save", root / "ck", "--save-interval", 4,
              "--out", root / "out")
    assert "error" not in got[0], got[0]
    return root / "ck", got[0]


def _snapshot(folder):
    """Every file under ``folder`` with its size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


# ---- item 1: a checkpoint is never replaced ------------------------------------------

def test_resuming_at_or_past_steps_is_refused_and_writes_nothing(pool, saved, tmp_path):
    ck, _ = saved
    before = _snapshot(ck)
    for steps in (4, 8):
        err = error_of(pool, "--load", ck, "--save", ck, "--steps", steps,
                       "--out", tmp_path / "out")
        assert f"at step 8, at or past --steps {steps}" in err["message"], err
        assert "--steps above 8" in err["message"] and "--eval-only" in err["message"], err
    assert _snapshot(ck) == before                       # nothing written, latest unmoved
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, says", [
    (["--steps", 8], "step8 already exists there"),                   # a fresh run, same tags
    (["--steps", 8, "--save-interval", 4], "step4, step8 already exist there"),
    (["--steps", 6], "its 'latest' is step8, later than this run's last step 6"),
])
def test_a_save_that_would_replace_a_checkpoint_is_refused(pool, saved, argv, says):
    ck, _ = saved
    before = _snapshot(ck)
    err = error_of(pool, "--save", ck, *argv)
    assert says in err["message"] and f"--load {ck}" in err["message"], err
    assert _snapshot(ck) == before


# ---- item 2: paths checked at startup; metrics kept when a step fails ----------------

def test_paths_are_checked_before_the_first_step(pool, saved, tmp_path):
    ck, _ = saved
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    (tmp_path / "bad_latest").mkdir()
    (tmp_path / "bad_latest" / "latest").write_text("step99")
    cases = [
        (["--save", a_file], f"--save {a_file}: this is a file, not a folder"),
        (["--out", a_file], f"--out {a_file}: this is a file, not a folder"),
        (["--save", a_file / "ck"], f"{a_file} is a file, so no folder can be made there"),
        (["--load", tmp_path / "nowhere"], "no such folder"),
        (["--load", ck, "--load-tag", "step5"], "step5 does not exist; the tags there: step4, step8"),
        (["--load", tmp_path / "bad_latest"], "its 'latest' file names 'step99'"),
        (["--load", tmp_path], "no 'latest' file there"),
        (["--profile"], "--profile writes <out>/profile_<recipe>.txt; add --out FOLDER"),
        (["--profile", "--out", tmp_path / "p", "--steps", 3], "--steps 3 has none"),
    ]
    for argv, says in cases:
        err = error_of(pool, "--steps", 8, *argv)
        assert says in err["message"], (argv, err)
        assert err["exit_code"] == 2


def test_a_run_name_labels_the_run_and_its_files(pool, tmp_path):
    got = run(pool, "--steps", 2, "--recipe", "bf16", "--run-name", "bf16_lr1001",
              "--out", tmp_path)
    assert got[0]["summary"]["recipe"] == "bf16_lr1001", got[0]
    assert (tmp_path / "metrics_bf16_lr1001.csv").is_file()
    for argv, says in ((["--compare", "bf16,fp4"], "--compare runs several"),
                       (["--run-name", "a/b"], "names the run's files")):
        err = error_of(pool, "--steps", 2, "--run-name", "twin", *argv)
        assert says in err["message"], (argv, err)


# ---- branches of a run: its schedule, and an --lr given with --load ----------------------

def test_a_branch_keeps_the_schedule_of_the_run_it_branches_from(pool, saved):
    _, full = saved                                       # 8 steps
    got = run(pool, "--steps", 6, "--schedule-steps", 8)[0]
    assert got["lrs"] == full["lrs"][:6] and got["losses"] == full["losses"][:6]
    assert got["summary"]["schedule_steps"] == 8 and got["summary"]["steps"] == 6
    err = error_of(pool, "--steps", 8, "--schedule-steps", 4)
    assert "--schedule-steps 4 ends the LR schedule before --steps 8" in err["message"]


def test_an_lr_given_with_load_replaces_the_checkpoints(pool, saved):
    ck, full = saved
    peak = full["summary"]["lr"]
    same = run(pool, "--load", ck, "--load-tag", "step4", "--steps", 8)[0]
    assert same["lrs"] == full["lrs"][4:] and same["losses"] == full["losses"][4:]
    twice = run(pool, "--load", ck, "--load-tag", "step4", "--steps", 8, "--lr", 2 * peak)[0]
    assert twice["lrs"] == pytest.approx([2 * lr for lr in full["lrs"][4:]], rel=1e-12)
    assert twice["losses"][0] == full["losses"][4]        # the step's loss, before its update
    assert twice["losses"][1] != full["losses"][5]
    assert twice["summary"]["lr"] == 2 * peak


def test_a_resumed_run_records_the_peak_lr_it_runs_at(pool, tmp_path):
    """Without --lr, --load goes on at the checkpoint's peak LR, and the summary says so."""
    got = run(pool, "--steps", 4, "--lr", "0.0123", "--save", tmp_path / "ck",
              "--save-interval", 2)[0]
    assert got["summary"]["lr"] == 0.0123
    on = run(pool, "--load", tmp_path / "ck", "--load-tag", "step2", "--steps", 4)[0]
    assert on["lrs"] == got["lrs"][2:] and on["summary"]["lr"] == 0.0123


def test_a_checkpoint_resumes_under_another_recipe(pool, saved):
    """A prefix run (tools/device/gpu_branches.sh, PREFIXES): the saved fp4 run goes on in
    bf16 from its step 4, on its schedule, and its first step's loss is the saved run's."""
    ck, full = saved
    assert full["summary"]["recipe"] == "fp4"
    got = run(pool, "--load", ck, "--load-tag", "step4", "--steps", 8, "--recipe", "bf16",
              "--run-name", "after_fp4")[0]
    assert got["summary"]["recipe"] == "after_fp4" and got["lrs"] == full["lrs"][4:]
    assert got["losses"][0] == pytest.approx(full["losses"][4], rel=1e-2)
    assert got["losses"][1:] != full["losses"][5:]      # bf16 from there, not fp4


def _checked_config(tmp_path):
    """The example ds_config with DeepSpeed's bf16 overflow check on (its own default)."""
    cfg = json.loads((REPO / "ds_config_examples" / "fp4_moe.json").read_text())
    cfg["bf16"]["check_grad_overflow"] = True
    path = tmp_path / "checked.json"
    path.write_text(json.dumps(cfg))
    return path


def test_a_diverged_run_stops_and_keeps_its_metrics(pool, tmp_path):
    """With the overflow check on DeepSpeed skips the steps whose gradients are not
    finite; the loss guard stops the run after 3 non-finite losses."""
    err = error_of(pool, "--steps", 20, "--lr", "1e6", "--warmup", 1, "--out", tmp_path,
                   "--deepspeed_config", _checked_config(tmp_path), "--recipe", "fp4")
    assert err["error"] == "Diverged" and err["exit_code"] == 1, err
    assert "not finite for 3 steps in a row" in err["message"], err
    assert "Lower --lr (now 1e+06)" in err["message"], err
    rows = (tmp_path / "metrics_fp4.csv").read_text().splitlines()[1:]
    last = int(rows[-1].split(",")[0])
    assert 3 <= last < 20 and len(rows) == last, rows          # every step up to the stop


def test_unchecked_nonfinite_gradients_stop_before_a_save(pool, tmp_path):
    """The example ds_configs turn DeepSpeed's bf16 overflow check off: a step with
    non-finite gradients is applied, so the run stops at that step, before the checkpoint
    due after it, and the message names the setting and the way back."""
    err = error_of(pool, "--steps", 20, "--lr", "1e6", "--warmup", 1, "--out", tmp_path,
                   "--save", tmp_path / "ck", "--save-interval", 1)
    assert err["error"] == "Diverged" and err["exit_code"] == 1, err
    assert "gradients were not finite at step" in err["message"], err
    assert '"check_grad_overflow": false' in err["message"] and "--load" in err["message"], err
    step = int(err["message"].split("at step ")[1].split()[0])
    saved = sorted(int(d.name[4:]) for d in (tmp_path / "ck").glob("step*"))
    assert saved == list(range(1, step)), (step, saved)    # every step before it, not it


def test_the_gradient_guard_only_acts_where_deepspeed_applies_bad_steps():
    tools = str(TOOLS)
    if tools not in sys.path:
        sys.path.insert(0, tools)
    from moe_train.checks import Diverged, DivergenceGuard
    unchecked = DivergenceGuard(3, 1e-3, skips_bad_steps=False)
    for norm in (float("nan"), float("inf")):
        with pytest.raises(Diverged, match="not finite at step 7"):
            unchecked.check_grad_norm(norm, 7)
    unchecked.check_grad_norm(1.5, 7)
    unchecked.check_grad_norm(None, 7)                      # no norm computed: nothing to read
    DivergenceGuard(3, 1e-3).check_grad_norm(float("inf"), 7)  # DeepSpeed skipped the step
    DivergenceGuard(0, 1e-3, skips_bad_steps=False).check_grad_norm(float("nan"), 7)  # never stop


def test_max_nonfinite_steps_zero_never_stops(pool, tmp_path):
    got = run(pool, "--steps", 6, "--lr", "1e6", "--warmup", 1,
              "--max-nonfinite-steps", 0)
    assert "error" not in got[0], got[0]
    assert not all(map(lambda v: v == v, got[0]["losses"]))   # NaNs, and no stop


# ---- item 4: load failures name the file and the tag ---------------------------------

def test_a_truncated_expert_shard_is_named_on_every_rank(pool, saved, tmp_path):
    ck, _ = saved
    copy = tmp_path / "ck"
    shutil.copytree(ck, copy)
    shard = copy / "step8" / "layer_0_expert_3_mp_rank_00_model_states.pt"  # rank 1's expert
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    got = run(pool, "--load", copy, "--steps", 12)
    for rank in got:
        assert "error" in rank, rank
        assert f"{shard} is not a complete checkpoint file" in rank["message"], rank
        assert "its 'latest' file names 'step8'" in rank["message"], rank


def test_a_load_deepspeed_refuses_names_the_tag(pool, saved):
    ck, _ = saved
    err = error_of(pool, "--load", ck, "--load-tag", "step4", "--steps", 12, "--ffn", 256)
    assert f"--load {ck}: loading tag step4 failed" in err["message"], err
    assert "--ffn" in err["message"], err


# ---- items 6 and 7 --------------------------------------------------------------------

@pytest.mark.parametrize("steps", ["0", "-3", "x"])
def test_steps_below_one_are_rejected(steps, capsys):
    with pytest.raises(SystemExit) as stop:
        _train_moe().build_parser().parse_args(["--steps", steps])
    assert stop.value.code == 2
    assert "--steps: must be a whole number >= 1" in capsys.readouterr().err


def test_evaluation_is_a_function_of_the_weights(pool):
    (first, second), untouched = pool.run(_eval_twice, [])[0]
    assert first == second                                    # no gate noise, fixed seed
    assert untouched                                          # the training RNG is unchanged


def test_a_loaded_checkpoint_evaluates_to_its_runs_held_out_loss(pool, saved):
    ck, finished = saved
    got = run(pool, "--load", ck, "--eval-only")
    assert "error" not in got[0], got[0]
    assert got[0]["losses"] == []                                          # trained nothing
    assert got[0]["evals"] == [(8, finished["summary"]["heldout_loss"])]    # bit for bit


# ---- item 10: binary data ---------------------------------------------------------------

def test_binary_data_files_and_folders(tmp_path):
    _train_moe()
    from moe_train.checks import RunError
    from moe_train.data import load_corpus
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "a.bin").write_bytes(b"\x7fELF\0\0\1" * 100)
    (binary / "b.bin").write_bytes(bytes(range(256)) * 10)
    with pytest.raises(RunError, match="a binary file"):
        load_corpus(str(binary / "a.bin"))
    with pytest.raises(RunError, match=r"holds only binary files \(2, e.g. a.bin"):
        load_corpus(str(binary))
    (binary / "c.txt").write_text("text " * 400)
    train, held, desc = load_corpus(str(binary))            # the binaries are left out
    assert "(1 files" in desc and len(train) + len(held) == 2001
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunError, match="holds no files"):
        load_corpus(str(tmp_path / "empty"))


# ---- the command line: exit status and one message ---------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*argv):
    """``deepspeed --num_gpus 2 tools/train_moe.py TINY argv``; returns the process."""
    build_shm_comm()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
           "--master_port", str(_free_port()), str(TOOLS / "train_moe.py"), *TINY,
           *map(str, argv)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_the_command_line_refuses_with_status_2_and_one_message(saved):
    ck, _ = saved
    before = _snapshot(ck)
    proc = launch("--load", ck, "--save", ck, "--steps", 4)   # the command
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert output.count("train_moe.py: error: ") == 1, output[-3000:]
    assert "at or past --steps 4" in output
    assert _snapshot(ck) == before
