"""Build and launch ds_fp4's CUDA kernels through CuPy's RawModule.

Every CUDA source of ds_fp4 is a ``.cu`` file next to this one (``MODULES``), with the
``.cuh`` headers it includes. The sources receive every format number, and the launch
geometry (``BLOCK`` threads a CTA), as a ``DS_FP4_*`` ``#define`` computed here from
``ds_fp4.formats``; ``module_source`` returns the exact text that is compiled (the CPU
compile test feeds the same text to nvcc). CuPy is imported only when a kernel is first
needed, so CPU-only installs never touch it.

Tensors are passed to kernels as raw device pointers of the torch tensors: the kernels read
and write torch's memory in place (the zero-copy sharing DLPack would give, without its
per-call capsule and cross-stream event), on torch's current stream of the tensor's device.
CuPy compiles and loads the kernels; ``launch`` hands them to the driver's ``cuLaunchKernel``
itself, the arguments packed once per call into a buffer kept per kernel (``_Packed``).
"""

import contextlib
import ctypes
import math
import pathlib
import re
import struct
import threading

import numpy as np
import torch

from ds_fp4 import formats as F

_DIR = pathlib.Path(__file__).resolve().parent
MODULES = ("mxfp4_quant", "fp8_quant", "mxfp4_to_fp8", "mxfp4_to_fp8_colwise", "fp8_tiles",
           "fp8_segments", "route_grads", "encode_routes", "split_bf16", "route_sums")
NVRTC_OPTIONS = ("-std=c++17", "--fmad=false", "--ftz=false", "--prec-div=true")
BLOCK = 256          # threads a CTA, every kernel (DS_FP4_BLOCK in the sources)
GRID_YZ_MAX = 65535  # CUDA's limit on gridDim.y and gridDim.z
DTYPE_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}  # kernel names
_INCLUDE = re.compile(r'^#include "(\w+\.cuh)"$', re.MULTILINE)

_lock = threading.Lock()
_modules = {}      # (device index, module, soft_cvt) -> cupy.RawModule
_functions = {}    # (device index, module, soft_cvt, kernel name) -> cupy.RawKernel
_streams = {}      # (device index, stream handle) -> cupy stream object
_sm_counts = {}    # device index -> multiprocessor count
_graph_held = []   # device tables that captured CUDA graphs read by address
_soft_cvt = False  # tests: run the portable E4M3 conversions instead of sm_89+ cvt


def _e2m1_layout():
    """(mantissa bits, min normal exponent) of E2M1, checked against ``E2M1_VALUES``."""
    mant = 1
    emin = 1 - F.E2M1_EXP_BIAS
    grid = [m * 2.0 ** (emin - mant) for m in range(2 ** mant)]           # subnormals
    for ex in range(emin, emin + 3):
        grid += [(1 + m / 2 ** mant) * 2.0 ** ex for m in range(2 ** mant)]
    if tuple(grid) != tuple(F.E2M1_VALUES):
        raise RuntimeError(f"E2M1_VALUES {F.E2M1_VALUES} do not follow the s e1 e0 m layout "
                           f"the kernels decode; update the .cu sources with formats.py")
    return mant, emin


def _mant_threshold(vmax):
    """(VE, mantissa field of vm) with vmax = vm * 2^VE, vm in [0.5, 1)."""
    vm, ve = math.frexp(vmax)
    thr = (2 * vm - 1) * 2 ** 23
    assert thr == int(thr)
    return ve, int(thr)


def _e4m3_byte(value):
    return int(torch.tensor(value).to(F.FP8_DTYPE).view(torch.uint8))


def format_defines():
    """Every ``DS_FP4_*`` macro the sources use, as ``{name: C literal}``."""
    mant, emin = _e2m1_layout()
    mx_ve, mx_thr = _mant_threshold(F.E2M1_MAX)
    fp8_ve, fp8_thr = _mant_threshold(F.E4M3_MAX)
    fp8_vm = math.frexp(F.E4M3_MAX)[0]
    # mxfp4_to_fp8 derives the FP8 exponent from floor(log2 amax) alone: valid while every
    # E2M1 value's frexp mantissa is at most 448's.
    if any(math.frexp(v)[0] > fp8_vm for v in F.E2M1_VALUES if v):
        raise RuntimeError("an E2M1 mantissa exceeds E4M3_MAX's: mxfp4_to_fp8.cu needs the full rule")
    d = {
        "BLOCK": BLOCK,
        "MX_BLOCK": F.MX_BLOCK,
        "FP8_GROUP": F.FP8_GROUP,
        "E8M0_BIAS": F.E8M0_BIAS,
        "E8M0_NAN": F.E8M0_NAN,
        "MX_EXP_MIN": F.MX_EXP_MIN,
        "MX_EXP_MAX": F.MX_EXP_MAX,
        "MX_VE": mx_ve,
        "MX_MANT_THR": f"0x{mx_thr:X}u",
        # floor rule: e = floor(log2 A) - emax(E2M1) = frexp exponent - 1 - emax
        "MX_FLOOR_SUB": 1 + (math.frexp(F.E2M1_MAX)[1] - 1),
        "FP8_EXP_MIN": F.FP8_EXP_MIN,
        "FP8_EXP_MAX": F.FP8_EXP_MAX,
        "FP8_VE": fp8_ve,
        "FP8_MANT_THR": f"0x{fp8_thr:X}u",
        "E4M3_MAX": f"{F.E4M3_MAX!r}f",
        "E4M3_MAX_BYTE": f"0x{_e4m3_byte(F.E4M3_MAX):02X}u",
        "E4M3_EXP_BIAS": F.E4M3_EXP_BIAS,
        "E4M3_MANT_BITS": F.E4M3_MANT_BITS,
        "E4M3_NAN": f"0x{F.E4M3_NAN:02X}u",
        "E2M1_SIGN_BIT": f"0x{F.E2M1_SIGN_BIT:X}u",
        "E2M1_EXP_BIAS": F.E2M1_EXP_BIAS,
        "E2M1_MANT_BITS": mant,
        "E2M1_EMIN": emin,
        "E2M1_MAX_CODE": len(F.E2M1_VALUES) - 1,
        "EXACT_SPREAD": F.MXFP4_TO_FP8_EXACT_SPREAD,
    }
    for c, v in enumerate(F.E2M1_VALUES):
        d[f"E2M1_V{c}"] = f"{float(v)!r}f"
    return {f"DS_FP4_{k}": str(v) for k, v in d.items()}


def _inline_headers(text, seen):
    """``text`` with each ``#include "x.cuh"`` replaced by that header's own text (inlined
    the same way) the first time, by nothing after: NVRTC compiles one string."""
    def header(match):
        name = match.group(1)
        if name in seen:
            return ""
        seen.add(name)
        return _inline_headers((_DIR / name).read_text(), seen)
    return _INCLUDE.sub(header, text)


def module_source(name, soft_cvt=False):
    """The full CUDA text of module ``name``: defines, then ``name.cu`` with its headers
    (common.cuh first) inlined."""
    if name not in MODULES:
        raise ValueError(f"unknown kernel module {name!r}; one of {MODULES}")
    lines = [f"#define {k} {v}" for k, v in format_defines().items()]
    if soft_cvt:
        lines.append("#define DS_FP4_SOFT_CVT 1")
    body = _inline_headers((_DIR / f"{name}.cu").read_text(), set())
    return "\n".join(lines) + "\n" + body


# ---- run time (CuPy) --------------------------------------------------------------------


def _cupy():
    import cupy  # noqa: PLC0415  (lazy: only CUDA tensors need it)
    return cupy


def _device_scope(cupy, index):
    """A context that makes ``index`` CuPy's current device (a no-op when it already is)."""
    if cupy.cuda.runtime.getDevice() == index:
        return contextlib.nullcontext()
    return cupy.cuda.Device(index)


def get_kernel(device_index, module, name, soft_cvt=False):
    """The compiled kernel ``name`` of ``module`` for device ``device_index`` (memoized)."""
    key = (device_index, module, soft_cvt, name)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    cupy = _cupy()
    with _lock:
        mkey = key[:3]
        mod = _modules.get(mkey)
        if mod is None:
            mod = cupy.RawModule(code=module_source(module, soft_cvt), options=NVRTC_OPTIONS)
            _modules[mkey] = mod
        with _device_scope(cupy, device_index):
            fn = mod.get_function(name)     # compiles for this device's architecture
            fn.compile()
        _functions[key] = fn
    return fn


class _StreamRef:
    """Hands torch's stream handle to CuPy through the CUDA stream protocol."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


# torch.cuda.current_stream builds a torch.cuda.Stream object under a device guard on every
# call (measured as a large part of a launch's host time on the H200); torch's own compiled
# kernels read the raw handle through _cuda_getCurrentRawStream (absent in CPU builds).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _torch_stream_handle(index):
    """Device ``index``'s current torch stream as a raw ``cudaStream_t`` value."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def hold_while_captured(device, obj):
    """Keep ``obj`` (a cached device table a kernel reads by address) alive for good when
    it is used inside a CUDA graph capture on ``device``: a replay reads its address long
    after any cache would have dropped it (``ds_fp4.moe.expert_graphs``)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _graph_held.append(obj)


def cupy_stream(cupy, index):
    """The CuPy stream wrapping device ``index``'s current torch stream (memoized per handle)."""
    handle = _torch_stream_handle(index)
    key = (index, handle)
    stream = _streams.get(key)
    if stream is None:
        try:
            stream = cupy.cuda.Stream.from_external(_StreamRef(handle))
        except (AttributeError, TypeError, ValueError):   # CuPy < 14
            stream = cupy.cuda.ExternalStream(handle, index)
        _streams[key] = stream
    return stream


@contextlib.contextmanager
def soft_conversions():
    """Inside: kernels use the portable (pre-sm_89) E4M3 conversions; for tests."""
    global _soft_cvt
    before, _soft_cvt = _soft_cvt, True
    try:
        yield
    finally:
        _soft_cvt = before


def sm_count(device):
    """The multiprocessor count of CUDA ``device`` (memoized)."""
    index = device.index
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


def launch(device, module, name, grid, args, block=BLOCK):
    """Launch kernel ``name`` of ``module`` on ``device``'s current torch stream.

    Arguments:
        device: the ``torch.device`` all tensors of the call live on.
        grid: int or tuple of blocks; ``args``: the kernel's arguments in order, already
            converted by ``ptr`` / numpy scalar types.
    """
    if isinstance(grid, int):
        grid = (grid,)
    cupy = _cupy()
    index = device.index
    if cupy.cuda.runtime.getDevice() == index:
        packed = _packed(index, module, name, args)
        if packed is not None:
            packed.launch(cupy, grid, block, _torch_stream_handle(index), args)
            return
    fn = get_kernel(index, module, name, _soft_cvt)
    with _device_scope(cupy, index):
        fn(grid, (block,), args, stream=cupy_stream(cupy, index))


# Kernel arguments by type, each in an 8-byte slot (the driver reads a parameter's own size
# from its slot's start: little-endian, as every CUDA host is)
_SLOTS = {np.uint64: "Q", np.int64: "q", np.uint32: "I4x", np.int32: "i4x", np.float32: "f4x"}
_packers = {}   # (device index, module, soft_cvt, kernel name, argument types) -> _Packed


class _Packed:
    """One kernel's launch straight through ``cuLaunchKernel``, its arguments packed into a
    buffer kept for it, where CuPy's call converts every argument on every launch: the FP8
    layer at hidden 4096 (21 such launches a step) issued a step faster on an H200's host in
    9 of 12 rounds alternating in one process, medians 5.26 -> 4.94 ms
    (bench/results/driver_launches29_h200). The driver copies the arguments before the call
    returns, so the buffer is free again."""

    def __init__(self, function, types):
        self.function = function   # the CUfunction handle of the kernel on its device
        self.layout = struct.Struct("<" + "".join(_SLOTS[t] for t in types))
        self.buffer = ctypes.create_string_buffer(self.layout.size)
        base = ctypes.addressof(self.buffer)
        self.table = (ctypes.c_void_p * len(types))(*(base + 8 * i for i in range(len(types))))
        self.table_address = ctypes.addressof(self.table)
        self.lock = threading.Lock()   # one buffer: one launch at a time through it

    def pack(self, args):
        self.layout.pack_into(self.buffer, 0, *args)

    def slots(self):
        """The packed arguments as the driver reads them (tests)."""
        return [ctypes.string_at(a, 8) for a in self.table]

    def launch(self, cupy, grid, block, stream, args):
        gx, gy, gz = (*grid, 1, 1)[:3]
        with self.lock:
            self.pack(args)
            cupy.cuda.driver.launchKernel(self.function, gx, gy, gz, block, 1, 1, 0, stream,
                                          self.table_address, 0)


def _packed(index, module, name, args):
    """The ``_Packed`` launcher of kernel ``name`` of ``module`` on device ``index`` (the
    current one) for ``args``' types, or None for a type without a slot (CuPy's call
    handles those). A hit is one dict lookup: the kernel is looked up only to make one."""
    key = (index, module, _soft_cvt, name, tuple(map(type, args)))
    hit = _packers.get(key)
    if hit is None:
        if not all(t in _SLOTS for t in key[-1]):
            return None
        fn = get_kernel(index, module, name, _soft_cvt)
        hit = _packers[key] = _Packed(getattr(fn, "kernel", fn).ptr, key[-1])
    return hit


def ptr(t):
    """A tensor's device address as a kernel pointer argument."""
    return np.uint64(t.data_ptr())


def u64(v):
    return np.uint64(v)


def i64(v):
    return np.int64(v)


def u32(v):
    if not 0 <= v < 2 ** 32:
        raise ValueError(f"kernel argument {v} does not fit 32 bits; split the call")
    return np.uint32(v)


def fast_div(d):
    """(m, p) with n // d == (n * m) >> p for every 0 <= n < 2^31 (d >= 1)."""
    l = (d - 1).bit_length()               # ceil(log2 d)
    p = 31 + l
    m = -(-(1 << p) // d)
    return u32(m), u32(p)


def blocks_for(n, block=BLOCK):
    return (n + block - 1) // block
