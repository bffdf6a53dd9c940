"""tools/bench_lib/host_breakdown.py: each wrapped function gets its calls, its own time
without its children's, its inclusive time, and everything is unwrapped afterwards."""

import sys
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

from bench_lib.host_breakdown import HostBreakdown  # noqa: E402


def _toy_package():
    """A module ``toyhb`` whose ``outer`` sleeps 20 ms and calls ``inner`` (30 ms) twice,
    and an autograd Function whose backward sleeps 10 ms."""
    mod = types.ModuleType("toyhb")
    src = '''
import time
import torch

def inner():
    time.sleep(0.03)

def outer():
    time.sleep(0.02)
    inner()
    inner()

class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.01)
        return g * 2
'''
    exec(compile(src, "toyhb.py", "exec"), mod.__dict__)
    sys.modules["toyhb"] = mod
    return mod


def test_self_and_inclusive_times_and_unwrapping():
    mod = _toy_package()
    originals = (mod.outer, mod.inner, vars(mod.Twice)["backward"])
    try:
        with HostBreakdown(["toyhb"], [(torch.autograd, "backward")]) as hb:
            mod.outer()
            hb.reset()
            mod.outer()
            x = torch.ones(2, requires_grad=True)
            mod.Twice.apply(x).sum().backward()
            assert torch.equal(x.grad, torch.full((2,), 2.0))
        rows = {name: (calls, own, inc) for name, calls, own, inc in hb.table(1, by="self")}
    finally:
        del sys.modules["toyhb"]
    calls, own, inc = rows["toyhb.outer"]
    assert calls == 1 and 18 < own < 40 and 75 < inc < 120   # 20 own, 80 with inner's 60
    calls, own, inc = rows["toyhb.inner"]
    assert calls == 2 and 55 < own < 90 and abs(own - inc) < 1e-6
    calls, own, inc = rows["toyhb.Twice.backward"]
    assert calls == 1 and own >= 9
    # the engine's call holds the Function's backward: its own time excludes it
    calls, own, inc = rows["torch.autograd.backward"]
    assert calls == 1 and inc >= 9 and own < inc
    assert (mod.outer, mod.inner, vars(mod.Twice)["backward"]) == originals
    t0 = time.perf_counter()
    mod.inner()
    assert time.perf_counter() - t0 >= 0.029
