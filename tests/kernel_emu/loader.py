"""Build ds_fp4's CUDA modules for the host with g++ and launch them on CPU tensors.

The modules are ds_fp4/ops/*.cu (``_cuda_loader.MODULES``). The text compiled is the exact
text NVRTC compiles (``module_text``), with the portable E4M3 conversions (the host has no
FP8 ``cvt``), after ``emu_shim.h``. Each ``extern "C"`` kernel gets a host entry
``emu_<name>(gx, gy, gz, block, argv)`` that runs its grid through the shim. Builds are
cached in a temp directory under a hash of the full text and compiler flags, so an edited
kernel is rebuilt and an unchanged one is not. ``HostKernels.launch`` has the signature of
``_cuda_loader.launch``, so a test can monkeypatch it in and call ``ds_fp4.ops.cuda`` (or
``ds_fp4.ops.fp8_tiles`` / ``fp8_segments``) with CPU tensors.
"""

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ds_fp4.ops import _cuda_loader as L

SHIM = Path(__file__).resolve().with_name("emu_shim.h")
CACHE_DIR = Path(tempfile.gettempdir()) / "ds_fp4_kernel_emu"
GXX_FLAGS = ("-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-fno-strict-aliasing",
             "-ffp-contract=off", "-w")
# Kernels that shuffle or __syncthreads: their CTAs need real threads (name prefixes). One
# missing here fails its launch with an error naming it (the shim never waits forever).
THREADED = ("fp8_quantize", "mxfp4_to_fp8", "fp8_tiles", "fp8_seg", "route_grads_",
            "route_sum_")
_CTYPES = {np.uint64: ctypes.c_uint64, np.int64: ctypes.c_int64, np.uint32: ctypes.c_uint32}
_KERNEL_RE = re.compile(r'extern "C"\s+void\s+(\w+)\s*\(([^)]*)\)\s*\{')


def gxx():
    """Path of g++, or None when it is not installed."""
    return shutil.which("g++")


def module_text(module):
    """The CUDA text of ``module`` with the portable E4M3 conversions, as the host compiles it."""
    return L.module_source(module, soft_cvt=True)


def _param_type(param):
    """C type of one preprocessed parameter declaration (``const u8* __restrict__ x``)."""
    p = param.replace("__restrict__", "").strip()
    return p if p.endswith("*") else p.rsplit(" ", 1)[0]


def host_source(cuda_text):
    """The g++ translation unit for one module's CUDA text (shim, kernels, host entries) and
    ``kernel name -> parameter count``."""
    text = SHIM.read_text() + "\n" + cuda_text
    # The kernels' signatures come from macros: find them in the preprocessed text.
    pre = subprocess.run([gxx(), "-std=c++20", "-E", "-P", "-x", "c++", "-"], input=text,
                         capture_output=True, text=True, check=True).stdout
    entries, arity = [], {}
    for name, params in _KERNEL_RE.findall(pre):
        arity[name] = len(params.split(","))
        call = ", ".join(f"*({_param_type(p)}*)a[{i}]" for i, p in enumerate(params.split(",")))
        sync = "true" if name.startswith(THREADED) else "false"
        entries.append(f'extern "C" int emu_{name}(unsigned gx, unsigned gy, unsigned gz, '
                       f'unsigned bx, void** a) {{ return emu_launch(gx, gy, gz, bx, {sync}, '
                       f'[&] {{ {name}({call}); }}); }}')
    if not entries:
        raise RuntimeError("no extern \"C\" kernels found in the module text")
    return text + "\n" + "\n".join(entries) + "\n", arity


def build(cuda_text):
    """The loaded shared library of ``cuda_text`` (built once per distinct text and flags)
    and its kernels' parameter counts."""
    full, arity = host_source(cuda_text)
    key = hashlib.sha256((full + " ".join(GXX_FLAGS)).encode()).hexdigest()[:16]
    so = CACHE_DIR / f"{key}.so"
    if not so.exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        cpp = CACHE_DIR / f"{key}.{os.getpid()}.cpp"
        tmp = CACHE_DIR / f"{key}.{os.getpid()}.so"
        cpp.write_text(full)
        proc = subprocess.run([gxx(), *GXX_FLAGS, "-o", str(tmp), str(cpp)],
                              capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"g++ failed on the emulated kernels:\n{proc.stderr[-4000:]}")
        os.replace(tmp, so)          # atomic: a parallel run sees no half-written library
        cpp.unlink()
    return ctypes.CDLL(str(so)), arity


class HostKernels:
    """Launches kernels of the emulated modules; a drop-in for ``_cuda_loader.launch``.

    Arguments:
        source: ``module name -> CUDA text``; default ``module_text`` (tests may pass an
            edited text to check that the comparison catches a change).
    """

    def __init__(self, source=None):
        self._source = source or module_text
        self._libs = {}

    def library(self, module):
        """``(ctypes library, kernel name -> parameter count)`` of ``module`` (built once)."""
        if module not in self._libs:
            self._libs[module] = build(self._source(module))
        return self._libs[module]

    def launch(self, device, module, name, grid, args, block=L.BLOCK):
        """As ``_cuda_loader.launch``; every pointer argument must be host memory."""
        if device.type != "cpu":
            raise ValueError(f"host-emulated kernel {name} got a {device} tensor; pass CPU tensors")
        grid = (grid,) if isinstance(grid, int) else tuple(grid)
        gx, gy, gz = (*grid, 1, 1)[:3]
        vals = [_CTYPES[type(a)](a) for a in args]
        argv = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        lib, arity = self.library(module)
        if arity.get(name) != len(args):     # the entry reads exactly that many pointers
            raise ValueError(f"kernel {name} takes {arity.get(name)} arguments, got {len(args)}")
        fn = getattr(lib, "emu_" + name)
        fn.restype = ctypes.c_int
        if fn(ctypes.c_uint(gx), ctypes.c_uint(gy), ctypes.c_uint(gz), ctypes.c_uint(block),
              argv):
            raise RuntimeError(f"kernel {name} synchronizes but ran without threads: add its "
                               f"name prefix to tests/kernel_emu/loader.py THREADED")


# ---- what the op tests share: kernels built up front, launches redirected, planted bugs ----


def built(module):
    """``HostKernels`` with ``module`` already built (a g++ error fails the caller, not a
    later case); skips the test without g++."""
    import pytest
    if gxx() is None:
        pytest.skip("g++ is not on PATH: the host emulation of the CUDA kernels needs it")
    kernels = HostKernels()
    kernels.library(module)
    return kernels


def redirect(monkeypatch, kernels):
    """The ops' launches on CPU tensors go to ``kernels`` (every op takes its kernel path);
    returns the list the launched kernels' names are appended to."""
    from ds_fp4.ops import backend
    launched = []

    def launch(device, module, name, grid, args, block=L.BLOCK):
        launched.append(name)
        kernels.launch(device, module, name, grid, args, block=block)

    monkeypatch.setattr(backend, "uses_kernels", lambda *tensors: True)
    monkeypatch.setattr(L, "launch", launch)
    return launched


def op_fixtures(module):
    """An op test's two fixtures: ``host_kernels`` (``module`` built once per test module)
    and ``emulated`` (the ops' launches on CPU tensors go to them; yields the list of launched
    kernels' names). Use: ``host_kernels, emulated = loader.op_fixtures("route_sums")``."""
    import pytest

    @pytest.fixture(scope="module")
    def host_kernels():
        return built(module)

    @pytest.fixture
    def emulated(host_kernels, monkeypatch):
        return redirect(monkeypatch, host_kernels)

    return host_kernels, emulated


def planted(old, new):
    """``HostKernels`` whose module texts have ``old`` replaced by ``new`` (a planted bug;
    ``old`` must be in the text)."""
    def source(module):
        text = module_text(module)
        assert old in text, f"{old!r} is not in {module}'s text"
        return text.replace(old, new)
    return HostKernels(source)
