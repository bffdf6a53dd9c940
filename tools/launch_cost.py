"""Host time of one CuPy kernel launch of ds_fp4, through CuPy's call and through the direct
``cuLaunchKernel`` path of ``ds_fp4.ops._cuda_loader.launch``, and the outputs of both.

Each op runs on a tensor small enough that the GPU keeps up with the host, ``--calls``
times from a synchronized start: the host time per call is what the host spends issuing it
(the op's Python wrapper included). Both paths must give the same bytes. GPU only::

    python tools/launch_cost.py --out bench/results/launch_cost_h200
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS.parent))
sys.path.insert(0, str(TOOLS))

from bench_common import environment, environment_line  # noqa: E402
from ds_fp4 import ops  # noqa: E402
from ds_fp4.ops import _cuda_loader as L  # noqa: E402


def _ops(device):
    """``{name: callable returning the op's outputs}`` on small CUDA inputs."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(256, 1024, device=device, generator=g).to(torch.bfloat16)
    rows = ops.quantize_mxfp4_rows(x)
    w = [torch.randn(256, 256, device=device, generator=g).to(torch.bfloat16) for _ in range(4)]
    a, sa = ops.quantize_fp8(x[:, :256].contiguous())
    tiles = [ops.quantize_fp8_tiles(t) for t in w]
    wt, wts = torch.stack([t[0] for t in tiles]), torch.stack([t[1] for t in tiles])
    return {
        # a Triton launch, for scale (the path switch does not touch it)
        "m_grouped_gemm_fp8_nt, 4 groups (Triton)":
            lambda: ops.m_grouped_gemm_fp8_nt(a, sa, wt, wts, group_rows=64),
        "quantize_fp8 (8 args)": lambda: ops.quantize_fp8(x),
        "quantize_mxfp4_rows": lambda: ops.quantize_mxfp4_rows(x),
        "mxfp4_rows_to_fp8 (9 args)": lambda: ops.mxfp4_rows_to_fp8(rows, 1024),
        "tile_quant, 4 weights (12 args)": lambda: ops.tile_quant(w, 1),
    }


_ADDRESS = L._function_address


def _path(direct):
    """Make every kernel launch from now on take the direct path, or CuPy's call (a kernel
    without an address takes CuPy's)."""
    L._functions.clear()
    L._function_address = _ADDRESS if direct else (lambda fn: None)


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def measure(fn, calls):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    rows, outputs = {}, {}
    for rnd in range(args.rounds):
        for direct in (False, True):
            _path(direct)
            for name, fn in _ops(device).items():
                row = rows.setdefault(name, {"cupy": [], "direct": []})
                try:
                    row["direct" if direct else "cupy"].append(measure(fn, args.calls))
                    if rnd == 0:
                        outputs[(name, direct)] = [t.clone() for t in _flat(fn())]
                except Exception as err:   # one op's failure must not hide the others'
                    row["error"] = f"{type(err).__name__}: {err}"
    for name in rows:
        if (name, False) not in outputs or (name, True) not in outputs:
            rows[name]["same_bytes"] = None
            continue
        a, b = outputs[(name, False)], outputs[(name, True)]
        rows[name]["same_bytes"] = len(a) == len(b) and all(
            x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
            for x, y in zip(a, b))
    result = {"environment": environment(), "calls": args.calls, "rounds": args.rounds,
              "direct_path_available": all(a is not None for _, a in L._functions.values()),
              "host_us_per_call": rows}
    lines = ["| op | CuPy call, us | direct, us | same bytes |", "|---|---|---|---|"]
    for name, r in rows.items():
        best = [f"{min(r[k]):.1f}" if r[k] else r.get("error", "-") for k in ("cupy", "direct")]
        lines.append(f"| {name} | {best[0]} | {best[1]} | {r['same_bytes']} |")
    table = "\n".join(lines)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch_cost.json").write_text(json.dumps(result, indent=1))
    (out / "launch_cost.md").write_text(
        f"# Host time per launch (min of {args.rounds} rounds of {args.calls} calls)\n\n"
        f"{environment_line(result['environment'])}\n\n{table}\n")
    print(table)
    print("direct path available:", result["direct_path_available"])


if __name__ == "__main__":
    main()
