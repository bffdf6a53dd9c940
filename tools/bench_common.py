"""What every benchmark in tools/ shares: the environment of a measurement, median GPU
timing, and JSON + markdown output."""

import datetime
import json
import platform
from pathlib import Path

import torch


def environment():
    """GPU, library versions and date of a measurement (a dict of strings)."""
    env = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    for name in ("triton", "cupy", "deepspeed"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            pass
    return env


def median_ms(fn, warmup_ms=25, rep_ms=200):
    """Median GPU time of ``fn()`` in ms (CUDA events, L2 flushed between runs)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def markdown_table(rows, columns, fmt="{:.1f}"):
    """``rows``: list of dicts; ``columns``: keys in order. Floats through ``fmt``."""
    def cell(v):
        if isinstance(v, float):
            return fmt.format(v)
        return "" if v is None else str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_report(out, report, markdown):
    """``out``.json (``report`` plus the environment) and ``out``.md (the environment line,
    then ``markdown``); returns the markdown written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = report.setdefault("environment", environment())
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    text = ", ".join(f"{k} {v}" for k, v in env.items()) + "\n\n" + markdown + "\n"
    out.with_suffix(".md").write_text(text)
    return text
