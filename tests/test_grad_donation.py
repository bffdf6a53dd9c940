"""The FP8 experts write their input's gradient into their output's gradient buffer when
the layer donates it (``fp8_expert_passes.donated_grad``): one ``[rows, hidden]`` buffer
less at the backward's peak, the same bytes as without."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")   # before deepspeed is imported

from ds_fp4 import ops
from ds_fp4.moe.autoep.fp8_experts import run_fp8_experts
from ds_fp4.moe.fp8_expert_passes import donated_grad
from ds_fp4.moe.fp8_experts import FP8Experts
from tests.test_autoep_fp8_experts import _layout, _tokens, _Weights
from tests.test_fp8_experts import make_experts, make_inputs, needs_hopper

# the CUDA runs take the Triton grouped GEMMs and the CUDA quantizers
DEVICES = ["cpu", pytest.param("cuda", marks=needs_hopper)]


def _grads(fn, x, params, dy):
    """``fn(x)``'s output and the gradients of ``x`` and ``params`` for ``dy`` (a clone of
    it: a donated gradient is overwritten), with the gradient buffer the pass received."""
    xin = x.clone().requires_grad_(True)
    y = fn(xin)
    given = dy.clone()
    grads = torch.autograd.grad(y, [xin, *params], given)
    return y.detach(), grads, given


def test_donated_grad_takes_only_a_buffer_it_may_write():
    g = torch.zeros(4, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        assert donated_grad(g, torch.bfloat16, True) is g
        assert donated_grad(g, torch.bfloat16, False) is None          # not donated
        assert donated_grad(g.float(), torch.bfloat16, True) is None   # not what the GEMM writes
        assert donated_grad(g, torch.float32, True) is None            # input of another dtype
        assert donated_grad(g.t(), torch.bfloat16, True) is None       # not contiguous
        assert donated_grad(torch.zeros(8, 256, dtype=torch.bfloat16)[:4], torch.bfloat16,
                            True) is None                              # part of a larger buffer
        assert donated_grad(g.clone().requires_grad_(True), torch.bfloat16, True) is None
    with torch.enable_grad():                                          # double backward
        assert donated_grad(g, torch.bfloat16, True) is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ep, n_local", [(1, 3), (2, 3), (2, 1)])
@pytest.mark.parametrize("with_rows", [True, False])
def test_legacy_experts_donated_grad_same_bytes_in_its_buffer(ep, n_local, with_rows, device):
    experts = make_experts(256, 128, n_local=n_local, seed=ep + n_local).to(device)
    x = make_inputs(ep, n_local, 96, 256, seed=3).to(device)
    dy = make_inputs(ep, n_local, 96, 256, seed=4).to(device)
    fp8 = FP8Experts.from_experts(experts, cache="mxfp4")
    params = list(experts.parameters())
    rows = ops.quantize_mxfp4_rows(x) if with_rows else None
    run = lambda xin: fp8(xin, rows)   # noqa: E731
    y0, want, given0 = _grads(run, x, params, dy)
    fp8.donate_grad = True
    y1, got, given1 = _grads(run, x, params, dy)
    assert torch.equal(y0, y1)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert got[0].data_ptr() == given1.data_ptr()      # dx lives in dy's buffer
    assert want[0].data_ptr() != given0.data_ptr() and torch.equal(given0, dy)


@pytest.mark.parametrize("ep", [1, 2])
def test_legacy_experts_donated_grad_through_the_loop(monkeypatch, ep):
    """The per-expert cuBLASLt path writes the input's gradient into the donated buffer as
    well (torch's scaled_mm emulated on the CPU)."""
    from tests.test_fp8_gemm_loop import _loop_through_fake_scaled_mm
    _loop_through_fake_scaled_mm(monkeypatch)
    experts = make_experts(256, 128, n_local=2, seed=12)
    x, dy = make_inputs(ep, 2, 64, 256, seed=13), make_inputs(ep, 2, 64, 256, seed=14)
    fp8 = FP8Experts.from_experts(experts, cache="mxfp4")
    params = list(experts.parameters())
    _, want, _ = _grads(fp8, x, params, dy)
    fp8.donate_grad = True
    _, got, given = _grads(fp8, x, params, dy)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert got[0].data_ptr() == given.data_ptr()


def test_legacy_experts_with_bias_keep_dy_for_its_gradient():
    experts = make_experts(256, 128, n_local=2, bias=True, seed=9)
    x, dy = make_inputs(1, 2, 64, 256, seed=5), make_inputs(1, 2, 64, 256, seed=6)
    fp8 = FP8Experts.from_experts(experts, cache="fp8")
    fp8.donate_grad = True
    params = list(experts.parameters())
    _, got, given = _grads(fp8, x, params, dy)
    assert got[0].data_ptr() != given.data_ptr() and torch.equal(given, dy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_rows", [True, False])
def test_autoep_experts_donated_grad_same_bytes_in_its_buffer(with_rows, device):
    weights = _Weights(make_experts(256, 128, n_local=3, seed=2)).to(device)
    x, rows, counts, _ = _layout(_tokens(300), [100, 0, 130])
    x, counts = x.to(device), counts.to(device)
    rows = rows.to(device) if with_rows else None
    dy = _tokens(x.shape[0], seed=6).to(device)
    params = [weights.w1, weights.w3, weights.w2]
    run = lambda donate: (lambda xin: run_fp8_experts(   # noqa: E731
        weights, xin, counts, rows, "mxfp4", donate_grad=donate))
    y0, want, _ = _grads(run(False), x, params, dy)
    y1, got, given = _grads(run(True), x, params, dy)
    assert torch.equal(y0, y1)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert got[0].data_ptr() == given.data_ptr()


def test_fp4moe_donates_its_decode_gradient_to_fp8_experts():
    """The legacy layer's FP8 experts get ``donate_grad`` (its decode's backward makes their
    output's gradient) and a layer step gives the same bytes as without it."""
    from ds_fp4.moe import SwiGLUExpert, to_fp4
    from tests.dist_utils import cpu_env, forward_backward, make_moe
    cpu_env()
    moe = to_fp4(make_moe(hidden=128, num_experts=4, ep_size=1, k=2, drop_tokens=True,
                          dtype=torch.bfloat16, parallel=False,
                          expert=SwiGLUExpert(128, 256)), dict(fp8_experts=True))
    x = torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
    got = forward_backward(moe, x, 1, dy.clone())
    assert moe.deepspeed_moe.experts.donate_grad is True
    moe.deepspeed_moe.experts.donate_grad = False
    want = forward_backward(moe, x, 1, dy.clone())
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)
    assert got[3].keys() == want[3].keys()
    assert all(torch.equal(got[3][k], want[3][k]) for k in got[3])
