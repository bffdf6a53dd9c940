"""The seam where the local experts run on the received rows: one function.

With ``fp8`` it runs the grouped FP8 experts (``autoep.fp8_experts``: one launch per GEMM
kind over the contiguous segments, fed from the packed rows). Otherwise AutoEP's own
``GroupedExperts`` (``torch._grouped_mm``, Triton or a loop) on the dequantized rows, under
``ExpertInputCache`` so that the experts' saved input is the received MXFP4 payload instead
of the dense rows (no recompute: the saved rows are dequantized once in the backward pass),
and with ``activation_cache`` set, under a ``RowsCache`` of their ``[N, F]`` activations.
"""

import contextlib

from typing import Optional, Tuple

import torch

from ds_fp4.config import Format, Kernels, ScaleRounding
from ds_fp4.moe.autoep.fp8_experts import SlotMap, run_fp8_experts
from ds_fp4.moe.cache import ExpertInputCache, activation_hooks
from ds_fp4.moe.weight_cache import TileCache


def run_local_experts(experts, x: torch.Tensor, counts: torch.Tensor,
                      rows: Optional[torch.Tensor] = None, cache: Optional[Format] = None,
                      rounding: ScaleRounding = ScaleRounding.RCEIL,
                      kernels: Optional[Kernels] = None,
                      fp8: bool = False, exactness: Optional[torch.Tensor] = None,
                      z_cache: Optional[Format] = None,
                      tiles: Optional[TileCache] = None,
                      donate_grad: bool = False,
                      gather: Optional[SlotMap] = None) -> Tuple[torch.Tensor, int]:
    """Run this rank's experts on rows grouped by expert.

    Arguments:
        experts: the layer's ``deepspeed.moe.ep_experts.GroupedExperts`` (``w1``/``w3``
            ``[E_local, F, H]``, ``w2`` ``[E_local, H, F]``).
        x: ``[N, H]`` contiguous, the model's dtype: expert e's rows are
            ``x[sum(counts[:e]) : sum(counts[:e+1])]`` (AutoEP's aligned segments; padding
            rows are zeros; rows past ``sum(counts)`` are padding too). The autograd input:
            its gradient flows back to the dispatch.
        counts: int32 ``[E_local]`` rows per expert (AutoEP's aligned ``m_sizes``), on
            ``x``'s device; with ``fp8``, multiples of 128 and N too (the layer's
            ``permute_aligned`` with 128-row alignment).
        rows: uint8 ``[N, R]``: the same rows packed in ``cache`` format (the received
            payload, in the same order), or None (packed here when first saved).
        cache: ``Format`` in which the experts' saved input is kept, or None (autograd keeps
            ``x`` itself).
        rounding: MXFP4 block-scale rule for packing.
        kernels: ``ops.kernels`` mode of every op the experts and the cache run, forward
            and backward, or None (the process setting).
        fp8: run the experts' GEMMs in FP8 (``rows``, when given, must be MXFP4; the cache
            format then keeps z, and x when no rows came).
        exactness: with ``fp8``, the counters the rows' direct conversion adds to, or None.
        z_cache: with ``fp8``, how z is kept when not as the cache; without, how the bf16
            experts keep their ``[N, F]`` activations (gate, up, silu(gate), h). None: as
            the cache (fp8), as autograd does (bf16 experts).
        tiles: with ``fp8``, the layer's ``TileCache`` of FP8 weight tiles
            (``fp4_moe.fp8_weight_cache``), or None (made on every pass).
        donate_grad: with ``fp8``, the output's gradient may take the input's (the caller's
            next op makes it fresh for the experts alone in its backward).
        gather: with ``fp8`` (no ``rows``, an MXFP4 or FP8 cache), a ``SlotMap``: ``x`` is
            then the tokens, and the N rows are the ones the map names, read in place.
    Returns:
        ``(y, cached_views)``: ``y`` ``[N, H]`` in ``x``'s dtype (rows past ``sum(counts)``
        are unspecified: they are never read) and the number of saved views of ``x`` that
        the cache took over (0 without a cache or without grad).
    """
    if gather is not None and not fp8:
        raise ValueError("gather: only the FP8 experts read their rows through a SlotMap; "
                         "AutoEP's experts take the permuted rows (pass gather=None)")
    if fp8:
        mx_rows = rows if cache == Format.MXFP4 else None
        return run_fp8_experts(experts, x, counts, mx_rows, cache or Format.BF16,
                               rounding, exactness, kernels, z_cache, tiles, donate_grad,
                               gather), 0
    if cache is None and z_cache is None or not torch.is_grad_enabled():
        return experts(x, counts), 0
    keeper = None if cache is None else \
        ExpertInputCache(x, cache, rounding, rows=rows, kernels=kernels)
    inputs = keeper.hooks() if keeper else contextlib.nullcontext()
    with activation_hooks(z_cache, x.shape[0], experts.w1.shape[1], x.dtype, rounding,
                          kernels), inputs:
        y = experts(x, counts)
    return y, keeper.packed_views if keeper else 0
