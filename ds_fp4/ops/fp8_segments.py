"""FP8 1x128 quantization of the FP8 experts' token segments, row-wise and column-wise
from one read, optionally computing SwiGLU or its gradient on the way in.

``segment_quant(x, segments, seg_len, row, col, source, dh)`` quantizes ``segments`` blocks
of ``seg_len`` tokens (one per local expert) along features (``row``: the data/dgrad GEMM
operand) and along tokens (``col``: the transposed weight-gradient operand, each segment
zero padded to a multiple of 128 tokens), in one launch of ``fp8_segments.cu``; with
``source`` ``"swiglu"``/``"swiglu_grad"`` the values are the SwiGLU output ``h`` or its
gradient ``dz`` of bf16 ``z``. The bytes equal ``ops.quantize_fp8`` of the same values;
``segment_quant_ref`` is the PyTorch twin of the same signature. CUDA tensors run the
kernels where ``ds_fp4.ops.backend.uses_kernels`` says so (``set_kernels``), else the twin.
"""

import contextlib

import torch
from torch.nn import functional as F

from ds_fp4 import formats
from ds_fp4.ops import _cuda_loader as L
from ds_fp4.ops import backend, checks, reference

__all__ = ["segment_quant", "segment_quant_ref", "swiglu_ref", "swiglu_grad_ref", "SOURCES",
           "forced_variant", "kernel_choices"]

G = formats.FP8_GROUP
SOURCES = ("plain", "swiglu", "swiglu_grad")
_SUFFIX = L.DTYPE_SUFFIX
# Variants of every segment kernel, timed on first use per shape: the kernel itself (one
# CTA per tile) and name_o3 (the same, 3 CTAs per SM); for the plain bf16 source also the
# persistent, pipelined name_p, launched as CTAs-per-SM (the value here) times the SM count.
_SEG_VARIANTS = ("", "_o3")
_PIPELINED = {"_p": 2}
_PIPELINED_SOURCES = ("plain_bf16",)
_variants = {}       # (device index, kernel, grid) -> the fastest of its candidates
_forced = None       # a variant suffix that _launch_tuned launches instead of timing


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


# ---- arguments ---------------------------------------------------------------------------


def _check_segment_args(x, segments, seg_len, row, col, source, dh, index=None, scale=None):
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}; got {source!r}")
    if not (row or col):
        raise ValueError("segment_quant needs row=True and/or col=True")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("x must be a 2-D tensor [segments * seg_len, features]")
    if index is not None:
        if source != "plain":
            raise ValueError(f"index gathers the plain source's rows; got source={source!r}")
        checks.row_index("index", index, x.device)
        if index.numel() != segments * seg_len:
            raise ValueError(f"index has {index.numel()} entries; segments * seg_len = "
                             f"{segments * seg_len} (one source row per token)")
    elif x.shape[0] != segments * seg_len:
        raise ValueError(f"x has {x.shape[0]} rows; segments * seg_len = {segments * seg_len}")
    checks.row_scale("scale", scale, index, x.device)
    if source == "plain":
        if x.dtype not in _SUFFIX:
            raise TypeError(f"x must be bfloat16, float16 or float32; got {x.dtype}")
        k = x.shape[1]
    else:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"z must be bfloat16; got {x.dtype}")
        two_f = x.shape[1]
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
    return swiglu_ref(x) if source == "swiglu" else swiglu_grad_ref(x, dh)


# ---- the twin and the kernels ------------------------------------------------------------


def segment_quant_ref(x, segments, seg_len, row=True, col=False, source="plain", dh=None,
                      index=None, scale=None):
    """The PyTorch twin of ``segment_quant`` (same arguments, same bytes)."""
    k = _check_segment_args(x, segments, seg_len, row, col, source, dh, index, scale)
    if index is not None:
        x = reference.gathered_rows(x, index, scale)
    val = _source_values(x, source, dh)
    padded = -(-seg_len // G) * G
    quant = backend.select(val).quantize_fp8          # as ops.quantize_fp8
    row_out = col_out = None
    if row:
        data, scales = quant(val)                      # scales [M, K/128], strides (1, M)
        scales = scales.t().reshape(k // G, segments, seg_len).transpose(0, 1).contiguous()
        row_out = (data, scales)
    if col:
        datas, scaless = [], []
        for s in range(segments):
            part = val.new_zeros(k, padded)
            part[:, :seg_len] = val[s * seg_len:(s + 1) * seg_len].t()
            data, scales = quant(part)                  # scales [K, P/128], strides (1, K)
            datas.append(data)
            scaless.append(scales.t())
        if not datas:
            datas = [torch.empty(k, padded, dtype=formats.FP8_DTYPE, device=x.device)]
            scaless = [torch.empty(padded // G, k, dtype=torch.float32, device=x.device)]
        col_out = (torch.stack(datas)[:segments], torch.stack(scaless)[:segments])
    return row_out, col_out


def segment_quant(x, segments, seg_len, row=True, col=False, source="plain", dh=None,
                  index=None, scale=None):
    """FP8 1x128 quantization of token segments along features and/or along tokens.

    Arguments:
        x: ``[segments * seg_len, K]`` bf16/fp16/fp32 (``source="plain"``; with ``index``
            any number of rows), or ``z``: bf16 ``[segments * seg_len, 2F]`` (``"swiglu"``,
            ``"swiglu_grad"``); unit stride along features.
        segments, seg_len: the token blocks (segment s = rows s*seg_len .. +seg_len).
        row, col: which quantizations to return.
        source: ``"plain"`` (x itself), ``"swiglu"`` (``swiglu_ref(z)``, K = F) or
            ``"swiglu_grad"`` (``swiglu_grad_ref(z, dh)``, K = 2F).
        dh: bf16 ``[segments * seg_len, F]`` for ``"swiglu_grad"``.
        index: None, or (plain source) int64 ``[segments * seg_len]`` on x's device: token
            j is x's row ``index[j]``, a zero row where that is outside ``[0, x rows)``;
            the kernels read those rows in place (the gathered copy never exists).
        scale: None, or (with ``index``) float32 ``[segments * seg_len]``: token j's values
            are its row's times ``scale[j]``, rounded to x's dtype (the bytes of that
            scaled copy's quantization; a NaN or Inf scale gives NaN/Inf values as the
            product does; a zero row stays zero whatever its scale).
    Returns:
        ``(row, col)``, each None unless asked for:
        row: ``(data float8 [segments*seg_len, K], scales float32 [segments, K/128,
            seg_len])``; segment s's GEMM operand is ``(data[s*L:(s+1)*L], scales[s].t())``.
        col: ``(data float8 [segments, K, P], scales float32 [segments, P/128, K])`` with
            ``P = seg_len`` rounded up to 128 (zero tokens): the quantization of segment
            s's zero-padded transpose, operand ``(data[s], scales[s].t())``.
    """
    k = _check_segment_args(x, segments, seg_len, row, col, source, dh, index, scale)
    tensors = (x,) if dh is None else (x, dh)
    padded = -(-seg_len // G) * G
    if (not backend.uses_kernels(*tensors) or x.stride(-1) != 1
            or (dh is not None and dh.stride(-1) != 1)
            or padded // G > L.GRID_YZ_MAX or segments > L.GRID_YZ_MAX):
        return segment_quant_ref(x, segments, seg_len, row, col, source, dh, index, scale)
    dev = x.device
    row_out = col_out = None
    zero = L.u64(0)
    row_args, col_args = (zero, zero), (zero, zero)
    if row:
        row_out = (torch.empty(segments * seg_len, k, dtype=formats.FP8_DTYPE, device=dev),
                   torch.empty(segments, k // G, seg_len, dtype=torch.float32, device=dev))
        row_args = (L.ptr(row_out[0]), L.ptr(row_out[1]))
    if col:
        col_out = (torch.empty(segments, k, padded, dtype=formats.FP8_DTYPE, device=dev),
                   torch.empty(segments, padded // G, k, dtype=torch.float32, device=dev))
        col_args = (L.ptr(col_out[0]), L.ptr(col_out[1]))
    if segments * seg_len == 0:
        return row_out, col_out
    kind = _SUFFIX[x.dtype]
    ffn = 0 if source == "plain" else k // 2 if source == "swiglu_grad" else k
    name = f"fp8_seg_{source}_{kind}_" + ("r" if not col else "c" if not row else "rc") \
        + ("" if index is None else "_g")
    dh_ptr, dh_pitch = (L.ptr(dh), dh.stride(0)) if dh is not None else (zero, 0)
    if index is not None:
        index = index.contiguous()         # held here until the launch below
    index_ptr = zero if index is None else L.ptr(index)
    if scale is not None:
        scale = scale.contiguous()         # held here until the launch below
    args = (L.ptr(x), L.i64(x.stride(0)), dh_ptr, L.i64(dh_pitch), L.u32(ffn),
            L.u32(seg_len), L.u32(k), L.u32(padded), *row_args, *col_args, index_ptr,
            L.i64(x.shape[0]), zero if scale is None else L.ptr(scale))
    grid = (k // G, padded // G, segments)
    candidates = [(name + v, grid, args) for v in _SEG_VARIANTS]
    if f"{source}_{kind}" in _PIPELINED_SOURCES:
        tiles = grid[0] * grid[1] * grid[2]
        for suffix, per_sm in _PIPELINED.items():
            p_grid = (min(tiles, per_sm * L.sm_count(dev)), 1, 1)
            candidates.append((name + suffix, p_grid, args + (L.u32(segments),)))
    _launch_tuned(dev, name, grid, candidates)
    return row_out, col_out


# ---- the fastest variant -----------------------------------------------------------------


def _launch(device, name, grid, args):
    L.launch(device, "fp8_segments", name, grid, args)


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
