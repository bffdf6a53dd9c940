"""FP8 experts: the 128x128 weight quantizer and FP8Experts' forward/backward against a
float64 model of the same quantized computation.

CPU tests run the grouped GEMMs' float32 twins; the CUDA-marked tests run the Triton
kernels (Hopper) and compare them with the same references. The grouped GEMMs alone are
tested in test_grouped_gemm.py.
"""

import gc
import math
import os
import weakref

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")   # before deepspeed is imported
from deepspeed.moe.experts import Experts

from ds_fp4 import formats as F
from ds_fp4 import ops
from ds_fp4.ops import reference as R
from ds_fp4.moe.expert import SwiGLUExpert
from ds_fp4.moe.fp8_experts import FP8Experts, fp8_experts_supported
from ds_fp4.ops.fp8_tiles import (dequantize_fp8_tiles, quantize_fp8_tile_groups,
                                  quantize_fp8_tiles)
from ds_fp4.ops.grouped_gemm import grouped_fp8_supported

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_hopper = pytest.mark.skipif(not fp8_experts_supported(),
                                  reason="needs a Hopper GPU and Triton")


def rel(a, b):
    """Relative Frobenius error of ``a`` against ``b`` (float64)."""
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


# ---- float64 models ------------------------------------------------------------------------


def tiles_f64(w):
    """128x128 tile quantization by the FORMATS.md rule, via the reference's rule helpers;
    returns (bytes uint8 [N, K], scales float32 [N/128, K/128], dequantized float64)."""
    n, k = w.shape
    t = w.double().reshape(n // 128, 128, k // 128, 128)
    finite = torch.isfinite(t).all(dim=3).all(dim=1)
    amax = torch.where(torch.isfinite(t), t.abs(), 0).amax(dim=(1, 3))
    e = R.fp8_exponent(amax)
    data = R.e4m3_round(t * R.pow2(-e)[:, None, :, None]).view(torch.uint8).reshape(n, k)
    scales = torch.where(finite, R.pow2(e), math.nan).float()
    deq = (data.view(F.FP8_DTYPE).double().reshape(n // 128, 128, k // 128, 128)
           * scales.double()[:, None, :, None]).reshape(n, k)
    return data, scales, deq


def q1x128(x):
    """float64 value of FP8 1x128 quantization of ``x [M, K]`` (quantized from float32)."""
    return ops.dequantize_fp8(*ops.quantize_fp8(x.float()), torch.float32).double()


def q_colwise(x, padded):
    """float64 value of the FP8 1x128 quantization of x's zero-padded transpose ``[K, P]``."""
    xt = torch.zeros(x.shape[1], padded, dtype=torch.float64)
    xt[:, :x.shape[0]] = x.t()
    return q1x128(xt)


def act_f64(z, activation):
    if activation == "swiglu":
        g, u = z.chunk(2, dim=-1)
        return g * torch.sigmoid(g) * u
    return 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))


def act_grad_f64(z, dh, activation):
    if activation == "swiglu":
        g, u = z.chunk(2, dim=-1)
        s = torch.sigmoid(g)
        return torch.cat((dh * u * s * (1 + g * (1 - s)), dh * g * s), dim=-1)
    pdf = torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    return dh * (0.5 * (1 + torch.erf(z / math.sqrt(2))) + z * pdf)


def cache_f64(z, cache):
    if cache == "mxfp4":
        return ops.dequantize_mxfp4_rows(ops.quantize_mxfp4_rows(z.float()), torch.float32).double()
    if cache == "fp8":
        return ops.dequantize_fp8_rows(ops.quantize_fp8_rows(z.float()), torch.float32).double()
    return z.to(torch.bfloat16).double()


def model_experts(experts, inputs, rows, dy, cache):
    """The FP8 experts' quantized computation with float64 arithmetic.

    The computation is specified with its formats: FP8/MXFP4 quantization at fixed points
    and bf16 GEMM outputs and activations. This model keeps every one of those roundings
    (``r`` marks the bf16 ones) and does all arithmetic, the GEMMs' sums included, in
    float64. Dropping the bf16 roundings would not give a better reference, only a different
    one: a 2^-9 shift of z moves ~3% of the FP8-quantized activations to a neighbouring
    E4M3 value, which alone differs from the specified computation by ~1.7%.
    Returns (y, dx, [grads of each expert's parameters, in ``parameters()`` order]).
    """
    r = lambda t: t.to(torch.bfloat16).double()
    ep, n, cap, hidden = inputs.shape
    tokens = ep * cap
    padded = -(-tokens // 128) * 128
    ys, dxs, grads = [], [], []
    for e, ex in enumerate(experts.deepspeed_experts):
        first = [ex.gate, ex.up] if ex.activation == "swiglu" else [ex.up]
        w1 = tiles_f64(torch.cat([l.weight.detach() for l in first]))[2]
        w2 = tiles_f64(ex.down.weight.detach())[2]
        b1 = torch.cat([l.bias.detach() for l in first]).double() if ex.up.bias is not None else 0
        b2 = ex.down.bias.detach().double() if ex.up.bias is not None else 0
        if rows is not None:
            x_val = ops.dequantize_mxfp4_rows(rows[:, e].reshape(tokens, -1), torch.float32).double()
            xq, xcol = q1x128(x_val), q_colwise(x_val, padded)
        else:
            x = inputs[:, e].reshape(tokens, hidden).detach()
            xq = q1x128(x)
            kept = {"mxfp4": lambda: ops.dequantize_mxfp4_rows(ops.quantize_mxfp4_rows(x),
                                                               torch.float32).double(),
                    "fp8": lambda: xq,
                    "bf16": lambda: x.to(torch.bfloat16).double()}[cache]()
            xcol = q_colwise(kept, padded)
        z = r(r(xq @ w1.t()) + (r(b1) if torch.is_tensor(b1) else 0))
        zc = cache_f64(z, cache)
        h = r(act_f64(zc if cache == "fp8" else z, ex.activation))  # an FP8 copy feeds h
        y = r(r(q1x128(h) @ w2.t()) + (r(b2) if torch.is_tensor(b2) else 0))
        ys.append(y.view(ep, cap, hidden))
        d = dy[:, e].reshape(tokens, hidden).double()
        hc = r(act_f64(zc, ex.activation))
        dz = r(act_grad_f64(zc, r(q1x128(d) @ w2), ex.activation))
        dxs.append(r(q1x128(dz) @ w1).view(ep, cap, hidden))
        # the grouped weight-gradient GEMM writes the parameters' dtype (bf16 or float32)
        rw = lambda t: t.to(ex.up.weight.dtype).double()  # noqa: E731
        dw1 = rw(q_colwise(dz, padded) @ xcol.t())
        dw2 = rw(q_colwise(d, padded) @ q_colwise(hc, padded).t())
        wgrads = list(dw1.chunk(len(first))) + [dw2]
        bgrads = list(dz.sum(0).chunk(len(first))) + [d.sum(0)]
        grads.append([g for w, b in zip(wgrads, bgrads)      # ex.parameters() order
                      for g in ((w, b) if ex.up.bias is not None else (w,))])
    return torch.stack(ys, 1), torch.stack(dxs, 1), grads


# ---- helpers ---------------------------------------------------------------------------------


def make_experts(hidden, ffn, n_local, activation="swiglu", bias=False, seed=0):
    torch.manual_seed(seed)
    experts = Experts(SwiGLUExpert(hidden, ffn, activation=activation, bias=bias), n_local)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, hidden ** -0.5)
    return experts


def make_inputs(ep, n_local, cap, hidden, counts=None, seed=1, dtype=torch.bfloat16):
    """[ep, n_local, C, hidden]; with ``counts``, expert e's slots beyond counts[e] are zero
    padding (counted over the ep*C slots of expert e, ep-major as DeepSpeed lays them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ep, n_local, cap, hidden, generator=g).to(dtype)
    if counts is not None:
        slots = x.transpose(0, 1).reshape(n_local, ep * cap, hidden)
        for e, c in enumerate(counts):
            slots[e, c:] = 0
        x = slots.reshape(n_local, ep, cap, hidden).transpose(0, 1).contiguous()
    return x


def run_fp8(experts, x, dy, cache, with_rows, device="cpu", **kw):
    """FP8Experts fwd+bwd on ``device`` (``kw``: more ``from_experts`` arguments); returns
    (y, dx, grads per expert, rows or None)."""
    fp8 = FP8Experts.from_experts(experts.to(device), cache=cache, **kw)
    for p in experts.parameters():
        p.grad = None
    xin = x.to(device).clone().requires_grad_(True)
    rows = ops.quantize_mxfp4_rows(xin.detach()) if with_rows else None
    y = fp8(xin, rows)
    y.backward(dy.to(device))
    grads = [[p.grad.cpu() for p in ex.parameters()] for ex in experts.deepspeed_experts]
    return y.detach().cpu(), xin.grad.cpu(), grads, (rows.cpu() if rows is not None else None)


def assert_close_all(got, want, tol):
    (y, dx, grads), (y_ref, dx_ref, grads_ref) = got, want
    errors = {"y": rel(y, y_ref), "dx": rel(dx, dx_ref)}
    for e, (gs, rs) in enumerate(zip(grads, grads_ref)):
        for i, (g, ref) in enumerate(zip(gs, rs)):
            if ref.abs().max() > 0:
                errors[f"grad[{e}][{i}]"] = rel(g, ref)
            else:
                assert g.abs().max() == 0, f"grad[{e}][{i}] must be zero"
    bad = {k: v for k, v in errors.items() if not v < tol}
    assert not bad, f"relative errors above {tol}: {bad}"
    return errors


# ---- 128x128 weight tiles ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_tiles_match_rule(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(384, 256, generator=g)
    w[:128, :128] *= 1e-30 if dtype != torch.float16 else 1e-3    # tiny tile
    w[128:256, 128:] *= 3e4 if dtype != torch.float16 else 1e2    # large tile
    w[256:, :128] = 0                                             # zero tile
    w = w.to(dtype)
    data, scales = quantize_fp8_tiles(w)
    want_data, want_scales, want = tiles_f64(w)
    assert torch.equal(data.view(torch.uint8), want_data)
    assert torch.equal(scales, want_scales)
    assert scales[2, 0] == 1.0
    assert torch.equal(dequantize_fp8_tiles(data, scales, torch.float64), want)


def test_tiles_scale_boundaries():
    w = torch.zeros(128, 512)
    w[0, 0] = 448.0               # exactly 448 * 2^0 -> scale 1
    w[0, 128] = 448.0 * 1.0078125  # just above -> scale 2
    w[0, 256] = 2.0 ** -140       # below 448 * 2^-126 -> exponent clamped at -126
    w[0, 384] = -448.0 * 2 ** 10
    _, scales = quantize_fp8_tiles(w)
    assert scales.tolist() == [[1.0, 2.0, 2.0 ** -126, 2.0 ** 10]]


def test_tiles_nan_and_inf_stay_non_finite():
    w = torch.randn(256, 256)
    w[5, 7] = math.nan
    w[200, 130] = -math.inf
    data, scales = quantize_fp8_tiles(w)
    assert torch.isnan(scales[0, 0]) and torch.isnan(scales[1, 1])
    assert torch.isfinite(scales[0, 1]) and torch.isfinite(scales[1, 0])
    deq = dequantize_fp8_tiles(data, scales)
    assert torch.isnan(deq[:128, :128]).all() and torch.isnan(deq[128:, 128:]).all()
    assert torch.isfinite(deq[:128, 128:]).all()


def test_tiles_stacked_and_transposed():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(256, 384, generator=g), 5 * torch.randn(128, 384, generator=g)
    data, scales = quantize_fp8_tiles(a, b)
    cat_data, cat_scales = quantize_fp8_tiles(torch.cat((a, b)))
    assert torch.equal(data.view(torch.uint8), cat_data.view(torch.uint8))
    assert torch.equal(scales, cat_scales)
    tdata, tscales = quantize_fp8_tiles(a, b, transpose=True)
    assert tdata.is_contiguous() and tscales.is_contiguous()
    assert torch.equal(tdata.view(torch.uint8), cat_data.view(torch.uint8).t())
    assert torch.equal(tscales, cat_scales.t())


def test_tile_groups_equal_separate_calls():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(256, 384, generator=g), torch.randn(128, 384, generator=g) * 1e-3
    c = torch.randn(384, 128, generator=g).to(torch.bfloat16)
    for transpose in (False, True):
        grouped = quantize_fp8_tile_groups([(a, b), (c,)], transpose=transpose)
        for (data, scales), group in zip(grouped, [(a, b), (c,)]):
            want_data, want_scales = quantize_fp8_tiles(*group, transpose=transpose)
            assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
            assert torch.equal(scales, want_scales)


@pytest.mark.parametrize("bad, match", [
    ((torch.randn(100, 128),), "multiple of 128"),
    ((torch.randn(128, 200),), "multiple of 128"),
    ((torch.randn(128, 128), torch.randn(128, 256)), "share K"),
    ((torch.randn(128, 128).to(torch.int32),), "dtype"),
])
def test_tiles_reject_bad_weights(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        quantize_fp8_tiles(*bad)


# ---- GEMM wrappers (CPU: dequantized operands) -------------------------------------------------


# ---- FP8Experts against the float64 model -----------------------------------------------------


@pytest.mark.parametrize("cache", ["mxfp4", "fp8", "bf16"])
@pytest.mark.parametrize("with_rows", [True, False])
def test_experts_match_float64_model(cache, with_rows):
    experts = make_experts(2048, 256, n_local=2)
    x = make_inputs(1, 2, 300, 2048)
    dy = make_inputs(1, 2, 300, 2048, seed=2)
    y, dx, grads, rows = run_fp8(experts, x, dy, cache, with_rows)
    want = model_experts(experts, x, rows, dy, cache)
    assert_close_all((y, dx, grads), want, tol=1e-2)


@pytest.mark.parametrize("with_rows", [True, False])
def test_activation_cache_keeps_z_alone(with_rows):
    """activation_cache fp8 beside cache mxfp4: z is kept as the fp8 cache keeps it, x as
    the mxfp4 cache does. What reads z only (the input gradient, the down weights'
    gradient) equals cache fp8's bit for bit. The gate/up weights' gradients read x too:
    they equal cache fp8's when x arrived as rows (kept as they are under any cache) and
    differ from them without rows."""
    experts = make_experts(256, 256, n_local=2)
    x, dy = make_inputs(1, 2, 200, 256), make_inputs(1, 2, 200, 256, seed=2)
    y, dx, grads, _ = run_fp8(experts, x, dy, "mxfp4", with_rows, activation_cache="fp8")
    y8, dx8, grads8, _ = run_fp8(experts, x, dy, "fp8", with_rows)
    assert torch.equal(y, y8) and torch.equal(dx, dx8)
    for (gate, up, down), (gate8, up8, down8) in zip(grads, grads8):
        assert torch.equal(down, down8)
        assert torch.equal(gate, gate8) == with_rows and torch.equal(up, up8) == with_rows
    _, dx4, _, _ = run_fp8(experts, x, dy, "mxfp4", with_rows)
    assert not torch.equal(dx, dx4)          # z's MXFP4 copy moves the input gradient


def test_forward_reads_z_copy_only_in_fp8():
    """h comes from z's FP8 copy (the z the backward reads), never from an MXFP4 one: without
    rows x's FP8 operand is the same under every cache, so only the fp8 output moves."""
    experts = make_experts(256, 256, n_local=2)
    x, dy = make_inputs(1, 2, 200, 256), make_inputs(1, 2, 200, 256, seed=2)
    ys = {cache: run_fp8(experts, x, dy, cache, False)[0] for cache in ("bf16", "mxfp4", "fp8")}
    assert torch.equal(ys["mxfp4"], ys["bf16"])
    assert not torch.equal(ys["fp8"], ys["bf16"])
    y_z8 = run_fp8(experts, x, dy, "mxfp4", False, activation_cache="fp8")[0]
    assert torch.equal(y_z8, ys["fp8"])


@pytest.mark.parametrize("cap", [0, 1, 128, 300])
def test_experts_token_counts(cap):
    # ep = 2: expert e's segment is the 2 * C slots of both ranks (ragged, not 128-aligned).
    experts = make_experts(2048, 128, n_local=2, seed=cap)
    x = make_inputs(2, 2, cap, 2048, seed=cap)
    dy = make_inputs(2, 2, cap, 2048, seed=cap + 7)
    y, dx, grads, rows = run_fp8(experts, x, dy, "mxfp4", with_rows=True)
    assert y.shape == dx.shape == x.shape
    if cap == 0:
        assert all(g.abs().max() == 0 for gs in grads for g in gs)
        return
    want = model_experts(experts, x, rows, dy, "mxfp4")
    assert_close_all((y, dx, grads), want, tol=1e-2)


def test_experts_capacity_padding():
    # 4 experts, C = 300 slots, of which 0, 1, 128 and 300 hold tokens; the rest are zeros.
    counts = [0, 1, 128, 300]
    experts = make_experts(2048, 128, n_local=4, seed=5)
    x = make_inputs(1, 4, 300, 2048, counts=counts)
    dy = make_inputs(1, 4, 300, 2048, counts=counts, seed=8)
    y, dx, grads, rows = run_fp8(experts, x, dy, "mxfp4", with_rows=True)
    assert y[0, 0].abs().max() == 0 and y[0, 1, 1:].abs().max() == 0
    assert all(g.abs().max() == 0 for g in grads[0])     # expert 0 saw no token
    want = model_experts(experts, x, rows, dy, "mxfp4")
    assert_close_all((y, dx, grads), want, tol=1e-2)


@pytest.mark.parametrize("activation, bias", [("gelu", False), ("swiglu", True), ("gelu", True)])
def test_experts_gelu_and_bias(activation, bias):
    experts = make_experts(256, 256, n_local=2, activation=activation, bias=bias)
    with torch.no_grad():
        for ex in experts.deepspeed_experts:
            for layer in ex.children():
                if layer.bias is not None:
                    layer.bias.normal_(0, 0.5)
    x = make_inputs(2, 2, 100, 256, dtype=torch.float32)
    dy = make_inputs(2, 2, 100, 256, seed=4, dtype=torch.float32)
    y, dx, grads, rows = run_fp8(experts, x, dy, "fp8", with_rows=False)
    assert y.dtype == dx.dtype == torch.float32
    assert_close_all((y, dx, grads), model_experts(experts, x, rows, dy, "fp8"), tol=1e-2)


def test_experts_exactly_representable_operands():
    # Inputs on the MXFP4 grid (the rows), weights on their FP8 tile grid: only float32-vs-
    # float64 accumulation separates the two (through the bf16 roundings it can flip).
    experts = make_experts(2048, 256, n_local=2, seed=11)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(dequantize_fp8_tiles(*quantize_fp8_tiles(p)))
    x = make_inputs(1, 2, 128, 2048, seed=12)
    dy = make_inputs(1, 2, 128, 2048, seed=13)
    y, dx, grads, rows = run_fp8(experts, x, dy, "bf16", with_rows=True)
    errors = assert_close_all((y, dx, grads), model_experts(experts, x, rows, dy, "bf16"),
                              tol=1e-3)
    assert errors["y"] < 1e-4, errors


def test_experts_hidden_7168():
    experts = make_experts(7168, 128, n_local=1, seed=21)
    x = make_inputs(1, 1, 128, 7168, seed=22)
    dy = make_inputs(1, 1, 128, 7168, seed=23)
    y, dx, grads, rows = run_fp8(experts, x, dy, "mxfp4", with_rows=True)
    assert_close_all((y, dx, grads), model_experts(experts, x, rows, dy, "mxfp4"), tol=1e-2)


@pytest.mark.parametrize("cache, tol_fwd, tol_bwd",
                         [("bf16", 0.08, 0.1), ("fp8", 0.08, 0.12), ("mxfp4", 0.08, 0.25)])
def test_experts_close_to_bf16_expert(cache, tol_fwd, tol_bwd):
    # Against DeepSpeed's Experts with bf16 SwiGLU experts on the same (dequantized) tokens:
    # what FP8 block scaling costs (E4M3 carries 3 mantissa bits: ~2-3% per operand).
    experts = make_experts(2048, 256, n_local=2, seed=31)
    x = make_inputs(1, 2, 256, 2048, seed=32)
    dy = make_inputs(1, 2, 256, 2048, seed=33)
    y, dx, grads, rows = run_fp8(experts, x, dy, cache, with_rows=True)
    ref = Experts(SwiGLUExpert(2048, 256), 2).to(torch.bfloat16)
    ref.load_state_dict(experts.state_dict())
    x_ref = ops.dequantize_mxfp4_rows(rows).requires_grad_(True)
    ref(x_ref).backward(dy)
    assert rel(y, ref(x_ref).detach()) < tol_fwd
    assert rel(dx, x_ref.grad) < tol_bwd
    for gs, ex in zip(grads, ref.deepspeed_experts):
        for g, p in zip(gs, ex.parameters()):
            assert rel(g, p.grad) < tol_bwd


# ---- the hand-off contract ------------------------------------------------------------------


def test_rows_only_are_read_and_kept():
    experts = make_experts(256, 128, n_local=2, seed=41)
    x = make_inputs(2, 2, 64, 256, seed=42)
    rows = ops.quantize_mxfp4_rows(x)
    fp8 = FP8Experts.from_experts(experts)
    # a stride-0 NaN placeholder: reading it would poison the output
    leaf = torch.full((), math.nan, dtype=torch.bfloat16, requires_grad=True)
    placeholder = leaf.expand(x.shape)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fp8(placeholder, rows)
    assert torch.isfinite(y).all()
    params = {p.data_ptr() for p in experts.parameters()}
    kept = [t for t in saved if t.data_ptr() not in params]
    assert any(t.data_ptr() == rows.data_ptr() for t in kept), "rows must be kept, not copied"
    assert not any(t.is_floating_point() and t.numel() >= x[:, 0].numel() for t in kept), \
        "no float copy of the expert input may be kept"
    # same result as feeding the real values with the same rows
    assert torch.equal(y, fp8(x.clone(), rows))
    y.float().sum().backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()


def test_from_experts_keeps_parameters_and_names():
    experts = make_experts(256, 128, n_local=3)
    fp8 = FP8Experts.from_experts(experts)
    assert [id(p) for p in fp8.parameters()] == [id(p) for p in experts.parameters()]
    assert list(fp8.state_dict()) == list(experts.state_dict())
    assert all(p.allreduce is False for p in fp8.parameters())
    x = make_inputs(1, 3, 8, 256, dtype=torch.float32).requires_grad_(True)
    fp8(x).sum().backward()
    assert all(p.grad is not None for p in experts.parameters())


def test_constructor_builds_like_experts():
    fp8 = FP8Experts(SwiGLUExpert(256, 128), num_local_experts=2, expert_group_name="ep_size_2")
    assert len(fp8.deepspeed_experts) == 2
    assert all(p.group_name == "ep_size_2" for p in fp8.parameters())


def test_bad_configurations_are_rejected():
    plain = Experts(torch.nn.Linear(256, 256), 2)
    with pytest.raises(TypeError, match="SwiGLUExpert"):
        FP8Experts.from_experts(plain)
    with pytest.raises(ValueError, match="multiple of 128"):
        FP8Experts.from_experts(Experts(SwiGLUExpert(256, 100), 1))
    with pytest.raises(ValueError, match="cache"):
        FP8Experts.from_experts(make_experts(256, 128, 1), cache="fp4")
    fp8 = FP8Experts.from_experts(make_experts(256, 128, 2))
    with pytest.raises(ValueError, match="n_local, hidden"):
        fp8(torch.zeros(1, 3, 4, 256))
    x = torch.zeros(1, 2, 4, 256)
    with pytest.raises(ValueError, match="rows must be uint8"):
        fp8(x, torch.zeros(1, 2, 4, 100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scale_rounding must be one of"):
        FP8Experts.from_experts(make_experts(256, 128, 1), scale_rounding="up")
    with pytest.raises(ValueError, match="kernels must be one of"):
        FP8Experts.from_experts(make_experts(256, 128, 1), kernels="fast")


def test_kernels_option_governs_both_passes(monkeypatch):
    """``kernels=`` (the layer's ``fp4_moe.kernels``) is the mode of every op the experts
    run, forward and backward, whatever the process setting."""
    from ds_fp4.moe import fp8_expert_passes as passes
    seen = []
    quant = passes.fp8_segments.segment_quant

    def recording(*args, **kwargs):
        seen.append(ops.get_kernels())
        return quant(*args, **kwargs)

    monkeypatch.setattr(passes.fp8_segments, "segment_quant", recording)
    experts = make_experts(256, 128, n_local=2, seed=81)
    x = make_inputs(1, 2, 16, 256, seed=82).requires_grad_(True)
    with ops.kernels("auto"):
        FP8Experts.from_experts(experts, kernels="reference")(x).sum().backward()
        assert ops.get_kernels() == "auto"
    assert len(seen) >= 4 and set(seen) == {"reference"}, seen


def test_supported_is_false_without_hopper():
    assert grouped_fp8_supported("cpu") is False
    if not torch.cuda.is_available():
        assert fp8_experts_supported() is False


@needs_cuda
def test_cuda_tiles_match_cpu():
    w = torch.randn(512, 768, dtype=torch.bfloat16) * 0.02
    w[0, 0] = math.nan
    for transpose in (False, True):
        dc, sc = quantize_fp8_tiles(w, transpose=transpose)
        dg, sg = quantize_fp8_tiles(w.cuda(), transpose=transpose)
        assert torch.equal(sg.cpu().nan_to_num(-1.0), sc.nan_to_num(-1.0))
        finite = ~dc.float().isnan()
        assert torch.equal(dg.cpu().view(torch.uint8)[finite], dc.view(torch.uint8)[finite])


@needs_cuda
@pytest.mark.parametrize("cache", ["mxfp4", "fp8"])
@pytest.mark.parametrize("with_rows", [True, False])
def test_cuda_experts_match_float64_model(cache, with_rows):
    experts = make_experts(2048, 256, n_local=2, seed=51).to(torch.bfloat16)
    x = make_inputs(2, 2, 150, 2048, seed=52)
    dy = make_inputs(2, 2, 150, 2048, seed=53)
    y, dx, grads, rows = run_fp8(experts, x, dy, cache, with_rows, device="cuda")
    experts.cpu()
    want = model_experts(experts, x, rows, dy, cache)
    assert rel(y, want[0]) < 1e-2
    # The tensor-core sums differ from float64 by ~1e-4 (see above); re-quantizing z onto
    # the MXFP4 grid (steps up to half a value) turns the few elements this moves across a
    # rounding boundary into full steps: 1.3e-2 was measured on one weight gradient.
    assert_close_all((y, dx, grads), want, tol=3e-2 if cache == "mxfp4" else 1e-2)


def _run_used(experts, x, dy, used):
    fp8 = FP8Experts.from_experts(experts, cache="mxfp4")
    for p in experts.parameters():
        p.grad = None
    xin = x.clone().requires_grad_(True)
    y = fp8(xin, used=used)
    y.backward(dy)
    return [y.detach(), xin.grad] + [p.grad.clone() for p in experts.parameters()]


@needs_hopper
@pytest.mark.parametrize("cap", [640, 1280])
def test_cuda_used_slots_skip_the_padding_with_the_same_bytes(cap):
    """``used``: each expert's slots past it are zero rows; the grouped GEMMs skip their
    tiles (and, past 8 K blocks, the weight gradients' K blocks) with every output and
    gradient unchanged bit for bit. A count below the data changes them (the check can
    fail)."""
    counts = [0, 1, 300, cap]
    experts = make_experts(1024, 256, n_local=4, seed=71).to("cuda", torch.bfloat16)
    x = make_inputs(1, 4, cap, 1024, counts=counts, seed=72).cuda()
    dy = make_inputs(1, 4, cap, 1024, counts=counts, seed=73).cuda()
    want = _run_used(experts, x, dy, None)
    got = _run_used(experts, x, dy, torch.tensor(counts, device="cuda"))
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {i}: max diff {(a.float() - b.float()).abs().max()}"
    short = _run_used(experts, x, dy, torch.tensor([0, 1, 100, cap], device="cuda"))
    assert not torch.equal(short[0], want[0]) and not torch.equal(short[8], want[8])


def test_used_is_checked_and_ignored_where_it_cannot_hold():
    experts = make_experts(256, 128, n_local=2, seed=74, bias=True)
    fp8 = FP8Experts.from_experts(experts)
    x = make_inputs(1, 2, 40, 256, seed=75, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"used must be 1-D with n_local = 2 entries"):
        fp8(x, used=torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="used must have dtype int32, int64"):
        fp8(x, used=torch.tensor([1.0, 2.0]))
    # with bias a zero row's output is not zero: ``used`` is not passed on (same result)
    assert torch.equal(fp8(x, used=torch.tensor([0, 0])), fp8(x))


@pytest.mark.parametrize("activation, bias", [("swiglu", False), ("swiglu", True),
                                              ("gelu", False), ("gelu", True)])
def test_expert_params_are_the_layers_own(activation, bias):
    """The parameters read from the modules' dicts are those their attributes give, in the
    passes' order (weights gate/up/down, then biases); a parametrized weight (not in the
    dict) is its attribute's value."""
    import torch.nn.utils.parametrize as parametrize
    from ds_fp4.moe.fp8_experts import _expert_params
    expert = SwiGLUExpert(256, 128, activation=activation, bias=bias)
    names = (["gate"] if activation == "swiglu" else []) + ["up", "down"]
    want = [getattr(expert, n).weight for n in names]
    want += [getattr(expert, n).bias for n in names] if bias else []
    got = _expert_params(expert)
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want))

    class Negated(torch.nn.Module):
        def forward(self, w):
            return -w
    parametrize.register_parametrization(expert.up, "weight", Negated())
    got = _expert_params(expert)
    assert torch.equal(got[names.index("up")], -expert.up.parametrizations.weight.original)


# ---- CUDA graphs of the passes (fp4_moe.expert_graphs) ---------------------------------------


def _steps(module, experts, inputs, dys, with_rows):
    """fwd+bwd of ``module`` for each (x, dy): the outputs, input and parameter gradients."""
    results = []
    for x, dy in zip(inputs, dys):
        for p in experts.parameters():
            p.grad = None
        xin = x.clone().requires_grad_(True)
        y = module(xin, ops.quantize_mxfp4_rows(xin.detach()) if with_rows else None)
        y.backward(dy)
        results.append([y.detach(), xin.grad] + [p.grad.clone() for p in experts.parameters()])
    return results


def test_graphs_option_runs_eagerly_on_cpu():
    experts = make_experts(256, 128, n_local=2, seed=61).to(torch.bfloat16)
    x, dy = make_inputs(1, 2, 40, 256, seed=62), make_inputs(1, 2, 40, 256, seed=63)
    graphed = FP8Experts.from_experts(experts, graphs=True)
    eager = FP8Experts.from_experts(experts, graphs=False)
    got = _steps(graphed, experts, [x], [dy], False)[0]
    want = _steps(eager, experts, [x], [dy], False)[0]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert graphed.graphs.captures == 0 and eager.graphs is None
    with pytest.raises(ValueError, match="graphs must be true, false or"):
        FP8Experts.from_experts(experts, graphs="yes")


def test_graphs_auto_rule_takes_small_gemms_only():
    from ds_fp4.moe.expert_graphs import AUTO_MAX_GEMM_FLOP, ExpertGraphs
    small = ExpertGraphs(auto=True, hidden=1024, ffn=1024)    # bench "small": 5.4 GFLOP
    large = ExpertGraphs(auto=True, hidden=4096, ffn=2048)    # bench "h4096": 43 GFLOP
    assert small.worth_capturing((2, 4, 1280, 1024))
    assert not large.worth_capturing((2, 8, 1280, 4096))
    edge = AUTO_MAX_GEMM_FLOP // (2 * 1024 * 1024)            # tokens at the limit
    assert small.worth_capturing((1, 4, edge, 1024))
    assert not small.worth_capturing((1, 4, edge + 1, 1024))
    # what FP8Experts asks before handing a pass to the graphs: only auto's size rule says no
    assert small.may_capture((1, 4, edge, 1024)) and not large.may_capture((2, 8, 1280, 4096))
    assert ExpertGraphs(auto=False, hidden=4096, ffn=2048).may_capture((2, 8, 1280, 4096))


@needs_hopper
@pytest.mark.parametrize("with_rows, cache", [(True, "mxfp4"), (False, "mxfp4"), (False, "fp8")])
def test_cuda_graphs_equal_eager_bit_for_bit(with_rows, cache):
    experts = make_experts(1024, 256, n_local=2, seed=64).to("cuda", torch.bfloat16)
    xs = [make_inputs(2, 2, 160, 1024, seed=s).cuda() for s in (65, 66, 67, 68)]
    dys = [make_inputs(2, 2, 160, 1024, seed=s).cuda() for s in (69, 70, 71, 72)]
    graphed = FP8Experts.from_experts(experts, cache=cache, graphs=True)
    eager = FP8Experts.from_experts(experts, cache=cache)
    got = _steps(graphed, experts, xs, dys, with_rows)
    want = _steps(eager, experts, xs, dys, with_rows)
    # step 1 eager, step 2 captures forward and backward, steps 3-4 replay them
    assert graphed.graphs.captures == 2 and graphed.graphs.disabled is None
    for step, (g, w) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(g, w)):
            assert torch.equal(a, b), f"step {step}, output {i} differs from the eager pass"


@needs_hopper
def test_cuda_graphs_follow_moved_parameters():
    experts = make_experts(512, 256, n_local=2, seed=73).to("cuda", torch.bfloat16)
    xs = [make_inputs(1, 2, 128, 512, seed=s).cuda() for s in (74, 75, 76)]
    dys = [make_inputs(1, 2, 128, 512, seed=s).cuda() for s in (77, 78, 79)]
    graphed = FP8Experts.from_experts(experts, graphs=True)
    eager = FP8Experts.from_experts(experts)
    _steps(graphed, experts, xs[:2], dys[:2], True)
    with torch.no_grad():
        for p in experts.parameters():       # new storage and new values, as a reload would
            p.data = p.data * 0.5
    got = _steps(graphed, experts, xs[2:] * 3, dys[2:] * 3, True)
    want = _steps(eager, experts, xs[2:] * 3, dys[2:] * 3, True)
    assert graphed.graphs.captures == 2      # the weights are staged: the moved ones too
    for g, w in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(g, w))


def _interleaved(modules, experts_list, x, dy):
    """Both modules' forwards, then their backwards in reverse order (as two layers run):
    outputs, input and parameter gradients per module."""
    outs, xins = [], []
    for module, experts in zip(modules, experts_list):
        for p in experts.parameters():
            p.grad = None
        xins.append(x.clone().requires_grad_(True))
        outs.append(module(xins[-1]))
    for y in reversed(outs):
        y.backward(dy)
    return [[y.detach(), xin.grad] + [p.grad.clone() for p in experts.parameters()]
            for y, xin, experts in zip(outs, xins, experts_list)]


@needs_hopper
def test_cuda_graphs_shared_by_layers_equal_eager_bit_for_bit():
    """Two layers of the same sizes (other weights) replay one capture per pass, interleaved
    as a model runs them, and each equals its own eager pass."""
    experts = [make_experts(512, 256, n_local=2, seed=s).to("cuda", torch.bfloat16)
               for s in (80, 81)]
    graphed = [FP8Experts.from_experts(e, graphs=True) for e in experts]
    eager = [FP8Experts.from_experts(e) for e in experts]
    for step, seed in enumerate((82, 83, 84)):
        x = make_inputs(1, 2, 128, 512, seed=seed).cuda()
        dy = make_inputs(1, 2, 128, 512, seed=seed + 10).cuda()
        got = _interleaved(graphed, experts, x, dy)
        want = _interleaved(eager, experts, x, dy)
        for layer, (g, w) in enumerate(zip(got, want)):
            for i, (a, b) in enumerate(zip(g, w)):
                assert torch.equal(a, b), f"step {step}, layer {layer}, output {i} differs"
    assert sum(g.graphs.captures for g in graphed) == 2     # one capture per pass, shared


@needs_hopper
def test_cuda_graphs_capture_again_once_earlier_captures_are_gone():
    """Torch releases a graph pool with its last graph: a module made after every earlier
    capture is gone captures into a new pool (a capture into the released one fails)."""
    experts = make_experts(640, 384, n_local=2, seed=90).to("cuda", torch.bfloat16)
    xs = [make_inputs(1, 2, 128, 640, seed=s).cuda() for s in (91, 92, 93)]
    dys = [make_inputs(1, 2, 128, 640, seed=s).cuda() for s in (94, 95, 96)]
    want = _steps(FP8Experts.from_experts(experts), experts, xs, dys, True)
    for _ in range(2):
        graphed = FP8Experts.from_experts(experts, graphs=True)
        got = _steps(graphed, experts, xs, dys, True)
        assert graphed.graphs.captures == 2 and graphed.graphs.disabled is None
        for g, w in zip(got, want):
            assert all(torch.equal(a, b) for a, b in zip(g, w))
        del graphed
        gc.collect()


@needs_hopper
class _FakeCapture:
    """Stands in for a captured pass (CPU): records how it was made and replays ``fn``."""

    made = []

    def __init__(self, fn, args, staged, pool=None):
        if getattr(fn, "fails", False):
            raise RuntimeError("operation not permitted when stream is capturing")
        self.fn = fn
        _FakeCapture.made.append(staged)

    def run(self, args):
        return ["replayed", *self.fn(*args)]


@pytest.fixture
def fake_cuda(monkeypatch):
    """ExpertGraphs' CUDA calls on the CPU: no capture in progress, reserved memory that
    grows by ``state["grow"]`` bytes per capture."""
    from ds_fp4.moe import expert_graphs as G
    state = {"reserved": 0, "grow": 0}

    def reserved(device=None):
        return state["reserved"]

    def fake(*a, **k):
        state["reserved"] += state["grow"]
        return _FakeCapture(*a, **k)
    _FakeCapture.made = []
    monkeypatch.setattr(G, "_Captured", fake)
    monkeypatch.setattr(G, "_pool_bytes", {})
    monkeypatch.setattr(G, "_pool", lambda device: None)
    monkeypatch.setattr(G, "_shared", weakref.WeakValueDictionary())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", reserved)
    return G, state


def _forward_args(tokens=128, hidden=256):
    plan = ("plan",)
    inputs = torch.zeros(1, 2, tokens, hidden)
    rows = torch.zeros(1, 2, tokens, 8, dtype=torch.uint8)
    return (inputs, rows, plan, torch.zeros(4)), rows


def test_graphs_run_eager_then_capture_then_replay(fake_cuda):
    G, _ = fake_cuda
    graphs = G.ExpertGraphs()
    args, rows = _forward_args()
    calls = []

    def fn(*a):
        calls.append(a)
        return ["out"]
    assert graphs.forward(fn, args, rows) == ["out"]              # 1st: eager
    assert graphs.forward(fn, args, rows) == ["replayed", "out"]  # 2nd: captured, replayed
    assert graphs.forward(fn, args, rows) == ["replayed", "out"]  # 3rd: replayed
    assert graphs.captures == 1 and _FakeCapture.made == [(1, 3)]  # rows and weights
    other, rows2 = _forward_args(tokens=256)                      # a new shape: a new key
    graphs.forward(fn, other, rows2)
    assert graphs.captures == 1
    for tokens in range(1000, 1010 + G.MAX_UNCAPTURED):           # keys that never repeat
        graphs.forward(fn, *_forward_args(tokens=tokens))
    assert len(graphs._uncaptured) == G.MAX_UNCAPTURED and graphs.captures == 1


def test_graphs_auto_rule_and_pool_budget(fake_cuda):
    G, state = fake_cuda
    big = G.ExpertGraphs(auto=True, hidden=8192, ffn=8192)
    args, rows = _forward_args(tokens=2048)     # 2 * 2048 * 8192^2 FLOP: far above the limit
    for _ in range(3):
        assert big.forward(lambda *a: ["out"], args, rows) == ["out"]
    assert big.captures == 0
    state["grow"] = G.AUTO_MAX_POOL_BYTES      # the first capture spends the whole budget
    small = [G.ExpertGraphs(auto=True, hidden=256, ffn=256) for _ in range(2)]
    for graphs, tokens in zip(small, (128, 256)):     # two calls: two captures wanted
        args, rows = _forward_args(tokens)
        for _ in range(3):
            graphs.forward(lambda *a: ["out"], args, rows)
    assert [g.captures for g in small] == [1, 0]
    heavy = G.ExpertGraphs(auto=True, hidden=256, ffn=256)   # small GEMMs, big weights to copy
    inputs, rows, plan, _ = _forward_args(tokens=64)[0]
    weights = torch.zeros(G.AUTO_MAX_STAGED_BYTES // 4 + 1)
    G._pool_bytes.clear()                       # the budget is not what stops it
    for _ in range(3):
        heavy.forward(lambda *a: ["out"], (inputs, rows, plan, weights), rows)
    assert heavy.captures == 0
    forced = G.ExpertGraphs(auto=False)         # "true" ignores all limits
    args, rows = _forward_args(tokens=2048)
    for _ in range(2):
        forced.forward(lambda *a: ["out"], args, rows)
    assert forced.captures == 1


def test_graphs_turn_off_when_capture_fails_or_keys_churn(fake_cuda):
    G, _ = fake_cuda

    def failing(*a):
        return ["out"]
    failing.fails = True
    graphs = G.ExpertGraphs()
    args, rows = _forward_args()
    graphs.forward(failing, args, rows)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        assert graphs.forward(failing, args, rows) == ["out"]     # eager after the failure
    assert graphs.disabled is not None and graphs.captures == 0
    churn = G.ExpertGraphs()
    with pytest.warns(RuntimeWarning, match="keep changing"):
        for tokens in range(1, G.MAX_CAPTURES + 2):               # a new shape each time
            args, rows = _forward_args(tokens=tokens)
            for _ in range(2):
                churn.forward(lambda *a: ["out"], args, rows)
    assert churn.disabled is not None
    assert len(churn._graphs) <= 2 * G.MAX_GRAPHS


def test_modules_share_a_capture_of_the_same_call(fake_cuda):
    """A second module with the same call replays the first one's capture (its weights are
    staged in), a call that differs captures apart, and the capture lives as long as a
    module holds it."""
    G, _ = fake_cuda
    first, second = G.ExpertGraphs(), G.ExpertGraphs()
    fn = lambda *a: ["out"]  # noqa: E731
    args, rows = _forward_args()
    for _ in range(2):                                     # eager, then captured
        first.forward(fn, args, rows)
    theirs, _ = _forward_args()                            # other weights, same sizes
    assert second.forward(fn, theirs, rows) == ["replayed", "out"]   # no eager, no capture
    assert (first.captures, second.captures) == (1, 0) and len(_FakeCapture.made) == 1
    bigger, rows2 = _forward_args(tokens=256)
    for _ in range(2):
        second.forward(fn, bigger, rows2)
    assert second.captures == 1 and len(G._shared) == 2
    del first
    gc.collect()
    assert len(G._shared) == 2                            # the second module holds both
    del second
    gc.collect()
    assert len(G._shared) == 0


def test_only_eager_backward_passes_donate(fake_cuda):
    """The input's gradient may go into the output's buffer in an eager pass only: the
    captured pass (and its replays) gets ``how.donate`` off, and so does nothing else."""
    import dataclasses
    G, _ = fake_cuda

    @dataclasses.dataclass(frozen=True)
    class How:
        shape: tuple = (1, 2, 128, 256)
        plan: object = None
        donate: bool = True
    seen = []

    def fn(how, *tensors):
        seen.append(how.donate)
        return ["out"]
    args = (How(), torch.zeros(1, 2, 128, 256), torch.zeros(3))
    graphs = G.ExpertGraphs()
    for _ in range(3):                    # eager, captured and replayed, replayed
        graphs.backward(fn, args)
    assert seen == [True, False, False] and graphs.captures == 1
    seen.clear()
    heavy = (How(), torch.zeros(1, 2, 128, 256), torch.zeros(G.AUTO_MAX_STAGED_BYTES // 4))
    left_eager = G.ExpertGraphs(auto=True, hidden=256, ffn=256)
    for _ in range(3):                    # "auto" leaves it eager: it donates every time
        left_eager.backward(fn, heavy)
    assert seen == [True] * 3 and left_eager.captures == 0


def test_monitored_layers_capture_apart(fake_cuda):
    """Passes that add to a layer's exactness counters bake in their address: layers with
    counters of their own do not share a capture."""
    import dataclasses
    G, _ = fake_cuda

    @dataclasses.dataclass(frozen=True)
    class Plan:
        counts: object = dataclasses.field(default=None, compare=False)
    modules = [G.ExpertGraphs() for _ in range(2)]
    for module in modules:
        inputs, rows, _, w = _forward_args()[0]
        args = (inputs, rows, Plan(torch.zeros(3, dtype=torch.int64)), w)
        for _ in range(2):
            module.forward(lambda *a: ["out"], args, rows)
    assert [m.captures for m in modules] == [1, 1]


def test_captured_pass_returns_inputs_it_keeps_and_clones_the_rest(monkeypatch):
    """``_Captured.run``'s outputs (CPU, with a stand-in graph that replays nothing): an
    output that is a staged input is the caller's tensor, None stays None, and every other
    output is a copy, never the graph's own buffer."""
    import contextlib
    from ds_fp4.moe import expert_graphs as G

    class _Graph:
        def replay(self):
            pass
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    entry = G._Captured(lambda x, scale, rows: [x * scale, rows, None],
                        [torch.ones(3), 2.0, torch.zeros(2, dtype=torch.uint8)], (0, 2))
    x, rows = torch.full((3,), 5.0), torch.ones(2, dtype=torch.uint8)
    y, kept, nothing = entry.run([x, 2.0, rows])
    assert kept is rows and nothing is None
    assert y is not entry.outs[0] and torch.equal(y, entry.outs[0])
    assert torch.equal(entry.args[0], x)          # staged inputs were copied in


def test_captured_pass_copies_views_of_one_buffer_out_together(monkeypatch):
    """Outputs that tile one buffer (the weight gradients, views of stacked ones) come out
    as views of one fresh copy, with their shapes, strides and values; an output with gaps
    in its buffer is cloned alone; staged inputs of several dtypes are all copied in."""
    import contextlib
    from ds_fp4.moe import expert_graphs as G

    class _Graph:
        def replay(self):
            pass
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())

    def fn(x, rows):
        stacked = torch.arange(24.0).view(2, 3, 4) * x.sum()
        gappy = (torch.arange(10.0) + rows.sum())[::2]
        return [*stacked.unbind(0), gappy, x * 2]
    x, rows = torch.ones(3), torch.ones(2, dtype=torch.uint8)
    entry = G._Captured(fn, [x, rows], (0, 1))
    x2, rows2 = torch.full((3,), 2.0), torch.full((2,), 3, dtype=torch.uint8)
    outs = entry.run([x2, rows2])
    assert torch.equal(entry.args[0], x2) and torch.equal(entry.args[1], rows2)
    for j, (got, static) in enumerate(zip(outs, entry.outs)):
        assert torch.equal(got, static)
        assert got.untyped_storage().data_ptr() != static.untyped_storage().data_ptr()
        assert j in entry.single or got.stride() == static.stride()
    a, b, gappy, doubled = outs
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()   # one copy
    assert len(entry.spans) == 2 and entry.single == [2]     # the strided one on its own


def test_param_grads_convert_only_where_the_dtype_differs():
    """The backward hands a gradient back as is when it already has its parameter's dtype
    (no ``Tensor.to`` call per parameter), and converts it otherwise, in parameter order:
    each expert's weights, then its biases."""
    from ds_fp4.moe.fp8_expert_passes import _Plan, _param_grads
    plan = _Plan("swiglu", True, "mxfp4", "rceil", n_local=2, hidden=128, ffn=128)
    dws = [[torch.full((2, 2), 3.0 * e + i) for i in range(3)] for e in range(2)]
    dbs = [[torch.full((2,), 3.0 * e + i) for i in range(3)] for e in range(2)]
    meta = [torch.float32, torch.float16, torch.float32,
            torch.float32, torch.bfloat16, torch.float32] * 2
    got = _param_grads(dws, dbs, meta, plan)
    for e in range(2):
        for i in (0, 2):
            assert got[6 * e + i] is dws[e][i] and got[6 * e + 3 + i] is dbs[e][i]
        assert got[6 * e + 1].dtype == torch.float16 and got[6 * e + 4].dtype == torch.bfloat16
        assert torch.equal(got[6 * e + 1].float(), dws[e][1])
        assert torch.equal(got[6 * e + 4].float(), dbs[e][1])
    assert _param_grads(None, None, meta, plan) == [None] * 12
    bias_only = _param_grads(None, dbs, meta, plan)
    assert bias_only[:3] == [None] * 3 and bias_only[3] is dbs[0][0]
