"""Memory of the main job beyond one run's meter (issue 14): freeing an engine before the
next one, the peak of each phase of a step, and the largest micro batch that fits.

``release`` runs between the recipes of ``--compare`` (and between the trials of
``--find-max-batch``), so that each starts from what the previous one freed and its peak
is its own. ``PhasePeaks`` restarts the allocator's peak at each phase of one profiled
step (forward, backward, optimizer step) and reads it at the phase's end. ``largest_fitting``
is the search behind ``--find-max-batch``: doubling from 1, then bisecting.
"""

import contextlib
import gc

import torch
from deepspeed.accelerator import get_accelerator

from .metrics import PHASES


def release(acc=None):
    """Free what a deleted engine left behind and restart the allocator's peak.

    Call it once the caller holds no reference to the engine, its model or optimizer:
    DeepSpeed's engine and its modules hold each other (hooks, back references), so only
    the cycle collector frees them; ds_fp4's process-wide caches are dropped
    (``ds_fp4.release_caches``); then the allocator's free blocks go back to the device
    (graph pools included) and the peak restarts from what is still allocated.

    Returns:
        ``ds_fp4.cache_stats()`` as it was before the release (``{}`` without ds_fp4).
    """
    acc = acc or get_accelerator()
    gc.collect()
    try:
        from ds_fp4 import release_caches
    except ImportError:
        stats = {}
    else:
        stats = release_caches()
    acc.empty_cache()
    acc.reset_peak_memory_stats()
    return stats


def discard(engine, model):
    """``engine.destroy()``, then empty every parameter and gradient of ``model``.

    With ZeRO 1/2 DeepSpeed keeps the parameters that feed a gate (embeddings, attention,
    norms, the gate's own weight) alive after the engine, its optimizer and the model are
    gone, held from outside Python's reach (no Python object refers to them; measured on
    DeepSpeed 0.19.8, ``tests/test_train_memory.py``). Their data are views of ZeRO's flat
    bf16 buffer, which they would keep allocated into the next engine; emptied, the
    leftover parameter objects hold no memory.
    """
    try:
        engine.destroy()
    finally:
        with torch.no_grad():
            for p in model.parameters():
                p.grad = None
                p.data = p.data.new_empty(0)


def live_tensor_bytes():
    """Bytes of the storages of every tensor the garbage collector tracks (each storage
    once): what a process holds in tensors, counted from the objects themselves."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:   # the type, not isinstance: that reads __class__, which some modules warn on
            if not issubclass(type(obj), torch.Tensor) or obj.is_meta:
                continue
            storage = obj.untyped_storage()
        except Exception:  # noqa: BLE001 - half-built or exotic objects: not ours
            continue
        key = (storage.device, storage.data_ptr())
        if storage.data_ptr() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


class PhasePeaks:
    """Peak allocated memory (MB) in each phase of a step: ``forward``, ``backward`` and
    the optimizer ``step``.

    On GPUs each phase syncs, restarts the allocator's peak, runs and reads the peak; a
    phase that runs several times (gradient accumulation) keeps its largest. On CPU the
    process RSS has no per-phase peak, so nothing is measured and every phase reads None.

    Arguments:
        acc: the DeepSpeed accelerator.
        meter: a ``metrics.MemoryMeter`` whose window peak must survive the restarts.
    """

    def __init__(self, acc=None, meter=None):
        self.acc = acc or get_accelerator()
        self.meter = meter
        self.on = self.acc.device_name() != "cpu"
        self.peaks = {}
        self.marker = None   # memory_history's mark(name) while a history is recorded

    @contextlib.contextmanager
    def phase(self, name):
        if not self.on:
            yield
            return
        self.acc.synchronize()
        if self.meter is not None:
            self.meter.carry()
        self.acc.reset_peak_memory_stats()
        if self.marker is not None:
            self.marker(name)
        yield
        self.acc.synchronize()
        mb = self.acc.max_memory_allocated() / 2**20
        self.peaks[name] = max(self.peaks.get(name, 0.0), mb)

    def summary(self):
        """``{"peak_mem_<phase>_mb": MB or None}`` for every phase."""
        return {f"peak_mem_{p}_mb": self.peaks.get(p) for p in PHASES}


def no_phases():
    """A stand-in for ``PhasePeaks`` in steps that measure nothing."""
    class _Off:
        def phase(self, name):
            return contextlib.nullcontext()
    return _Off()


# ---- the largest micro batch that fits ---------------------------------------------------

def is_oom(err):
    """Whether ``err`` says the device ran out of memory (torch's error, or a library's
    RuntimeError that says so, e.g. cuBLAS or NCCL failing to allocate)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text
                                              or "alloc_failed" in text)


def largest_fitting(fits, limit):
    """The largest batch ``b`` in ``1..limit`` for which ``fits(b)`` is true.

    Doubles from 1 until a batch does not fit (or ``limit`` is reached), then bisects
    between the last that fit and the first that did not: about ``2 log2(answer)`` calls.
    Assumes that every batch below one that fits fits too.

    Returns:
        ``(batch, trials)``: 0 when even 1 does not fit; ``trials`` lists ``(b, fitted)``
        in the order tried.
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1; got {limit}")
    trials = []

    def ok(b):
        fitted = bool(fits(b))
        trials.append((b, fitted))
        return fitted

    lo, hi, b = 0, limit + 1, 1   # lo fits (0 trivially); hi does not (limit + 1: unknown)
    while b < hi:
        if not ok(b):
            hi = b
            break
        lo = b
        if b == limit:
            break
        b = min(2 * b, limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, trials


def fits_without_oom(run, cleanup):
    """``fits(b)`` for ``largest_fitting``: ``run(b)`` finished, or ran out of memory.

    ``run(b)`` builds and trains; an out-of-memory error means "does not fit", anything else
    is raised. ``cleanup()`` runs after every trial, once ``run``'s frames (and the error's
    traceback, which holds its tensors) are gone.
    """
    def fits(b):
        try:
            fitted = _attempt(run, b)
        finally:
            cleanup()
        return fitted
    return fits


def _attempt(run, b):
    try:
        run(b)
    except Exception as err:  # noqa: BLE001 - only an OOM is an answer; the rest re-raise
        if not is_oom(err):
            raise
        return False
    return True


def max_batch_table(found, args, fraction=None):
    """The ``--find-max-batch`` table (markdown): each recipe's largest micro batch, its
    ratio to bf16's (or the first recipe's) and the peak allocated memory at it."""
    from .report import fmt, markdown_table
    base = next((f for f in found if f["recipe"] == "bf16"), found[0])
    rows = []
    for f in found:
        ratio = f["max_micro_batch"] / base["max_micro_batch"] if base["max_micro_batch"] else None
        batch = f"{'>= ' if f['at_limit'] else ''}{f['max_micro_batch']}"
        rows.append([f["recipe"], batch, fmt(ratio, ".2f") + "x" if ratio else "-",
                     f"{f['max_micro_batch'] * args.seq_len:,}", fmt(f["peak_mem_mb"], ",.0f")])
    head = ["recipe", "largest micro batch", f"vs {base['recipe']}", "tokens per micro batch",
            "peak MB at it"]
    cap = (f"capped at {args.max_batch_memory_gb:g} GB (set_per_process_memory_fraction "
           f"{fraction:.3f})" if fraction is not None else "the whole GPU")
    notes = (f"One GPU, {cap}; a batch fits when a fresh engine trains its first steps without "
             f"running out of memory (doubling, then bisecting).")
    return markdown_table(head, rows) + "\n\n" + notes
