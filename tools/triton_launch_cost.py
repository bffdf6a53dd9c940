"""Where the host time of one grouped FP8 GEMM launch goes (issue 18), on a GPU.

The FP8 experts issue 6 Triton launches a step (forward, data and weight gradients) and
session 17 measured 65-68 us of host time per grouped GEMM call at a tiny shape. This times,
while the GPU is kept busy (so only host time is seen), the pieces of one call:

- ``public``: ``m_grouped_gemm_fp8_nt`` / ``k_grouped_gemm_fp8_nt`` (argument checks included);
- ``launcher``: ``grouped_gemm_triton.launch_*`` (descriptors, grid, Triton's ``run``);
- ``jit_run``: ``kernel[grid](...)`` on arguments built once (Triton's ``JITFunction.run``:
  binder, cache key, launch);
- ``binder``: Triton's argument binder and specialization alone;
- ``direct``: the compiled kernel's own launcher, ``compiled[grid](*bound args)``, on
  arguments built once (what a bypass of ``JITFunction.run`` would cost);
- ``descriptors``: building the two operands' ``TensorDescriptor``s.

And it checks that the direct launch writes the same bytes as the public call. Prints a
table; ``--out`` writes JSON and the table (bench/results/triton_launch_h200).

    python tools/triton_launch_cost.py --out $OUT/triton_launch
"""

import argparse
import json
import time
from pathlib import Path

import torch

import bench_common  # noqa: F401  first: it puts the checkout on sys.path
from ds_fp4.ops import grouped_gemm as gg
from ds_fp4.ops import grouped_gemm_triton as ggt
from host_overhead import CALLS, host_us_per_call as host_us


def capture(kernel, launch):
    """``(args, kwargs, grid)`` of the one ``kernel[grid](...)`` call ``launch()`` makes."""
    seen = {}
    run = kernel.run

    def spy(*args, grid, warmup, **kwargs):
        seen.update(args=args, kwargs=kwargs, grid=grid)
        return run(*args, grid=grid, warmup=warmup, **kwargs)

    kernel.run = spy
    try:
        launch()
    finally:
        del kernel.run
    return seen["args"], seen["kwargs"], seen["grid"]


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def pieces(kernel, public, launcher, descriptors, out):
    """Host us of each piece of one call, and whether the direct launch matches ``public``."""
    args, kwargs, grid = capture(kernel, launcher)
    compiled = kernel[grid](*args, **kwargs)
    device = torch.cuda.current_device()
    binder = kernel.device_caches[device][4]
    bound = list(binder(*args, **kwargs)[0].values())
    runner = compiled[tuple(grid) + (1,) * (3 - len(grid))]
    out.fill_(float("nan"))
    public()
    want = out.clone()
    out.fill_(float("nan"))
    runner(*bound)
    torch.cuda.synchronize()
    same = bool(torch.equal(_bits(want), _bits(out)))
    return {
        "public": host_us(public),
        "launcher": host_us(launcher),
        "jit_run": host_us(lambda: kernel[grid](*args, **kwargs)),
        "binder": host_us(lambda: binder(*args, **kwargs)),
        "direct": host_us(lambda: runner(*bound)),
        "descriptors": host_us(descriptors),
        "stream": host_us(lambda: torch.cuda.current_stream().cuda_stream),
        "direct_equals_public": same,
    }


def m_grouped(groups=8, rows=128, n=256, k=256):
    dev = "cuda"
    a = torch.randn(groups * rows, k, device=dev).to(torch.float8_e4m3fn)
    sa = torch.rand(a.shape[0], k // 128, device=dev) + 0.5
    w = torch.randn(groups, n, k, device=dev).to(torch.float8_e4m3fn)
    sw = torch.rand(groups, n // 128, k // 128, device=dev) + 0.5
    offs = torch.arange(0, groups + 1, device=dev, dtype=torch.int32) * rows
    out = torch.empty(a.shape[0], n, dtype=torch.bfloat16, device=dev)
    return pieces(
        ggt._m_grouped_kernel,
        lambda: gg.m_grouped_gemm_fp8_nt(a, sa, w, sw, offsets=offs, out=out),
        lambda: ggt.launch_m_grouped(a, sa, w, sw, out, offs, None, False),
        lambda: (ggt._descriptor(a, (ggt.BM, 128)), ggt._descriptor(w, (128, 128))),
        out)


def k_grouped(groups=8, cols=256, m=256, n=256):
    dev = "cuda"
    a = torch.randn(m, groups * cols, device=dev).to(torch.float8_e4m3fn)
    sa = torch.rand(m, groups * cols // 128, device=dev) + 0.5
    b = torch.randn(n, groups * cols, device=dev).to(torch.float8_e4m3fn)
    sb = torch.rand(n, groups * cols // 128, device=dev) + 0.5
    offs = torch.arange(0, groups + 1, device=dev, dtype=torch.int32) * cols
    out = torch.empty(groups, m, n, dtype=torch.float32, device=dev)
    return pieces(
        ggt._k_grouped_kernel,
        lambda: gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, col_offsets=offs, out=out),
        lambda: ggt.launch_k_grouped(a, sa, b, sb, out, offs, False),
        lambda: (ggt._descriptor(a, (ggt.BM, 128)), ggt._descriptor(b, (128, 128))),
        out)


def table(rows):
    cols = ["public", "launcher", "jit_run", "binder", "direct", "descriptors", "stream"]
    lines = ["| GEMM | " + " | ".join(f"{c} (us)" for c in cols) + " | direct == public |",
             "|---|" + "---|" * (len(cols) + 1)]
    for name, r in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{r[c]:.1f}" for c in cols)
                     + f" | {r['direct_equals_public']} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for triton_launch.json and triton_launch.md")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (host time of real launches)")
    import triton
    rows = {"m_grouped (fwd, dgrad)": m_grouped(), "k_grouped (wgrad)": k_grouped()}
    text = table(rows)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
                "calls_per_round": CALLS, "rounds": 3}
        (out / "triton_launch.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
        (out / "triton_launch.md").write_text(
            f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}"
            f"\n\nHost us per call (median of 3 rounds x {CALLS} calls, GPU kept busy)\n\n"
            + text + "\n")


if __name__ == "__main__":
    main()
