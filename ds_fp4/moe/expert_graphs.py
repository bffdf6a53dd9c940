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
as long as the module lives (for the benchmark's small layer, tens of MB per layer; for
DeepSeek-sized experts, GBs), so this is for layers whose host, not memory, is the limit.
A parameter that moves (ZeRO-3 gathers, ``.to()``) gives a new key and a new capture.
"""

import warnings
from collections import OrderedDict

import torch

MAX_GRAPHS = 4   # captured passes kept per direction and module (least recently used go)
MAX_CAPTURES = 16  # more than this in one module: the keys keep changing, so stop capturing


class _Captured:
    """One captured pass: its graph, the static copies of its staged inputs, its outputs."""

    def __init__(self, fn, args, staged):
        self.staged = staged
        self.args = list(args)
        for i in staged:
            self.args[i] = args[i].detach().clone(memory_format=torch.contiguous_format)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outs = fn(*self.args)

    def run(self, args):
        """Copy ``args``' staged tensors in, replay, return the outputs (fresh tensors)."""
        for i in self.staged:
            self.args[i].copy_(args[i])
        self.graph.replay()
        given = {id(self.args[i]): args[i] for i in self.staged}
        return [o if o is None else given[id(o)] if id(o) in given else o.clone()
                for o in self.outs]


def _addresses(tensors):
    return tuple(t.data_ptr() for t in tensors)


def _layout(tensors):
    return tuple(None if t is None else (tuple(t.shape), t.dtype, t.device) for t in tensors)


class ExpertGraphs:
    """Captured forward and backward passes of one ``FP8Experts`` module."""

    def __init__(self):
        self._graphs = OrderedDict()   # key -> _Captured
        self._seen = set()             # keys that ran eagerly once
        self.captures = 0              # how many passes were captured (diagnostics, tests)
        self.disabled = None           # the error that turned graphs off, if one did

    def forward(self, fn, args, rows):
        """``fn(*args)`` for ``args = (inputs, rows, plan, *params)``; stages ``rows`` when
        given (``inputs`` is then only a shape), else ``inputs``."""
        inputs, _, plan, *params = args
        staged = (1,) if rows is not None else (0,)
        key = ("forward", plan, _layout([inputs, rows]), _addresses(params))
        return self._call(key, fn, args, staged)

    def backward(self, fn, args):
        """``fn(*args)`` for ``args = (how, grad_out, kept_z, *kept_x, *params)``; stages
        every tensor but the parameters."""
        how = args[0]
        n_params = len(how.param_meta)
        staged = tuple(range(1, len(args) - n_params))
        key = ("backward", how, _layout([args[i] for i in staged]),
               _addresses(args[len(args) - n_params:]))
        return self._call(key, fn, args, staged)

    def _call(self, key, fn, args, staged):
        if self.disabled is not None or torch.cuda.is_current_stream_capturing():
            return fn(*args)
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:          # first time: eager, which warms everything
                self._seen.add(key)
                return fn(*args)
            entry = self._capture(key, fn, args, staged)
            if entry is None:
                return fn(*args)
        self._graphs.move_to_end(key)
        return entry.run(args)

    def _capture(self, key, fn, args, staged):
        try:
            entry = _Captured(fn, args, staged)
        except Exception as err:  # a pass that cannot be captured runs eagerly from now on
            warnings.warn(f"ds_fp4 FP8 experts: CUDA graph capture failed ({type(err).__name__}: "
                          f"{err}); running the experts eagerly", RuntimeWarning)
            self.disabled = err
            return None
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
