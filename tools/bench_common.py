"""What every benchmark in tools/ shares: the environment of a measurement, median GPU
timing, relative errors, markdown tables and JSON + markdown output.

Importing it puts the checkout on ``sys.path`` (``import ds_fp4`` then works from a
checkout); the tools run as ``python tools/X.py``, so ``tools/`` is already on it.
"""

import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"   # where the benchmarks write by default
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))


def environment(libraries=("triton", "cupy", "deepspeed")):
    """GPU, library versions and date of a measurement (a dict of strings).

    Arguments:
        libraries: the modules whose ``__version__`` is recorded (those not installed are
            left out).
    Returns:
        ``{"gpu", "torch", "python", "date", *libraries}``; ``gpu`` is "cpu" without CUDA,
        ``date`` is UTC in ISO format.
    """
    env = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    for name in libraries:
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            pass
    return env


def environment_line(env):
    """``env`` as one line of markdown: ``key value, key value, ...``."""
    return ", ".join(f"{k} {v}" for k, v in env.items())


def median_ms(fn, warmup_ms=25, rep_ms=200):
    """Median GPU time of ``fn()`` in ms (CUDA events, L2 flushed between runs)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def events_ms(fn, reps):
    """Median per-call ms of ``fn(i)`` for ``i`` in ``range(reps)``, each call bracketed by
    CUDA events (back to back: nothing flushes L2, so ``fn`` should rotate its inputs)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def rel_err(a, b):
    """``||a - b|| / ||b||`` in float32 (Frobenius norms), a Python float."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def fmt(v, spec):
    """``format(v, spec)``, or "-" for None."""
    return "-" if v is None else format(v, spec)


def markdown_table(head, rows):
    """A markdown table: the ``head`` cells, then one line per row (cells through ``str``)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def cells(records, columns, spec="{:.1f}"):
    """Rows of cells for ``markdown_table`` from dicts: ``columns`` are the keys, floats go
    through ``spec``, missing keys and None become empty cells."""
    def cell(v):
        if isinstance(v, float):
            return spec.format(v)
        return "" if v is None else str(v)
    return [[cell(r.get(c)) for c in columns] for r in records]


def write_report(out, report, markdown):
    """Write ``<out>.json`` (``report``, which should hold the environment) and
    ``<out>.md`` (``markdown``, ending in a newline); create the folder.

    Returns:
        The ``Path`` of the JSON file.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.with_suffix(".json")
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    return path
