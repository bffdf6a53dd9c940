"""Tokens to expert slots and back (the MoE layer's encode and decode), with backward passes
made of gathers.

The forwards compute what DeepSpeed's do (``deepspeed.moe.sharded_moe._route_slots`` and
``_sparse_encode``: a gather into the ``[E, C, M]`` slot buffer, in ``ops.encode_routes``,
on CUDA one fill and two launches, or, for a consumer that reads the tokens' rows through
the slots' source map, no buffer: ``encode_gathered``; and ``_sparse_decode``'s ops: a
gather of each token's routes weighted by its gates in float32, keeping the gathered rows
for the gates' gradient as autograd does). DeepSpeed's autograd backwards are ``index_add_``
scatters, which on the GPU are atomic adds into bf16 rows: at hidden 7168 with 32 experts x
640 slots, ~1 ms each, 10% of the whole layer step on one H200
(``bench/results/layer_routing_streams_h200``). Here both backwards are gathers:

- decode: every used slot receives exactly one route's gradient, so the scatter is a
  permutation; it becomes a gather through the inverse map (slot -> route), done with the
  gates' gradient by ``ops.route_grads`` (on CUDA one pass over tokens and slots).
- encode: a token receives the gradients of its (up to k) slots; they are gathered and
  summed in float32 in ascending slot order, rounded once, as the CPU's index_add_ does. On
  a GPU, DeepSpeed's atomic bf16 adds round after each addition in whatever order they
  land: the same result for k <= 2, an order-dependent one for larger k.

The values equal DeepSpeed's (the tests compare them; signed zeros aside: ``0 + -0`` is
``+0`` in a scatter into zeros).

The sums over a token's routes are ``ops.weighted_route_sum`` (the decode: its gates'
products added in route order) and ``ops.slot_sum`` (the encode's backward: the slots'
gradients added in ascending slot order, as the CPU's index_add_ does), both in float32 and
rounded once, reading the slots in place: on CUDA one launch each, where DeepSpeed's fused
restore kernel (AutoEP's) needed ~10 torch ops around it. Their values are the eager ops'
for k <= 2 (a GPU's atomic adds in DeepSpeed's encode backward are order-dependent for
larger k; the decode adds in route order). The gates' gradient is the eager decode's on
the CPU (``route_grads``' twin) and, on CUDA, summed over the hidden dimension in another
order (float32 rounding) by its kernel.
"""

import dataclasses
from typing import Optional

import torch

from ds_fp4 import ops

__all__ = ["encode", "encode_gathered", "decode", "GatheredSlots"]


@dataclasses.dataclass
class GatheredSlots:
    """The slots' rows as their reader takes them without the ``[E, C, M]`` buffer, both
    ways (EP 1's FP8 experts): in the forward ``tokens`` ``[S, M]`` through ``source`` (int64
    ``[E * C]``, slot -> token, -1 where none: ``encode_gathered``); in the backward the
    decode's gradient ``grad = (dy [S, M], slot_gates float32 [E * C])``, the slots'
    gradient being ``dtype(dy[source[s]] * slot_gates[s])`` (``ops.route_gate_grads``),
    which ``decode`` leaves here for the experts (their output's gradient is then a stride-0
    placeholder) when it is given this object. The layer drops ``tokens`` once they are read
    (held by the backward's contexts, they would keep the layer's input alive)."""
    tokens: Optional[torch.Tensor]
    source: torch.Tensor
    grad: Optional[tuple] = None

    def take_grad(self) -> Optional[tuple]:
        """``grad``, handed over once."""
        grad, self.grad = self.grad, None
        return grad

    def handed_grad(self, grad_out: torch.Tensor, reader: str) -> Optional[tuple]:
        """``(dy, source, slot_gates)`` where the decode left the slots' gradient here
        (``take_grad``), else None. ``grad_out``, the gradient autograd gave ``reader`` for
        the slots, must then be the decode's stride-0 placeholder: anything added to it on
        the way would be lost, so a real one is refused."""
        grad = self.take_grad()
        if grad is None:
            return None
        if any(grad_out.stride()):
            raise RuntimeError(f"{reader}: the slots' gradient came both from the decode "
                               "(through GatheredSlots) and from elsewhere, which would be "
                               "lost: pass the slots through routing.decode alone")
        return grad[0], self.source, grad[1]


# ---- encode -----------------------------------------------------------------------------

NO_GRADS = (None,) * 5   # the encode's arguments after the tokens


class _Encode(torch.autograd.Function):
    """``gathered``: no slot buffer (``ops.route_map``): a stride-0 placeholder of its shape
    and each slot's source token instead."""

    @staticmethod
    def forward(ctx, tokens, indices, locations, num_experts, capacity, gathered):
        ctx.mode = ops.get_kernels()   # the layer's kernels setting, for the backward too
        if gathered:
            slots, used, source = ops.route_map(indices, locations, num_experts, capacity)
            out = tokens.new_zeros(()).expand(num_experts, capacity, tokens.shape[1])
            ctx.mark_non_differentiable(slots, used, source)
        else:
            (out, slots, used), source = ops.encode_routes(
                tokens, indices, locations, num_experts, capacity), None
            ctx.mark_non_differentiable(slots, used)
        ctx.save_for_backward(slots)
        ctx.set_materialize_grads(False)   # no zero tensors made for slots' and used's
        return out, slots, used, source

    @staticmethod
    def backward(ctx, grad, _slots, _used, _source):
        if grad is None:
            return None, *NO_GRADS
        (slots,) = ctx.saved_tensors
        with ops.kernels(ctx.mode):
            return ops.slot_sum(grad.reshape(-1, grad.shape[-1]), slots), *NO_GRADS


# ---- decode -----------------------------------------------------------------------------

class _Decode(torch.autograd.Function):
    """DeepSpeed's decode: the output straight from the slots (``ops.weighted_route_sum``:
    no gathered copy, no float32 ``[k, S, M]`` products on CUDA); the routes' outputs are
    gathered only to be kept for the gates' gradient, as FP8 rows quantized straight from
    the slots or as rows (a dropped route's row: zeros or any slot's; the backward reads
    neither)."""

    @staticmethod
    def forward(ctx, expert_output, slots, gates, num_tokens, keep, fp8, gathered):
        ctx.gathered = gathered
        ctx.mode = ops.get_kernels()   # the layer's kernels setting, for the backward too
        rows = expert_output.contiguous()
        kept = None
        if keep and fp8:        # from the sum's own reads of the routes' rows; dropped: zeros
            out, kept = ops.weighted_route_sum_kept(rows, slots, gates)
        else:
            out = ops.weighted_route_sum(rows, slots, gates)
        if keep and not fp8:
            kept = rows.index_select(0, slots.reshape(-1).clamp(max=rows.shape[0] - 1))
        ctx.save_for_backward(slots, gates, kept)
        ctx.slot_count = rows.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad):
        """The experts' output gradient (a tensor of its own storage: the experts may write
        their input's gradient into it, ``fp8_expert_passes.donated_grad``) and the gates'
        from the kept routes' outputs, in one pass on CUDA (``ops.route_grads``). With a
        ``GatheredSlots``, the slots' gates and dy go to it instead of the slots' gradient,
        and the experts' output gets a stride-0 placeholder (``ops.route_gate_grads``)."""
        slots, gates, kept = ctx.saved_tensors
        routes = kept if ctx.needs_input_grad[2] else None
        grad = grad.contiguous()
        with ops.kernels(ctx.mode):
            if ctx.gathered is not None and ctx.needs_input_grad[0]:
                d_gates, slot_gates = ops.route_gate_grads(grad, slots, gates, ctx.slot_count,
                                                           routes)
                ctx.gathered.grad = (grad, slot_gates)
                d_output = grad.new_zeros(()).expand(ctx.slot_count, grad.shape[1])
            else:
                d_output, d_gates = ops.route_grads(grad, slots, gates, ctx.slot_count, routes)
        return (d_output if ctx.needs_input_grad[0] else None), None, d_gates, *(None,) * 4


def encode(tokens, indices, locations, num_experts, capacity):
    """The gate's sparse routes to slots and ``[S, M]`` -> ``[E, C, M]`` (``ops.encode_routes``:
    DeepSpeed's ``_route_slots`` and ``_sparse_encode``), whose backward gathers each token's
    slot gradients (see the module docstring).

    Returns:
        ``(out [E, C, M], slots int64 [k, S], used int64 [E])``: ``used[e]`` is one past the
        last of expert e's slots a route takes; its slots from there on are capacity padding,
        zero rows that ``decode`` never reads (DeepSpeed's gates fill each expert's slots
        from its first).
    """
    return _Encode.apply(tokens, indices, locations, num_experts, capacity, False)[:3]


def encode_gathered(tokens, indices, locations, num_experts, capacity):
    """``encode`` for a consumer that reads the tokens' rows itself, through the slots'
    source map (``FP8Experts``' ``gather``): the ``[E, C, M]`` slot buffer is never made.

    Returns:
        ``(placeholder, slots, used, source)``: ``placeholder`` a stride-0 ``[E, C, M]``
        tensor of the tokens' dtype whose values must not be read (the autograd path: its
        gradient, the slots' ``[E, C, M]``, reaches the tokens as ``encode``'s does);
        ``slots`` and ``used`` as ``encode``'s; ``source`` int64 ``[E * C]``: each slot's
        token, -1 where none is (``ops.route_map``).
    """
    return _Encode.apply(tokens, indices, locations, num_experts, capacity, True)


def decode(expert_output, slots, gates, num_tokens, fp8_routes=False, gathered=None):
    """``_sparse_decode(expert_output, slots, gates, num_tokens)``: ``[E*C, M]`` -> ``[S, M]``,
    whose backward gathers each slot's route gradient (see the module docstring).
    ``fp8_routes``: keep the routes' outputs for the gates' gradient as FP8 1x128 rows
    (``M % 128 == 0``; ``cache.route_output_format``) instead of as autograd would.
    ``gathered``: None, or the ``GatheredSlots`` of the experts that made ``expert_output``
    (float32 gates): the backward hands them dy and the slots' gates instead of making the
    slots' gradient."""
    keep = torch.is_grad_enabled() and gates.requires_grad     # rows for the gates' gradient
    return _Decode.apply(expert_output, slots, gates, num_tokens, keep, fp8_routes, gathered)
