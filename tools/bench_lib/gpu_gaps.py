"""Where the GPU waits: idle gaps between the kernels of a torch.profiler trace, each put on
the host op that launched the kernel after it.

A layer whose wall time is above its GPU busy time leaves the GPU idle somewhere inside the
step: waiting for the host to issue the next kernel (a host-heavy stretch, or a sync that
drained the queue). ``gaps`` reads the Chrome trace torch.profiler exports (CPU and CUDA
activities): kernels, memcpys and memsets on the device, the CUDA runtime or driver calls
that launched them (matched by correlation id) and the CPU ops around those calls.
"""

from collections import defaultdict

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# torch's own kernels launch through the runtime; Triton's and CuPy's through the driver
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
MIN_GAP_US = 5.0   # gaps listed one by one from this size (all count in the summary)


def _innermost(ops, tid, ts):
    """The shortest CPU op on thread ``tid`` whose span holds ``ts`` (None if none)."""
    best = None
    for op in ops.get(tid, ()):
        if op["ts"] <= ts <= op["ts"] + op["dur"] and (best is None or op["dur"] < best["dur"]):
            best = op
    return best


def gaps(trace, min_us=MIN_GAP_US):
    """``(summary, gap list)`` of a Chrome trace dict (``traceEvents``).

    Each gap of at least ``min_us`` between one device activity's end and the next one's
    start: ``idle_us``, the kernels ``before`` and ``after`` it, ``launched_by`` (the
    innermost CPU op around the runtime call that launched ``after``; ``"?"`` if not
    found) and ``queued_us`` (how long ``after`` waited between its launch and its start:
    near zero means the GPU waited for the host). ``summary``: ``span_us`` (first start to
    last end), ``busy_us`` (the activities' summed time) and ``idle_us`` (gaps of any size).
    """
    events = trace["traceEvents"]
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS),
                    key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    ops = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op" and e.get("ph") == "X":
            ops[e["tid"]].append(e)
    found, idle, end = [], 0.0, None
    for e in device:
        if end is not None and e["ts"] > end:
            idle += e["ts"] - end
            if e["ts"] - end >= min_us:
                launch = launches.get(e.get("args", {}).get("correlation"))
                op = _innermost(ops, launch["tid"], launch["ts"]) if launch else None
                found.append({"idle_us": e["ts"] - end, "before": prev["name"],
                              "after": e["name"], "launched_by": op["name"] if op else "?",
                              "queued_us": e["ts"] - launch["ts"] if launch else None})
        if end is None or e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e
    span = (end - device[0]["ts"]) if device else 0.0
    summary = {"span_us": span, "busy_us": sum(e["dur"] for e in device), "idle_us": idle}
    return summary, found


def by_launcher(found, steps=1):
    """``[(launching op, idle us per step, gaps per step)]``, most idle first."""
    per = defaultdict(lambda: [0.0, 0])
    for g in found:
        per[g["launched_by"]][0] += g["idle_us"] / steps
        per[g["launched_by"]][1] += 1 / steps
    return sorted(((k, us, n) for k, (us, n) in per.items()), key=lambda r: -r[1])
