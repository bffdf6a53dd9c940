"""The FP8 experts' weight tiles kept from one optimizer step to the next
(``fp4_moe.fp8_weight_cache``).

Each FP8 expert pass quantizes every local expert's weights to 128x128 FP8 tiles (and the
backward their transposes) from the bf16 parameters: one read of all expert weights per
GEMM kind, 1.99 ms of a 12.5 ms layer step at 32 experts x hidden 7168 on an H200
(``bench/results/profile_h200``). The weights only change at an optimizer step, so with
gradient accumulation, pipeline micro-batches or recomputation the same tiles are made
again and again. With the cache a layer makes them once per step, as Transformer Engine
does for its FP8 weights across micro-batches, and holds them (W and W^T: 2 bytes per
expert parameter, plus scales) until the next step.

When tiles are made again:
- at every ``torch.optim.Optimizer`` step (a global pre-step hook drops all caches, so the
  optimizer's own memory never adds to theirs; DeepSpeed's optimizers, ZeRO's inner one
  included, are torch optimizers);
- when a weight's storage or version counter changed (``module.to``, ``load_state_dict``,
  an in-place update under ``torch.no_grad()``).
Not seen: writes through ``param.data`` outside an optimizer step (``.data`` has a version
counter of its own). After such a write call ``drop_all()`` (``ds_fp4.moe.drop_weight_tiles``).
"""

import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

from ds_fp4.ops import fp8_tiles

__all__ = ["TileCache", "drop_all", "tile_quant", "tile_quant_stacked"]

_live = weakref.WeakSet()   # every TileCache, for the optimizer hook
_hook = []                  # the hook's handle, registered with the first cache


def tile_quant(cache, weights, per_group, transpose=False):
    """``fp8_tiles.tile_quant(weights, per_group, transpose)``, through ``cache`` (a
    ``TileCache``) when there is one."""
    if cache is None:
        return fp8_tiles.tile_quant(weights, per_group, transpose)
    return cache.get((len(weights), per_group, transpose), weights,
                     lambda: fp8_tiles.tile_quant(weights, per_group, transpose))


def tile_quant_stacked(cache, stacks, transpose=False):
    """``fp8_tiles.tile_quant_stacked(stacks, transpose)``, through ``cache`` when there is
    one."""
    if cache is None:
        return fp8_tiles.tile_quant_stacked(stacks, transpose)
    return cache.get(("stacked", len(stacks), transpose), stacks,
                     lambda: fp8_tiles.tile_quant_stacked(stacks, transpose))


def drop_all(*_):
    """Forget the tiles of every cache (the optimizer pre-step hook; also for callers that
    change weights through ``.data``)."""
    for cache in list(_live):
        cache.clear()


class TileCache:
    """One layer's FP8 weight tiles, keyed by GEMM kind, valid while the weights are the
    same tensors at the same versions and no optimizer stepped."""

    def __init__(self):
        self._tiles = {}
        _live.add(self)
        if not _hook:
            _hook.append(register_optimizer_step_pre_hook(drop_all))

    def clear(self):
        self._tiles.clear()

    def get(self, key, weights, make):
        """The tiles held under ``key`` while ``weights`` are the same tensors at the same
        versions, else ``make()`` (then held)."""
        stamp = tuple((w.data_ptr(), w._version) for w in weights)
        held = self._tiles.pop(key, None)   # a stale entry is freed before its remake
        if held is None or held[0] != stamp:
            held = (stamp, make())
        self._tiles[key] = held
        return held[1]

    def nbytes(self):
        """Bytes of the tiles and scales held."""
        return sum(t.numel() * t.element_size() for _, tiles in self._tiles.values()
                   for t in tiles)
