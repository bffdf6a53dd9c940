"""ds_fp4.moe.routing: the layer's encode/decode equal DeepSpeed's, forward and backward.

DeepSpeed's backwards scatter with index_add_ (on the CPU in ascending slot order); ours
gather. Outputs, input gradients and gate gradients must be equal values for any k, with
and without dropped routes, in bf16 and fp32. On a GPU the same holds for k <= 2 (larger k
makes DeepSpeed's atomic adds order-dependent).
"""

import pytest
import torch
from deepspeed.moe.sharded_moe import _route_slots, _sparse_decode, _sparse_encode

from ds_fp4.moe import routing
from tests.dist_utils import cpu_env
from tests.kernel_emu import loader

cpu_env()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _routes(tokens, experts, k, capacity, seed):
    """Top-k routes as DeepSpeed's gate returns them: expert indices (-1: dropped),
    locations (arrival order per expert) and float32 gates, each ``[k, tokens]``."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    idx = scores.topk(k, dim=1).indices.t().contiguous()          # [k, S], distinct per token
    flat = idx.reshape(-1)
    onehot = torch.nn.functional.one_hot(flat, experts)
    loc = (onehot.cumsum(0) - 1).gather(1, flat[:, None]).view(k, tokens)
    kept = loc < capacity
    indices = torch.where(kept, idx, -1).to(torch.int32)
    gates = torch.rand(k, tokens, generator=gen)
    return indices, loc.to(torch.int32), gates


def _both(tokens, experts, k, capacity, dtype, seed=0, device="cpu"):
    indices, locations, gates = _routes(tokens, experts, k, capacity, seed)
    slots = _route_slots(indices, locations, experts, capacity).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, 64, generator=gen).to(device, DTYPES[dtype])
    # the experts' output, a function of the dispatched buffer, so both grads flow
    w = torch.randn(experts * capacity, 64, generator=gen).to(device, DTYPES[dtype])
    dy = torch.randn(tokens, 64, generator=gen).to(device, DTYPES[dtype])
    gates = gates.to(device)
    results = []
    ours = lambda xi, *_: routing.encode(xi, indices.to(device), locations.to(device), experts,
                                         capacity)[0]
    for enc, dec in ((_sparse_encode, _sparse_decode), (ours, routing.decode)):
        xi, gi = x.clone().requires_grad_(), gates.clone().requires_grad_()
        dispatched = enc(xi, slots, experts, capacity)
        out = dec(dispatched.view(experts * capacity, -1) * w, slots, gi, tokens)
        out.backward(dy)
        results.append((dispatched.detach().cpu(), out.detach().cpu(), xi.grad.cpu(),
                        gi.grad.cpu()))
    return results, (indices < 0).any().item()


@pytest.mark.parametrize("k", [1, 2, 3, 8])
@pytest.mark.parametrize("capacity", [4, 64])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_equal_to_deepspeed(k, capacity, dtype):
    (want, got), dropped = _both(48, 8, k, capacity, dtype)
    assert dropped == (capacity == 4)   # both cases are exercised
    for name, a, b in zip(("dispatched", "output", "input grad", "gate grad"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max()}"


def test_decode_grad_reaches_only_used_slots():
    indices, locations, gates = _routes(16, 4, 2, 4, seed=3)
    slots = _route_slots(indices, locations, 4, 4)
    y = torch.randn(16, 8, requires_grad=True)
    out = routing.decode(y, slots, gates, 16)
    out.backward(torch.ones_like(out))
    used = torch.zeros(17, dtype=torch.bool)
    used[slots.reshape(-1)] = True
    assert torch.all(y.grad[~used[:16]] == 0)
    assert torch.all(y.grad[used[:16]] != 0)


@pytest.mark.parametrize("gathered", [False, True])
def test_backwards_keep_the_forwards_kernels_setting(monkeypatch, gathered):
    """The encode's and the decode's backwards run under the ``ops.kernels`` mode their
    forwards ran under (the layer's ``fp4_moe.kernels``), not the process setting that
    holds when autograd runs them."""
    from ds_fp4 import ops
    seen = []
    for name in ("slot_sum", "route_grads", "route_gate_grads"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name: (
            seen.append((_name, ops.get_kernels())), _real(*a))[1])
    indices, locations, gates = _routes(16, 4, 2, 8, seed=5)
    x = torch.randn(16, 128, requires_grad=True)
    gates.requires_grad_(True)
    with ops.kernels("reference"):
        slots_in, slots, _ = routing.encode(x, indices, locations, 4, 8)
        handoff = routing.GatheredSlots(None, torch.arange(32)) if gathered else None
        out = routing.decode(slots_in.reshape(32, 128) * 2, slots, gates, 16, False, handoff)
    assert ops.get_kernels() != "reference"
    out.backward(torch.ones_like(out))
    assert seen and {mode for _, mode in seen} == {"reference"}, seen
    assert {name for name, _ in seen} == {"route_gate_grads" if gathered else "route_grads",
                                          "slot_sum"}


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_equal_to_deepspeed(k, dtype):
    """On CUDA the decode's weighted sum and the encode's backward are ``ops.route_sums``'
    kernels, the decode's backward ``ops.route_grads``', whose gates' gradient sums the
    hidden dimension in another order (float32 rounding). For k > 2 the decode adds the
    routes in route order and DeepSpeed's encode backward (atomic adds) in any order."""
    (want, got), _ = _both(4096, 32, k, 256, dtype, device="cuda")
    for name, a, b in zip(("dispatched", "output", "input grad", "gate grad"), got, want):
        if name == "input grad" and k > 2:   # DeepSpeed's atomic adds: order-dependent
            torch.testing.assert_close(a, b, rtol=0.02, atol=0.02)
        elif name == "gate grad":   # ops.route_grads' kernel: float32 sums in another order
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
        elif name == "output" and k > 2:   # then rounded to the rows' dtype
            torch.testing.assert_close(a, b, rtol=1e-5 if dtype == "fp32" else 2 ** -8,
                                       atol=1e-5 * b.abs().max().item())
        else:
            assert torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max()}"


@cuda
def test_cuda_sum_fails_on_a_wrong_gate():
    """The comparison above can fail: one gate changed moves the output and its gradient."""
    indices, locations, gates = _routes(512, 8, 2, 256, seed=5)
    slots = _route_slots(indices, locations, 8, 256).cuda()
    y = torch.randn(8 * 256, 64, device="cuda", dtype=torch.bfloat16)
    good = routing.decode(y, slots, gates.cuda(), 512)
    bad_gates = gates.clone()
    bad_gates[1, 7] += 0.5
    bad = routing.decode(y, slots, bad_gates.cuda(), 512)
    assert not torch.equal(good[7], bad[7]) and torch.equal(good[:7], bad[:7])


host_kernels, _ = loader.op_fixtures("route_sums")


def _paths(path, monkeypatch, host_kernels):
    """The device of a path; "emulated": every op's launches go to the CUDA sources run
    on the host (tests/kernel_emu)."""
    if path == "emulated":
        loader.redirect(monkeypatch, host_kernels)
    return "cuda" if path == "cuda" else "cpu"


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("capacity", [4, 64])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kernel_paths_equal_deepspeed_emulated(k, capacity, dtype, monkeypatch, host_kernels):
    """The kernels' glue (dropped routes, the slots no route reads, the gates' gradient of a
    dropped route) on the CPU, every kernel emulated."""
    launched = loader.redirect(monkeypatch, host_kernels)
    (want, got), dropped = _both(48, 8, k, capacity, dtype)
    assert dropped == (capacity == 4)
    assert {"route_sum_bf16_w" if dtype == "bf16" else "route_sum_f32_w",
            "route_sum_bf16" if dtype == "bf16" else "route_sum_f32"} <= set(launched)
    for name, a, b in zip(("dispatched", "output", "input grad", "gate grad"), got, want):
        assert not a.isnan().any(), name
        if name == "gate grad":   # summed in another order
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
        else:
            assert torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max()}"


def test_decode_without_grad_keeps_nothing(monkeypatch, host_kernels):
    """Under no_grad the decode gathers no routes to keep, and its output is the same."""
    loader.redirect(monkeypatch, host_kernels)
    indices, locations, gates = _routes(48, 8, 2, 4, seed=2)
    slots = _route_slots(indices, locations, 8, 4)
    y = torch.randn(8 * 4, 64).bfloat16()
    selects = []
    real = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select",
                        lambda t, *a: selects.append(1) or real(t, *a))
    with torch.no_grad():
        out = routing.decode(y, slots, gates, 48)
    assert not selects
    monkeypatch.undo()
    assert torch.equal(out, _sparse_decode(y, slots, gates, 48))


@pytest.mark.parametrize("path", ["eager", "emulated", pytest.param("cuda", marks=cuda)])
def test_decode_grad_owns_its_storage(path, monkeypatch, host_kernels):
    """The experts' output gradient is a tensor of its own storage, with dropped routes
    (scratch slot) and unused slots: the FP8 experts may write their input's gradient there
    (``fp8_expert_passes.donated_grad`` refuses views of larger buffers)."""
    device = _paths(path, monkeypatch, host_kernels)
    indices, locations, gates = _routes(48, 8, 2, 4, seed=4)       # capacity 4: drops
    slots = _route_slots(indices, locations, 8, 4).to(device)
    y = torch.randn(8 * 4, 64, device=device).bfloat16().requires_grad_()
    out = routing.decode(y, slots, gates.to(device).requires_grad_(), 48)
    (d,) = torch.autograd.grad(out, y, torch.randn_like(out))
    assert d.shape == y.shape and d.is_contiguous()
    assert d.untyped_storage().nbytes() == d.numel() * d.element_size()
    used = torch.zeros(8 * 4 + 1, dtype=torch.bool, device=device)
    used[slots.reshape(-1)] = True
    assert torch.all(d[~used[:-1]] == 0) and (indices < 0).any()


@pytest.mark.parametrize("path", ["eager", "emulated", pytest.param("cuda", marks=cuda)])
def test_fp8_routes_reach_only_the_gates_gradient(path, monkeypatch, host_kernels):
    """``fp8_routes``: the routes' outputs kept as FP8 rows (on CUDA quantized straight from
    the slots). The output and the experts' output gradient never read them (bit for bit
    the bf16 decode's); the gates' gradient is the float64 product over their FP8 values,
    a dropped route's zero."""
    from ds_fp4 import ops
    device = _paths(path, monkeypatch, host_kernels)
    tokens, experts, k, cap, m = 96, 8, 2, 16, 256
    indices, locations, gates = _routes(tokens, experts, k, cap, seed=6)   # drops some
    slots = _route_slots(indices, locations, experts, cap).to(device)
    gen = torch.Generator().manual_seed(7)
    y = torch.randn(experts * cap, m, generator=gen).to(device, torch.bfloat16)
    dy = torch.randn(tokens, m, generator=gen).to(device, torch.bfloat16)

    def run(fp8):
        yi, gi = y.clone().requires_grad_(), gates.to(device).clone().requires_grad_()
        out = routing.decode(yi, slots, gi, tokens, fp8_routes=fp8)
        out.backward(dy)
        return out, yi.grad, gi.grad

    (out, d_y, d_g), (ref_out, ref_y, ref_g) = run(True), run(False)
    assert torch.equal(out, ref_out) and torch.equal(d_y, ref_y)
    fp8_y = ops.dequantize_fp8_rows(ops.quantize_fp8_rows(y), torch.float32, m)
    padded = torch.cat([fp8_y, fp8_y.new_zeros(1, m)]).double()
    want = (padded[slots.reshape(-1)].view(k, tokens, m) * dy.double()).sum(-1)
    want[slots >= experts * cap] = 0      # DeepSpeed's zero for a dropped route
    assert (indices < 0).any()
    torch.testing.assert_close(d_g.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    err = (d_g - ref_g).norm() / ref_g.norm()
    assert 0 < err < 0.05                 # FP8's rounding, not more


@pytest.mark.parametrize("k, capacity", [(1, 4), (2, 64), (3, 40)])
def test_slots_used_is_one_past_each_experts_last_route(k, capacity):
    indices, locations, gates = _routes(48, 8, k, capacity, seed=k)
    want = torch.zeros(8, dtype=torch.int64)
    for e, loc in zip(indices.reshape(-1).tolist(), locations.reshape(-1).tolist()):
        if e >= 0:
            want[e] = max(want[e], loc + 1)
    _, slots, got = routing.encode(torch.zeros(48, 16), indices, locations, 8, capacity)
    assert torch.equal(slots, _route_slots(indices, locations, 8, capacity))
    assert torch.equal(got, want) and (want < capacity).any() and (want > 0).all()
    # the slots past it are the ones no route takes
    taken = torch.zeros(8 * capacity + 1, dtype=torch.bool)
    taken[slots.reshape(-1)] = True
    past = torch.arange(capacity)[None, :] >= got[:, None]
    assert not (taken[:-1].view(8, capacity) & past).any()
