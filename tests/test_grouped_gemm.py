"""Grouped FP8 GEMMs: the twins against float64 math, the Triton kernels against the twins
(on the CPU under Triton's interpreter, on a GPU natively), and argument checks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_fp4 import ops
from ds_fp4.ops.fp8_tiles import quantize_fp8_tiles
from ds_fp4.ops import grouped_gemm as gg

REPO = Path(__file__).resolve().parents[1]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def _weights(groups, n, k, device="cpu", gen=None):
    w = torch.randn(groups, n, k, generator=gen).to(device)
    tiles = [quantize_fp8_tiles(w[g]) for g in range(groups)]
    return torch.stack([t[0] for t in tiles]), torch.stack([t[1] for t in tiles])


def _fp8(m, k, device="cpu", gen=None):
    return ops.quantize_fp8(torch.randn(m, k, generator=gen).to(device))


def _float64_m(a, sa, w, ws, bounds):
    """The definition in float64: dequantize every element, multiply, sum."""
    a64 = a.double() * sa.double().repeat_interleave(128, 1)
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float64)
    for g in range(w.shape[0]):
        lo, hi = bounds[g], bounds[g + 1]
        w64 = w[g].double() * ws[g].double().repeat_interleave(128, 0).repeat_interleave(128, 1)
        out[lo:hi] = a64[lo:hi] @ w64.t()
    return out


def _float64_k(a, sa, b, sb, bounds):
    a64 = a.double() * sa.double().repeat_interleave(128, 1)
    b64 = b.double() * sb.double().repeat_interleave(128, 1)
    return torch.stack([a64[:, lo:hi] @ b64[:, lo:hi].t() for lo, hi in zip(bounds, bounds[1:])])


# ---- the twins ---------------------------------------------------------------------------


@pytest.mark.parametrize("bounds", [[0, 5, 5, 70], [0, 0], [0, 1, 129, 130, 300]])
def test_m_grouped_ref_is_the_definition(bounds):
    gen = torch.Generator().manual_seed(len(bounds))
    groups = len(bounds) - 1
    a, sa = _fp8(bounds[-1], 256, gen=gen)
    w, ws = _weights(groups, 128, 256, gen=gen)
    out = gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, offsets=bounds, out_dtype=torch.float32)
    if bounds[-1]:
        assert _rel(out, _float64_m(a, sa, w, ws, bounds)) < 1e-6


def test_m_grouped_rows_after_the_last_group_are_zeros():
    a, sa = _fp8(50, 128)
    w, ws = _weights(2, 128, 128)
    out = torch.full((50, 128), float("nan"), dtype=torch.bfloat16)
    gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, offsets=[0, 10, 37], out=out)
    assert torch.count_nonzero(out[37:]) == 0 and not out[:37].isnan().any()


def test_m_grouped_fixed_and_per_group_scales_match_offsets():
    gen = torch.Generator().manual_seed(3)
    a, sa = _fp8(3 * 40, 256, gen=gen)
    w, ws = _weights(3, 256, 256, gen=gen)
    by_offsets = gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, offsets=[0, 40, 80, 120])
    fixed = gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, group_rows=40)
    # [G, K/128, rows]: each group's scales stored apart (FP8Experts' segment layout)
    per_group = sa.t().reshape(2, 3, 40).transpose(0, 1).contiguous()
    grouped_scales = gg.m_grouped_gemm_fp8_nt(a, per_group, w, ws, group_rows=40)
    assert torch.equal(by_offsets, fixed) and torch.equal(by_offsets, grouped_scales)


@pytest.mark.parametrize("bounds", [[0, 128, 128, 384], [0, 0, 0], [0, 256]])
def test_k_grouped_ref_is_the_definition(bounds):
    gen = torch.Generator().manual_seed(7 + len(bounds))
    a, sa = _fp8(256, max(bounds[-1], 128), gen=gen)
    b, sb = _fp8(128, max(bounds[-1], 128), gen=gen)
    out = gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, bounds)
    want = _float64_k(a, sa, b, sb, bounds)
    assert out.shape == want.shape
    for g in range(len(bounds) - 1):
        if bounds[g + 1] == bounds[g]:
            assert torch.count_nonzero(out[g]) == 0      # empty group: zeros
        else:
            assert _rel(out[g], want[g]) < 1e-6


def test_k_grouped_accumulates_and_reads_slabs():
    gen = torch.Generator().manual_seed(11)
    a, sa = _fp8(128, 384, gen=gen)
    b, sb = _fp8(256, 384, gen=gen)
    bounds = [0, 128, 384]
    base = torch.randn(2, 128, 256, generator=gen)
    acc = gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, bounds, out=base.clone(), accumulate=True)
    assert _rel(acc - base, _float64_k(a, sa, b, sb, bounds)) < 1e-6
    # the same groups as [G, R, P] slabs (each group's columns from 0, padded to 256)
    slab_a = torch.zeros(2, 128, 256, dtype=a.dtype)
    slab_b = torch.zeros(2, 256, 256, dtype=b.dtype)
    ssa, ssb = torch.ones(2, 128, 2), torch.ones(2, 256, 2)
    for g, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        slab_a[g, :, :hi - lo], ssa[g, :, :(hi - lo) // 128] = a[:, lo:hi], sa[:, lo // 128:hi // 128]
        slab_b[g, :, :hi - lo], ssb[g, :, :(hi - lo) // 128] = b[:, lo:hi], sb[:, lo // 128:hi // 128]
    slabs = gg.k_grouped_gemm_fp8_nt(slab_a, ssa, slab_b, ssb, bounds)
    assert torch.equal(slabs, gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, bounds))
    # fixed-size groups: 192 columns each (slab a, side-by-side b)
    fixed = gg.k_grouped_gemm_fp8_nt(slab_a[:, :, :128], ssa[:, :, :1], b[:, :256],
                                     sb[:, :2], group_cols=128)
    assert torch.equal(fixed, gg.k_grouped_gemm_fp8_nt(slab_a[:, :, :128], ssa[:, :, :1],
                                                       b[:, :256], sb[:, :2], [0, 128, 256]))


def test_k_grouped_halves_are_the_rows_split():
    gen = torch.Generator().manual_seed(13)
    a, sa = _fp8(512, 384, gen=gen)
    b, sb = _fp8(128, 384, gen=gen)
    bounds = [0, 128, 128, 384]
    whole = gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, bounds, out_dtype=torch.bfloat16)
    top, bottom = gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, bounds, out_dtype=torch.bfloat16,
                                           halves=True)
    assert top.is_contiguous() and bottom.is_contiguous()
    assert torch.equal(top, whole[:, :256]) and torch.equal(bottom, whole[:, 256:])
    with pytest.raises(ValueError, match="multiple of 256"):
        gg.k_grouped_gemm_fp8_nt(a[:384], sa[:384], b, sb, bounds, halves=True)
    with pytest.raises(ValueError, match="out=None"):
        gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, bounds, out=whole, halves=True)


def test_nan_scale_comes_out_nan():
    a, sa = _fp8(64, 128)
    w, ws = _weights(1, 128, 128)
    sa = sa.clone()
    sa[3, 0] = float("nan")
    out = gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, group_rows=64)
    assert out[3].isnan().all() and not out[4].isnan().any()


# ---- bad input ---------------------------------------------------------------------------


def test_bad_input_names_the_argument():
    a, sa = _fp8(10, 256)
    w, ws = _weights(2, 128, 256)
    with pytest.raises(ValueError, match="offsets must be non-decreasing"):
        gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, offsets=[0, 11, 10])
    with pytest.raises(ValueError, match="must not pass the 10 rows"):
        gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, offsets=[0, 3, 11])
    with pytest.raises(ValueError, match="offsets must have 3 entries"):
        gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, offsets=[0, 10])
    with pytest.raises(ValueError, match="exactly one of offsets"):
        gg.m_grouped_gemm_fp8_nt(a, sa, w, ws)
    with pytest.raises(ValueError, match="group_rows"):
        gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, group_rows=4)
    with pytest.raises(ValueError, match="share K"):
        gg.m_grouped_gemm_fp8_nt(a, sa, *_weights(2, 128, 128), offsets=[0, 5, 10])
    with pytest.raises(TypeError, match="a must have dtype float8_e4m3fn"):
        gg.m_grouped_gemm_fp8_nt(a.float(), sa, w, ws, offsets=[0, 5, 10])
    with pytest.raises(ValueError, match="w_scales must have shape"):
        gg.m_grouped_gemm_fp8_nt(a, sa, w, ws[:, :, :1], offsets=[0, 5, 10])
    with pytest.raises(ValueError, match="a: its last dimension K = 64"):
        gg.m_grouped_gemm_fp8_nt(a[:, :64], sa, w, ws, offsets=[0, 5, 10])
    b, sb = _fp8(128, 256)
    with pytest.raises(ValueError, match="multiples of 128"):
        gg.k_grouped_gemm_fp8_nt(b, sb, b, sb, [0, 100, 256])
    with pytest.raises(ValueError, match="col_offsets need 384"):
        gg.k_grouped_gemm_fp8_nt(b, sb, b, sb, [0, 128, 384])
    with pytest.raises(ValueError, match="exactly one of col_offsets"):
        gg.k_grouped_gemm_fp8_nt(b, sb, b, sb, [0, 256], group_cols=128)
    with pytest.raises(ValueError, match="group_cols must be a non-negative multiple"):
        gg.k_grouped_gemm_fp8_nt(b, sb, b, sb, group_cols=100)
    with pytest.raises(ValueError, match="accumulate=True needs out"):
        gg.k_grouped_gemm_fp8_nt(b, sb, b, sb, [0, 256], accumulate=True)


def test_used_counts_are_checked_and_a_promise_only():
    """rows_used / cols_used: fixed-size groups only, int [G] on the operands' device; the
    twins (which read all rows) give the same result where the promise holds."""
    a, sa = _fp8(80, 128)
    w, ws = _weights(2, 128, 128)
    ok = torch.tensor([40, 3])
    with pytest.raises(ValueError, match="rows_used applies to fixed-size groups"):
        gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, offsets=[0, 40, 80], rows_used=ok)
    with pytest.raises(TypeError, match="rows_used must have dtype"):
        gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, group_rows=40, rows_used=ok.float())
    with pytest.raises(ValueError, match="rows_used must be 1-D with one entry per group"):
        gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, group_rows=40, rows_used=ok[:1])
    b, sb = _fp8(128, 256)
    with pytest.raises(ValueError, match="cols_used must be 1-D"):
        gg.k_grouped_gemm_fp8_nt(b, sb, b, sb, group_cols=128, cols_used=ok[None])
    with pytest.raises(ValueError, match="cols_used applies to fixed-size groups"):
        gg.k_grouped_gemm_fp8_nt(b, sb, b, sb, [0, 128, 256], cols_used=ok)
    assert torch.equal(gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, group_rows=40, rows_used=ok),
                       gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, group_rows=40))


def _recorded_launches(monkeypatch):
    """Every ``launch_m_grouped`` / ``launch_k_grouped`` call, recorded instead of run, with
    the kernels' branch taken on the CPU."""
    from ds_fp4.ops import grouped_gemm_triton as gt
    calls = []
    monkeypatch.setattr(gg, "_use_kernel", lambda *t: True)
    for name in ("launch_m_grouped", "launch_k_grouped"):
        monkeypatch.setattr(gt, name, lambda *a, _n=name, **k: calls.append((_n, a, k)))
    return calls


def _same_call(one, two, out_at=4):
    """Two recorded launches with the same arguments: the very same tensors, except the
    output (argument ``out_at``) each call allocates, which must agree in shape and dtype."""
    assert one[0] == two[0] and one[2].keys() == two[2].keys()
    args = list(zip((*one[1], *one[2].values()), (*two[1], *two[2].values())))
    assert len(args) == len(one[1]) + len(one[2]) == len(two[1]) + len(two[2])
    for i, (x, y) in enumerate(args):
        if i == out_at:
            assert x is not y and (x.shape, x.dtype, x.stride()) == (y.shape, y.dtype, y.stride())
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert x is y, f"argument {i}"
        else:
            assert x == y, f"argument {i}: {x!r} vs {y!r}"


@pytest.mark.parametrize("per_group", [False, True])
def test_unchecked_entries_launch_what_the_checked_functions_launch(monkeypatch, per_group):
    """``m_grouped_fixed_unchecked`` / ``k_grouped_fixed_unchecked`` (the FP8 experts'
    entries, without the argument checks) hand the kernels the checked functions' arguments,
    and off the kernels' path are those functions."""
    a, sa = _fp8(80, 256)
    if per_group:   # [G, K/128, rows], as the experts' segment quantizer stores them
        sa = sa.t().reshape(2, 2, 40).contiguous()
    w, ws = _weights(2, 128, 256)
    used = torch.tensor([40, 3], dtype=torch.int32)
    want = gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, group_rows=40, rows_used=used)
    assert torch.equal(gg.m_grouped_fixed_unchecked(a, sa, w, ws, 40, rows_used=used), want)
    xa, xsa = _fp8(256, 256)   # slabs [G, M, P] against side-by-side [N, G * P]
    xb, xsb = _fp8(128, 256)
    slabs, slab_scales = xa.view(2, 128, 256)[:, :, :128], xsa.view(2, 128, 2)[:, :, :1]
    for dtype in (torch.float32, torch.bfloat16):
        want = gg.k_grouped_gemm_fp8_nt(slabs, slab_scales, xb, xsb, group_cols=128,
                                        out_dtype=dtype, cols_used=used)
        got = gg.k_grouped_fixed_unchecked(slabs, slab_scales, xb, xsb, 128, dtype, used)
        assert got.dtype == dtype and torch.equal(got, want)
    calls = _recorded_launches(monkeypatch)
    gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, group_rows=40, rows_used=used)
    gg.m_grouped_fixed_unchecked(a, sa, w, ws, 40, rows_used=used)
    gg.k_grouped_gemm_fp8_nt(slabs, slab_scales, xb, xsb, group_cols=128,
                             out_dtype=torch.bfloat16, cols_used=used)
    gg.k_grouped_fixed_unchecked(slabs, slab_scales, xb, xsb, 128, torch.bfloat16, used)
    assert [c[0] for c in calls] == ["launch_m_grouped"] * 2 + ["launch_k_grouped"] * 2
    _same_call(calls[0], calls[1])
    _same_call(calls[2], calls[3])


# ---- the Triton kernels under the interpreter (CPU, CI) ------------------------------------

_INTERPRETED = r"""
import sys, torch, triton
from ds_fp4 import ops
from ds_fp4.ops.fp8_tiles import quantize_fp8_tiles
from ds_fp4.ops import grouped_gemm as gg, grouped_gemm_triton as gt
torch.manual_seed(0)

def rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()

worst = 0.0
for bounds, k, n in (([0, 5, 5, 70], 256, 256), ([0, 33, 97], 512, 128)):
    groups = len(bounds) - 1
    a, sa = ops.quantize_fp8(torch.randn(bounds[-1], k))
    tiles = [quantize_fp8_tiles(torch.randn(n, k)) for _ in range(groups)]
    w, ws = torch.stack([t[0] for t in tiles]), torch.stack([t[1] for t in tiles])
    ref = gg.m_grouped_gemm_fp8_nt_ref(a, sa, w, ws, offsets=bounds, out_dtype=torch.float32)
    cfg = triton.Config({"BM": 16}, num_warps=4, num_stages=1)
    out = torch.full(ref.shape, float("nan"))
    gt.launch_m_grouped(a, sa, w, ws, out, torch.tensor(bounds, dtype=torch.int32),
                        None, False, cfg)
    worst = max(worst, rel(out, ref))
    out = torch.full(ref.shape, float("nan"))
    if len(set(b - a_ for a_, b in zip(bounds, bounds[1:]))) == 1:
        gt.launch_m_grouped(a, sa, w, ws, out, None, bounds[1], False, cfg)
        worst = max(worst, rel(out, ref))
# rows after the last group come out as zeros
out = torch.full(ref.shape, float("nan"))
gt.launch_m_grouped(a, sa, w, ws, out, torch.tensor([0, 33, 80], dtype=torch.int32), None,
                    False, triton.Config({"BM": 16}, num_warps=4, num_stages=1))
tail = gg.m_grouped_gemm_fp8_nt_ref(a, sa, w, ws, offsets=[0, 33, 80], out_dtype=torch.float32)
worst = max(worst, rel(out, tail))
assert torch.count_nonzero(out[80:]) == 0
# a planted wrong offset must be caught by the same comparison
out = torch.full(ref.shape, float("nan"))
gt.launch_m_grouped(a, sa, w, ws, out, torch.tensor([0, 40, 97], dtype=torch.int32), None,
                    False, triton.Config({"BM": 16}, num_warps=4, num_stages=1))
planted = rel(out, ref)
bounds = [0, 128, 128, 384]
a, sa = ops.quantize_fp8(torch.randn(256, 384))
b, sb = ops.quantize_fp8(torch.randn(128, 384))
ref = gg.k_grouped_gemm_fp8_nt_ref(a, sa, b, sb, bounds)
out = torch.full(ref.shape, float("nan"))
gt.launch_k_grouped(a, sa, b, sb, out, torch.tensor(bounds, dtype=torch.int32), False)
worst = max(worst, rel(out, ref))
ref = gg.k_grouped_gemm_fp8_nt_ref(a, sa, b, sb, [0, 128, 256, 384])
out = torch.full(ref.shape, float("nan"))
gt.launch_k_grouped(a, sa, b, sb, out, None, False, group_cols=128)
worst = max(worst, rel(out, ref))
# N = 120: rows of out not 16-aligned, so the fused path stores through pointers
b5, sb5 = ops.quantize_fp8(torch.randn(120, 384))
ref5 = gg.k_grouped_gemm_fp8_nt_ref(a, sa, b5, sb5, [0, 128, 256, 384])
out5 = torch.full(ref5.shape, float("nan"))
gt.launch_k_grouped(a, sa, b5, sb5, out5, None, False, group_cols=128)
worst = max(worst, rel(out5, ref5))
# M's two halves into two tensors (halves=True's launch), ragged groups
halves = [torch.full((3, 128, 128), float("nan")) for _ in range(2)]
gt.launch_k_grouped(a, sa, b, sb, halves[0], torch.tensor(bounds, dtype=torch.int32), False,
                    out2=halves[1])
worst = max(worst, rel(torch.cat(halves, 1), gg.k_grouped_gemm_fp8_nt_ref(a, sa, b, sb, bounds)))
# [G, R, P] operands (one slab per group) and accumulation into out
slabs = lambda t: t.reshape(t.shape[0], 3, -1).transpose(0, 1).contiguous()  # noqa: E731
out2 = out.clone()
gt.launch_k_grouped(slabs(a), slabs(sa), slabs(b), slabs(sb), out2, None, True, group_cols=128)
worst = max(worst, rel(out2, 2 * ref))
# rows_used / cols_used: zero rows (columns) past a group's count; the kernels skip them
cfg = triton.Config({"BM": 16}, num_warps=4, num_stages=1)
a, sa = ops.quantize_fp8(torch.randn(120, 256))
tiles = [quantize_fp8_tiles(torch.randn(128, 256)) for _ in range(3)]
w, ws = torch.stack([t[0] for t in tiles]), torch.stack([t[1] for t in tiles])
used = torch.tensor([40, 17, 0], dtype=torch.int32)
zeroed = a.clone()
for g, u in enumerate(used.tolist()):
    zeroed[40 * g + u:40 * (g + 1)] = 0
ref = gg.m_grouped_gemm_fp8_nt_ref(zeroed, sa, w, ws, group_rows=40, out_dtype=torch.float32)
out = torch.full(ref.shape, float("nan"))
gt.launch_m_grouped(zeroed, sa, w, ws, out, None, 40, False, cfg, rows_used=used)
worst = max(worst, rel(out, ref))
out = torch.full(ref.shape, float("nan"))   # the promise broken: the tiles past it skipped
gt.launch_m_grouped(a, sa, w, ws, out, None, 40, False, cfg, rows_used=used)
full = gg.m_grouped_gemm_fp8_nt_ref(a, sa, w, ws, group_rows=40, out_dtype=torch.float32)
assert torch.count_nonzero(out[72:]) == 0 and torch.count_nonzero(full[72:]) > 0
worst = max(worst, rel(out[:72], full[:72]))
a, sa = ops.quantize_fp8(torch.randn(64, 2 * 1152))        # 9 K blocks a group: not fused
b, sb = ops.quantize_fp8(torch.randn(128, 2 * 1152))
used = torch.tensor([300, 0])   # int64: the kernels load either type
za, zb = a.clone(), b.clone()
za[:, 300:1152], za[:, 1152:], zb[:, 300:1152], zb[:, 1152:] = 0, 0, 0, 0
ref = gg.k_grouped_gemm_fp8_nt_ref(za, sa, zb, sb, [0, 1152, 2304])
out = torch.full(ref.shape, float("nan"))
gt.launch_k_grouped(za, sa, zb, sb, out, None, False, group_cols=1152, cols_used=used)
worst = max(worst, rel(out, ref))
out = torch.full(ref.shape, float("nan"))   # the promise broken: 3 blocks of group 0 read
gt.launch_k_grouped(a, sa, b, sb, out, None, False, group_cols=1152, cols_used=used)
part = gg.k_grouped_gemm_fp8_nt_ref(a, sa, b, sb, [0, 384, 1152])
assert torch.count_nonzero(out[1]) == 0
worst = max(worst, rel(out[0], part[0]))
print(f"worst {worst:.3e} planted {planted:.3e}")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the kernels natively")
def test_triton_kernels_interpreted_equal_the_twins():
    pytest.importorskip("triton")
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    res = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    line = res.stdout.strip().splitlines()[-1]
    worst, planted = float(line.split()[1]), float(line.split()[3])
    assert worst < 1e-6, line
    assert planted > 1e-2 or planted != planted, line   # the comparison can fail


# ---- the kernels on a GPU ------------------------------------------------------------------


def _gpu_m_case(bounds, k, n, fixed=False):
    dev = torch.device("cuda")
    groups = len(bounds) - 1
    a, sa = _fp8(bounds[-1], k, dev)
    w, ws = _weights(groups, n, k, dev)
    kw = {"group_rows": bounds[1]} if fixed else {"offsets": torch.tensor(bounds, device=dev)}
    # float32 out: the comparison measures the kernel's math, not bf16's rounding (~1.7e-3)
    out = torch.full((bounds[-1], n), float("nan"), device=dev, dtype=torch.float32)
    gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, out=out, out_dtype=torch.float32, **kw)
    ref = gg.m_grouped_gemm_fp8_nt_ref(a, sa, w, ws, offsets=bounds, out_dtype=torch.float32)
    bf16 = gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, **kw)
    assert _rel(bf16, ref) < 4e-3     # the same values rounded to bf16
    return out, ref, (a, sa, w, ws, kw)


@cuda
@pytest.mark.parametrize("groups", [1, 3, 8, 32, 64])
@pytest.mark.parametrize("k,n", [(2048, 7168), (7168, 4096), (384, 256)])
def test_gpu_m_grouped_equals_twin(groups, k, n):
    gen = torch.Generator().manual_seed(groups * k + n)
    sizes = torch.randint(0, 300, (groups,), generator=gen).tolist()
    sizes[0], sizes[-1] = 0, 1   # an empty and a one-row segment
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    out, ref, _ = _gpu_m_case(bounds, k, n)
    assert not out.isnan().any()
    assert _rel(out, ref) < 1e-3
    if groups > 1:
        out, ref, _ = _gpu_m_case([g * 130 for g in range(groups + 1)], k, n, fixed=True)
        assert _rel(out, ref) < 1e-3


@cuda
def test_gpu_m_grouped_planted_errors_fail():
    out, ref, (a, sa, w, ws, kw) = _gpu_m_case([0, 100, 300], 2048, 512)
    assert _rel(out, ref) < 1e-3
    bad = ws.clone()
    bad[1, 0, 3] *= 2
    f32 = {"out_dtype": torch.float32}
    assert _rel(gg.m_grouped_gemm_fp8_nt(a, sa, w, bad, **kw, **f32), ref) > 1e-3
    shifted = gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, offsets=torch.tensor([0, 101, 300],
                                                                          device="cuda"), **f32)
    assert _rel(shifted, ref) > 1e-3


@cuda
@pytest.mark.parametrize("groups", [1, 4, 32])
@pytest.mark.parametrize("m,n", [(4096, 7168), (7168, 2048), (256, 384), (192, 120)])
def test_gpu_k_grouped_equals_twin(groups, m, n):
    gen = torch.Generator().manual_seed(groups + m + n)
    sizes = (torch.randint(0, 4, (groups,), generator=gen) * 128).tolist()
    sizes[0] = 0
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    cols = max(bounds[-1], 128)
    a, sa = _fp8(m, cols, "cuda")
    b, sb = _fp8(n, cols, "cuda")
    dev_bounds = torch.tensor(bounds, device="cuda")
    out = gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, dev_bounds)
    ref = gg.k_grouped_gemm_fp8_nt_ref(a, sa, b, sb, bounds)
    for g in range(groups):
        if bounds[g + 1] == bounds[g]:
            assert torch.count_nonzero(out[g]) == 0
        else:
            assert _rel(out[g], ref[g]) < 1e-3
    base = torch.randn_like(out)
    acc = gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, dev_bounds, out=base.clone(), accumulate=True)
    assert _rel(acc - base, ref) < 1e-3 or bounds[-1] == 0
    fixed = gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, group_cols=128)
    fixed_ref = gg.k_grouped_gemm_fp8_nt_ref(a, sa, b, sb, list(range(0, cols + 1, 128)))
    assert _rel(fixed, fixed_ref) < 1e-3
    if m % 256 == 0:   # the two halves of M from one launch: the rows of the whole, bit for bit
        whole = gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, dev_bounds, out_dtype=torch.bfloat16)
        top, bottom = gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, dev_bounds, halves=True,
                                               out_dtype=torch.bfloat16)
        assert torch.equal(top, whole[:, :m // 2]) and torch.equal(bottom, whole[:, m // 2:])


@cuda
@pytest.mark.parametrize("m,n", [(200, 320), (64, 128), (7168, 2048)])
def test_gpu_k_grouped_edges_and_planted_errors(m, n):
    """Rows and columns not multiples of the tiles, [G, R, P] slabs, bf16 and accumulated
    outputs, NaN in, a one-block group beside long ones; a wrong scale or offset fails."""
    dev = torch.device("cuda")
    bounds = [0, 128, 128, 128 + 1280, 128 + 1280 + 256]
    a, sa = _fp8(m, bounds[-1], dev)
    b, sb = _fp8(n, bounds[-1], dev)
    offs = torch.tensor(bounds, device=dev)
    ref = gg.k_grouped_gemm_fp8_nt_ref(a, sa, b, sb, bounds)
    out = gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, offs)
    assert _rel(out, ref) < 1e-3 and torch.count_nonzero(out[1]) == 0
    assert _rel(gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, offs, out_dtype=torch.bfloat16),
                ref) < 4e-3
    base = torch.randn_like(out)
    acc = gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, offs, out=base.clone(), accumulate=True)
    assert _rel(acc - base, ref) < 1e-3
    # the same groups as [G, R, P] slabs (each group from column 0 of its slab)
    width = max(y - x for x, y in zip(bounds, bounds[1:]))
    def slabs(t, s):
        ts = torch.zeros(len(bounds) - 1, t.shape[0], width, dtype=t.dtype, device=dev)
        ss = torch.ones(len(bounds) - 1, width // 128, t.shape[0], device=dev)
        for g, (x, y) in enumerate(zip(bounds, bounds[1:])):
            ts[g, :, :y - x] = t[:, x:y]
            ss[g, :(y - x) // 128] = s[:, x // 128:y // 128].t()
        return ts, ss.transpose(1, 2)
    (a3, sa3), (b3, sb3) = slabs(a, sa), slabs(b, sb)
    widths = torch.tensor([0] + [y - x for x, y in zip(bounds, bounds[1:])], device=dev)
    out3 = gg.k_grouped_gemm_fp8_nt(a3, sa3, b3, sb3, widths.cumsum(0))
    assert _rel(out3, ref) < 1e-3
    bad = sb.clone()
    bad[n // 2, 3] *= 2                                  # one scale of group 2
    assert _rel(gg.k_grouped_gemm_fp8_nt(a, sa, b, bad, offs)[2], ref[2]) > 1e-3
    moved = torch.tensor([0, 128, 256, 128 + 1280, 128 + 1280 + 256], device=dev)
    assert _rel(gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, moved), ref) > 1e-3
    nan = sa.clone()
    nan[m - 1, 0] = float("nan")                         # group 0's last row
    got = gg.k_grouped_gemm_fp8_nt(a, nan, b, sb, offs)
    assert got[0, m - 1].isnan().all() and not got[0, :m - 1].isnan().any()
    assert not got[2:].isnan().any()


def _compile_gluon_sm90(fixed, accumulate, out_dtype):
    """The Gluon kernel compiled for sm_90 without a GPU (what a launch would build)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon import language as gl
    from triton.runtime.jit import mangle_type
    sys.path.insert(0, str(REPO / "tools"))
    import wgrad_gluon_trial as gk
    m, n, cols, groups = 256, 384, 4 * 128, 4
    a = torch.empty(m, cols, dtype=torch.float8_e4m3fn)
    b = torch.empty(n, cols, dtype=torch.float8_e4m3fn)
    sa, sb = torch.empty(cols // 128, m), torch.empty(cols // 128, n)
    args = dict(a_desc=gk._descriptor(a, (64, 128), gl.float8e4nv),
                b_desc=gk._descriptor(b, (128, 128), gl.float8e4nv),
                sa_desc=gk._descriptor(gk._flat(sa), (64,), gl.float32),
                sb_desc=gk._descriptor(gk._flat(sb), (128,), gl.float32),
                out_ptr=torch.empty(groups, m, n, dtype=out_dtype),
                coff_ptr=torch.zeros(groups + 1, dtype=torch.int32), M=m, N=n,
                n_groups=groups, group_cols=128, a_group_rows=0, b_group_rows=0, s_asg=0,
                s_asc=m, s_bsg=0, s_bsc=n, s_og=m * n, s_om=n, s_on=1)
    sig = {k: mangle_type(v) for k, v in args.items()}
    consts = dict(FIXED=fixed, A_CONCAT=True, B_CONCAT=True, ACCUMULATE=accumulate,
                  STAGES=gk.STAGES)
    fn = gk._k_grouped_ws_kernel
    sig.update({k: "constexpr" for k in consts})
    src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v
                                              for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


@pytest.mark.parametrize("fixed, accumulate, out_dtype", [
    (True, False, torch.float32), (False, True, torch.bfloat16)])
def test_gluon_kernel_compiles_for_sm90(fixed, accumulate, out_dtype):
    """CPU CI: the trial Gluon weight-gradient kernel (tools/wgrad_gluon_trial.py) still
    lowers to sm_90 PTX with its wgmmas and warp specialization on the installed Triton."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    try:
        kernel = _compile_gluon_sm90(fixed, accumulate, out_dtype)
    except (ImportError, AttributeError) as err:   # Triton's internal compile API moved
        pytest.skip(f"this Triton cannot compile Gluon offline: {err}")
    ptx = kernel.asm["ptx"]
    assert ptx.count("wgmma.mma_async") >= 2 and "setmaxnreg" in ptx
    assert kernel.metadata.num_warps == 12   # 2 consumer warpgroups + the producer's
