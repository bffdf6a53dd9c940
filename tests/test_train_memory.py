"""Memory across and within the main job's runs (issue 14, items 3 and 4), on CPU.

- A second engine built in the same process after the first is deleted inherits nothing
  from it: the first's parameters, optimizer and engine are freed (weak references dead),
  the tensors the process holds fall back to what they were before it, and ds_fp4's
  process-wide caches are empty (``--compare`` runs recipes one after another like this).
- ds_fp4's caches: ``release_caches`` drops the tables it lists; a captured graph owns the
  tables it reads and gives its pool's bytes back to the ``auto`` budget when freed.
- ``--find-max-batch``: the search (doubling then bisecting) against a fake step that runs
  out of memory above a threshold; the per-phase peaks with a fake GPU accelerator.
"""

import gc
import json
import sys
import weakref
from pathlib import Path

import pytest
import torch

from tests.dist_utils import TINY_TRAIN_ARGS, DistPool, cpu_env

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "tools"
TINY = TINY_TRAIN_ARGS
cpu_env()
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))


def _train_moe():
    import train_moe
    return train_moe


# ---- the search behind --find-max-batch ------------------------------------------------

class _FakeOOM:
    """A step that runs out of memory above ``threshold`` (as torch does on a GPU)."""

    def __init__(self, threshold, error=torch.OutOfMemoryError):
        self.threshold, self.error, self.tried, self.cleanups = threshold, error, [], 0

    def run(self, batch):
        self.tried.append(batch)
        if batch > self.threshold:
            raise self.error(f"CUDA out of memory. Tried to allocate {batch} GiB")

    def cleanup(self):
        self.cleanups += 1


@pytest.mark.parametrize("threshold", [0, 1, 2, 3, 5, 37, 64, 100, 4095, 4096, 10**6])
def test_largest_fitting_finds_the_threshold(threshold):
    from moe_train import memory
    fake = _FakeOOM(threshold)
    batch, trials = memory.largest_fitting(memory.fits_without_oom(fake.run, fake.cleanup), 4096)
    assert batch == min(threshold, 4096)
    assert [b for b, _ in trials] == fake.tried and fake.cleanups == len(trials)
    assert all(ok == (b <= threshold) for b, ok in trials)
    assert len(set(fake.tried)) == len(fake.tried)          # never the same batch twice
    assert len(trials) <= 2 * max(1, batch).bit_length() + 2, trials


def test_oom_kinds_and_other_errors():
    from moe_train import memory
    # a library's allocation failure reads as an OOM too; anything else is raised as is
    fake = _FakeOOM(6, error=lambda m: RuntimeError("CUBLAS_STATUS_ALLOC_FAILED " + m))
    assert memory.largest_fitting(memory.fits_without_oom(fake.run, fake.cleanup), 64)[0] == 6
    broken = _FakeOOM(6, error=ValueError)
    with pytest.raises(ValueError):
        memory.largest_fitting(memory.fits_without_oom(broken.run, broken.cleanup), 64)
    assert broken.cleanups == len(broken.tried)               # freed even then
    assert not memory.is_oom(RuntimeError("shape mismatch"))
    with pytest.raises(ValueError, match="limit"):
        memory.largest_fitting(lambda b: True, 0)


def test_find_max_batches_table_and_files(tmp_path, monkeypatch):
    """The --find-max-batch driver with a fake trial: fp4 fits 3x the bf16 batch here."""
    tm = _train_moe()
    limits = {"bf16": 24, "fp4": 72}
    current = {}

    def fake_trial(args, cfg, train, batch, peaks):
        recipe = "bf16" if not cfg["fp4_moe"].get("enabled", True) else "fp4"
        current["recipe"] = recipe
        if batch > limits[recipe]:
            raise torch.OutOfMemoryError("CUDA out of memory")
        peaks[batch] = 10.0 * batch
    from moe_train import max_batch
    monkeypatch.setattr(max_batch, "_trial", fake_trial)
    args = tm.build_parser().parse_args(TINY + ["--find-max-batch", "--compare", "bf16,fp4",
                                                "--out", str(tmp_path)])
    found = tm.find_max_batches(args, tm.base_config(args), tm._runs(args), None, None)
    assert [(f["recipe"], f["max_micro_batch"]) for f in found] == [("bf16", 24), ("fp4", 72)]
    assert found[1]["peak_mem_mb"] == 720.0 and not found[1]["at_limit"]
    table = (tmp_path / "max_batch.md").read_text()
    assert "| fp4 | 72 | 3.00x | 4,608 | 720 |" in table, table
    assert json.loads((tmp_path / "max_batch.json").read_text())[0]["max_micro_batch"] == 24


# ---- peaks per phase ---------------------------------------------------------------------

class _FakeGPU:
    """An accelerator whose allocated memory the test sets; peaks as torch keeps them."""

    def __init__(self):
        self.now = self.peak = 0

    def device_name(self):
        return "cuda"

    def synchronize(self):
        pass

    def alloc(self, mb):
        self.now += mb * 2**20
        self.peak = max(self.peak, self.now)

    def reset_peak_memory_stats(self):
        self.peak = self.now

    def max_memory_allocated(self):
        return self.peak


def test_phase_peaks_and_the_window_peak_they_restart(monkeypatch):
    from moe_train import memory, metrics
    acc = _FakeGPU()
    monkeypatch.setattr(metrics, "get_accelerator", lambda: acc)
    meter = metrics.MemoryMeter()
    meter.reset()
    acc.alloc(500), acc.alloc(-400)                # a step before the profiled one: 500 MB
    phases = memory.PhasePeaks(acc, meter)
    with phases.phase("forward"):
        acc.alloc(200), acc.alloc(-50)             # 100 -> 300 peak, 250 kept
    with phases.phase("backward"):
        acc.alloc(120), acc.alloc(-200)            # 250 -> 370 peak, 170 after
    with phases.phase("step"):
        acc.alloc(30), acc.alloc(-30)              # 170 -> 200
    assert phases.summary() == {"peak_mem_forward_mb": 300, "peak_mem_backward_mb": 370,
                                "peak_mem_step_mb": 200}
    assert meter.peak_mb() == 500                  # the window still saw the earlier step
    assert memory.PhasePeaks(type("Cpu", (), {"device_name": lambda self: "cpu"})()).summary() \
        == dict.fromkeys(("peak_mem_forward_mb", "peak_mem_backward_mb", "peak_mem_step_mb"))


def test_table_shows_phases_and_reads_old_summaries():
    from moe_train import report
    base = {"recipe": "bf16", "layer": "FP4MoE", "train_loss": 1.0, "heldout_loss": 1.0,
            "tokens_per_s_per_gpu": 1.0, "step_time_ms": 1.0, "peak_mem_mb": 900.0,
            "peak_mem_first100_mb": 900.0, "peak_mem_last100_mb": 900.0,
            "kept_for_backward_mb": 1.0, "memory_kind": "allocated",
            **{f"a2a_{k}_bytes": 1024 for k in ("dispatch_fwd", "combine_fwd", "combine_bwd",
                                                "dispatch_bwd")}}
    new = {**base, "recipe": "fp4", "peak_mem_forward_mb": 700.0, "peak_mem_backward_mb": 900.0,
           "peak_mem_step_mb": 650.0}
    table = report.format_table([base, new], report.add_deviations([base, new]))
    assert "| - / - / - |" in table and "| 700 / 900 / 650 |" in table, table


# ---- ds_fp4's process-wide caches --------------------------------------------------------

def test_release_caches_drops_the_tables():
    import ds_fp4
    from ds_fp4.ops import cuda, fp8_tiles
    host = torch.arange(4, dtype=torch.int64)
    fp8_tiles._tables[(None, (1, 2, 3, 4))] = (host.clone(), host)   # as _pointer_table does
    cuda._tile_table(torch.device("cpu"), (0, 128, 384))
    stats = ds_fp4.cache_stats()
    assert stats["ops.fp8_tiles.weight_tables"] == {"entries": 1, "bytes": 64}
    assert stats["ops.cuda.tile_tables"]["entries"] == 1
    assert ds_fp4.release_caches() == stats
    assert all(s["entries"] == 0 for s in ds_fp4.cache_stats().values())
    assert not fp8_tiles._tables


@pytest.fixture
def fake_graphs(monkeypatch):
    """ExpertGraphs' CUDA calls on the CPU: a capture runs the pass once, reserved memory
    grows by 100 bytes per capture."""
    import contextlib
    from ds_fp4.moe import expert_graphs as G
    reserved = [0]

    class Graph:
        def replay(self):
            pass

    @contextlib.contextmanager
    def graph(g, **kw):
        reserved[0] += 100
        CAPTURING[0] = True
        try:
            yield
        finally:
            CAPTURING[0] = False
    monkeypatch.setattr(G, "_pool_bytes", {})
    monkeypatch.setattr(G, "_pool", lambda device: None)
    monkeypatch.setattr(G, "_shared", weakref.WeakValueDictionary())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved[0])
    return G


CAPTURING = [False]


def _pass_holding(table):
    """A pass that reads a device table by address (which hold_while_captured keeps while
    a capture runs)."""
    from ds_fp4.ops import _cuda_loader as L

    def fn(inputs, rows, plan, *params):
        if CAPTURING[0]:
            L._graph_held.append(table)
        return [inputs + 1]
    return fn


def test_graph_owns_its_tables_and_gives_its_pool_back(fake_graphs):
    G = fake_graphs
    from ds_fp4.ops import _cuda_loader as L
    held_before = len(L._graph_held)
    graphs = G.ExpertGraphs()
    table = torch.zeros(4)
    args = (torch.zeros(2, 1, 4, 8), None, ("plan",), torch.zeros(3))
    fn = _pass_holding(table)
    for _ in range(3):        # eager, captured, replayed
        graphs.forward(fn, args, None)
    assert graphs.captures == 1 and G.live_pool_bytes(0) == 100
    assert len(L._graph_held) == held_before            # the graph holds it, not the loader
    alive = weakref.ref(table)
    del table, fn
    assert alive() is not None                          # a replay still reads it
    del graphs
    gc.collect()
    assert alive() is None and G.live_pool_bytes() == 0  # freed with the module


def test_failed_capture_keeps_no_table(fake_graphs):
    G = fake_graphs
    from ds_fp4.ops import _cuda_loader as L
    held_before, calls = len(L._graph_held), []

    def fn(inputs, rows, plan, *params):
        calls.append(1)
        if len(calls) == 2:    # the capture: it reads a table, then fails
            L._graph_held.append(torch.zeros(1))
            raise RuntimeError("operation not permitted when stream is capturing")
        return [inputs]
    graphs = G.ExpertGraphs()
    args = (torch.zeros(2, 1, 4, 8), None, ("plan",), torch.zeros(3))
    with pytest.warns(RuntimeWarning, match="capture failed"):
        for _ in range(3):
            graphs.forward(fn, args, None)
    assert graphs.disabled is not None and len(calls) == 4   # eager after the failure
    assert len(L._graph_held) == held_before and G.live_pool_bytes() == 0


# ---- a second engine in the same process -------------------------------------------------

def _engines_one_after_another(argv):
    """Build, step and delete an engine, then build a second one; what outlived the first."""
    tm = _train_moe()
    import ds_fp4
    from moe_train import memory
    from moe_train.data import load_corpus
    from moe_train.launch import local_device
    from moe_train.recipes import finish_config
    args = tm.build_parser().parse_args(TINY + argv)
    cfg = finish_config(tm.setup(args), args)
    train, _, _ = load_corpus(None)
    counter = type("Counter", (), {"phase": None})()
    memory.release()
    baseline = memory.live_tensor_bytes()
    engine, model = tm.build_engine(args, cfg, args.ep_size)
    for step in range(2):
        tm.train_step(engine, counter, train, args, step, local_device())
    built = memory.live_tensor_bytes()
    params = {n: weakref.ref(p) for n, p in model.named_parameters()}
    objects = [weakref.ref(m) for m in model.modules()]
    objects += [weakref.ref(engine), weakref.ref(engine.optimizer)]
    memory.discard(engine, model)
    del engine, model
    stats = memory.release()
    freed = memory.live_tensor_bytes()
    alive = sum(r() is not None for r in objects)
    left = {n: r().untyped_storage().nbytes() for n, r in params.items() if r() is not None}
    engine, model = tm.build_engine(args, cfg, args.ep_size)
    tm.train_step(engine, counter, train, args, 0, local_device())
    second = memory.live_tensor_bytes()
    caches = ds_fp4.cache_stats()
    peaks = {}
    engine.destroy()
    del engine, model
    memory.release()
    from moe_train import max_batch
    max_batch._trial(args, cfg, train, 4, peaks)   # --find-max-batch's trial runs on CPU too
    memory.release()
    return {"baseline": baseline, "built": built, "freed": freed, "second": second,
            "alive": alive, "left": left, "stats": stats, "caches": caches,
            "trial_peak": peaks.get(4)}


@pytest.fixture(scope="module")
def pool():
    p = DistPool(2)
    yield p
    p.close()


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--recipe", "fp4"], ["--moe", "autoep", "--recipe", "fp4"]],
                         ids=["legacy", "autoep"])
def test_second_engine_inherits_nothing(pool, argv):
    for got in pool.run(_engines_one_after_another, argv):
        assert got["alive"] == 0, got            # engine, optimizer, model and its modules
        # DeepSpeed (ZeRO 1/2) keeps the parameters before the gates alive from C++
        # (memory.discard); emptied, they hold nothing. The experts' and ln_f's are freed.
        assert all(nbytes == 0 for nbytes in got["left"].values()), got
        assert not any(".experts." in n or "ln_f" in n for n in got["left"]), got
        grown = got["built"] - got["baseline"]
        assert grown > 1 << 20, got                        # weights, Adam state, gradients
        # what stays after the release: a few small tensors DeepSpeed or torch make once
        assert got["freed"] - got["baseline"] < 0.02 * grown, got
        # the second engine holds what the first did, not that plus the first's leftovers
        assert abs(got["second"] - got["built"]) < 0.02 * grown, got
        assert all(c["entries"] == 0 for c in got["caches"].values()), got
        assert got["trial_peak"] is not None


def _reduce_bucket(argv, bucket):
    """The ZeRO optimizer's reduce_bucket_size, and the model's trainable elements."""
    tm = _train_moe()
    from moe_train.recipes import finish_config
    args = tm.build_parser().parse_args(TINY + argv)
    cfg = finish_config(tm.setup(args), args)
    if bucket is not None:
        cfg["zero_optimization"] = {**cfg["zero_optimization"], "reduce_bucket_size": bucket}
    engine, model = tm.build_engine(args, cfg, args.ep_size)
    got = (engine.optimizer.reduce_bucket_size,
           sum(p.numel() for p in model.parameters() if p.requires_grad))
    engine.destroy()
    return got


@pytest.mark.slow
def test_reduce_bucket_sized_to_the_model_unless_set(pool):
    from moe_train.engine import ZERO_REDUCE_BUCKET
    # DeepSpeed's default bucket (5e8 elements) would be >100x this model's gradients
    for size, grads in pool.run(_reduce_bucket, ["--recipe", "fp4"], None):
        assert size == grads and 0 < grads < ZERO_REDUCE_BUCKET // 100
    for size, _ in pool.run(_reduce_bucket, ["--recipe", "fp4"], 12345):
        assert size == 12345                               # the config's own size is kept


@pytest.mark.slow
def test_find_max_batch_refused_on_cpu_and_capacity_factor_with_autoep(pool):
    got = pool.run(_error_of, ["--find-max-batch"])
    assert all("--find-max-batch needs a GPU" in g for g in got), got
    got = pool.run(_error_of, ["--max-batch-memory-gb", "40"])
    assert all("--max-batch-memory-gb 40 caps memory for --find-max-batch only" in g
               for g in got), got
    got = pool.run(_error_of, ["--find-max-batch", "--save", "/tmp/x"])
    assert all("--save does not apply" in g for g in got), got
    got = pool.run(_error_of, ["--moe", "autoep", "--capacity-factor", "1.5"])
    assert all("--capacity-factor 1.5 does not apply to --moe autoep" in g for g in got), got
    got = pool.run(_error_of, ["--memory-breakdown", "--out", "/tmp/x"])
    assert all("--memory-breakdown reads the GPU allocator's history" in g for g in got), got


def _error_of(argv):
    try:
        _train_moe().main(TINY + argv)
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return str(err)
    return "no error"


# ---- --memory-breakdown: the allocator's history replayed ---------------------------------

def _alloc(addr, size, name, file="/x/ds_fp4/moe/experts.py"):
    return {"action": "alloc", "addr": addr, "size": size,
            "frames": [{"filename": "/t/torch/functional.py", "line": 7, "name": "op"},
                       {"filename": file, "line": 3, "name": name}]}


def _free(addr, action="free_completed"):
    return {"action": action, "addr": addr, "size": 0, "frames": []}


MARK = {"action": "alloc", "size": 512, "frames": [
    {"filename": "/t/tools/moe_train/memory_history.py", "line": 1, "name": "_phase_marker"}]}


def test_breakdown_replays_to_each_phase_peak():
    from moe_train.memory_history import breakdown
    mib = 2 ** 20
    trace = [{**MARK, "addr": 9}, _free(9),
             _alloc(1, 1 * mib, "kept"), _alloc(2, 3 * mib, "scratch"), _free(2),
             {**MARK, "addr": 9}, _alloc(3, 2 * mib, "grad"), _alloc(4, 1 * mib, "grad"),
             _free(1), _free(3), _free(4)]
    r = breakdown(trace, 10 * mib, ["forward", "backward"])
    assert r["base_mb"] == 10
    fwd, bwd = r["phases"]["forward"], r["phases"]["backward"]
    assert (fwd["mb"], fwd["during_step_mb"]) == (14, 4)      # kept + scratch
    assert sorted((s[0], s[2], s[3]) for s in fwd["sites"]) == [
        ("moe/experts.py:3 kept", 1, 1), ("moe/experts.py:3 scratch", 3, 1)]
    assert (bwd["mb"], bwd["during_step_mb"]) == (14, 4)       # kept + two grads
    assert bwd["sites"][0][:4] == ["moe/experts.py:3 grad", "torch/functional.py:7 op", 3, 2]
    assert r["peak"]["mb"] == 14
    # the marker's one-byte allocations are not counted; a history without
    # free_completed events frees at free_requested
    trace = [_alloc(1, mib, "a"), _free(1, "free_requested"), _alloc(2, 2 * mib, "b")]
    r = breakdown(trace, 0)
    assert r["peak"]["mb"] == 2 and r["peak"]["sites"][0][0] == "moe/experts.py:3 b"

