"""MXFP4 -> FP8 conversions: the composition identity, its exactness bound, column-wise."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_fp4 import ops


def fp8_bytes(pair):
    data, scales = pair
    return data.view(torch.uint8), scales.nan_to_num(-1.0)


def assert_same_fp8(a, b):
    for x, y in zip(fp8_bytes(a), fp8_bytes(b)):
        assert torch.equal(x, y)


def random_mxfp4(rows, k, spread=20, seed=0):
    """Random MXFP4 codes with block scale bytes spread over ``spread`` powers of two."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(127 - spread, 128, (rows, k // 32), generator=g, dtype=torch.int32)
    return data, scales.to(torch.uint8)


def group_of_blocks(scale_bytes, codes):
    """One 128-element row: block i holds ``codes`` (a list of 32 codes) at scale ``scale_bytes[i]``."""
    c = torch.tensor(codes, dtype=torch.uint8)
    data = (c[0::2] | (c[1::2] << 4)).repeat(4).reshape(1, 64)
    return data, torch.tensor([scale_bytes], dtype=torch.uint8)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.sampled_from([128, 256, 640]), st.integers(0, 30), st.integers(0, 10**6))
def test_composition_identity_through_bf16(rows, k, spread, seed):
    data, scales = random_mxfp4(rows, k, spread, seed)
    expected = ops.quantize_fp8(ops.dequantize_mxfp4(data, scales))        # bf16 in between
    assert_same_fp8(ops.mxfp4_to_fp8(data, scales), expected)


@pytest.mark.parametrize("spread", [0, 1, 7, 13, 14])
def test_exact_while_block_scales_spread_at_most_14(spread):
    codes = list(range(16)) * 2
    data, scales = group_of_blocks([140, 140 - spread, 140 - spread // 2, 140], codes)
    mx = ops.dequantize_mxfp4(data, scales, torch.float32)
    assert torch.equal(ops.dequantize_fp8(*ops.mxfp4_to_fp8(data, scales), torch.float32), mx)


def test_spread_of_15_rounds_onto_the_subnormal_grid():
    # block 0 pins the group (6 * 2^13 -> FP8 scale 2^7); block 1 sits 15 powers lower:
    # 0.5 * 2^-2 / 2^7 = 2^-10, a tie between 0 and 2^-9 -> 0 (even);
    # 1.5 * 2^-2 / 2^7 = 1.5 * 2^-9, a tie between 2^-9 (odd) and 2^-8 (even) -> 2^-8.
    codes_big = [7] + [0] * 31
    c = torch.tensor(codes_big + [1, 3, 9, 11] + [0] * 28 + [0] * 64, dtype=torch.uint8)
    data = (c[0::2] | (c[1::2] << 4)).reshape(1, 64)
    scales = torch.tensor([[140, 125, 0, 0]], dtype=torch.uint8)
    fp8, fscale = ops.mxfp4_to_fp8(data, scales)
    assert fscale.item() == 2.0 ** 7
    assert fp8.float()[0, 32:36].tolist() == [0.0, 2 ** -8, -0.0, -(2 ** -8)]
    assert math.copysign(1, fp8.float()[0, 34].item()) == -1


@pytest.mark.parametrize("spread", [15, 16, 20, 40])
def test_large_spreads_follow_the_composition(spread):
    codes = list(range(16)) * 2
    data, scales = group_of_blocks([200, 200 - spread, 200 - spread // 2, 199], codes)
    assert_same_fp8(ops.mxfp4_to_fp8(data, scales),
                    ops.quantize_fp8(ops.dequantize_mxfp4(data, scales, torch.float32)))


def test_zeros_keep_sign_and_nan_block_makes_a_nan_group():
    data = torch.zeros(2, 128, dtype=torch.uint8)
    data[0, 3] = 0x80                                 # element 7 is -0.0
    scales = torch.full((2, 8), 100, dtype=torch.uint8)
    scales[1, 5] = 255
    fp8, fscale = ops.mxfp4_to_fp8(data, scales)
    assert fp8.view(torch.uint8)[0, 7].item() == 0x80 and fp8.view(torch.uint8)[0, 6].item() == 0
    assert fscale[0].tolist() == [1.0, 1.0]
    assert math.isnan(fscale[1, 1].item()) and fscale[1, 0].item() == 1.0
    assert (fp8.view(torch.uint8)[1, 128:] == 0x7F).all()


def test_values_beyond_float32_make_a_nan_group():
    data = torch.full((1, 64), 0x66, dtype=torch.uint8)       # code 6 = 4.0 everywhere
    scales = torch.tensor([[254, 100, 100, 100]], dtype=torch.uint8)   # 4 * 2^127 = 2^129
    assert math.isnan(ops.mxfp4_to_fp8(data, scales)[1].item())


def test_packed_rows_convert_like_the_pair():
    data, scales = random_mxfp4(9, 256)
    rows = torch.cat((data, scales), dim=1)
    assert_same_fp8(ops.mxfp4_rows_to_fp8(rows), ops.mxfp4_to_fp8(data, scales))


# ---- column-wise ---------------------------------------------------------------------------

def colwise_by_segments(data, scales, lengths):
    """The contract's formula, one segment at a time."""
    x = ops.dequantize_mxfp4(data, scales, torch.float32)
    parts, start = [], 0
    for n in lengths:
        padded = torch.zeros(-(-n // 128) * 128, x.shape[1])
        padded[:n] = x[start:start + n]
        parts.append(ops.quantize_fp8(padded.t()))
        start += n
    return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)


@pytest.mark.parametrize("lengths", [
    [0], [1], [127], [128], [129], [0, 129, 0, 1, 127, 128, 0], [300, 5], [0, 0],
])
def test_colwise_equals_per_segment_formula(lengths):
    data, scales = random_mxfp4(sum(lengths), 256, spread=16, seed=sum(lengths))
    offsets = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    out_data, out_scales = ops.mxfp4_to_fp8_colwise(data, scales, offsets)
    total = sum(-(-n // 128) * 128 for n in lengths)
    assert out_data.shape == (256, total) and out_scales.shape == (256, total // 128)
    assert out_scales.stride() == (1, 256)
    assert_same_fp8((out_data, out_scales), colwise_by_segments(data, scales, lengths))


def test_colwise_padding_is_zero_and_groups_stay_in_their_segment():
    data, scales = random_mxfp4(130, 128, spread=0)
    offsets = torch.tensor([0, 1, 130], dtype=torch.int32)
    out, out_scales = ops.mxfp4_to_fp8_colwise(data, scales, offsets)
    assert out.shape == (128, 128 + 256)
    assert (out.float()[:, 1:128] == 0).all()                  # padding of segment 0
    assert (out.float()[:, 128 + 129:] == 0).all()             # padding of segment 1
    assert (out.float()[:, 128:128 + 129].abs().amax(0) > 0).all()


@pytest.mark.parametrize("offsets, match", [
    ([0, 5, 3, 8], "non-decreasing"),
    ([0, 4], "end at T"),
    ([1, 8], "start at 0"),
])
def test_colwise_rejects_bad_offsets(offsets, match):
    data, scales = random_mxfp4(8, 128)
    with pytest.raises(ValueError, match=match):
        ops.mxfp4_to_fp8_colwise(data, scales, torch.tensor(offsets, dtype=torch.int32))


def test_colwise_takes_host_offsets_as_a_list():
    data, scales = random_mxfp4(300, 256)
    as_tensor = ops.mxfp4_to_fp8_colwise(data, scales, torch.tensor([0, 7, 7, 300]))
    assert_same_fp8(ops.mxfp4_to_fp8_colwise(data, scales, [0, 7, 7, 300]), as_tensor)
    with pytest.raises(TypeError, match="Python ints"):
        ops.mxfp4_to_fp8_colwise(data, scales, [0, 7.0, 300])
    with pytest.raises(ValueError, match="at least one"):
        ops.mxfp4_to_fp8_colwise(data[:0], scales[:0], [])


def test_colwise_rejects_float_offsets_and_bad_k():
    data, scales = random_mxfp4(8, 128)
    with pytest.raises(TypeError, match="offsets"):
        ops.mxfp4_to_fp8_colwise(data, scales, torch.tensor([0.0, 8.0]))
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.mxfp4_to_fp8_colwise(data[:, :16], scales[:, :1], torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.mxfp4_to_fp8(data[:, :16], scales[:, :1])
