"""Every CUDA kernel source compiles with nvcc for sm_90 (H100/H200) and sm_80 (A100).

CPU CI: the exact text the loader hands to NVRTC (``_cuda_loader.module_source``: the
DS_FP4_* defines from ds_fp4.formats, common.cuh, the .cu file), with the loader's options,
both with the sm_89+ E4M3 conversion instructions and with the portable fallback. A broken
kernel source fails here instead of on the first GPU that imports it. Skipped, with the
reason, where nvcc is not installed.
"""

import contextlib
import re
import shutil
import subprocess
import sys

import pytest

from ds_fp4.ops import _cuda_loader as L

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (CUDA toolkit needed)")
SPILLS_MEASURED = ("fp8_segments",)


def _nvcc_options():
    """The loader's NVRTC options (each is also an nvcc option)."""
    return list(L.NVRTC_OPTIONS)


@needs_nvcc
# sm_80 has no E4M3 conversion instructions: common.cuh takes the portable path there with
# or without DS_FP4_SOFT_CVT, so one sm_80 build covers both
@pytest.mark.parametrize("arch, soft_cvt", [("sm_90", False), ("sm_90", True), ("sm_80", False)],
                         ids=["sm_90-hw_cvt", "sm_90-soft_cvt", "sm_80"])
@pytest.mark.parametrize("module", L.MODULES)
def test_kernel_source_compiles(module, arch, soft_cvt, tmp_path):
    src = tmp_path / f"{module}.cu"
    src.write_text(L.module_source(module, soft_cvt))
    out = tmp_path / f"{module}.cubin"
    proc = subprocess.run([NVCC, f"-arch={arch}", "-cubin", "-Xptxas", "-v", *_nvcc_options(),
                           "-o", str(out), str(src)], capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"nvcc failed for {module} ({arch}):\n{log[-4000:]}"
    assert "warning" not in log.lower(), f"nvcc warnings for {module} ({arch}):\n{log[-4000:]}"
    # every kernel the Python side launches exists, and none spills to local memory (the
    # segment quantizers excepted: their name_o3 variants trade spills for occupancy by
    # design, and fp8_seg_plain_bf16_r spills 4 bytes on sm_90; fp8_segments.py times them)
    kernels = re.findall(r"Compiling entry function '(\w+)'", log)
    assert kernels, log[-2000:]
    spills = re.findall(r"(\d+) bytes spill stores", log)
    assert module in SPILLS_MEASURED or all(int(n) == 0 for n in spills), \
        f"register spills in {module} ({arch}):\n{log}"


def test_loader_defines_come_from_formats():
    """The defines carry formats.py's values (a changed constant reaches the kernels)."""
    from ds_fp4 import formats as F
    d = L.format_defines()
    assert d["DS_FP4_E8M0_BIAS"] == str(F.E8M0_BIAS)
    assert d["DS_FP4_E4M3_NAN"] == f"0x{F.E4M3_NAN:02X}u"
    assert d["DS_FP4_FP8_GROUP"] == str(F.FP8_GROUP)
    assert [d[f"DS_FP4_E2M1_V{c}"] for c in range(8)] == [f"{float(v)!r}f" for v in F.E2M1_VALUES]
    # rceil thresholds: 6 = 0.75 * 2^3 and 448 = 0.875 * 2^9
    assert (d["DS_FP4_MX_VE"], d["DS_FP4_MX_MANT_THR"]) == ("3", "0x400000u")
    assert (d["DS_FP4_FP8_VE"], d["DS_FP4_FP8_MANT_THR"]) == ("9", "0x600000u")
    for name in L.MODULES:
        src = L.module_source(name)
        used = set(re.findall(r"\bDS_FP4_[A-Z0-9_]+\b", src.split("\n", len(d))[-1]))
        defined = set(d) | {"DS_FP4_SOFT_CVT", "DS_FP4_HW_E4M3", "DS_FP4_HOST_EMU"} | set(
            re.findall(r"#define (DS_FP4_\w+)", src))
        assert used <= defined, f"{name} uses undefined {sorted(used - defined)}"


def test_cuda_module_imports_without_cupy():
    """ds_fp4.ops.cuda and its loader import without importing CuPy (CPU-only installs)."""
    code = ("import sys, ds_fp4.ops.cuda, ds_fp4.ops._cuda_loader; "
            "assert 'cupy' not in sys.modules, 'cupy imported eagerly'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


class _FakeCuPy:
    """What ``_cuda_loader.launch`` touches of CuPy, recording the launches."""

    def __init__(self, device):
        self.calls = []
        fake = self
        self.cuda = type("cuda", (), {})()
        self.cuda.runtime = type("runtime", (), {"getDevice": staticmethod(lambda: device)})()
        self.cuda.driver = type("driver", (), {"launchKernel": staticmethod(
            lambda *a: fake.calls.append(("driver", a)))})()


class _FakeKernel:
    def __init__(self, calls):
        self.calls = calls
        self.kernel = type("Function", (), {"ptr": 0xF00D})()

    def __call__(self, grid, block, args, stream=None):
        self.calls.append(("cupy", grid, block, args))


def _fake_loader(monkeypatch, device_now):
    cupy = _FakeCuPy(device_now)
    kernel = _FakeKernel(cupy.calls)
    monkeypatch.setattr(L, "_cupy", lambda: cupy)
    # the compiled kernel, found where get_kernel memoizes it
    monkeypatch.setattr(L, "_functions", {(0, "fp8_tiles", False, "k"): kernel})
    monkeypatch.setattr(L, "_torch_stream_handle", lambda index: 0x5EED)
    monkeypatch.setattr(L, "_device_scope", lambda cupy, index: contextlib.nullcontext())
    monkeypatch.setattr(L, "cupy_stream", lambda cupy, index: "stream")
    monkeypatch.setattr(L, "_packers", {})
    return cupy


def test_launch_packs_arguments_for_the_driver(monkeypatch):
    """A launch goes to ``cuLaunchKernel`` with the kernel's handle, the grid padded to 3-D,
    torch's stream, and a table whose slots hold each argument's own bytes (what CuPy's call
    would pass); a 4-byte argument sits at its slot's start."""
    import torch
    cupy = _fake_loader(monkeypatch, device_now=0)
    args = (L.u64(2 ** 63 + 5), L.i64(-3), L.u32(7), L.ptr(torch.empty(0)), L.u32(2 ** 32 - 1))
    L.launch(torch.device("cuda", 0), "fp8_tiles", "k", (4, 2), args, block=128)
    (kind, call), = cupy.calls
    assert kind == "driver"
    assert call[:9] == (0xF00D, 4, 2, 1, 128, 1, 1, 0, 0x5EED) and call[10] == 0
    (packed,) = L._packers.values()
    assert call[9] == packed.table_address
    assert packed.slots() == [a.tobytes().ljust(8, b"\0") for a in args]
    # a launch of other values refills the same buffer
    L.launch(torch.device("cuda", 0), "fp8_tiles", "k", 3,
             (L.u64(1), L.i64(2), L.u32(3), L.u64(4), L.u32(5)))
    assert len(L._packers) == 1 and cupy.calls[-1][1][1:4] == (3, 1, 1)
    assert packed.slots() == [v.to_bytes(8, "little") for v in (1, 2, 3, 4, 5)]


def test_launch_leaves_other_devices_and_types_to_cupy(monkeypatch):
    """Another current device (the call needs CuPy's device scope) or an argument type
    without a slot (a Python int) launches through CuPy's call, with the arguments as given."""
    import torch
    cupy = _fake_loader(monkeypatch, device_now=1)
    args = (L.u64(1), L.u32(2))
    L.launch(torch.device("cuda", 0), "fp8_tiles", "k", 5, args)
    _fake_loader(monkeypatch, device_now=0)
    cupy2 = L._cupy()
    L.launch(torch.device("cuda", 0), "fp8_tiles", "k", 5, (L.u64(1), 2))
    assert cupy.calls == [("cupy", (5,), (L.BLOCK,), args)]
    assert cupy2.calls == [("cupy", (5,), (L.BLOCK,), (L.u64(1), 2))] and not L._packers


def test_packed_arguments_refuse_values_out_of_range():
    """A value that does not fit its slot's type raises (no silent wrap-around)."""
    import struct
    import numpy as np
    packed = L._Packed(0, (np.uint64, np.uint32))
    with pytest.raises(struct.error):
        packed.pack((-1, 1))
    with pytest.raises(struct.error):
        packed.pack((1, 2 ** 32))
