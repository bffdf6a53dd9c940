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

``route_gate_grads`` is the same pass without the slots' gradient: the gates' gradient and
each used slot's gate, for a consumer that reads dy's rows through the slots' source map
and scales them itself (``segment_quant``'s ``scale``: the same bytes as ``d_slots``), so
that the ``[slot_count, M]`` buffer is never made. On CUDA one launch.
"""

import torch

from ds_fp4 import formats as F
from ds_fp4.ops import _cuda_loader as L
from ds_fp4.ops import backend, checks, reference

__all__ = ["route_grads", "route_grads_ref", "route_gate_grads", "route_gate_grads_ref"]

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


def _slot_gates_ref(slots, gates, slot_count):
    """Each used slot's gate, float32 ``[slot_count]`` (zeros where no route is)."""
    flat = slots.reshape(-1)
    used = (flat >= 0) & (flat < slot_count)
    out = torch.zeros(slot_count + 1, dtype=torch.float32, device=slots.device)
    out.scatter_(0, torch.where(used, flat, slot_count), gates.reshape(-1).float())
    return out[:slot_count]


def route_gate_grads_ref(grad, slots, gates, slot_count, routes=None):
    """The PyTorch twin of ``route_gate_grads`` (same arguments)."""
    rows = _check(grad, slots, gates, slot_count, routes)
    d_gates = None if rows is None else _ref(grad, slots, gates, slot_count, rows)[1]
    return d_gates, _slot_gates_ref(slots, gates, slot_count)


def route_gate_grads(grad, slots, gates, slot_count, routes=None):
    """``route_grads`` without the slots' gradient (module docstring).

    Arguments:
        as ``route_grads``' (float32 gates).
    Returns:
        ``(d_gates [k, S] of gates' dtype or None without routes, slot_gates float32
        [slot_count])``: ``slot_gates[s]`` is the gate of the route in slot s, where one is
        (elsewhere any value); ``route_grads``' ``d_slots[s]`` is then
        ``dtype(float32(grad[t]) * slot_gates[s])`` for the token t of slot s.
    """
    rows = _check(grad, slots, gates, slot_count, routes)
    if gates.dtype != torch.float32:
        raise TypeError(f"route_gate_grads needs float32 gates (DeepSpeed's); got {gates.dtype}")
    if not _kernel_path(grad, slots, gates, rows):
        return route_gate_grads_ref(grad, slots, gates, slot_count, routes)
    k, tokens = slots.shape
    slot_gates = torch.empty(slot_count, dtype=torch.float32, device=grad.device)
    d_gates = None if rows is None else \
        torch.empty(k, tokens, dtype=torch.float32, device=grad.device)
    if tokens and grad.shape[1]:
        _launch(grad, slots.contiguous(), gates, slot_count, rows, None, None, d_gates,
                slot_gates, grid=tokens)
    elif d_gates is not None:
        d_gates.zero_()
    return d_gates, slot_gates


def _kernel_path(grad, slots, gates, rows):
    tensors = (grad, slots, gates) if rows is None else (grad, slots, gates, rows)
    return (backend.uses_kernels(*tensors) and gates.dtype == torch.float32
            and grad.shape[1] % 8 == 0 and grad.stride(-1) == 1
            and (rows is None or rows.stride(-1) == 1))


def _launch(grad, slots, gates, slot_count, rows, inverse, d_slots, d_gates, slot_gates, grid):
    """One ``route_grads_*`` launch of ``grid`` CTAs (tokens, then slots when ``d_slots``)."""
    k, tokens = slots.shape
    m = grad.shape[1]
    kind = "" if rows is None else "_fp8" if rows.dtype == torch.uint8 else "_rows"
    zero = L.u64(0)
    ptr = lambda t: zero if t is None else L.ptr(t)     # noqa: E731
    args = (L.ptr(grad), L.i64(grad.stride(0) * grad.element_size()), L.i64(tokens), L.u32(k),
            L.ptr(slots), L.i64(slot_count), ptr(inverse),
            L.ptr(gates), L.i64(gates.stride(0)), L.i64(gates.stride(1)),
            ptr(rows), L.i64(0 if rows is None else rows.stride(0) * rows.element_size()),
            L.i64(m), ptr(d_slots), L.i64(m * grad.element_size()), ptr(d_gates),
            ptr(slot_gates))
    L.launch(grad.device, "route_grads", f"route_grads_{_SUFFIX[grad.dtype]}{kind}", grid, args)


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
    m = grad.shape[1]
    if not _kernel_path(grad, slots, gates, rows):
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
    _launch(grad, slots, gates, slot_count, rows, inverse, d_slots, d_gates, None,
            grid=tokens + slot_count)
    return d_slots, d_gates
