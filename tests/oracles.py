"""Independent, slow, scalar oracles of FORMATS.md for the tests.

Written from the contract's text with Python floats and exhaustive grids, sharing no code
with ds_fp4.ops.reference, so a wrong rule in the reference disagrees with them.
"""

import math

E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3_value(byte):
    """Decode one E4M3 (fn) byte from its bit fields."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, mant = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and mant == 0x7:
        return math.nan
    if exp == 0:
        return sign * mant * 2.0 ** -9
    return sign * (1 + mant / 8) * 2.0 ** (exp - 7)


E4M3_POSITIVE = sorted({e4m3_value(b) for b in range(0x7F)})   # 0 .. 448, no NaN


def round_to_grid(v, grid, mantissa_is_even):
    """Nearest grid value to |v| (ties to the even neighbour), saturating at the grid's end."""
    a = abs(v)
    if a >= grid[-1]:
        return grid[-1]
    hi = next(i for i, g in enumerate(grid) if g >= a)
    if grid[hi] == a:
        return a
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    if d_lo != d_hi:
        return grid[lo] if d_lo < d_hi else grid[hi]
    return grid[lo] if mantissa_is_even(lo) else grid[hi]


def e2m1_round(v):
    """Magnitude on the E2M1 grid; an even code has mantissa bit 0 (codes 0, 2, 4, 6)."""
    return round_to_grid(v, E2M1_GRID, lambda i: i % 2 == 0)


def e4m3_round(v):
    """Magnitude on the E4M3 grid; grid index parity is the mantissa's last bit."""
    return round_to_grid(v, E4M3_POSITIVE, lambda i: i % 2 == 0)


def rceil_exponent(amax):
    """Smallest e in [-127, 127] with amax <= 6 * 2^e, found by search."""
    if amax == 0:
        return -127
    e = -127
    while amax > 6 * 2.0 ** e and e < 127:
        e += 1
    return e


def floor_exponent(amax):
    if amax == 0:
        return -127
    return max(-127, min(127, math.floor(math.log2(amax)) - 2))


def fp8_exponent(amax):
    """Smallest e in [-126, 127] with amax <= 448 * 2^e; 0 for amax == 0."""
    if amax == 0:
        return 0
    e = -126
    while amax > 448 * 2.0 ** e and e < 127:
        e += 1
    return e
