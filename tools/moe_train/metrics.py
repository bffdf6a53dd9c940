"""What a run measures: all-to-all bytes, memory, losses; one run's result and its files.

Used by the training loop (``tools/train_moe.py``) and the layer benchmark
(``tools/bench_moe_layer.py``).
"""

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as tdist
from deepspeed.accelerator import get_accelerator

from .curve_files import open_metrics

A2A_KINDS = ("dispatch_fwd", "combine_fwd", "combine_bwd", "dispatch_bwd")
PHASES = ("forward", "backward", "step")   # memory.PhasePeaks' phases of a step


def _layer_comm_stats():
    """FP4MoE's own per-collective byte counters, or None without ds_fp4's layer."""
    try:
        from ds_fp4.moe.alltoall import comm_stats
    except ImportError:
        return None
    return comm_stats


class AllToAllCounter:
    """Bytes each rank hands to ``all_to_all_single``, labelled dispatch/combine, fwd/bwd.

    FP4MoE names its collectives (``fp4_dispatch_fwd``, ...) and counts them in
    ``ds_fp4.moe.alltoall.comm_stats``; those counts are used when present. DeepSpeed's own
    layer names nothing, so this also wraps ``torch.distributed.all_to_all_single`` (which
    ``deepspeed.comm`` calls) and labels calls by order: in the forward pass every MoE layer
    sends dispatch then combine, and autograd runs each layer's backward in reverse
    (combine's gradient, then dispatch's); AutoEP's layer (``--moe autoep``) sends the same
    four, plus its integer split counts, which are not counted. ``phase`` is set by the
    training loop; calls made while it is None are not counted.
    """

    def __init__(self):
        self.phase = None
        self._sent = {"fwd": [], "bwd": []}
        self._orig = None

    def __enter__(self):
        self._orig = tdist.all_to_all_single

        def counted(output, input, *a, **kw):
            # AutoEP exchanges its split counts (int32/int64, one per layer and forward)
            # before each dispatch: not payload, and it would shift the labels by order.
            # Packed wire rows are uint8 and stay counted.
            if not input.is_floating_point() and input.dtype != torch.uint8:
                return self._orig(output, input, *a, **kw)
            if self.phase in self._sent:
                self._sent[self.phase].append(input.numel() * input.element_size())
            return self._orig(output, input, *a, **kw)

        tdist.all_to_all_single = counted
        return self

    def __exit__(self, *exc):
        tdist.all_to_all_single = self._orig

    def begin(self):
        """Forget everything counted so far (e.g. by an evaluation)."""
        self._sent = {"fwd": [], "bwd": []}
        stats = _layer_comm_stats()
        if stats is not None:
            stats.reset()

    def take(self):
        """Bytes sent since ``begin()``: ``{kind: bytes}`` for ``A2A_KINDS``, plus ``calls``."""
        fwd, bwd = self._sent["fwd"], self._sent["bwd"]
        out = {"dispatch_fwd": sum(fwd[0::2]), "combine_fwd": sum(fwd[1::2]),
               "combine_bwd": sum(bwd[0::2]), "dispatch_bwd": sum(bwd[1::2]),
               "calls": len(fwd) + len(bwd)}
        stats = _layer_comm_stats()
        named = {k: stats.bytes.get(f"fp4_{k}", 0) for k in A2A_KINDS} if stats else {}
        if sum(named.values()):
            # Bytes of all-to-alls that are not FP4MoE's (0 unless something else sends).
            out["other"] = sum(fwd) + sum(bwd) - sum(named.values())
            out.update(named)
        self.begin()
        return out


class MemoryMeter:
    """Peak memory in windows of a run: allocated bytes on GPUs, process RSS on CPU."""

    def __init__(self):
        self.acc = get_accelerator()
        self.kind = "allocated" if self.acc.device_name() != "cpu" else "RSS"
        self.overall = 0
        self._carried = 0.0   # the window's peak from before a restart by someone else

    def reset(self):
        """Start a window: the allocator's peak restarts."""
        self._carried = 0.0
        self.acc.reset_peak_memory_stats()

    def carry(self):
        """Keep the window's peak so far: someone (``memory.PhasePeaks``) is about to
        restart the allocator's peak inside this window."""
        self._carried = max(self._carried, self.acc.max_memory_allocated() / 2**20)

    def peak_mb(self):
        """The window's peak so far (MB)."""
        peak = max(self._carried, self.acc.max_memory_allocated() / 2**20)
        self.overall = max(self.overall, peak)
        return peak


def measure_kept_for_backward(forward):
    """Memory that a forward pass leaves allocated for its backward (activations, caches).

    Arguments:
        forward: a callable running one forward pass and returning the loss tensor(s).

    Returns:
        ``(result of forward, MB)``. On GPUs the growth of allocated memory; on CPU the net
        bytes allocated by tensors created during ``forward`` (torch profiler, CPU memory).
    """
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        acc.synchronize()
        before = acc.memory_allocated()
        result = forward()
        acc.synchronize()
        return result, (acc.memory_allocated() - before) / 2**20
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = forward()
    net = sum(e.self_cpu_memory_usage for e in prof.events())
    return result, net / 2**20


@dataclass
class RunResult:
    """What one recipe's run produced (rank 0's view; losses are averaged over ranks)."""
    recipe: str
    layer: str
    fp4_moe: dict
    steps: list = field(default_factory=list)    # one dict per optimizer step
    evals: list = field(default_factory=list)    # (step, held-out loss)
    summary: dict = field(default_factory=dict)


def mean_over_ranks(values, device):
    """The mean over all ranks of each of a few floats (float64 on ``device``), as a list."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    tdist.all_reduce(t)
    return (t / tdist.get_world_size()).tolist()


def summarize(result, args, counts, mem, peaks, kept_mb, phase_peaks=None):
    """The numbers of the end table for one run; ``counts``: this rank's ``(total, expert)``
    parameters (the model's own ``count_params``); ``phase_peaks``: ``PhasePeaks.summary()``
    of the profiled step (None: not measured)."""
    steps = result.steps
    timed = [r["step_time_s"] for r in steps if not r["probe"]][min(5, len(steps) // 5):]
    step_s = sorted(timed)[len(timed) // 2] if timed else None   # None: no timed step (--eval-only)
    tail = steps[-max(1, min(50, len(steps) // 10)):] if steps else []
    total, expert = counts
    world = tdist.get_world_size()
    out = {
        "recipe": result.recipe, "layer": result.layer, "world_size": world, "ep_size": args.ep_size,
        "params": total - expert + expert * args.ep_size, "expert_params": expert * args.ep_size,
        "steps": args.steps, "steps_run": len(steps), "seed": args.seed,
        "lr": args.lr, "schedule_steps": args.schedule_steps,
        "train_loss": sum(r["lm_loss"] for r in tail) / len(tail) if tail else None,
        "heldout_loss": result.evals[-1][1],
        "step_time_ms": step_s * 1e3 if step_s else None,
        "tokens_per_s_per_gpu": steps[0]["tokens"] / step_s if step_s else None,
        "memory_kind": mem.kind, "peak_mem_mb": mem.overall,
        "peak_mem_first100_mb": peaks["first100"], "peak_mem_last100_mb": peaks["last100"],
        "kept_for_backward_mb": kept_mb,
        **(phase_peaks or {f"peak_mem_{p}_mb": None for p in PHASES}),
    }
    last = steps[-1] if steps else {}
    out.update({f"a2a_{k}_bytes": last.get(k) for k in A2A_KINDS})
    return out


def write_curves(result, out_dir):
    """``metrics_<recipe>.csv`` (every step so far) and ``eval_<recipe>.csv`` under
    ``out_dir``: written at every evaluation too, so a run stopped early keeps its curves."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"metrics_{result.recipe}.csv", "w", newline="") as f:
        fields = list(dict.fromkeys(k for rec in result.steps for k in rec)) or ["step"]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(result.steps)
    with open(out / f"eval_{result.recipe}.csv", "w", newline="") as f:
        csv.writer(f).writerows([("step", "heldout_loss"), *result.evals])


def write_outputs(results, out_dir, table):
    """metrics/eval CSV per recipe, summary.json and summary.md under ``out_dir``."""
    out = Path(out_dir)
    for r in results:
        write_curves(r, out)
    runs = [{**r.summary, "fp4_moe": r.fp4_moe, "evals": r.evals} for r in results]
    (out / "summary.json").write_text(json.dumps(runs, indent=2) + "\n")
    (out / "summary.md").write_text(table + "\n")


def _cell(text):
    """A CSV cell back as the Python value ``write_outputs`` wrote (bool, int, float or None)."""
    if text in ("True", "False"):
        return text == "True"
    if text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_outputs(out_dir):
    """The ``RunResult`` list a run wrote with ``write_outputs`` into ``out_dir``."""
    out = Path(out_dir)
    results = []
    for run in json.loads((out / "summary.json").read_text()):
        evals, fp4_moe = run.pop("evals"), run.pop("fp4_moe")
        name = run["recipe"]
        with open_metrics(out / f"metrics_{name}.csv") as f:
            steps = [{k: _cell(v) for k, v in row.items()} for row in csv.DictReader(f)]
        results.append(RunResult(recipe=name, layer=run["layer"], fp4_moe=fp4_moe, steps=steps,
                                 evals=[tuple(e) for e in evals], summary=run))
    return results
