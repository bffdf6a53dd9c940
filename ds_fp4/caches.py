"""ds_fp4's process-wide caches that hold tensors, and releasing them between engines.

A process that builds one engine after another (``tools/train_moe.py --compare``, a sweep,
a notebook) should start each from what the previous one left *freed*. What ds_fp4 keeps
beyond a layer's life:

- held here and dropped by ``release_caches``: the FP8 weight-tile kernels' device tables
  of parameter addresses (``ds_fp4.ops.fp8_tiles``, at most 16, each with its pinned host
  copy) and the segment tile tables of ``mxfp4_to_fp8_colwise`` (``ds_fp4.ops.cuda``, at
  most 64). Both are rebuilt on the next call (one small host-to-device copy each); a table
  a captured CUDA graph reads stays alive through that graph (``expert_graphs`` owns it).
- owned by the layer and freed with it: the FP8 experts' CUDA graphs, their memory pools
  and their tables (``ds_fp4.moe.expert_graphs``; the ``auto`` pool budget counts live
  pools only), the cache of the experts' inputs, the wires' handles, and with
  ``fp8_weight_cache`` the FP8 weight tiles (``ds_fp4.moe.weight_cache``: the process keeps
  only weak references to those caches, and one optimizer hook that holds no tensor).
- kept, holding no tensor: compiled kernels and streams, the tuned kernel variants (a
  property of the GPU and shapes, valid for any engine),
  ``torch.compile``'d activations and the signatures of checked GEMM calls.
"""

from ds_fp4.ops import cuda, fp8_tiles   # neither imports CuPy

__all__ = ["cache_stats", "release_caches"]


def _tensor_bytes(value):
    if hasattr(value, "untyped_storage"):
        return value.untyped_storage().nbytes()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def cache_stats():
    """``{cache: {"entries": n, "bytes": b}}`` of the caches ``release_caches`` drops
    (``bytes``: storage of the tensors held; None where the cache cannot list them)."""
    stats = {}
    tables = fp8_tiles._tables
    stats["ops.fp8_tiles.weight_tables"] = {
        "entries": len(tables), "bytes": sum(_tensor_bytes(v) for v in tables.values())}
    entries = cuda._tile_table.cache_info().currsize
    stats["ops.cuda.tile_tables"] = {"entries": entries, "bytes": None if entries else 0}
    return stats


def release_caches():
    """Drop ds_fp4's process-wide caches that hold tensors (see the module's notes).

    Safe while engines live: what a live layer or graph still needs it owns itself, and
    the caches refill on the next call. Call it after deleting an engine (and running
    ``gc.collect()``), before ``torch.cuda.empty_cache()``.

    Returns:
        ``cache_stats()`` as it was before the release.
    """
    before = cache_stats()
    fp8_tiles._tables.clear()
    cuda._tile_table.cache_clear()
    return before
