"""Turning AutoEP layers into FP4 ones, and the checks that run first.

The ``fp4_moe`` keys mean for AutoEP what they mean for the legacy layer. ``fp8_experts:
true`` runs AutoEP's experts with grouped FP8 GEMMs (``autoep.fp8_experts``; refused by
name where the experts' activation or sizes do not allow it); ``auto`` keeps AutoEP's bf16
``GroupedExperts`` until the FP8 path has been measured faster inside AutoEP on a GPU.
``expert_graphs: true`` (an option of the legacy FP8 experts) is refused; ``auto`` and
``false`` ask for nothing the layer does not do, so a ds_config shared with the legacy
layer works unchanged. AutoEP's DeepEP
backend (``expert_parallel.comm_backend: "deepep"``) bypasses the all-to-alls that carry the
formats and is refused together with an enabled ``fp4_moe``; so are AutoEP layers folded
with tensor parallelism.
"""

import logging
from typing import Optional

import torch

from ds_fp4 import formats
from ds_fp4.config import SECTION, Format, FP4MoEConfig
from ds_fp4.moe.autoep import _internals
from ds_fp4.moe.autoep.fp8_experts import fp8_experts_problem
from ds_fp4.moe.autoep.layer import FP4AutoEPMoELayer
from ds_fp4.moe.layer import _fp4_class, check_hidden

logger = logging.getLogger(__name__)

EP_SECTION = "expert_parallel"
_DEEPEP = "deepep"
_ROW_UNIT = {Format.MXFP4: formats.MX_BLOCK, Format.FP8: formats.FP8_GROUP}   # elements a scale


def config_errors(cfg: FP4MoEConfig):
    """Messages for the ``fp4_moe`` values an AutoEP layer cannot honour (empty: fine)."""
    if not cfg.enabled:
        return []
    errors = []
    if cfg.expert_graphs is True:
        errors.append(
            "fp4_moe.expert_graphs = true: CUDA graphs are an option of the legacy layer's FP8 "
            "experts and do not apply to AutoEP layers; set it to \"auto\" or false")
    return errors


def _deepep_error(where: str) -> str:
    return (f"{where} = \"{_DEEPEP}\" cannot be combined with an enabled fp4_moe section: "
            f"DeepEP's dispatch and combine bypass the all-to-alls that carry the MXFP4/FP8 "
            f"rows. Set expert_parallel.comm_backend to \"comm\" (the default), or "
            f"fp4_moe.enabled to false")


def check_ds_config(ds_config: dict, cfg: Optional[FP4MoEConfig] = None) -> None:
    """Refuse, before DeepSpeed builds anything, a ds_config whose AutoEP cannot take fp4_moe.

    Arguments:
        ds_config: a whole ds_config dict.
        cfg: its ``fp4_moe`` section as already validated, or None (validated here).
    Raises:
        ValueError naming the key (the DeepEP backend, an fp4_moe key that does not apply);
        AutoEPVersionError when AutoEP is enabled but this DeepSpeed lacks what is needed.
    """
    ep = ds_config.get(EP_SECTION) or {}
    if not (isinstance(ep, dict) and ep.get("enabled")) or SECTION not in ds_config:
        return
    if cfg is None:
        cfg = FP4MoEConfig.from_whole(ds_config)
    if not cfg.enabled:
        return
    errors = config_errors(cfg)
    if ep.get("comm_backend") == _DEEPEP:
        errors.append(_deepep_error("expert_parallel.comm_backend"))
    if errors:
        raise ValueError("fp4_moe with AutoEP (expert_parallel):\n  " + "\n  ".join(errors))
    _internals.require_module()


def check_layer(layer, cfg: FP4MoEConfig) -> None:
    """Raise before any change when ``layer`` cannot run with ``cfg``.

    Raises:
        AutoEPVersionError (another DeepSpeed); ValueError naming the key or attribute
        (a key that does not apply, DeepEP, folded tensor parallelism, a hidden size the
        formats cannot pack).
    """
    _internals.require_module()
    _internals.require_layer(layer)
    if not cfg.enabled:
        return
    errors = config_errors(cfg)
    if layer.comm_backend == _DEEPEP:
        errors.append(_deepep_error("expert_parallel.comm_backend"))
    folding = layer.folding_group_handles
    if folding is not None and folding.spec.tp_size > 1:
        errors.append(f"AutoEP folded with tensor parallelism (tp_size "
                      f"{folding.spec.tp_size}) is not supported by fp4_moe yet; set "
                      f"tensor_parallel.autotp_size to 1 or fp4_moe.enabled to false")
    ffn, unit = layer.experts.w1.shape[1], _ROW_UNIT.get(cfg.activation_cache)
    if unit and ffn % unit:
        errors.append(f"fp4_moe.activation_cache = '{cfg.activation_cache}' keeps the experts' "
                      f"activations in rows of {unit}, but their ffn size is {ffn}; set it to "
                      f"null or 'bf16'")
    why = fp8_experts_problem(layer.experts) if cfg.fp8_experts is True else ""
    if why:
        errors.append(f"fp4_moe.fp8_experts = true but {why}; set it to \"auto\" or false")
    if errors:
        raise ValueError("fp4_moe with AutoEP (expert_parallel):\n  " + "\n  ".join(errors))
    check_hidden(cfg, layer.hidden_size, layer.ep_size)


def to_fp4_autoep(layer, config=None, explicit: bool = True):
    """Turn an ``AutoEPMoELayer`` into an ``FP4AutoEPMoELayer`` in place (weights kept).

    Arguments:
        layer: an AutoEP layer (or an FP4 one, which is reconfigured).
        config: anything ``FP4MoEConfig.from_ds_config`` takes; None: the defaults.
        explicit: remember the config as given by the user (``convert_autoep`` keeps it).
    Returns:
        ``layer`` itself, now an ``FP4AutoEPMoELayer``.
    """
    ael = _internals.require_module()
    if not isinstance(layer, ael.AutoEPMoELayer):
        raise TypeError(f"to_fp4_autoep expects a {ael.__name__}.AutoEPMoELayer; got "
                        f"{type(layer).__name__}")
    _convert_layers([layer], FP4MoEConfig.from_ds_config(config), explicit)
    return layer


def _convert_layers(layers, cfg: FP4MoEConfig, explicit: bool) -> None:
    """Check every layer, then convert them all: a bad one changes nothing."""
    base = _internals.require_module().AutoEPMoELayer
    for layer in layers:
        check_layer(layer, cfg)
    for layer in layers:
        layer.__class__ = _fp4_class(type(layer), base, FP4AutoEPMoELayer)
        layer.fp4_setup(cfg)
        layer._fp4_explicit = explicit


def autoep_layers(model: torch.nn.Module):
    """The AutoEP layers of ``model`` (any module carrying AutoEP's marker)."""
    return [m for m in model.modules() if getattr(type(m), "_is_autoep_layer", False)]


def convert_autoep(model: torch.nn.Module, config=None) -> int:
    """Turn every AutoEP layer of ``model`` into an FP4 one, in place; all or none.

    Arguments:
        model: an ``nn.Module`` after ``deepspeed.initialize`` built its AutoEP layers
            (``engine.module``).
        config: as ``to_fp4_autoep``. Layers converted with an explicit config keep it.
    Returns:
        the number of layers converted.
    """
    layers = [m for m in autoep_layers(model)
              if not (isinstance(m, FP4AutoEPMoELayer) and m._fp4_explicit)]
    if not layers:
        return 0
    cfg = FP4MoEConfig.from_ds_config(config)
    if not cfg.enabled and not _internals.complete():
        return 0  # off means AutoEP's own layer, which these layers already are
    _convert_layers(layers, cfg, explicit=False)
    logger.info("ds_fp4: %d AutoEP layer(s) set to %s", len(layers), cfg)
    return len(layers)
