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

``encode_routes_ref`` is DeepSpeed's two functions, called as they are, plus the used count.
Routes must be what DeepSpeed's gates give: a kept route's expert in ``[0, E)`` and location
in ``[0, C)``, no two kept routes in one slot. The kernel drops any other route (writes
nothing out of bounds); DeepSpeed's functions do not check.
"""

import torch

from ds_fp4.ops import _cuda_loader as L
from ds_fp4.ops import backend, checks

__all__ = ["encode_routes", "encode_routes_ref"]


def _check(tokens, indices, locations, num_experts, capacity):
    checks.tensor("tokens", tokens)
    checks.matrix("tokens", tokens)
    checks.dtype("indices", indices, (torch.int32, torch.int64))
    checks.dtype("locations", locations, (torch.int32, torch.int64))
    checks.routes("indices", indices, "tokens", tokens.shape[0])
    checks.same_shape("locations", locations, "indices", indices)
    checks.int_at_least("num_experts", num_experts, 1)
    checks.int_at_least("capacity", capacity, 1)
    checks.same_device(tokens=tokens, indices=indices, locations=locations)


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
    if (not backend.uses_kernels(tokens, indices, locations) or indices.dtype != torch.int32
            or locations.dtype != torch.int32 or row_bytes % 16 or tokens.stride(-1) != 1
            or (tokens.stride(0) * tokens.element_size()) % 16 or tokens.data_ptr() % 16):
        return _ref(tokens, indices, locations, num_experts, capacity)
    dev = tokens.device
    k, count = indices.shape
    indices, locations = indices.contiguous(), locations.contiguous()
    slot_count = num_experts * capacity
    out = torch.empty(num_experts, capacity, tokens.shape[1], dtype=tokens.dtype, device=dev)
    slots = torch.empty(k, count, dtype=torch.int64, device=dev)
    used = torch.empty(num_experts, dtype=torch.int64, device=dev)
    marks = torch.full((slot_count + num_experts,), -1, dtype=torch.int32, device=dev)
    source, last = marks[:slot_count], marks[slot_count:]
    if indices.numel():
        L.launch(dev, "encode_routes", "encode_routes_map", L.blocks_for(indices.numel()),
                 (L.ptr(indices), L.ptr(locations), L.i64(indices.numel()), L.i64(count),
                  L.i64(num_experts), L.i64(capacity), L.ptr(slots), L.ptr(source), L.ptr(last)))
    L.launch(dev, "encode_routes", "encode_routes_gather", slot_count + 1,
             (L.ptr(tokens), L.i64(tokens.stride(0) * tokens.element_size()), L.ptr(source),
              L.i64(slot_count), L.i64(row_bytes), L.ptr(out), L.ptr(last),
              L.i64(num_experts), L.ptr(used)))
    return out, slots, used
