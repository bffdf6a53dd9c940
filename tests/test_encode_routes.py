"""ds_fp4.ops.encode_routes: the gate's sparse routes to slots, the slot buffer and the used
slots, equal to DeepSpeed's ``_route_slots`` and ``_sparse_encode`` byte for byte; and
``route_map``: the same slots and used slots with each slot's source token, no buffer.

- CPU: the twin (DeepSpeed's functions) against the definition, for top-k routes with and
  without drops.
- CPU, g++: encode_routes.cu under the host emulation (tests/kernel_emu), through the real
  ``encode_routes`` (its launches redirected), byte for byte against the twin; planted
  kernel bugs fail; routes outside DeepSpeed's range are dropped, not written out of bounds.
- GPU: the CUDA kernels against the twin.
"""

import pytest
import torch
from deepspeed.moe.sharded_moe import _route_slots, _sparse_encode

from ds_fp4 import ops
from ds_fp4.ops.encode_routes import encode_routes, encode_routes_ref, route_map, route_map_ref
from tests.kernel_emu import loader
from tests.test_routing import _routes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _case(tokens, experts, k, cap, m, dtype, seed, device="cpu"):
    indices, locations, _ = _routes(tokens, experts, k, cap, seed)
    x = torch.randn(tokens, m, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return x.to(device), indices.to(device), locations.to(device)


def _definition(x, indices, locations, experts, cap):
    """Slot by slot, route by route, in Python."""
    m = x.shape[1]
    out = torch.zeros(experts, cap, m, dtype=x.dtype)
    slots = torch.full(indices.shape, experts * cap, dtype=torch.int64)
    used = torch.zeros(experts, dtype=torch.int64)
    k, tokens = indices.shape
    for j in range(k):
        for t in range(tokens):
            e, loc = int(indices[j, t]), int(locations[j, t])
            if 0 <= e < experts and 0 <= loc < cap:
                slots[j, t] = e * cap + loc
                out[e, loc] = x[t]
                used[e] = max(int(used[e]), loc + 1)
    return out, slots, used


def _source_definition(indices, locations, experts, cap):
    """Slot -> the token of the kept route in it, -1 where none is."""
    source = torch.full((experts * cap,), -1, dtype=torch.int64)
    k, tokens = indices.shape
    for j in range(k):
        for t in range(tokens):
            e, loc = int(indices[j, t]), int(locations[j, t])
            if 0 <= e < experts and 0 <= loc < cap:
                source[e * cap + loc] = t
    return source


def _assert_same(got, want, names=("out", "slots", "used")):
    for name, a, b in zip(names, got, want):
        a, b = a.cpu(), b.cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), \
            f"{name} differs"


@pytest.mark.parametrize("k, cap", [(1, 4), (2, 6), (2, 64), (3, 40), (8, 16)])
def test_twin_matches_its_definition(k, cap):
    x, indices, locations = _case(48, 8, k, cap, 64, torch.bfloat16, seed=k)
    got = encode_routes_ref(x, indices, locations, 8, cap)
    _assert_same(got, _definition(x, indices, locations, 8, cap))
    assert torch.equal(got[1], _route_slots(indices, locations, 8, cap))
    assert torch.equal(got[0], _sparse_encode(x, got[1], 8, cap))
    mapped = route_map_ref(indices, locations, 8, cap)
    _assert_same(mapped, (*got[1:], _source_definition(indices, locations, 8, cap)),
                 ("slots", "used", "source"))


# ---- the kernel under the host emulation ---------------------------------------------------


host_kernels, emulated = loader.op_fixtures("encode_routes")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k, cap", [(1, 12), (2, 6), (2, 64), (3, 40), (8, 16)])
def test_emulated_kernel_equals_twin(emulated, k, cap, dtype):
    x, indices, locations = _case(48, 8, k, cap, 64, dtype, seed=k)
    got = encode_routes(x, indices, locations, 8, cap)
    assert emulated == ["encode_routes_map", "encode_routes_gather"]
    _assert_same(got, encode_routes_ref(x, indices, locations, 8, cap))
    assert (got[2] < cap).any() or k * 48 > 8 * cap   # some padding, or drops


@pytest.mark.parametrize("k, cap", [(1, 12), (2, 6), (8, 16)])
def test_emulated_route_map_equals_twin(emulated, k, cap):
    _, indices, locations = _case(48, 8, k, cap, 64, torch.float32, seed=k)
    got = route_map(indices, locations, 8, cap)
    assert emulated == ["encode_routes_map", "encode_routes_used"]
    _assert_same(got, route_map_ref(indices, locations, 8, cap), ("slots", "used", "source"))
    indices[0, 0], locations[k - 1, 3] = 8, cap          # routes out of range: dropped
    got = route_map(indices, locations, 8, cap)
    want = _definition(torch.zeros(48, 1), indices, locations, 8, cap)[1:]
    _assert_same(got, (*want, _source_definition(indices, locations, 8, cap)),
                 ("slots", "used", "source"))
    empty = torch.empty(2, 0, dtype=torch.int32)
    slots, used, source = route_map(empty, empty, 4, 3)
    assert slots.shape == (2, 0) and torch.equal(used, torch.zeros(4, dtype=torch.int64))
    assert torch.equal(source, torch.full((12,), -1, dtype=torch.int64))


def test_emulated_kernel_strided_tokens_and_no_tokens(emulated):
    """Tokens read in place through their row stride (a column slice); S = 0: every slot
    zero, every expert unused."""
    wide, indices, locations = _case(32, 4, 2, 12, 128, torch.bfloat16, seed=5)
    x = wide[:, 8:72]
    got = encode_routes(x, indices, locations, 4, 12)
    assert emulated[-1] == "encode_routes_gather"
    _assert_same(got, encode_routes_ref(x, indices, locations, 4, 12))
    empty = torch.empty(2, 0, dtype=torch.int32)
    out, slots, used = encode_routes(x[:0], empty, empty, 4, 3)
    assert torch.equal(out, torch.zeros(4, 3, 64, dtype=torch.bfloat16))
    assert slots.shape == (2, 0) and torch.equal(used, torch.zeros(4, dtype=torch.int64))


def test_emulated_kernel_drops_routes_out_of_range(emulated):
    """A route whose expert or location lies outside the buffer is dropped (slot E * C), as
    the definition says; nothing is written outside ``out``."""
    x, indices, locations = _case(16, 4, 2, 8, 64, torch.float32, seed=6)
    indices[0, 0], locations[1, 3], locations[0, 5] = 4, 8, -2
    got = encode_routes(x, indices, locations, 4, 8)
    want = _definition(x, indices, locations, 4, 8)
    _assert_same(got, want)
    assert (want[1] == 32).sum() >= 3


@pytest.mark.parametrize("plant", [("r % tokens", "r / tokens"),
                                   ("(i64)last[e] + 1", "(i64)last[e]"),
                                   ("src >= 0 ?", "src >= 1 ?")])
def test_a_planted_kernel_bug_fails(host_kernels, monkeypatch, plant):
    """The comparison can fail: a wrong source token, used slots off by one, token 0 never
    copied."""
    loader.redirect(monkeypatch, loader.planted(*plant))
    x, indices, locations = _case(48, 8, 2, 16, 64, torch.bfloat16, seed=7)
    got = encode_routes(x, indices, locations, 8, 16)
    with pytest.raises(AssertionError):
        _assert_same(got, encode_routes_ref(x, indices, locations, 8, 16))


@pytest.mark.parametrize("plant", [("r % tokens", "r / tokens"),
                                   ("(i64)last[e] + 1", "(i64)last[e]")])
def test_a_planted_map_bug_fails(host_kernels, monkeypatch, plant):
    loader.redirect(monkeypatch, loader.planted(*plant))
    _, indices, locations = _case(48, 8, 2, 16, 64, torch.float32, seed=7)
    got = route_map(indices, locations, 8, 16)
    with pytest.raises(AssertionError):
        _assert_same(got, route_map_ref(indices, locations, 8, 16), ("slots", "used", "source"))


# ---- arguments -----------------------------------------------------------------------------


def _args(**change):
    x, indices, locations = _case(16, 4, 2, 8, 64, torch.bfloat16, seed=2)
    args = dict(tokens=x, indices=indices, locations=locations, num_experts=4, capacity=8)
    args.update(change)
    return args


@pytest.mark.parametrize("change, error, names", [
    (dict(tokens=[1.0]), TypeError, "tokens"),
    (dict(tokens=torch.zeros(16, 2, 64)), ValueError, "tokens"),
    (dict(indices=torch.zeros(2, 16)), TypeError, "indices"),
    (dict(indices=torch.zeros(2, 15, dtype=torch.int32)), ValueError, "indices"),
    (dict(locations=torch.zeros(2, 16, dtype=torch.float32)), TypeError, "locations"),
    (dict(locations=torch.zeros(3, 16, dtype=torch.int32)), ValueError, "locations"),
    (dict(num_experts=0), ValueError, "num_experts"),
    (dict(capacity=8.0), ValueError, "capacity"),
    (dict(capacity=True), ValueError, "capacity"),
])
@pytest.mark.parametrize("fn", [encode_routes, encode_routes_ref])
def test_bad_arguments_are_named(fn, change, error, names):
    with pytest.raises(error, match=names):
        fn(**_args(**change))


@pytest.mark.parametrize("change, error, names", [
    (dict(indices=torch.zeros(2, 16)), TypeError, "indices"),
    (dict(indices=torch.zeros(32, dtype=torch.int32)), ValueError, "indices"),
    (dict(locations=torch.zeros(3, 16, dtype=torch.int32)), ValueError, "locations"),
    (dict(num_experts=0), ValueError, "num_experts"),
    (dict(capacity=0), ValueError, "capacity"),
])
@pytest.mark.parametrize("fn", [route_map, route_map_ref])
def test_route_map_bad_arguments_are_named(fn, change, error, names):
    args = _args(**change)
    del args["tokens"]
    with pytest.raises(error, match=names):
        fn(**args)


# ---- GPU -----------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, experts, k, m", [(8192, 32, 2, 7168), (4096, 16, 8, 7168),
                                                   (1000, 8, 2, 520), (7, 4, 3, 8)], ids=str)
def test_cuda_kernel_equals_twin(tokens, experts, k, m, dtype):
    cap = max(1, tokens * k // experts * 5 // 4)
    x, indices, locations = _case(tokens, experts, k, cap, m, dtype, seed=k, device="cuda")
    with ops.kernels("cuda"):
        got = encode_routes(x, indices, locations, experts, cap)
    with ops.kernels("reference"):
        want = encode_routes(x, indices, locations, experts, cap)
    _assert_same(got, want)
    with ops.kernels("cuda"):
        mapped = route_map(indices, locations, experts, cap)
    _assert_same(mapped, route_map_ref(indices, locations, experts, cap),
                 ("slots", "used", "source"))
