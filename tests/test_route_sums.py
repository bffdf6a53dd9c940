"""ds_fp4.ops.route_sums: each token's routed rows summed, the decode's weighted sum and the
encode's backward, in float32 rounded once.

- CPU: the twins against their definitions (Python loops over tokens and routes).
- CPU, g++: route_sums.cu under the host emulation (tests/kernel_emu), through the real
  functions (their launches redirected), byte for byte against the twins; planted kernel
  bugs fail.
- GPU: the CUDA kernels against the twins, byte for byte.
"""

import pytest
import torch

from ds_fp4 import ops
from ds_fp4.ops.route_sums import MAX_K, slot_sum, slot_sum_ref, weighted_route_sum, \
    weighted_route_sum_kept, weighted_route_sum_kept_ref, weighted_route_sum_ref
from tests.kernel_emu import loader

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _case(tokens, rows, k, m, dtype, seed, device="cpu", dropped=0.2):
    """Rows, slots (distinct per token; some outside ``[0, rows)``, DeepSpeed's scratch
    slot ``rows``) and float32 gates ``[k, S]``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, m, generator=gen).to(dtype)
    slots = torch.rand(tokens, rows, generator=gen).argsort(1)[:, :k].t().contiguous()
    slots[torch.rand(k, tokens, generator=gen) < dropped] = rows
    gates = torch.rand(k, tokens, generator=gen)
    return x.to(device), slots.to(device), gates.to(device)


def _definition(x, slots, gates=None):
    """Token by token: the float32 sum of its routes, route order with gates, else
    ascending slot order."""
    k, tokens = slots.shape
    out = torch.zeros(tokens, x.shape[1], dtype=x.dtype)
    for t in range(tokens):
        order = range(k) if gates is not None else sorted(range(k), key=lambda j: int(slots[j, t]))
        acc = None
        for j in order:
            s = int(slots[j, t])
            row = x[s].float() if 0 <= s < x.shape[0] else torch.zeros(x.shape[1])
            term = row * gates[j, t] if gates is not None else row
            acc = term if acc is None else acc + term
        out[t] = acc.to(x.dtype)
    return out


def _assert_bytes(a, b):
    """Equal bytes, NaN's aside (the kernels write CUDA's NaN, torch's CPU cast another):
    NaN in the same places."""
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    assert torch.equal(a.masked_fill(nan, 0).view(torch.uint8),
                       b.masked_fill(nan, 0).view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_twins_match_their_definitions(k, dtype):
    x, slots, gates = _case(24, 40, k, 16, dtype, seed=k)
    _assert_bytes(weighted_route_sum_ref(x, slots, gates), _definition(x, slots, gates))
    _assert_bytes(slot_sum_ref(x, slots), _definition(x, slots))


def test_twins_are_deepspeeds_sums_at_k2():
    """At k = 2 the eager decode's ``(rows * gates).sum(0)`` and a bf16 add: the same bits."""
    x, slots, gates = _case(64, 48, 2, 32, torch.bfloat16, seed=3)
    padded = torch.cat([x, x.new_zeros(1, 32)])
    routed = padded[slots.clamp(max=48).reshape(-1)].view(2, 64, 32)
    _assert_bytes(weighted_route_sum_ref(x, slots, gates),
                  (routed * gates.unsqueeze(-1)).sum(0).to(x.dtype))
    _assert_bytes(slot_sum_ref(x, slots), routed[0] + routed[1])


# ---- the kernels under the host emulation --------------------------------------------------


host_kernels, emulated = loader.op_fixtures("route_sums")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_emulated_kernels_equal_twins(emulated, k, dtype):
    x, slots, gates = _case(24, 40, k, 64, dtype, seed=k)
    _assert_bytes(weighted_route_sum(x, slots, gates), weighted_route_sum_ref(x, slots, gates))
    _assert_bytes(slot_sum(x, slots), slot_sum_ref(x, slots))
    suffix = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[dtype]
    assert emulated == [f"route_sum_{suffix}_w", f"route_sum_{suffix}"]


def test_emulated_kernels_read_strided_gates_rows_and_nan(emulated):
    """Gates read through their strides (a transposed ``[S, k]``), rows through their row
    stride (a column slice), a NaN gate and an Inf row carried, no tokens."""
    wide, slots, gates = _case(16, 24, 2, 128, torch.bfloat16, seed=5, dropped=0.0)
    x = wide[:, 32:96]
    gates_sk = gates.t().contiguous()
    gates_sk[3, 1] = float("nan")
    x[int(slots[0, 4])] = float("inf")
    got = weighted_route_sum(x, slots, gates_sk.t())
    _assert_bytes(got, weighted_route_sum_ref(x, slots, gates_sk.t()))
    assert got[3].isnan().all() and got[4].isinf().all()
    _assert_bytes(slot_sum(x, slots), slot_sum_ref(x, slots))
    assert slot_sum(x, slots[:, :0]).shape == (0, 64)


def test_emulated_plain_sum_adds_in_ascending_slot_order(emulated):
    """Three routes whose float32 sum depends on the order: ascending slot order's bits."""
    x = torch.zeros(3, 8)
    x[0], x[1], x[2] = 1.0, 2.0 ** -24, 2.0 ** -24
    slots = torch.tensor([[1], [2], [0]])            # route order adds the small ones first
    got = slot_sum(x, slots)
    assert torch.equal(got, torch.ones(1, 8))        # 1 + 2^-24 + 2^-24 rounds to 1
    assert torch.equal(weighted_route_sum(x, slots, torch.ones(3, 1)),
                       torch.full((1, 8), 1.0 + 2.0 ** -23))


@pytest.mark.parametrize("plant", [("slot[i - 1] > s", "slot[i - 1] < s"),
                                   ("fmul_rn(v[k], gate[j])", "v[k]"),
                                   ("s >= 0 && s < row_count", "s >= 0 && s <= row_count")])
def test_a_planted_kernel_bug_fails(host_kernels, monkeypatch, plant):
    """The comparison can fail: descending order, gates ignored, the scratch slot read."""
    kernels = loader.planted(*plant)
    kernels.library("route_sums")   # built here: a plant missing from the text fails here
    loader.redirect(monkeypatch, kernels)
    x, slots, gates = _case(64, 40, 3, 64, torch.float32, seed=7)
    rows = torch.cat([x, torch.full((1, 64), 3.0)])[:40]   # the scratch slot's row readable
    with pytest.raises(AssertionError):
        _assert_bytes(weighted_route_sum(rows, slots, gates),
                      weighted_route_sum_ref(rows, slots, gates))
        _assert_bytes(slot_sum(rows, slots), slot_sum_ref(rows, slots))


def _fp8_rows_same(a, b):
    """Packed FP8 rows: equal bytes, a NaN's sign aside (a NaN group: E4M3 NaN either sign)."""
    a, b = a.cpu(), b.cpu()
    assert a.shape == b.shape and a.dtype == b.dtype == torch.uint8
    norm = lambda t: torch.where(t & 0x7F == 0x7F, 0x7F, t)    # noqa: E731
    assert torch.equal(norm(a), norm(b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k, m", [(1, 128), (2, 384), (3, 4224)])
def test_emulated_sum_with_kept_fp8_rows(emulated, k, m, dtype):
    """The weighted sum and the routes' FP8 rows from one pass: the sum's bytes and
    quantize_fp8_rows' bytes of the routes (dropped: zero rows; a NaN and an Inf group;
    M of 1, 3 and 33 groups: rows not 8-byte aligned, lanes idle in the last pass)."""
    x, slots, gates = _case(12, 30, k, m, dtype, seed=k)
    x[int(slots[0, 2]) % 30, 5] = float("nan")
    x[int(slots[0, 3]) % 30, m - 1] = float("inf")
    out, kept = weighted_route_sum_kept(x, slots, gates)
    want_out, want_kept = weighted_route_sum_kept_ref(x, slots, gates)
    suffix = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[dtype]
    assert emulated == [f"route_sum_{suffix}_w_fp8"]
    _assert_bytes(out, want_out)
    _assert_bytes(out, weighted_route_sum_ref(x, slots, gates))
    _fp8_rows_same(kept, want_kept)
    _fp8_rows_same(kept, ops.quantize_fp8_rows(x, index=slots.reshape(-1)))


@pytest.mark.parametrize("plant", [("row[m + (c >> 4)]", "row[m + (c >> 5)]"),
                                   ("o < 16; o <<= 1", "o < 8; o <<= 1"),
                                   ("pow2f(-e)", "pow2f(e)")])
def test_a_planted_kept_rows_bug_fails(host_kernels, monkeypatch, plant):
    """A group's scale byte in the wrong place, the group amax over 8 lanes, the scale
    inverted."""
    kernels = loader.planted(*plant)
    kernels.library("route_sums")
    loader.redirect(monkeypatch, kernels)
    x, slots, gates = _case(12, 30, 2, 384, torch.bfloat16, seed=3)
    x[int(slots[0, 1]) % 30, 100] = 1e4            # one large value per group decides its scale
    with pytest.raises(AssertionError):
        _fp8_rows_same(weighted_route_sum_kept(x, slots, gates)[1],
                       weighted_route_sum_kept_ref(x, slots, gates)[1])


def test_more_routes_than_the_kernels_take_run_the_twin(emulated):
    x, slots, gates = _case(4, 64, MAX_K + 1, 8, torch.float32, seed=8)
    _assert_bytes(slot_sum(x, slots), slot_sum_ref(x, slots))
    assert emulated == []


# ---- arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize("change, error, names", [
    (dict(rows=[1.0]), TypeError, "rows"),
    (dict(rows=torch.zeros(40, 2, 8)), ValueError, "rows"),
    (dict(rows=torch.zeros(40, 8, dtype=torch.int32)), TypeError, "rows"),
    (dict(slots=torch.zeros(2, 16, dtype=torch.int32)), TypeError, "slots"),
    (dict(slots=torch.zeros(32, dtype=torch.int64)), ValueError, "slots"),
    (dict(slots=torch.zeros(0, 16, dtype=torch.int64), gates=torch.zeros(0, 16)), ValueError,
     "slots"),
    (dict(gates=torch.zeros(2, 15)), ValueError, "gates"),
    (dict(gates=torch.zeros(2, 16, dtype=torch.int64)), TypeError, "gates"),
])
def test_bad_arguments_are_named(change, error, names):
    x, slots, gates = _case(16, 40, 2, 8, torch.bfloat16, seed=2)
    args = dict(rows=x, slots=slots, gates=gates)
    args.update(change)
    for fn in (weighted_route_sum, weighted_route_sum_ref):
        with pytest.raises(error, match=names):
            fn(**args)
    if "gates" not in change:
        for fn in (slot_sum, slot_sum_ref):
            with pytest.raises(error, match=names):
                fn(args["rows"], args["slots"])


# ---- GPU -----------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, rows, k, m", [(8192, 32 * 640, 2, 7168),
                                                (4096, 16 * 2560, 8, 7168),
                                                (1000, 300, 3, 520), (7, 5, 1, 8)], ids=str)
def test_cuda_kernels_equal_twins(tokens, rows, k, m, dtype):
    x, slots, gates = _case(tokens, rows, k, m, dtype, seed=k, device="cuda")
    with ops.kernels("cuda"):
        got = weighted_route_sum(x, slots, gates), slot_sum(x, slots)
    with ops.kernels("reference"):
        want = weighted_route_sum(x, slots, gates), slot_sum(x, slots)
    for a, b in zip(got, want):
        _assert_bytes(a, b)
    if m % 128 == 0:
        with ops.kernels("cuda"):
            out, kept = weighted_route_sum_kept(x, slots, gates)
        _assert_bytes(out, want[0])
        with ops.kernels("reference"):
            _fp8_rows_same(kept, ops.quantize_fp8_rows(x, index=slots.reshape(-1)))
