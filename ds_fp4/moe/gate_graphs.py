"""DeepSpeed's gating function as a pair of CUDA graphs (forward, backward), per layer.

On small layers the host is what paces FP4MoE, and DeepSpeed's gate is the largest host
cost left once the experts are captured (``expert_graphs``): ``top2gating`` is ~50 small
torch ops, and its backward ~35 autograd nodes, for a few microseconds of GPU work each
(``bench/NOTES_experts.md``, session 13). After the gate's Linear, DeepSpeed's gating
functions (``top1gating``, ``top2gating``, ``topkgating`` in ``deepspeed.moe.sharded_moe``)
are a fixed function of the logits' shape and of host values (capacity factor, minimum
capacity, k) when tokens are dropped at a fixed capacity: no host sync, no collective,
device RNG only (the second expert's Gumbel noise, random token selection), which CUDA
graphs capture. So each layer captures the call once per distinct (function, shape,
arguments), on its second call, and replays it: one copy in, one replay and a few clones
out; in the backward one copy in, one replay, one clone out. At most ``MAX_CAPTURES`` a
layer: shapes beyond that run eagerly. By design the integers and floats are DeepSpeed's
own kernels' (the same kernels run), and the RNG draws those eager calls would make: the
generator's state is put back after the warm-up and capture, and a replay advances it as
the eager call does (the GPU tests check both).

What stays eager (DeepSpeed's call as is): CPU tensors, grad mode off or logits that need
no gradient, ``drop_tokens=False`` (its capacity is the data's and may be all-reduced),
tensor arguments (``used_token``), a call while a stream is being captured, and a forward
while the layer's previous graphed forward still waits for its backward (pipeline
schedules, activation checkpointing's recompute): the graph's saved state is that
forward's until its backward replays. The layer also calls the gate eagerly while someone
else's saved-tensor hooks are active (``torch.utils.checkpoint``'s non-reentrant recompute
matches the tensors a forward saved; offloading hooks move them): a replayed gate keeps its
tensors inside its graph, out of their reach. A capture that fails warns and leaves the
layer's gate eager from then on.

The graphs live in the layer's ``GateGraphs`` (freed with the layer) and each capture has
its own memory pool (a capture's saved state must outlive other graphs' replays until its
backward, so it cannot share the experts' pool): a few MB, the gate's tensors being
``[tokens, experts]``, once no cuBLAS call is captured (``gate_scan``'s einsum; with one,
each pool held its own 65 MB workspace). The layer uses them unless ``expert_graphs`` is
false. Measured on an H200 (bench/results/shared_graphs_h200/session15): host time of
one fwd+bwd of the main job's GPU layer 9.2 -> 6.4 ms, the main job's peak +6 MB.
"""

import functools
import inspect
import warnings
import weakref

import torch

from ds_fp4.moe.recent_keys import RecentKeys

__all__ = ["GateGraphs"]

_WARMUP = 1   # eager runs on a side stream before capture (cuBLAS handles, lazy inits)
# Captures per layer: a model whose token counts keep changing (no padding to one length)
# stops capturing new shapes here and runs those eagerly.
MAX_CAPTURES = 8
MAX_SEEN = 64   # keys remembered as called once (keys that never repeat must not grow it)


class GateGraphs:
    """A layer's captured gating calls (``call``), keyed by function, shape and arguments.

    A key is captured on its second call: a shape seen once (a last partial batch) costs no
    capture, which synchronizes the device and empties torch's cache."""

    def __init__(self):
        self._captured = {}
        self._seen = RecentKeys(MAX_SEEN)   # keys called once, not captured
        self.replays = 0   # graphed calls so far (tests, benchmarks)
        self.disabled = None   # the error that turned the graphs off, if one did

    def call(self, fn, logits, args, kwargs):
        """``fn(logits, *args, **kwargs)``: replayed from a capture where it can be."""
        key = _key(fn, logits, args, kwargs)
        if key is None:
            return fn(logits, *args, **kwargs)
        capture = self._captured.get(key)
        if capture is None:
            if self.disabled is not None or not self._capture_due(key):
                return fn(logits, *args, **kwargs)
            try:
                capture = self._captured[key] = _Capture(fn, logits, args, kwargs)
            except Exception as err:  # a gate that cannot be captured runs eagerly from now on
                warnings.warn(f"ds_fp4: CUDA graph capture of DeepSpeed's gate failed "
                              f"({type(err).__name__}: {err}); running it eagerly",
                              RuntimeWarning)
                self.disabled = err
                return fn(logits, *args, **kwargs)
        if capture.busy():
            return fn(logits, *args, **kwargs)
        self.replays += 1
        return capture.replay(logits)

    def _capture_due(self, key) -> bool:
        """Whether an uncaptured key is captured now: on its second call, within
        ``MAX_CAPTURES``."""
        if len(self._captured) >= MAX_CAPTURES:
            return False
        if self._seen.forget(key) is not None:
            return True
        self._seen.remember(key)
        return False


def _key(fn, logits, args, kwargs):
    """The capture's key, or None when this call must run eagerly (module docstring)."""
    if not (logits.is_cuda and torch.is_grad_enabled() and logits.requires_grad):
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    bound = _signature(fn).bind(logits, *args, **kwargs)
    given = list(bound.arguments.items())[1:]
    if bound.arguments.get("drop_tokens", True) is not True or bound.arguments.get("use_tutel"):
        return None
    if any(isinstance(v, torch.Tensor) for _, v in given):
        return None
    try:
        hash(tuple(given))
    except TypeError:
        return None
    # autocast changes which kernels a call runs: a capture serves its own setting only
    autocast = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda")
    return (fn, tuple(logits.shape), logits.dtype, logits.device, tuple(given), autocast)


_signature = functools.cache(inspect.signature)   # three DeepSpeed functions


class _Ticket:
    """A graphed forward's claim on its capture's saved state, until its backward replays
    (or autograd drops its graph, which frees the ticket)."""
    done = False


class _Capture:
    """One gating call captured: the forward graph from ``leaf`` to its outputs, the backward
    graph from the outputs' gradients to ``leaf``'s."""

    def __init__(self, fn, logits, args, kwargs):
        device = logits.device
        rng = torch.cuda.get_rng_state(device)
        self.leaf = torch.empty_like(logits, requires_grad=True)
        self.leaf.detach().copy_(logits)
        call = lambda: fn(self.leaf.clone(), *args, **kwargs)   # DeepSpeed adds noise in place
        try:
            self._capture(call, device)
        finally:
            torch.cuda.set_rng_state(rng, device)   # the warm-up and capture drew nothing
        self._ticket = lambda: None

    def _capture(self, call, device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), _plain_saved_tensors():
            for _ in range(_WARMUP):
                self._backward_of(call())
        torch.cuda.current_stream(device).wait_stream(side)
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # captured on the warm-up's stream: the leaf's gradient node was made there, and
        # autograd warns when a gradient reaches it from another stream; thread_local: only
        # this thread's capture-unsafe calls fail it (not a data loader's meanwhile)
        graph = functools.partial(torch.cuda.graph, stream=side, capture_error_mode="thread_local")
        with _plain_saved_tensors():
            with graph(self.fwd):
                out = call()
            self._layout(out)
            self.grads = [torch.empty_like(t) for t in self.tensors if t.requires_grad]
            self._stale = [True] * len(self.grads)   # a buffer not known to hold zeros
            with graph(self.bwd, pool=self.fwd.pool()):
                self.leaf_grad = self._backward_of(out, self.grads)

    def _layout(self, out):
        """Split the outputs into the graph's tensors and host values fixed at capture."""
        self.single = not isinstance(out, tuple)
        items = (out,) if self.single else out
        self.tensors, self.template = [], []
        for item in items:
            if isinstance(item, torch.Tensor) and item.is_cuda:
                self.template.append(("graph", len(self.tensors)))
                self.tensors.append(item)
            else:
                self.template.append(("host", item))
        self.grad_mask = [t.requires_grad for t in self.tensors]

    def _backward_of(self, out, grads=None):
        items = (out,) if not isinstance(out, tuple) else out
        outs = [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = grads if grads is not None else [torch.ones_like(t) for t in outs]
        (g,) = torch.autograd.grad(outs, self.leaf, grads, retain_graph=True, allow_unused=True)
        return torch.zeros_like(self.leaf) if g is None else g

    def busy(self) -> bool:
        ticket = self._ticket()
        return ticket is not None and not ticket.done

    def replay(self, logits):
        ticket = _Ticket()
        self._ticket = weakref.ref(ticket)
        tensors = _Replay.apply(self, ticket, logits)
        out = [tensors[ref] if kind == "graph" else ref for kind, ref in self.template]
        return out[0] if self.single else tuple(out)

    def grad(self, ticket, grads):
        if ticket.done or self._ticket() is not ticket:
            raise RuntimeError(
                "FP4MoE: the graphed gate's backward ran twice, or after a later forward of the "
                "same layer (retain_graph); set fp4_moe.expert_graphs to false for this model")
        self._copy_in([g for g, d in zip(grads, self.grad_mask) if d])
        self.bwd.replay()
        ticket.done = True
        return self.leaf_grad.clone()

    def _copy_in(self, grads):
        """The outputs' gradients into the graph's buffers; an output without one (None:
        the loss does not use it, e.g. l_aux) reads zeros, written only when the buffer
        last held a gradient (the same outputs lack one step after step)."""
        dst, src = [], []
        for i, (buf, g) in enumerate(zip(self.grads, grads)):
            if g is None:
                if self._stale[i]:
                    buf.zero_()
                    self._stale[i] = False
            else:
                dst.append(buf)
                src.append(g)
                self._stale[i] = True
        if dst:
            torch._foreach_copy_(dst, src)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, capture, ticket, logits):
        capture.leaf.detach().copy_(logits)
        capture.fwd.replay()
        outs = tuple(t.clone() for t in capture.tensors)
        ctx.capture, ctx.ticket = capture, ticket
        ctx.mark_non_differentiable(*[t for t, d in zip(outs, capture.grad_mask) if not d])
        ctx.set_materialize_grads(False)   # an unused output's gradient: None, not zeros
        return outs

    @staticmethod
    def backward(ctx, *grads):
        return None, None, ctx.capture.grad(ctx.ticket, grads)


class _plain_saved_tensors(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors as they are while capturing: hooks of the caller (the layer's
    ``GateInputCopy``, a benchmark's count of what is kept) see the replay, not the capture."""

    def __init__(self):
        super().__init__(lambda t: t, lambda t: t)
