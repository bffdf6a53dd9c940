"""``tools/bench_experts.py``'s guard: before anything is timed, the CUDA kernels the FP8
experts run are compared once with their references; a kernel that disagrees or fails
switches every op to the reference (``ops.set_kernels("reference")``), and the returned
line says so, so that a broken kernel shows in the report instead of in the timings."""

import torch

from ds_fp4 import ops
from ds_fp4.ops import backend, fp8_segments, fp8_tiles
from ds_fp4.ops.compare import first_mismatch


def check_kernels(device):
    """Run every op FP8Experts uses once on CUDA and compare it byte for byte with the
    reference; on a mismatch or an error fall back to the reference ops (and say so)."""
    if device.type != "cuda":
        return "cpu: reference ops"
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(300, 2048, device=device, generator=g).to(torch.bfloat16)
    offsets = torch.tensor([0, 100, 100, 300], dtype=torch.int32, device=device)

    def run():
        rows = ops.quantize_mxfp4_rows(x)
        return (rows, ops.mxfp4_rows_to_fp8(rows), ops.quantize_fp8(x),
                ops.quantize_fp8_rows(x), ops.dequantize_mxfp4_rows(rows),
                ops.dequantize_fp8_rows(ops.quantize_fp8_rows(x)),
                ops.mxfp4_to_fp8_colwise(*ops.split_mxfp4_rows(rows), offsets))
    try:
        got = run()
        with ops.kernels("reference"):
            want = run()
        bad = [i for i, (a, b) in enumerate(zip(got, want)) if first_mismatch(a, b)]
        if not bad:
            return f"{ops.get_kernels()}: the ops FP8Experts uses match the reference byte for byte"
        reason = f"outputs {bad} differ from the reference"
    except Exception as err:  # a kernel that fails must not stop the GEMM measurements
        reason = f"{type(err).__name__}: {err}"
    ops.set_kernels("reference")
    return f"reference (CUDA kernels rejected: {reason}); FP8 timings include slow ops"


def check_fused(device):
    """Compare the experts' tile and segment quantizers (``ds_fp4.ops.fp8_tiles``,
    ``fp8_segments``) with their PyTorch twins once (weight tiles and plain activations byte
    for byte; SwiGLU sources up to exp()'s last bit: <= 1e-4 of the bytes); on a mismatch or
    an error run every op on the reference (and say so)."""
    if device.type != "cuda" or not backend.uses_kernels(torch.empty(0, device=device)):
        return "fused kernels not used (CPU, reference ops or no CuPy): PyTorch twins"
    g = torch.Generator(device=device).manual_seed(1)
    ws = [torch.randn(256, 384, device=device, generator=g).to(torch.bfloat16)
          for _ in range(4)]
    x = torch.randn(600, 512, device=device, generator=g).to(torch.bfloat16)
    dh = torch.randn(600, 256, device=device, generator=g).to(torch.bfloat16)
    checks = {
        "tiles": lambda f: f(ws, 2, False), "tiles_t": lambda f: f(ws, 2, True),
        "plain": lambda f: f(x, 2, 300, True, True),
        "swiglu": lambda f: f(x, 2, 300, True, True, source="swiglu"),
        "swiglu_grad": lambda f: f(x, 2, 300, True, True, source="swiglu_grad", dh=dh)}
    try:
        bad = []
        for name, call in checks.items():
            kernel, twin = ((fp8_tiles.tile_quant, fp8_tiles.tile_quant_ref) if "tiles" in name
                            else (fp8_segments.segment_quant, fp8_segments.segment_quant_ref))
            got, want = call(kernel), call(twin)
            pairs = [(got, want)] if "tiles" in name else list(zip(got, want))
            for a, b in pairs:
                differ = (a[0].view(torch.uint8) != b[0].view(torch.uint8)).float().mean().item()
                limit = 1e-4 if "swiglu" in name else 0.0
                if differ > limit or first_mismatch(a[1], b[1]):
                    bad.append(f"{name} ({differ:.2e} of the bytes differ)")
        if not bad:
            return "fused kernels match their twins (SwiGLU sources: <= 1e-4 of the bytes)"
        reason = ", ".join(bad)
    except Exception as err:  # a kernel that fails must not stop the measurements
        reason = f"{type(err).__name__}: {err}"
    ops.set_kernels("reference")
    return f"reference (fused kernels rejected: {reason}); FP8 timings include slow ops"
