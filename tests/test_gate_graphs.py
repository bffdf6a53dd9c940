"""GateGraphs: DeepSpeed's gating function replayed from CUDA graphs, the same bits.

CPU: the dispatchers that RowScanCumsum(graphs) puts in place of DeepSpeed's gating
functions hand the layer's calls (this thread only) to its GateGraphs, and DeepSpeed's own
functions are back once the context closes; calls that cannot be graphed run DeepSpeed's
function. GPU: a replayed call equals DeepSpeed's eager call bit for bit (outputs, the
logits' gradient, the RNG draws of the second expert's noise and of random token
selection) for top-1/2/k, several shapes, many replays; a forward that finds the capture
still waiting for its backward runs eagerly; FP4MoE with every format bf16 and the graphs
on equals the same layer with them off over several steps (and DeepSpeed's layer within
float32 order: the split gate's logits, the fused decode); a capture holds a few MB.
"""

import threading

import pytest
import torch
from deepspeed.moe import sharded_moe

from ds_fp4.moe.gate_graphs import GateGraphs
from ds_fp4.moe.gate_scan import RowScanCumsum
from tests.dist_utils import rel_err
from tests.test_gate_scan import recorded_gate_contexts
from tests.test_moe_layer import _pair

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_NAMES = ("top1gating", "top2gating", "topkgating")
_ORIGINALS = {n: getattr(sharded_moe, n) for n in _NAMES}


class _Recorder:
    def __init__(self):
        self.calls = []

    def call(self, fn, logits, args, kwargs):
        self.calls.append(fn)
        return fn(logits, *args, **kwargs)


def test_the_layers_calls_go_to_its_graphs_and_deepspeed_gets_its_functions_back():
    rec = _Recorder()
    logits = torch.randn(64, 8)
    with RowScanCumsum(rec):
        assert all(getattr(sharded_moe, n) is not _ORIGINALS[n] for n in _NAMES)
        sharded_moe.top2gating(logits.clone(), 1.0, 4, sparse_routes=True)
        sharded_moe.topkgating(logits.clone(), 3, 1.0, 4, sparse_routes=True)
    assert rec.calls == [_ORIGINALS["top2gating"], _ORIGINALS["topkgating"]]
    assert all(getattr(sharded_moe, n) is _ORIGINALS[n] for n in _NAMES)


def test_other_threads_and_contexts_without_graphs_call_deepspeed():
    rec, seen = _Recorder(), []
    logits = torch.randn(64, 8)
    with RowScanCumsum(rec):
        worker = threading.Thread(
            target=lambda: seen.append(sharded_moe.top1gating(logits.clone(), 1.0, 4)))
        worker.start()
        worker.join()
        with RowScanCumsum():          # a nested context without graphs
            sharded_moe.top1gating(logits.clone(), 1.0, 4)
        sharded_moe.top1gating(logits.clone(), 1.0, 4)   # the outer one's again
    assert len(seen) == 1 and rec.calls == [_ORIGINALS["top1gating"]]


def test_calls_that_cannot_be_graphed_run_deepspeeds_function():
    graphs = GateGraphs()
    fn = _ORIGINALS["top2gating"]
    logits = torch.randn(64, 8, requires_grad=True)
    torch.manual_seed(5)
    want = fn(logits.clone(), 1.0, 4, sparse_routes=True)
    torch.manual_seed(5)
    got = graphs.call(fn, logits.clone(), (1.0, 4), dict(sparse_routes=True))   # a CPU tensor
    assert graphs.replays == 0 and not graphs._captured
    for g, w in zip(got, want):
        assert torch.equal(g, w) if isinstance(w, torch.Tensor) else g == w


def test_the_layer_has_graphs_unless_expert_graphs_is_false():
    for graphs, want in (("auto", GateGraphs), (True, GateGraphs), (False, type(None))):
        _, fp4 = _pair(dict(expert_graphs=graphs), 2, True, "bf16")
        assert type(fp4.deepspeed_moe.gate_graphs) is want
    _, off = _pair(dict(enabled=False), 2, True, "bf16")
    assert off.deepspeed_moe.gate_graphs is None


def test_the_layer_calls_its_gate_eagerly_under_others_saved_tensor_hooks(monkeypatch):
    made = recorded_gate_contexts(monkeypatch)
    _, fp4 = _pair(dict(dispatch="bf16", combine="bf16", grad="bf16", cache="bf16",
                        expert_graphs=True), 2, True, "bf16")
    x = torch.randn(2, 16, fp4.deepspeed_moe.gate.wg.weight.shape[1], dtype=torch.bfloat16)
    fp4(x)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        fp4(x)
    given = [context._graphs for context in made]
    assert given == [fp4.deepspeed_moe.gate_graphs, None] and given[0] is not None


class _FakeCapture:
    """A capture stand-in on the CPU: counts what GateGraphs makes and replays."""
    made = 0

    def __init__(self, fn, logits, args, kwargs):
        _FakeCapture.made += 1
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def busy(self):
        return False

    def replay(self, logits):
        return self.fn(logits, *self.args, **self.kwargs)


def test_a_shape_is_captured_on_its_second_call_and_a_layer_keeps_a_few(monkeypatch):
    from ds_fp4.moe import gate_graphs as G
    monkeypatch.setattr(G, "_Capture", _FakeCapture)
    monkeypatch.setattr(G, "_key", lambda fn, logits, args, kwargs: tuple(logits.shape))
    _FakeCapture.made = 0
    graphs, fn = GateGraphs(), _ORIGINALS["top1gating"]
    call = lambda s: graphs.call(fn, torch.randn(s, 4), (1.0, 4), {})
    call(8)
    assert _FakeCapture.made == 0 and graphs.replays == 0      # seen once: eager
    call(8), call(8)
    assert _FakeCapture.made == 1 and graphs.replays == 2
    for s in range(9, 9 + 2 * G.MAX_CAPTURES):                 # shapes that keep changing
        call(s), call(s)
    assert len(graphs._captured) == G.MAX_CAPTURES == _FakeCapture.made
    graphs = GateGraphs()
    for s in range(100, 100 + 2 * G.MAX_SEEN):                 # shapes that never repeat
        call(s)
    assert len(graphs._seen) == G.MAX_SEEN and not graphs._captured


def test_a_failed_capture_warns_and_leaves_the_layers_gate_eager(monkeypatch):
    from ds_fp4.moe import gate_graphs as G
    tries = []

    def failing(*args):
        tries.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(G, "_Capture", failing)
    monkeypatch.setattr(G, "_key", lambda fn, logits, args, kwargs: tuple(logits.shape))
    graphs, fn = GateGraphs(), _ORIGINALS["top1gating"]
    logits = torch.randn(8, 4)
    torch.manual_seed(0)   # random token selection
    want = fn(logits.clone(), 1.0, 4)
    graphs.call(fn, logits.clone(), (1.0, 4), {})
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="capture of DeepSpeed's gate failed"):
        got = graphs.call(fn, logits.clone(), (1.0, 4), {})
    for _ in range(3):
        graphs.call(fn, logits.clone(), (1.0, 4), {})
    assert len(tries) == 1 and isinstance(graphs.disabled, RuntimeError)
    assert all(torch.equal(g, w) if torch.is_tensor(w) else g == w for g, w in zip(got, want))


# ---- GPU ---------------------------------------------------------------------------------

_CASES = [("top1gating", (1.25, 4), {}),
          ("top1gating", (1.0, 4), dict(use_rts=False)),
          ("top2gating", (1.25, 4), {}),
          ("top2gating", (1.0, 8), dict(top2_2nd_expert_sampling=False)),
          ("topkgating", (3, 1.25, 4), {}),
          ("topkgating", (4, 1.0, 4), dict(drop_policy="position"))]


def _step(call, logits, seed, with_aux=True):
    """One gating call and its backward, RNG at ``seed``: (outputs, logits' gradient).
    ``with_aux`` False: no gradient for l_aux (the first output)."""
    leaf = logits.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    out = call(leaf * 1)    # DeepSpeed adds its noise in place: not into the leaf
    g = torch.Generator(device="cuda").manual_seed(seed)
    diff = [t for t in out if isinstance(t, torch.Tensor) and t.requires_grad]
    diff = diff if with_aux else diff[1:]
    grads = [torch.randn(t.shape, device="cuda", generator=g) for t in diff]
    torch.autograd.backward(diff, grads)
    return out, leaf.grad


def _assert_same(got, want):
    (out_g, grad_g), (out_w, grad_w) = got, want
    assert len(out_g) == len(out_w)
    for g, w in zip(out_g, out_w):
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.device == w.device and torch.equal(g, w)
        else:
            assert g == w
    assert torch.equal(grad_g, grad_w)


@cuda
@pytest.mark.parametrize("name, args, kwargs", _CASES)
@pytest.mark.parametrize("tokens, experts", [(4096, 8), (300, 16), (64, 4)])
def test_replays_equal_deepspeeds_calls(name, args, kwargs, tokens, experts):
    fn = _ORIGINALS[name]
    kw = dict(kwargs, sparse_routes=True)
    graphs = GateGraphs()
    for seed in range(4):
        logits = torch.randn(tokens, experts, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(100 + seed))
        want = _step(lambda lg: fn(lg, *args, **kw), logits, seed)
        got = _step(lambda lg: graphs.call(fn, lg, args, kw), logits, seed)
        _assert_same(got, want)
    assert graphs.replays == 3 and len(graphs._captured) == 1   # the first call: eager


@cuda
def test_an_output_without_a_gradient_reads_zeros_in_the_replay():
    """Steps alternate between a loss with l_aux and one without (its gradient None, the
    replay's buffer zeroed only after a step that wrote it): the input's gradient is the
    eager call's every time."""
    fn, args, kw = _ORIGINALS["top2gating"], (1.25, 4), dict(sparse_routes=True)
    graphs = GateGraphs()
    for seed, with_aux in enumerate((True, True, False, False, True, False)):
        logits = torch.randn(512, 8, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(200 + seed))
        want = _step(lambda lg: fn(lg, *args, **kw), logits, seed, with_aux)
        got = _step(lambda lg: graphs.call(fn, lg, args, kw), logits, seed, with_aux)
        _assert_same(got, want)
    assert graphs.replays == 5


def test_gradients_copied_in_and_missing_ones_zeroed_once():
    """``_Capture._copy_in`` on CPU buffers: a missing gradient zeroes a buffer only when it
    may hold an older gradient (garbage at first)."""
    from ds_fp4.moe.gate_graphs import _Capture
    capture = _Capture.__new__(_Capture)
    capture.grads = [torch.full((3,), 7.0), torch.full((2,), 7.0)]
    capture._stale = [True, True]
    writes = []
    for buf in capture.grads:
        real = buf.zero_
        buf.zero_ = lambda real=real: writes.append(1) or real()
    capture._copy_in([None, torch.ones(2)])
    assert capture.grads[0].eq(0).all() and capture.grads[1].eq(1).all() and len(writes) == 1
    capture._copy_in([None, None])
    assert capture.grads[1].eq(0).all() and len(writes) == 2
    capture._copy_in([None, None])
    assert len(writes) == 2                               # both known zero: nothing written
    capture._copy_in([torch.full((3,), 2.0), None])
    assert capture.grads[0].eq(2).all() and len(writes) == 2


@cuda
def test_the_rng_moves_on_as_deepspeeds_call_moves_it():
    fn, args, kw = _ORIGINALS["top2gating"], (1.0, 4), dict(sparse_routes=True)
    logits = torch.randn(512, 8, device="cuda")
    graphs = GateGraphs()
    for _ in range(2):   # seen, then captured
        graphs.call(fn, logits.clone().requires_grad_() * 1, args, kw)
    for use_graphs in (False, True):
        torch.manual_seed(11)
        call = (lambda lg: graphs.call(fn, lg, args, kw)) if use_graphs else \
            (lambda lg: fn(lg, *args, **kw))
        # detached: autograd drops each call's graph, so the capture is free for the next
        outs = [[t.detach() if torch.is_tensor(t) else t
                 for t in call(logits.clone().requires_grad_() * 1)] for _ in range(3)]
        after = torch.rand(4, device="cuda")
        if not use_graphs:
            want_outs, want_after = outs, after
    for g, w in zip(outs, want_outs):
        assert torch.equal(g[3], w[3]) and torch.equal(g[5], w[5])   # indices, gates
    assert torch.equal(after, want_after)
    assert graphs.replays == 4


@cuda
def test_a_forward_before_the_last_ones_backward_runs_eagerly():
    fn, args, kw = _ORIGINALS["top2gating"], (1.0, 4), dict(sparse_routes=True)
    graphs = GateGraphs()
    logits = [torch.randn(256, 8, device="cuda") for _ in range(2)]
    leaves = [lg.clone().requires_grad_() for lg in logits]
    graphs.call(fn, leaves[0] * 1, args, kw)             # seen: eager
    torch.manual_seed(3)
    first = graphs.call(fn, leaves[0] * 1, args, kw)     # captured, then replayed
    second = graphs.call(fn, leaves[1] * 1, args, kw)    # the capture is still held: eager
    assert graphs.replays == 1
    (second[0] + second[5].sum()).backward()
    (first[0] + first[5].sum()).backward()
    refs = [lg.clone().requires_grad_() for lg in logits]
    torch.manual_seed(3)
    want = [fn(r * 1, *args, **kw) for r in refs]
    for got, w, leaf, ref in zip((first, second), want, leaves, refs):
        (w[0] + w[5].sum()).backward()
        assert torch.equal(got[3], w[3]) and torch.equal(leaf.grad, ref.grad)
    third = graphs.call(fn, leaves[0] * 1, args, kw)      # free again
    assert graphs.replays == 2 and torch.is_tensor(third[0])


@cuda
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_layer_with_graphs_is_the_layer_without(k):
    """FP4MoE with every format bf16 and the gate graphs on computes bit for bit what the
    same layer computes with them off, over several steps (output, l_aux, the input's and
    every parameter's gradient). Both are DeepSpeed's layer up to float32 order on CUDA (the
    split gate Linear's logits, session 24; the fused decode's route order at k > 2): that
    bit-for-bit comparison with DeepSpeed failed at k = 2, 3 on the H200 (session 26)."""
    from tests.dist_utils import forward_backward
    bf16 = dict(dispatch="bf16", combine="bf16", grad="bf16", cache="bf16")
    ref, on = (m.cuda() for m in _pair(dict(bf16, expert_graphs=True), k, True, "bf16"))
    off = _pair(dict(bf16, expert_graphs=False), k, True, "bf16")[1].cuda()
    assert off.deepspeed_moe.gate_graphs is None
    for step in range(3):
        x = torch.randn(2, 64, ref.deepspeed_moe.gate.wg.weight.shape[1], device="cuda",
                        dtype=torch.bfloat16)
        g = torch.randn_like(x)
        got, want = forward_backward(on, x, step, g), forward_backward(off, x, step, g)
        for i in range(3):
            assert torch.equal(got[i], want[i]), f"output {i} differs at step {step}"
        assert all(torch.equal(got[3][n], want[3][n]) for n in want[3])
        ds = forward_backward(ref, x, step, g)
        assert rel_err(got[0], ds[0]) < 1e-2 and rel_err(got[2], ds[2]) < 1e-2
    assert on.deepspeed_moe.gate_graphs.replays == 2   # step 0: eager


@cuda
def test_a_captured_gate_holds_little_memory():
    """No cuBLAS call in the captured gate (the stand-in's einsum): a capture whose pool
    held its own cuBLAS workspace took 65 MB at 4096 x 8 (session 15)."""
    graphs, logits = GateGraphs(), torch.randn(4096, 8, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(2):   # eager, then captured
        with RowScanCumsum(graphs):
            out = sharded_moe.top2gating(logits * 1, 1.25, 4, sparse_routes=True)
        (out[0] + out[5].sum()).backward()
        del out
    torch.cuda.synchronize()
    assert graphs.replays == 1
    assert torch.cuda.memory_allocated() - before < 8 * 2 ** 20


@cuda
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_the_layer_with_graphs_gives_its_plain_result(reentrant):
    """torch.utils.checkpoint over FP4MoE with the gate graphs on: the non-reentrant
    recompute checks the tensors the forward saved (the gate runs eagerly under its hooks),
    the reentrant one replays with grad after a forward without."""
    from torch.utils.checkpoint import checkpoint
    cfg = dict(dispatch="bf16", combine="bf16", grad="bf16", cache="bf16", expert_graphs=True)
    _, fp4 = _pair(cfg, 2, True, "bf16")
    fp4 = fp4.cuda()
    hidden = fp4.deepspeed_moe.gate.wg.weight.shape[1]
    for step in range(3):
        x = torch.randn(2, 64, hidden, device="cuda", dtype=torch.bfloat16)
        results = []
        for ckpt in (False, True):
            leaf = x.clone().requires_grad_()
            fp4.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            run = lambda t: fp4(t)[0]
            out = checkpoint(run, leaf, use_reentrant=reentrant) if ckpt else run(leaf)
            out.float().square().sum().backward()
            results.append([out.detach(), leaf.grad] + [p.grad for p in fp4.parameters()])
        for a, b in zip(*results):
            assert (a is None and b is None) or torch.equal(a, b)


@cuda
def test_a_capture_serves_its_own_autocast_setting():
    from ds_fp4.moe.gate_graphs import _key
    fn = _ORIGINALS["top2gating"]
    logits = torch.randn(64, 8, device="cuda", requires_grad=True) * 1
    plain = _key(fn, logits, (1.0, 4), {})
    with torch.autocast("cuda", dtype=torch.bfloat16):
        cast = _key(fn, logits, (1.0, 4), {})
    assert plain is not None and cast is not None and plain != cast
    assert _key(fn, logits, (1.0, 4), {}) == plain
