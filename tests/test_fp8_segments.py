"""The FP8 experts' segment quantizers (ds_fp4/ops/fp8_segments.{py,cu}).

- CPU, g++: the kernel source runs under the host emulation of tests/kernel_emu (one
  std::thread per CUDA thread, barriers for __syncthreads and shuffles, the portable E4M3
  conversion) through the real Python launcher, and must equal the PyTorch twin byte for
  byte: layouts, swizzles, shuffles, padding and scales; FP8Experts' wiring of the kernels'
  layouts gives the twins' bits. (tests/test_kernels_compile.py compiles it with nvcc.)
- GPU: the kernels and every tuned variant against the twins on the device.
"""

import contextlib
import math

import pytest
import torch

from ds_fp4.ops import backend, fp8_segments as FS
from tests.kernel_emu.fp8 import (EMU_SMS, cupy_or_skip, emulated, host_kernels,  # noqa: F401
                                  same_bytes)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PIPELINED = ["_p"]


def run_variant(launched, variant, fn, *args, **kw):
    """``fn(*args, **kw)`` with the segment kernels' variant ``variant`` forced; checks that
    it ran (with a persistent grid smaller than the tile count for the pipelined ones)."""
    launched.clear()
    with FS.forced_variant(variant):
        out = fn(*args, **kw)
    seg = [(n, g) for n, g in launched if n.startswith("fp8_seg")]
    assert seg and all(n.endswith("_" + variant.lstrip("_")) or not variant for n, _ in seg), seg
    for n, g in seg:
        if variant in PIPELINED:
            assert g[0] == FS._PIPELINED[variant] * EMU_SMS and g[1:] == (1, 1), (n, g)
        else:
            assert not n.endswith(tuple(PIPELINED)), n
    return out


# ---- host emulation against the twins --------------------------------------------------------


@pytest.mark.parametrize("dtype, variant", [
    (torch.bfloat16, ""), (torch.float16, ""), (torch.float32, ""),
    (torch.bfloat16, "_p")])
@pytest.mark.parametrize("seg_len", [1, 128, 150])
@pytest.mark.parametrize("row, col", [(True, False), (False, True), (True, True)])
def test_emulated_segments_plain_equal_twin(emulated, dtype, variant, seg_len, row, col):
    g = torch.Generator().manual_seed(seg_len)
    x = torch.randn(2 * seg_len, 256, generator=g)
    x[0, 130] = 1e-6 if dtype == torch.float16 else 1e-40    # a subnormal / tiny element
    if seg_len > 100:
        x[seg_len + 3, 7] = math.nan
        x[5, 200] = math.inf
        x[seg_len + 9, 128:] = 0
    x = x.to(dtype)
    got = run_variant(emulated, variant, FS.segment_quant, x, 2, seg_len, row, col)
    want = FS.segment_quant_ref(x, 2, seg_len, row, col)
    for part, w, name in zip(got, want, ("row", "col")):
        assert (part is None) == (w is None)
        if w is not None:
            same_bytes(part, w, name)


@pytest.mark.parametrize("variant", ["", "_p"])
def test_emulated_segments_strided_rows(emulated, variant):
    # a row-strided view (a column block of a wider matrix) is read in place
    wide = torch.randn(300, 512, dtype=torch.bfloat16)
    x = wide[:, 128:384]
    got = run_variant(emulated, variant, FS.segment_quant, x, 3, 100, row=True, col=True)
    want = FS.segment_quant_ref(x.contiguous(), 3, 100, row=True, col=True)
    same_bytes(got[0], want[0], "row")
    same_bytes(got[1], want[1], "col")


@pytest.mark.parametrize("dtype, variant", [
    (torch.bfloat16, ""), (torch.bfloat16, "_o3"), (torch.bfloat16, "_p"), (torch.float32, "")])
@pytest.mark.parametrize("row, col", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("scaled", [False, True])
def test_emulated_segments_gathered_equal_twin(emulated, dtype, variant, row, col, scaled):
    # Tokens read through an index (repeats, out-of-range entries: zero rows) from a
    # row-strided source, each scaled by its own factor or not: the bytes of the gathered
    # (scaled, rounded) copy's quantization.
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(90, 384, generator=g)
    wide[4, 200], wide[17, 130] = math.nan, -math.inf
    x = wide.to(dtype)[:, 128:]
    index = torch.randint(0, 90, (3 * 100,), generator=g)
    index[::9], index[4::13], index[250:] = -1, 90, -1     # empty slots, a padding tail
    scale = torch.rand(300, generator=g) * 3 if scaled else None
    inside = (index >= 0) & (index < 90)
    if scaled:
        scale[11], scale[12] = 1e-30, math.inf
        # zero rows stay zero whatever their factor (an unused slot's gate is any value)
        scale[0], scale[4], scale[9], scale[299] = math.nan, -math.inf, -2.0, math.nan
        assert not inside[[0, 4, 9, 299]].any() and inside[[11, 12]].all()
    got = run_variant(emulated, variant, FS.segment_quant, x, 3, 100, row, col, index=index,
                      scale=scale)
    want = FS.segment_quant_ref(x, 3, 100, row, col, index=index, scale=scale)
    rows = torch.where(inside[:, None], x[index.clamp(0, 89)], 0)
    if scaled:
        rows = torch.where(inside[:, None], (rows.float() * scale[:, None]).to(dtype), 0)
    copy = FS.segment_quant_ref(rows, 3, 100, row, col)
    for part, w, c, name in zip(got, want, copy, ("row", "col")):
        assert (part is None) == (w is None)
        if w is not None:
            same_bytes(part, w, name)
            same_bytes(w, c, name + " (twin vs the gathered copy)")


@contextlib.contextmanager
def poisoned_allocations():
    """``torch.empty``, ``empty_like``, ``empty_strided`` and ``Tensor.new_empty`` return
    floating tensors full of NaN and integer ones full of -77: on a GPU fresh memory holds
    whatever the allocator left there (a freed -1-filled index reads as NaN in float32),
    on this CPU it is rarely NaN, so a read of memory nothing wrote shows only this way."""
    def poison(make):
        def made(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(math.nan if t.is_floating_point() else -77) if t.numel() else t
        return made
    names = ("empty", "empty_like", "empty_strided")
    saved = [getattr(torch, n) for n in names] + [torch.Tensor.new_empty]
    try:
        for n, f in zip(names, saved):
            setattr(torch, n, poison(f))
        torch.Tensor.new_empty = poison(saved[-1])
        yield
    finally:
        for n, f in zip(names, saved):
            setattr(torch, n, f)
        torch.Tensor.new_empty = saved[-1]


def _z_and_dh(tokens, ffn, seed):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(tokens, 2 * ffn, generator=g) * 2).to(torch.bfloat16)
    dh = torch.randn(tokens, ffn, generator=g).to(torch.bfloat16)
    return z, dh


def differing_fraction(got, want):
    a, b = got[0].view(torch.uint8), want[0].view(torch.uint8)
    return (a != b).float().mean().item()


@pytest.mark.parametrize("source", ["swiglu", "swiglu_grad"])
@pytest.mark.parametrize("seg_len", [64, 130])
def test_emulated_segments_swiglu_match_twin(emulated, source, seg_len):
    # Same float32 operation sequence as torch's float kernels; only exp() may differ in its
    # last bit between libraries (glibc here, torch's vectorized CPU exp in the twin), which
    # can move a bf16 rounding: allow a handful of E4M3 bytes to differ, scales must agree.
    z, dh = _z_and_dh(2 * seg_len, 256, seg_len)
    kw = {"dh": dh} if source == "swiglu_grad" else {}
    got = run_variant(emulated, "", FS.segment_quant, z, 2, seg_len, True, True,
                      source=source, **kw)
    want = FS.segment_quant_ref(z, 2, seg_len, True, True, source=source, **kw)
    for part, w in zip(got, want):
        assert differing_fraction(part, w) < 1e-3
        assert torch.equal(part[1], w[1])


@pytest.mark.parametrize("row, col", [(True, False), (False, True), (True, True)])
def test_emulated_pipelined_equal_base(emulated, row, col):
    # The persistent variants run the base kernels' math: the same bytes over 3 segments of
    # 150 tokens (padding), 2 feature tiles, edge values (NaN, +-Inf, zero rows, a
    # subnormal), 2 CTAs each walking several tiles.
    x = (torch.randn(3 * 150, 256, generator=torch.Generator().manual_seed(11)) * 1e3)
    x[7, 3], x[160, 130], x[161, 2] = math.nan, math.inf, -math.inf
    x[300, :] = 0
    x[301, 5] = 1e-40
    x = x.to(torch.bfloat16)
    want = run_variant(emulated, "", FS.segment_quant, x, 3, 150, row, col)
    for variant in PIPELINED:
        got = run_variant(emulated, variant, FS.segment_quant, x, 3, 150, row, col)
        for part, w, name in zip(got, want, ("row", "col")):
            assert (part is None) == (w is None)
            if w is not None:
                same_bytes(part, w, f"{name} {variant}")


@pytest.mark.parametrize("cache, with_rows, activation, bias", [
    ("mxfp4", True, "swiglu", False), ("fp8", False, "swiglu", False),
    ("bf16", False, "gelu", True), ("mxfp4", False, "swiglu", True)])
def test_emulated_experts_equal_twin_path(emulated, cache, with_rows, activation, bias):
    # FP8Experts' wiring of the kernels' layouts: the same bits as with the twins.
    from deepspeed.moe.experts import Experts
    from ds_fp4 import ops
    from ds_fp4.moe.expert import SwiGLUExpert
    from ds_fp4.moe.fp8_experts import FP8Experts
    torch.manual_seed(3)
    experts = Experts(SwiGLUExpert(256, 128, activation=activation, bias=bias), 2)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.1)
    x = torch.randn(2, 2, 75, 256).to(torch.bfloat16)
    dy = torch.randn(2, 2, 75, 256).to(torch.bfloat16)
    rows = ops.quantize_mxfp4_rows(x) if with_rows else None

    def run():
        for p in experts.parameters():
            p.grad = None
        xin = x.clone().requires_grad_(True)
        y = FP8Experts.from_experts(experts, cache=cache)(xin, rows)
        y.backward(dy)
        return [y, xin.grad] + [p.grad.clone() for p in experts.parameters()]

    got = run()
    assert any(n.startswith("fp8_seg") for n, _ in emulated)    # the kernels ran
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "uses_kernels", lambda *tensors: False)
        want = run()
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {i} differs"


@pytest.mark.parametrize("cache, variant", [("mxfp4", ""), ("fp8", ""), ("mxfp4", "_p")])
def test_emulated_experts_gathered_input(emulated, cache, variant):
    # FP8Experts reading its slots' rows from the tokens through a source map (the layer at
    # EP 1): with the kernels (the segment quantizers' ``variant``), the bits it computes
    # from the gathered slot buffer itself, and the twins' bits; the unused slots' gates are
    # NaN (route_gate_grads leaves them unwritten: any value) and change nothing.
    from deepspeed.moe.experts import Experts
    from ds_fp4.ops import reference
    from ds_fp4.moe.expert import SwiGLUExpert
    from ds_fp4.moe import routing
    from ds_fp4.moe.fp8_experts import FP8Experts
    torch.manual_seed(4)
    experts = Experts(SwiGLUExpert(256, 128), 2)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.1)
    tokens = torch.randn(100, 256).to(torch.bfloat16)
    source = torch.randperm(100)[torch.arange(150) % 100]
    source[::7], source[60:75], source[140:] = -1, -1, -1     # empty slots, padding tails
    slots = reference.gather_rows_or_zeros(tokens, source).view(1, 2, 75, 256)
    # the slots' gradient as the decode's backward makes it: dy's token rows times the slots'
    # gates, or (gathered) dy and the gates handed over through GatheredSlots
    dy_tokens = torch.randn(100, 256).to(torch.bfloat16)
    slot_gates = torch.rand(150)
    slot_gates[source < 0] = math.nan
    dy = torch.where((source >= 0)[:, None], (reference.gather_rows_or_zeros(
        dy_tokens, source).float() * slot_gates[:, None]).to(torch.bfloat16), 0)
    dy = dy.view(1, 2, 75, 256)

    def run(gathered):
        for p in experts.parameters():
            p.grad = None
        module = FP8Experts.from_experts(experts, cache=cache)
        assert module.reads_gathered(slots.shape, slots.device)
        if gathered:
            xin = torch.zeros((), dtype=torch.bfloat16).expand(slots.shape).detach()
            handle = routing.GatheredSlots(tokens, source)
            y = module(xin.requires_grad_(True), gather=handle)
            handle.grad = (dy_tokens, slot_gates)
            y.backward(torch.zeros((), dtype=torch.bfloat16).expand(y.shape))
        else:
            xin = slots.clone().requires_grad_(True)
            y = module(xin)
            y.backward(dy)
        return [y, xin.grad] + [p.grad.clone() for p in experts.parameters()]

    with FS.forced_variant(variant):
        want = run(False)
        emulated.clear()
        got = run(True)
        with poisoned_allocations():   # nothing read before it is written
            poisoned = run(True)
    assert any(n.startswith("fp8_seg_plain") and n.endswith("_g" + variant)
               for n, _ in emulated), emulated   # the kernel gathered
    for i, (a, b) in enumerate(zip(poisoned, got)):
        assert torch.equal(a, b), f"output {i} read memory nothing wrote"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "uses_kernels", lambda *tensors: False)
        twin = run(True)
    for i, (a, b, c) in enumerate(zip(got, want, twin)):
        assert torch.equal(a, b), f"output {i} differs from the slot buffer's"
        assert torch.equal(a, c), f"output {i} differs from the twins'"


def test_gathered_grad_with_another_gradient_raises():
    # The decode's gradient handed over through GatheredSlots while the output's gradient is
    # a real tensor (something else also used the output): refused, not half lost.
    from deepspeed.moe.experts import Experts
    from ds_fp4.moe import routing
    from ds_fp4.moe.expert import SwiGLUExpert
    from ds_fp4.moe.fp8_experts import FP8Experts
    module = FP8Experts.from_experts(Experts(SwiGLUExpert(128, 128), 2))
    tokens, source = torch.randn(10, 128).to(torch.bfloat16), torch.arange(16) % 10
    handle = routing.GatheredSlots(tokens, source)
    xin = torch.zeros((), dtype=torch.bfloat16).expand(1, 2, 8, 128).detach().requires_grad_()
    y = module(xin, gather=handle)
    handle.grad = (torch.randn(10, 128).to(torch.bfloat16), torch.ones(16))
    with pytest.raises(RuntimeError, match="both from the decode"):
        y.backward(torch.ones_like(y))


def test_gather_arguments_are_named():
    from deepspeed.moe.experts import Experts
    from ds_fp4.config import Format
    from ds_fp4.moe import alltoall, routing
    from ds_fp4.moe.expert import SwiGLUExpert
    from ds_fp4.moe.fp8_experts import FP8Experts
    module = FP8Experts.from_experts(Experts(SwiGLUExpert(128, 128), 2))
    xin = torch.zeros((), dtype=torch.bfloat16).expand(1, 2, 8, 128)
    tokens, source = torch.randn(10, 128).to(torch.bfloat16), torch.arange(16) % 10
    bad = [(dict(source=source[:15]), "one entry per slot"),
           (dict(source=source.int()), "gather's source"),
           (dict(tokens=tokens.float()), "gather's tokens"),
           (dict(tokens=tokens[:, :64]), "gather's tokens")]
    for change, match in bad:
        g = routing.GatheredSlots(change.get("tokens", tokens), change.get("source", source))
        with pytest.raises((ValueError, TypeError), match=match):
            module(xin, gather=g)
    with pytest.raises(ValueError, match="gather is for inputs without rows"):
        module(xin, torch.zeros(1, 2, 8, 68, dtype=torch.uint8),
               gather=routing.GatheredSlots(tokens, source))
    biased = FP8Experts.from_experts(Experts(SwiGLUExpert(128, 128, bias=True), 2))
    assert not biased.reads_gathered(xin.shape, xin.device)
    with pytest.raises(ValueError, match="no biases"):
        biased(xin, gather=routing.GatheredSlots(tokens, source))
    with pytest.raises(ValueError, match="scale for fp8 only; got index and scale for mxfp4"):
        alltoall.pack_rows(tokens, Format.MXFP4, index=source, scale=torch.ones(16))
    with pytest.raises(ValueError, match="got index for bf16"):
        alltoall.pack_rows(tokens, Format.BF16, index=source)


# ---- argument checks --------------------------------------------------------------------------


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="segments \\* seg_len"):
        FS.segment_quant(torch.zeros(10, 128), 2, 4)
    with pytest.raises(ValueError, match="row=True and/or col=True"):
        FS.segment_quant(torch.zeros(8, 128), 2, 4, row=False, col=False)
    with pytest.raises(ValueError, match="dh must be"):
        FS.segment_quant(torch.zeros(8, 256, dtype=torch.bfloat16), 2, 4,
                         source="swiglu_grad", dh=torch.zeros(8, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="source"):
        FS.segment_quant(torch.zeros(8, 128), 2, 4, source="relu")
    with pytest.raises(TypeError, match="z must be bfloat16"):
        FS.segment_quant(torch.zeros(8, 272, dtype=torch.uint8), 2, 4, source="swiglu")


# ---- on the GPU ------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("seg_len", [1, 300, 4096])
def test_cuda_segments_plain_equal_twin(seg_len):
    cupy_or_skip()
    x = torch.randn(3 * seg_len, 2048, device="cuda").to(torch.bfloat16)
    x[0, 5] = math.nan
    got = FS.segment_quant(x, 3, seg_len, True, True)
    want = FS.segment_quant_ref(x, 3, seg_len, True, True)
    same_bytes(got[0], want[0], "row")
    same_bytes(got[1], want[1], "col")


@needs_cuda
@pytest.mark.parametrize("source", ["swiglu", "swiglu_grad"])
def test_cuda_segments_swiglu_match_twin(source):
    cupy_or_skip()
    z, dh = _z_and_dh(2 * 300, 1024, 5)
    z, dh = z.cuda(), dh.cuda()
    kw = {"dh": dh} if source == "swiglu_grad" else {}
    got = FS.segment_quant(z, 2, 300, True, True, source=source, **kw)
    want = FS.segment_quant_ref(z, 2, 300, True, True, source=source, **kw)
    for part, w in zip(got, want):
        frac = differing_fraction(part, w)
        assert frac < 1e-4, frac
        assert torch.equal(part[1], w[1])


@needs_cuda
@pytest.mark.parametrize("source", ["plain", "swiglu", "swiglu_grad"])
@pytest.mark.parametrize("row, col", [(True, False), (False, True), (True, True)])
def test_cuda_variants_equal(source, row, col):
    # every candidate _launch_tuned picks from gives the same bytes on the GPU: name and
    # name_o3 (two register budgets) and, for plain bf16, the persistent name_p (3 segments of 2000
    # tokens: more tiles than their CTAs, padding in each segment's last token tile)
    cupy_or_skip()
    z, dh = _z_and_dh(3 * 2000, 1024, 9)
    z[5, 7], z[2100, 1030], z[4100, 3] = math.nan, math.inf, 1e-40
    z, dh = z.cuda(), dh.cuda()
    kw = {"dh": dh} if source == "swiglu_grad" else {}
    with FS.forced_variant(""):
        want = FS.segment_quant(z, 3, 2000, row, col, source=source, **kw)
    for variant in ("_o3", "_p") if source == "plain" else ("_o3",):
        with FS.forced_variant(variant):
            got = FS.segment_quant(z, 3, 2000, row, col, source=source, **kw)
        for part, w, name in zip(got, want, ("row", "col")):
            if w is not None:
                same_bytes(part, w, f"{source} {name} {variant}")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("row, col", [(True, False), (True, True)])
def test_cuda_gathered_variants_equal_twin(dtype, row, col):
    # the gathering kernels (name_g, _g_o3 and for bf16 _g_p) on the GPU: tokens through an
    # index with empty slots and a padding tail, scaled or not, the twin's bytes (the
    # twin's float32 products and casts are IEEE on both)
    cupy_or_skip()
    g = torch.Generator().manual_seed(12)
    x = torch.randn(5000, 1024, generator=g)
    x[17, 5], x[4000, 900] = math.nan, -math.inf
    x = x.to(dtype).cuda()
    index = torch.randint(0, 5000, (3 * 2000,), generator=g)
    index[::11], index[5900:] = -1, -1
    index = index.cuda()
    scaled = torch.rand(6000, generator=g) * 4
    scaled[0], scaled[11], scaled[5999] = math.nan, -math.inf, -2.0   # zero rows: any gate
    for scale in (None, scaled.cuda()):
        want = FS.segment_quant_ref(x.cpu(), 3, 2000, row, col, index=index.cpu(),
                                    scale=None if scale is None else scale.cpu())
        variants = ("", "_o3", "_p") if dtype == torch.bfloat16 else ("", "_o3")
        for variant in variants:
            with FS.forced_variant(variant):
                got = FS.segment_quant(x, 3, 2000, row, col, index=index, scale=scale)
            for part, w, name in zip(got, want, ("row", "col")):
                if w is not None:
                    same_bytes(tuple(t.cpu() for t in part), w, f"{name} {variant} {scale is None}")


@needs_cuda
def test_cuda_tuned_choice_is_a_candidate():
    cupy_or_skip()
    x = torch.randn(2 * 1000, 1024, device="cuda").to(torch.bfloat16)
    got = FS.segment_quant(x, 2, 1000, True, True)
    want = FS.segment_quant_ref(x, 2, 1000, True, True)
    same_bytes(got[0], want[0], "row")
    same_bytes(got[1], want[1], "col")
    key = (torch.cuda.current_device(), "fp8_seg_plain_bf16_rc", (8, 8, 2))
    assert FS.kernel_choices()[key] in {key[1] + v for v in ("", "_o3", "_p")}
