"""Where the GPU waits: idle gaps between the kernels of a torch.profiler trace, each put on
the host op that launched the kernel after it.

A layer whose wall time is above its GPU busy time leaves the GPU idle somewhere inside the
step: waiting for the host to issue the next kernel (a host-heavy stretch, or a sync that
drained the queue). ``gaps`` reads the Chrome trace torch.profiler exports (CPU and CUDA
activities): kernels, memcpys and memsets on the device, the CUDA runtime or driver calls
that launched them (matched by correlation id) and the CPU ops around those calls; with
``with_stack`` profiles also the Python frames around them. ``long_calls`` lists the
runtime and driver calls that held the host (a sync waits in one of them); ``host_pieces``
the host's time per autograd Function forward and backward node.
"""

import statistics
from collections import defaultdict

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# torch's own kernels launch through the runtime; Triton's and CuPy's through the driver
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
MIN_GAP_US = 5.0   # gaps listed one by one from this size (all count in the summary)
MIN_CALL_US = 30.0   # runtime/driver calls listed by long_calls from this size
FRAMES = 3   # Python frames of our code named per gap (innermost first)
# Python frames worth naming: the package and the tools, not torch's or the profiler's own
OUR_CODE = ("ds_fp4/", "tools/", "deepspeed/")


def _spans(events, cat):
    """``{tid: [events of category cat]}``, complete ("X") events only."""
    spans = defaultdict(list)
    for e in events:
        if e.get("cat") == cat and e.get("ph") == "X":
            spans[e["tid"]].append(e)
    return spans


def _enclosing(spans, tid, ts):
    """The events on thread ``tid`` whose span holds ``ts``, innermost (shortest) first."""
    held = [e for e in spans.get(tid, ()) if e["ts"] <= ts <= e["ts"] + e["dur"]]
    return sorted(held, key=lambda e: e["dur"])


def _where(frames, tid, ts):
    """The innermost ``FRAMES`` Python frames of our code around ``ts`` (innermost first),
    joined by " < "; "" without Python frames in the trace."""
    names = [e["name"] for e in _enclosing(frames, tid, ts)
             if any(s in e["name"] for s in OUR_CODE)]
    return " < ".join(n.split("site-packages/")[-1] for n in names[:FRAMES])


def _host(ops, frames, call):
    """``(innermost CPU op, Python frames)`` around a runtime call (``"?"``, "" if none)."""
    if call is None:
        return "?", ""
    inner = _enclosing(ops, call["tid"], call["ts"])
    return (inner[0]["name"] if inner else "?"), _where(frames, call["tid"], call["ts"])


def gaps(trace, min_us=MIN_GAP_US):
    """``(summary, gap list)`` of a Chrome trace dict (``traceEvents``).

    Each gap of at least ``min_us`` between one device activity's end and the next one's
    start: ``idle_us``, the kernels ``before`` and ``after`` it, ``launched_by`` (the
    innermost CPU op around the runtime call that launched ``after``; ``"?"`` if not
    found), ``where`` (our Python frames around that call, "" without them) and
    ``queued_us`` (how long ``after`` waited between its launch and its start: near zero
    means the GPU waited for the host). ``summary``: ``span_us`` (first start to last end),
    ``busy_us`` (the activities' summed time) and ``idle_us`` (gaps of any size).
    """
    events = trace["traceEvents"]
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS),
                    key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    ops, frames = _spans(events, "cpu_op"), _spans(events, "python_function")
    found, idle, end = [], 0.0, None
    for e in device:
        if end is not None and e["ts"] > end:
            idle += e["ts"] - end
            if e["ts"] - end >= min_us:
                launch = launches.get(e.get("args", {}).get("correlation"))
                op, where = _host(ops, frames, launch)
                found.append({"idle_us": e["ts"] - end, "before": prev["name"],
                              "after": e["name"], "launched_by": op, "where": where,
                              "queued_us": e["ts"] - launch["ts"] if launch else None})
        if end is None or e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e
    span = (end - device[0]["ts"]) if device else 0.0
    summary = {"span_us": span, "busy_us": sum(e["dur"] for e in device), "idle_us": idle}
    return summary, found


def long_calls(trace, min_us=MIN_CALL_US, steps=1):
    """``[(call name, innermost CPU op, Python frames, us per step, calls per step)]`` of
    the runtime and driver calls of at least ``min_us``, most time first: where the host
    waited (a sync, an allocation, a module load)."""
    events = trace["traceEvents"]
    ops, frames = _spans(events, "cpu_op"), _spans(events, "python_function")
    per = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") in LAUNCH_CATS and e.get("ph") == "X" and e["dur"] >= min_us:
            op, where = _host(ops, frames, e)
            per[(e["name"], op, where)][0] += e["dur"] / steps
            per[(e["name"], op, where)][1] += 1 / steps
    return sorted((k + (us, n) for k, (us, n) in per.items()), key=lambda r: -r[3])


BACKWARD = "autograd::engine::evaluate_function: "   # a backward node's event in the trace


def host_pieces(trace, steps=1):
    """``[(name, calls per step, median us a call, us per step)]``, most time first: the
    host's top-level pieces of work, the CPU ops that are neither aten ops nor inside
    another such piece on their thread. In a layer step: each autograd Function's forward
    (named by its class) and each backward node (``"X (backward)"``: its whole
    evaluation, AccumulateGrad's included). The median over calls is robust to a first
    step's one-time work."""
    by_thread = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op" and not e["name"].startswith("aten::"):
            by_thread[e["tid"]].append(e)
    durations = defaultdict(list)
    for events in by_thread.values():
        end = None   # where the latest top-level piece ends: events before it lie inside
        for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            if end is not None and e["ts"] + e["dur"] <= end:
                continue
            end = e["ts"] + e["dur"]
            name = e["name"]
            if name.startswith(BACKWARD):
                name = name[len(BACKWARD):].removesuffix("Backward") + " (backward)"
            durations[name].append(e["dur"])
    rows = [(name, len(d) / steps, statistics.median(d), sum(d) / steps)
            for name, d in durations.items()]
    return sorted(rows, key=lambda r: -r[3])


def by_launcher(found, steps=1):
    """``[(launching op, idle us per step, gaps per step)]``, most idle first; the op is
    named with its Python frames where the trace has them."""
    per = defaultdict(lambda: [0.0, 0])
    for g in found:
        key = g["launched_by"] + (f" @ {g['where']}" if g.get("where") else "")
        per[key][0] += g["idle_us"] / steps
        per[key][1] += 1 / steps
    return sorted(((k, us, n) for k, (us, n) in per.items()), key=lambda r: -r[1])
