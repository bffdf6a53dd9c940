"""The fused FP8 quantizers of the FP8 experts (ds_fp4/moe/fp8_fused.{py,cu}).

- CPU, nvcc: the kernel source compiles for sm_90 (hardware and portable E4M3 conversions)
  without warnings or spills.
- CPU, g++: the same kernel source runs under the host emulation of tests/kernel_emu (one
  std::thread per CUDA thread, barriers for __syncthreads and shuffles, the portable E4M3
  conversion; the ops kernels' emulation too) through the real Python wrappers, and must
  equal the PyTorch twins byte for byte: layouts, swizzles, shuffles, padding and scales.
- GPU: the kernels against the twins on the device.
"""

import math
import re
import shutil
import subprocess

import pytest
import torch

from ds_fp4 import formats as F
from ds_fp4 import ops
from ds_fp4.moe import fp8_fused as FF
from tests.kernel_emu import loader

NVCC = shutil.which("nvcc")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# the persistent variants' grids are this many CTAs per SM: fewer than the tiles of every
# case below, so that each CTA walks several tiles
EMU_SMS = 1
PIPELINED = ["_p"]


@pytest.fixture(scope="module")
def host_kernels():
    """The host emulation of the kernels (built once per kernel text, cached across runs)."""
    if loader.gxx() is None:
        pytest.skip("g++ is not on PATH")
    kernels = loader.HostKernels()
    kernels.library(loader.FUSED)       # build here: a g++ error fails setup, not one case
    return kernels


@pytest.fixture
def emulated(host_kernels, monkeypatch):
    """Route fp8_fused's launches on CPU tensors into the host-emulated kernels, for one
    test only (a GPU test after it must reach the real kernels); yields the launches made."""
    launched = []

    def launch(device, name, grid, args):
        launched.append((name, grid))
        host_kernels.launch(device, loader.FUSED, name, grid, args, block=FF._THREADS)

    tables = []       # kept alive for the test, as fp8_fused caches its own

    def table(weights):
        tables.append(torch.tensor([w.data_ptr() for w in weights], dtype=torch.int64))
        return tables[-1]

    monkeypatch.setattr(FF, "kernels_used", lambda *tensors: True)
    monkeypatch.setattr(FF, "_launch", launch)
    monkeypatch.setattr(FF, "_pointer_table", table)
    monkeypatch.setattr(FF, "_sm_count", lambda device: EMU_SMS)
    return launched


def run_variant(launched, variant, fn, *args, **kw):
    """``fn(*args, **kw)`` with the segment kernels' variant ``variant`` forced; checks that
    it ran (with a persistent grid smaller than the tile count for the pipelined ones)."""
    launched.clear()
    with FF.forced_variant(variant):
        out = fn(*args, **kw)
    seg = [(n, g) for n, g in launched if n.startswith("fp8_seg")]
    assert seg and all(n.endswith("_" + variant.lstrip("_")) or not variant for n, _ in seg), seg
    for n, g in seg:
        if variant in PIPELINED:
            assert g[0] == FF._PIPELINED[variant] * EMU_SMS and g[1:] == (1, 1), (n, g)
        else:
            assert not n.endswith(tuple(PIPELINED)), n
    return out


def _bits(t):
    """Comparable bits: E4M3 bytes with NaN's sign dropped (a NaN tile or group is NaN; the
    twins' float products give NaNs either sign), float32 words as they are."""
    if t.dtype == F.FP8_DTYPE:
        b = t.contiguous().view(torch.uint8)
        return torch.where(b & 0x7F == F.E4M3_NAN, F.E4M3_NAN, b)
    return t.contiguous().view(torch.int32)


def same_bytes(got, want, what):
    """Byte equality of (data, scales) pairs; reports the first mismatch."""
    for name, a, b in ((f"{what} data", got[0], want[0]), (f"{what} scales", got[1], want[1])):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        ab, bb = _bits(a), _bits(b)
        bad = (ab != bb).nonzero()
        assert bad.numel() == 0, f"{name}: {bad.shape[0]} differ, first at {bad[0].tolist()}: " \
                                 f"{ab[tuple(bad[0])].item()} vs {bb[tuple(bad[0])].item()}"


def weights_with_edges(n, r, c, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(r, c, generator=g) * 0.05 for _ in range(n)]
    ws[0][:128, :128] *= 1e-30 if dtype != torch.float16 else 1e-3   # tiny tile
    ws[0][:128, 128:256] = 0                                         # zero tile
    if n > 1:
        ws[1][130, 5] = math.nan
        ws[1][200, 140] = -math.inf
    ws[-1][-128:, -128:] *= 3e3 if dtype != torch.float16 else 1e2    # large tile
    return [w.to(dtype) for w in ws]


# ---- the source compiles ------------------------------------------------------------------


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_kernel_source_compiles(tmp_path):
    # (the portable E4M3 path is what the host emulation below runs)
    from ds_fp4.ops import _cuda_loader as L
    src = tmp_path / "fp8_fused.cu"
    src.write_text(FF.module_source())
    proc = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-Xptxas", "-v", *L.NVRTC_OPTIONS,
                           "-o", str(tmp_path / "k.cubin"), str(src)],
                          capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "warning" not in log.lower(), log[-4000:]
    kernels = set(re.findall(r"Compiling entry function '(\w+)'", log))
    assert {"fp8_tiles_bf16_t", "fp8_seg_swiglu_grad_mx_rc", "fp8_seg_plain_f32_c",
            "fp8_seg_plain_bf16_rc_o3"} <= kernels


# ---- host emulation against the twins --------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_group", [1, 2])
@pytest.mark.parametrize("transpose", [False, True])
def test_emulated_tiles_equal_twin(emulated, dtype, per_group, transpose):
    ws = weights_with_edges(2 * per_group, 256, 384, dtype, seed=per_group)
    got = FF.tile_quant(ws, per_group, transpose)
    want = FF.tile_quant_ref(ws, per_group, transpose)
    same_bytes(got, want, "tiles")


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
    got = run_variant(emulated, variant, FF.segment_quant, x, 2, seg_len, row, col)
    want = FF.segment_quant_ref(x, 2, seg_len, row, col)
    for part, w, name in zip(got, want, ("row", "col")):
        assert (part is None) == (w is None)
        if w is not None:
            same_bytes(part, w, name)


@pytest.mark.parametrize("variant", ["", "_p"])
def test_emulated_segments_strided_rows(emulated, variant):
    # a row-strided view (a column block of a wider matrix) is read in place
    wide = torch.randn(300, 512, dtype=torch.bfloat16)
    x = wide[:, 128:384]
    got = run_variant(emulated, variant, FF.segment_quant, x, 3, 100, row=True, col=True)
    want = FF.segment_quant_ref(x.contiguous(), 3, 100, row=True, col=True)
    same_bytes(got[0], want[0], "row")
    same_bytes(got[1], want[1], "col")


def _z_and_dh(tokens, ffn, seed, mx):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(tokens, 2 * ffn, generator=g) * 2).to(torch.bfloat16)
    dh = torch.randn(tokens, ffn, generator=g).to(torch.bfloat16)
    return (ops.quantize_mxfp4_rows(z) if mx else z), dh


def differing_fraction(got, want):
    a, b = got[0].view(torch.uint8), want[0].view(torch.uint8)
    return (a != b).float().mean().item()


@pytest.mark.parametrize("source", ["swiglu", "swiglu_grad"])
@pytest.mark.parametrize("mx, variant", [(False, ""), (True, "")], ids=["z_bf16", "z_mxfp4"])
@pytest.mark.parametrize("seg_len", [64, 130])
def test_emulated_segments_swiglu_match_twin(emulated, source, mx, variant, seg_len):
    # Same float32 operation sequence as torch's float kernels; only exp() may differ in its
    # last bit between libraries (glibc here, torch's vectorized CPU exp in the twin), which
    # can move a bf16 rounding: allow a handful of E4M3 bytes to differ, scales must agree.
    z, dh = _z_and_dh(2 * seg_len, 256, seg_len, mx)
    kw = {"dh": dh} if source == "swiglu_grad" else {}
    got = run_variant(emulated, variant, FF.segment_quant, z, 2, seg_len, True, True,
                      source=source, **kw)
    want = FF.segment_quant_ref(z, 2, seg_len, True, True, source=source, **kw)
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
    want = run_variant(emulated, "", FF.segment_quant, x, 3, 150, row, col)
    for variant in PIPELINED:
        got = run_variant(emulated, variant, FF.segment_quant, x, 3, 150, row, col)
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
        feed = xin * 1
        if rows is not None:
            feed.ds_fp4_rows = rows
        y = FP8Experts.from_experts(experts, cache=cache)(feed)
        y.backward(dy)
        return [y, xin.grad] + [p.grad.clone() for p in experts.parameters()]

    got = run()
    with FF.enabled(False), pytest.MonkeyPatch.context() as mp:
        mp.setattr(FF, "kernels_used", lambda *tensors: False)
        want = run()
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {i} differs"


# ---- argument checks --------------------------------------------------------------------------


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="per_group"):
        FF.tile_quant([torch.zeros(128, 128)] * 3, 2)
    with pytest.raises(ValueError, match="share shape"):
        FF.tile_quant([torch.zeros(128, 128), torch.zeros(256, 128)], 1)
    with pytest.raises(ValueError, match="multiples of 128"):
        FF.tile_quant([torch.zeros(100, 128)], 1)
    with pytest.raises(ValueError, match="segments \\* seg_len"):
        FF.segment_quant(torch.zeros(10, 128), 2, 4)
    with pytest.raises(ValueError, match="row=True and/or col=True"):
        FF.segment_quant(torch.zeros(8, 128), 2, 4, row=False, col=False)
    with pytest.raises(ValueError, match="dh must be"):
        FF.segment_quant(torch.zeros(8, 256, dtype=torch.bfloat16), 2, 4,
                         source="swiglu_grad", dh=torch.zeros(8, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="source"):
        FF.segment_quant(torch.zeros(8, 128), 2, 4, source="relu")


# ---- on the GPU ------------------------------------------------------------------------------


def _cuda_kernels_or_skip():
    try:
        FF._cupy()
    except ImportError:
        pytest.skip("CuPy is not installed")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transpose", [False, True])
def test_cuda_tiles_equal_twin(dtype, transpose):
    _cuda_kernels_or_skip()
    ws = [w.cuda() for w in weights_with_edges(4, 512, 768, dtype, seed=7)]
    assert FF.kernels_used(ws[0])
    same_bytes(FF.tile_quant(ws, 2, transpose), FF.tile_quant_ref(ws, 2, transpose), "tiles")


@needs_cuda
@pytest.mark.parametrize("seg_len", [1, 300, 4096])
def test_cuda_segments_plain_equal_twin(seg_len):
    _cuda_kernels_or_skip()
    x = torch.randn(3 * seg_len, 2048, device="cuda").to(torch.bfloat16)
    x[0, 5] = math.nan
    got = FF.segment_quant(x, 3, seg_len, True, True)
    want = FF.segment_quant_ref(x, 3, seg_len, True, True)
    same_bytes(got[0], want[0], "row")
    same_bytes(got[1], want[1], "col")


@needs_cuda
@pytest.mark.parametrize("source", ["swiglu", "swiglu_grad"])
@pytest.mark.parametrize("mx", [False, True], ids=["z_bf16", "z_mxfp4"])
def test_cuda_segments_swiglu_match_twin(source, mx):
    _cuda_kernels_or_skip()
    z, dh = _z_and_dh(2 * 300, 1024, 5, mx)
    z, dh = z.cuda(), dh.cuda()
    kw = {"dh": dh} if source == "swiglu_grad" else {}
    got = FF.segment_quant(z, 2, 300, True, True, source=source, **kw)
    want = FF.segment_quant_ref(z, 2, 300, True, True, source=source, **kw)
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
    _cuda_kernels_or_skip()
    z, dh = _z_and_dh(3 * 2000, 1024, 9, mx=False)
    z[5, 7], z[2100, 1030], z[4100, 3] = math.nan, math.inf, 1e-40
    z, dh = z.cuda(), dh.cuda()
    kw = {"dh": dh} if source == "swiglu_grad" else {}
    with FF.forced_variant(""):
        want = FF.segment_quant(z, 3, 2000, row, col, source=source, **kw)
    for variant in ("_o3", "_p") if source == "plain" else ("_o3",):
        with FF.forced_variant(variant):
            got = FF.segment_quant(z, 3, 2000, row, col, source=source, **kw)
        for part, w, name in zip(got, want, ("row", "col")):
            if w is not None:
                same_bytes(part, w, f"{source} {name} {variant}")


@needs_cuda
def test_cuda_tuned_choice_is_a_candidate():
    _cuda_kernels_or_skip()
    x = torch.randn(2 * 1000, 1024, device="cuda").to(torch.bfloat16)
    got = FF.segment_quant(x, 2, 1000, True, True)
    want = FF.segment_quant_ref(x, 2, 1000, True, True)
    same_bytes(got[0], want[0], "row")
    same_bytes(got[1], want[1], "col")
    key = (torch.cuda.current_device(), "fp8_seg_plain_bf16_rc", (8, 8, 2))
    assert FF.kernel_choices()[key] in {key[1] + v for v in ("", "_o3", "_p")}
