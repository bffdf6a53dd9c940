"""FP8 GEMMs for AutoEP's ``GroupedExperts``, fed straight from the received MXFP4 rows.

The layer hands its experts one ``[N, H]`` buffer whose rows are grouped by local expert,
each expert's segment a multiple of 128 rows (``counts``, on the device; AutoEP's
permutation with 128-row alignment, ``layer.permute_aligned``; zero rows pad each segment
and follow the last). Here every GEMM kind is one grouped launch over those contiguous
segments (``ds_fp4.ops.grouped_gemm``; the segment offsets stay on the device: no host sync,
no loop over experts):

forward:   x: received MXFP4 rows -> FP8 1x128 (``mxfp4_rows_to_fp8``, exact), or bf16 -> FP8
           z = x @ [w1; w3]^T     grouped 1x128 x 128x128, bf16 out (zeros after the groups)
           h = silu(z_gate) * z_up -> FP8 1x128 (``ops.segment_quant``, "swiglu")
           y = h @ w2^T           grouped
kept:      the received rows themselves (or x in the cache format) and z in the activation
           cache format (default: the cache's)
backward:  dW2 first, then dh = dy @ w2, dz = dh * swiglu'(z), dx = dz @ [w1; w3]  grouped
           dW = (rows of each expert)^T (rows of each expert)        K-grouped, both
           operands FP8 1x128 along tokens (one fused pass quantizes dy and dz along
           features and tokens; x^T by ``mxfp4_to_fp8_colwise`` from the kept MXFP4 rows)

All of it runs on the rows where the permutation put them (see ``_Function``). With one
rank the rows need not exist: given a ``SlotMap`` the experts read each row from the tokens
in place (``slot_map``), and their input's gradient goes back to the tokens as each token's
sum over its routes (``ops.slot_sum``).

The math is the legacy layer's ``FP8Experts`` (equal segments give the same bytes; the CPU
tests check it); the weights stay AutoEP's ``w1``/``w3``/``w2`` parameters.
"""

from typing import NamedTuple, Optional

import torch
from torch.nn import functional as F

from ds_fp4 import formats, ops
from ds_fp4.config import Format, choice
from ds_fp4.moe import weight_cache
from ds_fp4.moe.alltoall import kernel_scope
from ds_fp4.moe.routing import GatheredSlots
# the legacy FP8 experts' activation and cache helpers: one definition of each
from ds_fp4.moe.fp8_expert_passes import (_dense_z, _encode_cache, _grad_dtype, _keep_z,
                                          donated_grad)
from ds_fp4.ops.grouped_gemm import k_grouped_gemm_fp8_nt, m_grouped_gemm_fp8_nt

__all__ = ["SlotMap", "fp8_experts_problem", "run_fp8_experts", "slot_map"]

G = formats.FP8_GROUP


def fp8_experts_problem(experts) -> str:
    """Why FP8 GEMMs cannot run AutoEP's ``experts`` ('' when they can)."""
    if getattr(experts, "activation", "swiglu") != "swiglu":
        return f"the experts' activation is {experts.activation!r} (FP8 experts run swiglu)"
    e, ffn, hidden = experts.w1.shape
    bad = [f"{name} = {size}" for name, size in (("hidden", hidden), ("ffn", ffn)) if size % G]
    if bad:
        return (f"{' and '.join(bad)} must be multiples of {G} (128x128 FP8 weight tiles); "
                f"round them up to multiples of {G}")
    return ""


class SlotMap(NamedTuple):
    """Where each row of the experts' permuted input comes from (``slot_map``).

    ``tokens``: int64 ``[N]``, the token whose row is slot j's (past the tokens for a
    padding slot: a zero row); ``slots``: int64 ``[k, T]``, the slot of token t's j-th
    route (``ops.slot_sum``'s and ``routing.decode``'s layout); ``handoff``: None, or the
    ``routing.GatheredSlots`` (source ``tokens``) through which a ``routing.decode`` of the
    experts' output hands their backward dy and the slots' gates instead of the slots'
    gradient."""
    tokens: torch.Tensor
    slots: torch.Tensor
    handoff: Optional[GatheredSlots] = None


def slot_map(order, indices, top_k):
    """The ``SlotMap`` of AutoEP's two steps ``x[order // top_k]`` (the routes in expert
    order) then ``permute_aligned`` (``indices``: its ``permuted_indices``, -1 at padding),
    without making either copy.

    Arguments:
        order: int64 ``[T * k]``, the routes (``t * k + j``) in expert order.
        indices: int ``[N]``, each slot's position in ``order``, or padding: -1 (AutoEP's),
            or anything outside ``[0, T * k)`` (its ``inverse_permutation``'s rule).
        top_k: k.
    """
    routes = order.numel()
    # padding, clamped to -1 or the routes, reads the entry past them: the route count
    route = F.pad(order, (0, 1), value=routes)[indices.clamp(-1, routes)]
    positions = torch.arange(indices.numel(), device=indices.device)
    # padding slots then go to distinct places past the routes, as in AutoEP's
    # inverse_permutation: each place of the scatter written once
    route = torch.where(route == routes, routes + positions, route)
    slots = torch.empty(routes + indices.numel(), dtype=torch.int64, device=order.device)
    slots.scatter_(0, route, positions)
    # [k, T] contiguous: what ops.slot_sum reads, without the padding's tail
    return SlotMap(route // top_k, slots[:routes].view(-1, top_k).t().contiguous())


def run_fp8_experts(experts, x, counts, rows=None, cache="mxfp4", rounding="rceil",
                    exactness=None, kernels=None, z_cache=None, tiles=None, donate_grad=False,
                    gather=None):
    """AutoEP's experts on ``x`` with FP8 GEMMs.

    Arguments:
        experts: AutoEP's ``GroupedExperts`` (``w1``/``w3`` ``[E, F, H]``, ``w2``
            ``[E, H, F]``, swiglu).
        x: ``[N, H]`` rows grouped by expert, N a multiple of 128 (the autograd input;
            only a shape and dtype when ``rows`` is given). Padding rows are zeros. With
            ``gather``: the tokens ``[T, H]``, bf16, whose rows ``gather`` names.
        counts: int ``[E]`` rows per expert (padding included), multiples of 128, on
            ``x``'s device (checked only where reading them costs no sync: on the CPU);
            rows past their sum are padding (their outputs are zeros).
        rows: uint8 ``[N, H/2 + H/32]``, the same rows as packed MXFP4 (the received
            payload), or None.
        cache: a ``Format`` (or ``"mxfp4"``/``"fp8"``/``"bf16"``): how z (and x, without
            ``rows``) is kept.
        rounding: MXFP4 scale rule for what is quantized here.
        exactness: int64 ``[3]`` counters (``ds_fp4.moe.exactness``) that the direct
            conversions of ``rows`` add to (forward: every row's groups; backward: every
            column group of the N rows; zero padding rows count as exact), or None.
        kernels: ``ops.kernels`` mode of every op of the forward and the backward, or None
            (the process setting).
        z_cache: how z alone is kept (``fp4_moe.activation_cache``), or None: as ``cache``.
        tiles: a ``weight_cache.TileCache`` holding the weights' FP8 tiles between
            optimizer steps, or None (made on every pass).
        donate_grad: the output's gradient may take the input's (``donated_grad``): only
            when the op after the experts makes it fresh for them alone in its backward
            (the layer's unpermutation does).
        gather: None, or (no ``rows``, an MXFP4 or FP8 cache) a ``SlotMap``: the experts'
            ``N`` input rows are ``x``'s rows it names, read in place; ``x``'s gradient is
            each token's sum over its routes. With its ``handoff``, the output's gradient
            may come as dy and the slots' gates from a ``routing.decode`` of the output.
    Returns:
        ``[N, H]`` in ``x``'s dtype.
    """
    cache = choice(Format, cache, "cache")
    z_cache = cache if z_cache is None else choice(Format, z_cache, "activation_cache")
    if gather is not None:
        _check_gather(x, rows, cache, gather)
    _check_layout(x.shape[0] if gather is None else gather.tokens.numel(), counts)
    with kernel_scope(kernels):
        return _Function.apply(x, rows, counts, (cache, z_cache), rounding, exactness,
                               (kernels, tiles, donate_grad), gather, experts.w1,
                               experts.w3, experts.w2)


# ---- layout -------------------------------------------------------------------------------


def _check_layout(n, counts):
    """Refuse rows that are not in 128-row segments: the token groups would span experts.
    ``n``: the experts' row count (x's, or the slots' map's)."""
    if n % G:
        raise ValueError(f"x must have a multiple of {G} rows (each expert's segment "
                         f"padded to {G}: layer.permute_aligned); got {n}")
    if counts.device.type == "cpu" and (bool((counts % G).any()) or counts.sum() > n):
        raise ValueError(f"counts must be multiples of {G} within the {n} rows; "
                         f"got {counts.tolist()}")


def _check_gather(x, rows, cache, gather):
    """What reading the rows through ``gather`` needs (the layer decides it can)."""
    if rows is not None or cache not in (Format.MXFP4, Format.FP8) \
            or x.dtype != torch.bfloat16:
        raise ValueError(f"gather reads bf16 tokens for an MXFP4 or FP8 cache, without rows; "
                         f"got x {x.dtype}, cache {cache.value}, rows "
                         f"{'given' if rows is not None else 'None'}")


def _offsets(counts):
    """The segments' int32 row offsets ``[E + 1]``, on the counts' device (no sync)."""
    return F.pad(counts.to(torch.int32).cumsum(0, dtype=torch.int32), (1, 0))


def _rows_op(q):
    """``segment_quant``'s one-segment row output as an M-grouped operand."""
    data, scales = q
    return data, scales[0].t()


def _cols_op(q):
    """``segment_quant``'s one-segment column output as a K-grouped operand ``[K, height]``."""
    data, scales = q
    return data[0], scales[0].t()


def _tiles(cache, weights_a, weights_b=None, transpose=False):
    """128x128 tiles of each expert's ``[a; b]`` (or ``a``): ``[E, N, K]`` and scales, made
    now or held by ``cache`` (a ``weight_cache.TileCache``, or None)."""
    stacks = (weights_a,) if weights_b is None else (weights_a, weights_b)
    return weight_cache.tile_quant_stacked(cache, stacks, transpose)


# ---- the autograd Function ------------------------------------------------------------------
# Each expert's rows start at a multiple of 128 (zero rows fill the gaps): the 128-token scale
# groups of the weight-gradient operands then never span two experts, so one fused pass over
# all rows quantizes an operand along features and along tokens at once (``segment_quant``
# with one segment, SwiGLU and its gradient computed on the way in), and the MXFP4 input goes
# to FP8 columns by the direct conversion. The zero rows cost GEMM work (up to 128 an expert).


class _Function(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, rows, counts, caches, rounding, exactness, how, gather, w1, w3, w2):
        # the forward runs in the kernels' scope (run_fp8_experts)
        kernels, ctx.tiles, ctx.donate = how
        ctx.kernels = kernels
        ctx.exactness = exactness
        hidden = x.shape[1]
        n = x.shape[0] if gather is None else gather.tokens.numel()
        index = None if gather is None else gather.tokens
        offs = _offsets(counts)
        cache, z_cache = caches   # how x (without rows) and z are kept
        ctx.meta = (z_cache, x.dtype, hidden, w1.shape[1], n)
        if rows is not None:
            x_op = ops.mxfp4_rows_to_fp8(rows, hidden, exactness)
            kept_x, ctx.x_format = rows, "rows"
        else:
            xb = x.to(torch.bfloat16)
            x_op = _rows_op(ops.segment_quant(xb, 1, n, row=True, index=index)[0])
            kept_x, ctx.x_format = _encode_cache(xb, cache, rounding, index), cache
        z = m_grouped_gemm_fp8_nt(*x_op, *_tiles(ctx.tiles, w1, w3), offsets=offs)
        del x_op
        kept_z, z = _keep_z(z, z_cache, rounding)
        h_op = _rows_op(ops.segment_quant(z, 1, n, row=True, source="swiglu")[0])
        del z
        y = m_grouped_gemm_fp8_nt(*h_op, *_tiles(ctx.tiles, w2), offsets=offs)
        ctx.handoff = None if gather is None else gather.handoff
        route_slots = None if gather is None else gather.slots
        ctx.save_for_backward(kept_z, kept_x, offs, route_slots, w1, w3, w2)
        return y.to(x.dtype)   # zeros past the last group

    @staticmethod
    def backward(ctx, dy):
        with kernel_scope(ctx.kernels):
            return _Function._backward(ctx, dy)

    @staticmethod
    def _backward(ctx, dy):
        kept_z, kept_x, offs, route_slots, w1, w3, w2 = ctx.saved_tensors
        z_cache, dtype, hidden, ffn, n = ctx.meta
        need_x, need_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[8:])
        into, (dy_row, dy_col) = _dy_operands(ctx, dy, n, dtype, need_x, need_w)
        z = _dense_z(kept_z, z_cache, 2 * ffn)
        wdtype = _grad_dtype(w1.dtype)
        d2 = None
        if need_w:
            # The down weights' gradient first: dy's and h's columns are then gone before
            # w1's and w3's, when all three gradients are live (the pass's memory peak).
            h_col = ops.segment_quant(z, 1, n, row=False, col=True, source="swiglu")[1]
            d2 = k_grouped_gemm_fp8_nt(*_cols_op(dy_col), *_cols_op(h_col), col_offsets=offs,
                                       out_dtype=wdtype)
            del h_col
        del dy_col
        dh = m_grouped_gemm_fp8_nt(*_rows_op(dy_row), *_tiles(ctx.tiles, w2, transpose=True),
                                   offsets=offs)
        del dy_row
        dz_row, dz_col = ops.segment_quant(z, 1, n, row=need_x, col=need_w,
                                           source="swiglu_grad", dh=dh)
        del dh, z
        dx = None
        if need_x:
            dx = m_grouped_gemm_fp8_nt(*_rows_op(dz_row),
                                       *_tiles(ctx.tiles, w1, w3, transpose=True),
                                       offsets=offs, out=into).to(dtype)
            if route_slots is not None:   # the slots' gradients to their tokens
                dx = ops.slot_sum(dx, route_slots)
        del dz_row
        grads = [None, None, None]
        if need_w:   # w1, w3, w2
            x_col = _x_columns(kept_x, ctx.x_format, n, hidden, ctx.exactness)
            # w1's and w3's gradients from one launch over dz^T's gate and up halves, each
            # into a tensor of its own: contiguous, so autograd takes it as the .grad
            # without a copy (slices of one [E, 2F, H] result would each be copied)
            d1, d3 = k_grouped_gemm_fp8_nt(*_cols_op(dz_col), *x_col, col_offsets=offs,
                                           out_dtype=wdtype, halves=True)
            grads = [d1.to(w1.dtype), d3.to(w3.dtype), d2.to(w2.dtype)]
        return (dx, None, None, None, None, None, None, None, *grads)


def _dy_operands(ctx, dy, n, dtype, need_x, need_w):
    """``(into, (dy_row, dy_col))``: where the input's gradient may go (``donated_grad``)
    and dy quantized along features and, for the weight gradients, along tokens. Where a
    ``routing.decode`` handed over dy and the slots' gates (``SlotMap.handoff``), the slots'
    rows are read from dy's token rows times their gates (``dy`` is then the decode's
    placeholder, and nothing is donated)."""
    handed = None if ctx.handoff is None else \
        ctx.handoff.handed_grad(dy, "AutoEP's FP8 experts")
    if handed is None:
        into = donated_grad(dy, dtype, ctx.donate and need_x)   # dx goes there
        return into, ops.segment_quant(dy.contiguous(), 1, n, row=True, col=need_w)
    dy_tokens, index, slot_gates = handed
    return None, ops.segment_quant(dy_tokens, 1, n, row=True, col=need_w, index=index,
                                   scale=slot_gates)


def _x_columns(kept_x, x_format, n, hidden, exactness=None):
    """The input as FP8 1x128 along tokens ``[H, n]`` (and scales ``[H, n/128]``), from what
    forward kept: the received MXFP4 rows (converted directly, counted into ``exactness``)
    or x in the cache format."""
    if x_format in ("rows", "mxfp4"):
        counts = exactness if x_format == "rows" else None
        return ops.mxfp4_to_fp8_colwise(*ops.split_mxfp4_rows(kept_x, hidden), [0, n], counts)
    x = _dense_z(kept_x, x_format, hidden)
    return _cols_op(ops.segment_quant(x, 1, n, row=False, col=True)[1])
