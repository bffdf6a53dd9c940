"""ds_fp4.ops.route_grads: the decode's backward (the slots' and the gates' gradients).

- The twin is the eager decode's ops (tests/test_routing.py checks it against DeepSpeed's
  autograd bit for bit, through ``routing.decode``); here its gates' gradient against
  float64 and its slots' against their definition.
- CPU, g++: route_grads.cu under the host emulation (tests/kernel_emu), through the real
  launcher: the slots' gradient byte for byte the twin's, the gates' within float32
  summation order; a planted bug in the kernel text fails the comparison.
- GPU: the same at the layer's sizes (hidden 7168, top-8, FP8 kept rows).
"""

import math

import pytest
import torch

from ds_fp4 import formats as F
from ds_fp4 import ops
from ds_fp4.ops import _cuda_loader as L
from ds_fp4.ops import reference
from ds_fp4.ops.route_grads import (route_gate_grads, route_gate_grads_ref, route_grads,
                                    route_grads_ref)
from tests.kernel_emu import loader
from tests.test_routing import _routes
from deepspeed.moe.sharded_moe import _route_slots

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
KEPT = ["none", "fp8", "rows"]


def _case(tokens, experts, k, cap, m, dtype, kept, seed, device="cpu"):
    """``(grad, slots, gates, slot_count, routes)`` as the decode's backward gets them: top-k
    routes (capacity ``cap`` drops some when small), dy with a NaN and an Inf row, the kept
    routes' outputs of a random expert output (FP8 rows from the slots, or rows)."""
    indices, locations, gates = _routes(tokens, experts, k, cap, seed)
    slots = _route_slots(indices, locations, experts, cap)
    g = torch.Generator().manual_seed(seed + 1)
    y = torch.randn(experts * cap, m, generator=g).to(dtype)
    dy = torch.randn(tokens, m, generator=g)
    if tokens > 8:
        dy[3, 5], dy[7, m - 1] = math.nan, math.inf
    dy = dy.to(dtype)
    gates = gates.t().contiguous().t()            # strided, as DeepSpeed's gate gives them
    routes = None
    if kept == "fp8":
        routes = reference.quantize_fp8_rows(y, index=slots.reshape(-1))
    elif kept == "rows":
        routes = y.index_select(0, slots.reshape(-1).clamp(max=y.shape[0] - 1))
    to = lambda t: None if t is None else t.to(device)   # noqa: E731
    return to(dy), to(slots), to(gates), experts * cap, to(routes)


def _float64_gates(grad, slots, slot_count, routes):
    """The gates' gradient in float64, and the sum of its terms' magnitudes."""
    m = grad.shape[1]
    rows = routes.reshape(slots.numel(), -1)
    values = reference.dequantize_fp8_rows(rows.cpu(), grad.dtype, m) \
        if rows.dtype == torch.uint8 else rows.cpu()
    used = ((slots >= 0) & (slots < slot_count)).reshape(-1, 1).cpu()
    terms = values.double().masked_fill(~used, 0).view(*slots.shape, m) * grad.cpu().double()
    return terms.sum(-1), terms.abs().nan_to_num(posinf=0).sum(-1)


def _compare(got, want, grad, slots, slot_count, routes):
    """Slots' gradient: the same bytes; gates': within the float32 summation order of both
    (<= 2^-18 of the terms' magnitudes from float64), the same NaN/Inf."""
    d_slots, d_gates = got
    assert d_slots.shape == want[0].shape and d_slots.dtype == want[0].dtype
    a, b = d_slots.cpu(), want[0].cpu()
    assert torch.equal(a.isnan(), b.isnan()), "d_slots: NaN elsewhere"   # any NaN's bits
    a, b = a.masked_fill(a.isnan(), 0), b.masked_fill(b.isnan(), 0)
    bad = (a.view(torch.uint8) != b.view(torch.uint8)).nonzero()
    assert bad.numel() == 0, f"d_slots: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}"
    assert (d_gates is None) == (want[1] is None) == (routes is None)
    if d_gates is None:
        return
    exact, size = _float64_gates(grad, slots, slot_count, routes)
    for name, d in (("kernel", d_gates.cpu()), ("twin", want[1].cpu())):
        assert d.dtype == torch.float32 and d.shape == slots.shape, name
        assert torch.equal(d.isnan(), exact.isnan()), name
        finite = exact.isfinite()
        err = (d.double() - exact)[finite].abs()
        assert torch.all(err <= 2 ** -18 * size[finite] + 1e-30), (name, err.max())


# ---- the twin ------------------------------------------------------------------------------


@pytest.mark.parametrize("kept", KEPT)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_twin_matches_its_definition(dtype, kept):
    grad, slots, gates, count, routes = _case(40, 4, 2, 12, 256, dtype, kept, seed=1)
    d_slots, d_gates = route_grads_ref(grad, slots, gates, count, routes)
    assert d_slots.untyped_storage().nbytes() == d_slots.numel() * d_slots.element_size()
    want = torch.zeros(count, 256, dtype=dtype)
    for j in range(2):
        for t in range(40):
            s = slots[j, t].item()
            if s < count:
                want[s] = (grad[t].float() * gates[j, t]).to(dtype)
    assert (slots >= count).any() and torch.equal(d_slots.view(torch.uint8), want.view(torch.uint8))
    _compare((d_slots, d_gates), (d_slots, d_gates), grad, slots, count, routes)


# ---- the kernel under the host emulation ---------------------------------------------------


host_kernels, emulated = loader.op_fixtures("route_grads")


@pytest.mark.parametrize("kept", KEPT)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k, cap", [(1, 12), (2, 6), (3, 40)])
def test_emulated_kernel_equals_twin(emulated, k, cap, dtype, kept):
    grad, slots, gates, count, routes = _case(24, 4, k, cap, 384, dtype, kept, seed=k)
    got = route_grads(grad, slots, gates, count, routes)
    suffix = {"none": "", "fp8": "_fp8", "rows": "_rows"}[kept]
    assert emulated == ["route_grads_invert", f"route_grads_{L.DTYPE_SUFFIX[dtype]}{suffix}"]
    _compare(got, route_grads_ref(grad, slots, gates, count, routes), grad, slots, count, routes)


def test_emulated_kernel_narrow_rows_and_no_routes(emulated):
    """M = 40 (rows kind only: not a multiple of 128); S = 0 (every slot zero)."""
    grad, slots, gates, count, routes = _case(16, 4, 2, 3, 40, torch.bfloat16, "rows", seed=9)
    got = route_grads(grad, slots, gates, count, routes)
    _compare(got, route_grads_ref(grad, slots, gates, count, routes), grad, slots, count, routes)
    empty = torch.empty(2, 0, dtype=torch.int64)
    d_slots, d_gates = route_grads(grad[:0], empty, torch.empty(2, 0), 8,
                                   torch.empty(0, 40, dtype=torch.bfloat16))
    assert torch.equal(d_slots, torch.zeros(8, 40, dtype=torch.bfloat16))
    assert d_gates.shape == (2, 0)


@pytest.mark.parametrize("plant", [("inverse[s] >= 0) return", "inverse[s] > 0) return"),
                                   ("row[m + (c >> 4)]", "row[m + (c >> 5)]"),
                                   ("o[k] = fmul_rn(g[k], gate)", "o[k] = g[k]")])
def test_a_planted_kernel_bug_fails(host_kernels, monkeypatch, plant):
    """The comparison can fail: each edit of the kernel text (a used slot zeroed, the wrong
    FP8 scale, the gate not applied) is caught."""
    loader.redirect(monkeypatch, loader.planted(*plant))
    grad, slots, gates, count, routes = _case(24, 4, 2, 12, 384, torch.bfloat16, "fp8", seed=3)
    got = route_grads(grad, slots, gates, count, routes)
    with pytest.raises(AssertionError):
        _compare(got, route_grads_ref(grad, slots, gates, count, routes), grad, slots, count,
                 routes)


# ---- without the slots' gradient: the slots' gates ------------------------------------------


def _compare_gate_grads(got, grad, slots, gates, count, routes):
    """``route_gate_grads``' result against ``route_grads``' twin: the gates' gradient as
    ``_compare`` checks it, and each used slot's gate scaling dy's row to ``d_slots``' bytes."""
    d_gates, slot_gates = got
    d_slots, want_gates = route_grads_ref(grad, slots, gates, count, routes)
    _compare((d_slots, d_gates), (d_slots, want_gates), grad, slots, count, routes)
    flat = slots.reshape(-1)
    used = (flat >= 0) & (flat < count)
    token = torch.arange(flat.numel()) % slots.shape[1]
    assert slot_gates.dtype == torch.float32 and slot_gates.shape == (count,)
    assert torch.equal(slot_gates[flat[used]], gates.reshape(-1)[used])
    rebuilt = torch.zeros_like(d_slots)
    rebuilt[flat[used]] = (grad[token[used]].float() * slot_gates[flat[used], None]).to(grad.dtype)
    assert torch.equal(rebuilt.nan_to_num().view(torch.uint8), d_slots.nan_to_num().view(torch.uint8))


@pytest.mark.parametrize("kept", KEPT)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gate_grads_twin(dtype, kept):
    grad, slots, gates, count, routes = _case(40, 4, 2, 12, 256, dtype, kept, seed=1)
    _compare_gate_grads(route_gate_grads_ref(grad, slots, gates, count, routes), grad, slots,
                        gates, count, routes)


@pytest.mark.parametrize("kept", KEPT)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k, cap", [(1, 12), (3, 40)])
def test_emulated_gate_grads(emulated, k, cap, dtype, kept):
    grad, slots, gates, count, routes = _case(24, 4, k, cap, 384, dtype, kept, seed=k)
    got = route_gate_grads(grad, slots, gates, count, routes)
    suffix = {"none": "", "fp8": "_fp8", "rows": "_rows"}[kept]
    assert emulated == [f"route_grads_{L.DTYPE_SUFFIX[dtype]}{suffix}"]    # no fill, no invert
    _compare_gate_grads(got, grad, slots, gates, count, routes)


def test_a_planted_slot_gate_bug_fails(host_kernels, monkeypatch):
    loader.redirect(monkeypatch, loader.planted("slot_gates[s] = gate;", "slot_gates[s] = -gate;"))
    grad, slots, gates, count, routes = _case(24, 4, 2, 12, 384, torch.bfloat16, "fp8", seed=3)
    got = route_gate_grads(grad, slots, gates, count, routes)
    with pytest.raises(AssertionError):
        _compare_gate_grads(got, grad, slots, gates, count, routes)


# ---- arguments -----------------------------------------------------------------------------


def _args(**change):
    grad, slots, gates, count, routes = _case(16, 4, 2, 8, 128, torch.bfloat16, "fp8", seed=2)
    args = dict(grad=grad, slots=slots, gates=gates, slot_count=count, routes=routes)
    args.update(change)
    return args


@pytest.mark.parametrize("change, error, names", [
    (dict(grad=torch.zeros(16, 128, dtype=torch.int32)), TypeError, "grad"),
    (dict(grad=torch.zeros(16, 2, 64, dtype=torch.bfloat16)), ValueError, "grad"),
    (dict(slots=torch.zeros(2, 16, dtype=torch.int32)), TypeError, "slots"),
    (dict(slots=torch.zeros(2, 15, dtype=torch.int64)), ValueError, "slots"),
    (dict(gates=torch.zeros(2, 15)), ValueError, "gates"),
    (dict(gates=torch.zeros(2, 16, dtype=torch.int64)), TypeError, "gates"),
    (dict(slot_count=-1), ValueError, "slot_count"),
    (dict(slot_count=8.0), ValueError, "slot_count"),
    (dict(routes=torch.zeros(32, 128, dtype=torch.float16)), TypeError, "routes"),
    (dict(routes=torch.zeros(31, F.fp8_row_bytes(128), dtype=torch.uint8)), ValueError, "routes"),
    (dict(routes=torch.zeros(32, 100, dtype=torch.bfloat16)), ValueError, "routes"),
    (dict(grad=torch.zeros(16, 40, dtype=torch.bfloat16),
          routes=torch.zeros(32, 41, dtype=torch.uint8)), ValueError, "M % 128"),
])
@pytest.mark.parametrize("fn", [route_grads, route_grads_ref])
def test_bad_arguments_are_named(fn, change, error, names):
    with pytest.raises(error, match=names):
        fn(**_args(**change))


# ---- GPU -----------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("kept", KEPT)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, experts, k, m", [(4096, 16, 8, 7168), (1000, 32, 2, 1024),
                                                   (7, 4, 3, 136)], ids=str)
def test_cuda_kernel_equals_twin(tokens, experts, k, m, dtype, kept):
    if kept == "fp8" and m % 128:
        pytest.skip("FP8 rows need M % 128 == 0")
    cap = tokens * k // experts * 5 // 4
    grad, slots, gates, count, routes = _case(tokens, experts, k, cap, m, dtype, kept, seed=k,
                                              device="cuda")
    with ops.kernels("cuda"):
        got = route_grads(grad, slots, gates, count, routes)
    with ops.kernels("reference"):
        want = route_grads(grad, slots, gates, count, routes)
    _compare(got, want, grad, slots, count, routes)
    with ops.kernels("cuda"):
        got = route_gate_grads(grad, slots, gates, count, routes)
    _compare_gate_grads(tuple(None if t is None else t.cpu() for t in got), grad.cpu(),
                        slots.cpu(), gates.cpu(), count, None if routes is None else routes.cpu())
