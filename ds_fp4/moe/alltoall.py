"""The two all-to-alls of the FP4MoE layers, each with a wire format per direction.

A tensor ``[E, C, M]`` (E experts, C capacity slots, M hidden) is packed into one uint8
buffer of rows (FORMATS.md "Wire/cache packing"), moved by ONE ``all_to_all_single`` on the
layer's expert-parallel group and unpacked into the model's dtype:

==========  =========================  =====================
format      bytes per row of M         packing
==========  =========================  =====================
``mxfp4``   ``M/2 + M/32``             ``quantize_mxfp4_rows``
``fp8``     ``M + M/128``              ``quantize_fp8_rows`` (E4M3 travels as uint8)
``bf16``    ``2 M``                    bf16 values viewed as bytes
==========  =========================  =====================

AutoEP's dropless layer moves rows with variable splits instead (``wire_all_to_all_v``:
``[N, M]`` rows, host split sizes, optionally put into the experts' order on arrival); the
packing and the exchange are the same.

The backward pass moves the gradient the same way in the plan's backward format. The
quantizers are straight-through: the gradient of "quantize, send, dequantize" is "send the
gradient" (quantized on the wire in its own format).

Every call is named for DeepSpeed's comms logger (``fp4_dispatch_fwd``, ``fp4_dispatch_bwd``,
``fp4_combine_fwd``, ``fp4_combine_bwd``) and counted in ``comm_stats``.
"""

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol

import torch
from deepspeed import comm as dist

from ds_fp4 import formats as F
from ds_fp4 import ops
from ds_fp4.config import Format, Kernels, ScaleRounding


# ---- byte accounting ------------------------------------------------------------------

@dataclass
class CommStats:
    """Bytes each rank handed to ``all_to_all_single``, per log name, since ``reset()``.

    Attributes:
        calls: ``{log_name: number of calls}``.
        bytes: ``{log_name: bytes of the input buffers, summed}`` (a rank's whole send
            buffer, including the part it keeps for itself, as the comms logger counts it).
        last: ``{log_name: bytes of the latest call}``.
    """

    calls: Dict[str, int] = field(default_factory=dict)
    bytes: Dict[str, int] = field(default_factory=dict)
    last: Dict[str, int] = field(default_factory=dict)

    def record(self, log_name: str, nbytes: int) -> None:
        self.calls[log_name] = self.calls.get(log_name, 0) + 1
        self.bytes[log_name] = self.bytes.get(log_name, 0) + nbytes
        self.last[log_name] = nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.last.clear()

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        """A copy: ``{"calls": {...}, "bytes": {...}, "last": {...}}``."""
        return {"calls": dict(self.calls), "bytes": dict(self.bytes), "last": dict(self.last)}


comm_stats = CommStats()
"""Process-wide counters of every FP4MoE all-to-all (read by training and bench tools)."""


# ---- row packing (shared with the activation cache) -----------------------------------

def row_bytes(fmt: Format, m: int) -> int:
    """Bytes of one packed row of ``m`` elements in ``fmt``."""
    if fmt == Format.MXFP4:
        return F.mxfp4_row_bytes(m)
    if fmt == Format.FP8:
        return F.fp8_row_bytes(m)
    return 2 * m


def pack_rows(x: torch.Tensor, fmt: Format,
              rounding: ScaleRounding = ScaleRounding.RCEIL,
              index: Optional[torch.Tensor] = None,
              scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pack ``x`` row by row into uint8 (FORMATS.md wire layout).

    Arguments:
        x: ``[..., M]`` bf16/fp16/fp32; ``M % 32 == 0`` for mxfp4, ``M % 128 == 0`` for fp8.
        fmt: ``Format``.
        rounding: MXFP4 block-scale rule.
        index: None, or (mxfp4, fp8; x ``[S, M]``) int64 ``[R]``: the rows ``x[index]``, a
            zero row where an index is outside ``[0, S)``, read in place (no gathered copy).
        scale: None, or (fp8, with ``index``) float32 ``[R]``: those rows times it, rounded
            to x's dtype.
    Returns:
        uint8 ``[..., row_bytes(fmt, M)]`` (``[R, ...]`` with ``index``), contiguous.
        NaN/Inf stay NaN after unpacking.
    """
    if fmt == Format.FP8:
        m = x.shape[-1]  # sizes spelt out: a view with -1 is ambiguous for 0 rows
        lead = x.shape[:-1] if index is None else index.shape
        return ops.quantize_fp8_rows(x.reshape(-1, m), index=index, scale=scale).view(
            *lead, row_bytes(fmt, m))
    if scale is not None or (index is not None and fmt != Format.MXFP4):
        given = "index and scale" if scale is not None and index is not None else \
            "scale" if scale is not None else "index"
        raise ValueError(f"pack_rows: index is for the mxfp4 and fp8 wires, scale for fp8 "
                         f"only; got {given} for {fmt}")
    if fmt == Format.MXFP4:
        return ops.quantize_mxfp4_rows(x, rounding, index=index)
    return x.to(torch.bfloat16).contiguous().view(torch.uint8)


def unpack_rows(rows: torch.Tensor, fmt: Format, dtype: torch.dtype,
                m: Optional[int] = None) -> torch.Tensor:
    """Inverse of ``pack_rows``: uint8 ``[..., R]`` -> ``dtype`` ``[..., M]``.

    ``m``: M, which the row ops need where R also fits the other packed format (R a multiple
    of 2193 bytes, e.g. M = 2176 in FP8); pass it whenever it is known.
    """
    if fmt == Format.MXFP4:
        return ops.dequantize_mxfp4_rows(rows, dtype, m)
    if fmt == Format.FP8:
        r = rows.shape[-1]
        out = ops.dequantize_fp8_rows(rows.reshape(-1, r), dtype, m)
        return out.view(*rows.shape[:-1], out.shape[-1])
    return rows.view(torch.bfloat16).to(dtype)


def kernel_scope(mode: Optional[Kernels]):
    """``ops.kernels(mode)`` around a layer's ops (the config's ``kernels``), or nothing
    when mode is None (the process setting then applies)."""
    return contextlib.nullcontext() if mode is None else ops.kernels(str(mode))


# ---- plans and handles ----------------------------------------------------------------

@dataclass(frozen=True)
class WirePlan:
    """How one all-to-all of a layer moves its tensor.

    Attributes:
        name: ``"dispatch"`` or ``"combine"``; log names are ``fp4_{name}_fwd/_bwd``.
        forward: wire format of the forward pass.
        backward: wire format of the gradient.
        rounding: MXFP4 block-scale rule.
        kernels: ``ops.kernels`` mode for the packing ops, or None for the process setting.
    """

    name: str
    forward: Format
    backward: Format
    rounding: ScaleRounding = ScaleRounding.RCEIL
    kernels: Optional[Kernels] = None

    @property
    def log_name_fwd(self) -> str:
        return f"fp4_{self.name}_fwd"

    @property
    def log_name_bwd(self) -> str:
        return f"fp4_{self.name}_bwd"


class _ReceivedRows:
    """The received packed rows a handle holds from the forward all-to-all until their
    consumer (the activation cache, the FP8 experts) takes them: after that the handle,
    which the layer keeps for its byte counts (``last_handles``), no longer keeps them
    alive; whoever took them holds them for the backward pass."""

    rows: Optional[torch.Tensor]

    def take_rows(self) -> Optional[torch.Tensor]:
        """``rows``, handed over once (None if none were kept or they were taken)."""
        rows, self.rows = self.rows, None
        return rows


def wire_plans(cfg) -> tuple:
    """``(dispatch, combine)`` ``WirePlan`` of an ``FP4MoEConfig``, with its enums as they
    are: the wires' packing follows the config's ``scale_rounding`` and ``kernels``."""
    return tuple(WirePlan(name, fmt, cfg.grad, cfg.scale_rounding, cfg.kernels)
                 for name, fmt in (("dispatch", cfg.dispatch), ("combine", cfg.combine)))


@dataclass
class A2AHandle(_ReceivedRows):
    """State of one all-to-all call: made by the layer, filled by the forward and backward.

    Attributes:
        plan: the ``WirePlan``.
        group: the expert-parallel process group.
        ep_size: ranks in ``group``.
        num_local_experts: experts per rank (E = ep_size * num_local_experts).
        expert_major: dispatch only: lay the received tokens out expert by expert
            (``[n_local, ep, C, M]`` in memory, returned as its ``[ep, n_local, C, M]``
            transpose view) so that each local expert's input is one contiguous block
            (what the activation cache needs).
        hand_off: dispatch only: return a stride-0 placeholder and leave the received
            MXFP4 rows in ``rows`` for FP8 experts instead of dequantizing.
        keep_rows: keep the received packed rows in ``rows`` (for the cache).
        rows: uint8 received rows, ``[ep, n_local, C, R]`` (``hand_off``) or
            ``[n_local * ep * C, R]`` in expert-major order (``keep_rows``); else None.
            Held until ``take_rows()``.
        gather: dispatch only: None, or a ``routing.GatheredSlots`` (mxfp4 and fp8 wires):
            the forward packs slot j's row from ``tokens[source[j]]`` (zeros where -1), the
            input being ``routing.encode_gathered``'s placeholder. Dropped once packed.
        grad_gather: combine only: None, or the decode's ``routing.GatheredSlots`` (fp8
            gradient wire): where the decode left dy and the slots' gates there, the
            backward packs the slots' gradient from them (its input is then a placeholder).
        fwd_bytes / bwd_bytes: bytes this rank sent in the forward / backward call.
    """

    plan: WirePlan
    group: Any
    ep_size: int
    num_local_experts: int
    expert_major: bool = False
    hand_off: bool = False
    keep_rows: bool = False
    rows: Optional[torch.Tensor] = None
    gather: Any = None
    grad_gather: Any = None
    fwd_bytes: int = 0
    bwd_bytes: int = 0


def _exchange(buf: torch.Tensor, group, log_name: str, output_splits=None,
              input_splits=None) -> torch.Tensor:
    """One ``all_to_all_single`` of a contiguous uint8 buffer along dim 0: equal splits, or
    ``input_splits`` rows to each rank and ``output_splits`` rows from each (host ints)."""
    if output_splits is None:
        out = torch.empty_like(buf)
        dist.all_to_all_single(out, buf, group=group, log_name=log_name)
    else:
        out = buf.new_empty((sum(output_splits), *buf.shape[1:]))
        dist.all_to_all_single(out, buf, output_split_sizes=output_splits,
                               input_split_sizes=input_splits, group=group, log_name=log_name)
    comm_stats.record(log_name, buf.numel() * buf.element_size())
    return out


def _send(x: torch.Tensor, fmt: Format, handle: A2AHandle, log_name: str,
          rows_from: Optional[tuple] = None) -> torch.Tensor:
    """Pack ``x [E, C, M]`` (or, with ``rows_from = (src, index, scale or None)``, its rows
    ``src[index]`` times ``scale``: x is then only a shape), exchange, return the received
    uint8 rows ``[E, C, R]``."""
    if rows_from is None:
        rows = pack_rows(x, fmt, handle.plan.rounding)
    else:
        src, index, scale = rows_from
        rows = pack_rows(src, fmt, handle.plan.rounding, index=index, scale=scale).view(
            *x.shape[:-1], -1)
    return _exchange(rows, handle.group, log_name)


class _WireAllToAll(torch.autograd.Function):
    """All-to-all of ``[E, C, M]`` with the handle's wire formats (straight-through)."""

    @staticmethod
    def forward(ctx, x, handle: A2AHandle):
        plan = handle.plan
        ctx.handle = handle
        ctx.shape = x.shape
        e, c, m = x.shape
        ep, n_local = handle.ep_size, handle.num_local_experts
        with kernel_scope(plan.kernels):
            gather, handle.gather = handle.gather, None
            rows = _send(x, plan.forward, handle, plan.log_name_fwd,
                         None if gather is None else (gather.tokens, gather.source, None))
            handle.fwd_bytes = rows.numel()
            if handle.hand_off:
                handle.rows = rows.view(ep, n_local, c, -1)
                return x.new_zeros(()).expand(ep, n_local, c, m)
            if handle.expert_major:
                rows = rows.view(ep, n_local, c, -1).transpose(0, 1).contiguous()
            if handle.keep_rows:
                handle.rows = rows.view(-1, rows.shape[-1])
            y = unpack_rows(rows, plan.forward, x.dtype, m)
        if handle.expert_major:
            return y.view(n_local, ep, c, m).transpose(0, 1)
        return y.view(e, c, m)

    @staticmethod
    def backward(ctx, grad):
        handle = ctx.handle
        plan = handle.plan
        grad = grad.reshape(ctx.shape)
        gathered = None if handle.grad_gather is None else \
            handle.grad_gather.handed_grad(grad, "FP4MoE combine")
        with kernel_scope(plan.kernels):
            rows = _send(grad, plan.backward, handle, plan.log_name_bwd, gathered)
            handle.bwd_bytes = rows.numel()
            return unpack_rows(rows, plan.backward, grad.dtype, ctx.shape[-1]).view(ctx.shape), None


def wire_all_to_all(x: torch.Tensor, handle: A2AHandle) -> torch.Tensor:
    """Move ``x`` through the expert-parallel all-to-all in the handle's wire formats.

    Arguments:
        x: ``[E, C, M]`` bf16/fp16/fp32, E = ep_size * num_local_experts, rows ordered by
            destination rank (DeepSpeed's dispatch layout; for the combine, by source).
        handle: an ``A2AHandle``; its ``rows``/``fwd_bytes`` are filled here and
            ``bwd_bytes`` in the backward pass.
    Returns:
        dispatch with ``expert_major`` or ``hand_off``: ``[ep, n_local, C, M]`` (a
        transposed view, or a stride-0 placeholder whose values must not be read);
        otherwise ``[E, C, M]`` contiguous. Same dtype as ``x``.
    """
    return _WireAllToAll.apply(x, handle)


# ---- variable splits (AutoEP's dropless layer) ----------------------------------------

class RowOrder(Protocol):
    """How a dispatch puts the received rows into the experts' order, and back.

    ``permute(rows uint8 [N, R]) -> uint8 [N', R]``: reorder (and pad: an all-zero packed
    row is a zero row in every format) the received packed rows; ``restore(grad [N', M])
    -> [N, M]``: the gradient back in arrival order (padding rows dropped).
    """

    def permute(self, rows: torch.Tensor) -> torch.Tensor: ...

    def restore(self, grad: torch.Tensor) -> torch.Tensor: ...


@dataclass
class A2AVHandle(_ReceivedRows):
    """State of one all-to-all with variable splits: made by the layer, filled by the passes.

    Attributes:
        plan: the ``WirePlan``.
        group: the expert-parallel process group.
        input_splits: rows this rank sends to each rank of ``group`` (host ints).
        output_splits: rows this rank receives from each rank (host ints).
        source_rows: dispatch only: int64 ``[sum(input_splits)]``, the rows of ``x`` to send
            (``x[source_rows]``), or None (send ``x`` itself). Each row of ``x`` is then
            packed once however many routes send it (top-k: k times fewer rows to quantize,
            and the gather moves packed rows); its gradient sums those routes' gradients.
            Read by the forward only (the caller may drop it afterwards).
        order: dispatch only: a ``RowOrder`` applied to the received packed rows (AutoEP's
            permutation into expert-contiguous, aligned segments), or None.
        keep_rows: keep the received packed rows, after ``order``, in ``rows``.
        rows: uint8 ``[N', R]`` received rows in ``plan.forward`` (``keep_rows``), else None;
            held until ``take_rows()``.
        fwd_bytes / bwd_bytes: bytes this rank handed to the forward / backward call.
    """

    plan: WirePlan
    group: Any
    input_splits: List[int]
    output_splits: List[int]
    source_rows: Optional[torch.Tensor] = None
    order: Optional[RowOrder] = None
    keep_rows: bool = False
    rows: Optional[torch.Tensor] = None
    fwd_bytes: int = 0
    bwd_bytes: int = 0


class _WireAllToAllV(torch.autograd.Function):
    """All-to-all of rows ``[N, M]`` with variable splits and wire formats (straight-through)."""

    @staticmethod
    def forward(ctx, x, handle: A2AVHandle):
        plan = handle.plan
        ctx.handle = handle
        ctx.x_rows = x.shape[0]
        ctx.gathered = handle.source_rows is not None
        if ctx.gathered:  # kept by autograd (not the handle), so that saved-tensor hooks see it
            ctx.save_for_backward(handle.source_rows)
        with kernel_scope(plan.kernels):
            sent = pack_rows(x, plan.forward, plan.rounding)
            if handle.source_rows is not None:
                sent = sent.index_select(0, handle.source_rows)
            handle.fwd_bytes = sent.numel()
            rows = _exchange(sent, handle.group, plan.log_name_fwd,
                             handle.output_splits, handle.input_splits)
            del sent
            if handle.order is not None:
                rows = handle.order.permute(rows)
            if handle.keep_rows:
                handle.rows = rows
            return unpack_rows(rows, plan.forward, x.dtype, x.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        handle = ctx.handle
        plan = handle.plan
        if handle.order is not None:
            grad = handle.order.restore(grad)
        with kernel_scope(plan.kernels):
            sent = pack_rows(grad.contiguous(), plan.backward, plan.rounding)
            handle.bwd_bytes = sent.numel()
            rows = _exchange(sent, handle.group, plan.log_name_bwd,
                             handle.input_splits, handle.output_splits)
            grad = unpack_rows(rows, plan.backward, grad.dtype, grad.shape[-1])
        if ctx.gathered:  # what autograd does for x[source_rows]
            source_rows, = ctx.saved_tensors
            grad = grad.new_zeros((ctx.x_rows, grad.shape[1])).index_put_(
                (source_rows,), grad, accumulate=True)
        return grad, None


def wire_all_to_all_v(x: torch.Tensor, handle: A2AVHandle) -> torch.Tensor:
    """Move rows through an all-to-all with variable splits in the handle's wire formats.

    Arguments:
        x: ``[sum(handle.input_splits), M]`` bf16/fp16/fp32, rows grouped by destination
            rank (AutoEP's dispatch layout; for the combine, by source rank); with
            ``handle.source_rows``, ``[T, M]`` rows that it indexes.
        handle: an ``A2AVHandle``; ``rows``/``fwd_bytes`` are filled here, ``bwd_bytes``
            in the backward pass.
    Returns:
        ``[sum(handle.output_splits), M]`` (or ``handle.order``'s ``[N', M]``), contiguous,
        same dtype as ``x``. The gradient of ``x`` is the reverse all-to-all of the
        incoming gradient in ``plan.backward`` format.
    """
    return _WireAllToAllV.apply(x, handle)
