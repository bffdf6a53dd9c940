"""FP4AutoEPMoELayer: DeepSpeed's AutoEP layer with MXFP4 dispatch, FP8 gradients and an
MXFP4 expert-input cache.

A subclass of ``deepspeed.module_inject.auto_ep_layer.AutoEPMoELayer`` made by swapping the
class of a layer AutoEP built (``to_fp4_autoep``): every parameter, buffer, name and
checkpoint key stays AutoEP's. Its ``_forward`` is AutoEP's dropless forward for the
all-to-all backend, composed of AutoEP's own helpers (router, ``compute_split_plan``,
``permute_by_local_expert``, ``unpermute_by_local_expert``, ``combine_from_routed``, the
output tail), with the two ``_AllToAllV`` calls replaced:

- **dispatch** (``wire_all_to_all_v``): right before the all-to-all with AutoEP's variable
  splits, each token is packed to MXFP4 once (``K/2 + K/32`` bytes a row) and its packed
  row gathered once per route (top-k: k times fewer rows to quantize; with AutoEP's
  ``score_apply: pre`` the scaled routes are packed instead); the received packed rows are
  put into the experts' order by AutoEP's permutation (moving 0.53 B per element instead
  of 2; with ``fp8_experts: true`` its DeepSpeed pieces with segments aligned to 128 rows,
  which the FP8 experts take as they are: ``permute_aligned``) and kept as the experts'
  saved input; the gradient goes back as FP8 1x128 rows (``K + K/128``).
- **combine**: bf16 forward (default), FP8 gradient back. The routes' outputs that the
  restore keeps for the router scores' gradient are kept as FP8 rows when the recipe keeps
  activations below bf16 (``moe.cache.route_output_hooks``; AutoEP's
  ``legacy_bmm`` debug combine keeps its float32 copy). Under ``score_apply: pre`` the
  float32 copy of the routes that the scaling keeps for the same gradient is taken instead.

The split sizes are the host lists AutoEP already brings to the host: no other sync.
With ``fp4_moe.enabled`` false, or during ``bf16_start_steps``, ``_forward`` is AutoEP's own.
"""

import contextlib
import logging
from typing import Optional

import torch

from ds_fp4 import formats
from ds_fp4.config import Format, FP4MoEConfig
from ds_fp4.moe.alltoall import A2AVHandle, kernel_scope, wire_all_to_all_v, wire_plans
from ds_fp4.moe import bf16_start, exactness, routing
from ds_fp4.moe.cache import kept_format, route_output_format, route_output_hooks
from ds_fp4.moe.autoep import _internals
from ds_fp4.moe.autoep.experts import run_local_experts
from ds_fp4.moe.autoep.fp8_experts import slot_map
from ds_fp4.moe.weight_cache import TileCache

logger = logging.getLogger(__name__)

_ael = _internals.auto_ep_layer
_ek = _internals.ep_kernels
# Without AutoEP the class below still has to be defined; conversion refuses first.
_BASE = _ael.AutoEPMoELayer if _ael is not None and hasattr(_ael, "AutoEPMoELayer") \
    else torch.nn.Module


def permute_aligned(tokens: torch.Tensor, local_counts: torch.Tensor,
                    alignment: Optional[int] = None):
    """AutoEP's ``permute_by_local_expert``, with each expert's segment aligned to
    ``alignment`` rows (None: AutoEP's own function and alignment, 8).

    The FP8 experts want 128 (``formats.FP8_GROUP``): their 1x128 token groups then never
    span two experts, so they run on the permuted rows as they are, with no re-padding
    copy. This composes the DeepSpeed pieces AutoEP's function is built from with that
    alignment (empty experts get ``alignment`` zero rows, as AutoEP's get 8); its output
    goes back through AutoEP's ``unpermute_by_local_expert``, which reads only the indices.

    Returns:
        AutoEP's ``(rows [N', ...] with zero padding rows, permuted_indices [N'] (padding
        -1), aligned counts int32 [E_local], N)``; N' is a multiple of ``alignment``.
    """
    if alignment is None:
        return _ael.permute_by_local_expert(tokens, local_counts)
    indices, sizes = _aligned_indices(local_counts, tokens.shape[0], alignment, tokens.device)
    if _ek.permute_rows_supported(tokens):
        return _ek.permute_rows(tokens, indices), indices, sizes, tokens.shape[0]
    # AutoEP's fallback: the padding index -1 reads an appended zero row
    padded = torch.vstack((tokens, tokens.new_zeros((tokens.shape[-1],))))
    return padded[indices, :], indices, sizes, tokens.shape[0]


def _aligned_indices(local_counts, n, alignment, device):
    """``generate_permute_indices`` as AutoEP calls it, with ``alignment``: the permuted
    indices and aligned counts, on ``device``."""
    ep_degree, n_local = local_counts.shape if local_counts.ndim == 2 \
        else (1, local_counts.numel())
    max_len = -(-(n + n_local * alignment) // alignment) * alignment   # AutoEP's bound
    use_cpu = device.type == "cpu"   # as AutoEP: its Triton index kernel needs a GPU
    counts = local_counts.reshape(-1)
    with torch.no_grad():
        indices, sizes, _ = _ek.generate_permute_indices(
            counts.cpu() if use_cpu else counts, n_local, ep_degree, max_len, alignment,
            use_cpu=use_cpu)
    return indices.to(device), sizes.to(device)


class _ExpertOrder:
    """AutoEP's permutation of the received rows into aligned per-expert segments.

    ``permute`` runs ``permute_aligned`` on the packed rows (zero rows at the alignment
    padding, which unpack to zeros in every format) and records what the experts, the
    unpermutation and the backward pass need.

    Arguments:
        local_counts: int ``[ep_size, E_local]`` rows from each source rank for each local
            expert (``SplitPlan.local_counts_by_source``).
        alignment: ``permute_aligned``'s (None: AutoEP's).
    Attributes (after ``permute``):
        indices: AutoEP's ``permuted_indices`` ``[N']`` (padding: -1).
        counts: int32 ``[E_local]`` aligned rows per expert.
        n_rows: rows received (``N``).
    """

    def __init__(self, local_counts: torch.Tensor, alignment: Optional[int] = None):
        self.local_counts, self.alignment = local_counts, alignment
        self.indices = self.counts = self.n_rows = None

    def permute(self, rows: torch.Tensor) -> torch.Tensor:
        out, self.indices, self.counts, self.n_rows = permute_aligned(
            rows, self.local_counts, self.alignment)
        return out

    def restore(self, grad: torch.Tensor) -> torch.Tensor:
        return _ael.unpermute_by_local_expert(grad, self.indices, self.n_rows)


class FP4AutoEPMoELayer(_BASE):
    """AutoEP's MoE layer with the ``fp4_moe`` wire formats and expert-input cache.

    Built by ``to_fp4_autoep`` from an ``AutoEPMoELayer`` (class swap), never directly.
    Attributes set by ``fp4_setup``: ``fp4_config`` (``FP4MoEConfig``), ``last_handles``
    (the ``A2AVHandle`` of the latest dispatch and combine, for bytes; None with one rank)
    and, after each forward, ``cached_views`` (saved views of the experts' input that the
    cache took over; 0 means nothing was saved through it).

    ``forward(hidden_states [B, S, H])`` returns what AutoEP's does (``[B, S, H]``, or the
    tuple with router logits some HF models expect).
    """

    def fp4_setup(self, cfg: FP4MoEConfig) -> None:
        """(Re)configure with a checked config (``convert.check_layer`` ran first)."""
        self.fp4_config = cfg
        self._plans = wire_plans(cfg)
        self.last_handles = (None, None)
        self.cached_views = 0
        # counts what the FP8 experts convert directly (ds_fp4.moe.exactness_stats)
        self.fp4_exactness = exactness.ExactnessCounter() \
            if cfg.enabled and cfg.monitor_exactness else None
        # the FP8 experts' weight tiles, held from one optimizer step to the next
        self.fp4_tiles = TileCache() if cfg.enabled and cfg.fp8_weight_cache else None

    # -- forward ---------------------------------------------------------------------------

    def _forward(self, hidden_states: torch.Tensor):
        if not self.fp4_config.enabled or bf16_start.in_bf16_start(self):
            return super()._forward(hidden_states)
        bsz, seqlen, hdim = hidden_states.shape
        x = hidden_states.reshape(-1, hdim)  # [T, H]
        if self.combine_impl == "fused_weighted_sum" and not self._fused_combine_checked:
            _ael.fused_token_ops.assert_supported(x, score_apply=self.score_apply)
            self._fused_combine_checked = True  # fail every rank before any collective

        ro = _ael.RouterOutput(*self.router(x, self.expert_bias))
        pending = None
        if self.async_split_plan and self.ep_size > 1:
            pending = self._start_async_split_plan(ro.num_tokens_per_expert)
        with torch.no_grad():
            self.tokens_per_expert.add_(ro.num_tokens_per_expert)

        # Routes in expert order, so that each destination rank's rows are contiguous.
        order = torch.argsort(ro.selected_experts.view(-1), stable=True)
        if self.ep_size == 1 and self._reads_gathered(x):
            output = self._gathered_local_layer(x, ro, order).view(bsz, seqlen, hdim)
            return self._finalize_output(output, x, hidden_states, hdim)
        if self.ep_size > 1 and self.score_apply == "post":
            # The dispatch packs each token once and sends its packed row k times.
            plan = self._split_plan(ro, pending)
            expert_out = self._dispatch_experts_combine(x, plan, order // self.top_k)
        else:
            routed = self._scaled_routes(x[order // self.top_k], ro.top_scores.view(-1)[order])
            if self.ep_size == 1:
                expert_out = self._local_experts(routed, ro.num_tokens_per_expert)
            else:
                plan = self._split_plan(ro, pending)
                expert_out = self._dispatch_experts_combine(routed, plan)

        output = self._restore_tokens(expert_out, ro, order, (bsz, seqlen, hdim))
        return self._finalize_output(output, x, hidden_states, hdim)

    def _split_plan(self, ro, pending):
        """AutoEP's split plan: per-rank row counts on the host (its one sync per layer)."""
        if pending is not None:
            return self._wait_async_split_plan(pending)
        return _ael.compute_split_plan(
            selected_experts=ro.selected_experts, num_experts=self.num_experts,
            ep_size=self.ep_size, num_local_experts=self.num_local_experts,
            ep_group=self.ep_group, num_tokens_per_expert=ro.num_tokens_per_expert)

    def _cache_format(self, dtype: torch.dtype) -> Optional[Format]:
        return kept_format(self.fp4_config.cache, dtype)

    def _fp8_experts(self) -> bool:
        # fp8_experts: true runs the grouped FP8 experts; "auto" keeps AutoEP's bf16 ones
        # until the FP8 path is measured faster inside AutoEP (convert.py)
        return self.fp4_config.fp8_experts is True

    def _alignment(self) -> Optional[int]:
        """The experts' row alignment: 128 for the FP8 experts (they take the permuted
        rows as they are), else AutoEP's (None)."""
        return formats.FP8_GROUP if self._fp8_experts() else None

    def _run_experts(self, x, counts, rows, cache, gather=None):
        plan = self._plans[0]
        fp8 = self._fp8_experts()
        counter = self.fp4_exactness.tensor(x.device) if fp8 and self.fp4_exactness else None
        cfg = self.fp4_config
        y, self.cached_views = run_local_experts(
            self.experts, x, counts, rows, cache, plan.rounding, plan.kernels, fp8, counter,
            z_cache=cfg.z_cache if fp8 else cfg.activation_cache, tiles=self.fp4_tiles,
            # y goes to AutoEP's unpermutation or to routing.decode: either backward makes
            # the gradient fresh for the experts alone
            donate_grad=True, gather=gather)
        return y

    def _local_experts(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One rank: nothing is sent; the cache alone applies (it packs the experts' input)."""
        x, indices, aligned, n_rows = permute_aligned(routed, counts, self._alignment())
        self.last_handles = (None, None)
        y = self._run_experts(x.contiguous(), aligned, None, self._cache_format(x.dtype))
        return _ael.unpermute_by_local_expert(y, indices, n_rows)

    def _reads_gathered(self, x: torch.Tensor) -> bool:
        """Whether, with one rank, the layer runs as ``_gathered_local_layer``: what the
        FP8 experts' gathering quantizers take (bf16 tokens sent unscaled, ``score_apply:
        post``, to an MXFP4 or FP8 cache) and a weighted-sum combine (not the
        ``legacy_bmm`` debug combine, which keeps a float32 copy). ``weighted_sum`` and
        ``fused_weighted_sum`` then both mean ``routing.decode``."""
        return (self._fp8_experts() and self.score_apply == "post"
                and self.combine_impl != "legacy_bmm" and x.dtype == torch.bfloat16
                and self._cache_format(x.dtype) in (Format.MXFP4, Format.FP8))

    def _gathered_local_layer(self, x: torch.Tensor, ro, order: torch.Tensor):
        """One rank, FP8 experts: AutoEP's local path (the routes copied into expert
        order and aligned to 128 rows, the experts, the routes' outputs copied back into
        route order, their score-weighted sum) with no ``[T*k, H]`` copy either way, as
        the legacy layer's EP 1 path runs: the experts read each slot's row from the
        tokens (``slot_map``) and give the tokens their routes' summed gradient
        (``ops.slot_sum``); ``routing.decode`` sums the slots' outputs weighted by the
        scores, keeping the routes' FP8 rows for the scores' gradient from the same
        reads, and hands the experts dy and the slots' scores (``SlotMap.handoff``)
        instead of the slots' gradient. Returns ``[T, H]``.

        Against AutoEP's copies: the same output and expert gradients for top-2 (float32
        products and sums, rounded once; slots' gradients rounded as AutoEP's); the
        scores' gradient sums over the hidden size in the decode's order, so the router's
        and the input's gradients may differ in the last bits; for k > 2 the sums'
        orders may differ too."""
        indices, aligned = _aligned_indices(ro.num_tokens_per_expert, order.numel(),
                                            formats.FP8_GROUP, x.device)
        routes = slot_map(order, indices, self.top_k)
        routes = routes._replace(handoff=routing.GatheredSlots(None, routes.tokens))
        self.last_handles = (None, None)
        y = self._run_experts(x.contiguous(), aligned, None, self._cache_format(x.dtype),
                              routes)
        fp8_routes = route_output_format(self.fp4_config.z_cache, x.shape[1]) == Format.FP8
        with kernel_scope(self._plans[0].kernels):
            return routing.decode(y, routes.slots, ro.top_scores.t().float(), x.shape[0],
                                  fp8_routes, routes.handoff)

    def _dispatch_experts_combine(self, routed: torch.Tensor, plan,
                                  source: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Routes -> experts' outputs ``[T*k, H]`` back here, in route order.

        ``routed``: ``[T*k, H]`` rows by destination rank, or with ``source`` (int64
        ``[T*k]``, the token of each route) the tokens ``[T, H]`` themselves.
        """
        dispatch_plan, combine_plan = self._plans
        cache = self._cache_format(routed.dtype)
        expert_order = _ExpertOrder(plan.local_counts_by_source, self._alignment())
        # The received payload is the cache when both use one format: nothing is re-packed.
        keep = cache is not None and cache == dispatch_plan.forward and torch.is_grad_enabled()
        dispatch = A2AVHandle(dispatch_plan, self.ep_group, plan.input_splits,
                              plan.output_splits, source_rows=source, order=expert_order,
                              keep_rows=keep)
        expert_in = wire_all_to_all_v(routed, dispatch)  # [N', H] in expert order
        y = self._run_experts(expert_in, expert_order.counts, dispatch.take_rows(), cache)
        dispatch.source_rows = None  # autograd holds it for the backward; the handle
        # (last_handles) keeps only counts and the order
        y = _ael.unpermute_by_local_expert(y, expert_order.indices, expert_order.n_rows)
        combine = A2AVHandle(combine_plan, self.ep_group, plan.output_splits, plan.input_splits)
        out = wire_all_to_all_v(y, combine)
        self.last_handles = (dispatch, combine)
        return out

    def _scaled_routes(self, routes, scores):
        """AutoEP's ``score_apply`` before the experts (``pre``: routes x scores in float32,
        whose float32 copy of the routes, kept for the scores' gradient, is kept as
        ``route_output_format`` says, like the routes' outputs under ``post``)."""
        hooks = contextlib.nullcontext()
        if self.score_apply == "pre":
            hooks = route_output_hooks(self.fp4_config.z_cache, *routes.shape, torch.float32,
                                       self._plans[0])
        with hooks:
            return _ael.apply_scores_before_experts_if_enabled(routes, scores,
                                                                score_apply=self.score_apply)

    def _restore_tokens(self, expert_out, ro, order, shape):
        """The routes' outputs back to tokens, weighted by the router scores (AutoEP's);
        what it saves for the scores' gradient is kept as ``route_output_format`` says."""
        with route_output_hooks(self.fp4_config.z_cache, *expert_out.shape, expert_out.dtype,
                                self._plans[0]):
            return self._weighted_restore(expert_out, ro, order, shape)

    def _weighted_restore(self, expert_out, ro, order, shape):
        if self.combine_impl == "fused_weighted_sum":
            return _ael.fused_token_ops.fused_weighted_restore(
                expert_out, top_scores=ro.top_scores, token_indices_sorted=order,
                top_k=self.top_k, shape=shape)
        return _ael.combine_from_routed(
            expert_out, top_scores=ro.top_scores, token_indices_sorted=order,
            top_k=self.top_k, score_apply=self.score_apply, combine_impl=self.combine_impl,
            shape=shape)
