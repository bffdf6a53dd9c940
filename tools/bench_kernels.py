"""Benchmark ds_fp4's CUDA kernels against a same-run device-to-device copy (issue 3).

For each shape (default 16384x7168 and 4096x2048, bf16) and each kernel: a correctness
check against the reference first (bytes, ``ds_fp4.ops.compare``), then the median time
of the kernel alone (CUDA-graph replays of back-to-back launches that rotate over several
input and ``out=`` sets, so nothing stays in L2), achieved GB/s with the bytes read + written
counted explicitly, and the ratio to the copy bandwidth measured in the same run; beside
it, the reference op compiled with torch.compile (and torchao's to_mx when installed).

    python tools/bench_kernels.py --out DIR [--shapes 16384x7168,4096x2048] [--no-compile]

Writes DIR/kernels_h200.json and DIR/kernels_h200.md and prints the table.
"""

import argparse
import math
import os
import statistics
import time

import torch

import bench_common  # first: it puts the checkout on sys.path (tools/ is, run by path)
from bench_common import events_ms, markdown_table
from ds_fp4 import formats as F
from ds_fp4.ops import cuda, reference
from ds_fp4.ops.compare import first_mismatch

DEV = torch.device("cuda")


def assert_same(got, want, what):
    """Raise AssertionError naming the first difference unless the bytes are the same."""
    message = first_mismatch(got, want, what)
    if message:
        raise AssertionError(message)


def graph_ms(fn, n_sets, replays=15):
    """Median per-launch ms: a CUDA graph of max(20, n_sets) launches (rotating over the
    input sets), replayed ``replays`` times, each replay timed with events."""
    per_graph = max(20, n_sets)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(n_sets):              # warm up on the capture stream (CuPy stream)
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(per_graph):
            fn(i % n_sets)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / per_graph)
    return statistics.median(times), min(times), max(times)


def copy_gbps(nbytes, reps=30):
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = events_ms(lambda i: dst.copy_(src), reps)
    return 2 * nbytes / ms / 1e6, ms


# ---- kernel cases ------------------------------------------------------------------------


def ragged_lengths(t, groups, seed=0):
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, t + 1, (groups - 1,), generator=g).tolist())
    bounds = [0] + cuts + [t]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def make_cases(m, k, n_sets):
    """[(name, bytes, kernel(i), public(i), reference(i))] over ``n_sets`` input sets; the
    kernel closures write into per-set outputs too, so no set is served from L2."""
    g = torch.Generator(device=DEV).manual_seed(m + k)
    sets = range(n_sets)
    xs = [torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16) for _ in sets]
    mx = [cuda.quantize_mxfp4(x) for x in xs]
    mx_rows = [cuda.quantize_mxfp4_rows(x) for x in xs]
    f8 = [cuda.quantize_fp8(x) for x in xs]
    mk = m * k

    def empty(*shape, dtype=torch.uint8):
        return [torch.empty(*shape, dtype=dtype, device=DEV) for _ in sets]

    cases = []
    # 1. bf16 -> MXFP4 (rceil), separate tensors and the packed wire rows
    od, os_ = empty(m, k // 2), empty(m, k // 32)
    cases.append(("quantize_mxfp4", 2 * mk + mk // 2 + mk // 32,
                  lambda i: cuda.quantize_mxfp4(xs[i], out=(od[i], os_[i])),
                  lambda i: cuda.quantize_mxfp4(xs[i]), lambda i: reference.quantize_mxfp4(xs[i])))
    orows = empty(m, F.mxfp4_row_bytes(k))
    cases.append(("quantize_mxfp4_rows", 2 * mk + mk // 2 + mk // 32,
                  lambda i: cuda.quantize_mxfp4_rows(xs[i], out=orows[i]),
                  lambda i: cuda.quantize_mxfp4_rows(xs[i]),
                  lambda i: reference.quantize_mxfp4_rows(xs[i])))
    # 2. MXFP4 -> bf16
    ox = empty(m, k, dtype=torch.bfloat16)
    cases.append(("dequantize_mxfp4", mk // 2 + mk // 32 + 2 * mk,
                  lambda i: cuda.dequantize_mxfp4(*mx[i], out=ox[i]),
                  lambda i: cuda.dequantize_mxfp4(*mx[i]),
                  lambda i: reference.dequantize_mxfp4(*mx[i])))
    # 3. bf16 -> FP8 1x128 (column-major float32 scales), and the packed FP8 rows
    of8 = [cuda.quantize_fp8(x) for x in xs]          # outputs in the returned layout
    cases.append(("quantize_fp8", 2 * mk + mk + 4 * mk // 128,
                  lambda i: cuda.quantize_fp8(xs[i], out=of8[i]),
                  lambda i: cuda.quantize_fp8(xs[i]), lambda i: reference.quantize_fp8(xs[i])))
    ofr = empty(m, F.fp8_row_bytes(k))
    cases.append(("quantize_fp8_rows", 2 * mk + mk + mk // 128,
                  lambda i: cuda.quantize_fp8_rows(xs[i], out=ofr[i]),
                  lambda i: cuda.quantize_fp8_rows(xs[i]),
                  lambda i: reference.quantize_fp8_rows(xs[i])))
    # 4. FP8 1x128 -> bf16
    cases.append(("dequantize_fp8", mk + 4 * mk // 128 + 2 * mk,
                  lambda i: cuda.dequantize_fp8(*f8[i], out=ox[i]),
                  lambda i: cuda.dequantize_fp8(*f8[i]), lambda i: reference.dequantize_fp8(*f8[i])))
    # 5. direct MXFP4 -> FP8 1x128, from separate tensors and from packed rows
    cases.append(("mxfp4_to_fp8", mk // 2 + mk // 32 + mk + 4 * mk // 128,
                  lambda i: cuda.mxfp4_to_fp8(*mx[i], out=of8[i]),
                  lambda i: cuda.mxfp4_to_fp8(*mx[i]), lambda i: reference.mxfp4_to_fp8(*mx[i])))
    # the same with exactness counts (fp4_moe.monitor_exactness): the counting instance;
    # its correctness check compares the data only (the counts are tested on the CPU and
    # in tests/test_exactness.py's GPU tests)
    cnt = [torch.zeros(len(F.EXACTNESS_COUNTS), dtype=torch.int64, device=DEV) for _ in sets]
    cases.append(("mxfp4_to_fp8 +counts", mk // 2 + mk // 32 + mk + 4 * mk // 128,
                  lambda i: cuda.mxfp4_to_fp8(*mx[i], counts=cnt[i], out=of8[i]),
                  lambda i: cuda.mxfp4_to_fp8(*mx[i], counts=cnt[i]),
                  lambda i: reference.mxfp4_to_fp8(*mx[i])))
    cases.append(("mxfp4_rows_to_fp8", mk // 2 + mk // 32 + mk + 4 * mk // 128,
                  lambda i: cuda.mxfp4_rows_to_fp8(mx_rows[i], out=of8[i]),
                  lambda i: cuda.mxfp4_rows_to_fp8(mx_rows[i]),
                  lambda i: reference.mxfp4_rows_to_fp8(mx_rows[i])))
    # 6. MXFP4 rows -> FP8 columns, 8 ragged segments (host offsets: no sync in a capture)
    lengths = ragged_lengths(m, 8)
    bounds = [0] + [sum(lengths[: j + 1]) for j in range(8)]
    offsets = torch.tensor(bounds, dtype=torch.int32, device=DEV)
    oc = [cuda.mxfp4_to_fp8_colwise(*mx[i], bounds) for i in sets]
    wcol = oc[0][0].shape[1]
    cases.append(("mxfp4_to_fp8_colwise (8 segs)",
                  mk // 2 + mk // 32 + k * wcol + 4 * k * wcol // 128,
                  lambda i: cuda.mxfp4_to_fp8_colwise(*mx[i], bounds, out=oc[i]),
                  lambda i: cuda.mxfp4_to_fp8_colwise(*mx[i], offsets),
                  lambda i: reference.mxfp4_to_fp8_colwise(*mx[i], offsets)))
    cases.append(("colwise +counts (8 segs)",
                  mk // 2 + mk // 32 + k * wcol + 4 * k * wcol // 128,
                  lambda i: cuda.mxfp4_to_fp8_colwise(*mx[i], bounds, counts=cnt[i], out=oc[i]),
                  lambda i: cuda.mxfp4_to_fp8_colwise(*mx[i], offsets, counts=cnt[i]),
                  lambda i: reference.mxfp4_to_fp8_colwise(*mx[i], offsets)))
    return cases, xs, mx, f8, offsets


# Inductor cannot compile the reference's float64 -> float8 casts (Triton has no such
# conversion), so the FP8-producing ops are compiled from float32 twins of the reference:
# the same rules, exact in float32 for these inputs, checked equal to the reference below.
_FP8_VM, _FP8_VE = math.frexp(F.E4M3_MAX)


def f32_quantize_fp8(x):
    m, k = x.shape
    g = x.float().view(m, k // F.FP8_GROUP, F.FP8_GROUP)
    amax = g.abs().amax(-1)
    mant, ex = torch.frexp(amax)
    e = torch.where(mant <= _FP8_VM, ex - _FP8_VE, ex - _FP8_VE + 1)
    e = torch.where(amax == 0, 0, e).clamp(F.FP8_EXP_MIN, F.FP8_EXP_MAX)
    scale = torch.ldexp(torch.ones_like(amax), e)
    data = (g / scale.unsqueeze(-1)).clamp(-F.E4M3_MAX, F.E4M3_MAX).to(F.FP8_DTYPE)
    return data.view(m, k), scale.t().contiguous().t()


def f32_dequantize_fp8(data, scales):
    m, k = data.shape
    g = data.float().view(m, k // F.FP8_GROUP, F.FP8_GROUP) * scales.unsqueeze(-1)
    return g.view(m, k).to(torch.bfloat16)


def f32_mxfp4_to_fp8(data, scales):
    return f32_quantize_fp8(reference.dequantize_mxfp4(data, scales, torch.float32))


def f32_colwise(data, scales, offsets):
    bounds = offsets.tolist()
    x = reference.dequantize_mxfp4(data, scales, torch.float32)
    cols = []
    for a, b in zip(bounds, bounds[1:]):
        seg = x.new_zeros(-(b - a) // F.FP8_GROUP * -F.FP8_GROUP, x.shape[1])
        seg[: b - a] = x[a:b]
        cols.append(seg.t())
    return f32_quantize_fp8(torch.cat(cols, dim=1))


BASELINE_FNS = {
    "quantize_mxfp4": reference.quantize_mxfp4,
    "dequantize_mxfp4": reference.dequantize_mxfp4,
    "quantize_fp8": f32_quantize_fp8,
    "dequantize_fp8": f32_dequantize_fp8,
    "mxfp4_to_fp8": f32_mxfp4_to_fp8,
    "mxfp4_to_fp8_colwise (8 segs)": f32_colwise,
}

BASELINE_OPS = {   # reference op -> argument builder over (xs, mx, f8, offsets, i)
    "quantize_mxfp4": lambda xs, mx, f8, off, i: (xs[i],),
    "dequantize_mxfp4": lambda xs, mx, f8, off, i: mx[i],
    "quantize_fp8": lambda xs, mx, f8, off, i: (xs[i],),
    "dequantize_fp8": lambda xs, mx, f8, off, i: f8[i],
    "mxfp4_to_fp8": lambda xs, mx, f8, off, i: mx[i],
    "mxfp4_to_fp8_colwise (8 segs)": lambda xs, mx, f8, off, i: (*mx[i], off),
}


def compiled_baseline(name, args_of, n_sets, budget_s):
    """ms of the compiled baseline of ``name`` (events around each call, median), its
    compile time, and whether its output equals the reference's byte for byte."""
    fn = torch.compile(BASELINE_FNS[name], dynamic=False)
    t0 = time.time()
    out = fn(*args_of(0))                    # compile
    torch.cuda.synchronize()
    compile_s = time.time() - t0
    try:
        assert_same(out, getattr(reference, name.split(" ")[0])(*args_of(0)), name)
        equal = True
    except BaseException:  # noqa: BLE001 - recorded, not fatal
        equal = False
    for i in range(n_sets):
        fn(*args_of(i))
    ms = events_ms(lambda i: fn(*args_of(i % n_sets)), 20)
    return ms, compile_s, equal


def torchao_baseline(xs, n_sets):
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception as err:  # noqa: BLE001 - any import failure means "not available"
        return None, f"torchao not installed ({type(err).__name__})"
    fn = torch.compile(lambda x: to_mx(x, torch.float4_e2m1fn_x2, 32))
    fn(xs[0])
    ms = events_ms(lambda i: fn(xs[i % n_sets]), 20)
    return ms, "torchao to_mx(x, float4_e2m1fn_x2, 32), torch.compile"


def run_shape(m, k, copy_ref, do_compile, budget):
    # every rotation touches >= 240 MB (4x the 60 MB L2) of the smallest operand (MXFP4)
    n_sets = max(2, min(64, math.ceil(240e6 / (m * k * 17 // 32))))
    cases, xs, mx, f8, offsets = make_cases(m, k, n_sets)
    rows = []
    for name, nbytes, kernel, public, ref in cases:
        try:
            assert_same(public(0), ref(0), f"{name} {m}x{k}")      # correctness first
        except BaseException as err:  # noqa: BLE001 - report the mismatch, time the rest
            rows.append({"kernel": name, "shape": f"{m}x{k}", "correct": False,
                         "error": str(err)[:300]})
            print(f"  {name}: NOT EQUAL TO THE REFERENCE: {str(err)[:200]}", flush=True)
            continue
        med, lo, hi = graph_ms(kernel, n_sets)
        public_ms = events_ms(lambda i: public(i % n_sets), 20)
        gbps = nbytes / med / 1e6
        row = {"kernel": name, "shape": f"{m}x{k}", "correct": True, "bytes": nbytes,
               "median_us": med * 1e3,
               "min_us": lo * 1e3, "max_us": hi * 1e3, "gbps": gbps,
               "pct_of_copy": 100 * gbps / copy_ref, "public_call_us": public_ms * 1e3,
               "floor_us": nbytes / copy_ref / 1e3}
        base = name if name in BASELINE_OPS else None
        if do_compile and base and budget["left"] > 0:
            t0 = time.time()
            try:
                bms, cs, eq = compiled_baseline(
                    base, lambda i: BASELINE_OPS[base](xs, mx, f8, offsets, i), n_sets,
                    budget["left"])
                row.update(compiled_us=bms * 1e3, compiled_gbps=nbytes / bms / 1e6,
                           speedup_vs_compiled=bms / med, compile_s=cs,
                           compiled_fn=BASELINE_FNS[base].__name__,
                           compiled_equals_reference=eq)
            except Exception as err:  # noqa: BLE001 - a baseline failing must not stop the bench
                row["compiled_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            budget["left"] -= time.time() - t0
        rows.append(row)
        print(f"  {name:32s} {med * 1e3:8.1f} us {gbps:7.0f} GB/s {row['pct_of_copy']:5.1f}% "
              f"of copy" + (f"  compiled {row['compiled_us']:8.1f} us" if "compiled_us" in row else ""),
              flush=True)
    ao_ms, ao_note = (torchao_baseline(xs, n_sets) if do_compile else (None, "skipped"))
    extra = {"torchao_to_mx_us": ao_ms * 1e3 if ao_ms else None, "torchao_note": ao_note}
    cases = xs = mx = f8 = None   # free the inputs (the lambdas above are done with them)
    torch.cuda.empty_cache()
    return rows, extra


def markdown(result):
    lines = [f"# ds_fp4 kernels on {result['gpu']}", "",
             f"{result['date']}; torch {result['torch']}, CuPy {result['cupy']}, CUDA "
             f"{result['cuda']}. Copy bandwidth (same run, read + write): "
             + ", ".join(f"{s}: {v['gbps']:.0f} GB/s" for s, v in result["copy"].items()) + ".",
             "", "Kernel time = median of CUDA-graph replays (back-to-back launches over rotating "
             "inputs and outputs); bytes = read + written, counted explicitly; % = achieved / copy "
             "GB/s; floor = bytes / copy GB/s. Baseline: torch.compile of the reference op "
             "(MXFP4 ops) or of its float32 twin (FP8 ops: Inductor cannot compile the "
             "reference's float64 -> float8 cast); each baseline's output is checked equal to "
             "the reference (json: compiled_equals_reference).", ""]
    head = ["kernel", "shape", "us", "GB/s", "% of copy", "floor us", "torch.compile baseline us",
            "x faster"]
    rows = []
    for r in result["rows"]:
        if not r.get("correct", True):
            rows.append([r["kernel"], r["shape"], "NOT EQUAL TO REFERENCE"] + [""] * 5)
            continue
        comp = f"{r['compiled_us']:.1f}" if "compiled_us" in r else r.get("compiled_error", "-")[:40]
        sp = f"{r['speedup_vs_compiled']:.1f}" if "speedup_vs_compiled" in r else "-"
        rows.append([r["kernel"], r["shape"], f"{r['median_us']:.1f}", f"{r['gbps']:.0f}",
                     f"{r['pct_of_copy']:.1f}", f"{r['floor_us']:.1f}", comp, sp])
    lines.append(markdown_table(head, rows))
    for shape, ex in result["extra"].items():
        lines.append(f"\ntorchao ({shape}): " + (f"{ex['torchao_to_mx_us']:.1f} us" if
                                                ex["torchao_to_mx_us"] else ex["torchao_note"]))
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--shapes", default="16384x7168,4096x2048")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile baselines")
    ap.add_argument("--compile-shapes", default="16384x7168",
                    help="shapes that also get the torch.compile baselines")
    ap.add_argument("--compile-budget-s", type=float, default=240)
    args = ap.parse_args()
    env = bench_common.environment(libraries=("cupy",))
    result = {"gpu": env["gpu"], "torch": env["torch"], "cupy": env["cupy"],
              "cuda": torch.version.cuda, "date": env["date"],
              "method": "CUDA graph of max(20, sets) launches, median of 15 replays; inputs and "
                        "outputs rotate over sets (>= 240 MB of MXFP4); copy = torch copy_ "
                        "of a uint8 buffer, median of 30",
              "copy": {}, "rows": [], "extra": {}}
    copy_big, _ = copy_gbps(1 << 30)
    result["copy"]["1GiB"] = {"gbps": copy_big}
    budget = {"left": args.compile_budget_s}
    for shape in args.shapes.split(","):
        m, k = map(int, shape.split("x"))
        c_gbps, _ = copy_gbps(2 * m * k)
        result["copy"][shape] = {"gbps": c_gbps}
        copy_ref = max(copy_big, c_gbps)
        print(f"{shape}: copy {c_gbps:.0f} GB/s (1 GiB: {copy_big:.0f}); ratios use {copy_ref:.0f}",
              flush=True)
        rows, extra = run_shape(m, k, copy_ref, not args.no_compile and shape in args.compile_shapes,
                                budget)
        result["rows"] += rows
        result["extra"][shape] = extra
    md = markdown(result)
    bench_common.write_report(os.path.join(args.out, "kernels_h200"), result, md)
    print(md)


if __name__ == "__main__":
    main()
