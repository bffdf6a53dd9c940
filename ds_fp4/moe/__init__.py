"""The DeepSpeed MoE side of ds_fp4: the FP4MoE layer, its all-to-alls and FP8 experts."""

from ds_fp4.moe.alltoall import A2AHandle, CommStats, WirePlan, comm_stats
from ds_fp4.moe.cache import ExpertInputCache
from ds_fp4.moe.exactness import exactness_stats, reset_exactness
from ds_fp4.moe.expert import SwiGLUExpert
from ds_fp4.moe.fp8_experts import FP8Experts
from ds_fp4.moe.layer import FP4MoE, FP4MOELayer, check_hidden, to_fp4
from ds_fp4.moe.weight_cache import drop_all as drop_weight_tiles

__all__ = ["FP4MoE", "FP4MOELayer", "to_fp4", "check_hidden", "comm_stats", "CommStats",
           "exactness_stats", "reset_exactness", "A2AHandle", "WirePlan", "ExpertInputCache",
           "SwiGLUExpert", "FP8Experts", "drop_weight_tiles"]
