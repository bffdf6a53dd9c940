"""The ds_fp4 recipe on DeepSpeed's AutoEP (dropless MoE layers of Hugging Face models).

``deepspeed.initialize`` with an ``expert_parallel`` section replaces a model's MoE blocks
by ``AutoEPMoELayer``; ``ds_fp4.initialize`` / ``ds_fp4.configure(engine)`` then turn each
into an ``FP4AutoEPMoELayer`` (``convert_autoep``). Needs DeepSpeed 0.19.8.
"""

from ds_fp4.moe.autoep._internals import REQUIRED_DEEPSPEED, AutoEPVersionError, available
from ds_fp4.moe.autoep.convert import (autoep_layers, check_ds_config, check_layer,
                                       config_errors, convert_autoep, to_fp4_autoep)
from ds_fp4.moe.autoep.experts import run_local_experts
from ds_fp4.moe.autoep.layer import FP4AutoEPMoELayer

__all__ = ["FP4AutoEPMoELayer", "to_fp4_autoep", "convert_autoep", "check_ds_config",
           "check_layer", "config_errors", "autoep_layers", "run_local_experts",
           "AutoEPVersionError", "REQUIRED_DEEPSPEED", "available"]
