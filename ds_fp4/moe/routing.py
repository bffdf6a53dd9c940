"""Tokens to expert slots and back (the MoE layer's encode and decode), with backward passes
made of gathers.

The forwards compute what DeepSpeed's do (``deepspeed.moe.sharded_moe._sparse_encode``,
called as is: a gather into the ``[E, C, M]`` slot buffer; and ``_sparse_decode``'s ops: a
gather of each token's routes weighted by its gates in float32, keeping the gathered rows
for the gates' gradient as autograd does). DeepSpeed's autograd backwards are ``index_add_``
scatters, which on the GPU are atomic adds into bf16 rows: at hidden 7168 with 32 experts x
640 slots, ~1 ms each, 10% of the whole layer step on one H200
(``bench/results/layer_routing_streams_h200``). Here both backwards are gathers:

- decode: every used slot receives exactly one route's gradient, so the scatter is a
  permutation; it becomes a gather through the inverse map (slot -> route).
- encode: a token receives the gradients of its (up to k) slots; they are gathered and
  summed in float32 in ascending slot order, rounded once, as the CPU's index_add_ does. On
  a GPU, DeepSpeed's atomic bf16 adds round after each addition in whatever order they
  land: the same result for k <= 2, an order-dependent one for larger k.

The values equal DeepSpeed's (the tests compare them; signed zeros aside: ``0 + -0`` is
``+0`` in a scatter into zeros). The gate gradients are computed with the very ops
autograd runs for DeepSpeed's decode.
"""

import functools
import types

import torch

from deepspeed.moe.sharded_moe import _sparse_encode

__all__ = ["encode", "decode"]


def _with_zero_row(t):
    """``t [R, M]`` with a zero row appended: index R reads zeros (dropped routes' slot)."""
    return torch.cat([t, t.new_zeros(1, t.shape[1])])


class _Encode(torch.autograd.Function):

    @staticmethod
    def forward(ctx, tokens, slots, num_experts, capacity):
        ctx.save_for_backward(slots)
        return _sparse_encode(tokens, slots, num_experts, capacity)

    @staticmethod
    def backward(ctx, grad):
        (slots,) = ctx.saved_tensors
        padded = _with_zero_row(grad.reshape(-1, grad.shape[-1]))
        # dropped routes sit on the scratch slot E*C, which reads the zero row
        ordered = torch.sort(slots, dim=0).values
        out = padded.index_select(0, ordered[0])
        if len(ordered) == 1:
            return out, None, None, None
        if len(ordered) == 2:   # one addition: rounded once, as any order of adds would be
            return out + padded.index_select(0, ordered[1]), None, None, None
        acc = out.float()
        for route in ordered[1:]:
            acc += padded.index_select(0, route)
        return acc.to(grad.dtype), None, None, None


@functools.lru_cache(maxsize=None)
def _fused_restore():
    """DeepSpeed's fused weighted restore (``_FusedWeightedRestore``, the Triton kernels of
    AutoEP's ``combine_impl: fused_weighted_sum``), or None where this DeepSpeed, its
    Triton or the device lacks it (then the eager ops run)."""
    try:
        from deepspeed.ops.triton_ops import autoep_fused_token_ops as fused
    except ImportError:
        return None
    restore = getattr(fused, "_FusedWeightedRestore", None)
    return restore if restore is not None and fused.is_available() else None


def _fused_for(routed, gates):
    """Whether the weighted sum over routes runs in DeepSpeed's fused kernels: on CUDA, for
    float32 gates (as the gate gives them: the kernels multiply in float32, as the eager
    product of bf16 rows and float32 gates does) and the kernels' row dtypes."""
    return (routed.is_cuda and gates.dtype == torch.float32 and _fused_restore() is not None
            and routed.dtype in (torch.bfloat16, torch.float16, torch.float32))


def _route_order(k, tokens, device):
    """For DeepSpeed's kernels: the row of ``routed [k * tokens, M]`` that holds token s's
    route j, at position ``s * k + j``."""
    order = torch.arange(k * tokens, device=device, dtype=torch.int32)
    return order.view(k, tokens).t().reshape(-1)


def _weighted_sum(routed, gates):
    """``sum_j routed[j] * gates[j]`` in float32, rounded once to the rows' dtype: the
    eager ops of DeepSpeed's decode, or one fused kernel on CUDA (the products rounded to
    float32 before the sum, added in route order: the same values for k <= 2)."""
    if not _fused_for(routed, gates):
        return (routed * gates.unsqueeze(-1)).sum(0).to(routed.dtype)
    k, tokens, m = routed.shape
    order = _route_order(k, tokens, routed.device)
    return _fused_restore().apply(routed.view(k * tokens, m), gates.t().contiguous(), order, k)


def _weighted_sum_grads(grad, routed, gates, need_gates):
    """The gradients of ``_weighted_sum``: ``(d routed, d gates or None)``, d routed as
    autograd gives it for DeepSpeed's decode (``float32(grad) * gate`` rounded to the rows'
    dtype); d gates ``<grad, routed[j]>`` in float32 (fused: summed in another order)."""
    if _fused_for(routed, gates):
        k, tokens, m = routed.shape
        saved = types.SimpleNamespace(top_k=k, saved_tensors=(
            routed.reshape(k * tokens, m), gates.t().contiguous(),
            _route_order(k, tokens, routed.device)))
        d_rows, d_scores = _fused_restore().backward(saved, grad)[:2]
        return d_rows.view(routed.shape), d_scores.t().to(gates.dtype)
    # the ops autograd runs for DeepSpeed's decode, in its order and dtypes
    d_combined = grad.to(torch.promote_types(routed.dtype, gates.dtype))
    d_combined = d_combined.unsqueeze(0).expand(routed.shape)
    d_gates = None
    if need_gates:
        d_gates = (d_combined * routed).sum(-1, keepdim=True).squeeze(-1).to(gates.dtype)
    return (d_combined * gates.unsqueeze(-1)).to(routed.dtype), d_gates


class _Decode(torch.autograd.Function):

    @staticmethod
    def forward(ctx, expert_output, slots, gates, num_tokens):
        routed = _with_zero_row(expert_output).index_select(0, slots.reshape(-1))
        routed = routed.view(slots.shape[0], num_tokens, expert_output.shape[-1])
        ctx.save_for_backward(slots, gates, routed)   # what autograd keeps for DeepSpeed's
        ctx.slot_count = expert_output.shape[0]
        return _weighted_sum(routed, gates)

    @staticmethod
    def backward(ctx, grad):
        slots, gates, routed = ctx.saved_tensors
        d_routed, d_gates = _weighted_sum_grads(grad, routed, gates, ctx.needs_input_grad[2])
        if not ctx.needs_input_grad[2]:
            d_gates = None
        d_output = None
        if ctx.needs_input_grad[0]:
            routes = slots.numel()
            inverse = torch.full((ctx.slot_count + 1,), routes, dtype=torch.long,
                                 device=slots.device)
            inverse.scatter_(0, slots.reshape(-1).long(),
                             torch.arange(routes, device=slots.device))
            d_output = _with_zero_row(d_routed.view(routes, -1)).index_select(0, inverse[:-1])
        return d_output, None, d_gates, None


def encode(tokens, slots, num_experts, capacity):
    """``_sparse_encode(tokens, slots, num_experts, capacity)``: ``[S, M]`` -> ``[E, C, M]``,
    whose backward gathers each token's slot gradients (see the module docstring)."""
    return _Encode.apply(tokens, slots, num_experts, capacity)


def decode(expert_output, slots, gates, num_tokens):
    """``_sparse_decode(expert_output, slots, gates, num_tokens)``: ``[E*C, M]`` -> ``[S, M]``,
    whose backward gathers each slot's route gradient (see the module docstring)."""
    return _Decode.apply(expert_output, slots, gates, num_tokens)
