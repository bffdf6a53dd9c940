"""The DeepSpeed MoE side of ds_fp4: the FP4MoE layer, its all-to-alls and FP8 experts.

``FP8Experts`` and ``SwiGLUExpert`` are exported when their modules are present.
"""

import importlib

from ds_fp4.moe.alltoall import A2AHandle, CommStats, WirePlan, comm_stats
from ds_fp4.moe.cache import ExpertInputCache
from ds_fp4.moe.exactness import exactness_stats, reset_exactness
from ds_fp4.moe.layer import FP4MoE, FP4MOELayer, check_hidden, to_fp4

__all__ = ["FP4MoE", "FP4MOELayer", "to_fp4", "check_hidden", "comm_stats", "CommStats",
           "exactness_stats", "reset_exactness", "A2AHandle", "WirePlan", "ExpertInputCache"]


def _optional(module, name):
    """Export ``module.name`` if ``module`` exists (a missing dependency inside still raises)."""
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as err:
        if err.name != module:
            raise
        return
    globals()[name] = value
    __all__.append(name)


_optional("ds_fp4.moe.expert", "SwiGLUExpert")
_optional("ds_fp4.moe.fp8_experts", "FP8Experts")
