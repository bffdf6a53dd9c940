"""Fixtures and comparisons shared by the tests of the FP8 experts' quantizers
(tests/test_fp8_tiles.py, tests/test_fp8_segments.py): their kernels under the host
emulation, reached through the real Python launchers with CPU tensors."""

import pytest
import torch

from ds_fp4 import formats as F
from ds_fp4.ops import _cuda_loader as L
from ds_fp4.ops import backend, fp8_tiles
from tests.kernel_emu import loader

MODULES = ("fp8_tiles", "fp8_segments")
# the persistent segment variants' grids are this many CTAs per SM: fewer than the tiles of
# every case in the tests, so that each CTA walks several tiles
EMU_SMS = 1


@pytest.fixture(scope="module")
def host_kernels():
    """The host emulation of the kernels (built once per kernel text, cached across runs)."""
    if loader.gxx() is None:
        pytest.skip("g++ is not on PATH")
    kernels = loader.HostKernels()
    for module in MODULES:
        kernels.library(module)         # build here: a g++ error fails setup, not one case
    return kernels


@pytest.fixture
def emulated(host_kernels, monkeypatch):
    """Route the quantizers' launches on CPU tensors into the host-emulated kernels, for one
    test only (a GPU test after it must reach the real kernels); yields the launches made
    as ``(kernel, grid)``."""
    launched = []

    def launch(device, module, name, grid, args, block=L.BLOCK):
        launched.append((name, grid))
        host_kernels.launch(device, module, name, grid, args, block=block)

    tables = []       # kept alive for the test, as fp8_tiles caches its own

    def table(index, addresses):
        tables.append(torch.tensor(addresses, dtype=torch.int64))
        return tables[-1]

    monkeypatch.setattr(backend, "uses_kernels", lambda *tensors: True)
    monkeypatch.setattr(L, "launch", launch)
    monkeypatch.setattr(fp8_tiles, "_pointer_table", table)
    monkeypatch.setattr(L, "sm_count", lambda device: EMU_SMS)
    return launched


def _bits(t):
    """Comparable bits: E4M3 bytes with NaN's sign dropped (a NaN tile or group is NaN; the
    twins' float products give NaNs either sign), float32 words as they are."""
    if t.dtype == F.FP8_DTYPE:
        b = t.contiguous().view(torch.uint8)
        return torch.where(b & 0x7F == F.E4M3_NAN, F.E4M3_NAN, b)
    return t.contiguous().view(torch.int32)


def same_bytes(got, want, what):
    """Byte equality of (data, scales) pairs; reports the first mismatch."""
    for name, a, b in ((f"{what} data", got[0], want[0]), (f"{what} scales", got[1], want[1])):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        ab, bb = _bits(a), _bits(b)
        bad = (ab != bb).nonzero()
        assert bad.numel() == 0, f"{name}: {bad.shape[0]} differ, first at {bad[0].tolist()}: " \
                                 f"{ab[tuple(bad[0])].item()} vs {bb[tuple(bad[0])].item()}"


def cupy_or_skip():
    try:
        import cupy  # noqa: F401, PLC0415
    except ImportError:
        pytest.skip("CuPy is not installed")
