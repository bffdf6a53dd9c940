"""DeepSpeed's gate with its slot counting done as a row scan (same integers, faster).

DeepSpeed's ``top1gating``/``top2gating``/``topkgating`` (``deepspeed/moe/sharded_moe.py``)
number each expert's tokens with ``torch.cumsum(mask, dim=0)`` over an int64
``[tokens, experts]`` one-hot mask. Torch runs that as a scan over the outer dimension with
one column per expert, and on an H200 the two calls of one top-2 forward took 3.03 ms at
8192 tokens x 32 experts (17% of the GPU time of the whole FP4MoE layer's fwd+bwd,
``bench/results/profile_h200``) and 1.37 ms at 4096 x 8 (62% of DeepSpeed's bf16 layer at
hidden 512, ``bench/results/shared_graphs_h200/call5``). The same running sums along the
rows of the transposed, contiguous mask are the same integers (an integer sum does not
depend on its order): 0.014 ms there.

``RowScanCumsum`` is a context manager: inside it, the name ``torch`` in DeepSpeed's
``sharded_moe`` module is a stand-in whose ``cumsum`` of a 2-D integer or bool tensor along
dim 0 is computed that way, and whose ``einsum("se,se->s", gates, mask)`` is a product and
a row sum (the same bits for a one-hot mask, and no cuBLAS call for a CUDA graph to give a
workspace of its own: ``_TorchWithRowScan.einsum``); every other attribute is torch's own.
The layer enters it around DeepSpeed's gate only, so DeepSpeed's code runs as it is.

Why not a ``TorchFunctionMode`` (the first version): a mode routes every torch call made
inside it through Python, ~70 calls per gate: DeepSpeed's ``top2gating`` of 64 tokens x 8
experts took 760 us of host time on a CPU, 1,264-1,487 us inside the mode and 866-1,019 us
with the stand-in (session 13, ``bench/NOTES_experts.md``), which costs one attribute
lookup per call. Other threads that run DeepSpeed's gate while it is in place
get the same integers (only faster); the last one out puts torch back.

With ``graphs`` (a layer's ``gate_graphs.GateGraphs``), the same context also puts
dispatchers in place of DeepSpeed's gating functions (``top1gating``, ``top2gating``,
``topkgating``): in the thread that opened it they hand the call to ``graphs`` (replayed
from CUDA graphs where it can be); elsewhere they call DeepSpeed's function.
"""

import threading
import types

import torch
from deepspeed.moe import sharded_moe

__all__ = ["RowScanCumsum"]


def _counted_along_dim0(args, kwargs):
    """The mask when the call is ``cumsum(mask, dim=0)`` of a 2-D integer/bool tensor with
    no other arguments, else None."""
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if len(args) > 2 or set(kwargs) - {"dim"} or x.dim() != 2 or dim not in (0, -2):
        return None
    if x.dtype.is_floating_point or x.dtype.is_complex:
        return None   # float sums depend on their order: leave them to torch
    return x


class _TorchWithRowScan(types.ModuleType):
    """``torch`` for DeepSpeed's gating functions: its own attributes but ``cumsum``."""

    rewritten = 0   # calls computed as a row scan (tests)

    def __getattr__(self, name):
        return getattr(torch, name)

    def cumsum(self, *args, **kwargs):
        x = _counted_along_dim0(args, kwargs)
        if x is None:
            return torch.cumsum(*args, **kwargs)
        _TorchWithRowScan.rewritten += 1
        # torch's integer cumsum (bool included) returns int64
        return torch.cumsum(x.t().contiguous(), dim=1).t().contiguous()

    def einsum(self, rule, *operands):
        """``"se,se->s"`` as a product and a row sum, no cuBLAS: DeepSpeed's gating
        functions call it with a one-hot 0/1 mask as the second operand, so the one product
        that is not zero is the sum in any order (bit for bit; its gradient, the product
        with the mask, too). torch's einsum runs it as a batched GEMM, and each CUDA graph
        capture that calls cuBLAS allocates its own workspace in the graph's pool: 65 MB
        per captured gate on an H200 (``gate_graphs``)."""
        if rule == "se,se->s" and len(operands) == 2:
            a, b = operands
            return (a * b).sum(dim=1)
        return torch.einsum(rule, *operands)


_STAND_IN = _TorchWithRowScan("torch")
_GATINGS = {name: getattr(sharded_moe, name) for name in ("top1gating", "top2gating", "topkgating")}
_lock = threading.Lock()
_depth = 0   # RowScanCumsum contexts open, over all threads
_local = threading.local()   # .graphs: the GateGraphs of this thread's open context


def _dispatcher(gating):
    def dispatch(logits, *args, **kwargs):
        graphs = getattr(_local, "graphs", None)
        if graphs is None:
            return gating(logits, *args, **kwargs)
        return graphs.call(gating, logits, args, kwargs)
    dispatch.__wrapped__ = gating
    return dispatch


_DISPATCHERS = {name: _dispatcher(fn) for name, fn in _GATINGS.items()}


def _install(on: bool):
    sharded_moe.torch = _STAND_IN if on else torch
    for name, fn in (_DISPATCHERS if on else _GATINGS).items():
        setattr(sharded_moe, name, fn)


class RowScanCumsum:
    """``with RowScanCumsum(graphs=None): ...`` -- DeepSpeed's gating functions' 2-D integer
    ``cumsum`` along dim 0 as a row scan of the transpose (bit-identical; ``calls`` counts
    the rewritten calls made while it was open); with ``graphs``, their calls in this thread
    go through it."""

    def __init__(self, graphs=None):
        self._graphs = graphs

    def __enter__(self):
        global _depth
        with _lock:
            _depth += 1
            if _depth == 1:
                _install(True)
        self._outer = getattr(_local, "graphs", None)
        _local.graphs = self._graphs
        self._start = _TorchWithRowScan.rewritten
        self._end = None
        return self

    def __exit__(self, *exc):
        global _depth
        self._end = _TorchWithRowScan.rewritten
        _local.graphs = self._outer
        with _lock:
            _depth -= 1
            if _depth == 0:
                _install(False)
        return False

    @property
    def calls(self):
        end = _TorchWithRowScan.rewritten if self._end is None else self._end
        return end - self._start
