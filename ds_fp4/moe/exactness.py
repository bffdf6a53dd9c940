"""Exactness monitor of the FP4MoE layers' MXFP4 -> FP8 1x128 conversions (``fp4_moe.
monitor_exactness``, off by default).

The direct conversion is exact when the scale bytes of a 128-group's nonzero elements
spread by at most 14 (FORMATS.md). With the key on, each FP4MoE layer owns an
``ExactnessCounter``: an int64 ``[3]`` tensor on its device that the conversions its FP8
experts run add to as a by-product (``mxfp4_rows_to_fp8`` on the received dispatch rows in
forward, ``mxfp4_to_fp8_colwise`` on the kept rows for the weight gradients in backward;
no extra pass over the data, no host sync). Which groups count is defined in
``ds_fp4.ops.reference.mxfp4_to_fp8``: finite groups outside the exactness bound, NaN
groups, and all groups converted. Conversions that run inside captured CUDA graphs count
too (the graphs add to the same tensor on every replay).

Only what the legacy layer's FP8 experts (``ds_fp4.moe.fp8_experts``) convert is counted;
bf16 experts convert nothing (their totals stay 0); AutoEP layers with ``fp8_experts: true``
count the received rows' conversion (``autoep.fp8_experts``).

Reading, beside ``ds_fp4.moe.comm_stats``::

    from ds_fp4.moe import exactness_stats, reset_exactness
    exactness_stats(model)   # {"blocks.0.moe.deepspeed_moe": {"inexact_groups": 0, ...}}
    reset_exactness(model)

The counts are per rank (this process's layers) and accumulate until reset. They count
every conversion that runs: a forward recomputed under activation checkpointing counts again.
"""

import dataclasses
import itertools
import weakref
from typing import Dict, Optional

import torch

from ds_fp4 import formats as F

__all__ = ["ExactnessCounter", "exactness_stats", "reset_exactness"]

_names = itertools.count()
_live = weakref.WeakValueDictionary()    # registration number -> counter of a live layer


class ExactnessCounter:
    """One layer's counts: ``tensor(device)`` is what its conversions add to.

    Attributes:
        name: the layer's name where no model is given to ``exactness_stats``
            (``fp4_moe_<n>``, n in order of creation).
    """

    def __init__(self):
        number = next(_names)
        self.name = f"fp4_moe_{number}"
        self._counts = None
        _live[number] = self

    def tensor(self, device) -> torch.Tensor:
        """The int64 ``[3]`` counters on ``device`` (``F.EXACTNESS_COUNTS`` order), made
        zero on first use; moved, keeping their values, if the layer changed device."""
        device = torch.device(device)
        if self._counts is None:
            self._counts = torch.zeros(len(F.EXACTNESS_COUNTS), dtype=torch.int64, device=device)
        elif self._counts.device != device:
            self._counts = self._counts.to(device)
        return self._counts

    def reset(self) -> None:
        """Zero the counts in place (the same tensor: captured graphs keep adding to it)."""
        if self._counts is not None:
            self._counts.zero_()


def _counters(model):
    """``[(name, counter)]`` of ``model``'s monitored layers, or of every live one."""
    if model is None:
        return [(c.name, c) for _, c in sorted(_live.items())]
    return [(name, m.fp4_exactness) for name, m in model.named_modules()
            if getattr(m, "fp4_exactness", None) is not None]


def exactness_stats(model: Optional[torch.nn.Module] = None,
                    reset: bool = False) -> Dict[str, Dict[str, int]]:
    """The exactness counts of every monitored FP4MoE layer since the last reset.

    Arguments:
        model: a model holding FP4MoE layers: they are named by their module path
            (``blocks.0.moe.deepspeed_moe``). None: every monitored layer alive in this
            process, named ``fp4_moe_<n>``.
        reset: zero the counts after reading them.
    Returns:
        ``{layer name: {"inexact_groups": n, "nan_groups": n, "groups": total}}`` for this
        rank; ``{}`` when no layer has ``monitor_exactness`` on. A layer that has not
        converted anything yet reports zeros.
    Cost: one device-to-host copy, i.e. one sync, per device the layers are on (all
    counters are stacked first); nothing else is synchronised.
    """
    named = _counters(model)
    live = [(name, c._counts) for name, c in named if c._counts is not None]
    values = {}
    for device in {t.device for _, t in live}:
        on_device = [(name, t) for name, t in live if t.device == device]
        rows = torch.stack([t for _, t in on_device]).tolist()   # the one sync
        values.update({name: row for (name, _), row in zip(on_device, rows)})
    zeros = [0] * len(F.EXACTNESS_COUNTS)
    out = {name: dict(zip(F.EXACTNESS_COUNTS, values.get(name, zeros))) for name, _ in named}
    if reset:
        for _, counter in named:
            counter.reset()
    return out


def reset_exactness(model: Optional[torch.nn.Module] = None) -> None:
    """Zero the counts of ``model``'s monitored layers (None: of every live one); no sync."""
    for _, counter in _counters(model):
        counter.reset()


def attach(experts, counter: Optional[ExactnessCounter], device) -> None:
    """Hand ``counter``'s tensor on ``device`` (or None) to ``FP8Experts`` ``experts``, whose
    plan passes it to both conversions. Kept as is when already attached."""
    counts = None if counter is None else counter.tensor(device)
    if experts.plan.counts is not counts:
        experts.plan = dataclasses.replace(experts.plan, counts=counts)
