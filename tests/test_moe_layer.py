"""FP4MoE in one process (expert parallel size 1: nothing is sent, the cache still applies).

Multi-rank behaviour (wires, bytes, engine, checkpoints) is in test_moe_dist.py.
"""

import json
import os

import pytest
import torch
from deepspeed.moe.experts import Experts
from deepspeed.moe.layer import MoE

import ds_fp4
from ds_fp4 import formats as F
from ds_fp4.moe import FP4MoE, FP8Experts, SwiGLUExpert, bf16_start, to_fp4
from tests.dist_utils import (Contiguous, checkpointed_output, cpu_env, fake_quant,
                              forward_backward, kept_route_outputs, make_moe, mlp_expert,
                              rel_err, route_format)
from tests.test_fp8_experts import needs_hopper

cpu_env()
HIDDEN, FFN = 128, 256
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "ds_config_examples")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _pair(cfg, k=2, drop_tokens=True, dtype="fp32", expert=None, num_experts=4, hidden=HIDDEN):
    kw = dict(hidden=hidden, num_experts=num_experts, ep_size=1, k=k, drop_tokens=drop_tokens,
              dtype=DTYPES[dtype], parallel=False,
              expert=expert if expert is not None else mlp_expert(hidden, FFN))
    return make_moe(**kw), to_fp4(make_moe(**kw), cfg)


def _x(dtype="fp32", tokens=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, tokens // 2, HIDDEN, generator=gen).to(DTYPES[dtype])


def _grad_out(x):
    return torch.randn(x.shape, generator=torch.Generator().manual_seed(99)).to(x.device)


def _run(layer, x, seed=1):
    return forward_backward(layer, x, seed, _grad_out(x))


def _run_spec(ref, x, cache):
    """DeepSpeed's layer with the routes' outputs its decode keeps rounded as FP4MoE with
    ``cache`` keeps them (``RouteOutputCache``)."""
    from deepspeed.moe import sharded_moe
    fmt = route_format(dict(cache=cache))
    if fmt is None:
        return _run(ref, x)
    with kept_route_outputs(sharded_moe, "_sparse_decode", fmt, "rceil",
                            lambda out, slots, *_: slots.numel()):
        return _run(ref, x)


def _assert_same(got, want, skip=()):
    for name, a, b in zip(("output", "l_aux", "input grad"), got[:3], want[:3]):
        assert torch.equal(a, b), f"{name}: rel err {rel_err(a, b):.3g}"
    assert got[3].keys() == want[3].keys()
    for n in want[3]:
        if n not in skip:
            err = rel_err(got[3][n], want[3][n])
            assert torch.equal(got[3][n], want[3][n]), f"grad of {n}: rel err {err:.3g}"


def _first_linear_weights(layer):
    """Names of the parameters whose gradient uses the saved expert inputs."""
    return {n for n, _ in layer.named_parameters()
            if ".deepspeed_experts." in n and n.endswith(".0.weight")}


# ---- equal to DeepSpeed ---------------------------------------------------------------

@pytest.mark.parametrize("k,drop_tokens", [(1, True), (2, False), (3, True)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_disabled_is_deepspeed(k, drop_tokens, dtype):
    ref, fp4 = _pair(dict(enabled=False), k, drop_tokens, dtype)
    x = _x(dtype)
    _assert_same(_run(fp4, x), _run(ref, x))


class _Engine:
    """What a layer reads of a DeepSpeed engine for ``bf16_start_steps``."""
    global_steps = 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_hopper)])
def test_bf16_start_is_deepspeed_until_the_step_then_the_recipe(device):
    """DeepSpeed's layer and experts while the engine's step is below N; from N on the
    recipe with its FP8 experts, bit for bit the layer without a bf16 start."""
    def layer(cfg=None):
        moe = make_moe(hidden=HIDDEN, num_experts=4, ep_size=1, k=2, dtype=torch.bfloat16,
                       parallel=False, expert=SwiGLUExpert(HIDDEN, FFN)).to(device)
        return moe if cfg is None else to_fp4(moe, dict(cfg, fp8_experts=True))
    ref, fp4, started = layer(), layer({}), layer(dict(bf16_start_steps=2))
    engine = _Engine()
    bf16_start.attach(started, engine)
    x = _x("bf16").to(device)
    deepspeed_out, recipe_out = _run(ref, x), _run(fp4, x)
    assert not torch.equal(recipe_out[0], deepspeed_out[0])   # the FP8 experts round
    # the last: an engine rolled back to a checkpoint before the step
    for step, want in ((0, deepspeed_out), (1, deepspeed_out), (2, recipe_out), (5, recipe_out),
                       (1, deepspeed_out), (3, recipe_out)):
        engine.global_steps = step
        _assert_same(_run(started, x), want)
        fp8 = isinstance(started.deepspeed_moe.experts, FP8Experts)
        assert fp8 == (step >= 2), step


def test_bf16_start_without_an_engine_names_the_fix():
    _, started = _pair(dict(bf16_start_steps=3))
    with pytest.raises(RuntimeError, match=r"bf16_start_steps = 3 .*ds_fp4\.initialize"):
        started(_x())
    engine = _Engine()
    bf16_start.attach(started, engine)
    del engine        # a weak reference: a layer never keeps an engine alive
    with pytest.raises(RuntimeError, match="ds_fp4.configure"):
        started(_x())


@pytest.mark.parametrize("k", [1, 2, 3])
def test_all_bf16_options_are_deepspeed_in_bf16(k):
    cfg = dict(dispatch="bf16", combine="bf16", grad="bf16", cache="bf16")
    ref, fp4 = _pair(cfg, k, True, "bf16")
    x = _x("bf16")
    _assert_same(_run(fp4, x), _run(ref, x))


@pytest.mark.parametrize("cache,bound", [("mxfp4", 0.2), ("fp8", 0.05), ("bf16", 0.01)])
@pytest.mark.parametrize("k,drop_tokens", [(1, False), (2, True), (3, False)])
def test_only_the_cache_acts_with_one_rank(cache, bound, k, drop_tokens):
    """ep 1: output and every gradient but the experts' first weights are DeepSpeed's, with
    the routes' outputs its decode keeps in the cache format."""
    ref, fp4 = _pair(dict(cache=cache), k, drop_tokens, "fp32")
    x = _x()
    want = _run_spec(ref, x, cache)
    got = forward_backward(fp4, x, 1, _grad_out(x))
    cached = _first_linear_weights(ref)
    _assert_same(got, want, skip=cached)
    errs = [rel_err(got[3][n], want[3][n]) for n in cached if n in want[3]]
    assert errs and 0 < max(errs) < bound, errs


def _representable(dtype, tokens=32):
    """Tokens whose values are E2M1 codes times one power of two: exact in MXFP4 and FP8."""
    gen = torch.Generator().manual_seed(5)
    table = torch.tensor(F.E2M1_VALUES)
    codes = torch.randint(0, 8, (2, tokens // 2, HIDDEN), generator=gen)
    signs = torch.randint(0, 2, codes.shape, generator=gen) * 2 - 1
    return (table[codes] * signs * 0.25).to(DTYPES[dtype])


def _tanh_sigmoid_expert():
    """An expert whose activations save their outputs (tanh, sigmoid) rather than inputs."""
    return torch.nn.Sequential(Contiguous(), torch.nn.Linear(HIDDEN, FFN), torch.nn.Tanh(),
                               torch.nn.Linear(FFN, HIDDEN), torch.nn.Sigmoid())


@pytest.mark.parametrize("cache", ["mxfp4", "fp8"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("num_experts,kind", [(2, "gelu"), (4, "gelu"), (4, "tanh")])
def test_cache_is_exact_when_the_format_is(cache, dtype, num_experts, kind):
    """Inputs that the format holds exactly: every gradient is DeepSpeed's, bit for bit.

    This pins the cache's bookkeeping (which rows, offsets and strides of which local
    expert's chunk) independently of rounding, and the pass-through of everything else.
    """
    expert = mlp_expert(HIDDEN, FFN, contiguous_input=True) if kind == "gelu" \
        else _tanh_sigmoid_expert()
    ref, fp4 = _pair(dict(cache=cache), 2, True, dtype, num_experts=num_experts, expert=expert)
    x = _representable(dtype)
    assert torch.equal(fake_quant(x, cache), x)
    _assert_same(_run(fp4, x), _run_spec(ref, x, cache))
    assert fp4.deepspeed_moe.cached_views == num_experts  # every expert's input was taken


@pytest.mark.parametrize("cache", ["mxfp4", "fp8", "bf16"])
def test_cache_keeps_the_quantized_inputs(cache):
    """Linear experts: grad W_j = dy_j^T @ Q(x_j) with Q the cache format's round trip."""
    ref, fp4 = _pair(dict(cache=cache), 2, True, "fp32",
                     expert=torch.nn.Linear(HIDDEN, HIDDEN, bias=False))
    seen = []

    def capture(module, inputs, output):
        seen.append([inputs[0].detach().clone(), None])
        output.register_hook(lambda g, slot=seen[-1]: slot.__setitem__(1, g.detach().clone()))

    for ex in fp4.deepspeed_moe.experts.deepspeed_experts:
        ex.register_forward_hook(capture)
    x = _x()
    got = forward_backward(fp4, x, 1, _grad_out(x))
    want = forward_backward(ref, x, 1, _grad_out(x))
    assert len(seen) == fp4.num_local_experts
    for j, (xj, gj) in enumerate(seen):
        name = f"deepspeed_moe.experts.deepspeed_experts.{j}.weight"
        x2d, g2d = xj.reshape(-1, HIDDEN), gj.reshape(-1, HIDDEN)
        expected = g2d.t().mm(fake_quant(x2d, cache))
        torch.testing.assert_close(got[3][name], expected, rtol=1e-5, atol=1e-6)
        assert rel_err(got[3][name], want[3][name]) > 1e-4  # and not the unquantized one


def test_route_outputs_kept_in_fp8_below_bf16_only():
    from ds_fp4.config import Format
    from ds_fp4.moe.cache import route_output_format
    assert route_output_format(Format.MXFP4, 256) == Format.FP8   # never MXFP4
    assert route_output_format(Format.FP8, 256) == Format.FP8
    assert route_output_format(Format.BF16, 256) is None
    assert route_output_format(Format.MXFP4, 96) is None          # FP8 rows need 128s


def test_route_outputs_left_to_autograd_when_hidden_is_not_128s():
    """hidden 96 packs in MXFP4 but not in FP8 rows: the decode's routes' outputs stay as
    autograd keeps them, so the gates' gradient is DeepSpeed's."""
    ref, fp4 = _pair(dict(cache="mxfp4"), 2, True, "fp32", hidden=96,
                     expert=torch.nn.Sequential(Contiguous(), torch.nn.Linear(96, 96)))
    x = torch.randn(2, 16, 96, generator=torch.Generator().manual_seed(3))
    got, want = _run(fp4, x), _run(ref, x)
    gate = [n for n in want[3] if ".gate." in n]
    assert gate and all(torch.equal(got[3][n], want[3][n]) for n in gate)


def test_gate_copy_survives_the_input_changed_in_place():
    """The gate's float32 input copy is kept as a bf16 copy of the input: changing the
    input in place after the forward leaves every gradient DeepSpeed's, as with its copy."""
    def run(layer):
        x = _x("bf16").requires_grad_(True)
        inner = x * 1   # a non-leaf the caller may overwrite
        out, l_aux, _ = layer(inner)
        inner.data.mul_(3)
        torch.autograd.backward((out, l_aux), (_grad_out(out).to(out.dtype), torch.ones_like(l_aux)))
        return x.grad, {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}

    ref, fp4 = _pair(dict(dispatch="bf16", combine="bf16", grad="bf16", cache="bf16"), 2, True,
                     "bf16")
    torch.manual_seed(1)
    want = run(ref)
    torch.manual_seed(1)
    got = run(fp4)
    assert torch.equal(got[0], want[0])
    gate = [n for n in want[1] if ".gate." in n]
    assert gate and all(torch.equal(got[1][n], want[1][n]) for n in want[1])


def test_gate_upcast_does_not_outlive_the_forward(monkeypatch):
    """Neither the gate's saved tensor nor autograd's reference to the pack hook keeps the
    float32 upcast alive after the forward (only its bf16 copy is kept)."""
    import gc
    import weakref
    from ds_fp4.moe import cache
    upcasts = []
    init = cache.GateInputCopy.__init__

    def recording(self, tokens):
        init(self, tokens)
        upcasts.append(weakref.ref(self.upcast))

    monkeypatch.setattr(cache.GateInputCopy, "__init__", recording)
    _, fp4 = _pair({}, 2, True, "bf16")
    out = fp4(_x("bf16").requires_grad_(True))[0]   # the graph stays alive
    gc.collect()
    assert len(upcasts) == 1 and upcasts[0]() is None
    out.float().sum().backward()


def test_no_cache_without_grad():
    ref, fp4 = _pair({}, 2, True, "bf16")
    x = _x("bf16")
    torch.manual_seed(1)
    with torch.no_grad():
        out = fp4(x)[0]
    torch.manual_seed(1)
    assert torch.equal(out, fp4(x)[0].detach())
    torch.manual_seed(1)
    assert torch.equal(out, ref(x)[0].detach())  # ep 1: no wire


# ---- activation checkpointing ---------------------------------------------------------

@pytest.mark.parametrize("fp8", [False, True], ids=["deepspeed-experts", "fp8-experts"])
@pytest.mark.parametrize("mode", ["torch", "deepspeed"])
def test_checkpointing_gives_the_same_gradients(mode, fp8):
    # deepspeed.checkpointing moves its inputs to DeepSpeed's accelerator: on a GPU host
    # whose accelerator is CUDA (another test file imported DeepSpeed first), run there.
    # FP8 experts: the slots gathered from the tokens both ways (GatheredSlots) under both.
    from deepspeed.accelerator import get_accelerator
    from ds_fp4.moe import SwiGLUExpert
    device = get_accelerator().current_device_name() if mode == "deepspeed" else "cpu"
    _, fp4 = _pair(dict(fp8_experts=True) if fp8 else {}, 2, True, "bf16",
                   expert=SwiGLUExpert(HIDDEN, FFN) if fp8 else None)
    fp4 = fp4.to(device)
    x0, g = _x("bf16").to(device), _grad_out(_x("bf16")).bfloat16().to(device)
    results = []
    for use in (None, mode):
        x = x0.clone().requires_grad_(True)
        fp4.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        out = checkpointed_output(fp4, x, use)
        out.backward(g)
        results.append([out.detach(), x.grad] + [p.grad for p in fp4.parameters()])
    for a, b in zip(*results):
        assert (a is None and b is None) or torch.equal(a, b)


# ---- bad input ------------------------------------------------------------------------

@pytest.mark.parametrize("hidden,cfg,ep_size,option,unit", [
    (48, {}, 1, "cache", 32),
    (96, dict(cache="fp8"), 1, "cache", 128),
    (96, {}, 2, "grad", 128),
    (96, dict(grad="bf16", dispatch="fp8"), 2, "dispatch", 128),
    (80, dict(grad="bf16", cache="bf16", dispatch="bf16", combine="mxfp4"), 2, "combine", 32),
])
def test_hidden_size_rejected_at_construction(hidden, cfg, ep_size, option, unit):
    with pytest.raises(ValueError) as err:
        FP4MoE(hidden, mlp_expert(hidden, 64), num_experts=2, ep_size=ep_size, fp4_config=cfg)
    msg = str(err.value)
    assert f"fp4_moe.{option} = " in msg and f"needs a multiple of {unit}" in msg
    assert f"e.g. {-(-hidden // unit) * unit}" in msg and "to 'bf16'" in msg  # the two fixes


def test_hidden_size_error_names_every_option():
    with pytest.raises(ValueError) as err:
        FP4MoE(80, mlp_expert(80, 64), num_experts=2, ep_size=2)
    msg = str(err.value)
    for option in ("dispatch", "grad", "cache"):
        assert f"fp4_moe.{option} = " in msg
    assert "fp4_moe.combine" not in msg and "multiple of 128 (e.g. 128)" in msg


def test_hidden_size_accepted_when_the_formats_allow():
    FP4MoE(96, mlp_expert(96, 64), num_experts=2, ep_size=2, fp4_config=dict(grad="bf16"))
    FP4MoE(96, mlp_expert(96, 64), num_experts=2, fp4_config=dict(enabled=False, cache="fp8"))


def test_convert_rejects_without_changing_any_layer():
    ok, bad = MoE(64, mlp_expert(64, 64), num_experts=2), MoE(48, mlp_expert(48, 64), num_experts=2)
    with pytest.raises(ValueError, match="hidden_size 48 .* multiple of 32"):
        ds_fp4.convert(torch.nn.Sequential(ok, bad))
    for layer in (ok, bad):
        assert type(layer) is MoE and not hasattr(layer.deepspeed_moe, "fp4_config")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_input_stays_non_finite(value):
    ref, fp4 = _pair({}, 2, True, "bf16")
    x = _x("bf16")
    x[1, 4, 9] = value
    got = forward_backward(fp4, x, 1, _grad_out(x))
    want = forward_backward(ref, x, 1, _grad_out(x))
    pairs = [(got[0], want[0]), (got[2], want[2])] + [(got[3][n], want[3][n]) for n in want[3]]
    assert any((~b.isfinite()).any() for _, b in pairs)
    for a, b in pairs:
        assert not (~b.isfinite() & a.isfinite()).any(), "a non-finite value became finite"


# ---- conversion keeps DeepSpeed's layer -----------------------------------------------

class _MyMoE(MoE):
    def extra_flag(self):
        return "kept"


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = MoE(HIDDEN, mlp_expert(HIDDEN, FFN), num_experts=2, k=1)
        self.b = torch.nn.ModuleList([_MyMoE(HIDDEN, mlp_expert(HIDDEN, FFN), num_experts=2)])
        self.c = FP4MoE(HIDDEN, mlp_expert(HIDDEN, FFN), num_experts=2,
                        fp4_config=dict(cache="fp8"))


def test_convert_in_place_keeps_parameters_and_names():
    net = _Net()
    params = dict(net.named_parameters())
    keys = list(net.state_dict())
    assert ds_fp4.convert(net, os.path.join(EXAMPLES, "fp4_moe.json")) is net
    assert isinstance(net.a, FP4MoE) and isinstance(net.b[0], FP4MoE)
    assert isinstance(net.b[0], _MyMoE) and net.b[0].extra_flag() == "kept"
    assert net.a.fp4_config.cache == "mxfp4" and net.c.fp4_config.cache == "fp8"  # explicit kept
    assert list(net.state_dict()) == keys
    assert all(p is params[n] for n, p in net.named_parameters())
    assert type(net.a.deepspeed_moe.experts) is Experts


def test_fp4moe_has_deepspeed_names():
    torch.manual_seed(0)
    a = MoE(HIDDEN, mlp_expert(HIDDEN, FFN), num_experts=4, k=2)
    torch.manual_seed(0)
    b = FP4MoE(HIDDEN, mlp_expert(HIDDEN, FFN), num_experts=4, k=2)
    assert list(a.state_dict()) == list(b.state_dict())
    assert all(torch.equal(v, b.state_dict()[n]) for n, v in a.state_dict().items())


def test_initialize_rejects_a_bad_section_before_deepspeed():
    with open(os.path.join(EXAMPLES, "fp4_moe.json")) as f:
        cfg = json.load(f)
    cfg["fp4_moe"]["dispach"] = "mxfp4"
    with pytest.raises(ValueError, match=r"fp4_moe\.dispach: unknown key"):
        ds_fp4.initialize(model=_Net(), config=cfg)


# ---- FP8 experts selection ------------------------------------------------------------

def test_fp8_experts_true_needs_swiglu_experts():
    with pytest.raises(ValueError, match="fp4_moe.fp8_experts = true but the experts are not"):
        FP4MoE(HIDDEN, mlp_expert(HIDDEN, FFN), num_experts=2, fp4_config=dict(fp8_experts=True))


def test_fp8_experts_auto_keeps_deepspeed_experts_on_cpu():
    pytest.importorskip("ds_fp4.moe.fp8_experts")
    from ds_fp4.moe import SwiGLUExpert
    layer = FP4MoE(HIDDEN, SwiGLUExpert(HIDDEN, FFN), num_experts=2)
    layer(_x())
    assert type(layer.deepspeed_moe.experts) is Experts


def test_fp8_experts_swap_keeps_parameters_and_can_be_undone():
    pytest.importorskip("ds_fp4.moe.fp8_experts")
    from ds_fp4.moe import FP8Experts, SwiGLUExpert
    ref, fp4 = _pair(dict(fp8_experts=True), 2, True, "bf16",
                     expert=SwiGLUExpert(HIDDEN, FFN))
    params = dict(fp4.named_parameters())
    x = _x("bf16")
    got = forward_backward(fp4, x, 1, _grad_out(x))
    assert isinstance(fp4.deepspeed_moe.experts, FP8Experts)
    assert all(p is params[n] for n, p in fp4.named_parameters())
    want = forward_backward(ref, x, 1, _grad_out(x))
    assert rel_err(got[0], want[0]) < 0.1  # FP8 GEMMs (dequantized on CPU), bf16 model
    to_fp4(fp4, dict(fp8_experts=False))
    assert type(fp4.deepspeed_moe.experts) is Experts
    assert all(p is params[n] for n, p in fp4.named_parameters())


def _watch_fp8_experts(monkeypatch):
    """``(seen, encoded)``: FP8Experts' ``(used, gather)`` per forward and the encodes'
    results (either kind) of the layer's forwards."""
    from ds_fp4.moe import routing
    seen, encoded = [], []
    real = FP8Experts.forward

    def forward(self, x, rows=None, used=None, gather=None):
        tokens = None if gather is None else gather.tokens
        seen.append((used, gather, x.stride(), tokens))
        return real(self, x, rows, used, gather)
    monkeypatch.setattr(FP8Experts, "forward", forward)
    for name in ("encode", "encode_gathered"):
        monkeypatch.setattr(routing, name, lambda *a, real_encode=getattr(routing, name):
                            encoded.append(real_encode(*a)) or encoded[-1])
    return seen, encoded


def test_fp8_experts_get_each_experts_used_slots_at_ep1(monkeypatch):
    """At EP 1 the layer hands its FP8 experts the encode's used slots of this step's routes
    (the grouped GEMMs skip the capacity padding past it) and its slots' source tokens: the
    experts read the tokens' rows in place, no slot buffer is made (their input is the
    encode's stride-0 placeholder)."""
    from ds_fp4.moe import SwiGLUExpert
    seen, encoded = _watch_fp8_experts(monkeypatch)
    _, fp4 = _pair(dict(fp8_experts=True), 2, True, "bf16", expert=SwiGLUExpert(HIDDEN, FFN))
    x = _x("bf16")
    forward_backward(fp4, x, 1, _grad_out(x))
    assert len(seen) == len(encoded) == 1
    (used, gather, stride, tokens), (_, _, encoded_used, source) = seen[0], encoded[0]
    assert used is encoded_used and gather.source is source and stride == (0, 0, 0, 0)
    assert torch.equal(tokens, x.reshape(-1, HIDDEN))
    assert gather.tokens is None     # dropped once read: the backward keeps no input copy


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_hopper)])
@pytest.mark.parametrize("cache", ["mxfp4", "fp8", "bf16"])
def test_gathered_experts_input_changes_no_bit(monkeypatch, cache, device):
    """The experts reading the tokens through the slots' source map compute what they
    compute from the slot buffer, bit for bit (outputs, the input's and every parameter's
    gradients), for each cache format; a bf16 cache takes the slot buffer. On a GPU with
    the kernels (the grouped GEMMs, the gathering quantizers, route_gate_grads)."""
    from ds_fp4 import ops
    from ds_fp4.moe import SwiGLUExpert
    seen, _ = _watch_fp8_experts(monkeypatch)
    gate_grads = []
    real = ops.route_gate_grads
    monkeypatch.setattr(ops, "route_gate_grads", lambda *a: gate_grads.append(1) or real(*a))
    # eager passes: CUDA graphs (expert_graphs auto, at this small size) keep the slot buffer
    _, fp4 = _pair(dict(fp8_experts=True, cache=cache, expert_graphs=False), 2, True, "bf16",
                   expert=SwiGLUExpert(HIDDEN, FFN))
    fp4 = fp4.to(device)
    x = _x("bf16", tokens=64).to(device)
    gathered = _run(fp4, x)
    monkeypatch.setattr(FP8Experts, "reads_gathered", lambda *a: False)
    materialized = _run(fp4, x)
    assert [g is not None for _, g, _, _ in seen] == [cache != "bf16", False]
    assert len(gate_grads) == (cache != "bf16")     # the backward took dy and the gates
    _assert_same(gathered, materialized)


def test_cache_rebuilds_an_input_saved_twice_once(monkeypatch):
    """A SwiGLU expert's gate and up both save its input: one decode serves both, and the
    gradients stay DeepSpeed's (inputs the format holds exactly)."""
    from ds_fp4.moe import cache as cache_module
    from ds_fp4.moe.expert import SwiGLUExpert
    num_experts = 4
    ref, fp4 = _pair(dict(cache="mxfp4", fp8_experts=False), 2, True, "fp32",
                     num_experts=num_experts, expert=SwiGLUExpert(HIDDEN, FFN))
    decoded = []
    real = cache_module.unpack_rows
    monkeypatch.setattr(cache_module, "unpack_rows",
                        lambda *a, **k: decoded.append(a[0].shape) or real(*a, **k))
    x = _representable("fp32")
    _assert_same(_run(fp4, x), _run_spec(ref, x, "mxfp4"))
    assert fp4.deepspeed_moe.cached_views == 2 * num_experts   # gate and up of each expert
    assert len(decoded) == num_experts   # (the decode reads its routes' FP8 rows itself)
