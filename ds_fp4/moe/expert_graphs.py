"""CUDA graphs of the FP8 experts' forward and backward passes (``fp4_moe.expert_graphs``).

A small MoE layer is host-bound: its FP8 experts issue ~40 launches per step (one blockwise
``scaled_mm`` per expert and GEMM, the fused quantizers, the conversions), and on an H200
host issuing them takes longer than the GPU takes to run them (bench/results/host_*). A
captured pass replays all of them in one launch.

How a pass is replayed, per distinct call (shapes, dtypes, formats, the parameters'
addresses): the first call runs eagerly (it compiles, tunes and checks everything once);
the second captures the pass with ``torch.cuda.graph`` from copies of its tensor inputs
and replays it; later calls copy their inputs in and replay. Every output is cloned out
of the graph's memory (a later replay overwrites it), except an output that *is* an input
(the forward keeps the received MXFP4 rows themselves), which maps back to the caller's
tensor. Results are bit-identical to the eager pass: the same kernels run on the same
bytes.

What it costs: each captured pass keeps its intermediates in a private memory pool for
as long as the module lives (measured on H200s: 204-310 MB for the benchmark's small layer,
1.9 GB for hidden 4096 with 8 local experts), so it pays only where the host, not memory,
is the limit. ``expert_graphs: "auto"`` (the default) therefore captures a pass only when
its GEMMs are small, ``2 * tokens * hidden * ffn <= AUTO_MAX_GEMM_FLOP`` per expert GEMM,
and only while all the live pools captured in the process (as reserved memory grew; a
pool's bytes leave the count when its graph is freed) stay under ``AUTO_MAX_POOL_BYTES``; ``true`` captures every pass. A parameter that moves (ZeRO-3
gathers, ``.to()``) gives a new key and a new capture.
"""

import warnings
import weakref
from collections import OrderedDict

import torch

from ds_fp4.ops import _cuda_loader as L

MAX_GRAPHS = 4   # captured passes kept per direction and module (least recently used go)
MAX_CAPTURES = 16  # more than this in one module: the keys keep changing, so stop capturing
MAX_UNCAPTURED = 64  # keys remembered as run once / left eager (a key that never repeats,
                     # e.g. ZeRO-3 addresses, must not grow this without bound)
# "auto": the largest expert GEMM worth capturing. Measured on 2 H200s (bench_moe_layer):
# 5.4 GFLOP GEMMs (hidden 1024, ffn 1024, 2560 tokens) ran the layer 1.27x -> 0.84x of
# DeepSpeed's time with graphs; 43 GFLOP ones (hidden 4096, ffn 2048) 0.95x -> 1.01x. The
# limit sits between the two: a GEMM under it runs on the GPU for less time (~20 us) than
# the host takes to issue it (~40 us).
AUTO_MAX_GEMM_FLOP = 2 ** 34
AUTO_MAX_POOL_BYTES = 2 * 2 ** 30   # "auto": stop capturing once the pools reach this
_pool_bytes = {}                     # device index -> bytes the live captured pools reserved


class _Captured:
    """One captured pass: its graph, the static copies of its staged inputs, its outputs."""

    def __init__(self, fn, args, staged):
        self.staged = staged
        self.args = list(args)
        for i in staged:
            self.args[i] = args[i].detach().clone(memory_format=torch.contiguous_format)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's capture-unsafe calls fail it, not those of
        # other threads (data loader pinning, logging) that happen to run meanwhile
        mark = len(L._graph_held)
        try:
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.outs = fn(*self.args)
        finally:
            # The device tables this pass read by address, which the loader's
            # hold_while_captured kept process-wide: this graph owns them from now on and
            # frees them with itself (a failed capture needs none of them).
            self.held = L._graph_held[mark:]
            del L._graph_held[mark:]
        # outputs that are staged inputs themselves: {output index: argument index}
        self.aliases = {j: i for j, o in enumerate(self.outs) for i in staged
                        if o is self.args[i]}

    def run(self, args):
        """Copy ``args``' staged tensors in, replay, return the outputs (fresh tensors)."""
        for i in self.staged:
            self.args[i].copy_(args[i])
        self.graph.replay()
        return [args[self.aliases[j]] if j in self.aliases else None if o is None else o.clone()
                for j, o in enumerate(self.outs)]


def _addresses(tensors):
    return tuple(t.data_ptr() for t in tensors)


def _layout(tensors):
    return tuple(None if t is None else (tuple(t.shape), t.dtype, t.device) for t in tensors)


class ExpertGraphs:
    """Captured forward and backward passes of one ``FP8Experts`` module.

    Arguments:
        auto: capture only small passes, within the process's pool budget (see above).
        hidden, ffn: the experts' sizes (for the ``auto`` rule).
    """

    def __init__(self, auto=False, hidden=0, ffn=0):
        self.auto, self.hidden, self.ffn = auto, hidden, ffn
        self._graphs = OrderedDict()   # key -> _Captured
        self._uncaptured = OrderedDict()  # key -> True: "auto" leaves it eager; False: ran once
        self.captures = 0              # how many passes were captured (diagnostics, tests)
        self.disabled = None           # the error that turned graphs off, if one did

    def forward(self, fn, args, rows):
        """``fn(*args)`` for ``args = (inputs, rows, plan, *params)``; stages ``rows`` when
        given (``inputs`` is then only a shape), else ``inputs``."""
        inputs, _, plan, *params = args
        staged = (1,) if rows is not None else (0,)
        key = ("forward", plan, _layout([inputs, rows]), _addresses(params))
        return self._call(key, fn, args, staged, inputs.shape)

    def backward(self, fn, args):
        """``fn(*args)`` for ``args = (how, grad_out, kept_z, *kept_x, *params)``; stages
        every tensor but the parameters."""
        how = args[0]
        n_params = len(how.param_meta)
        staged = tuple(range(1, len(args) - n_params))
        key = ("backward", how, _layout([args[i] for i in staged]),
               _addresses(args[len(args) - n_params:]))
        return self._call(key, fn, args, staged, how.shape)

    def worth_capturing(self, shape):
        """The ``auto`` rule for inputs ``[ep, n_local, C, hidden]``: small GEMMs only."""
        tokens = shape[0] * shape[2]
        return 2 * tokens * self.hidden * self.ffn <= AUTO_MAX_GEMM_FLOP

    def _call(self, key, fn, args, staged, shape):
        if self.disabled is not None or self._uncaptured.get(key) \
                or torch.cuda.is_current_stream_capturing():
            return fn(*args)
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._uncaptured:    # first time: eager, which warms everything
                self._remember(key, False)
                return fn(*args)
            if self.auto and not self._auto_allows(shape):
                self._remember(key, True)
                return fn(*args)
            del self._uncaptured[key]
            entry = self._capture(key, fn, args, staged)
            if entry is None:
                return fn(*args)
        self._graphs.move_to_end(key)
        return entry.run(args)

    def _remember(self, key, eager):
        self._uncaptured[key] = eager
        self._uncaptured.move_to_end(key)
        while len(self._uncaptured) > MAX_UNCAPTURED:
            self._uncaptured.popitem(last=False)

    def _auto_allows(self, shape):
        device = torch.cuda.current_device()
        return (self.worth_capturing(shape)
                and _pool_bytes.get(device, 0) < AUTO_MAX_POOL_BYTES)

    def _capture(self, key, fn, args, staged):
        device = torch.cuda.current_device()
        before = torch.cuda.memory_reserved(device)
        try:
            entry = _Captured(fn, args, staged)
        except Exception as err:  # a pass that cannot be captured runs eagerly from now on
            warnings.warn(f"ds_fp4 FP8 experts: CUDA graph capture failed ({type(err).__name__}: "
                          f"{err}); running the experts eagerly", RuntimeWarning)
            self.disabled = err
            return None
        grew = max(torch.cuda.memory_reserved(device) - before, 0)
        _pool_bytes[device] = _pool_bytes.get(device, 0) + grew
        # The pool goes with the graph (evicted below, or with this module): its bytes go
        # back to the budget then, so that a later engine's "auto" sees only live pools.
        weakref.finalize(entry, _give_back, _pool_bytes, device, grew)
        self._graphs[key] = entry
        self.captures += 1
        if self.captures > MAX_CAPTURES:
            self.disabled = RuntimeError(f"{self.captures} captures: the experts' shapes or "
                                         "parameter addresses keep changing")
            warnings.warn(f"ds_fp4 FP8 experts: {self.disabled}; CUDA graphs off for this "
                          "module", RuntimeWarning)
        while len(self._graphs) > 2 * MAX_GRAPHS:
            self._graphs.popitem(last=False)
        return entry


def _give_back(pools, device, nbytes):
    """A captured pass was freed: its pool's bytes leave the ``pools`` budget."""
    pools[device] = max(0, pools.get(device, 0) - nbytes)


def live_pool_bytes(device=None):
    """Bytes reserved by the captured pools still alive (on ``device``, else all devices)."""
    return _pool_bytes.get(device, 0) if device is not None else sum(_pool_bytes.values())
