"""ds_fp4.moe.gate_linear: DeepSpeed's float32 gate Linear as split bf16 GEMMs.

The split is exact; the logits and both gradients are float32 math up to the order of the
additions (compared with float64 against the bound float32's own Linear meets); the layer
with it routes as DeepSpeed's does. On a CPU ``_mm_f32`` computes in float32 (the products of
bf16 parts are exact there too); the CUDA case runs torch's bf16 GEMM with float32 output.
"""

import importlib

import pytest
import torch
from deepspeed.moe.sharded_moe import TopKGate

from ds_fp4.moe import gate_linear as GL
from ds_fp4.ops.split_bf16 import split3
from tests.dist_utils import cpu_env, forward_backward, make_moe, mlp_expert
from tests.test_fp8_experts import needs_cuda

cpu_env()
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def _wide_floats(n, seed=0):
    """float32 values over a wide exponent range, both signs, with zeros."""
    gen = torch.Generator().manual_seed(seed)
    mant = torch.rand(n, generator=gen) + 0.5
    expo = torch.randint(-60, 60, (n,), generator=gen).float()
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    t = sign * mant * torch.exp2(expo)
    t[::97] = 0.0
    return t


@pytest.mark.parametrize("device", DEVICES)
def test_split3_is_exact(device):
    t = _wide_floats(100_000).to(device)
    parts = split3(t)
    assert all(torch.equal(p.to(torch.bfloat16).float(), p) for p in parts)   # bf16 numbers
    assert torch.equal((parts[0] + parts[1]) + parts[2], t)
    assert not torch.equal(parts[0] + parts[1], t)   # the third part carries bits


def test_layouts_are_the_six_products_below_order_three():
    """d x's factor pairs (g_i, w_j) are the six with i + j <= 2, each once."""
    pairs = sorted(zip(GL.GRAD_FACTORS, GL.WEIGHT_FACTORS))
    assert pairs == sorted((i, j) for i in range(3) for j in range(3) if i + j <= 2)
    assert GL.GATE_PARTS == (0, 1, 2)


def _case(device, w_dtype=torch.float32, tokens=300, hidden=512, experts=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(experts, hidden, generator=gen) * hidden ** -0.5).to(device, w_dtype)
    g = torch.randn(tokens, experts, generator=gen).to(device)
    return x, w, g


def _run(x, w, g, linear):
    """``(logits, d w, d x)`` of ``linear(x, w)`` and the gradient ``g``."""
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = linear(x, w)
    out.backward(g)
    return out, w.grad, x.grad


def _deepspeed_linear(x, w):
    return torch.nn.functional.linear(x.float(), w.float())


def _within(got, exact, scale, bits):
    """Every element of ``got`` within ``2**-bits`` of its sum of magnitudes (``scale``) of
    ``exact``, plus half a step of ``got``'s dtype when that is bf16 (rounded once)."""
    rounding = exact.abs() * 2 ** -8 if got.dtype == torch.bfloat16 else 0
    return bool(((got.double() - exact).abs() <= scale * 2.0 ** -bits + rounding).all())


# Float32 accumulation: on a CPU the sums of float32's own Linear (~2**-25 of the sum of
# magnitudes here); the H200's tensor cores align products inside each MMA with truncation,
# measured 3-6x float32 SGEMM's error (2.7e-6 against 8e-7 absolute at K = 512): 2**-20 holds
# both with room, while two bf16 parts (16 significand bits) miss it by far.
ACCUMULATION_BITS = 20


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_float32_math_up_to_order(device, w_dtype):
    """Logits, d w and d x within float32 accumulation error of the exact values (d x, and
    d w of a bf16 weight, rounded once to bf16 from there)."""
    x, w, g = _case(device, w_dtype)
    logits, dw, dx = _run(x, w, g, GL._GateLinear.apply)
    x64, w64, g64 = x.double(), w.double(), g.double()
    assert _within(logits, x64 @ w64.t(), x64.abs() @ w64.abs().t(), ACCUMULATION_BITS)
    assert _within(dw, g64.t() @ x64, g64.abs().t() @ x64.abs(), ACCUMULATION_BITS)
    assert dw.dtype == w.dtype and dx.dtype == torch.bfloat16
    assert _within(dx, g64 @ w64, g64.abs() @ w64.abs(), ACCUMULATION_BITS)
    want = _run(x, w, g, _deepspeed_linear)[2]
    assert (dx != want).float().mean() < 1e-3        # DeepSpeed's d x but for rare last bits


def test_hidden_three_times_the_experts():
    """hidden == 3 * experts: the parts are summed along the right dimension each time."""
    x, w, g = _case("cpu", tokens=64, hidden=96, experts=32)
    logits, dw, _ = _run(x, w, g, GL._GateLinear.apply)
    x64, w64, g64 = x.double(), w.double(), g.double()
    assert _within(logits, x64 @ w64.t(), x64.abs() @ w64.abs().t(), ACCUMULATION_BITS)
    assert _within(dw, g64.t() @ x64, g64.abs().t() @ x64.abs(), ACCUMULATION_BITS)


def test_the_bound_fails_without_the_third_part(monkeypatch):
    """Two bf16 parts (16 significand bits) put the logits well past the bound."""
    x, w, g = _case("cpu")
    module = importlib.import_module("ds_fp4.ops.split_bf16")   # ops.split_bf16: the function
    monkeypatch.setattr(module, "split3", lambda t: (*split3(t)[:2], torch.zeros_like(t)))
    logits = _run(x, w, g, GL._GateLinear.apply)[0]
    x64, w64 = x.double(), w.double()
    assert not _within(logits, x64 @ w64.t(), x64.abs() @ w64.abs().t(), ACCUMULATION_BITS)


@pytest.mark.parametrize("w_dtype, forward, backward", [
    (torch.float32, [(3, 0)], [(9, 1), (6, 0)]), (torch.bfloat16, [], [(3, 1)])])
def test_a_bf16_weight_is_its_own_part(monkeypatch, w_dtype, forward, backward):
    """The splits each pass makes, as (parts, dim): a bf16 weight needs none of its own
    (one GEMM forward), and the logits' gradient is split once for both GEMMs."""
    calls = []
    real = GL.split_bf16
    monkeypatch.setattr(GL, "split_bf16",
                        lambda x, p, d: calls.append((len(p), d)) or real(x, p, d))
    x, w, g = _case("cpu", w_dtype, tokens=16, hidden=256, experts=4)
    x.requires_grad_(True)
    w.requires_grad_(True)
    logits = GL._GateLinear.apply(x, w)
    assert calls == forward
    calls.clear()
    logits.backward(g)
    assert sorted(calls, reverse=True) == backward


def _kept_shapes(x, w):
    """Shapes of what ``_GateLinear`` saves for its backward."""
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t,
                                                  lambda t: t):
        GL._GateLinear.apply(x, w)
    return shapes


def test_input_copy_kept_only_for_the_weight_gradient():
    """The input's copy is kept when w needs a gradient (which reads it), not otherwise."""
    x, w, _ = _case("cpu", tokens=16, hidden=256, experts=4)
    assert _kept_shapes(x.clone().requires_grad_(True), w) == [(4, 256)]
    assert sorted(_kept_shapes(x, w.clone().requires_grad_(True))) == [(4, 256), (16, 256)]


def test_applies_only_to_deepspeeds_gate_on_a_bf16_input(monkeypatch):
    gate = TopKGate(64, 4, k=2)
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert not GL.applies(gate, x)            # a CPU: DeepSpeed's gate as is
    monkeypatch.setattr(GL, "_on", lambda t: True)
    assert GL.applies(gate, x)
    assert not GL.applies(gate, x.float())    # float32 input: DeepSpeed's own math
    gate.noisy_gate_policy = "Jitter"
    assert not GL.applies(gate, x)            # jitter rescales the input first
    gate.eval()
    assert GL.applies(gate, x)                # ... in training only
    gate.noisy_gate_policy = None
    gate.wall_clock_breakdown = True
    assert not GL.applies(gate, x)            # DeepSpeed's gate timer

    class Mine(TopKGate):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)
    assert not GL.applies(Mine(64, 4, k=2), x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_layer_routes_as_deepspeed(device, k, monkeypatch):
    """FP4MoE with bf16 formats and the split gate against DeepSpeed's bf16 layer: the
    same routes (capacity, counts), outputs and gradients within float32 rounding of the
    logits carried through bf16."""
    from ds_fp4.moe import to_fp4
    monkeypatch.setattr(GL, "_on", lambda t: True)
    calls = []
    real = GL._GateLinear.apply
    monkeypatch.setattr(GL._GateLinear, "apply", lambda *a: calls.append(1) or real(*a))
    bf16 = dict(dispatch="bf16", combine="bf16", grad="bf16", cache="bf16", fp8_experts=False)
    kw = dict(hidden=128, num_experts=4, ep_size=1, k=k, parallel=False,
              expert=mlp_expert(128, 256))
    ref = make_moe(**kw).to(device, torch.bfloat16)
    fp4 = to_fp4(make_moe(**kw), bf16).to(device, torch.bfloat16)
    x = torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(3)).to(device,
                                                                                torch.bfloat16)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(device)
    got, want = forward_backward(fp4, x, 1, g), forward_backward(ref, x, 1, g)
    assert calls
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)       # l_aux, float32
    torch.testing.assert_close(got[2], want[2], rtol=2e-2, atol=2e-2)
    for name, grad in want[3].items():
        torch.testing.assert_close(got[3][name].float(), grad.float(), rtol=2e-2, atol=2e-3,
                                   msg=name)
    counts = fp4.deepspeed_moe.exp_counts, ref.deepspeed_moe.exp_counts
    assert torch.equal(*counts)
