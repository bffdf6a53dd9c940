"""The MoE encode from the gate's sparse routes: slots, the slot buffer and the used slots.

DeepSpeed's gates (``sparse_routes=True``) give each token's k routes as expert indices
(-1: dropped) and locations (arrival order within the expert), int32 ``[k, S]``. The layer
then needs each route's slot (``deepspeed.moe.sharded_moe._route_slots``: ``e * C + loc``,
``E * C`` for a dropped route), the ``[E, C, M]`` buffer of the tokens in their slots
(``_sparse_encode``: an inverse map, then a gather from the tokens with a zero row
appended) and, for the FP8 experts at EP 1, each expert's used slots (one past its largest
location: the rest is capacity padding). That is ~21 small torch ops, ~0.7 ms of host time
before the experts' first kernel at 32 experts x hidden 7168 on an H200, where the GPU waits
for the host (``bench/results/host_gaps_h200``). On CUDA (``backend.uses_kernels``, int32
routes, rows of a multiple of 16 bytes) ``encode_routes.cu`` does it in one fill and two
launches, reading the tokens in place (no appended copy): the same bytes.

``route_map`` is the same without the buffer: each slot's source token instead (``-1``
where none), for consumers that read the tokens' rows through it in place
(``ops.quantize_mxfp4_rows`` and ``ops.segment_quant`` take it as their ``index``): on CUDA
one fill and two launches, the second a single CTA.

``encode_routes_ref`` is DeepSpeed's two functions, called as they are, plus the used count;
``route_map_ref`` DeepSpeed's ``_route_slots`` plus the used count and the source map.
Routes must be what DeepSpeed's gates give: a kept route's expert in ``[0, E)`` and location
in ``[0, C)``, no two kept routes in one slot. The kernel drops any other route (writes
nothing out of bounds); DeepSpeed's functions do not check.
"""

import torch

from ds_fp4.ops import _cuda_loader as L
from ds_fp4.ops import backend, checks

__all__ = ["encode_routes", "encode_routes_ref", "route_map", "route_map_ref"]


def _check(tokens, indices, locations, num_experts, capacity):
    checks.tensor("tokens", tokens)
    checks.matrix("tokens", tokens)
    _check_routes(indices, locations, num_experts, capacity, tokens)
    checks.same_device(tokens=tokens, indices=indices, locations=locations)


def _check_routes(indices, locations, num_experts, capacity, tokens=None):
    checks.dtype("indices", indices, (torch.int32, torch.int64))
    checks.dtype("locations", locations, (torch.int32, torch.int64))
    if tokens is None:
        checks.matrix("indices", indices)
    else:
        checks.routes("indices", indices, "tokens", tokens.shape[0])
    checks.same_shape("locations", locations, "indices", indices)
    checks.int_at_least("num_experts", num_experts, 1)
    checks.int_at_least("capacity", capacity, 1)
    checks.same_device(indices=indices, locations=locations)


def _used(slots, num_experts, capacity):
    """Per expert, one past the largest slot index within it that a route takes (int64)."""
    flat = slots.reshape(-1)
    expert = flat.div(capacity, rounding_mode="floor")      # the scratch slot: num_experts
    used = flat.new_zeros(num_experts + 1)
    used.scatter_reduce_(0, expert, flat - expert * capacity + 1, "amax")
    return used[:num_experts]


def encode_routes_ref(tokens, indices, locations, num_experts, capacity):
    """The PyTorch twin of ``encode_routes`` (same arguments; DeepSpeed's functions)."""
    _check(tokens, indices, locations, num_experts, capacity)
    return _ref(tokens, indices, locations, num_experts, capacity)


def _ref(tokens, indices, locations, num_experts, capacity):
    from deepspeed.moe.sharded_moe import _route_slots, _sparse_encode
    slots = _route_slots(indices, locations, num_experts, capacity)
    out = _sparse_encode(tokens, slots, num_experts, capacity)
    return out, slots, _used(slots, num_experts, capacity)


def _source_ref(slots, slot_count):
    """Each slot's source token (int64 ``[slot_count]``, -1 where no kept route is)."""
    flat = slots.reshape(-1)
    source = torch.full((slot_count + 1,), -1, dtype=torch.int64, device=slots.device)
    kept = (flat >= 0) & (flat < slot_count)
    tokens = torch.arange(flat.numel(), device=slots.device) % slots.shape[1]
    source.scatter_(0, torch.where(kept, flat, slot_count), tokens)
    return source[:slot_count]


def route_map_ref(indices, locations, num_experts, capacity):
    """The PyTorch twin of ``route_map`` (same arguments)."""
    _check_routes(indices, locations, num_experts, capacity)
    from deepspeed.moe.sharded_moe import _route_slots
    slots = _route_slots(indices, locations, num_experts, capacity)
    return (slots, _used(slots, num_experts, capacity),
            _source_ref(slots, num_experts * capacity))


def route_map(indices, locations, num_experts, capacity):
    """``encode_routes``' map without the ``[E, C, M]`` buffer (module docstring).

    Arguments:
        indices, locations, num_experts, capacity: as for ``encode_routes``.
    Returns:
        ``(slots int64 [k, S], used int64 [E])`` as ``encode_routes`` gives them, and
        ``source`` int64 ``[E * C]``: slot s's token, -1 where no route takes s.
    """
    _check_routes(indices, locations, num_experts, capacity)
    if not _kernel_routes(indices, locations):
        return route_map_ref(indices, locations, num_experts, capacity)
    slots, used, source, last = _map(indices, locations, num_experts, capacity)
    L.launch(indices.device, "encode_routes", "encode_routes_used", 1,
             (L.ptr(last), L.i64(num_experts), L.ptr(used)))
    return slots, used, source


def _kernel_routes(indices, locations):
    return (backend.uses_kernels(indices, locations) and indices.dtype == torch.int32
            and locations.dtype == torch.int32)


def _map(indices, locations, num_experts, capacity):
    """``encode_routes_map``'s launch: ``(slots, used (unwritten), source, last)``."""
    dev = indices.device
    k, count = indices.shape
    indices, locations = indices.contiguous(), locations.contiguous()
    slot_count = num_experts * capacity
    slots = torch.empty(k, count, dtype=torch.int64, device=dev)
    used = torch.empty(num_experts, dtype=torch.int64, device=dev)
    # one fill for both: -1 in int64 is -1 in each int32 half as well
    marks = torch.full((slot_count + num_experts,), -1, dtype=torch.int64, device=dev)
    source, last = marks[:slot_count], marks[slot_count:].view(torch.int32)[:num_experts]
    if indices.numel():
        L.launch(dev, "encode_routes", "encode_routes_map", L.blocks_for(indices.numel()),
                 (L.ptr(indices), L.ptr(locations), L.i64(indices.numel()), L.i64(count),
                  L.i64(num_experts), L.i64(capacity), L.ptr(slots), L.ptr(source), L.ptr(last)))
    return slots, used, source, last


def encode_routes(tokens, indices, locations, num_experts, capacity):
    """Tokens into their experts' slots (module docstring).

    Arguments:
        tokens: ``[S, M]``, any dtype (its rows are copied as bytes).
        indices: int32/int64 ``[k, S]``: route ``(j, t)``'s expert, -1 if dropped.
        locations: ``[k, S]`` like ``indices``: the route's slot within its expert.
        num_experts, capacity: E and C of the ``[E, C, M]`` buffer.
    Returns:
        ``(out [E, C, M] of tokens' dtype, zeros in slots no route takes; slots int64
        [k, S]: e * C + loc, E * C for a dropped route; used int64 [E]: one past each
        expert's largest location, 0 for an expert without routes)``.
    """
    _check(tokens, indices, locations, num_experts, capacity)
    row_bytes = tokens.shape[1] * tokens.element_size()
    if (not _kernel_routes(indices, locations) or not backend.uses_kernels(tokens)
            or row_bytes % 16 or tokens.stride(-1) != 1
            or (tokens.stride(0) * tokens.element_size()) % 16 or tokens.data_ptr() % 16):
        return _ref(tokens, indices, locations, num_experts, capacity)
    dev = tokens.device
    slot_count = num_experts * capacity
    out = torch.empty(num_experts, capacity, tokens.shape[1], dtype=tokens.dtype, device=dev)
    slots, used, source, last = _map(indices, locations, num_experts, capacity)
    L.launch(dev, "encode_routes", "encode_routes_gather", slot_count + 1,
             (L.ptr(tokens), L.i64(tokens.stride(0) * tokens.element_size()), L.ptr(source),
              L.i64(slot_count), L.i64(row_bytes), L.ptr(out), L.ptr(last),
              L.i64(num_experts), L.ptr(used)))
    return out, slots, used
