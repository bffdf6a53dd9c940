"""Kernel times: h = SwiGLU(z) FP8 rows with z's MXFP4 rows from one launch, against the
two launches (separate MXFP4 quantize), per variant, at the layer sizes (session 28)."""
import sys, torch
sys.path.insert(0, ".clean")
from ds_fp4 import formats, ops
from ds_fp4.ops import fp8_segments as FS

def t(fn, n=50):
    for _ in range(3): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(n): fn()
    e.record(); e.synchronize()
    return s.elapsed_time(e) / n * 1000

for name, seg, tok, ffn in (("h4096", 16, 1280, 2048), ("e32", 32, 640, 2048)):
    z = torch.randn(seg * tok, 2 * ffn, device="cuda").bfloat16()
    rows = torch.empty(seg * tok, formats.mxfp4_row_bytes(2 * ffn), dtype=torch.uint8, device="cuda")
    for v in ("", "_o3"):
        with FS.forced_variant(v):
            fused = t(lambda: FS.segment_quant(z, seg, tok, source="swiglu", z_rows=rows))
            h = t(lambda: FS.segment_quant(z, seg, tok, source="swiglu"))
        q = t(lambda: ops.quantize_mxfp4_rows(z, out=rows))
        print(f"{name} variant '{v}': fused {fused:.1f} us, swiglu {h:.1f} + quantize {q:.1f} = {h + q:.1f} us")
