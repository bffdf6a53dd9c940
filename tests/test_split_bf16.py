"""ds_fp4.ops.split_bf16: float32 -> three bfloat16 parts per element, laid out by a pattern.

- CPU: the twin against its definition (the parts' sum is the input; each is the cast of
  ``split3``'s float32 part), over wide exponents, subnormals, zeros, NaN and Inf.
- CPU, g++: split_bf16.cu under the host emulation, byte for byte against the twin; planted
  kernel bugs fail.
- GPU: the CUDA kernel against the twin, at the gate's shapes.
"""

import math

import pytest
import torch

from ds_fp4 import ops
from ds_fp4.ops.split_bf16 import split3, split_bf16, split_bf16_ref
from tests.kernel_emu import loader

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LAYOUTS = [((0, 1, 2), 0), ((0, 1, 0, 2, 1, 0), 0), ((0, 1, 2), 1), ((0, 0, 1, 0, 1, 2), 1),
           ((2,), 0)]


def _floats(rows, cols, seed=0, subnormals=False):
    """float32 over a wide exponent range, both signs, with zeros, NaN, Inf; with
    ``subnormals`` also float32 subnormals with all 23 bits (whose bf16 casts depend on the
    machine: see ``test_emulated_subnormals_round_to_nearest_even``)."""
    gen = torch.Generator().manual_seed(seed)
    n = rows * cols
    mant = torch.rand(n, generator=gen) + 0.5
    expo = torch.randint(-60, 60, (n,), generator=gen).float()
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    t = sign * mant * torch.exp2(expo)
    t[::97] = 0.0
    if subnormals:
        bits = torch.randint(1, 2**23, (len(t[1::50]),), generator=gen, dtype=torch.int32)
        t[1::50] = bits.view(torch.float32)
    t[5], t[6], t[7] = math.nan, math.inf, -math.inf
    return t.view(rows, cols)


def _same(a, b, nan_bits=True):
    """Byte for byte; ``nan_bits`` False: NaN where NaN, any NaN bits (torch's CPU cast
    and CUDA's write different ones)."""
    assert a.shape == b.shape and a.dtype == b.dtype == torch.bfloat16
    a, b = a.cpu(), b.cpu()
    if not nan_bits:
        assert torch.equal(a.isnan(), b.isnan()) and a.isnan().any()
        a, b = a.masked_fill(a.isnan(), 0), b.masked_fill(b.isnan(), 0)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), \
        f"{(a.view(torch.int16) != b.view(torch.int16)).sum()} elements differ"


@pytest.mark.parametrize("pattern, dim", LAYOUTS)
def test_twin_is_the_cast_parts_side_by_side(pattern, dim):
    x = _floats(12, 40, subnormals=True)
    got = split_bf16_ref(x, pattern, dim)
    parts = split3(x)
    want = torch.cat([parts[p].to(torch.bfloat16) for p in pattern], dim)
    _same(got, want)
    normal = (x.abs() >= torch.finfo(torch.float32).tiny) & x.isfinite()
    full = split_bf16_ref(x, (0, 1, 2), 0).float().view(3, 12, 40)
    assert torch.equal(full.sum(0)[normal], x[normal])   # exact but for subnormals, NaN, Inf


# ---- the kernel under the host emulation ---------------------------------------------------


host_kernels, emulated = loader.op_fixtures("split_bf16")


@pytest.mark.parametrize("pattern, dim", LAYOUTS)
def test_emulated_kernel_equals_twin(emulated, pattern, dim):
    x = _floats(33, 70, seed=len(pattern))
    got = split_bf16(x, pattern, dim)
    assert emulated == ["split_bf16"]
    _same(got, split_bf16_ref(x, pattern, dim), nan_bits=False)
    assert (got.view(torch.int16)[got.isnan()] == 0x7FFF).all()     # CUDA's cast's NaN


def _bf16_rne_bits(v):
    """float32 -> bfloat16 bits by the definition (round half to even on the bits), NaN
    0x7FFF; Python integers, no machine's cast."""
    if math.isnan(v):
        return 0x7FFF
    b = torch.tensor([v], dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def test_emulated_subnormals_round_to_nearest_even(emulated):
    """Parts of float32 subnormals are rounded to bf16 by the definition (not flushed). The
    twin is not the reference there: torch's casts differ by machine (its CUDA cast flushed
    them on the H200; its CPU cast there gave other bytes than on a CI machine)."""
    x = _floats(9, 50, seed=4, subnormals=True)
    got = split_bf16(x, (0, 1, 2), 0).view(torch.int16).view(3, 9, 50)
    parts = split3(x)
    sub = (x != 0) & (x.abs() < torch.finfo(torch.float32).tiny)
    assert sub.sum() >= 9
    for r, c in sub.nonzero().tolist():
        for p in range(3):
            assert got[p, r, c].item() & 0xFFFF == _bf16_rne_bits(parts[p][r, c].item())


def test_emulated_empty_and_strided(emulated):
    assert split_bf16(torch.empty(0, 8), (0, 1), 1).shape == (0, 16)
    x = _floats(8, 16).t()                     # not contiguous: the twin
    _same(split_bf16(x, (0, 1, 2), 0), split_bf16_ref(x, (0, 1, 2), 0))
    assert emulated == []


@pytest.mark.parametrize("plant", [("f2u(v) & 0xFFFF0000u", "f2u(v) & 0xFFFE0000u"),
                                   ("fadd_rn(rest, -t1)", "fadd_rn(rest, t1)"),
                                   ("+ p * cols + c", "+ c")])
def test_a_planted_kernel_bug_fails(host_kernels, monkeypatch, plant):
    """The comparison can fail: a part one bit short, the last part's sign, the
    side-by-side layout."""
    loader.redirect(monkeypatch, loader.planted(*plant))
    x = _floats(16, 64, seed=3)
    got = split_bf16(x, (0, 0, 1, 0, 1, 2), 1)      # builds the planted text (asserts it)
    with pytest.raises(AssertionError):
        _same(got, split_bf16_ref(x, (0, 0, 1, 0, 1, 2), 1), nan_bits=False)


@pytest.mark.parametrize("change, error, names", [
    (dict(x=torch.zeros(4, 4, dtype=torch.bfloat16)), TypeError, "x"),
    (dict(x=torch.zeros(4)), ValueError, "x"),
    (dict(pattern=(0, 3)), ValueError, "pattern"),
    (dict(pattern=[0, 1]), ValueError, "pattern"),
    (dict(pattern=()), ValueError, "pattern"),
    (dict(dim=2), ValueError, "dim"),
])
@pytest.mark.parametrize("fn", [split_bf16, split_bf16_ref])
def test_bad_arguments_are_named(fn, change, error, names):
    args = dict(x=torch.zeros(4, 4), pattern=(0, 1, 2), dim=0)
    args.update(change)
    with pytest.raises(error, match=names):
        fn(**args)


@needs_cuda
@pytest.mark.parametrize("pattern, dim", LAYOUTS)
@pytest.mark.parametrize("rows, cols", [(32, 7168), (8192, 32), (7, 13)])
def test_cuda_kernel_equals_twin(rows, cols, pattern, dim):
    """The twin's bytes (on the CPU; NaN as 0x7FFF, CUDA's cast's NaN), for inputs without
    float32 subnormals, whose casts differ by machine (torch's CUDA cast flushed them on the
    H200)."""
    x = _floats(rows, cols, seed=rows)
    with ops.kernels("cuda"):
        got = split_bf16(x.cuda(), pattern, dim)
    _same(got, split_bf16_ref(x, pattern, dim), nan_bits=False)
    assert (got.view(torch.int16)[got.isnan()] == 0x7FFF).all()
