"""Every CUDA kernel against its pure-PyTorch reference, byte for byte (FORMATS.md).

Runs on a CUDA GPU with CuPy (skipped elsewhere). Inputs are generated on the CPU from fixed
seeds, moved to the GPU, and each op of ``ds_fp4.ops.cuda`` is compared with
``ds_fp4.ops.reference`` on the same tensors: raw bytes for integer/FP8 outputs, bit
patterns for float outputs (where NaN must meet NaN; NaN payloads are not part of the
contract: torch's own casts give different ones on CPU and GPU), plus dtype, shape and
strides. A failure names the first mismatching coordinate.
"""

import importlib.util
import math
import zlib

import pytest
import torch

import tests
from ds_fp4 import formats as F
from ds_fp4.ops import reference
from ds_fp4.ops.compare import first_mismatch
from tests import oracles

# A host emulation of the kernels (a development tool) may set tests.KERNEL_TEST_DEVICE.
DEVICE = getattr(tests, "KERNEL_TEST_DEVICE", "cuda")
_HAVE_GPU = DEVICE != "cuda" or (torch.cuda.is_available()
                                 and importlib.util.find_spec("cupy") is not None)
pytestmark = pytest.mark.skipif(not _HAVE_GPU, reason="needs a CUDA GPU and CuPy")

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def kernels():
    from ds_fp4.ops import cuda   # imported lazily: CuPy is not needed to collect this file
    return cuda


# ---- comparison -------------------------------------------------------------------------


def assert_same(got, want, what):
    """Equal dtype, shape, strides and bytes (NaN == NaN for float outputs)."""
    message = first_mismatch(got, want, what)
    if message:
        pytest.fail(message)


def check(op, *args, what=None, **kwargs):
    """Run ``op`` of the kernels and of the reference on the same tensors and compare."""
    got = getattr(kernels(), op)(*args, **kwargs)
    want = getattr(reference, op)(*args, **kwargs)
    assert_same(got, want, what or op)
    return got


# ---- inputs -------------------------------------------------------------------------


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _seed(*key):
    """A seed fixed by the test parameters (Python's hash() changes between runs)."""
    return zlib.crc32(repr(key).encode()) % 100000


def _to(t):
    return t.to(DEVICE)


_E2M1_POINTS = sorted(set(oracles.E2M1_GRID)
                      | {m for m, _ in F.E2M1_MIDPOINTS})          # grid and every tie
_E4M3_POINTS = sorted(set(oracles.E4M3_POSITIVE)
                      | {(a + b) / 2 for a, b in zip(oracles.E4M3_POSITIVE,
                                                     oracles.E4M3_POSITIVE[1:])})


def _exp_range(dtype, top):
    """Block exponents for which value * 2^e stays finite and mostly normal in dtype."""
    if dtype == torch.float16:
        return -14, 15 - top
    return -120, 120


def floats(shape, dtype, kind, seed, group=F.MX_BLOCK):
    """Float test input of ``shape`` (last dim a multiple of ``group``), generated on CPU.

    kinds: normal (row scales 1e-3..1e3), spread (each group its own power of two), ties
    (grid points and rounding midpoints of E2M1 (group 32) or E4M3 (group 128), group max
    pinned), sat (group max between 6 and 8 times a power of two: the floor rule
    saturates), special (zeros, -0, NaN, +-Inf, subnormals, the dtype's max, mixed in).
    """
    g = _gen(seed)
    n = math.prod(shape)
    groups = n // group
    if kind == "normal":
        rows = n // shape[-1]
        x = torch.randn(rows, shape[-1], generator=g) * 10.0 ** (
            torch.rand(rows, 1, generator=g) * 6 - 3)
    elif kind in ("spread", "special"):
        lo, hi = _exp_range(dtype, 3)
        e = torch.randint(max(lo, -40), min(hi, 40), (groups, 1), generator=g)
        x = torch.randn(groups, group, generator=g) * torch.exp2(e.float())
    elif kind in ("ties", "sat"):
        points = torch.tensor(_E2M1_POINTS if group == F.MX_BLOCK else _E4M3_POINTS)
        top = 6.0 if group == F.MX_BLOCK else F.E4M3_MAX
        lo, hi = _exp_range(dtype, 9)
        e = torch.randint(lo, hi, (groups, 1), generator=g).double()
        v = points[torch.randint(len(points), (groups, group), generator=g)].double()
        if kind == "sat":
            v = v * 1.3
            v[:, 0] = 7.0 if group == F.MX_BLOCK else 460.0
        else:
            v[:, 0] = top
        sign = torch.randint(0, 2, (groups, group), generator=g).double() * 2 - 1
        x = v * sign * torch.exp2(e)
    else:
        raise ValueError(kind)
    x = x.reshape(shape).to(dtype)
    if kind == "special":
        info = torch.finfo(dtype)
        flat = x.view(-1, group)
        pick = torch.randint(0, 10, (flat.shape[0],), generator=g)
        flat[pick == 0] = 0.0
        flat[pick == 1] = -0.0
        flat[pick == 2, 3] = math.nan
        flat[pick == 3, 5] = math.inf
        flat[pick == 4, 7] = -math.inf
        flat[pick == 5] = info.smallest_normal * torch.randint(
            -4, 5, (int((pick == 5).sum()), group), generator=g).to(dtype) / 4
        flat[pick == 6, 9] = info.max
        flat[pick == 6, 10] = -info.max
        flat[pick == 7] = flat[pick == 7].abs() * -1.0          # all negative, incl. -0
    return _to(x)


def mx_codes(rows, k, seed, zero_fraction=0.1):
    """Random E2M1 data bytes ``[rows, K/2]``; some blocks all zero, some all -0."""
    g = _gen(seed)
    data = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, generator=g)
    blocks = data.view(rows, k // F.MX_BLOCK, F.MX_BLOCK // 2)
    pick = torch.rand(rows, k // F.MX_BLOCK, generator=g)
    blocks[pick < zero_fraction / 2] = 0
    blocks[(pick >= zero_fraction / 2) & (pick < zero_fraction)] = 0x88
    return _to(data)


def mx_scales(rows, k, mode, seed):
    """E8M0 bytes ``[rows, K/32]``.

    modes: full (0..255), typical (110..140), edge (0, 1, 2, 126..128, 252..255), or
    ``spreadS``: every (128-row, 4-block) tile has a base B and each byte is B - U(0..S),
    so a 128-group (along rows or along tokens) spans up to S powers of two.
    """
    g = _gen(seed)
    nb = k // F.MX_BLOCK
    if mode == "full":
        s = torch.randint(0, 256, (rows, nb), generator=g)
    elif mode == "typical":
        s = torch.randint(110, 141, (rows, nb), generator=g)
    elif mode == "edge":
        table = torch.tensor([0, 1, 2, 126, 127, 128, 252, 253, 254, 255])
        s = table[torch.randint(len(table), (rows, nb), generator=g)]
    elif mode.startswith("spread"):
        spread = int(mode[len("spread"):])
        base = torch.randint(spread, 255, ((rows + 127) // 128, (nb + 3) // 4), generator=g)
        base = base.repeat_interleave(128, 0)[:rows].repeat_interleave(4, 1)[:, :nb]
        s = base - torch.randint(0, spread + 1, (rows, nb), generator=g)
    else:
        raise ValueError(mode)
    return _to(s.to(torch.uint8))


def fp8_data(m, k, seed):
    """Random E4M3 bytes (NaN bytes included) as float8_e4m3fn ``[M, K]``."""
    g = _gen(seed)
    return _to(torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=g).view(F.FP8_DTYPE))


def fp8_scales(m, k, mode, seed, layout="colmajor"):
    """float32 ``[M, K/128]``: pow2 (2^-126..2^127), pow2nan (some NaN), any (arbitrary
    floats: subnormal, zero, negative, Inf). Layout colmajor (strides (1, M)) or rowmajor."""
    g = _gen(seed)
    n = k // F.FP8_GROUP
    if mode.startswith("pow2"):
        s = torch.exp2(torch.randint(F.FP8_EXP_MIN, F.FP8_EXP_MAX + 1, (m, n), generator=g).double())
        if mode == "pow2nan":
            s[torch.rand(m, n, generator=g) < 0.1] = math.nan
    else:
        s = torch.randn(m, n, generator=g).double() * torch.exp2(
            torch.randint(-150, 130, (m, n), generator=g).double())
        s[torch.rand(m, n, generator=g) < 0.05] = 0.0
    s = s.float()
    if layout == "colmajor":
        s = s.t().contiguous().t()
    return _to(s)


# ---- MXFP4 quantize ------------------------------------------------------------------

MX_SHAPES = [(1, 32), (3, 64), (127, 96), (129, 7168), (4097, 128)]
KINDS = ["normal", "spread", "ties", "sat", "special"]


@pytest.mark.parametrize("rounding", F.MX_ROUNDINGS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", MX_SHAPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_quantize_mxfp4(kind, shape, dtype, rounding):
    x = floats(shape, dtype, kind, seed=_seed(kind, shape))
    check("quantize_mxfp4", x, rounding)
    check("quantize_mxfp4_rows", x, rounding)


def _strided_views(x):
    """Views of the same values with other strides: a column slice (16-byte aligned), a
    column slice at an odd element offset (misaligned rows), every other row, a transposed
    copy (last stride != 1) and a 3-D batch."""
    m, k = x.shape
    wide = torch.zeros(m, k + 64, dtype=x.dtype, device=x.device)
    wide[:, 16:16 + k] = x
    odd = torch.zeros(m, k + 64, dtype=x.dtype, device=x.device)
    odd[:, 1:1 + k] = x
    tall = torch.zeros(2 * m, k, dtype=x.dtype, device=x.device)
    tall[::2] = x
    return {
        "col_slice": wide[:, 16:16 + k],
        "misaligned": odd[:, 1:1 + k],
        "row_step": tall[::2],
        "transposed": x.t().contiguous().t(),
        "batch3d": x.reshape(1, m, k).expand(2, m, k),
    }


@pytest.mark.parametrize("layout", ["col_slice", "misaligned", "row_step", "transposed",
                                    "batch3d"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_quantize_strided_inputs(layout, dtype):
    x = _strided_views(floats((37, 256), dtype, "spread", seed=5))[layout]
    check("quantize_mxfp4", x, "rceil", what=f"mxfp4 {layout}")
    check("quantize_mxfp4_rows", x, "floor", what=f"mxfp4 rows {layout}")
    if x.dim() == 2:
        check("quantize_fp8", x, what=f"fp8 {layout}")
        check("quantize_fp8_rows", x, what=f"fp8 rows {layout}")


# ---- MXFP4 dequantize -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["full", "typical", "edge"])
@pytest.mark.parametrize("shape", [(1, 32), (127, 96), (129, 7168), (4097, 64)], ids=str)
def test_dequantize_mxfp4(shape, mode, dtype):
    m, k = shape
    data, scales = mx_codes(m, k, seed=m), mx_scales(m, k, mode, seed=k)
    check("dequantize_mxfp4", data, scales, dtype)
    rows = torch.cat([data, scales], dim=1)
    check("dequantize_mxfp4_rows", rows, dtype)


def test_dequantize_mxfp4_row_views():
    """The halves of a packed row buffer at an odd byte offset (misaligned data rows)."""
    m, k = 65, 7168
    width = F.mxfp4_row_bytes(k)
    rows = torch.cat([mx_codes(m, k, 1), mx_scales(m, k, "typical", 2)], dim=1)
    buf = torch.zeros(m, width + 3, dtype=torch.uint8, device=rows.device)
    buf[:, 3:] = rows
    check("dequantize_mxfp4_rows", buf[:, 3:], torch.bfloat16)
    check("dequantize_mxfp4_rows", rows.reshape(5, 13, width), torch.float32, what="3-D rows")


# ---- FP8 quantize / dequantize --------------------------------------------------------

FP8_SHAPES = [(1, 128), (3, 256), (127, 384), (129, 7168), (4097, 128)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_quantize_fp8(kind, shape, dtype):
    x = floats(shape, dtype, kind, seed=_seed(kind, shape, 8), group=F.FP8_GROUP)
    check("quantize_fp8", x)
    check("quantize_fp8_rows", x)


def _row_index(m, r, seed):
    """int64 ``[r]``: rows of ``[0, m)`` in random order with repeats, and indices outside
    it (-1, m, m + 5: zero rows)."""
    idx = torch.randint(0, m, (r,), generator=_gen(seed))
    idx[1:3] = torch.tensor([0, m - 1])[:max(r - 1, 0)]   # the first and last rows
    idx[::7] = m
    idx[3::11] = -1
    idx[5::13] = m + 5
    return _to(idx)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape, r", [((1, 128), 5), ((127, 384), 300), ((129, 7168), 64),
                                      ((33, 256), 0)], ids=str)
def test_quantize_fp8_rows_gathered(shape, r, dtype):
    """Rows picked by an index: the reference's bytes, and those of the kernel on the
    gathered copy; a strided input too."""
    x = floats(shape, dtype, "special", seed=_seed(shape, r), group=F.FP8_GROUP)
    idx = _row_index(shape[0], r, seed=r)
    got = check("quantize_fp8_rows", x, index=idx)
    assert got.shape == (r, F.fp8_row_bytes(shape[1]))
    assert_same(got, kernels().quantize_fp8_rows(reference.gather_rows_or_zeros(x, idx)),
                "the gathered copy quantized")
    view = _strided_views(x)["col_slice"]
    check("quantize_fp8_rows", view, index=idx, what="gathered from a column slice")
    scale = (torch.rand(r, generator=_gen(r)) * 4).to(DEVICE)
    if r > 3:
        scale[1], scale[2] = 1e-30, math.inf
    outside = (idx < 0) | (idx >= shape[0])
    # a zero row stays zero whatever its factor (an unused slot's gate may be anything)
    scale[outside] = torch.tensor([math.nan, -math.inf, -2.0], device=scale.device).repeat(
        r)[:int(outside.sum())]
    got = check("quantize_fp8_rows", x, index=idx, scale=scale, what="gathered and scaled")
    rows = reference.gather_rows_or_zeros(x, idx)
    scaled = torch.where(outside[:, None], rows, (rows.float() * scale[:, None]).to(x.dtype))
    assert_same(got, kernels().quantize_fp8_rows(scaled), "the scaled copy quantized")


@pytest.mark.parametrize("rounding", F.MX_ROUNDINGS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape, r", [((1, 32), 5), ((127, 96), 300), ((129, 7168), 64),
                                      ((33, 64), 0)], ids=str)
def test_quantize_mxfp4_rows_gathered(shape, r, dtype, rounding):
    """MXFP4 rows picked by an index: the reference's bytes, and those of the kernel on the
    gathered copy; a strided input too."""
    x = floats(shape, dtype, "special", seed=_seed(shape, r, rounding))
    idx = _row_index(shape[0], r, seed=r + 1)
    got = check("quantize_mxfp4_rows", x, rounding, index=idx)
    assert got.shape == (r, F.mxfp4_row_bytes(shape[1]))
    assert_same(got, kernels().quantize_mxfp4_rows(reference.gather_rows_or_zeros(x, idx),
                                                   rounding), "the gathered copy quantized")
    view = _strided_views(x)["misaligned"]
    check("quantize_mxfp4_rows", view, rounding, index=idx, what="gathered, misaligned rows")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["pow2", "pow2nan", "any"])
@pytest.mark.parametrize("layout", ["colmajor", "rowmajor"])
@pytest.mark.parametrize("shape", [(1, 128), (127, 384), (129, 7168)], ids=str)
def test_dequantize_fp8(shape, layout, mode, dtype):
    m, k = shape
    check("dequantize_fp8", fp8_data(m, k, seed=m), fp8_scales(m, k, mode, k, layout), dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 128), (127, 384), (129, 7168)], ids=str)
def test_dequantize_fp8_rows(shape, dtype):
    m, k = shape
    g = _gen(m + k)
    rows = torch.randint(0, 256, (m, F.fp8_row_bytes(k)), dtype=torch.uint8, generator=g)
    rows[:, k:][torch.rand(m, k // F.FP8_GROUP, generator=g) < 0.5] = 127   # plausible scales
    check("dequantize_fp8_rows", _to(rows), dtype)


# ---- MXFP4 -> FP8 ----------------------------------------------------------------------

CONVERT_MODES = ["typical", "spread14", "spread15", "spread20", "full", "edge"]


@pytest.mark.parametrize("mode", CONVERT_MODES)
@pytest.mark.parametrize("shape", [(1, 128), (3, 256), (129, 384), (127, 7168), (4097, 128)],
                         ids=str)
def test_mxfp4_to_fp8(shape, mode):
    m, k = shape
    data, scales = mx_codes(m, k, seed=k), mx_scales(m, k, mode, seed=m)
    check("mxfp4_to_fp8", data, scales)
    rows = torch.cat([data, scales], dim=1)
    check("mxfp4_rows_to_fp8", rows)
    buf = torch.zeros(m, rows.shape[1] + 1, dtype=torch.uint8, device=rows.device)
    buf[:, 1:] = rows
    check("mxfp4_rows_to_fp8", buf[:, 1:], what="mxfp4_rows_to_fp8 misaligned")


def test_mxfp4_to_fp8_overflow_and_nan_groups():
    """E8M0 254 with code >= 4 (2^128: Inf in float32) and 253 with code 7 make NaN groups;
    a 255 scale byte makes a NaN group whatever its codes; a group below stays finite."""
    m, k = 4, 256
    data = torch.zeros(m, k // 2, dtype=torch.uint8)
    scales = torch.full((m, k // 32), 127, dtype=torch.uint8)
    data[0, 0] = 0x04; scales[0, 0] = 254          # 2 * 2^127
    data[1, 16] = 0x07; scales[1, 1] = 253         # 6 * 2^126 = 1.5 * 2^128
    data[2, 0] = 0x03; scales[2, 0] = 254          # 1.5 * 2^127: finite
    scales[3, 5] = 255                             # NaN block, all codes 0
    got = check("mxfp4_to_fp8", _to(data), _to(scales))
    nan = torch.isnan(got[1].cpu())
    assert nan[0, 0] and nan[1, 0] and nan[3, 1]
    assert not (nan[2, 0] or nan[3, 0] or nan[0, 1] or nan[2, 1])


# ---- column-wise conversion ------------------------------------------------------------

SEGMENTS = [[1], [0], [127, 0, 129], [300, 0, 0, 1, 128], [0, 256, 0], [4097]]


@pytest.mark.parametrize("mode", ["typical", "spread15", "spread20", "full", "edge"])
@pytest.mark.parametrize("k", [128, 384, 7168])
@pytest.mark.parametrize("lengths", SEGMENTS, ids=str)
def test_mxfp4_to_fp8_colwise(lengths, k, mode):
    if k == 7168 and sum(lengths) > 600:
        pytest.skip("large T x 7168 is covered by the benchmark's correctness check")
    t = sum(lengths)
    offsets = torch.tensor([0] + list(itertools_accumulate(lengths)), dtype=torch.int32)
    data, scales = mx_codes(t, k, seed=t + k), mx_scales(t, k, mode, seed=len(lengths))
    check("mxfp4_to_fp8_colwise", data, scales, _to(offsets))
    rows = torch.cat([data, scales], dim=1)
    d, s = torch.split(rows, [k // 2, k // 32], dim=1)          # strided halves
    check("mxfp4_to_fp8_colwise", d, s, _to(offsets.long()), what="colwise row views")
    check("mxfp4_to_fp8_colwise", d, s, offsets.tolist(), what="colwise host offsets")


def test_colwise_new_layouts_do_not_sync():
    """A layout not seen before (a dropless layer's row count changes from step to step)
    uploads its tile table without waiting for the GPU."""
    from ds_fp4.ops import cuda
    k = 256
    data, scales = _to(mx_codes(1000, k, seed=3)), _to(mx_scales(1000, k, "typical", seed=4))
    cuda.mxfp4_to_fp8_colwise(data, scales, [0, 1000])         # the kernel compiled, loaded
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for n in (999, 777, 555):                                # host offsets, new each time
            got = cuda.mxfp4_to_fp8_colwise(data[:n], scales[:n], [0, 300, n])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = reference.mxfp4_to_fp8_colwise(data[:555].cpu(), scales[:555].cpu(), [0, 300, 555])
    assert torch.equal(got[0].cpu().view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1].cpu(), want[1])


def itertools_accumulate(values):
    total = 0
    for v in values:
        total += v
        yield total


# ---- named edge cases -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_zero_and_negative_zero_blocks(dtype):
    x = torch.zeros(4, 256, dtype=dtype)
    x[1] = -0.0
    x[2, ::2] = -0.0
    x[3, 5] = -1e-30 if dtype != torch.float16 else -1e-7   # rounds to zero, sign kept
    x = _to(x)
    for op in ("quantize_mxfp4", "quantize_mxfp4_rows"):
        for rounding in F.MX_ROUNDINGS:
            check(op, x, rounding)
    check("quantize_fp8", x)
    check("quantize_fp8_rows", x)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_nan_and_inf_blocks(dtype):
    x = floats((8, 256), dtype, "normal", seed=3).cpu()
    x[0, 0] = math.nan
    x[1, 40] = math.inf
    x[2, 100] = -math.inf
    x[3, 255] = math.nan
    x[4] = math.nan
    x = _to(x)
    for rounding in F.MX_ROUNDINGS:
        data, scales = check("quantize_mxfp4", x, rounding)
        assert (scales[:5].cpu() == F.E8M0_NAN).any(dim=1).all()
    data, scales = check("quantize_fp8", x)
    assert torch.isnan(scales[:5].cpu()).any(dim=1).all()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_subnormal_inputs(dtype):
    info = torch.finfo(dtype)
    g = _gen(9)
    steps = torch.randint(-64, 65, (16, 256), generator=g).to(torch.float64)
    x = _to((steps * info.smallest_normal / 64).to(dtype))
    for rounding in F.MX_ROUNDINGS:
        check("quantize_mxfp4", x, rounding)
    check("quantize_fp8", x)


def test_empty_inputs():
    for dtype in FLOAT_DTYPES:
        x = _to(torch.zeros(0, 128, dtype=dtype))
        check("quantize_mxfp4", x)
        check("quantize_fp8", x)
        check("quantize_fp8_rows", x)
    empty = _to(torch.zeros(0, 64, dtype=torch.uint8))
    check("dequantize_mxfp4", empty, _to(torch.zeros(0, 4, dtype=torch.uint8)))
    check("mxfp4_to_fp8", empty, _to(torch.zeros(0, 4, dtype=torch.uint8)))
    check("mxfp4_to_fp8_colwise", empty, _to(torch.zeros(0, 4, dtype=torch.uint8)),
          _to(torch.tensor([0, 0], dtype=torch.int32)))


@pytest.mark.parametrize("op", ["quantize_fp8", "mxfp4_to_fp8", "dequantize_fp8",
                                "colwise"])
def test_portable_e4m3_conversions(op):
    """The pre-sm_89 software E4M3 conversions, forced on, equal the reference too."""
    from ds_fp4.ops import _cuda_loader
    with _cuda_loader.soft_conversions():
        if op == "quantize_fp8":
            for kind in KINDS:
                check(op, floats((33, 384), torch.bfloat16, kind, 7, group=F.FP8_GROUP))
        elif op == "mxfp4_to_fp8":
            for mode in CONVERT_MODES:
                check(op, mx_codes(33, 384, 1), mx_scales(33, 384, mode, 2))
        elif op == "dequantize_fp8":
            check(op, fp8_data(33, 384, 3), fp8_scales(33, 384, "any", 4), torch.bfloat16)
        else:
            offsets = _to(torch.tensor([0, 100, 100, 233], dtype=torch.int32))
            check("mxfp4_to_fp8_colwise", mx_codes(233, 256, 5), mx_scales(233, 256, "spread20", 6),
                  offsets)


def test_argument_errors_match_the_reference():
    """Bad input gets the reference's own ValueError/TypeError (the checks are shared)."""
    ops_bad = [
        ("quantize_mxfp4", (_to(torch.zeros(2, 48)),)),
        ("quantize_mxfp4", (_to(torch.zeros(2, 32, dtype=torch.int32)),)),
        ("quantize_fp8", (_to(torch.zeros(2, 64)),)),
        ("dequantize_mxfp4", (_to(torch.zeros(2, 16, dtype=torch.uint8)),
                              _to(torch.zeros(2, 2, dtype=torch.uint8)))),
        ("mxfp4_to_fp8_colwise", (_to(torch.zeros(3, 64, dtype=torch.uint8)),
                                  _to(torch.zeros(3, 4, dtype=torch.uint8)),
                                  _to(torch.tensor([0, 2], dtype=torch.int32)))),
    ]
    for op, args in ops_bad:
        with pytest.raises((ValueError, TypeError)) as want:
            getattr(reference, op)(*args)
        with pytest.raises(want.type, match=None) as got:
            getattr(kernels(), op)(*args)
        assert str(got.value) == str(want.value), op
