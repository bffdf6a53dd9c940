"""Tokens to expert slots and back (the MoE layer's encode and decode), with backward passes
made of gathers.

The forwards compute what DeepSpeed's do (``deepspeed.moe.sharded_moe._route_slots`` and
``_sparse_encode``: a gather into the ``[E, C, M]`` slot buffer, in ``ops.encode_routes``,
on CUDA one fill and two launches; and ``_sparse_decode``'s ops: a
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
``+0`` in a scatter into zeros). The gate gradients are computed with the very ops
autograd runs for DeepSpeed's decode.

On CUDA the sums over routes run in DeepSpeed's own fused restore kernels (those of
AutoEP's ``combine_impl: fused_weighted_sum``): the decode reads the slots directly (no
zero-row copy of the experts' output, no float32 ``[k, S, M]`` products; 2.1 ms of 14.4
at 32 experts top-2 on an H200, ``bench/results/fused_decode_h200``), and the encode's
backward sums each token's slot gradients in one pass, in the same ascending slot order and
float32. The same values, but for the gates' gradient, summed over the hidden dimension in
another order (float32 rounding) by ``route_grads``' kernel, and for the decode's output at
k > 2 (added in route order).
"""

import functools

import torch

from ds_fp4 import ops
from ds_fp4.config import Format
from ds_fp4.moe.alltoall import pack_rows

__all__ = ["encode", "decode"]


def _with_zero_row(t):
    """``t [R, M]`` with a zero row appended: index R reads zeros (dropped routes' slot)."""
    return torch.cat([t, t.new_zeros(1, t.shape[1])])


# ---- DeepSpeed's fused restore kernels (CUDA) ------------------------------------------

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


def _fused_for(rows, gates=None):
    """Whether a sum over routes runs in DeepSpeed's fused kernels: on CUDA, for their row
    dtypes and float32 gates (as the gate gives them: the kernels multiply in float32, as
    the eager product of bf16 rows and float32 gates does)."""
    return (rows.is_cuda and (gates is None or gates.dtype == torch.float32)
            and rows.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and _fused_restore() is not None)


def _sources(slots, rows):
    """``slots [k, S]`` as the kernels' index: token s's route j at ``s * k + j``, int32,
    -1 for a route to the scratch slot (``rows``: the real slots; -1 reads zeros)."""
    # one copy (transposed, to int32) and one masked fill, where where + reshape + to made
    # two copies: that form took 131 us of host time a call (bench/results/host_breakdown_h200)
    out = slots.t().to(torch.int32, memory_format=torch.contiguous_format)
    return out.masked_fill_(out >= rows, -1).view(-1)


def _sum_routes(rows, sources, scores):
    """``out[s] = sum_j rows[sources[s, j]] * scores[s, j]``: float32 products added in
    order j, rounded once to ``rows.dtype`` (a source of -1 adds zero)."""
    return _fused_restore().apply(rows, scores, sources, scores.shape[1])


# ---- encode -----------------------------------------------------------------------------

NO_GRADS = (None,) * 4   # the encode's arguments after the tokens


class _Encode(torch.autograd.Function):

    @staticmethod
    def forward(ctx, tokens, indices, locations, num_experts, capacity):
        out, slots, used = ops.encode_routes(tokens, indices, locations, num_experts, capacity)
        ctx.save_for_backward(slots)
        ctx.mark_non_differentiable(slots, used)
        return out, slots, used

    @staticmethod
    def backward(ctx, grad, _slots, _used):
        (slots,) = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        # each token's slots in ascending order, so that sums of k > 2 round as the CPU's
        # index_add_ does; dropped routes sit on the scratch slot E*C, which reads zeros
        ordered = torch.sort(slots, dim=0).values
        if _fused_for(rows):
            ones = rows.new_ones(slots.shape[1], slots.shape[0], dtype=torch.float32)
            return _sum_routes(rows, _sources(ordered, rows.shape[0]), ones), *NO_GRADS
        padded = _with_zero_row(rows)
        out = padded.index_select(0, ordered[0])
        if len(ordered) == 1:
            return out, *NO_GRADS
        if len(ordered) == 2:   # one addition: rounded once, as any order of adds would be
            return out + padded.index_select(0, ordered[1]), *NO_GRADS
        acc = out.float()
        for route in ordered[1:]:
            acc += padded.index_select(0, route)
        return acc.to(grad.dtype), *NO_GRADS


# ---- decode -----------------------------------------------------------------------------

def _decode_backward(ctx, grad):
    """Both decodes' backward: the experts' output gradient (a tensor of its own storage:
    the experts may write their input's gradient into it, ``fp8_expert_passes.donated_grad``)
    and the gates' from the kept routes' outputs, in one pass on CUDA (``ops.route_grads``)."""
    slots, gates, kept = ctx.saved_tensors
    routes = kept if ctx.needs_input_grad[2] else None
    d_output, d_gates = ops.route_grads(grad, slots, gates, ctx.slot_count, routes)
    return (d_output if ctx.needs_input_grad[0] else None), d_gates


class _Decode(torch.autograd.Function):
    """DeepSpeed's decode, its eager ops (CPU, or no fused kernels)."""

    @staticmethod
    def forward(ctx, expert_output, slots, gates, num_tokens, fp8):
        routed = _with_zero_row(expert_output).index_select(0, slots.reshape(-1))
        routed = routed.view(slots.shape[0], num_tokens, expert_output.shape[-1])
        # what autograd keeps for DeepSpeed's decode (the routes' outputs: or their FP8 rows)
        ctx.save_for_backward(slots, gates, pack_rows(routed, Format.FP8) if fp8 else routed)
        ctx.slot_count = expert_output.shape[0]
        return (routed * gates.unsqueeze(-1)).sum(0).to(expert_output.dtype)

    @staticmethod
    def backward(ctx, grad):
        d_output, d_gates = _decode_backward(ctx, grad)
        return d_output, None, d_gates, None, None


class _FusedDecode(torch.autograd.Function):
    """DeepSpeed's decode in its fused restore kernels (CUDA): the output straight from the
    slots (no gathered copy, no float32 ``[k, S, M]`` products); the routes' outputs are
    gathered only to be kept for the gates' gradient, as FP8 rows quantized straight from
    the slots or as rows (a dropped route's row: zeros or any slot's; the backward reads
    neither). The output equals the eager ops' for k <= 2 (for k > 2 added in route order)."""

    @staticmethod
    def forward(ctx, expert_output, slots, gates, num_tokens, keep, fp8):
        rows = expert_output.contiguous()
        out = _sum_routes(rows, _sources(slots, rows.shape[0]), gates.t().contiguous())
        kept = None
        if keep and fp8:        # no gathered copy; a dropped route's row is zeros
            kept = ops.quantize_fp8_rows(rows, index=slots.reshape(-1).long())
        elif keep:
            kept = rows.index_select(0, slots.reshape(-1).clamp(max=rows.shape[0] - 1))
        ctx.save_for_backward(slots, gates, kept)
        ctx.slot_count = rows.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad):
        d_output, d_gates = _decode_backward(ctx, grad.contiguous())
        return d_output, None, d_gates, None, None, None


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
    return _Encode.apply(tokens, indices, locations, num_experts, capacity)


def decode(expert_output, slots, gates, num_tokens, fp8_routes=False):
    """``_sparse_decode(expert_output, slots, gates, num_tokens)``: ``[E*C, M]`` -> ``[S, M]``,
    whose backward gathers each slot's route gradient (see the module docstring). On CUDA
    in DeepSpeed's fused restore kernels (``_FusedDecode``). ``fp8_routes``: keep the
    routes' outputs for the gates' gradient as FP8 1x128 rows (``M % 128 == 0``;
    ``cache.route_output_format``) instead of as autograd would."""
    if not _fused_for(expert_output, gates):
        return _Decode.apply(expert_output, slots, gates, num_tokens, fp8_routes)
    keep = torch.is_grad_enabled() and gates.requires_grad     # rows for the gates' gradient
    return _FusedDecode.apply(expert_output, slots, gates, num_tokens, keep, fp8_routes)
