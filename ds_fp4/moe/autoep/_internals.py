"""The parts of DeepSpeed's AutoEP that the FP4 AutoEP layer calls, checked in one place.

The FP4 layer is a subclass of ``AutoEPMoELayer`` whose forward calls AutoEP's own helpers
(router, split plan, permutation, combine, output tail) in place of the two ``_AllToAllV``
calls. Those helpers are internals of DeepSpeed 0.19.8 and may move in another version, so
every conversion first checks that they are all there and fails with the version it needs.
"""

import logging

import deepspeed

logger = logging.getLogger(__name__)

REQUIRED_DEEPSPEED = "0.19.8"
_MODULE = "deepspeed.module_inject.auto_ep_layer"

# Module-level names of auto_ep_layer that the forward calls.
_FUNCTIONS = ("AutoEPMoELayer", "RouterOutput", "compute_split_plan",
              "permute_by_local_expert", "unpermute_by_local_expert", "combine_from_routed",
              "apply_scores_before_experts_if_enabled", "fused_token_ops")
# Names of deepspeed.moe.ep_kernels that the FP8 experts' 128-aligned permutation composes.
_KERNELS = ("generate_permute_indices", "permute_rows", "permute_rows_supported")
# Methods of AutoEPMoELayer it calls.
_METHODS = ("_forward", "_finalize_output", "_start_async_split_plan",
            "_wait_async_split_plan", "set_deepspeed_parallelism")
# Attributes an AutoEPMoELayer instance must carry (set in AutoEP's __init__).
_LAYER_ATTRS = ("router", "experts", "ep_size", "ep_group", "num_experts", "num_local_experts",
                "top_k", "hidden_size", "score_apply", "combine_impl", "comm_backend",
                "async_split_plan", "folding_group_handles", "expert_bias", "tokens_per_expert",
                "_fused_combine_checked")

try:
    from deepspeed.module_inject import auto_ep_layer
    from deepspeed.moe import ep_kernels
    _IMPORT_ERROR = None
except ImportError as err:  # DeepSpeed without AutoEP (< 0.19.8) or a broken install
    auto_ep_layer = ep_kernels = None
    _IMPORT_ERROR = err

_warned_version = False


class AutoEPVersionError(RuntimeError):
    """DeepSpeed's AutoEP is missing or lacks what the FP4 AutoEP layer needs."""


def _fail(what: str):
    raise AutoEPVersionError(
        f"ds_fp4's FP4 AutoEP layer needs DeepSpeed {REQUIRED_DEEPSPEED}'s AutoEP "
        f"({_MODULE}); the installed DeepSpeed {deepspeed.__version__} {what}. Install "
        f"`pip install deepspeed=={REQUIRED_DEEPSPEED}`, or set fp4_moe.enabled to false to "
        f"train AutoEP's own layer.")


def available() -> bool:
    """Whether DeepSpeed's AutoEP layer module imports (no check of its contents)."""
    return auto_ep_layer is not None


def complete() -> bool:
    """Whether this DeepSpeed has every AutoEP name the FP4 layer calls."""
    try:
        require_module()
    except AutoEPVersionError:
        return False
    return True


def require_module():
    """``deepspeed.module_inject.auto_ep_layer`` with every name the FP4 layer calls (and
    those of ``deepspeed.moe.ep_kernels`` it composes).

    Returns:
        the module.
    Raises:
        AutoEPVersionError naming DeepSpeed 0.19.8 when it or one of those names is missing.
    """
    global _warned_version
    if auto_ep_layer is None:
        _fail(f"has no AutoEP ({_IMPORT_ERROR})")
    missing = [n for n in _FUNCTIONS if not hasattr(auto_ep_layer, n)]
    missing += [f"deepspeed.moe.ep_kernels.{n}" for n in _KERNELS if not hasattr(ep_kernels, n)]
    base = getattr(auto_ep_layer, "AutoEPMoELayer", None)
    missing += [f"AutoEPMoELayer.{n}" for n in _METHODS if base is not None and not hasattr(base, n)]
    if missing:
        _fail(f"lacks {', '.join(missing)}")
    if deepspeed.__version__ != REQUIRED_DEEPSPEED and not _warned_version:
        _warned_version = True
        logger.warning("ds_fp4: the FP4 AutoEP layer was checked with DeepSpeed %s; this is %s "
                       "(its AutoEP internals are present, so it runs)", REQUIRED_DEEPSPEED,
                       deepspeed.__version__)
    return auto_ep_layer


def require_layer(layer) -> None:
    """Raise AutoEPVersionError when an AutoEPMoELayer lacks an attribute the FP4 layer reads."""
    missing = [n for n in _LAYER_ATTRS if not hasattr(layer, n)]
    if missing:
        _fail(f"builds AutoEPMoELayer without {', '.join(missing)}")
