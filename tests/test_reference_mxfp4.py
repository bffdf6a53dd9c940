"""The MXFP4 rules of FORMATS.md, checked on the reference ops against scalar oracles."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_fp4 import ops
from tests import oracles

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def block_with(values, fill_max=6.0):
    """A 32-element fp32 block: ``values`` then zeros, with ``fill_max`` last (pins e = 0)."""
    block = torch.zeros(32)
    block[: len(values)] = torch.tensor(values)
    block[-1] = fill_max
    return block


def decode(data, scales):
    return ops.dequantize_mxfp4(data, scales, torch.float32)


# ---- codes, table and rounding -----------------------------------------------------------

def test_every_e2m1_code_decodes_to_its_table_value():
    codes = torch.arange(16, dtype=torch.uint8)
    data = (codes[0::2] | (codes[1::2] << 4)).repeat(2)          # 32 elements
    out = decode(data, torch.tensor([127], dtype=torch.uint8))[:16]
    expected = oracles.E2M1_GRID + [-v for v in oracles.E2M1_GRID]
    assert out.tolist() == expected
    assert torch.signbit(out[8]) and out[8] == 0                   # code 8 is -0.0


@pytest.mark.parametrize("value, expected", [
    (0.25, 0.0),    # tie to even: code 0
    (0.2500001, 0.5),
    (0.75, 1.0),    # tie to even: code 2
    (1.25, 1.0),    # tie to even: code 2
    (1.75, 2.0),    # tie to even: code 4
    (2.5, 2.0),     # tie to even: code 4
    (3.5, 4.0),     # tie to even: code 6
    (5.0, 4.0),     # tie to even: code 6
    (5.0000005, 6.0),
    (2.9, 3.0), (0.6, 0.5), (1.1, 1.0),
])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e2m1_rounding_table(value, expected, sign):
    data, scales = ops.quantize_mxfp4(block_with([sign * value]))
    assert scales.item() == 127
    assert decode(data, scales)[0].item() == sign * expected


def test_negative_values_that_round_to_zero_keep_the_sign():
    data, scales = ops.quantize_mxfp4(block_with([-0.0, -0.1, 0.0, 0.1]))
    assert data[0].item() == 0x88 and data[1].item() == 0x00


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, width=32), min_size=32, max_size=32),
       st.sampled_from(["rceil", "floor"]))
def test_block_scale_and_elements_match_the_oracle(values, rounding):
    x = torch.tensor(values, dtype=torch.float32)
    data, scales = ops.quantize_mxfp4(x, rounding)
    amax = max(abs(v) for v in values)
    e = (oracles.rceil_exponent if rounding == "rceil" else oracles.floor_exponent)(amax)
    assert scales.item() == e + 127
    got = decode(data, scales).tolist()
    for v, q in zip(values, got):
        expected = math.copysign(oracles.e2m1_round(v / 2.0 ** e), v) * 2.0 ** e
        assert q == expected and math.copysign(1, q) == math.copysign(1, expected), (v, q)


def test_rceil_never_clips_and_floor_saturates():
    x = block_with([7.0], fill_max=7.0)           # amax 7: rceil e = 1, floor e = 0
    assert ops.quantize_mxfp4(x, "rceil")[1].item() == 128
    data, scales = ops.quantize_mxfp4(x, "floor")
    assert scales.item() == 127 and decode(data, scales)[0].item() == 6.0


def test_rceil_boundary_is_exactly_six_times_a_power_of_two():
    at = block_with([], fill_max=6.0 * 2 ** 5)
    above = block_with([], fill_max=float(torch.nextafter(torch.tensor(6.0 * 2 ** 5), torch.tensor(1e9))))
    assert ops.quantize_mxfp4(at)[1].item() == 127 + 5
    assert ops.quantize_mxfp4(above)[1].item() == 127 + 6


def test_exponent_clamps_at_both_ends():
    tiny = block_with([], fill_max=float.fromhex("0x1p-149"))      # smallest fp32 subnormal
    assert ops.quantize_mxfp4(tiny)[1].item() == 0
    huge = block_with([], fill_max=3.0e38)
    b = ops.quantize_mxfp4(huge)[1].item()
    assert b == oracles.rceil_exponent(3.0e38) + 127 and b <= 254


# ---- zeros, NaN, Inf -----------------------------------------------------------------------

def test_all_zero_block_has_scale_byte_zero():
    x = torch.zeros(64)
    x[33] = -0.0
    x[40] = 1.0
    data, scales = ops.quantize_mxfp4(x)
    assert scales[0].item() == 0 and int(data[:16].sum()) == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_or_inf_block_becomes_nan_and_neighbours_are_untouched(bad):
    x = torch.randn(3, 64)
    ref_data, ref_scales = ops.quantize_mxfp4(x)
    x[1, 37] = bad
    data, scales = ops.quantize_mxfp4(x)
    assert scales[1, 1].item() == 255 and int(data[1, 16:].sum()) == 0
    out = decode(data, scales)
    assert torch.isnan(out[1, 32:]).all() and torch.isfinite(out[1, :32]).all()
    mask = torch.ones_like(scales, dtype=torch.bool)
    mask[1, 1] = False
    assert torch.equal(scales[mask], ref_scales[mask])


# ---- dtypes, shapes, strides, round trip -----------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(32,), (3, 64), (2, 5, 128), (0, 32), (1, 7168)])
def test_round_trip_is_stable(dtype, shape):
    x = (torch.randn(shape) * 3).to(dtype)
    data, scales = ops.quantize_mxfp4(x)
    assert data.shape == shape[:-1] + (shape[-1] // 2,) and scales.shape == shape[:-1] + (shape[-1] // 32,)
    y = ops.dequantize_mxfp4(data, scales, dtype)
    again = ops.dequantize_mxfp4(*ops.quantize_mxfp4(y), dtype)
    assert torch.equal(y, again)
    if x.numel():   # MXFP4 keeps about 2 significant bits: relative error well under 25%
        assert (y.float() - x.float()).norm() < 0.25 * x.float().norm()


def test_non_contiguous_input_equals_its_contiguous_copy():
    base = torch.randn(64, 96, dtype=torch.bfloat16)
    view = base.t()[:, ::2]                               # [96, 32], strided both ways
    assert not view.is_contiguous()
    for a, b in zip(ops.quantize_mxfp4(view), ops.quantize_mxfp4(view.contiguous())):
        assert torch.equal(a, b)


def test_rows_pack_data_then_scales():
    x = torch.randn(5, 128)
    data, scales = ops.quantize_mxfp4(x)
    rows = ops.quantize_mxfp4_rows(x)
    assert rows.shape == (5, 64 + 4)
    assert torch.equal(rows[:, :64], data) and torch.equal(rows[:, 64:], scales)
    d, s = ops.split_mxfp4_rows(rows)
    assert d.data_ptr() == rows.data_ptr()                 # views, no copy
    assert torch.equal(ops.dequantize_mxfp4_rows(rows), ops.dequantize_mxfp4(data, scales))


# ---- bad input ---------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: ops.quantize_mxfp4(torch.randn(4, 48)), "multiple of 32"),
    (lambda: ops.quantize_mxfp4(torch.randn(4, 32).double()), "dtype"),
    (lambda: ops.quantize_mxfp4(torch.randn(4, 32), "nearest"), "rounding"),
    (lambda: ops.quantize_mxfp4(torch.randn(4, 32).numpy()), "torch.Tensor"),
    (lambda: ops.dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.int8),
                                  torch.zeros(4, 1, dtype=torch.uint8)), "data must have dtype uint8"),
    (lambda: ops.dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8),
                                  torch.zeros(4, 2, dtype=torch.uint8)), "do not match"),
    (lambda: ops.dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8),
                                  torch.zeros(3, 1, dtype=torch.uint8)), "do not match"),
    (lambda: ops.dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8),
                                  torch.zeros(4, 1, dtype=torch.uint8, device="meta")), "one device"),
    (lambda: ops.dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8),
                                  torch.zeros(4, 1, dtype=torch.uint8), torch.int32), "dtype must be"),
    (lambda: ops.split_mxfp4_rows(torch.zeros(4, 18, dtype=torch.uint8)), "multiple of 17"),
])
def test_bad_input_is_rejected_with_a_clear_error(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
