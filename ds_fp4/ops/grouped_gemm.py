"""Grouped FP8 GEMMs with DeepSeek-V3 block scaling: one launch for all local experts.

Two GEMMs in the "NT" form (the contraction is the last dimension of both operands):

- ``m_grouped_gemm_fp8_nt``: ``out[rows of g] = a[rows of g] @ w[g]^T`` with ``a`` FP8 1x128
  and ``w[g]`` FP8 in 128x128 tiles (the experts' forward and data-gradient GEMMs). Groups
  are contiguous row segments given by device ``offsets`` (dropless layers; no host sync)
  or ``group_rows`` rows each (DeepSpeed's ``[experts, capacity, hidden]`` buffer).
- ``k_grouped_gemm_fp8_nt``: ``out[g] = a[g] @ b[g]^T`` contracted over group g's token
  columns, both operands FP8 1x128 along the tokens (the weight-gradient GEMMs, fed by the
  column-wise conversions); empty groups give zeros; optional accumulation into ``out``.

CUDA tensors run the Triton kernels of ``ds_fp4.ops.grouped_gemm_triton``; CPU tensors (and
``kernels="reference"``) run the ``_ref`` twins beside each function: float32 math on the
dequantized operands, one group at a time. The kernels equal them within float32 rounding.
"""

import functools
import importlib.util

import torch

from ds_fp4 import formats as F
from ds_fp4.ops import backend, checks, reference

__all__ = ["m_grouped_gemm_fp8_nt", "m_grouped_gemm_fp8_nt_ref",
           "k_grouped_gemm_fp8_nt", "k_grouped_gemm_fp8_nt_ref", "grouped_fp8_supported"]

G = F.FP8_GROUP


# ---- checks -----------------------------------------------------------------------------


def _check_fp8(name, t, dims):
    checks.dtype(name, t, (F.FP8_DTYPE,))
    if t.dim() not in dims:
        raise ValueError(f"{name} must be {' or '.join(f'{d}-D' for d in dims)}; got shape "
                         f"{tuple(t.shape)}")


def _check_scales(name, t, want):
    checks.dtype(name, t, (torch.float32,))
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must have shape {tuple(want)}; got {tuple(t.shape)}")


def _host_offsets(name, offsets, total, unit=1):
    """Validate offsets whose values are readable without a device sync; returns a list."""
    values = offsets.tolist() if isinstance(offsets, torch.Tensor) else list(offsets)
    if not values or values[0] != 0:
        raise ValueError(f"{name} must start at 0; got {values[:1]} ...")
    if total is not None and values[-1] > total:
        raise ValueError(f"{name} must not pass the {total} rows; got {values[-1]} last")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must be non-decreasing; got {values}")
    if any(v % unit for v in values):
        raise ValueError(f"{name} must be multiples of {unit} (segments padded to {unit} "
                         f"columns); got {values}")
    return values


def _device_offsets(name, offsets, groups, device, total, unit=1, check_values=False):
    """``offsets`` as an int32 tensor ``[groups + 1]`` on ``device``.

    Host offsets (a list, a CPU tensor) are validated and uploaded; device offsets are used
    as they are (their values stay unread: reading them would cost a device sync) unless
    ``check_values``. ``total``: the most the last offset may be (None: any).
    """
    if not isinstance(offsets, torch.Tensor) or offsets.device.type == "cpu":
        values = _host_offsets(name, offsets, total, unit)
        if len(values) != groups + 1:
            raise ValueError(f"{name} must have {groups + 1} entries (one more than the "
                             f"groups of the weights); got {len(values)}")
        return torch.tensor(values, dtype=torch.int32, device=device)
    checks.int_vector(name, offsets, groups + 1, device, f"{groups + 1} entries")
    if check_values:
        _host_offsets(name, offsets.cpu(), total, unit)
    return offsets.to(torch.int32).contiguous()


def _check_m_grouped(a, a_scales, w, w_scales, offsets, group_rows):
    _check_fp8("a", a, (2,))
    _check_fp8("w", w, (3,))
    m, k = a.shape
    groups, n, kw = w.shape
    checks.multiple("a", k, G)
    checks.multiple("w", n, G, "its dimension N")
    if kw != k:
        raise ValueError(f"a [M, K] and w [G, N, K] must share K; got a {tuple(a.shape)}, "
                         f"w {tuple(w.shape)}")
    _check_scales("w_scales", w_scales, (groups, n // G, k // G))
    if (offsets is None) == (group_rows is None):
        raise ValueError("pass exactly one of offsets (contiguous segments) and group_rows "
                         "(fixed-size groups)")
    if group_rows is not None:
        if isinstance(group_rows, bool) or not isinstance(group_rows, int) or group_rows < 0:
            raise ValueError(f"group_rows must be a non-negative int; got {group_rows!r}")
        if groups * group_rows != m:
            raise ValueError(f"a has {m} rows, but {groups} groups of group_rows = "
                             f"{group_rows} make {groups * group_rows}")
    per_group = a_scales.dim() == 3
    if per_group and group_rows is None:
        raise ValueError("a_scales [G, K/128, rows] (per-group layout) needs group_rows")
    _check_scales("a_scales", a_scales,
                  (groups, k // G, group_rows) if per_group else (m, k // G))
    checks.same_device(a=a, a_scales=a_scales, w=w, w_scales=w_scales)
    return per_group


def _check_out(out, shape, dtypes, device):
    """``out`` (None or a tensor of ``shape``, one of ``dtypes``, on ``device``)."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape) \
            or out.dtype not in dtypes or out.device != device:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"out must be {want} {tuple(shape)} on {device}; got "
                         f"{getattr(out, 'dtype', type(out).__name__)} "
                         f"{tuple(getattr(out, 'shape', ()))}")


def _check_out_dtype(out_dtype):
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32; got {out_dtype}")


def _use_kernel(*tensors):
    """The Triton kernels run on CUDA tensors of GPUs with FP8 tensor cores (sm_89+)."""
    if not all(t.is_cuda for t in tensors) or backend.get_kernels() == "reference":
        return False
    return _fp8_tensor_cores(tensors[0].device.index)


@functools.lru_cache(maxsize=None)
def _fp8_tensor_cores(index):
    # memoized: torch's capability query costs ~7 us of host time a call (H200)
    return torch.cuda.get_device_capability(index) >= (8, 9)


# ---- M-grouped: forward and data-gradient GEMMs -----------------------------------------


def m_grouped_gemm_fp8_nt(a, a_scales, w, w_scales, offsets=None, group_rows=None,
                          out=None, out_dtype=torch.bfloat16, check_offsets=False,
                          rows_used=None):
    """``out[rows of g] = a[rows of g] @ w[g]^T`` for every group g, in one launch.

    Arguments:
        a: float8_e4m3fn ``[M, K]``, unit stride along K; ``K % 128 == 0``.
        a_scales: float32 1x128 scales of ``a``: ``[M, K/128]`` (any strides, e.g. the
            ``(1, M)`` layout of ``quantize_fp8``), or with ``group_rows`` also
            ``[G, K/128, group_rows]`` (each group's scales stored apart).
        w: float8_e4m3fn ``[G, N, K]``, 128x128 tiles; ``N % 128 == 0``.
        w_scales: float32 ``[G, N/128, K/128]``.
        offsets: int32/int64 ``[G + 1]``, group g's rows are ``offsets[g]:offsets[g+1]``
            (non-decreasing from 0, at most M; empty groups allowed; rows from
            ``offsets[G]`` to M, e.g. a dropless layer's alignment padding, come out as
            zeros). On a's device they are not read on the host (no sync) unless
            ``check_offsets``; a list or CPU tensor is validated and uploaded.
        group_rows: instead of ``offsets``: every group has this many rows (M = G * it).
        out: optional ``[M, N]`` tensor of ``out_dtype`` (any strides) to write into.
        out_dtype: bfloat16 (default) or float32.
        check_offsets: validate device offsets too (reads them: one device sync).
        rows_used: None, or with ``group_rows`` an int32/int64 ``[G]`` on a's device, a
            promise that group g's rows from ``rows_used[g]`` on are zeros in ``a`` (the
            capacity padding of DeepSpeed's buffer): the kernel writes the zero output of
            the row tiles wholly past it without multiplying (values unread on the host;
            the result is the same, given the promise and finite weights).
    Returns:
        ``[M, N]`` of ``out_dtype``: sum over K of a * sa * w * sw, float32 accumulation
        (zeros after the last group).
    """
    per_group = _check_m_grouped(a, a_scales, w, w_scales, offsets, group_rows)
    rows_used = _check_used("rows_used", rows_used, group_rows, w.shape[0], a.device)
    _check_out_dtype(out_dtype)
    m, n = a.shape[0], w.shape[1]
    _check_out(out, (m, n), (out_dtype,), a.device)
    if offsets is not None:
        offsets = _device_offsets("offsets", offsets, w.shape[0], a.device, m,
                                  check_values=check_offsets)
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or w.shape[0] == 0:
        return out
    if not _use_kernel(a, a_scales, w, w_scales):
        return m_grouped_gemm_fp8_nt_ref(a, a_scales, w, w_scales, offsets, group_rows, out,
                                         out_dtype)
    if a.stride(1) != 1:
        a = a.contiguous()
    from ds_fp4.ops import grouped_gemm_triton
    grouped_gemm_triton.launch_m_grouped(a, a_scales, w, w_scales, out, offsets,
                                         group_rows, per_group, rows_used=rows_used)
    return out


def _check_used(name, used, fixed, groups, device):
    """``rows_used``/``cols_used``: None, or int32/int64 ``[groups]`` on ``device`` for
    fixed-size groups (``fixed``: their size); its values are the caller's promise, never
    read here. Passed on as it is (the kernels load either type: no conversion launch)."""
    if used is None:
        return None
    if fixed is None:
        raise ValueError(f"{name} applies to fixed-size groups (group_rows / group_cols); "
                         f"with offsets, end the segments where the rows end instead")
    checks.int_vector(name, used, groups, device, f"one entry per group ({groups})")
    return used.contiguous()


def m_grouped_fixed_unchecked(a, a_scales, w, w_scales, group_rows, out=None, rows_used=None):
    """``m_grouped_gemm_fp8_nt(a, a_scales, w, w_scales, group_rows=group_rows, out=out,
    rows_used=rows_used)`` without its argument checks, for a caller that builds every
    operand itself (the FP8 experts' passes, whose tests hold their shapes). The checks cost
    ~25 us of host time a call on an H200's host (``bench/results/triton_launch_h200``),
    and the FP8 experts make four calls a step. Off the kernel's path (CPU tensors,
    ``kernels="reference"``), the checked function runs."""
    if not _use_kernel(a, a_scales, w, w_scales):
        return m_grouped_gemm_fp8_nt(a, a_scales, w, w_scales, group_rows=group_rows, out=out,
                                     rows_used=rows_used)
    if out is None:
        out = torch.empty(a.shape[0], w.shape[1], dtype=torch.bfloat16, device=a.device)
    if a.shape[0] and w.shape[0]:
        from ds_fp4.ops import grouped_gemm_triton
        grouped_gemm_triton.launch_m_grouped(a, a_scales, w, w_scales, out, None, group_rows,
                                             a_scales.dim() == 3, rows_used=rows_used)
    return out


def _dequant_tiles(data, scales):
    """float32 128x128-tile dequantization of ``[N, K]`` with scales ``[N/128, K/128]``."""
    s = scales.float().repeat_interleave(G, 0).repeat_interleave(G, 1)
    return data.float() * s


def m_grouped_gemm_fp8_nt_ref(a, a_scales, w, w_scales, offsets=None, group_rows=None,
                              out=None, out_dtype=torch.bfloat16):
    """``m_grouped_gemm_fp8_nt``'s twin: float32 math on the dequantized operands."""
    per_group = _check_m_grouped(a, a_scales, w, w_scales, offsets, group_rows)
    m, n = a.shape[0], w.shape[1]
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if group_rows is not None:
        bounds = [g * group_rows for g in range(w.shape[0] + 1)]
    else:
        bounds = _host_offsets("offsets", offsets.cpu() if isinstance(offsets, torch.Tensor)
                               else offsets, m)
    out[bounds[-1]:] = 0
    for g in range(w.shape[0]):
        lo, hi = bounds[g], bounds[g + 1]
        if hi == lo:
            continue
        sa = a_scales[g].t() if per_group else a_scales[lo:hi]
        x = reference.dequantize_fp8(a[lo:hi], sa, torch.float32)
        out[lo:hi] = (x @ _dequant_tiles(w[g], w_scales[g]).t()).to(out.dtype)
    return out


# ---- K-grouped: weight-gradient GEMMs -----------------------------------------------------


def _check_k_operand(name, sname, t, s, groups):
    _check_fp8(name, t, (2, 3))
    if t.dim() == 3 and t.shape[0] != groups:
        raise ValueError(f"{name} [G, R, P] must have G = {groups} groups; got "
                         f"{tuple(t.shape)}")
    checks.multiple(name, t.shape[-1], G, "its token dimension")
    want = (*t.shape[:-1], t.shape[-1] // G)
    _check_scales(sname, s, want)


def _check_k_grouped(a, a_scales, b, b_scales, col_offsets, group_cols=None):
    if (col_offsets is None) == (group_cols is None):
        raise ValueError("pass exactly one of col_offsets and group_cols")
    if group_cols is not None:
        if isinstance(group_cols, bool) or not isinstance(group_cols, int) or group_cols < 0 \
                or group_cols % G:
            raise ValueError(f"group_cols must be a non-negative multiple of {G}; got "
                             f"{group_cols!r}")
        slabs = [t.shape[0] for t in (a, b) if isinstance(t, torch.Tensor) and t.dim() == 3]
        if slabs:
            groups = slabs[0]
        elif group_cols:
            groups = a.shape[-1] // group_cols
        else:
            raise ValueError("group_cols = 0 with 2-D operands leaves the group count open: "
                             "pass col_offsets")
        col_offsets = [g * group_cols for g in range(groups + 1)]
    elif isinstance(col_offsets, torch.Tensor):
        groups = col_offsets.numel() - 1
    else:
        groups = len(col_offsets) - 1
    if groups < 0:
        raise ValueError("col_offsets must have at least one entry (0)")
    _check_k_operand("a", "a_scales", a, a_scales, groups)
    _check_k_operand("b", "b_scales", b, b_scales, groups)
    checks.same_device(a=a, a_scales=a_scales, b=b, b_scales=b_scales)
    return groups, col_offsets


def k_grouped_gemm_fp8_nt(a, a_scales, b, b_scales, col_offsets=None, group_cols=None,
                          out=None, out_dtype=torch.float32, accumulate=False,
                          check_offsets=False, halves=False, cols_used=None):
    """``out[g] = a[g] @ b[g]^T`` (or ``+=``), contracted over group g's token columns.

    Arguments:
        a: float8_e4m3fn ``[M, sum P]`` (groups side by side, e.g. ``mxfp4_to_fp8_colwise``'s
            output) or ``[G, M, P_max]`` (one slab per group); quantized 1x128 along the last
            (token) dimension. a_scales: float32 of shape ``a.shape[:-1] + (cols/128,)``,
            any strides.
        b, b_scales: the same for the other operand, ``[N, ...]``.
        col_offsets: int32/int64 ``[G + 1]``: group g's columns are
            ``col_offsets[g]:col_offsets[g+1]`` (multiples of 128, zero padded; for
            ``[G, R, P]`` operands each group's columns start at 0 of its slab and only the
            differences count). Device offsets are not read on the host unless
            ``check_offsets``.
        group_cols: instead of ``col_offsets``: every group has this many columns.
        out: optional ``[G, M, N]`` (float32 or bfloat16) to write or accumulate into.
        out_dtype: float32 (default) or bfloat16, when ``out`` is None.
        accumulate: add to ``out`` instead of overwriting it.
        halves: return M's two halves as two tensors ``[G, M/2, N]`` of ``out_dtype``, each
            allocated on its own (a gate's and an up projection's weight gradients, each
            contiguous, from one launch); M a multiple of 256, no ``out``, no accumulation.
        cols_used: None, or with ``group_cols`` an int32/int64 ``[G]`` on a's device, a
            promise that group g's columns from ``cols_used[g]`` on are zeros in both
            operands (the capacity padding of DeepSpeed's buffer): the kernel may leave
            their K blocks out (values unread on the host; the same result, given it).
    Returns:
        ``[G, M, N]``: float32 accumulation of a * sa * b * sb; zeros (or ``out`` unchanged,
        when accumulating) for an empty group. With ``halves``: ``(rows :M/2, rows M/2:)``.
    """
    groups, host_offsets = _check_k_grouped(a, a_scales, b, b_scales, col_offsets, group_cols)
    cols_used = _check_used("cols_used", cols_used, group_cols, groups, a.device)
    m, n = a.shape[-2], b.shape[-2]
    if halves:
        return _k_grouped_halves(a, a_scales, b, b_scales, col_offsets, group_cols, out,
                                 out_dtype, accumulate, check_offsets, groups, host_offsets)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out (the gradient to add to)")
        _check_out_dtype(out_dtype)
        out = torch.empty(groups, m, n, dtype=out_dtype, device=a.device)
    _check_out(out, (groups, m, n), (torch.float32, torch.bfloat16), a.device)
    col_offsets = _k_col_offsets(col_offsets, group_cols, groups, a, b, check_offsets,
                                 host_offsets)
    if groups == 0 or m == 0 or n == 0:
        return out
    if not _use_kernel(a, a_scales, b, b_scales):
        return k_grouped_gemm_fp8_nt_ref(a, a_scales, b, b_scales, host_offsets if group_cols
                                         is not None else col_offsets, out=out,
                                         accumulate=accumulate)
    from ds_fp4.ops import grouped_gemm_triton
    grouped_gemm_triton.launch_k_grouped(a, a_scales, b, b_scales, out, col_offsets,
                                         accumulate, group_cols=group_cols, cols_used=cols_used)
    return out


def k_grouped_fixed_unchecked(a, a_scales, b, b_scales, group_cols, out_dtype, cols_used=None):
    """``k_grouped_gemm_fp8_nt(a, a_scales, b, b_scales, group_cols=group_cols,
    out_dtype=out_dtype, cols_used=cols_used)`` without its argument checks, for a caller
    that builds every operand itself (as ``m_grouped_fixed_unchecked``: the FP8 experts'
    two weight-gradient calls a step)."""
    if not _use_kernel(a, a_scales, b, b_scales):
        return k_grouped_gemm_fp8_nt(a, a_scales, b, b_scales, group_cols=group_cols,
                                     out_dtype=out_dtype, cols_used=cols_used)
    slabs = a if a.dim() == 3 else b if b.dim() == 3 else None
    groups = slabs.shape[0] if slabs is not None else a.shape[-1] // group_cols
    m, n = a.shape[-2], b.shape[-2]
    out = torch.empty(groups, m, n, dtype=out_dtype, device=a.device)
    if groups and m and n:
        from ds_fp4.ops import grouped_gemm_triton
        grouped_gemm_triton.launch_k_grouped(a, a_scales, b, b_scales, out, None, False,
                                             group_cols=group_cols, cols_used=cols_used)
    return out


def _k_col_offsets(col_offsets, group_cols, groups, a, b, check, host_offsets):
    """The groups' column offsets, checked against the operands, as the kernel takes them:
    ``_col_offsets``'s, or None for fixed-width groups (``group_cols``), whose widths are
    checked here."""
    if group_cols is None:
        return _col_offsets(col_offsets, groups, a, b, check)
    _check_widths(host_offsets, a, b)
    return None


def _k_grouped_halves(a, a_scales, b, b_scales, col_offsets, group_cols, out, out_dtype,
                      accumulate, check_offsets, groups, host_offsets):
    """``k_grouped_gemm_fp8_nt(..., halves=True)``: the two outputs from one launch."""
    m, n = a.shape[-2], b.shape[-2]
    if out is not None or accumulate:
        raise ValueError("halves=True makes its own two outputs: pass out=None and "
                         "accumulate=False")
    if m % (2 * G):
        raise ValueError(f"halves=True splits a's M = {m} rows in two halves of multiples of "
                         f"{G}: M must be a multiple of {2 * G}")
    _check_out_dtype(out_dtype)
    top, bottom = (torch.empty(groups, m // 2, n, dtype=out_dtype, device=a.device)
                   for _ in range(2))
    if not _use_kernel(a, a_scales, b, b_scales) or groups == 0 or m == 0 or n == 0:
        full = k_grouped_gemm_fp8_nt(a, a_scales, b, b_scales, col_offsets, group_cols,
                                     out_dtype=out_dtype, check_offsets=check_offsets)
        top.copy_(full[:, :m // 2])
        bottom.copy_(full[:, m // 2:])
        return top, bottom
    col_offsets = _k_col_offsets(col_offsets, group_cols, groups, a, b, check_offsets,
                                 host_offsets)
    from ds_fp4.ops import grouped_gemm_triton
    grouped_gemm_triton.launch_k_grouped(a, a_scales, b, b_scales, top, col_offsets, False,
                                         group_cols=group_cols, out2=bottom)
    return top, bottom


def _check_widths(values, a, b):
    """A ``[R, sum P]`` operand must hold ``values[-1]`` columns, a ``[G, R, P]`` one the
    widest group."""
    for name, t in (("a", a), ("b", b)):
        need = values[-1] if t.dim() == 2 else max(
            (y - x for x, y in zip(values, values[1:])), default=0)
        if need > t.shape[-1]:
            raise ValueError(f"{name} has {t.shape[-1]} token columns; col_offsets need {need}")


def _col_offsets(col_offsets, groups, a, b, check):
    """Column offsets for the kernel: device offsets as int32 (values read only if
    ``check``); host offsets validated (from 0, non-decreasing, multiples of 128, within the
    operands) and uploaded for CUDA operands."""
    on_device = isinstance(col_offsets, torch.Tensor) and col_offsets.device.type != "cpu"
    if on_device and not check:
        return _device_offsets("col_offsets", col_offsets, groups, a.device, None, G)
    values = _host_offsets("col_offsets", col_offsets.cpu() if on_device else col_offsets,
                           None, G)
    _check_widths(values, a, b)
    if on_device:
        return col_offsets.to(torch.int32).contiguous()
    if a.device.type == "cpu":
        return values
    return torch.tensor(values, dtype=torch.int32, device=a.device)


def k_grouped_gemm_fp8_nt_ref(a, a_scales, b, b_scales, col_offsets, out=None,
                              out_dtype=torch.float32, accumulate=False):
    """``k_grouped_gemm_fp8_nt``'s twin: float32 math on the dequantized operands (takes
    ``col_offsets`` only)."""
    groups, _ = _check_k_grouped(a, a_scales, b, b_scales, col_offsets)
    values = col_offsets.tolist() if isinstance(col_offsets, torch.Tensor) else list(col_offsets)
    m, n = a.shape[-2], b.shape[-2]
    if out is None:
        out = torch.zeros(groups, m, n, dtype=out_dtype, device=a.device)
    for g in range(groups):
        lo, hi = values[g], values[g + 1]
        x = _group_cols(a, a_scales, g, lo, hi)
        y = _group_cols(b, b_scales, g, lo, hi)
        prod = x @ y.t()
        out[g] = (prod + out[g].float() if accumulate else prod).to(out.dtype)
    return out


def _group_cols(t, s, g, lo, hi):
    """Group g's columns of a K-grouped operand, dequantized to float32 ``[R, hi - lo]``."""
    if t.dim() == 3:
        t, s, lo, hi = t[g], s[g], 0, hi - lo
    return reference.dequantize_fp8(t[:, lo:hi], s[:, lo // G:hi // G], torch.float32)


# ---- where the grouped FP8 GEMMs run on tensor cores --------------------------------------


@functools.lru_cache(maxsize=None)
def _hopper(device_index):
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def grouped_fp8_supported(device):
    """True when the experts' grouped FP8 GEMMs run on FP8 tensor cores on ``device``.

    Arguments:
        device: a ``torch.device``, a device string/index, or a tensor (its device).
    Returns:
        bool: a CUDA sm_90 (Hopper) device and an importable Triton (the kernels'
        compiler). The kernels also run on sm_89, but only Hopper has been measured, so
        ``fp8_experts: auto`` turns them on there only.
    """
    if isinstance(device, torch.Tensor):
        device = device.device
    device = torch.device(device) if not isinstance(device, torch.device) else device
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if importlib.util.find_spec("triton") is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _hopper(index)
