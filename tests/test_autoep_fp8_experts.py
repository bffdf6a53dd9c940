"""FP8 experts inside AutoEP (ds_fp4.moe.autoep.fp8_experts): equal segments give the
legacy FP8Experts' bytes; ragged segments (empty and one-row experts, alignment padding)
stay within FP8 error of AutoEP's own bf16 GroupedExperts; padding rows stay zero."""

import os

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")   # before deepspeed is imported

from ds_fp4 import ops
from ds_fp4.moe.autoep.fp8_experts import fp8_experts_problem, run_fp8_experts
from tests.test_fp8_experts import make_experts, make_inputs, rel, run_fp8

ep_experts = pytest.importorskip("deepspeed.moe.ep_experts")


class _Weights(nn.Module):
    """AutoEP's GroupedExperts parameters (w1/w3 [E, F, H], w2 [E, H, F]) from legacy experts."""

    def __init__(self, legacy):
        super().__init__()
        ex = list(legacy.deepspeed_experts)
        self.activation = "swiglu"
        self.w1 = nn.Parameter(torch.stack([e.gate.weight.detach() for e in ex]).clone())
        self.w3 = nn.Parameter(torch.stack([e.up.weight.detach() for e in ex]).clone())
        self.w2 = nn.Parameter(torch.stack([e.down.weight.detach() for e in ex]).clone())


def _run(weights, x, counts, rows, cache="mxfp4"):
    for p in weights.parameters():
        p.grad = None
    xin = x.clone().requires_grad_(True)
    y = run_fp8_experts(weights, xin, counts, rows, cache)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y.device, y.dtype)
    y.backward(dy)
    return y.detach(), xin.grad, [p.grad for p in (weights.w1, weights.w3, weights.w2)], dy


@pytest.mark.parametrize("with_rows, cache", [(True, "mxfp4"), (False, "fp8"), (False, "bf16")])
def test_equal_segments_match_legacy_fp8_experts_bit_for_bit(with_rows, cache):
    legacy = make_experts(256, 128, n_local=3, seed=3)
    weights = _Weights(legacy)
    x = make_inputs(1, 3, 128, 256, seed=4)                 # [1, n, C, H]
    flat = x.reshape(3 * 128, 256)
    rows = ops.quantize_mxfp4_rows(flat) if with_rows else None
    counts = torch.full((3,), 128, dtype=torch.int32)
    y, dx, grads, dy = _run(weights, flat, counts, rows, cache)
    y0, dx0, grads0, _ = run_fp8(legacy, x, dy.view(1, 3, 128, 256), cache, with_rows)
    assert torch.equal(y, y0.view_as(y)) and torch.equal(dx, dx0.view_as(dx))
    for name, g, i in (("w1", grads[0], 0), ("w3", grads[1], 1), ("w2", grads[2], 2)):
        assert torch.equal(g, torch.stack([per[i] for per in grads0])), name


def _grouped_experts(weights):
    ge = ep_experts.GroupedExperts(256, 128, 4, use_grouped_mm=False)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(ge, name).copy_(getattr(weights, name))
    return ge


def test_ragged_segments_close_to_autoep_bf16_experts():
    legacy = make_experts(256, 128, n_local=4, seed=7)
    weights = _Weights(legacy)
    counts = torch.tensor([0, 1, 136, 40], dtype=torch.int32)   # empty, one row, ragged
    n = int(counts.sum()) + 24                                   # alignment padding after
    x = torch.randn(n, 256, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    x[int(counts.sum()):] = 0
    rows = ops.quantize_mxfp4_rows(x)
    y, dx, grads, dy = _run(weights, x, counts, rows)
    assert torch.count_nonzero(y[int(counts.sum()):]) == 0
    ge = _grouped_experts(weights).to(torch.bfloat16)
    xin = ops.dequantize_mxfp4_rows(rows, torch.bfloat16, 256).requires_grad_(True)
    y_ref = ge(xin, counts)
    y_ref.backward(dy)
    real = slice(0, int(counts.sum()))
    assert rel(y[real], y_ref[real]) < 0.1            # FP8 GEMMs on an MXFP4 cache of z
    assert rel(dx[real], xin.grad[real]) < 0.2
    for g, ref in zip(grads, (ge.w1.grad, ge.w3.grad, ge.w2.grad)):
        assert torch.count_nonzero(g[0]) == 0          # the empty expert: no gradient
        assert rel(g[1:], ref[1:]) < 0.2


def test_nan_row_stays_in_its_expert():
    weights = _Weights(make_experts(256, 128, n_local=2, seed=9))
    counts = torch.tensor([64, 64], dtype=torch.int32)
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    x[3, 5] = float("nan")
    y = run_fp8_experts(weights, x, counts, ops.quantize_mxfp4_rows(x))
    assert y[3].isnan().any() and not y[64:].isnan().any()


def test_problems_are_named():
    weights = _Weights(make_experts(256, 128, n_local=2, seed=1))
    assert fp8_experts_problem(weights) == ""
    weights.activation = "geglu_tanh"
    assert "activation" in fp8_experts_problem(weights)
    odd = _Weights(make_experts(256, 96, n_local=2, seed=1))
    assert "ffn = 96 must be multiples of 128" in fp8_experts_problem(odd)
    with pytest.raises(ValueError, match="cache must be one of"):
        run_fp8_experts(odd, torch.zeros(1, 256), torch.ones(2, dtype=torch.int32), cache="x")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_equals_the_cpu_twins():
    # The Triton grouped GEMMs and CUDA quantizers against the CPU reference path, on
    # ragged segments with alignment padding (device offsets: no host sync in the path).
    weights = _Weights(make_experts(512, 256, n_local=5, seed=11))
    counts = torch.tensor([0, 1, 300, 129, 64], dtype=torch.int32)
    n = int(counts.sum()) + 40
    x = torch.randn(n, 512, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    x[int(counts.sum()):] = 0
    rows = ops.quantize_mxfp4_rows(x)
    cpu = _run(weights, x, counts, rows)
    gpu = _run(weights.cuda(), x.cuda(), counts.cuda(), rows.cuda())
    for got, want in ((gpu[0], cpu[0]), (gpu[1], cpu[1]), *zip(gpu[2], cpu[2])):
        assert rel(got.cpu(), want) < 2e-2


def test_exactness_counts_the_rows_converted():
    weights = _Weights(make_experts(256, 128, n_local=2, seed=13))
    counts = torch.tensor([100, 28], dtype=torch.int32)
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    x[7, :128] *= 2.0 ** -20       # one 128-group whose blocks spread by far more than 14
    x[7, :32] *= 2.0 ** 20
    rows = ops.quantize_mxfp4_rows(x)
    got = torch.zeros(3, dtype=torch.int64)
    run_fp8_experts(weights, x, counts, rows, exactness=got)
    want = torch.zeros(3, dtype=torch.int64)
    ops.mxfp4_rows_to_fp8(rows, 256, want)
    assert torch.equal(got, want) and want[0] >= 1 and want[2] == 128 * 2
    # the backward's direct column conversion counts too: the 128-padded layout (expert 0's
    # 100 rows, zeros to 128, expert 1's 28, zeros; its height is a bound made without a
    # host sync: ceil((128 + 2 * 127) / 128) * 128 + a scratch block = 512 rows)
    got = torch.zeros(3, dtype=torch.int64)
    xin = x.clone().requires_grad_(True)
    run_fp8_experts(weights, xin, counts, rows, exactness=got).float().sum().backward()
    padded = torch.zeros(512, rows.shape[1], dtype=torch.uint8)
    padded[:100], padded[128:156] = rows[:100], rows[100:]
    col = torch.zeros(3, dtype=torch.int64)
    ops.mxfp4_to_fp8_colwise(*ops.split_mxfp4_rows(padded, 256), [0, 512], col)
    assert col[2] == 256 * 4 and col[0] >= 1           # 256 features x 4 token blocks
    assert torch.equal(got, want + col)


def test_kernels_option_governs_both_passes(monkeypatch):
    """``kernels=`` (the layer's ``fp4_moe.kernels``) is the mode of every op, forward and
    backward, whatever the process setting."""
    seen = []
    quant = ops.segment_quant

    def recording(*args, **kwargs):
        seen.append(ops.get_kernels())
        return quant(*args, **kwargs)

    monkeypatch.setattr(ops, "segment_quant", recording)
    weights = _Weights(make_experts(256, 128, n_local=2, seed=15))
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(16)).to(torch.bfloat16)
    xin = x.requires_grad_(True)
    with ops.kernels("auto"):
        y = run_fp8_experts(weights, xin, torch.tensor([100, 28], dtype=torch.int32),
                            kernels="reference")
        y.float().sum().backward()
        assert ops.get_kernels() == "auto"
    assert len(seen) >= 4 and set(seen) == {"reference"}, seen
