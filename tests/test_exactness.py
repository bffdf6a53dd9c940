"""The exactness counts of the MXFP4 -> FP8 conversions and the monitor built on them.

The counts (``counts`` of ``mxfp4_to_fp8``, ``mxfp4_rows_to_fp8``, ``mxfp4_to_fp8_colwise``)
are checked three ways: against inputs built with known scale-byte spreads (0, 14, 15, 20),
NaN, overflow and zero blocks, whose expected counts follow from the construction; against
``oracle_counts``, an element-by-element count written here from the definition; and the
spread bound itself against the conversion's own output (14 always exact, 15 not). Each
runs through the reference ops and through the CUDA kernels under the host emulation
(tests/kernel_emu), and on a GPU (skipped without one) through the real kernels. Then the
monitor: the config key, one process, and 2 gloo ranks whose per-layer totals must equal
the oracle's count of exactly the rows the layer converted.
"""

import pytest
import torch

from ds_fp4 import formats as F
from ds_fp4.ops import _cuda_loader, reference
from tests import test_kernels_cuda as T
from tests.dist_utils import DistPool, make_moe
from tests.kernel_emu import loader

HIDDEN, FFN = 128, 256
SPREADS = (0, 14, 15, 20)
NIB = F.MX_BLOCK // 2          # data bytes per MX block
BPG = F.FP8_GROUP // F.MX_BLOCK  # MX blocks per FP8 group


def _zeros():
    return torch.zeros(len(F.EXACTNESS_COUNTS), dtype=torch.int64)


def _as_dict(counts):
    return dict(zip(F.EXACTNESS_COUNTS, counts.tolist()))


# ---- the oracle: the definition, element by element ------------------------------------

def _nonzero(data):
    """bool per element: its E2M1 code has a magnitude bit (not +-0)."""
    lo, hi = data & 0x7, (data >> 4) & 0x7
    return torch.stack((lo != 0, hi != 0), dim=-1).flatten(-2)


def _group_counts(b, nonzero, nan):
    """Counts of groups given per member (last dim) scale byte and nonzero flag."""
    inexact = 0
    for bytes_, nz, is_nan in zip(b.reshape(-1, b.shape[-1]).tolist(),
                                  nonzero.reshape(-1, b.shape[-1]).tolist(),
                                  nan.reshape(-1).tolist()):
        used = [x for x, keep in zip(bytes_, nz) if keep]
        inexact += bool(not is_nan and used and max(used) - min(used) > 14)
    return {"inexact_groups": inexact, "nan_groups": int(nan.sum()), "groups": nan.numel()}


def oracle_counts(data, scales, offsets=None):
    """Expected counts of ``mxfp4_to_fp8`` (``offsets`` None) or of the column-wise
    conversion, from each element's own scale byte; a NaN group is one whose converted
    scale is NaN (the conversion's output, not the counting code)."""
    t = data.shape[0]
    b = scales.long().repeat_interleave(F.MX_BLOCK, dim=1)       # [T, K] per element
    nz = _nonzero(data)
    if offsets is None:
        nan = torch.isnan(reference.mxfp4_to_fp8(data, scales)[1])
        return _group_counts(b.view(t, -1, F.FP8_GROUP), nz.view(t, -1, F.FP8_GROUP), nan)
    nan = torch.isnan(reference.mxfp4_to_fp8_colwise(data, scales, offsets)[1])
    cols_b, cols_nz = [], []
    for start, end in zip(offsets, offsets[1:]):
        for t0 in range(start, end, F.FP8_GROUP):              # one tile: [K, 128] groups
            rows = slice(t0, min(t0 + F.FP8_GROUP, end))
            pad = F.FP8_GROUP - (rows.stop - rows.start)
            cols_b.append(torch.nn.functional.pad(b[rows].t(), (0, pad)))
            cols_nz.append(torch.nn.functional.pad(nz[rows].t(), (0, pad)))
    if not cols_b:
        return _group_counts(torch.zeros(0, 1), torch.zeros(0, 1, dtype=torch.bool), nan)
    return _group_counts(torch.stack(cols_b, 1), torch.stack(cols_nz, 1), nan)


# ---- inputs with known counts ------------------------------------------------------------

def _codes(shape, gen):
    """Random nonzero E2M1 code bytes (both nibbles magnitude 1..7, random signs)."""
    lo = torch.randint(1, 8, shape, generator=gen) | torch.randint(0, 2, shape, generator=gen) * 8
    hi = torch.randint(1, 8, shape, generator=gen) | torch.randint(0, 2, shape, generator=gen) * 8
    return (lo | hi << 4).to(torch.uint8)


def known_rows(m=8, groups=6, seed=0):
    """MXFP4 rows whose 128-groups each have a labelled kind, and the counts they give.

    Kinds, cycling over the groups: spread s for s in SPREADS (blocks at B, B - s, B, B);
    "zero": the low block (B - 40) all +-0, so it must not count; "nan": a block of byte
    255; "overflow": a 6 at byte 254 (2^129, beyond float32); "lowzero": a spread-20 group
    whose low block is zero. Returns (data, scales, expected counts).
    """
    gen = torch.Generator().manual_seed(seed)
    kinds = [*SPREADS, "zero", "nan", "overflow", "lowzero"]
    k = groups * F.FP8_GROUP
    data = _codes((m, k // 2), gen)
    scales = torch.empty(m, k // F.MX_BLOCK, dtype=torch.uint8)
    expected = {"inexact_groups": 0, "nan_groups": 0, "groups": m * groups}
    for r in range(m):
        for g in range(groups):
            kind = kinds[(r * groups + g) % len(kinds)]
            base = int(torch.randint(60, 200, (1,), generator=gen))
            s = [base] * BPG
            blk = g * BPG + 1                  # the group's second block
            d = data[r, blk * NIB:(blk + 1) * NIB]
            if kind in SPREADS:
                s[1] = base - kind
                expected["inexact_groups"] += kind > F.MXFP4_TO_FP8_EXACT_SPREAD
            elif kind in ("zero", "lowzero"):
                s[1] = base - (40 if kind == "zero" else 20)
                d[:] = torch.tensor([0x00, 0x88, 0x80, 0x08] * (NIB // 4), dtype=torch.uint8)
            elif kind == "nan":
                s[1] = F.E8M0_NAN
                expected["nan_groups"] += 1
            else:
                s[1], d[0] = 254, 0x77       # 6 * 2^127
                s[0] = s[2] = s[3] = 254 - 30   # a spread the NaN must hide
                expected["nan_groups"] += 1
            scales[r, g * BPG:(g + 1) * BPG] = torch.tensor(s, dtype=torch.uint8)
    return data, scales, expected


def known_columns(k=256, seed=1):
    """Tokens in segments [128, 0, 200, 56] (tiles of 128, 128, 72, 56 tokens): tile i's tokens
    share one byte per token row except token 5, at B - SPREADS[i]; the first tile also has
    token 9 with a NaN block 0 (its 32 features' groups NaN) and token 11 at B - 40 with all
    codes 0 (no count). Returns (data, scales, offsets, expected counts)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [128, 0, 200, 56]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    t = offsets[-1]
    data = _codes((t, k // 2), gen)
    scales = torch.empty(t, k // F.MX_BLOCK, dtype=torch.uint8)
    tiles = [(start, min(start + F.FP8_GROUP, end)) for start, end in zip(offsets, offsets[1:])
             for start in range(start, end, F.FP8_GROUP)]
    expected = {"inexact_groups": 0, "nan_groups": 0, "groups": k * len(tiles)}
    for i, (start, end) in enumerate(tiles):
        base = 100 + 10 * i
        scales[start:end] = base
        scales[start + 5] = base - SPREADS[i]
        expected["inexact_groups"] += k * (SPREADS[i] > F.MXFP4_TO_FP8_EXACT_SPREAD)
    scales[9, 0] = F.E8M0_NAN        # first tile: spread 0, so none of it is inexact
    scales[11] = 60
    data[11] = 0x88
    expected["nan_groups"] += F.MX_BLOCK
    return data, scales, offsets, expected


# ---- the implementations under test ----------------------------------------------------

@pytest.fixture(scope="module")
def host_kernels():
    if loader.gxx() is None:
        pytest.skip("g++ is not on PATH: the host emulation of the CUDA kernels needs it")
    return loader.HostKernels()


@pytest.fixture(params=["reference", "emulated"])
def impl(request, monkeypatch):
    """The ops module under test: the reference, or ds_fp4.ops.cuda on CPU tensors with
    its launches routed into the host-emulated kernels. Inputs from test_kernels_cuda's
    makers are built on the CPU."""
    monkeypatch.setattr(T, "DEVICE", "cpu")
    if request.param == "reference":
        return reference
    monkeypatch.setattr(_cuda_loader, "launch", request.getfixturevalue("host_kernels").launch)
    from ds_fp4.ops import cuda
    return cuda


def _run(impl, op, *args):
    """``op`` with fresh counters; returns (outputs, counts dict)."""
    counts = _zeros()
    out = getattr(impl, op)(*args, counts=counts)
    return out, _as_dict(counts)


def test_known_spreads_rows(impl):
    data, scales, expected = known_rows()
    assert expected["inexact_groups"] and expected["nan_groups"]   # the input tests something
    assert _run(impl, "mxfp4_to_fp8", data, scales)[1] == expected
    rows = torch.cat([data, scales], dim=1)
    assert _run(impl, "mxfp4_rows_to_fp8", rows)[1] == expected
    assert oracle_counts(data, scales) == expected


def test_known_spreads_columns(impl):
    data, scales, offsets, expected = known_columns()
    assert _run(impl, "mxfp4_to_fp8_colwise", data, scales, offsets)[1] == expected
    assert oracle_counts(data, scales, offsets) == expected


@pytest.mark.parametrize("mode", T.CONVERT_MODES)
def test_random_scales_match_the_oracle(impl, mode):
    """Random codes (10% zero blocks) and scale bytes: rows, misaligned packed rows, and
    ragged segments; the counts add up over calls; outputs equal those of an uncounted call."""
    m, k = 129, 384
    data, scales = T.mx_codes(m, k, seed=k), T.mx_scales(m, k, mode, seed=m)
    want = oracle_counts(data, scales)
    out, got = _run(impl, "mxfp4_to_fp8", data, scales)
    assert got == want
    T.assert_same(out, impl.mxfp4_to_fp8(data, scales), "counted vs plain output")
    buf = torch.zeros(m, F.mxfp4_row_bytes(k) + 1, dtype=torch.uint8)
    buf[:, 1:] = torch.cat([data, scales], dim=1)
    counts = _zeros()
    impl.mxfp4_rows_to_fp8(buf[:, 1:], counts=counts)
    impl.mxfp4_rows_to_fp8(buf[:, 1:], counts=counts)
    assert _as_dict(counts) == {key: 2 * v for key, v in want.items()}
    offsets = [0, 100, 100, 129]
    out, got = _run(impl, "mxfp4_to_fp8_colwise", data, scales, offsets)
    assert got == oracle_counts(data, scales, offsets)
    T.assert_same(out, impl.mxfp4_to_fp8_colwise(data, scales, offsets), "counted vs plain")


def test_empty_inputs_count_nothing(impl):
    data, scales = torch.zeros(0, 64, dtype=torch.uint8), torch.zeros(0, 4, dtype=torch.uint8)
    assert _run(impl, "mxfp4_to_fp8", data, scales)[1] == _as_dict(_zeros())
    assert _run(impl, "mxfp4_to_fp8_colwise", data, scales, [0, 0])[1] == _as_dict(_zeros())


def test_spread_bound_is_the_conversions_own():
    """MXFP4_TO_FP8_EXACT_SPREAD is tight: every code next to a 6 (the largest block's
    worst case) survives the conversion at spread 14, a 0.5 is rounded at spread 15."""
    codes = torch.arange(16, dtype=torch.uint8)
    bound = F.MXFP4_TO_FP8_EXACT_SPREAD
    for spread, exact in ((bound, True), (bound + 1, False)):
        data = torch.zeros(16, F.FP8_GROUP // 2, dtype=torch.uint8)
        data[:, 0] = 0x07                                    # a 6 in block 0
        data[:, NIB:2 * NIB] = (codes | codes << 4)[:, None]  # block 1: one code throughout
        scales = torch.tensor([[130, 130 - spread, 130, 130]] * 16, dtype=torch.uint8)
        x = reference.dequantize_mxfp4(data, scales, torch.float32)
        y = reference.dequantize_fp8(*reference.mxfp4_to_fp8(data, scales), torch.float32)
        assert torch.equal(x, y) == exact, spread


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(3, dtype=torch.int32), "counts must have dtype int64"),
    (torch.zeros(2, dtype=torch.int64), r"shape \(3,\)"),
    (torch.zeros(6, dtype=torch.int64)[::2], "not contiguous"),
    (torch.zeros(3, dtype=torch.int64, device="meta"), "counts is on meta"),
], ids=["dtype", "shape", "strided", "device"])
def test_bad_counts_are_named(impl, bad, match):
    data, scales = torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8)
    with pytest.raises((TypeError, ValueError), match=match):
        impl.mxfp4_to_fp8(data, scales, counts=bad)
    with pytest.raises((TypeError, ValueError), match=match):
        impl.mxfp4_to_fp8_colwise(data, scales, [0, 2], counts=bad)


def test_emulated_counting_kernels_really_ran(host_kernels, monkeypatch):
    """Guards the harness: counted calls launch the counting instances."""
    seen = []
    monkeypatch.setattr(_cuda_loader, "launch",
                        lambda *a, **k: (seen.append(a[2]), host_kernels.launch(*a, **k)))
    from ds_fp4.ops import cuda
    data, scales, offsets, _ = known_columns()
    cuda.mxfp4_to_fp8(data, scales, counts=_zeros())
    cuda.mxfp4_to_fp8_colwise(data, scales, offsets, counts=_zeros())
    cuda.mxfp4_to_fp8(data, scales)
    assert seen == ["mxfp4_to_fp8_rows_counted", "mxfp4_to_fp8_colwise_counted",
                    "mxfp4_to_fp8_rows"]


def test_an_off_by_one_kernel_is_caught(monkeypatch):
    """The emulated comparison fails for kernels whose bound is off by one (spread >= 14)."""
    if loader.gxx() is None:
        pytest.skip("g++ is not on PATH")
    text = lambda m: loader.module_text(m).replace(  # noqa: E731
        "> DS_FP4_E8M0_NAN + DS_FP4_EXACT_SPREAD", ">= DS_FP4_E8M0_NAN + DS_FP4_EXACT_SPREAD")
    assert text("mxfp4_to_fp8") != loader.module_text("mxfp4_to_fp8")
    monkeypatch.setattr(_cuda_loader, "launch", loader.HostKernels(text).launch)
    from ds_fp4.ops import cuda
    data, scales, expected = known_rows()
    assert _run(cuda, "mxfp4_to_fp8", data, scales)[1] != expected
    data, scales, offsets, expected = known_columns()
    assert _run(cuda, "mxfp4_to_fp8_colwise", data, scales, offsets)[1] != expected


# ---- GPU: the real kernels ----------------------------------------------------------------

gpu = pytest.mark.skipif(not T._HAVE_GPU or T.DEVICE != "cuda", reason="needs a CUDA GPU and CuPy")


@gpu
@pytest.mark.parametrize("mode", T.CONVERT_MODES)
@pytest.mark.parametrize("shape", [(1, 128), (129, 384), (4097, 7168)], ids=str)
def test_cuda_counts_match_the_reference(shape, mode):
    from ds_fp4.ops import cuda
    m, k = shape
    data, scales = T.mx_codes(m, k, seed=k).cuda(), T.mx_scales(m, k, mode, seed=m).cuda()
    offsets = [0, m // 3, m // 3, m]
    for op, args in (("mxfp4_to_fp8", (data, scales)),
                     ("mxfp4_to_fp8_colwise", (data, scales, offsets))):
        got, want = _zeros().cuda(), _zeros().cuda()
        T.assert_same(getattr(cuda, op)(*args, counts=got), getattr(reference, op)(*args), op)
        getattr(reference, op)(*args, counts=want)
        assert got.tolist() == want.tolist(), (op, shape, mode)


@gpu
def test_cuda_known_spreads_and_graph_replays():
    """Known counts on the GPU; a captured conversion adds them again on every replay."""
    from ds_fp4.ops import cuda
    data, scales, expected = (t.cuda() if torch.is_tensor(t) else t for t in known_rows())
    cdata, cscales, offsets, cexpected = known_columns()
    cdata, cscales = cdata.cuda(), cscales.cuda()
    counts = _zeros().cuda()
    cuda.mxfp4_to_fp8(data, scales, counts=counts)
    assert _as_dict(counts) == expected
    counts.zero_()
    cuda.mxfp4_to_fp8_colwise(cdata, cscales, offsets, counts=counts)   # warm (tile table)
    counts.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda.mxfp4_to_fp8_colwise(cdata, cscales, offsets, counts=counts)
    counts.zero_()
    for _ in range(3):
        graph.replay()
    assert _as_dict(counts) == {key: 3 * v for key, v in cexpected.items()}


# ---- the monitor ----------------------------------------------------------------------

def test_config_key():
    from ds_fp4.config import FP4MoEConfig
    assert FP4MoEConfig().monitor_exactness is False
    assert FP4MoEConfig.from_section({"monitor_exactness": True}).monitor_exactness is True
    with pytest.raises(ValueError, match="fp4_moe.monitor_exactness"):
        FP4MoEConfig.from_section({"monitor_exactness": "yes"})


class Recorder:
    """Wraps the two conversion ops of ``ds_fp4.ops`` (what FP8Experts calls) and keeps
    each call's MXFP4 input and whether counters were passed."""

    def __init__(self, monkeypatch):
        from ds_fp4 import ops
        self.calls = []
        rows_op, col_op = ops.mxfp4_rows_to_fp8, ops.mxfp4_to_fp8_colwise

        def rows(r, k=None, counts=None):
            d, s = ops.split_mxfp4_rows(r, k)
            self.calls.append((d.clone(), s.clone(), None, counts is not None))
            return rows_op(r, k, counts)

        def col(data, scales, offsets, counts=None):
            self.calls.append((data.clone(), scales.clone(), list(offsets), counts is not None))
            return col_op(data, scales, offsets, counts)

        monkeypatch.setattr(ops, "mxfp4_rows_to_fp8", rows)
        monkeypatch.setattr(ops, "mxfp4_to_fp8_colwise", col)

    def expected(self):
        total = {key: 0 for key in F.EXACTNESS_COUNTS}
        for data, scales, offsets, _ in self.calls:
            for key, v in oracle_counts(data, scales, offsets).items():
                total[key] += v
        return total


def _spread_tokens(tokens, seed):
    """Tokens whose first 32 features are scaled by 2^-20 .. 2^20 (the rest as drawn): some
    row groups and the column groups of those features are wide, the others are not."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    x[:, :F.MX_BLOCK] *= torch.exp2(torch.randint(-20, 21, (tokens, 1), generator=gen).float())
    return x.view(1, tokens, HIDDEN)


def check_monitor_totals(ep, monitor, monkeypatch=None):
    """An FP4MoE with FP8 experts, forward and backward on spread tokens: the layer's totals
    equal the oracle's count of the rows it converted (``ep`` ranks), then reset to 0."""
    import torch.distributed as tdist
    from ds_fp4.moe import SwiGLUExpert, exactness_stats, reset_exactness, to_fp4
    own = monkeypatch is None
    if own:
        monkeypatch = pytest.MonkeyPatch()
    try:
        rec = Recorder(monkeypatch)
        cfg = dict(fp8_experts=True, monitor_exactness=monitor)
        moe = to_fp4(make_moe(hidden=HIDDEN, num_experts=2 * ep, ep_size=ep, k=2,
                              expert=SwiGLUExpert(HIDDEN, FFN), parallel=ep > 1), cfg)
        x = _spread_tokens(32, seed=tdist.get_rank() if tdist.is_initialized() else 0)
        x.requires_grad_(True)
        out, _, _ = moe(x)
        out.float().square().sum().backward()
        kinds = {offsets is None for _, _, offsets, _ in rec.calls}
        # MXFP4 rows only arrive with ep > 1; backward converts the kept rows column-wise
        assert kinds == ({True, False} if ep > 1 else {False}), kinds
        assert {passed for *_, passed in rec.calls} == {monitor}
        stats = exactness_stats(moe)
        if not monitor:
            assert stats == {}
            return None
        assert list(stats) == ["deepspeed_moe"]
        want = rec.expected()
        assert stats["deepspeed_moe"] == want
        assert want["inexact_groups"] > 0 and want["groups"] > want["inexact_groups"]
        reset_exactness(moe)
        assert exactness_stats(moe)["deepspeed_moe"] == {key: 0 for key in F.EXACTNESS_COUNTS}
        return want
    finally:
        if own:
            monkeypatch.undo()


@pytest.mark.parametrize("monitor", [True, False])
def test_monitor_one_rank(monkeypatch, monitor):
    check_monitor_totals(1, monitor, monkeypatch)


def test_monitor_stats_without_a_model():
    """Without a model: every live monitored layer by creation name; reset=True zeroes."""
    from ds_fp4.moe import exactness_stats, to_fp4
    from ds_fp4.moe.exactness import ExactnessCounter
    moe = to_fp4(make_moe(hidden=HIDDEN, num_experts=2, parallel=False),
                 dict(monitor_exactness=True))
    counter = moe.deepspeed_moe.fp4_exactness
    assert isinstance(counter, ExactnessCounter)
    counter.tensor("cpu").add_(torch.tensor([1, 2, 3]))
    stats = exactness_stats(reset=True)
    assert stats[counter.name] == {"inexact_groups": 1, "nan_groups": 2, "groups": 3}
    assert exactness_stats()[counter.name] == {"inexact_groups": 0, "nan_groups": 0, "groups": 0}


@pytest.fixture(scope="module")
def pool2():
    pool = DistPool(2)
    yield pool
    pool.close()


def test_monitor_two_ranks(pool2):
    results = pool2.run(check_monitor_totals, 2, True)
    assert all(r["groups"] > 0 for r in results)
    assert results[0] != results[1]    # each rank counts what it converted itself


def check_train_moe_events():
    """tools/train_moe.py's hook: with a monitor on, a Train/ write gets the counts summed
    over ranks (rank r's layer holds [1 + r, 2, 10]); an Eval/ write gets none and drops
    the counts; a disabled monitor adds nothing."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace
    import torch.distributed as tdist
    from ds_fp4.moe import exactness_stats, to_fp4
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import train_moe
    moe = to_fp4(make_moe(hidden=HIDDEN, num_experts=2, parallel=False),
                 dict(monitor_exactness=True))
    counts = moe.deepspeed_moe.fp4_exactness.tensor("cpu")
    written = []
    engine = SimpleNamespace(module=moe, monitor=SimpleNamespace(
        enabled=True, write_events=lambda events: written.append(list(events))))
    counts.add_(torch.tensor([1 + tdist.get_rank(), 2, 10]))
    train_moe._monitor(engine, [("Train/lm_loss", 1.5, 7)])
    counts.add_(torch.tensor([5, 5, 5]))                   # what an evaluation converted
    train_moe._monitor(engine, [("Eval/heldout_loss", 2.5, 7)])
    after_eval = exactness_stats(moe)["deepspeed_moe"]
    engine.monitor.enabled = False
    train_moe._monitor(engine, [("Train/lm_loss", 1.0, 8)])   # no collective, nothing added
    return written, after_eval


def test_train_moe_logs_the_counts(pool2):
    world = 2
    for written, after_eval in pool2.run(check_train_moe_events):
        assert written == [
            [("Train/lm_loss", 1.5, 7),
             ("Train/fp4_inexact_groups", sum(1 + r for r in range(world)), 7),
             ("Train/fp4_nan_groups", 2 * world, 7),
             ("Train/fp4_converted_groups", 10 * world, 7)],
            [("Eval/heldout_loss", 2.5, 7)]]
        assert after_eval == {key: 0 for key in F.EXACTNESS_COUNTS}
