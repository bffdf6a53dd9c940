"""The CUDA kernels of ds_fp4/ops, run on the CPU under a host emulation, against the
reference byte for byte.

tests/test_kernels_cuda.py needs a GPU. Here the same kernel text (``module_source`` with the
portable E4M3 conversions) is compiled with g++ against tests/kernel_emu/emu_shim.h and
launched through the real ``ds_fp4.ops.cuda`` wrappers on CPU tensors: argument checks,
row strides, output layouts, grid shapes, shuffles and shared memory all take part. The
cases are a subset of test_kernels_cuda.py's (every op, every dtype and rounding, strided and
packed-row views, ragged and empty segments, NaN/Inf/subnormal inputs), chosen to run in
well under a minute on two cores, and call that file's own test bodies and input makers.
Not covered here: the sm_89+ hardware E4M3 conversions and real-GPU concurrency.
"""

import pytest
import torch

from ds_fp4 import formats as F
from ds_fp4.ops import _cuda_loader
from tests import test_kernels_cuda as T
from tests.kernel_emu import loader

FLOAT_DTYPES = T.FLOAT_DTYPES


@pytest.fixture(scope="module", autouse=True)
def emulated():
    """Route ``_cuda_loader.launch`` into the host-emulated kernels and make the GPU test
    bodies build their inputs on the CPU; both undone after this module."""
    if loader.gxx() is None:
        pytest.skip("g++ is not on PATH: the host emulation of the CUDA kernels needs it")
    kernels = loader.HostKernels()
    mp = pytest.MonkeyPatch()
    mp.setattr(_cuda_loader, "launch", kernels.launch)
    mp.setattr(T, "DEVICE", "cpu")
    yield kernels
    mp.undo()


# ---- MXFP4 quantize / dequantize ---------------------------------------------------------


@pytest.mark.parametrize("rounding", F.MX_ROUNDINGS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("kind", T.KINDS)
def test_quantize_mxfp4(kind, dtype, rounding):
    T.test_quantize_mxfp4(kind, (127, 96), dtype, rounding)


@pytest.mark.parametrize("shape, dtype, kind", [
    ((1, 32), torch.float16, "ties"), ((3, 64), torch.float32, "sat"),
    ((129, 7168), torch.bfloat16, "special"), ((4097, 128), torch.float32, "spread")], ids=str)
def test_quantize_mxfp4_shapes(shape, dtype, kind):
    for rounding in F.MX_ROUNDINGS:
        T.test_quantize_mxfp4(kind, shape, dtype, rounding)


@pytest.mark.parametrize("layout", ["col_slice", "misaligned", "row_step", "transposed",
                                    "batch3d"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_quantize_strided_inputs(layout, dtype):
    T.test_quantize_strided_inputs(layout, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["full", "typical", "edge"])
def test_dequantize_mxfp4(mode, dtype):
    T.test_dequantize_mxfp4((127, 96), mode, dtype)


def test_dequantize_mxfp4_row_views():
    T.test_dequantize_mxfp4_row_views()


# ---- FP8 quantize / dequantize -----------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("kind", T.KINDS)
def test_quantize_fp8(kind, dtype):
    T.test_quantize_fp8(kind, (33, 384), dtype)


@pytest.mark.parametrize("shape, dtype, kind", [
    ((1, 128), torch.float16, "ties"), ((3, 256), torch.float32, "sat"),
    ((129, 7168), torch.bfloat16, "special")], ids=str)
def test_quantize_fp8_shapes(shape, dtype, kind):
    T.test_quantize_fp8(kind, shape, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape, r", [((127, 384), 300), ((33, 256), 0)], ids=str)
def test_quantize_fp8_rows_gathered(shape, r, dtype):
    T.test_quantize_fp8_rows_gathered(shape, r, dtype)


@pytest.mark.parametrize("rounding", F.MX_ROUNDINGS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape, r", [((127, 96), 300), ((33, 64), 0)], ids=str)
def test_quantize_mxfp4_rows_gathered(shape, r, dtype, rounding):
    T.test_quantize_mxfp4_rows_gathered(shape, r, dtype, rounding)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["pow2", "pow2nan", "any"])
@pytest.mark.parametrize("layout", ["colmajor", "rowmajor"])
def test_dequantize_fp8(layout, mode, dtype):
    T.test_dequantize_fp8((127, 384), layout, mode, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_dequantize_fp8_rows(dtype):
    T.test_dequantize_fp8_rows((127, 384), dtype)


# ---- MXFP4 -> FP8 ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", T.CONVERT_MODES)
def test_mxfp4_to_fp8(mode):
    T.test_mxfp4_to_fp8((129, 384), mode)


@pytest.mark.parametrize("shape, mode", [((1, 128), "spread20"), ((127, 7168), "spread15")],
                         ids=str)
def test_mxfp4_to_fp8_shapes(shape, mode):
    T.test_mxfp4_to_fp8(shape, mode)


def test_mxfp4_to_fp8_overflow_and_nan_groups():
    T.test_mxfp4_to_fp8_overflow_and_nan_groups()


@pytest.mark.parametrize("mode", ["typical", "spread15", "spread20", "edge"])
@pytest.mark.parametrize("lengths", [[1], [0], [127, 0, 129], [300, 0, 0, 1, 128]], ids=str)
def test_mxfp4_to_fp8_colwise(lengths, mode):
    """Ragged and empty segments; tensor int32/int64 and host-list offsets; row views."""
    T.test_mxfp4_to_fp8_colwise(lengths, 384, mode)


@pytest.mark.parametrize("lengths, k, mode", [([0, 256, 0], 128, "full"),
                                              ([127, 0, 129], 7168, "spread20")], ids=str)
def test_mxfp4_to_fp8_colwise_widths(lengths, k, mode):
    T.test_mxfp4_to_fp8_colwise(lengths, k, mode)


# ---- named edge cases --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_zero_nan_inf_and_subnormal_inputs(dtype):
    T.test_zero_and_negative_zero_blocks(dtype)
    T.test_nan_and_inf_blocks(dtype)
    T.test_subnormal_inputs(dtype)


def test_empty_inputs():
    T.test_empty_inputs()


@pytest.mark.parametrize("op", ["quantize_fp8", "mxfp4_to_fp8", "dequantize_fp8", "colwise"])
def test_portable_e4m3_conversions(op):
    T.test_portable_e4m3_conversions(op)


def test_argument_errors_match_the_reference():
    T.test_argument_errors_match_the_reference()


def test_launches_really_go_through_the_emulation(emulated, monkeypatch):
    """Guards the harness: the kernels above ran in the emulation, not in a fallback."""
    seen = []
    monkeypatch.setattr(_cuda_loader, "launch",
                        lambda *a, **k: (seen.append(a[2]), emulated.launch(*a, **k)))
    T.check("quantize_fp8", T.floats((3, 256), torch.float32, "normal", 1, F.FP8_GROUP))
    assert seen == ["fp8_quantize_f32"]
