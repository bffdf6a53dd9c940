"""Sums of each token's routed rows: the MoE decode's weighted sum and the encode's backward.

Route ``(j, t)``, token t's j-th choice, reaches row ``slots[j, t]`` of ``rows`` (the
experts' ``[E * C, M]`` slots), or none: a slot outside ``[0, R)`` is DeepSpeed's scratch
slot, which reads as a zero row.

- ``weighted_route_sum``: ``out[t] = sum_j gates[j, t] * rows[slots[j, t]]``, the decode
  (DeepSpeed's ``_sparse_decode``): float32 products added in route order.
- ``weighted_route_sum_kept``: the same sum and, from the same reads, each route's row as
  a packed FP8 1x128 row (``quantize_fp8_rows(rows, index=slots.reshape(-1))``' bytes), what
  the decode keeps for the gates' gradient: one pass over the routes' rows where two read
  them (235 MB at hidden 7168, 32 experts top-2).
- ``slot_sum``: ``out[t] = sum of rows[s]`` over t's slots in ascending order, the encode's
  backward (each token receives the gradients of its slots; the CPU's ``index_add_`` adds
  them in ascending slot order).

Both add in float32 and round once to the rows' dtype: the eager ops' bits (for k <= 2
any order's; a NaN's bits aside, which the kernels write as CUDA's casts do). The twins are
those torch ops. On CUDA (``backend.uses_kernels``, float32 gates, ``M % 8 == 0``, 16-byte
aligned rows, k <= ``MAX_K``) ``route_sums.cu`` runs each in one launch, reading the slots
and gates where they are. They replace DeepSpeed's fused restore kernel (Triton) and the
~10 torch ops around it (the sources' int32 copy and mask, the gates' transpose, a sort, a
ones tensor): the profiler's host time per call at hidden 4096 on an H200 fell from 516 to
159 us (decode) and from 558 to 143 us (encode backward) on a host whose untouched ops took ~0.67x the time, where
the layer's GPU waits for its host (``bench/results/host_cuts_h200``).
"""

import torch

from ds_fp4 import formats as F
from ds_fp4.ops import _cuda_loader as L
from ds_fp4.ops import backend, checks, reference

__all__ = ["weighted_route_sum", "slot_sum", "weighted_route_sum_ref", "slot_sum_ref",
           "weighted_route_sum_kept", "weighted_route_sum_kept_ref"]

MAX_K = 32   # routes a token the kernels take (RS_MAX_K in route_sums.cu)


def _check(rows, slots, gates=None):
    checks.dtype("rows", rows, F.FLOAT_INPUT_DTYPES)
    checks.matrix("rows", rows)
    checks.dtype("slots", slots, (torch.int64,))
    if slots.dim() != 2 or slots.shape[0] == 0:
        raise ValueError(f"slots must be [k, S] with k >= 1 routes a token; got shape "
                         f"{tuple(slots.shape)}")
    checks.same_device(rows=rows, slots=slots)
    if gates is None:
        return
    checks.float_tensor("gates", gates)
    checks.same_shape("gates", gates, "slots", slots)
    checks.same_device(rows=rows, gates=gates)


def _sum_in_order(rows, slots, gates=None):
    """``sum_j rows[slots[j]] (* gates[j])`` in float32 (the products in their promoted
    dtype), added in order along j, rounded once to the rows' dtype; a slot outside
    ``[0, R)`` reads a zero row. One route's rows at a time: ``[S, M]`` terms, not the
    ``[k, S, M]`` of all routes (the kernels' fallback runs at the backward's peak)."""
    acc = None
    for j in range(slots.shape[0]):
        term = reference.gather_rows_or_zeros(rows, slots[j])
        term = term.float() if gates is None else term * gates[j].unsqueeze(-1)
        acc = term if acc is None else acc + term
    return acc.to(rows.dtype)


def weighted_route_sum_ref(rows, slots, gates):
    """The PyTorch twin of ``weighted_route_sum`` (same arguments; the eager decode's ops)."""
    _check(rows, slots, gates)
    return _weighted_ref(rows, slots, gates)


def _weighted_ref(rows, slots, gates):
    return _sum_in_order(rows, slots, gates)


def slot_sum_ref(rows, slots):
    """The PyTorch twin of ``slot_sum`` (same arguments)."""
    _check(rows, slots)
    return _slot_ref(rows, slots)


def _slot_ref(rows, slots):
    return _sum_in_order(rows, torch.sort(slots, dim=0).values)


def _kernel_applies(rows, slots, gates):
    tensors = (rows, slots) if gates is None else (rows, slots, gates)
    row_bytes = rows.stride(0) * rows.element_size()
    return (backend.uses_kernels(*tensors) and slots.shape[0] <= MAX_K
            and (gates is None or gates.dtype == torch.float32)
            and rows.shape[1] % 8 == 0 and rows.stride(-1) == 1 and row_bytes % 16 == 0
            and rows.data_ptr() % 16 == 0)


def _launch(rows, slots, gates, kept=None):
    """One launch: the sum (weighted where ``gates``), also the routes' FP8 rows into
    ``kept`` where given."""
    k, tokens = slots.shape
    m = rows.shape[1]
    out = torch.empty(tokens, m, dtype=rows.dtype, device=rows.device)
    if tokens == 0 or m == 0:
        return out
    slots = slots.contiguous()
    weighted = gates is not None
    name = f"route_sum_{L.DTYPE_SUFFIX[rows.dtype]}{'_w' if weighted else ''}" \
        + ("" if kept is None else "_fp8")
    args = (L.ptr(rows), L.i64(rows.stride(0) * rows.element_size()), L.i64(rows.shape[0]),
            L.ptr(slots), L.i64(tokens), L.u32(k),
            L.ptr(gates) if weighted else L.u64(0),
            L.i64(gates.stride(0) if weighted else 0), L.i64(gates.stride(1) if weighted else 0),
            L.i64(m), L.ptr(out), L.i64(m * rows.element_size()))
    if kept is not None:
        args += (L.ptr(kept), L.i64(kept.stride(0)))
    L.launch(rows.device, "route_sums", name, tokens, args)
    return out


def weighted_route_sum(rows, slots, gates):
    """``out[t] = sum_j gates[j, t] * rows[slots[j, t]]`` (module docstring).

    Arguments:
        rows: bf16/fp16/fp32 ``[R, M]``, the experts' slots.
        slots: int64 ``[k, S]``; outside ``[0, R)``: a zero row.
        gates: float ``[k, S]`` (any strides).
    Returns:
        ``[S, M]`` of rows' dtype: float32 products (rows' values times the gates, in
        their promoted dtype) added in route order, rounded once.
    """
    _check(rows, slots, gates)
    if not _kernel_applies(rows, slots, gates):
        return _weighted_ref(rows, slots, gates)
    return _launch(rows, slots, gates)


def weighted_route_sum_kept_ref(rows, slots, gates):
    """The PyTorch twin of ``weighted_route_sum_kept`` (same arguments)."""
    _check_kept(rows, slots, gates)
    return (_weighted_ref(rows, slots, gates),
            reference.quantize_fp8_rows(rows, index=slots.reshape(-1)))


def _check_kept(rows, slots, gates):
    _check(rows, slots, gates)
    checks.multiple("rows", rows.shape[1], F.FP8_GROUP)


def weighted_route_sum_kept(rows, slots, gates):
    """``weighted_route_sum`` and each route's row as a packed FP8 row, in one pass.

    Arguments:
        as ``weighted_route_sum``'s, M a multiple of 128.
    Returns:
        ``(out [S, M], kept uint8 [k * S, M + M/128])``: ``weighted_route_sum``'s result and
        ``quantize_fp8_rows(rows, index=slots.reshape(-1))``' bytes (a dropped route's row
        zeros), the decode's FP8 route rows (``routing``).
    """
    _check_kept(rows, slots, gates)
    if not _kernel_applies(rows, slots, gates):
        return weighted_route_sum_kept_ref(rows, slots, gates)
    kept = torch.empty(slots.numel(), F.fp8_row_bytes(rows.shape[1]), dtype=torch.uint8,
                       device=rows.device)
    return _launch(rows, slots, gates, kept), kept


def slot_sum(rows, slots):
    """``out[t] = sum of rows[slots[j, t]]`` over j in ascending slot order (module
    docstring).

    Arguments:
        rows: bf16/fp16/fp32 ``[R, M]``, the gradient of the experts' slots.
        slots: int64 ``[k, S]``; outside ``[0, R)``: a zero row.
    Returns:
        ``[S, M]`` of rows' dtype, summed in float32 and rounded once.
    """
    _check(rows, slots)
    if not _kernel_applies(rows, slots, None):
        return _slot_ref(rows, slots)
    return _launch(rows, slots, None)
