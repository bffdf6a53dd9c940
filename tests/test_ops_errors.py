"""Errors of the ops name what the caller passed, and packed rows are never misread.

An op built from other ops must check its own arguments: ``mxfp4_to_fp8(data, scales)`` with
K = 64 must speak of ``data``, not of the ``x`` of the ``quantize_fp8`` inside it. Packed
row widths that are multiples of 17 * 129 = 2193 bytes fit both MXFP4 rows (17 bytes per 32
elements) and FP8 rows (129 bytes per 128): handed to the wrong function they would decode
into the wrong shape, so such widths need ``k``.
"""

import pytest
import torch

from ds_fp4 import formats as F
from ds_fp4 import ops


def _u8(*shape):
    return torch.zeros(*shape, dtype=torch.uint8)


# ---- the argument the caller passed ----------------------------------------------------

@pytest.mark.parametrize("call, names", [
    # data [4, 32] is K = 64: not a multiple of 128
    (lambda: ops.mxfp4_to_fp8(_u8(4, 32), _u8(4, 2)), "data: K (2 * its last dimension) = 64"),
    (lambda: ops.mxfp4_rows_to_fp8(_u8(4, 34)), "rows: K (from its width 34"),
    (lambda: ops.mxfp4_rows_to_fp8(_u8(2, 4, 68)), "rows must be 2-D"),
    (lambda: ops.mxfp4_to_fp8_colwise(_u8(4, 32), _u8(4, 2), [0, 4]), "data: K (2 * its"),
])
def test_errors_name_the_callers_argument(call, names):
    with pytest.raises(ValueError) as err:
        call()
    message = str(err.value)
    assert message.startswith(names), message
    assert not message.startswith("x"), message   # the inner quantize_fp8's argument


# ---- widths that fit both packed formats -----------------------------------------------

AMBIGUOUS = 2193            # MXFP4 rows of K = 4128, or FP8 rows of K = 2176


def test_both_readings_of_an_ambiguous_width():
    assert F.mxfp4_row_bytes(4128) == AMBIGUOUS == F.fp8_row_bytes(2176)


def test_fp8_rows_passed_to_the_mxfp4_decoder_raise():
    rows = ops.quantize_fp8_rows(torch.randn(3, 2176))
    assert rows.shape == (3, AMBIGUOUS)
    with pytest.raises(ValueError, match=r"fits two formats: MXFP4 rows of K = 4128 or FP8 "
                                         r"rows of K = 2176.*Pass k=4128"):
        ops.dequantize_mxfp4_rows(rows)
    with pytest.raises(ValueError, match="not k = 2176"):       # the FP8 K, told to MXFP4
        ops.dequantize_mxfp4_rows(rows, k=2176)
    with pytest.raises(ValueError, match="fits two formats"):
        ops.split_mxfp4_rows(rows)


def test_mxfp4_rows_passed_to_the_fp8_decoder_raise():
    rows = ops.quantize_mxfp4_rows(torch.randn(3, 4128))
    assert rows.shape == (3, AMBIGUOUS)
    with pytest.raises(ValueError, match=r"FP8 rows of K = 2176 or MXFP4 rows of K = 4128.*"
                                         r"Pass k=2176"):
        ops.dequantize_fp8_rows(rows)
    with pytest.raises(ValueError, match="not k = 4128"):
        ops.dequantize_fp8_rows(rows, k=4128)
    with pytest.raises(ValueError, match="fits two formats"):
        ops.split_fp8_rows(rows)


def test_an_ambiguous_width_decodes_with_its_k():
    x = torch.randn(3, 4128)
    mx = ops.quantize_mxfp4_rows(x)
    assert torch.equal(ops.dequantize_mxfp4_rows(mx, torch.float32, k=4128),
                       ops.dequantize_mxfp4(*ops.quantize_mxfp4(x), torch.float32))
    y = torch.randn(3, 2176)
    fp8 = ops.quantize_fp8_rows(y)
    assert torch.equal(ops.dequantize_fp8_rows(fp8, torch.float32, k=2176),
                       ops.dequantize_fp8(*ops.quantize_fp8(y), torch.float32))


def test_rows_to_fp8_needs_k_where_both_formats_fit():
    # 8772 bytes = 4 * 2193: MXFP4 rows of K = 16512 (a multiple of 128) or FP8 rows of 8704
    x = torch.randn(2, 16512)
    rows = ops.quantize_mxfp4_rows(x)
    with pytest.raises(ValueError, match="fits two formats"):
        ops.mxfp4_rows_to_fp8(rows)
    got = ops.mxfp4_rows_to_fp8(rows, k=16512)
    want = ops.mxfp4_to_fp8(*ops.quantize_mxfp4(x))
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


def test_a_width_of_one_format_needs_no_k():
    x = torch.randn(2, 256)
    assert ops.dequantize_mxfp4_rows(ops.quantize_mxfp4_rows(x)).shape == (2, 256)
    assert ops.dequantize_fp8_rows(ops.quantize_fp8_rows(x)).shape == (2, 256)
    with pytest.raises(ValueError, match="not k = 128"):       # a wrong k is still caught
        ops.dequantize_fp8_rows(ops.quantize_fp8_rows(x), k=128)


def test_the_layer_wires_pass_their_hidden_size():
    """FP4MoE's wire unpacking at a hidden size whose FP8 rows are 2193 bytes wide."""
    from ds_fp4.config import Format
    from ds_fp4.moe.alltoall import pack_rows, unpack_rows
    x = torch.randn(2, 3, 2176)
    rows = pack_rows(x, Format.FP8)
    assert rows.shape[-1] == AMBIGUOUS
    out = unpack_rows(rows, Format.FP8, torch.float32, 2176)
    assert out.shape == x.shape


def test_the_layer_cache_passes_its_hidden_size():
    """An FP8 cache of a hidden-2176 layer keeps 2193-byte rows and decodes them for backward."""
    from ds_fp4.moe import to_fp4
    from tests.dist_utils import cpu_env, forward_backward, make_moe, mlp_expert
    cpu_env()
    hidden = 2176
    layer = to_fp4(make_moe(hidden=hidden, num_experts=2, ep_size=1, k=1, parallel=False,
                            expert=mlp_expert(hidden, 128)),
                   dict(cache="fp8", fp8_experts=False))
    x = torch.randn(2, 8, hidden)
    out, _, dx, grads = forward_backward(layer, x, seed=0)
    assert layer.deepspeed_moe.cached_views > 0              # the cache took the inputs
    assert out.shape == x.shape and torch.isfinite(dx).all() and grads


# ---- a row index -------------------------------------------------------------------------

@pytest.mark.parametrize("index, error, names", [
    (torch.zeros(3, dtype=torch.int32), TypeError, "index must have dtype int64"),
    (torch.zeros(3, 1, dtype=torch.int64), ValueError, "index must be 1-D"),
])
def test_a_bad_row_index_is_named(index, error, names):
    with pytest.raises(error, match=names):
        ops.quantize_fp8_rows(torch.zeros(4, 128), index=index)


def test_a_row_index_outside_the_rows_reads_zeros():
    x = torch.arange(1, 3 * 128 + 1, dtype=torch.float32).view(3, 128)
    rows = ops.quantize_fp8_rows(x, index=torch.tensor([2, -1, 3, 0]))
    back = ops.dequantize_fp8_rows(rows, torch.float32, 128)
    want = ops.dequantize_fp8_rows(ops.quantize_fp8_rows(x), torch.float32, 128)
    assert torch.equal(back[0], want[2]) and torch.equal(back[3], want[0])
    assert not back[1].any() and not back[2].any()
