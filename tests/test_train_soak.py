"""Soak test of the main job: 300 steps on two gloo ranks, once straight through and once in
six runs of 50 steps that each load the previous run's checkpoint and save their own.

The loss curves must be the same to every digit (batches and random numbers depend only on
seed, step and rank; weights, optimizer and scheduler state travel in the checkpoint), and
the processes' memory must stay flat: over the 300 steps, and over the save/load cycles run
one after another in the same processes (a cache or an engine that is never freed grows it).
About a minute on 2 cores (tiny model, ``main`` run in-process on a pool of ranks).
"""

import gc
import json
from pathlib import Path

import pytest

from tests.dist_utils import DistPool, cpu_env
from tests.test_train_checks import _main

pytestmark = pytest.mark.slow  # multi-process DeepSpeed runs
cpu_env()

REPO = Path(__file__).resolve().parent.parent
STEPS, EVERY = 300, 50
# RSS growth allowed (MB). Measured (heap trimmed): < 1 MB over the 300 steps and ~0.25 MB
# per later cycle (15 cycles: +4.8 MB from the second; native memory, tracemalloc sees no
# Python objects pile up), while one engine of this model holds ~3.5 MB per rank (weights,
# gradients, Adam state).
RSS_SLACK_MB = 10


def _trim_heap():
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim``), so that RSS
    measures live memory: glibc keeps freed pages of a finished run for a while, and the
    RSS of the same process then wanders by tens of MB from one run to the next."""
    import ctypes
    import ctypes.util
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: RSS as it is
        pass


def _run_and_rss(argv):
    """``_main(argv)`` and this rank's resident memory (MB) after it."""
    import psutil
    out = _main(argv)
    gc.collect()
    _trim_heap()
    out["rss_mb"] = psutil.Process().memory_info().rss / 2**20
    return out


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """The FP4 example with a scheduler whose rate does not depend on --steps (the runs of 50
    steps must follow the 300-step run's schedule)."""
    cfg = json.loads((REPO / "ds_config_examples" / "fp4_moe.json").read_text())
    cfg["scheduler"] = {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 20}}
    path = tmp_path_factory.mktemp("soak") / "ds_config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_save_load_every_50_steps_repeats_the_run_and_memory_stays_flat(config, tmp_path):
    pool = DistPool(2)
    try:
        full = pool.run(_run_and_rss, ["--deepspeed_config", config, "--steps", str(STEPS)])
        resumed, rss = [], []
        for end in range(EVERY, STEPS + 1, EVERY):
            argv = ["--deepspeed_config", config, "--steps", str(end), "--save", str(tmp_path)]
            if end > EVERY:
                argv += ["--load", str(tmp_path)]
            got = pool.run(_run_and_rss, argv)
            assert "error" not in got[0], got[0]
            resumed += got[0]["losses"]
            rss.append([r["rss_mb"] for r in got])
    finally:
        pool.close()
    assert "error" not in full[0], full[0]
    assert len(resumed) == STEPS and resumed == full[0]["losses"]      # every digit
    summary = full[0]["summary"]
    assert summary["memory_kind"] == "RSS"
    assert summary["peak_mem_last100_mb"] - summary["peak_mem_first100_mb"] <= RSS_SLACK_MB, summary
    for rank in range(2):   # the first cycle warms the allocator up; later ones add nothing
        per_cycle = [r[rank] for r in rss]
        assert max(per_cycle[2:]) - per_cycle[1] <= RSS_SLACK_MB, per_cycle
