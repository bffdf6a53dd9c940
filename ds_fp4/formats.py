"""Every number of the data-format contract (FORMATS.md), in one place.

The CUDA sources receive these values as ``#define``s (see ``ds_fp4.ops`` kernels);
nothing else in the package retypes them.
"""

import torch

# ---- E2M1 (FP4) elements -------------------------------------------------------------
# Magnitude of the 3 low bits of a code; bit 3 is the sign (code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E2M1_SIGN_BIT = 0x8
E2M1_EXP_BIAS = 1
# Round-to-nearest-even onto the E2M1 grid: the magnitude code of v is the number of these
# midpoints that v passes. A tie goes to the neighbour whose mantissa bit is 0, so at the
# midpoints marked True a tie rounds up (0.75 -> 1, 1.75 -> 2, 3.5 -> 4) and at the others
# it rounds down (0.25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4).
E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                  (2.5, False), (3.5, True), (5.0, False))

# ---- E8M0 scale bytes ----------------------------------------------------------------
E8M0_BIAS = 127
E8M0_NAN = 255
MX_EXP_MIN = -127          # rceil/floor exponents are clamped to [MX_EXP_MIN, MX_EXP_MAX]
MX_EXP_MAX = 127
MX_BLOCK = 32              # elements per MXFP4 block (one E8M0 byte)
MX_ROUNDINGS = ("rceil", "floor")

# ---- E4M3 (FP8) with power-of-two scales ---------------------------------------------
FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
E4M3_EXP_BIAS = 7
E4M3_MANT_BITS = 3
E4M3_NAN = 0x7F            # the byte every element of a NaN group is written as
FP8_GROUP = 128            # elements per 1x128 scale group (and per side of a weight tile)
FP8_EXP_MIN = -126         # power-of-two scale exponents are clamped to [FP8_EXP_MIN, FP8_EXP_MAX]
FP8_EXP_MAX = 127

# ---- exactness of the direct MXFP4 -> FP8 1x128 conversion ----------------------------
# A 128-group converts exactly when every nonzero element's E8M0 byte is at least the
# largest such byte of the group minus this. Worst case: the largest block holds a 6
# (floor(log2 6) = 2), so the FP8 exponent is b_max - 127 + 2 - 8 (448 = 1.75 * 2^8); a
# 0.5 (2^-1, the finest E2M1 step) of block i is 2^(b_i - 128); E4M3's finest step is 2^-9
# (1 - bias 7 - 3 mantissa bits). Exact while b_i - 128 - (b_max - 133) >= -9.
MXFP4_TO_FP8_EXACT_SPREAD = 14
# What the conversions' optional int64 ``counts`` tensor holds, in this order.
EXACTNESS_COUNTS = ("inexact_groups", "nan_groups", "groups")

# ---- wire/cache row sizes ------------------------------------------------------------
# An MXFP4 row of K elements is K/2 data bytes then K/32 scale bytes = 17 bytes per 32.
MXFP4_ROW_UNIT = MX_BLOCK // 2 + 1       # bytes per 32-element block on the wire
# An FP8 row of K elements is K data bytes then K/128 E8M0 scale bytes = 129 bytes per 128.
FP8_ROW_UNIT = FP8_GROUP + 1             # bytes per 128-element group on the wire

FLOAT_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def mxfp4_row_bytes(k: int) -> int:
    """Bytes of one packed MXFP4 row of ``k`` elements (``k/2 + k/32``)."""
    return k // MX_BLOCK * MXFP4_ROW_UNIT


def fp8_row_bytes(k: int) -> int:
    """Bytes of one packed FP8 row of ``k`` elements (``k + k/128``)."""
    return k // FP8_GROUP * FP8_ROW_UNIT
