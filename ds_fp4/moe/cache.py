"""Keep the experts' saved inputs, and the routes' outputs the combine saves for the gate
gradient, as MXFP4 (or FP8/bf16) rows until their backward.

Autograd keeps, for the experts' backward, views of the tensor the dispatch produced (the
first Linear of every expert saves its input). Under ``ExpertInputCache.hooks()`` every
saved tensor that lies in that buffer is replaced by the packed rows that cover it (the
received MXFP4 payload itself when the dispatch sent MXFP4) and rebuilt in the backward
pass; everything else is passed through untouched.

Why the layout matters: DeepSpeed's ``Experts`` hands expert j the view
``inputs.chunk(n_local, dim=1)[j]`` of ``[ep, n_local, C, M]``. In DeepSpeed's own layout
that view is not contiguous, so ``Linear`` copies it and saves the copy, which no hook keyed
on the buffer would recognise. The layer therefore lays the buffer out expert-major
(``[n_local, ep, C, M]`` in memory): each chunk is one contiguous block and the tensor the
Linear saves is a view of the buffer.

Hooks compose: tensors this cache does not take, and the packed rows of those it does take,
go through whatever ``saved_tensors_hooks`` were active outside (for example
``torch.utils.checkpoint(use_reentrant=False)``, which then recomputes them instead of
keeping them, or a memory-measuring hook). ``deepspeed.checkpointing.checkpoint`` runs its
first forward without grad (nothing is saved) and the replay with grad, where the cache
works as without checkpointing.
"""

import contextlib
import weakref
from typing import Optional

import torch

from ds_fp4.config import Format, Kernels, ScaleRounding
from ds_fp4.formats import FP8_GROUP
from ds_fp4.moe.alltoall import kernel_scope, pack_rows, unpack_rows


def _outer_hooks():
    """The (pack, unpack) hooks active outside ours, or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def others_hooks_active() -> bool:
    """Whether saved-tensor hooks are active here (someone else's, when called outside
    ds_fp4's own: non-reentrant checkpointing, offloading, a memory count)."""
    return _outer_hooks() is not None


class _Outer:
    """A saved tensor left to the outer hooks (or kept as is when there are none)."""

    __slots__ = ("packed", "unpack_outer")

    def __init__(self, packed, unpack_outer):
        self.packed, self.unpack_outer = packed, unpack_outer

    def unpack(self):
        return self.packed if self.unpack_outer is None else self.unpack_outer(self.packed)


def kept_format(fmt: Optional[Format], dtype: torch.dtype) -> Optional[Format]:
    """``fmt`` for keeping a tensor of ``dtype``, or None where autograd's own saving is
    that format (bf16 in a bf16 model): then no cache is needed."""
    return None if fmt == Format.BF16 and dtype == torch.bfloat16 else fmt


def _pass_on(t: torch.Tensor, outer) -> _Outer:
    """A saved tensor a cache does not take, for the outer hooks (kept as is without)."""
    return _Outer(t.detach(), None) if outer is None else _Outer(outer[0](t), outer[1])


class _Restore:
    """What every packed reference of one cache shares: how to rebuild rows.

    Holds no tensor of the forward pass. A row range saved by several views (a SwiGLU
    expert's gate and up both save its input) is rebuilt once: ``pending`` counts the views
    of each range not yet unpacked, and ``kept`` holds the rebuilt rows until the last of
    them is (autograd frees each unpacked tensor right after its use, so a weak memo alone
    would rebuild them for every view). ``memo`` still finds rows rebuilt for a backward
    that unpacks more often than packed (``retain_graph``).
    """

    def __init__(self, fmt: Format, dtype: torch.dtype, m: int, kernels, unpack_outer):
        self.fmt, self.dtype, self.m, self.kernels = fmt, dtype, m, kernels
        self.unpack_outer = unpack_outer
        self.memo = weakref.WeakValueDictionary()
        self.pending = {}
        self.kept = {}

    def rows_to_dense(self, key, payload):
        dense = self.kept.get(key)
        if dense is None:
            dense = self.memo.get(key)
        if dense is None:
            with kernel_scope(self.kernels):
                dense = unpack_rows(payload, self.fmt, self.dtype, self.m)
            self.memo[key] = dense
        left = self.pending.get(key, 0) - 1
        if left > 0:
            self.pending[key] = left
            self.kept[key] = dense
        else:
            self.pending.pop(key, None)
            self.kept.pop(key, None)
        return dense


class _CachedRef:
    """A saved view of the expert-input buffer, held as packed rows ``[r0, r1)``."""

    __slots__ = ("restore", "payload", "outer", "size", "stride", "offset", "rows")

    def __init__(self, restore, payload, outer, size, stride, offset, rows):
        self.restore, self.payload, self.outer = restore, payload, outer
        self.size, self.stride, self.offset, self.rows = size, stride, offset, rows

    def unpack(self):
        payload = self.restore.unpack_outer(self.payload) if self.outer else self.payload
        dense = self.restore.rows_to_dense(self.rows, payload)
        return dense.as_strided(self.size, self.stride, self.offset)


class ExpertInputCache:
    """Packed copy of one forward's expert-input buffer, for the saved-tensor hooks.

    Arguments:
        base: the buffer the experts read, contiguous ``[..., M]`` (expert-major layout).
        fmt: ``Format`` in which saved views are kept.
        rounding: MXFP4 block-scale rule.
        rows: optional uint8 ``[base.numel() / M, R]`` already holding ``base`` packed in
            ``fmt`` in the same row order (the received dispatch payload); else ``base`` is
            packed on the first saved view (never, when nothing is saved).
        kernels: ``ops.kernels`` mode of the packing and of the backward's unpacking, or
            None (the process setting).
    """

    def __init__(self, base: torch.Tensor, fmt: Format,
                 rounding: ScaleRounding = ScaleRounding.RCEIL,
                 rows: Optional[torch.Tensor] = None, kernels: Optional[Kernels] = None):
        if not base.is_contiguous():
            raise ValueError("ExpertInputCache: base must be contiguous (expert-major layout)")
        self.m = base.shape[-1]
        self.fmt, self.rounding, self.kernels = fmt, rounding, kernels
        self._base = base
        self._ptr = base.untyped_storage().data_ptr()
        self._first = base.storage_offset()
        self._numel = base.numel()
        self._rows = rows
        self._outer = None
        self._restore = None
        self.packed_views = 0  # saved views taken over (diagnostics and tests)

    @contextlib.contextmanager
    def hooks(self):
        """Install the saved-tensor hooks; on exit forget the dense buffer."""
        self._outer = _outer_hooks()
        unpack_outer = self._outer[1] if self._outer is not None else None
        self._restore = _Restore(self.fmt, self._base.dtype, self.m, self.kernels, unpack_outer)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield self
        finally:
            self._base = None  # the packed rows (or nothing) outlive the forward, not base

    # -- hooks --------------------------------------------------------------------------

    def _covers(self, t: torch.Tensor) -> bool:
        base = self._base
        if base is None or t.dtype != base.dtype or t.device != base.device or t.numel() == 0:
            return False
        if t.untyped_storage().data_ptr() != self._ptr:
            return False
        lo, hi = storage_extent(t)
        return self._first <= lo and hi <= self._first + self._numel

    def _pack(self, t: torch.Tensor):
        if not self._covers(t):
            return _pass_on(t, self._outer)
        if self._rows is None:
            with kernel_scope(self.kernels):
                self._rows = pack_rows(self._base.reshape(-1, self.m), self.fmt, self.rounding)
        lo, hi = storage_extent(t)
        lo, hi = lo - self._first, hi - self._first
        r0, r1 = lo // self.m, -(-hi // self.m)
        payload = self._rows[r0:r1]
        outer = self._outer is not None
        if outer:
            payload = self._outer[0](payload)
        self.packed_views += 1
        self._restore.pending[(r0, r1)] = self._restore.pending.get((r0, r1), 0) + 1
        return _CachedRef(self._restore, payload, outer, tuple(t.shape), tuple(t.stride()),
                          lo - r0 * self.m, (r0, r1))


def _unpack(obj):
    return obj.unpack()


def route_output_format(z_format: Format, hidden: int) -> Optional[Format]:
    """How a combine keeps the routes' outputs for the router's gradient
    (``RowsCache``): as FP8 1x128 rows where the layer keeps its activations below
    bf16 (``activation_cache``, else ``cache``: mxfp4 or fp8) and ``hidden`` is a multiple
    of 128; else None, as autograd keeps them.

    Never MXFP4: on one layer against float32 (``tools/grad_numerics.py``, 5 seeds) an MXFP4
    copy doubled the router weight gradient's error, 0.059 -> 0.114, where FP8 leaves it at
    the FP8 GEMMs' own level. DeepSeek-V3 keeps its MoE gating in bf16/fp32 as sensitive to
    low precision (arXiv 2412.19437, section 3.3.1).
    """
    if z_format in (Format.MXFP4, Format.FP8) and hidden % FP8_GROUP == 0:
        return Format.FP8
    return None


class _PackedRows:
    """A saved tensor held as packed rows (``RowsCache``); ``rows``: an ``_Outer``."""

    __slots__ = ("rows", "fmt", "dtype", "shape", "kernels")

    def __init__(self, rows, fmt, dtype, shape, kernels):
        self.rows, self.fmt, self.dtype, self.shape, self.kernels = rows, fmt, dtype, shape, kernels

    def unpack(self):
        with kernel_scope(self.kernels):
            return unpack_rows(self.rows.unpack(), self.fmt, self.dtype,
                               self.shape[-1]).view(self.shape)


class RowsCache:
    """Keep every saved tensor of one ``[rows, m]`` size as packed rows.

    Under ``hooks()`` every saved tensor of ``dtype`` with last dimension ``m`` and
    ``rows * m`` elements is kept in ``fmt`` and rebuilt in the backward. Anything else
    passes on to the outer hooks untouched, as in ``ExpertInputCache``. Two uses:

    - **the routes' outputs** (``route_output_hooks``). A combine (AutoEP's restore; the
      legacy layer's decode keeps its own, ``routing.decode(fp8_routes=True)``, straight from
      the slots) weights each route's output by its gate and sums over a token's routes.
      Autograd keeps the outputs, ``routes x M``, only for the gates' gradient
      (``d gate = <dy, route output>``): at hidden 7168, 32 experts top-2, half of what
      AutoEP's layer keeps for backward. The data gradient never reads them.
    - **AutoEP's bf16 experts' activations** (``activation_hooks``): the ``[N, F]`` tensors
      its SwiGLU saves (gate, up, silu(gate), h).

    Arguments:
        rows: rows of the tensors to take (routes; the experts' rows).
        m: their last dimension.
        dtype: the activations' dtype.
        fmt: ``Format`` to keep them in.
        rounding: MXFP4 block-scale rule.
        kernels: ``ops.kernels`` mode, or None (the process setting).
    """

    def __init__(self, rows: int, m: int, dtype: torch.dtype, fmt: Format,
                 rounding: ScaleRounding = ScaleRounding.RCEIL,
                 kernels: Optional[Kernels] = None):
        self.numel, self.m, self.dtype = rows * m, m, dtype
        self.fmt, self.rounding, self.kernels = fmt, rounding, kernels
        self.packed = 0   # saved tensors taken over (tests)

    @contextlib.contextmanager
    def hooks(self):
        """Install the saved-tensor hooks."""
        outer = _outer_hooks()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, outer), _unpack):
            yield self

    def _takes(self, t: torch.Tensor) -> bool:
        return (t.dtype == self.dtype and t.dim() >= 2 and t.shape[-1] == self.m
                and t.numel() == self.numel and self.numel > 0)

    def _pack(self, t: torch.Tensor, outer):
        if not self._takes(t):
            return _pass_on(t, outer)
        with kernel_scope(self.kernels):
            rows = pack_rows(t.detach().contiguous(), self.fmt, self.rounding)
        self.packed += 1
        return _PackedRows(_pass_on(rows, outer), self.fmt, t.dtype, tuple(t.shape),
                           self.kernels)


def route_output_hooks(z_format: Format, routes: int, m: int, dtype: torch.dtype, plan):
    """The saved-tensor hooks to run a combine under: a ``RowsCache`` of the routes' outputs
    in ``route_output_format(z_format, m)``, or nothing (None there, or no grad). ``plan``:
    the layer's ``WirePlan`` (its rounding and kernels)."""
    return _rows_hooks(route_output_format(z_format, m), routes, m, dtype, plan.rounding,
                       plan.kernels)


def activation_hooks(fmt: Optional[Format], rows: int, ffn: int, dtype: torch.dtype,
                     rounding: ScaleRounding, kernels: Optional[Kernels]):
    """The saved-tensor hooks to run AutoEP's bf16 experts under: their ``[rows, ffn]``
    activations kept in ``fmt`` (``fp4_moe.activation_cache`` as set; None, or bf16 in a
    bf16 model: as autograd keeps them)."""
    return _rows_hooks(kept_format(fmt, dtype), rows, ffn, dtype, rounding, kernels)


def _rows_hooks(fmt, rows, m, dtype, rounding, kernels):
    if fmt is None or not torch.is_grad_enabled():
        return contextlib.nullcontext()
    return RowsCache(rows, m, dtype, fmt, rounding, kernels).hooks()


class _Uncast:
    """A saved float32 upcast held as a copy in the dtype it was cast from
    (``GateInputCopy``); ``source``: an ``_Outer``."""

    __slots__ = ("source",)

    def __init__(self, source):
        self.source = source

    def unpack(self):
        return self.source.unpack().float()


class GateInputCopy:
    """Keep the float32 copy of the layer's input that DeepSpeed's gate saves as the input.

    ``TopKGate`` casts its (bf16/fp16) input to float32 and its Linear keeps that copy for
    the weight gradient: 4 bytes per element, 64 MB a layer at 8192 tokens x hidden 2048.
    The cast is exact. So the layer casts first (``upcast``) and calls the gate on the
    result, whose own ``float()`` then returns it as is. Under ``hooks()`` the saved tensor
    that is this upcast is held as a copy in the input's dtype (a copy: the caller may
    change its input in place after the forward, as DeepSpeed's layer allows) and cast
    again in the backward: the same values, bit for bit, at half the bytes. The gate's
    jitter (``noisy_gate_policy: Jitter``) makes a new tensor, which passes on.
    """

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens
        self.upcast = tokens.float()

    @contextlib.contextmanager
    def hooks(self):
        """Install the hooks; on exit forget both tensors. Autograd keeps the pack hook, and
        so this object, with every tensor saved under it until the backward: held here,
        the float32 upcast would outlive the forward."""
        outer = _outer_hooks()
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, outer),
                                                          _unpack):
                yield self
        finally:
            self.tokens = self.upcast = None

    def _pack(self, t: torch.Tensor, outer):
        if self.upcast is not None and _same_view(t, self.upcast):
            return _Uncast(_pass_on(self.tokens.detach().clone(), outer))
        return _pass_on(t, outer)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def storage_extent(t: torch.Tensor):
    """Storage element range ``[lo, hi)`` that a strided tensor touches (empty: ``lo == hi``)."""
    lo = t.storage_offset()
    if t.numel() == 0:
        return lo, lo
    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return lo, lo + span + 1
