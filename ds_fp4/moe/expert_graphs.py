"""CUDA graphs of the FP8 experts' forward and backward passes (``fp4_moe.expert_graphs``).

A small MoE layer is host-bound: its FP8 experts issue ~20 launches per pass (the grouped
GEMMs, the fused quantizers, the conversions), and on an H200 host issuing them takes longer
than the GPU takes to run them (bench/results/host_*). A captured pass replays all of them
in one launch.

How a pass is replayed, per distinct call (shapes, dtypes, formats, the plan): the first call
runs eagerly (it compiles, tunes and checks everything once); the second captures the pass
with ``torch.cuda.graph`` from copies of its tensor inputs, the parameters included, and
replays it; later calls copy their inputs in (one ``_foreach_copy_`` per dtype) and replay. Every
output is cloned out of the graph's memory (a later replay overwrites it), except an output
that *is* an input (the forward keeps the received MXFP4 rows themselves), which maps back
to the caller's tensor. Results are bit-identical to the eager pass: the same kernels run on
the same bytes.

One captured pass serves every module of the process with the same call: the layers of a
model share their experts' shapes, so 8 layers replay one forward and one backward graph,
each with that layer's weights copied in (at hidden 512, 8 experts, ffn 512: 12.6 MB, a few
microseconds of copy). All captures on a device allocate from one memory pool: nothing a
graph leaves in it is needed between two replays (inputs are copied in just before, outputs
cloned out just after), so their scratch can overlap, as long as replays run one at a time
(one stream, as the layers do). The modules that use a capture own it (a weak registry finds
it for the next one): it and its memory go with the last of them. Layers whose passes add
to exactness counters (``monitor_exactness``) capture apart: the counters' address is baked
in.

What it costs: the inputs and outputs of each distinct capture, the parameters' copies and
one pass's scratch (measured on an H200 before the sharing: 516 MB for the main job's default
GPU model with 8 layers, 2.4 GB for issue 14's model). ``expert_graphs: "auto"`` captures a
pass only when its GEMMs are small, ``2 * tokens * hidden * ffn <= AUTO_MAX_GEMM_FLOP`` per
expert GEMM, and only while the memory the captures reserved (as reserved memory grew; a
capture's bytes leave the count when it is freed) stays under ``AUTO_MAX_POOL_BYTES``, and
only when what a replay copies in stays under ``AUTO_MAX_STAGED_BYTES``; ``true`` captures
every pass.
"""

import dataclasses
import warnings
import weakref
from collections import OrderedDict

import torch

from ds_fp4.moe.cache import storage_extent
from ds_fp4.moe.recent_keys import RecentKeys
from ds_fp4.ops import _cuda_loader as L

MAX_GRAPHS = 4   # captured passes kept per direction and module (least recently used go)
MAX_CAPTURES = 16  # more than this in one module: the keys keep changing, so stop capturing
MAX_UNCAPTURED = 64  # keys remembered as run once / left eager (keys that never repeat,
                     # e.g. ever new shapes, must not grow this without bound)
# "auto": the largest expert GEMM worth capturing. Measured on 2 H200s (bench_moe_layer):
# 5.4 GFLOP GEMMs (hidden 1024, ffn 1024, 2560 tokens) ran the layer 1.27x -> 0.84x of
# DeepSpeed's time with graphs; 43 GFLOP ones (hidden 4096, ffn 2048) 0.95x -> 1.01x. The
# limit sits between the two: a GEMM under it runs on the GPU for less time (~20 us) than
# the host takes to issue it (~40 us).
AUTO_MAX_GEMM_FLOP = 2 ** 34
AUTO_MAX_POOL_BYTES = 2 * 2 ** 30   # "auto": stop capturing once the captures reach this
# "auto": the most bytes a capture may copy in per replay (its weights and activations). A
# capture holds about three times that (static inputs, outputs, scratch): measured on an
# H200, 23-32 MB copied in per pass at the main job's default GPU model (8 experts, hidden
# and ffn 512, 1280 slots) cost 67 MB of peak for all 8 layers (bench/results/
# shared_graphs_h200), where issue 14's model (16 experts, hidden 2048, ffn 1024) would copy
# 270-390 MB: at that size the graphs' bytes outweigh what the recipe saves in the peak.
AUTO_MAX_STAGED_BYTES = 64 * 2 ** 20
_pool_bytes = {}                     # device index -> bytes the live captures reserved
_pools = weakref.WeakValueDictionary()   # device index -> the _Pool its live captures use
_shared = weakref.WeakValueDictionary()  # call key -> its capture, while a module holds it


class _Captured:
    """One captured pass: its graph, the static copies of its staged inputs, its outputs."""

    def __init__(self, fn, args, staged, pool=None):
        self.pool = pool          # held: the pool lives as long as a capture allocates from it
        self.args = list(args)
        for i in staged:
            self.args[i] = args[i].detach().clone(memory_format=torch.contiguous_format)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's capture-unsafe calls fail it, not those of
        # other threads (data loader pinning, logging) that happen to run meanwhile
        mark = len(L._graph_held)
        try:
            with torch.cuda.graph(self.graph, pool=None if pool is None else pool.handle,
                                  capture_error_mode="thread_local"):
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
        # One _foreach_copy_ per dtype: torch's one-kernel path wants a single dtype (mixed,
        # it copies tensor by tensor: 27 memcpy calls a backward, measured on the H200).
        by_dtype = {}
        for i in staged:
            by_dtype.setdefault(self.args[i].dtype, []).append(i)
        self.copy_in = [([self.args[i] for i in idx], idx) for idx in by_dtype.values()]
        self.spans, self.single = _copy_out_plan(
            [None if j in self.aliases else o for j, o in enumerate(self.outs)])

    def run(self, args):
        """Copy ``args``' staged tensors in, replay, return the outputs (fresh tensors)."""
        for static, idx in self.copy_in:
            torch._foreach_copy_(static, [args[i] for i in idx])
        self.graph.replay()
        outs = [args[self.aliases[j]] if j in self.aliases else None for j in range(len(self.outs))]
        for flat, views in self.spans:
            fresh = flat.clone()
            for j, shape, stride, offset in views:
                outs[j] = fresh.as_strided(shape, stride, offset)
        for j in self.single:
            outs[j] = self.outs[j].clone()
        return outs


def _copy_out_plan(outs):
    """How ``run`` copies the outputs out: ``(spans, single)``. Outputs that share one
    storage and tile a span of it without gaps (the weight gradients: views of the stacked
    ones, as the eager pass returns them) are copied with one clone of the span and viewed
    as they were; any other is cloned alone (indices in ``single``)."""
    groups = {}
    for j, o in enumerate(outs):
        if o is not None:
            groups.setdefault((o.untyped_storage().data_ptr(), o.dtype), []).append(j)
    spans, single = [], []
    for js in groups.values():
        lo = min(storage_extent(outs[j])[0] for j in js)
        hi = max(storage_extent(outs[j])[1] for j in js)
        if hi - lo != sum(outs[j].numel() for j in js) or hi == lo:
            single += js   # gaps or overlaps (or nothing): each on its own
            continue
        flat = outs[js[0]].as_strided((hi - lo,), (1,), lo)
        spans.append((flat, [(j, tuple(outs[j].shape), outs[j].stride(),
                              outs[j].storage_offset() - lo) for j in js]))
    return spans, sorted(single)


def _layout(tensors):
    return tuple(None if t is None else (tuple(t.shape), t.dtype, t.device) for t in tensors)


def _counts_address(plan):
    """Where the plan's passes add exactness counts (baked into a capture), or None."""
    counts = getattr(plan, "counts", None)
    return None if counts is None else counts.data_ptr()


class ExpertGraphs:
    """Captured forward and backward passes of one ``FP8Experts`` module (captures of the
    same call are shared with the process's other modules: see above).

    Arguments:
        auto: capture only small passes, within the process's pool budget (see above).
        hidden, ffn: the experts' sizes (for the ``auto`` rule).
    """

    def __init__(self, auto=False, hidden=0, ffn=0):
        self.auto, self.hidden, self.ffn = auto, hidden, ffn
        self._graphs = OrderedDict()   # key -> _Captured
        # key -> True: "auto" leaves it eager; False: ran once
        self._uncaptured = RecentKeys(MAX_UNCAPTURED)
        self.captures = 0              # how many passes were captured (diagnostics, tests)
        self.disabled = None           # the error that turned graphs off, if one did

    def forward(self, fn, args, rows):
        """``fn(*args)`` for ``args = (inputs, rows, plan, *params)``; stages ``rows`` when
        given (``inputs`` is then only a shape), else ``inputs``, and the parameters."""
        inputs, _, plan, *params = args
        staged = ((1,) if rows is not None else (0,)) + tuple(range(3, len(args)))
        key = ("forward", plan, _counts_address(plan), _layout([inputs, rows, *params]))
        return self._call(key, fn, args, staged, inputs.shape)

    def backward(self, fn, args):
        """``fn(*args)`` for ``args = (how, grad_out, kept_z, *kept_x, *params)``; stages
        every tensor. A captured pass never writes the input's gradient into ``grad_out``
        (its staged copy is not the caller's buffer): ``how.donate`` holds only where the
        pass runs eagerly."""
        how = args[0]
        graphed = (dataclasses.replace(how, donate=False), *args[1:]) if how.donate else args
        staged = tuple(i for i in range(1, len(args)) if args[i] is not None)
        key = ("backward", graphed[0], _counts_address(how.plan), _layout(args[1:]))
        return self._call(key, fn, graphed, staged, how.shape, eager_args=args)

    def worth_capturing(self, shape):
        """The ``auto`` rule for inputs ``[ep, n_local, C, hidden]``: small GEMMs only."""
        tokens = shape[0] * shape[2]
        return 2 * tokens * self.hidden * self.ffn <= AUTO_MAX_GEMM_FLOP

    def may_capture(self, shape):
        """Whether a pass on inputs of ``shape`` may ever be captured: False only where
        ``auto`` leaves it eager for its size alone. The caller then runs it without this
        object: its key (every tensor's layout, the plan) costs ~0.1 ms of host time a
        pass to build and hash at 16 experts (48 parameters)."""
        return not self.auto or self.worth_capturing(shape)

    def _call(self, key, fn, args, staged, shape, eager_args=None):
        """Replay (capturing first where due) or run ``fn`` eagerly: on ``eager_args`` when
        given (the backward's, which may donate), else on ``args``."""
        if torch.cuda.is_current_stream_capturing():   # inside someone else's capture
            return fn(*args)
        eager_args = args if eager_args is None else eager_args
        if self.disabled is not None or self._uncaptured.get(key):
            return fn(*eager_args)
        entry = self._graphs.get(key)
        if entry is None:
            entry = _shared.get(key)           # another module's capture of the same call
            if entry is not None:
                self._keep(key, entry)
                self._uncaptured.forget(key)
        if entry is None:
            if key not in self._uncaptured:    # first time: eager, which warms everything
                self._uncaptured.remember(key, False)
                return fn(*eager_args)
            if self.auto and not self._auto_allows(shape, [args[i] for i in staged]):
                self._uncaptured.remember(key, True)
                return fn(*eager_args)
            self._uncaptured.forget(key)
            entry = self._capture(key, fn, args, staged)
            if entry is None:
                return fn(*eager_args)
        self._graphs.move_to_end(key)
        return entry.run(args)

    def _auto_allows(self, shape, staged):
        device = torch.cuda.current_device()
        copied = sum(t.numel() * t.element_size() for t in staged)
        return (self.worth_capturing(shape) and copied <= AUTO_MAX_STAGED_BYTES
                and _pool_bytes.get(device, 0) < AUTO_MAX_POOL_BYTES)

    def _capture(self, key, fn, args, staged):
        device = torch.cuda.current_device()
        before = torch.cuda.memory_reserved(device)
        try:
            entry = _Captured(fn, args, staged, _pool(device))
        except Exception as err:  # a pass that cannot be captured runs eagerly from now on
            warnings.warn(f"ds_fp4 FP8 experts: CUDA graph capture failed ({type(err).__name__}: "
                          f"{err}); running the experts eagerly", RuntimeWarning)
            self.disabled = err
            return None
        grew = max(torch.cuda.memory_reserved(device) - before, 0)
        _pool_bytes[device] = _pool_bytes.get(device, 0) + grew
        # The capture goes with the last module that holds it (evicted below, or with the
        # modules): its bytes go back to the budget then, so that a later engine's "auto"
        # sees only live captures.
        weakref.finalize(entry, _give_back, _pool_bytes, device, grew)
        _shared[key] = entry
        self._keep(key, entry)
        self.captures += 1
        if self.captures > MAX_CAPTURES:
            self.disabled = RuntimeError(f"{self.captures} captures: the experts' shapes "
                                         "keep changing")
            warnings.warn(f"ds_fp4 FP8 experts: {self.disabled}; CUDA graphs off for this "
                          "module", RuntimeWarning)
        return entry

    def _keep(self, key, entry):
        self._graphs[key] = entry
        while len(self._graphs) > 2 * MAX_GRAPHS:
            self._graphs.popitem(last=False)


class _Pool:
    """A graph memory pool's handle, held by every capture made in it. Torch releases a pool
    with its last graph, and a capture into a released pool fails: once the last capture is
    gone, this goes too and the next capture starts a new pool."""

    def __init__(self):
        self.handle = torch.cuda.graph_pool_handle()


def _pool(device):
    """The memory pool of every live capture on ``device`` (their scratch overlaps: see
    above)."""
    pool = _pools.get(device)
    if pool is None:
        pool = _pools[device] = _Pool()
    return pool


def _give_back(pools, device, nbytes):
    """A captured pass was freed: its pool's bytes leave the ``pools`` budget."""
    pools[device] = max(0, pools.get(device, 0) - nbytes)


def live_pool_bytes(device=None):
    """Bytes reserved by the captured pools still alive (on ``device``, else all devices)."""
    return _pool_bytes.get(device, 0) if device is not None else sum(_pool_bytes.values())
