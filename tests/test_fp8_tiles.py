"""The FP8 experts' weight-tile quantizer (ds_fp4/ops/fp8_tiles.{py,cu}).

- CPU, g++: the kernel source runs under the host emulation of tests/kernel_emu (one
  std::thread per CUDA thread, barriers for __syncthreads and shuffles, the portable E4M3
  conversion) through the real Python launcher, and must equal the PyTorch twin byte for
  byte: layouts, the transposing swizzle, shuffles and scales. (tests/test_kernels_compile.py
  compiles it with nvcc.)
- GPU: the kernel against the twin on the device.
"""

import math

import pytest
import torch

from ds_fp4.ops import backend, fp8_tiles as FT
from tests.kernel_emu.fp8 import cupy_or_skip, emulated, host_kernels, same_bytes  # noqa: F401

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def weights_with_edges(n, r, c, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(r, c, generator=g) * 0.05 for _ in range(n)]
    ws[0][:128, :128] *= 1e-30 if dtype != torch.float16 else 1e-3   # tiny tile
    ws[0][:128, 128:256] = 0                                         # zero tile
    if n > 1:
        ws[1][130, 5] = math.nan
        ws[1][200, 140] = -math.inf
    ws[-1][-128:, -128:] *= 3e3 if dtype != torch.float16 else 1e2    # large tile
    return [w.to(dtype) for w in ws]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_group", [1, 2])
@pytest.mark.parametrize("transpose", [False, True])
def test_emulated_tiles_equal_twin(emulated, dtype, per_group, transpose):
    ws = weights_with_edges(2 * per_group, 256, 384, dtype, seed=per_group)
    got = FT.tile_quant(ws, per_group, transpose)
    want = FT.tile_quant_ref(ws, per_group, transpose)
    assert len(emulated) == 1 and emulated[0][0].startswith("fp8_tiles_")   # the kernel ran
    same_bytes(got, want, "tiles")


def _stacks(n, groups, r, c, dtype, seed):
    """``n`` stacked ``[groups, r, c]`` weights and the same as tile_quant's list."""
    ws = weights_with_edges(n * groups, r, c, dtype, seed)
    stacks = tuple(torch.stack(ws[j::n]) for j in range(n))   # list entry g*n + j
    return stacks, [stacks[j][g] for g in range(groups) for j in range(n)]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("transpose", [False, True])
def test_emulated_stacked_tiles_equal_twin(emulated, n, transpose):
    """The stacked weights' pointer table (each expert's address from its stack's base) and
    launch: the list form's bytes."""
    stacks, listed = _stacks(n, 3, 256, 384, torch.bfloat16, seed=n)
    got = FT.tile_quant_stacked(stacks, transpose)
    assert len(emulated) == 1 and emulated[0][1] == (3, 2, 3 * n)     # one launch, all weights
    same_bytes(got, FT.tile_quant_ref(listed, n, transpose), "stacked tiles")


def test_stacked_tiles_without_kernels_equal_twin():
    stacks, listed = _stacks(2, 2, 256, 256, torch.float32, seed=3)
    same_bytes(FT.tile_quant_stacked(stacks, True), FT.tile_quant_ref(listed, 2, True), "tiles")
    with pytest.raises(ValueError, match="3-D"):
        FT.tile_quant_stacked((torch.zeros(128, 128),))
    with pytest.raises(ValueError, match="share shape"):
        FT.tile_quant_stacked((torch.zeros(2, 128, 128), torch.zeros(3, 128, 128)))
    with pytest.raises(ValueError, match="G = 0"):
        FT.tile_quant_stacked((torch.zeros(0, 128, 128),))
    with pytest.raises(ValueError, match="multiples of 128"):
        FT.tile_quant_stacked((torch.zeros(2, 100, 128),))


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="per_group"):
        FT.tile_quant([torch.zeros(128, 128)] * 3, 2)
    with pytest.raises(ValueError, match="share shape"):
        FT.tile_quant([torch.zeros(128, 128), torch.zeros(256, 128)], 1)
    with pytest.raises(ValueError, match="multiples of 128"):
        FT.tile_quant([torch.zeros(100, 128)], 1)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transpose", [False, True])
def test_cuda_tiles_equal_twin(dtype, transpose):
    cupy_or_skip()
    ws = [w.cuda() for w in weights_with_edges(4, 512, 768, dtype, seed=7)]
    assert backend.uses_kernels(ws[0])
    same_bytes(FT.tile_quant(ws, 2, transpose), FT.tile_quant_ref(ws, 2, transpose), "tiles")


@needs_cuda
@pytest.mark.parametrize("transpose", [False, True])
def test_cuda_stacked_tiles_equal_twin(transpose):
    cupy_or_skip()
    stacks, listed = _stacks(2, 4, 512, 768, torch.bfloat16, seed=8)
    stacks = tuple(s.cuda() for s in stacks)
    listed = [w.cuda() for w in listed]
    same_bytes(FT.tile_quant_stacked(stacks, transpose), FT.tile_quant_ref(listed, 2, transpose),
               "stacked tiles")
