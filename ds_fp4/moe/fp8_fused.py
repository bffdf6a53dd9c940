"""Fused FP8 quantizers for the FP8 experts: all experts' weights in one launch, and the
token-major activations quantized row-wise and column-wise from one read.

Two operations, each with a CUDA kernel (``fp8_fused.cu`` beside this file, built through
CuPy with the same ``DS_FP4_*`` defines and ``common.cuh`` as ``ds_fp4.ops``) and a
pure-PyTorch twin of the same signature that computes the same bytes:

- ``tile_quant(weights, per_group, transpose)``: 128x128 FP8 tiles of ``len(weights)``
  same-shape weights, grouped ``per_group`` at a time into one ``[per_group * R, C]``
  operand per group (e.g. an expert's gate and up), as ``quantize_fp8_tile_groups`` does.
- ``segment_quant(x, segments, seg_len, row, col, source, dh)``: FP8 1x128 quantization of
  ``segments`` blocks of ``seg_len`` tokens (one per local expert) along features (``row``:
  the data/dgrad GEMM operand) and along tokens (``col``: the transposed weight-gradient
  operand, each segment zero padded to a multiple of 128 tokens), optionally computing the
  SwiGLU output ``h`` or its gradient ``dz`` from ``z`` (bf16 or packed MXFP4 rows) on the
  way in. The bytes equal ``ops.quantize_fp8`` of the same values.

CUDA tensors use the kernels unless ``ds_fp4.ops`` runs in ``reference`` mode, CuPy is
missing, or ``set_enabled(False)`` was called; everything else uses the twins.
"""

import contextlib
import pathlib
import threading

import numpy as np
import torch
from torch.nn import functional as F

from ds_fp4 import formats
from ds_fp4 import ops
from ds_fp4.ops import _cuda_loader as L
from ds_fp4.moe.fp8_gemm import quantize_fp8_tile_groups

__all__ = ["tile_quant", "tile_quant_ref", "segment_quant", "segment_quant_ref",
           "swiglu_ref", "swiglu_grad_ref", "kernels_used", "set_enabled", "enabled",
           "kernel_choices", "forced_variant", "module_source", "SOURCES"]

G = formats.FP8_GROUP
SOURCES = ("plain", "swiglu", "swiglu_grad")
_CU = pathlib.Path(__file__).resolve().with_name("fp8_fused.cu")
_OPS_DIR = pathlib.Path(ops.__file__).resolve().parent
_THREADS = 256
_GRID_MAX = 65535
_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_enabled = True
_lock = threading.Lock()
_modules = {}        # device index -> cupy.RawModule
_functions = {}      # (device index, kernel name) -> cupy.RawKernel
_tables = {}         # (device index, pointers) -> (device int64 table, pinned host copy)
_variants = {}       # (device index, kernel, grid) -> the fastest of its candidates
_TABLES_KEPT = 16
# Variants of every segment kernel, timed on first use per shape: the kernel itself (one
# CTA per tile) and name_o3 (the same, 3 CTAs per SM); for the plain bf16 source also the
# persistent, pipelined name_p, launched as CTAs-per-SM (the value here) times the SM count.
_SEG_VARIANTS = ("", "_o3")
_PIPELINED = {"_p": 2}
_PIPELINED_SOURCES = ("plain_bf16",)
_forced = None       # a variant suffix that _launch_tuned launches instead of timing
_sm_counts = {}      # device index -> multiprocessor count


# ---- the math twins (float32 math, one bf16 rounding, as torch's float kernels) ----------


def swiglu_ref(z):
    """bf16 ``z [T, 2F]`` (gate | up) -> bf16 ``silu(gate) * up`` ``[T, F]``, float32 math."""
    gate, up = z.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(torch.bfloat16)


def swiglu_grad_ref(z, dh):
    """``d(silu(gate) * up) / d[gate, up] * dh`` as bf16 ``[T, 2F]``, float32 math."""
    gate, up = z.float().chunk(2, dim=-1)
    dh, sig = dh.float(), torch.sigmoid(gate)
    d_gate = dh * up * sig * (1 + gate * (1 - sig))
    return torch.cat((d_gate, dh * gate * sig), dim=-1).to(torch.bfloat16)


# ---- switches -------------------------------------------------------------------------


def set_enabled(flag):
    """Allow (True, default) or forbid the CUDA kernels of this module (twins everywhere)."""
    global _enabled
    _enabled = bool(flag)


@contextlib.contextmanager
def enabled(flag):
    """Context manager: ``set_enabled(flag)`` inside, the previous setting after."""
    global _enabled
    before, _enabled = _enabled, bool(flag)
    try:
        yield
    finally:
        _enabled = before


def kernels_used(*tensors):
    """Whether an op on ``tensors`` runs the CUDA kernels (see the module docstring)."""
    if not _enabled or not all(t.is_cuda for t in tensors):
        return False
    if ops.get_kernels() == "reference":
        return False
    try:
        _cupy()
    except ImportError:
        return False
    return True


# ---- 128x128 weight tiles -------------------------------------------------------------


def _check_tiles_args(weights, per_group):
    if not weights or per_group < 1 or len(weights) % per_group:
        raise ValueError(f"tile_quant needs a non-empty list of weights whose length is a "
                         f"multiple of per_group = {per_group}; got {len(weights)}")
    first = weights[0]
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError(f"weights[{i}] must be a 2-D tensor [R, C]")
        if (w.shape, w.dtype, w.device) != (first.shape, first.dtype, first.device):
            raise ValueError(f"weights[{i}] must share shape, dtype and device with weights[0]: "
                             f"{tuple(w.shape)} {w.dtype} {w.device} vs {tuple(first.shape)} "
                             f"{first.dtype} {first.device}")
    if first.dtype not in _SUFFIX:
        raise TypeError(f"weights must be bfloat16, float16 or float32; got {first.dtype}")
    if first.shape[0] % G or first.shape[1] % G:
        raise ValueError(f"weights [R, C] need R and C multiples of {G}; got "
                         f"{tuple(first.shape)}")


def tile_quant_ref(weights, per_group, transpose=False):
    """The PyTorch twin of ``tile_quant`` (same arguments, same bytes)."""
    _check_tiles_args(weights, per_group)
    groups = [tuple(weights[i:i + per_group]) for i in range(0, len(weights), per_group)]
    done = quantize_fp8_tile_groups(groups, transpose=transpose)
    return torch.stack([d for d, _ in done]), torch.stack([s for _, s in done])


def tile_quant(weights, per_group, transpose=False):
    """FP8 128x128 tiles of groups of weights, all in one launch.

    Arguments:
        weights: list of ``len = G * per_group`` tensors ``[R, C]``, bf16/fp16/fp32, same
            shape, dtype and device, ``R % 128 == C % 128 == 0``; group g is
            ``weights[g*per_group:(g+1)*per_group]`` stacked along R.
        per_group: weights per group (2 for an expert's gate and up, 1 for down).
        transpose: quantize each group's transpose (data-gradient GEMM operand).
    Returns:
        data: float8_e4m3fn ``[G, per_group*R, C]`` (``[G, C, per_group*R]`` if transpose).
        scales: float32 ``[G, per_group*R/128, C/128]`` (its per-group transpose if
            transpose); a tile holding NaN/Inf has scale NaN and all bytes E4M3 NaN.
    """
    _check_tiles_args(weights, per_group)
    first = weights[0]
    if not kernels_used(first) or not all(w.is_contiguous() for w in weights):
        return tile_quant_ref(weights, per_group, transpose)
    r, c = first.shape
    groups = len(weights) // per_group
    n = per_group * r
    if groups * per_group > _GRID_MAX or r // G > _GRID_MAX:
        return tile_quant_ref(weights, per_group, transpose)
    shape = (groups, c, n) if transpose else (groups, n, c)
    data = torch.empty(shape, dtype=formats.FP8_DTYPE, device=first.device)
    scales = torch.empty((groups,) + ((c // G, n // G) if transpose else (n // G, c // G)),
                         dtype=torch.float32, device=first.device)
    tiles = (n // G) * (c // G)
    if transpose:
        strides = (c * n, r, n, tiles, r // G, 1, n // G)
    else:
        strides = (n * c, r * c, c, tiles, (r // G) * (c // G), c // G, 1)
    out_g, out_j, out_pitch, sc_g, sc_j, sc_r, sc_c = strides
    name = f"fp8_tiles_{_SUFFIX[first.dtype]}" + ("_t" if transpose else "")
    args = (_u64(_pointer_table(weights).data_ptr()), np.int64(c), np.uint32(per_group),
            _u64(data.data_ptr()), np.int64(out_g), np.int64(out_j), np.int64(out_pitch),
            _u64(scales.data_ptr()), np.int64(sc_g), np.int64(sc_j), np.int64(sc_r),
            np.int64(sc_c))
    _launch(first.device, name, (c // G, r // G, len(weights)), args)
    return data, scales


def _pointer_table(weights):
    """A device int64 table of the weights' addresses, cached (parameters rarely move);
    filled from pinned memory without a device synchronization."""
    device = weights[0].device
    key = (device.index, tuple(w.data_ptr() for w in weights))
    hit = _tables.get(key)
    if hit is None:
        host = torch.tensor(key[1], dtype=torch.int64).pin_memory()
        hit = (host.to(device, non_blocking=True), host)
        if len(_tables) >= _TABLES_KEPT:
            _tables.pop(next(iter(_tables)))
        _tables[key] = hit
    L.hold_while_captured(device, hit)    # the table and its pinned source
    return hit[0]


# ---- token segments ---------------------------------------------------------------------


def _check_segment_args(x, segments, seg_len, row, col, source, dh):
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}; got {source!r}")
    if not (row or col):
        raise ValueError("segment_quant needs row=True and/or col=True")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("x must be a 2-D tensor [segments * seg_len, features]")
    if x.shape[0] != segments * seg_len:
        raise ValueError(f"x has {x.shape[0]} rows; segments * seg_len = {segments * seg_len}")
    mx = x.dtype == torch.uint8
    if source == "plain":
        if x.dtype not in _SUFFIX:
            raise TypeError(f"x must be bfloat16, float16 or float32; got {x.dtype}")
        k = x.shape[1]
    else:
        if x.dtype not in (torch.bfloat16, torch.uint8):
            raise TypeError(f"z must be bfloat16 or packed MXFP4 rows (uint8); got {x.dtype}")
        two_f = x.shape[1] if not mx else x.shape[1] // formats.MXFP4_ROW_UNIT * formats.MX_BLOCK
        if mx and x.shape[1] != formats.mxfp4_row_bytes(two_f):
            raise ValueError(f"z rows of {x.shape[1]} bytes are not packed MXFP4 rows")
        k = two_f // 2 if source == "swiglu" else two_f
        if source == "swiglu_grad":
            want = (x.shape[0], two_f // 2)
            if not isinstance(dh, torch.Tensor) or dh.dtype != torch.bfloat16 \
                    or tuple(dh.shape) != want or dh.device != x.device:
                raise ValueError(f"dh must be bfloat16 {want} on {x.device}; got "
                                 f"{getattr(dh, 'dtype', None)} {tuple(getattr(dh, 'shape', ()))}")
        if (two_f // 2) % G:
            raise ValueError(f"z's ffn = {two_f // 2} must be a multiple of {G}")
    if k % G:
        raise ValueError(f"the quantized features ({k}) must be a multiple of {G}")
    return k


def _source_values(x, source, dh):
    if source == "plain":
        return x
    # uint8 z is packed MXFP4 rows by this function's contract: K follows from the width
    k = x.shape[1] // formats.MXFP4_ROW_UNIT * formats.MX_BLOCK
    z = ops.dequantize_mxfp4_rows(x, torch.bfloat16, k) if x.dtype == torch.uint8 else x
    return swiglu_ref(z) if source == "swiglu" else swiglu_grad_ref(z, dh)


def segment_quant_ref(x, segments, seg_len, row=True, col=False, source="plain", dh=None):
    """The PyTorch twin of ``segment_quant`` (same arguments, same bytes)."""
    k = _check_segment_args(x, segments, seg_len, row, col, source, dh)
    val = _source_values(x, source, dh)
    padded = -(-seg_len // G) * G
    row_out = col_out = None
    if row:
        data, scales = ops.quantize_fp8(val)           # scales [M, K/128], strides (1, M)
        scales = scales.t().reshape(k // G, segments, seg_len).transpose(0, 1).contiguous()
        row_out = (data, scales)
    if col:
        datas, scaless = [], []
        for s in range(segments):
            part = val.new_zeros(k, padded)
            part[:, :seg_len] = val[s * seg_len:(s + 1) * seg_len].t()
            data, scales = ops.quantize_fp8(part)       # scales [K, P/128], strides (1, K)
            datas.append(data)
            scaless.append(scales.t())
        if not datas:
            datas = [torch.empty(k, padded, dtype=formats.FP8_DTYPE, device=x.device)]
            scaless = [torch.empty(padded // G, k, dtype=torch.float32, device=x.device)]
        col_out = (torch.stack(datas)[:segments], torch.stack(scaless)[:segments])
    return row_out, col_out


def segment_quant(x, segments, seg_len, row=True, col=False, source="plain", dh=None):
    """FP8 1x128 quantization of token segments along features and/or along tokens.

    Arguments:
        x: ``[segments * seg_len, K]`` bf16/fp16/fp32 (``source="plain"``), or ``z``:
            bf16 ``[segments * seg_len, 2F]`` or its packed MXFP4 rows uint8 ``[..., F +
            F/16]`` (``"swiglu"``, ``"swiglu_grad"``); unit stride along features.
        segments, seg_len: the token blocks (segment s = rows s*seg_len .. +seg_len).
        row, col: which quantizations to return.
        source: ``"plain"`` (x itself), ``"swiglu"`` (``swiglu_ref(z)``, K = F) or
            ``"swiglu_grad"`` (``swiglu_grad_ref(z, dh)``, K = 2F).
        dh: bf16 ``[segments * seg_len, F]`` for ``"swiglu_grad"``.
    Returns:
        ``(row, col)``, each None unless asked for:
        row: ``(data float8 [segments*seg_len, K], scales float32 [segments, K/128,
            seg_len])``; segment s's GEMM operand is ``(data[s*L:(s+1)*L], scales[s].t())``.
        col: ``(data float8 [segments, K, P], scales float32 [segments, P/128, K])`` with
            ``P = seg_len`` rounded up to 128 (zero tokens): the quantization of segment
            s's zero-padded transpose, operand ``(data[s], scales[s].t())``.
    """
    k = _check_segment_args(x, segments, seg_len, row, col, source, dh)
    tensors = (x,) if dh is None else (x, dh)
    padded = -(-seg_len // G) * G
    if (not kernels_used(*tensors) or x.stride(-1) != 1 or (dh is not None and dh.stride(-1) != 1)
            or padded // G > _GRID_MAX or segments > _GRID_MAX):
        return segment_quant_ref(x, segments, seg_len, row, col, source, dh)
    dev = x.device
    row_out = col_out = None
    zero = _u64(0)
    row_args, col_args = (zero, zero), (zero, zero)
    if row:
        row_out = (torch.empty(segments * seg_len, k, dtype=formats.FP8_DTYPE, device=dev),
                   torch.empty(segments, k // G, seg_len, dtype=torch.float32, device=dev))
        row_args = (_u64(row_out[0].data_ptr()), _u64(row_out[1].data_ptr()))
    if col:
        col_out = (torch.empty(segments, k, padded, dtype=formats.FP8_DTYPE, device=dev),
                   torch.empty(segments, padded // G, k, dtype=torch.float32, device=dev))
        col_args = (_u64(col_out[0].data_ptr()), _u64(col_out[1].data_ptr()))
    if segments * seg_len == 0:
        return row_out, col_out
    if source == "plain":
        kind, ffn = _SUFFIX[x.dtype], 0
    else:
        kind = "mx" if x.dtype == torch.uint8 else "bf16"
        ffn = k // 2 if source == "swiglu_grad" else k
    name = f"fp8_seg_{source}_{kind}_" + ("r" if not col else "c" if not row else "rc")
    dh_ptr, dh_pitch = (_u64(dh.data_ptr()), dh.stride(0)) if dh is not None else (zero, 0)
    args = (_u64(x.data_ptr()), np.int64(x.stride(0)), dh_ptr, np.int64(dh_pitch),
            np.uint32(ffn), np.uint32(seg_len), np.uint32(k), np.uint32(padded), *row_args,
            *col_args)
    grid = (k // G, padded // G, segments)
    candidates = [(name + v, grid, args) for v in _SEG_VARIANTS]
    if f"{source}_{kind}" in _PIPELINED_SOURCES:
        tiles = grid[0] * grid[1] * grid[2]
        for suffix, per_sm in _PIPELINED.items():
            p_grid = (min(tiles, per_sm * _sm_count(dev)), 1, 1)
            candidates.append((name + suffix, p_grid, args + (np.uint32(segments),)))
    _launch_tuned(dev, name, grid, candidates)
    return row_out, col_out


# ---- build and launch -----------------------------------------------------------------------


def module_source():
    """The CUDA text compiled: the ds_fp4 format defines, common.cuh, fp8_fused.cu."""
    lines = [f"#define {k} {v}" for k, v in L.format_defines().items()]
    header = (_OPS_DIR / "common.cuh").read_text()
    body = _CU.read_text().replace('#include "common.cuh"', header)
    return "\n".join(lines) + "\n" + body


def _cupy():
    import cupy  # noqa: PLC0415  (lazy: only CUDA tensors need it)
    return cupy


def _module(cupy, index):
    mod = _modules.get(index)
    if mod is None:
        with _lock:
            mod = _modules.get(index)
            if mod is None:
                mod = cupy.RawModule(code=module_source(), options=tuple(L.NVRTC_OPTIONS))
                _modules[index] = mod
    return mod


def _launch(device, name, grid, args):
    """Launch kernel ``name`` on ``device``'s current torch stream."""
    cupy = _cupy()
    index = device.index if device.index is not None else torch.cuda.current_device()
    scope = (contextlib.nullcontext() if cupy.cuda.runtime.getDevice() == index
             else cupy.cuda.Device(index))
    with scope:
        fn = _functions.get((index, name))
        if fn is None:
            fn = _functions[(index, name)] = _module(cupy, index).get_function(name)
        fn(grid, (_THREADS,), args, stream=L.cupy_stream(cupy, index))


def _sm_count(device):
    """The device's multiprocessor count (cached)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


@contextlib.contextmanager
def forced_variant(suffix):
    """Context manager for tests and benchmarks: segment kernels launch their variant
    ``name + suffix`` (``""``, ``"_o3"``, ``"_p"``) where it exists, untimed and
    unrecorded, instead of the fastest one; ``None`` restores the timing."""
    global _forced
    before, _forced = _forced, suffix
    try:
        yield
    finally:
        _forced = before


def _launch_tuned(device, name, grid, candidates):
    """Launch the fastest of ``candidates`` (``(kernel, grid, args)`` variants of kernel
    ``name`` that write the same bytes): on the first launch of a (device, kernel, grid),
    each runs on the current stream and is timed with CUDA events (one device
    synchronization, once per shape); later launches take the recorded choice."""
    if _forced is not None:
        for candidate in candidates:
            if candidate[0] == name + _forced:
                _launch(device, *candidate)
                return
    key = (device.index, name, grid)
    by_name = {c[0]: c for c in candidates}
    choice = _variants.get(key)
    if choice is not None:
        _launch(device, *by_name[choice])
        return
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        _launch(device, *candidates[0])
        return
    times = {}
    for candidate in candidates:
        _launch(device, *candidate)                     # first run: loads the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _launch(device, *candidate)
        end.record()
        times[candidate[0]] = (start, end)
    end.synchronize()
    _variants[key] = min(times, key=lambda c: times[c][0].elapsed_time(times[c][1]))


def kernel_choices():
    """``{(device, kernel, grid): chosen variant}`` made so far (for benchmarks' reports)."""
    return dict(_variants)


def _u64(v):
    return np.uint64(v)
