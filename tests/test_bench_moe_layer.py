"""tools/bench_moe_layer.py on CPU (tiny sizes, one rank): the AutoEP rows run beside the
legacy ones, their errors are against AutoEP's own layer and their bytes follow the formats."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parent.parent


def test_autoep_rows(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "tools" / "bench_moe_layer.py"), "--out", str(tmp_path),
           "--variants", "deepspeed-bf16,autoep-bf16,autoep-fp4", "--warmup", "0",
           "--iters", "1"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    (out,) = tmp_path.glob("bench_moe_layer_*_1rank.json")
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    base, fp4 = rows["autoep-bf16"], rows["autoep-fp4"]
    # one rank sends nothing: only the MXFP4 cache of the experts' input changes anything,
    # i.e. the weight gradients that read it; errors are against AutoEP's own layer
    assert base["rel_err_dw"] is None and fp4["rel_err_out"] == 0.0
    assert 0 < fp4["rel_err_dw"] < 0.3
    assert fp4["experts"] == "AutoEP GroupedExperts"
    ratio = fp4["a2a_bytes"]["dispatch_fwd"] / base["a2a_bytes"]["dispatch_fwd"]
    assert ratio == pytest.approx(17 / 64)          # MXFP4 rows: 17 bytes per 32 elements
    assert "| tiny | autoep-fp4 |" in (out.with_suffix(".md")).read_text()


class _Out(torch.nn.Module):
    """A layer returning ``(op(x @ w),)``."""

    def __init__(self, op):
        super().__init__()
        self.w, self.op = torch.nn.Parameter(torch.randn(64, 64)), op

    def forward(self, x):
        return (self.op(x @ self.w),)


@pytest.mark.parametrize("op, counted", [(lambda t: t, False), (torch.sigmoid, True)],
                         ids=["matmul", "sigmoid"])
def test_kept_leaves_out_an_output_autograd_does_not_save(op, counted):
    # a matmul saves its inputs, not its result; sigmoid's backward reads its own result,
    # which is then kept for the backward and counts
    sys.path.insert(0, str(REPO / "tools"))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import bench_moe_layer as bench
    x = torch.randn(128, 64, requires_grad=True)
    y, out = bench._forward(_Out(op), x)
    assert out == (0 if counted else y.untyped_storage().nbytes())
    got = bench.measure_memory(_Out(op), x, torch.ones(128, 64))
    assert got["output_mb"] == out / 2**20


def test_weight_cache_rows(tmp_path):
    """The fp8_weight_cache variants: the same results as without, their tiles reported as
    held between steps (outside kept and the peaks)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "tools" / "bench_moe_layer.py"), "--out", str(tmp_path),
           "--variants", "deepspeed-bf16,fp4,fp4-wcache,autoep-bf16,autoep-fp4-fp8experts,"
           "autoep-fp4-fp8experts-wcache", "--warmup", "0", "--iters", "1"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    (out,) = tmp_path.glob("bench_moe_layer_*_1rank.json")
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    for plain, cached in (("fp4", "fp4-wcache"),
                          ("autoep-fp4-fp8experts", "autoep-fp4-fp8experts-wcache")):
        assert rows[cached]["fp4_moe"]["fp8_weight_cache"] is True
        assert rows[plain]["weight_cache_mb"] == 0
        for err in ("rel_err_out", "rel_err_dx", "rel_err_dw"):
            assert rows[cached][err] == rows[plain][err], (cached, err)
    # "auto" FP8 experts stay DeepSpeed's on the CPU: no tiles to hold
    assert rows["fp4-wcache"]["weight_cache_mb"] == 0
    # AutoEP with FP8 experts: 8 experts x (w1, w3, w2) 512 x 256, W and W^T in FP8 + scales
    assert rows["autoep-fp4-fp8experts-wcache"]["weight_cache_mb"] == pytest.approx(
        2 * 8 * 3 * (512 * 256 + 4 * 2 * 4) / 2**20)


def test_each_family_is_measured_against_its_asked_for_baseline():
    # AutoEP's fused-combine bf16 layer is the AutoEP rows' baseline when it is the one asked
    # for; without any AutoEP baseline their errors are None ("-"), never a made-up 0
    sys.path.insert(0, str(REPO / "tools"))
    from bench_lib.moe_layer_tables import _errors
    from bench_lib.moe_layer_variants import baselines
    assert baselines(["autoep-fp4-fused", "autoep-bf16-fused", "deepspeed-bf16"]) == \
        {"legacy": "deepspeed-bf16", "autoep": "autoep-bf16-fused"}
    assert baselines(["autoep-bf16", "autoep-bf16-fused"])["autoep"] == "autoep-bf16-fused"
    assert baselines(["autoep-bf16", "fp4"]) == {"autoep": "autoep-bf16"}
    assert baselines(["fp4", "autoep-fp4"]) == {}
    row = {"rel_err_out": 0.066, "rel_err_dx": None, "rel_err_dw": None}
    assert _errors(row) == "6.6e-02 / - / -"


def test_profile_layer_runs(tmp_path):
    """tools/profile_layer.py end to end (on a CPU its table lists CPU ops, not kernels)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "tools" / "profile_layer.py"), "--config", "tiny",
           "--variants", "fp4,grouped-bf16", "--warmup", "1", "--steps", "1",
           "--out", str(tmp_path / "prof"), "--gaps", "--sync-steps"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / "prof.json").read_text())["results"]
    assert [r["variant"] for r in rows] == ["fp4", "grouped-bf16"]
    assert all(r["launches"] > 0 and r["kernels"] for r in rows)


def test_ab_in_process_runs(tmp_path):
    """tools/ab_in_process.py end to end on a CPU: both settings timed each round, the
    switch restored afterwards."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "tools" / "ab_in_process.py"), "--switch",
           "encode_routes", "--configs", "tiny", "--rounds", "2", "--iters", "1", "--warmup", "1",
           "--out", str(tmp_path / "ab")]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = json.loads((tmp_path / "ab.json").read_text())["results"].values()
    assert len(row["on"]) == len(row["off"]) == 2 and set(row["memory"]) == {"on", "off"}
    assert len(row["issue_on"]) == len(row["issue_off"]) == 2
    assert all(t > 0 for t in row["issue_on"] + row["issue_off"])
    sys.path.insert(0, str(REPO / "tools"))
    import ab_in_process
    from ds_fp4 import ops
    from ds_fp4.ops.encode_routes import encode_routes, encode_routes_ref
    ab_in_process.SWITCHES["encode_routes"](False)
    assert ops.encode_routes is encode_routes_ref
    ab_in_process.SWITCHES["encode_routes"](True)
    assert ops.encode_routes is encode_routes
    from ds_fp4.moe import gate_linear
    real = gate_linear.split_bf16
    w = torch.randn(8, 16)
    ab_in_process.SWITCHES["split_bf16"](False)
    assert gate_linear.split_bf16 is not real     # the compiled twin (eager on a CPU)
    assert torch.equal(gate_linear.split_bf16(w, (0, 1, 2), 0), real(w, (0, 1, 2), 0))
    ab_in_process.SWITCHES["split_bf16"](True)
    assert gate_linear.split_bf16 is real
    wb = w.bfloat16()
    ab_in_process.SWITCHES["gate_bf16"](False)    # a bf16 weight split as a float32 one
    assert gate_linear._weight_parts(wb).shape == (24, 16)
    ab_in_process.SWITCHES["gate_bf16"](True)
    assert gate_linear._weight_parts(wb) is wb
    from ds_fp4.moe import fp8_expert_passes as passes
    from ds_fp4.ops import grouped_gemm as gg
    a, sa = ops.quantize_fp8(torch.randn(256, 128))
    wt, st = ops.quantize_fp8_tiles(torch.randn(128, 128))
    ab_in_process.SWITCHES["unchecked_gemms"](False)   # the checked functions: they check
    assert passes.m_grouped_fixed_unchecked is not gg.m_grouped_fixed_unchecked
    with pytest.raises(ValueError, match="group_rows"):
        passes.m_grouped_fixed_unchecked(a, sa, wt[None], st[None], 100)
    with pytest.raises(ValueError, match="group_cols"):
        passes.k_grouped_fixed_unchecked(a.t(), sa.t(), a.t(), sa.t(), 100, torch.float32)
    ab_in_process.SWITCHES["unchecked_gemms"](True)
    assert passes.m_grouped_fixed_unchecked is gg.m_grouped_fixed_unchecked
    assert passes.k_grouped_fixed_unchecked is gg.k_grouped_fixed_unchecked
    from ds_fp4.ops import _cuda_loader as L
    packed = L._packed
    ab_in_process.SWITCHES["driver_launches"](False)   # every launch through CuPy's call
    assert L._packed(0, "fp8_tiles", "k", (L.u64(1),)) is None
    ab_in_process.SWITCHES["driver_launches"](True)
    assert L._packed is packed
    from ds_fp4.moe.fp8_experts import FP8Experts
    reads = FP8Experts.reads_gathered
    ab_in_process.SWITCHES["gathered_input"](False)   # the slot buffer, as before
    assert FP8Experts.reads_gathered is not reads
    assert not FP8Experts.reads_gathered(None, (1, 2, 8, 128), torch.device("cpu"))
    ab_in_process.SWITCHES["gathered_input"](True)
    assert FP8Experts.reads_gathered is reads
    fused = ops.weighted_route_sum_kept
    rows, slots, gates = torch.randn(6, 128), torch.tensor([[0, 5, 9]]), torch.rand(1, 3)
    ab_in_process.SWITCHES["kept_route_rows"](False)   # two passes, the same results
    assert ops.weighted_route_sum_kept is not fused
    for a, b in zip(ops.weighted_route_sum_kept(rows, slots, gates), fused(rows, slots, gates)):
        assert torch.equal(a, b)
    ab_in_process.SWITCHES["kept_route_rows"](True)
    assert ops.weighted_route_sum_kept is fused


def _trace():
    """A Chrome trace as torch.profiler exports it with stacks: three kernels (the third
    after a 40 us gap whose launch came late, inside op "slow_op" within "outer", under two
    Python frames of ds_fp4 and one of torch), a memset overlapping the first kernel, their
    runtime launches, a 35 us stream sync and the CPU ops around those."""
    ev = []
    def op(name, ts, dur, tid=1, cat="cpu_op"):
        ev.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid})
    def launch(corr, ts, tid=1, cat="cuda_runtime", name="cudaLaunchKernel", dur=2):
        ev.append({"ph": "X", "cat": cat, "name": name, "ts": ts,
                   "dur": dur, "tid": tid, "args": {"correlation": corr}})
    def kernel(name, corr, ts, dur, cat="kernel"):
        ev.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 7,
                   "args": {"correlation": corr}})
    op("outer", 0, 200)
    op("fast_op", 1, 5)
    launch(1, 2)
    kernel("k1", 1, 10, 30)
    kernel("memset", 4, 12, 5, cat="gpu_memset")
    launch(2, 38)
    op("mm", 37, 4)
    kernel("k2", 2, 41, 9)                     # 1 us gap: counted, not listed
    op("slow_op", 60, 40)
    op(".../site-packages/ds_fp4/moe/layer.py(10): forward", 55, 60, cat="python_function")
    op("ds_fp4/ops/rows.py(7): quantize", 58, 45, cat="python_function")
    op("torch/autograd/function.py(5): apply", 59, 42, cat="python_function")
    launch(3, 88, cat="cuda_driver")           # as Triton and CuPy launch
    launch(None, 120, name="cudaStreamSynchronize", dur=35)
    op("aten::item", 118, 40)
    kernel("k3", 3, 90, 10)                    # 40 us gap after k2 (ends at 50)
    return {"traceEvents": ev}


def test_gpu_gaps_put_idle_time_on_the_launching_op():
    sys.path.insert(0, str(REPO / "tools"))
    from bench_lib import gpu_gaps
    summary, found = gpu_gaps.gaps(_trace())
    assert summary == {"span_us": 90, "busy_us": 54, "idle_us": 41}
    (gap,) = found
    where = "ds_fp4/ops/rows.py(7): quantize < ds_fp4/moe/layer.py(10): forward"
    assert gap == {"idle_us": 40, "before": "k2", "after": "k3", "launched_by": "slow_op",
                   "where": where, "queued_us": 2}
    assert gpu_gaps.by_launcher(found + [dict(gap, idle_us=10)], steps=2) == \
        [("slow_op @ " + where, 25.0, 1.0)]
    calls = gpu_gaps.long_calls(_trace(), steps=1)
    assert calls == [("cudaStreamSynchronize", "aten::item", "", 35, 1)]
    import profile_layer
    report = profile_layer._gap_report((summary, found), calls, steps=1)
    text = "\n".join(profile_layer._gap_lines(report))
    assert "idle 41" in text and f"| 40 | 1.0 | `slow_op @ {where}` |" in text
    assert "| 35 | 1.0 | `cudaStreamSynchronize` | `aten::item` |" in text


def test_host_pieces_are_top_level_functions_and_backward_nodes():
    """Per step: the CPU ops that are not aten ops and not inside another such op, on each
    thread; a backward node named by its Function; the median over calls."""
    sys.path.insert(0, str(REPO / "tools"))
    from bench_lib import gpu_gaps
    ev = []
    def op(name, ts, dur, tid=1):
        ev.append({"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid})
    for step, t0 in enumerate((0, 1000)):
        op("_Encode", t0, 50 + 100 * (step == 0))      # the first step's call: slower
        op("_Encode", t0 + 200, 100)                   # a second call a step
        op("aten::empty", t0 + 1, 5)
        op("_Inner", t0 + 10, 20)                      # inside _Encode: not a piece
        op("aten::mm", t0 + 60, 30)                    # an aten op: not a piece
        bwd = gpu_gaps.BACKWARD
        op(bwd + "_EncodeBackward", t0 + 500, 40, tid=2)
        op("_EncodeBackward", t0 + 501, 38, tid=2)     # inside its evaluation
        for i in range(3):
            op(bwd + "torch::autograd::AccumulateGrad", t0 + 600 + 10 * i, 4, tid=2)
    rows = gpu_gaps.host_pieces({"traceEvents": ev}, steps=2)
    assert rows == [("_Encode", 2.0, 100, 200.0), ("_Encode (backward)", 1.0, 40, 40.0),
                    ("torch::autograd::AccumulateGrad (backward)", 3.0, 4, 12.0)]
    import profile_layer
    report = profile_layer._gap_report(({"span_us": 0, "busy_us": 0, "idle_us": 0}, []), [],
                                       2, rows)
    text = "\n".join(profile_layer._gap_lines(report))
    assert "| 200 | 2.0 | 100 | `_Encode` |" in text


def test_host_sim_runs_the_kernels_path_with_launches_stubbed():
    """tools/host_sim.py times the FP8 experts' Python on a CPU: the kernels' path runs,
    with every launch counted instead of made (no GPU): the six grouped GEMMs of a step
    (4 M-grouped, 2 K-grouped) and the CuPy quantizers around them."""
    import re
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "tools/host_sim.py", "--reps", "2", "--rounds", "1"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    found = re.search(r"stubbed: ([0-9.]+) us .* launches a step: (\d+) CuPy, (\d+) Triton",
                      res.stdout)
    assert found, res.stdout
    assert float(found[1]) > 0 and int(found[3]) == 6 and int(found[2]) >= 8, found.groups()


def test_host_sim_layer_switch_counts_each_settings_launches():
    """``--layer tiny --switch gathered_input``: the whole layer's kernels path with the
    slot buffer (off) and without (on): on launches one CuPy kernel fewer a step (the
    encode's map-only pass and the decode's gates-only backward against the encode's
    gather, the inverse map and the slots' gradient); the GEMMs' six either way."""
    import re
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "tools/host_sim.py", "--layer", "tiny", "--switch",
                          "gathered_input", "--reps", "2", "--rounds", "1"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    found = dict(re.findall(r"gathered_input (on|off): median [0-9.]+ us .* launches a step: "
                            r"(\d+) CuPy, 6 Triton", res.stdout))
    assert set(found) == {"on", "off"}, res.stdout
    assert int(found["on"]) == int(found["off"]) - 1, found


def test_host_sim_autoep_gathered_switch():
    """``--variant autoep-fp4-fp8experts --switch autoep_gathered``: AutoEP's one-rank
    layer with the FP8 experts reading the tokens through the slots' map (on) launches
    ``ops.slot_sum`` (one CuPy launch more) than with AutoEP's two copies (off); the GEMMs'
    six either way. (The torch ops are counted too, but not compared: here AutoEP's
    permutation takes its CPU fallback, a few ops fewer than its GPU path.)"""
    import re
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "tools/host_sim.py", "--layer", "tiny", "--variant",
                          "autoep-fp4-fp8experts", "--switch", "autoep_gathered", "--reps", "2",
                          "--rounds", "1"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    found = {s: (int(c), int(t)) for s, c, t in re.findall(
        r"autoep_gathered (on|off): median [0-9.]+ us .* launches a step: (\d+) CuPy, "
        r"6 Triton, (\d+) torch ops", res.stdout)}
    assert set(found) == {"on", "off"}, res.stdout
    assert found["on"][0] == found["off"][0] + 1 and min(found["on"][1], found["off"][1]) > 0, \
        found
