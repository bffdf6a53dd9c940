"""Packed row layouts (FORMATS.md "Wire/cache packing") and E8M0 scale bytes.

One packed row holds a token's data bytes followed by its scale bytes, so one buffer and
one collective move a token: MXFP4 rows are ``K/2 + K/32`` bytes, FP8 rows ``K + K/128``
(E4M3 bytes, then the power-of-two group scales as E8M0 bytes). Splitting returns views.
"""

import math

import torch

from ds_fp4 import formats as F
from ds_fp4.ops import checks


def pow2(e):
    """``2.0 ** e`` as exact float64, built from the exponent bits (``e`` integer tensor)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def e8m0_from_pow2(scales):
    """Power-of-two float32 scales -> E8M0 bytes (``log2 + 127``; NaN -> 255)."""
    exp = torch.frexp(scales)[1] - 1          # 2^e = 0.5 * 2^(e+1)
    return torch.where(torch.isnan(scales), F.E8M0_NAN, exp + F.E8M0_BIAS).to(torch.uint8)


def pow2_from_e8m0(b):
    """E8M0 bytes -> float32 scales ``2^(b-127)`` (255 -> NaN)."""
    b = b.to(torch.int32)
    return torch.where(b == F.E8M0_NAN, math.nan, pow2(b - F.E8M0_BIAS)).to(torch.float32)


def join_rows(data, scales):
    """Concatenate uint8 data and scale bytes along the last dimension."""
    return torch.cat((data, scales), dim=-1)


def split_mxfp4_rows(rows, k=None):
    """uint8 ``[..., K/2 + K/32]`` -> views ``(data [..., K/2], scales [..., K/32])``.

    ``k``: the rows' K; needed only where the width also fits FP8 rows (multiples of 2193
    bytes, ``checks.packed_rows``), checked where given.
    """
    k = checks.packed_rows("rows", rows, "MXFP4", k)
    return rows[..., : k // 2], rows[..., k // 2:]


def split_mxfp4_rows_for_fp8(rows, k=None):
    """``split_mxfp4_rows`` for an FP8 conversion: 2-D rows whose K is a multiple of 128,
    checked under the caller's name for them (``rows``)."""
    data, scales = split_mxfp4_rows(rows, k)
    checks.matrix("rows", rows)
    checks.multiple("rows", 2 * data.shape[-1], F.FP8_GROUP,
                    f"K (from its width {rows.shape[-1]} = K/2 + K/32 bytes)")
    return data, scales


def split_fp8_rows(rows, k=None):
    """uint8 ``[M, K + K/128]`` -> ``(data float8 [M, K] view, scales float32 [M, K/128])``.

    The scales are decoded from their E8M0 bytes into the ``(1, M)``-strided layout that
    ``quantize_fp8`` returns. ``k`` as for ``split_mxfp4_rows``.
    """
    k = checks.packed_rows("rows", rows, "FP8", k)
    checks.matrix("rows", rows)
    scales = pow2_from_e8m0(rows[:, k:].t().contiguous()).t()
    return rows[:, :k].view(F.FP8_DTYPE), scales
