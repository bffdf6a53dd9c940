"""What is live at a step's memory peak (issue 14): the allocator's history of one step,
replayed, grouped by the code that allocated each tensor.

``recorded(path)`` wraps one training step on a GPU: it turns on torch's allocation
history (``torch.cuda.memory._record_memory_history``, Python stacks), marks the phases
(the ``mark(name)`` it yields), and at the end writes ``path`` (JSON) with, for the step's peak and for each
phase's peak, the bytes allocated before the step began (parameters, gradients, optimizer
state, graph pools) and the bytes of every allocation made during the step that is still
live then, summed by allocation site: the innermost frame in ds_fp4, the tools or a model,
and the innermost frame overall (a torch or DeepSpeed function).
"""

import collections
import contextlib
import json
import os

import torch

_OURS = ("/ds_fp4/", "/tools/", "/tests/")


def _phase_marker():
    """A one-byte allocation, freed at once, whose stack marks where the next phase begins."""
    torch.empty(1, dtype=torch.uint8, device="cuda")


@contextlib.contextmanager
def recorded(path, max_entries=400_000):
    """Record the allocator's history while the body runs and write its breakdown to ``path``."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    marks = []

    def mark(name):
        marks.append(name)
        _phase_marker()
    try:
        yield mark
    finally:
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        dev = torch.cuda.current_device()
        report = breakdown(snap["device_traces"][dev], base, marks)
        report["max_memory_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def _site(frames):
    """``(ours, innermost)``: 'file:line fn' of the innermost frame in our code and overall."""
    def fmt(f):
        return f"{'/'.join(f['filename'].split('/')[-2:])}:{f['line']} {f['name']}"
    frames = [f for f in frames if not f["filename"].endswith("memory_history.py")]
    ours = next((fmt(f) for f in frames if any(o in f["filename"] for o in _OURS)), "?")
    return ours, fmt(frames[0]) if frames else "?"


def breakdown(trace, base, phase_names=(), top=20):
    """Replay ``trace`` (one device's allocation history) from ``base`` allocated bytes.

    Phases begin at the markers of ``mark`` (named in the order of ``phase_names``).
    Returns a dict with ``base_mb``, the step's ``peak`` and per-phase ``phases``, each ``{"mb", "during_step_mb", "sites": [[ours, innermost, mb, count]...]}``.
    """
    live, total, phase = {}, base, None
    best = {}           # phase -> (bytes, event index)
    marks = iter(phase_names)
    free = _free_action(trace)
    for i, ev in enumerate(trace):
        act = ev["action"]
        if act == "alloc":
            if _is_marker(ev):
                phase = next(marks, phase)
                continue
            live[ev["addr"]] = ev
            total += ev["size"]
        elif act == free and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
        else:
            continue
        for key in ("step", phase):
            if key is not None and total > best.get(key, (-1, 0))[0]:
                best[key] = (total, i)
    return {"base_mb": base / 2**20,
            "peak": _live_at(trace, best.get("step", (base, -1)), base, free, top),
            "phases": {p: _live_at(trace, best[p], base, free, top) for p in best if p != "step"}}


def _is_marker(ev):
    """Whether an allocation is ``_phase_marker``'s (not counted: it only marks a phase)."""
    return any(f["name"] == "_phase_marker" for f in ev["frames"][:3])


def _free_action(trace):
    """The event that returns a block's bytes: ``free_completed`` (after its streams' work
    is done) where the history records it, else ``free_requested``."""
    return ("free_completed" if any(e["action"] == "free_completed" for e in trace)
            else "free_requested")


def _live_at(trace, best, base, free, top):
    """The allocations made during the step that are live right after event ``best[1]``."""
    total, idx = best
    live = {}
    for ev in trace[: idx + 1]:
        if ev["action"] == "alloc" and not _is_marker(ev):
            live[ev["addr"]] = ev
        elif ev["action"] == free:
            live.pop(ev["addr"], None)
    sites = collections.defaultdict(lambda: [0, 0])
    for ev in live.values():
        s = sites[_site(ev["frames"])]
        s[0] += ev["size"]
        s[1] += 1
    rows = sorted(([o, i, b / 2**20, n] for (o, i), (b, n) in sites.items()),
                  key=lambda r: -r[2])
    return {"mb": total / 2**20, "during_step_mb": (total - base) / 2**20,
            "sites": rows[:top]}
