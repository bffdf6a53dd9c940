"""ds_fp4: FP4 (MXFP4) dispatch and FP8 backward for DeepSpeed MoE on Hopper GPUs.

``ds_fp4.ops`` needs only torch; the DeepSpeed-facing API below is imported on first use so
that the ops work without DeepSpeed.
"""

__version__ = "0.1.0"

_LAZY = {
    "convert": "ds_fp4.api",
    "initialize": "ds_fp4.api",
    "configure": "ds_fp4.api",
    "FP4MoEConfig": "ds_fp4.config",
    "FP4MoE": "ds_fp4.moe",
    "comm_stats": "ds_fp4.moe",
    "release_caches": "ds_fp4.caches",
    "cache_stats": "ds_fp4.caches",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ds_fp4' has no attribute {name!r}")
