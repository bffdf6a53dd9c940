"""The MoE decode's backward: the gradients of the experts' slots and of the routes' gates.

The decode (DeepSpeed's ``_sparse_decode``) sums each token's routes, ``y[t] = sum_j
gate[j, t] * out[slots[j, t]]``. Its backward, for route ``r = j * S + t`` reaching slot
``slots[j, t]`` (a slot outside ``[0, slot_count)`` is DeepSpeed's scratch slot: dropped):

- ``d_slots[slots[j, t]] = dtype(dy[t] * gate[j, t])``, the product in the promoted dtype
  of ``dy`` and the gates (float32 for DeepSpeed's float32 gates), zeros in the slots no
  route reaches;
- ``d_gates[j, t] = sum_m dy[t, m] * routes[r, m]``, the routes' outputs as kept for it
  (packed FP8 rows, read back as ``ops.dequantize_fp8_rows`` to dy's dtype, or rows of
  dy's dtype), a dropped route's row zeros.

``route_grads_ref`` is the ops autograd runs for DeepSpeed's eager decode (its bits; the
gather through the inverse map is the scatter of a permutation). On CUDA (float32 gates,
``M % 8 == 0``, where ``backend.uses_kernels`` says so) ``route_grads.cu`` does it in two
launches after one fill: the slots' gradient byte for byte the twin's, the gates' gradient
summed over M in another order (float32 rounding). That replaces a dequantize of the kept
rows, DeepSpeed's fused restore backward in route order, the inverse map's ops and a gather
into slot order (~0.8 ms at hidden 7168, 16 experts top-8 on an H200).
"""

import torch

from ds_fp4 import formats as F
from ds_fp4.ops import _cuda_loader as L
from ds_fp4.ops import backend, checks, reference

__all__ = ["route_grads", "route_grads_ref"]

_SUFFIX = L.DTYPE_SUFFIX


def _check(grad, slots, gates, slot_count, routes):
    """The arguments' checks; returns the routes as 2-D rows ``[k * S, width]`` (or None)."""
    checks.dtype("grad", grad, F.FLOAT_INPUT_DTYPES)
    checks.matrix("grad", grad)
    checks.dtype("slots", slots, (torch.int64,))
    checks.float_tensor("gates", gates)
    checks.routes("slots", slots, "grad", grad.shape[0])
    checks.same_shape("gates", gates, "slots", slots)
    checks.int_at_least("slot_count", slot_count, 0, " (the experts' slots)")
    checks.same_device(grad=grad, slots=slots, gates=gates)
    if routes is None:
        return None
    checks.tensor("routes", routes)
    checks.same_device(grad=grad, routes=routes)
    m = grad.shape[1]
    if routes.dtype == torch.uint8:
        width = F.fp8_row_bytes(m) if m % F.FP8_GROUP == 0 else None
        what = f"packed FP8 rows of {width} bytes" if width else "packed FP8 rows (M % 128 == 0)"
    elif routes.dtype == grad.dtype:
        width, what = m, f"rows of {m} {str(grad.dtype).replace('torch.', '')} elements"
    else:
        raise TypeError(f"routes must be packed FP8 rows (uint8) or grad's dtype {grad.dtype}; "
                        f"got {routes.dtype}")
    if width is None or routes.numel() != slots.numel() * width or routes.shape[-1] != width:
        raise ValueError(f"routes must hold k * S = {slots.numel()} {what} (grad's M = {m}); "
                         f"got shape {tuple(routes.shape)}")
    return routes.reshape(slots.numel(), width)


def _route_values(routes, dtype, m):
    """The kept routes' outputs as ``dtype`` ``[k * S, m]``."""
    if routes.dtype != torch.uint8:
        return routes
    return reference.dequantize_fp8_rows(routes, dtype, m)


def route_grads_ref(grad, slots, gates, slot_count, routes=None):
    """The PyTorch twin of ``route_grads`` (same arguments; the eager decode's ops)."""
    return _ref(grad, slots, gates, slot_count, _check(grad, slots, gates, slot_count, routes))


def _ref(grad, slots, gates, slot_count, rows):
    """``route_grads_ref`` on checked arguments (``rows``: ``_check``'s)."""
    k, tokens = slots.shape
    m, n = grad.shape[1], slots.numel()
    flat = slots.reshape(-1)
    used = (flat >= 0) & (flat < slot_count)
    d_combined = grad.to(torch.promote_types(grad.dtype, gates.dtype)).unsqueeze(0)
    d_routed = (d_combined * gates.unsqueeze(-1)).to(grad.dtype).reshape(n, m)
    # slot -> route; slots no route reaches (-1) get zero rows
    inverse = torch.full((slot_count + 1,), -1, dtype=torch.long, device=grad.device)
    inverse.scatter_(0, torch.where(used, flat, slot_count), torch.arange(n, device=grad.device))
    d_slots = reference.gather_rows_or_zeros(d_routed, inverse[:slot_count])
    if rows is None:
        return d_slots, None
    values = _route_values(rows, grad.dtype, m).masked_fill(~used[:, None], 0).view(k, tokens, m)
    d_gates = (d_combined.expand(k, tokens, m) * values).sum(-1).to(gates.dtype)
    return d_slots, d_gates


def route_grads(grad, slots, gates, slot_count, routes=None):
    """The decode's backward (module docstring).

    Arguments:
        grad: ``dy``, bf16/fp16/fp32 ``[S, M]``.
        slots: int64 ``[k, S]``, route ``(j, t)``'s slot; outside ``[0, slot_count)``: dropped.
        gates: ``[k, S]`` float, the routes' gates.
        slot_count: the experts' slots (``E * C``), the rows of ``d_slots``.
        routes: None (no gates' gradient), or the routes' outputs ``[k * S, ...]`` (or
            ``[k, S, ...]``) as kept: uint8 packed FP8 rows (``M + M/128`` bytes) or rows of
            grad's dtype.
    Returns:
        ``(d_slots [slot_count, M] of grad's dtype, a tensor of its own storage;
        d_gates [k, S] of gates' dtype, or None without routes)``.
    """
    rows = _check(grad, slots, gates, slot_count, routes)
    tensors = (grad, slots, gates) if rows is None else (grad, slots, gates, rows)
    m = grad.shape[1]
    if (not backend.uses_kernels(*tensors) or gates.dtype != torch.float32 or m % 8
            or grad.stride(-1) != 1 or (rows is not None and rows.stride(-1) != 1)):
        return _ref(grad, slots, gates, slot_count, rows)
    k, tokens = slots.shape
    dev = grad.device
    slots = slots.contiguous()
    d_slots = torch.empty(slot_count, m, dtype=grad.dtype, device=dev)
    d_gates = None if rows is None else torch.empty(k, tokens, dtype=torch.float32, device=dev)
    if tokens + slot_count == 0 or m == 0:
        return d_slots, (d_gates.zero_() if d_gates is not None else None)
    inverse = torch.full((slot_count,), -1, dtype=torch.int32, device=dev)
    if slots.numel():
        L.launch(dev, "route_grads", "route_grads_invert", L.blocks_for(slots.numel()),
                 (L.ptr(slots), L.i64(slots.numel()), L.i64(slot_count), L.ptr(inverse)))
    kind = "" if rows is None else "_fp8" if rows.dtype == torch.uint8 else "_rows"
    zero = L.u64(0)
    args = (L.ptr(grad), L.i64(grad.stride(0) * grad.element_size()), L.i64(tokens), L.u32(k),
            L.ptr(slots), L.i64(slot_count), L.ptr(inverse),
            L.ptr(gates), L.i64(gates.stride(0)), L.i64(gates.stride(1)),
            zero if rows is None else L.ptr(rows),
            L.i64(0 if rows is None else rows.stride(0) * rows.element_size()), L.i64(m),
            L.ptr(d_slots), L.i64(m * grad.element_size()),
            zero if d_gates is None else L.ptr(d_gates))
    L.launch(dev, "route_grads", f"route_grads_{_SUFFIX[grad.dtype]}{kind}", tokens + slot_count,
             args)
    return d_slots, d_gates
