"""The per-expert cuBLASLt GEMMs (ds_fp4.moe.fp8_gemm_loop) and FP8Experts' loop path:
torch's blockwise scaled_mm layout rules checked on CPU with a stand-in, and on a Hopper GPU
against float64 references."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")   # before deepspeed is imported

from ds_fp4 import ops
from ds_fp4.moe import fp8_expert_passes
from ds_fp4.moe.fp8_experts import fp8_experts_supported
from ds_fp4.ops.fp8_tiles import dequantize_fp8_tiles, quantize_fp8_tiles
from ds_fp4.moe.fp8_gemm_loop import gemm_fp8_nt_1x128_1x128, gemm_fp8_nt_1x128_128x128
from tests.test_fp8_experts import (assert_close_all, make_experts, make_inputs, model_experts,
                                   rel, run_fp8)

needs_hopper = pytest.mark.skipif(not fp8_experts_supported(),
                                  reason="needs a Hopper GPU and blockwise F.scaled_mm")


def representable_1x128(m, k, seed):
    """FP8 1x128 operands and their exact float64 values."""
    g = torch.Generator().manual_seed(seed)
    data, scales = ops.quantize_fp8(torch.randn(m, k, generator=g) * 4)
    return data, scales, ops.dequantize_fp8(data, scales, torch.float32).double()


@pytest.mark.parametrize("m", [0, 1, 128, 300])
def test_gemm_1x128_128x128_exact_operands(m):
    a, sa, a64 = representable_1x128(m, 384, seed=m)
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(9))
    wq, ws = quantize_fp8_tiles(w)
    w64 = dequantize_fp8_tiles(wq, ws, torch.float64)
    want = a64 @ w64.t()
    out32 = gemm_fp8_nt_1x128_128x128(a, sa, wq, ws, out_dtype=torch.float32)
    out16 = gemm_fp8_nt_1x128_128x128(a, sa, wq, ws)
    assert out32.shape == out16.shape == (m, 256) and out16.dtype == torch.bfloat16
    if m:
        assert rel(out32, want) < 1e-6
        assert rel(out16, want) < 2 ** -8     # one bf16 rounding per element


@pytest.mark.parametrize("k", [128, 384])
def test_gemm_1x128_1x128_exact_operands(k):
    a, sa, a64 = representable_1x128(256, k, seed=1)
    b, sb, b64 = representable_1x128(384, k, seed=2)
    out = gemm_fp8_nt_1x128_1x128(a, sa, b, sb, out_dtype=torch.float32)
    assert rel(out, a64 @ b64.t()) < 1e-6
    # b as a column slice of a wider matrix (how the weight gradients read x^T)
    wide, swide, wide64 = representable_1x128(384, 3 * k, seed=3)
    part = gemm_fp8_nt_1x128_1x128(a, sa, wide[:, k:2 * k], swide[:, 1 * k // 128:2 * k // 128],
                                   out_dtype=torch.float32)
    assert rel(part, a64 @ wide64[:, k:2 * k].t()) < 1e-6


def test_gemm_rejects_mismatches():
    a, sa, _ = representable_1x128(4, 256, seed=0)
    wq, ws = quantize_fp8_tiles(torch.randn(128, 384))
    with pytest.raises(ValueError, match="share K"):
        gemm_fp8_nt_1x128_128x128(a, sa, wq, ws)
    with pytest.raises(ValueError, match="a_scales"):
        gemm_fp8_nt_1x128_128x128(a, sa[:, :1], wq[:, :256], ws[:, :2])
    with pytest.raises(TypeError, match="dtype"):
        gemm_fp8_nt_1x128_1x128(a.float(), sa, a, sa)
    with pytest.raises(TypeError, match="out_dtype"):
        gemm_fp8_nt_1x128_1x128(a, sa, a, sa, out_dtype=torch.float16)


def fake_scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, swizzle_a=None,
                   swizzle_b=None, output_dtype=torch.bfloat16):
    """torch 2.11's blockwise ``scaled_mm`` layout checks (ScaledBlas.cpp), computed on CPU."""
    (scale_a,), (recipe_a,), (scale_b,), (recipe_b,) = scale_a, recipe_a, scale_b, recipe_b
    m, k = mat_a.shape
    n = mat_b.shape[1]
    kt, kt4 = k // 128, -(-k // 128 // 4) * 4
    assert mat_a.stride() == (k, 1), "mat_a must be row-major"
    assert mat_b.shape[0] == k and mat_b.stride(0) == 1 and mat_b.stride(1) >= k, \
        "mat_b must be column-major"
    assert k % 16 == 0 and n % 16 == 0
    assert recipe_a == "1x128" and scale_a.shape == (m, kt) and scale_a.stride() == (1, m)
    a = mat_a.float().unflatten(1, (-1, 128)) * scale_a.unsqueeze(-1)
    if recipe_b == "128x128":
        assert scale_b.shape == (kt4, n // 128) and scale_b.stride() == (1, kt4)
        per_element = scale_b[:kt].repeat_interleave(128, 0).repeat_interleave(128, 1)
    else:
        assert scale_b.shape == (n, kt) and scale_b.stride() == (1, n)
        per_element = scale_b.t().repeat_interleave(128, 0)
    return (a.flatten(1) @ (mat_b.float() * per_element)).to(output_dtype)


def _loop_through_fake_scaled_mm(monkeypatch):
    """The per-expert cuBLASLt path forced on CPU, with ``fake_scaled_mm`` as the GEMM."""
    from ds_fp4.moe import fp8_gemm_loop as fp8_gemm
    monkeypatch.setattr(fp8_gemm, "_scaled_mm_api", lambda: (fake_scaled_mm, "1x128",
                                                             "128x128", None))
    monkeypatch.setattr(fp8_gemm, "native_blockwise_supported", lambda device: True)
    monkeypatch.setattr(fp8_expert_passes, "native_blockwise_supported",
                        lambda device: True)
    monkeypatch.setenv("DS_FP4_EXPERT_GEMMS", "loop")


@pytest.mark.parametrize("m", [1, 6, 128, 300])
def test_scaled_mm_call_layouts(monkeypatch, m):
    # The tensor-core path's argument layouts, checked on CPU against torch's own rules.
    _loop_through_fake_scaled_mm(monkeypatch)
    a, sa, a64 = representable_1x128(m, 256, seed=m)
    wq, ws = quantize_fp8_tiles(torch.randn(384, 256))       # K/128 = 2: scales padded to 4
    out = gemm_fp8_nt_1x128_128x128(a, sa, wq, ws, out_dtype=torch.float32)
    assert out.shape == (m, 384)
    assert rel(out, a64 @ dequantize_fp8_tiles(wq, ws, torch.float64).t()) < 1e-6
    wide, swide, wide64 = representable_1x128(384, 512, seed=1)
    out = gemm_fp8_nt_1x128_1x128(a, sa, wide[:, 256:], swide[:, 2:], out_dtype=torch.float32)
    assert rel(out, a64 @ wide64[:, 256:].t()) < 1e-6


def test_experts_through_scaled_mm_call(monkeypatch):
    _loop_through_fake_scaled_mm(monkeypatch)
    experts = make_experts(256, 128, n_local=2, seed=61)
    x, dy = make_inputs(2, 2, 75, 256, seed=62), make_inputs(2, 2, 75, 256, seed=63)
    y, dx, grads, rows = run_fp8(experts, x, dy, "mxfp4", with_rows=True)
    assert_close_all((y, dx, grads), model_experts(experts, x, rows, dy, "mxfp4"), tol=1e-2)


def fake_scaled_mm_v2(mat_a, mat_b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b,
                      bias, out_dtype, contraction_dim=(), use_fast_accum=False, out=None):
    """``torch._scaled_mm_v2`` (integer recipes, optional ``out=``) with the checks above."""
    names = {torch.nn.functional.ScalingType.BlockWise1x128.value: "1x128",
             torch.nn.functional.ScalingType.BlockWise128x128.value: "128x128"}
    assert bias is None and not use_fast_accum
    res = fake_scaled_mm(mat_a, mat_b, scale_a, [names[r] for r in recipe_a], scale_b,
                         [names[r] for r in recipe_b], output_dtype=out_dtype)
    if out is None:
        return res
    assert out.shape == res.shape and out.dtype == res.dtype and out.stride(-1) == 1
    return out.copy_(res)


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm_v2"), reason="torch without _scaled_mm_v2")
@pytest.mark.parametrize("ep, cap", [(1, 128), (2, 64), (2, 75)])
def test_experts_through_scaled_mm_v2_fast_loop(monkeypatch, ep, cap):
    # The direct torch._scaled_mm_v2 loop (out= into z/dh/y/dx, column slices of x^T as b),
    # with torch's own layout rules checked on CPU; cap 75 (M = 150) takes the padded path.
    from ds_fp4.moe import fp8_gemm_loop as fp8_gemm
    monkeypatch.setattr(torch, "_scaled_mm_v2", fake_scaled_mm_v2)
    monkeypatch.setattr(fp8_gemm, "native_blockwise_supported", lambda device: True)
    monkeypatch.setattr(fp8_expert_passes, "native_blockwise_supported",
                        lambda device: True)
    monkeypatch.setenv("DS_FP4_EXPERT_GEMMS", "loop")
    monkeypatch.setattr(fp8_gemm, "_out_broken", False)
    monkeypatch.setattr(fp8_gemm, "_strided_b_ok", True)
    monkeypatch.setattr(fp8_gemm, "_checked", set())
    calls = []
    real = fp8_gemm._fast_gemm
    monkeypatch.setattr(fp8_gemm, "_fast_gemm", lambda *a: calls.append(1) or real(*a))
    experts = make_experts(256, 128, n_local=3, seed=71)
    x, dy = make_inputs(ep, 3, cap, 256, seed=72), make_inputs(ep, 3, cap, 256, seed=73)
    aligned = ep * cap % 4 == 0       # else only the two wgrad groups (M = features) are fast
    for step in range(2):
        calls.clear()
        y, dx, grads, rows = run_fp8(experts, x, dy, "mxfp4", with_rows=True)
        assert not fp8_gemm._out_broken and fp8_gemm._strided_b_ok
        if step == 0:   # each new kind of GEMM group runs its first GEMM through the checks
            assert len(calls) >= (12 if aligned else 4)
        else:           # 6 (or 2) GEMM groups x 3 experts, all known: no checked GEMM
            assert len(calls) == (18 if aligned else 6)
        assert_close_all((y, dx, grads), model_experts(experts, x, rows, dy, "mxfp4"), tol=1e-2)


# ---- GPU: the scaled_mm path ----------------------------------------------------------------


@needs_hopper
@pytest.mark.parametrize("m", [1, 128, 300])
@pytest.mark.parametrize("k, n", [(2048, 4096), (256, 128), (7168, 2048)])
def test_cuda_gemm_1x128_128x128(m, k, n):
    a, sa, a64 = representable_1x128(m, k, seed=m)
    wq, ws = quantize_fp8_tiles(torch.randn(n, k, generator=torch.Generator().manual_seed(k)))
    want = a64 @ dequantize_fp8_tiles(wq, ws, torch.float64).t()
    out = gemm_fp8_nt_1x128_128x128(a.cuda(), sa.cuda(), wq.cuda(), ws.cuda())
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert rel(out, want) < 2 ** -8


@needs_hopper
@pytest.mark.parametrize("k", [128, 384, 4096])
def test_cuda_gemm_1x128_1x128(k):
    a, sa, a64 = representable_1x128(2048, k, seed=1)
    wide, swide, wide64 = representable_1x128(1024, 2 * k, seed=2)
    b, sb = wide[:, k:].cuda(), swide[:, k // 128:].cuda()
    out = gemm_fp8_nt_1x128_1x128(a.cuda(), sa.cuda(), b, sb)
    assert rel(out, a64 @ wide64[:, k:].t()) < 2 ** -8


@needs_hopper
def test_cuda_gemm_float32_output():
    # Hopper's FP8 tensor cores sum each 128-deep block with ~14 mantissa bits before the
    # float32 promotion (DeepSeek-V3 report): 1.3e-4 was measured here on an H200.
    a, sa, a64 = representable_1x128(256, 512, seed=5)
    wq, ws = quantize_fp8_tiles(torch.randn(256, 512))
    out = gemm_fp8_nt_1x128_128x128(a.cuda(), sa.cuda(), wq.cuda(), ws.cuda(),
                                    out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert rel(out, a64 @ dequantize_fp8_tiles(wq, ws, torch.float64).t()) < 1e-3




@pytest.mark.parametrize("hidden, ffn, rows, mode, loop", [
    (7168, 2048, 2048, "auto", True),      # the measured crossover at the DeepSeek-V3 expert
    (7168, 2048, 1280, "auto", False),     # grouped measured faster
    (512, 512, 5120, "auto", False),       # many rows of a small expert: host time would rule
    (4096, 2048, 4096, "auto", True),
    (512, 512, 5120, "loop", True),        # DS_FP4_EXPERT_GEMMS forces either way
    (7168, 2048, 4096, "grouped", False),
])
def test_loop_rule_takes_large_experts_only(monkeypatch, hidden, ffn, rows, mode, loop):
    monkeypatch.setattr(fp8_expert_passes, "native_blockwise_supported", lambda device: True)
    plan = fp8_expert_passes._Plan("swiglu", False, "mxfp4", "rceil", 4, hidden, ffn, mode)
    assert fp8_expert_passes._per_expert(torch.empty(0), rows, plan) is loop
    asked = []
    monkeypatch.setattr(fp8_expert_passes, "native_blockwise_supported",
                        lambda device: asked.append(device) or False)
    assert fp8_expert_passes._per_expert(torch.empty(0), rows, plan) is False
    assert bool(asked) is loop   # the device is queried only where the mode or size says loop
