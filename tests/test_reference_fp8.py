"""The FP8 E4M3 1x128 rules of FORMATS.md, checked on the reference ops against oracles."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_fp4 import ops
from tests import oracles


def group_with(values, amax=448.0):
    """One [1, 128] fp32 row: ``values`` then zeros, with ``amax`` last (pins the scale to 1)."""
    row = torch.zeros(1, 128)
    row[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    row[0, -1] = amax
    return row


def test_every_e4m3_code_matches_its_bit_fields():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float().tolist()
    for code, v in enumerate(values):
        expected = oracles.e4m3_value(code)
        assert (math.isnan(v) and math.isnan(expected)) or v == expected, hex(code)


def test_every_midpoint_between_e4m3_codes_rounds_to_even():
    grid = oracles.E4M3_POSITIVE
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    for chunk in range(0, len(mids), 120):
        part = mids[chunk: chunk + 120]
        data, scales = ops.quantize_fp8(group_with(part + [-m for m in part[:7]]))
        assert scales.item() == 1.0
        got = data.float()[0].tolist()
        for v, q in zip(part, got):
            assert q == oracles.e4m3_round(v), v
        assert got[len(part)] == -oracles.e4m3_round(part[0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-3e4, 3e4, width=32), min_size=128, max_size=128),
       st.integers(-40, 40))
def test_scale_and_elements_match_the_oracle(values, shift):
    x = torch.tensor(values, dtype=torch.float32).reshape(1, 128) * 2.0 ** shift
    data, scales = ops.quantize_fp8(x)
    xs = x[0].tolist()
    e = oracles.fp8_exponent(max(abs(v) for v in xs))
    assert scales.item() == 2.0 ** e
    for v, q in zip(xs, data.float()[0].tolist()):
        expected = math.copysign(oracles.e4m3_round(v / 2.0 ** e), v)
        assert q == expected and math.copysign(1, q) == math.copysign(1, expected), (v, q)


def test_subnormal_range_and_signed_zero():
    # scale 1: 2^-9 is the smallest subnormal; 2^-10 ties to 0; 3 * 2^-10 ties to 2^-8
    x = group_with([2 ** -9, 2 ** -10, 3 * 2 ** -10, 2 ** -10 * 1.01, -0.0, -2 ** -11])
    data, _ = ops.quantize_fp8(x)
    out = data.float()[0, :6].tolist()
    assert out[:4] == [2 ** -9, 0.0, 2 ** -8, 2 ** -9]
    assert out[4] == 0 and math.copysign(1, out[4]) == -1 and math.copysign(1, out[5]) == -1


def test_all_zero_group_has_scale_one_and_scales_are_powers_of_two():
    x = torch.randn(4, 384) * 1000
    x[2, 128:256] = 0
    data, scales = ops.quantize_fp8(x)
    assert scales[2, 1].item() == 1.0
    mant, _ = torch.frexp(scales)
    assert (mant == 0.5).all()
    assert (data.float().abs().amax(-1) <= 448).all()


def test_scale_exponent_clamps():
    tiny = torch.full((1, 128), float.fromhex("0x1p-130"))      # would want e = -138
    data, scales = ops.quantize_fp8(tiny)
    assert scales.item() == 2.0 ** -126 and data.float().max().item() == 2.0 ** -4


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_or_inf_group_is_nan_everywhere(bad):
    x = torch.randn(2, 256)
    x[1, 200] = bad
    data, scales = ops.quantize_fp8(x)
    assert math.isnan(scales[1, 1].item()) and not torch.isnan(scales[1, 0])
    assert (data[1, 128:].view(torch.uint8) == 0x7F).all()
    out = ops.dequantize_fp8(data, scales, torch.float32)
    assert torch.isnan(out[1, 128:]).all() and torch.isfinite(out[1, :128]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m, k", [(1, 128), (3, 256), (129, 7168), (0, 128)])
def test_layout_and_round_trip(dtype, m, k):
    x = torch.randn(m, k).to(dtype)
    data, scales = ops.quantize_fp8(x)
    assert data.dtype == torch.float8_e4m3fn and data.shape == (m, k)
    assert scales.shape == (m, k // 128) and scales.stride() == (1, max(m, 1))
    assert scales.t().is_contiguous()
    y = ops.dequantize_fp8(data, scales, torch.float32)
    if m:   # E4M3 keeps 4 significant bits: relative error near 2^-5
        assert (y - x.float()).norm() < 0.05 * x.float().norm()
    assert torch.equal(ops.dequantize_fp8(*ops.quantize_fp8(y), torch.float32), y)


def test_non_contiguous_input_equals_its_contiguous_copy():
    view = torch.randn(256, 300, dtype=torch.bfloat16).t()[:, :128]
    a, b = ops.quantize_fp8(view), ops.quantize_fp8(view.contiguous())
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def test_rows_carry_e8m0_scale_bytes():
    x = torch.randn(3, 256)
    x[0, :128] *= 2.0 ** 30
    x[2, 130] = math.nan
    data, scales = ops.quantize_fp8(x)
    rows = ops.quantize_fp8_rows(x)
    assert rows.shape == (3, 258)
    assert torch.equal(rows[:, :256], data.view(torch.uint8))
    expected = torch.log2(scales).nan_to_num(nan=128.0) + 127
    assert rows[:, 256:].tolist() == expected.to(torch.uint8).tolist()
    d, s = ops.split_fp8_rows(rows)
    assert torch.equal(d.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(s.nan_to_num(7.0), scales.nan_to_num(7.0)) and s.stride() == (1, 3)


@pytest.mark.parametrize("call, match", [
    (lambda: ops.quantize_fp8(torch.randn(4, 96)), "multiple of 128"),
    (lambda: ops.quantize_fp8(torch.randn(2, 4, 128)), "2-D"),
    (lambda: ops.quantize_fp8(torch.randn(4, 128).to(torch.float8_e4m3fn)), "dtype"),
    (lambda: ops.dequantize_fp8(torch.zeros(4, 128, dtype=torch.uint8), torch.ones(4, 1)), "float8"),
    (lambda: ops.dequantize_fp8(torch.zeros(4, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 4)), r"\[M, K/128\]"),
    (lambda: ops.dequantize_fp8(torch.zeros(4, 128, dtype=torch.float8_e4m3fn),
                                torch.ones(4, 1, dtype=torch.float64)), "float32"),
    (lambda: ops.split_fp8_rows(torch.zeros(4, 128, dtype=torch.uint8)), "multiple of 129"),
])
def test_bad_input_is_rejected_with_a_clear_error(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
