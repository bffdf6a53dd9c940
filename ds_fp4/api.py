"""How a DeepSpeed script turns FP4MoE on: ``convert``, ``initialize``, ``configure``.

- ``convert(model, config)``: every ``deepspeed.moe.layer.MoE`` in ``model`` becomes an
  ``FP4MoE`` in place (same parameter objects and names).
- ``initialize(...)``: ``deepspeed.initialize`` with the same arguments and return value; it
  first validates the ds_config's ``fp4_moe`` section and converts the model's MoE layers
  (AutoEP layers, which DeepSpeed builds inside ``deepspeed.initialize``, right after it).
- ``configure(engine)``: the same for an engine that ``deepspeed.initialize`` already made.
"""

import functools
import inspect
import logging

import deepspeed
from deepspeed.moe.layer import MoE

from ds_fp4.config import SECTION, FP4MoEConfig, is_section, misspelt_section, read_ds_config
from ds_fp4.moe import bf16_start
from ds_fp4.moe.layer import FP4MoE, convert_layers

logger = logging.getLogger(__name__)


def convert(model, config=None):
    """Turn every DeepSpeed MoE layer of ``model`` into an ``FP4MoE``, in place.

    Arguments:
        model: an ``nn.Module`` (or an ``MoE`` itself).
        config: a ds_config (dict, or a JSON/hjson path as ``initialize`` reads it) or just
            its ``fp4_moe`` section (``config.is_section`` tells them apart), or an
            ``FP4MoEConfig``; None: the defaults. FP4MoE layers built with an explicit
            ``fp4_config`` keep theirs.
    Returns:
        ``model``. Like ``initialize``, a ds_config without the section changes nothing
        and logs a warning (naming a misspelt section key such as ``fp4-moe``); a model
        without MoE layers logs a warning too.
    Raises:
        ValueError naming the key for a bad section; ValueError naming the fix when a
        layer's hidden size cannot be packed in the chosen formats.
    """
    if not isinstance(config, FP4MoEConfig):
        config = read_ds_config(config)
        if isinstance(config, dict) and not is_section(config) and SECTION not in config:
            _warn_no_section("ds_fp4.convert", config)
            return model
    cfg = FP4MoEConfig.from_ds_config(config)
    _warn_if_no_layers("ds_fp4.convert", model)
    return _convert(model, cfg)


def _convert(model, cfg):
    """``convert`` with a validated ``FP4MoEConfig`` and without its warnings."""
    layers = [m for m in model.modules()
              if isinstance(m, MoE) and not (isinstance(m, FP4MoE) and m._fp4_explicit)]
    convert_layers(layers, cfg)  # every layer checked first: all are converted or none
    logger.info("ds_fp4: %d MoE layer(s) set to %s", len(layers), cfg)
    _autoep().convert_autoep(model, cfg)  # AutoEP layers, once deepspeed.initialize built them
    return model


def _autoep():
    """``ds_fp4.moe.autoep`` (imported on use: it loads DeepSpeed's AutoEP modules)."""
    from ds_fp4.moe import autoep
    return autoep


def _ds_config_of(bound):
    """The ds_config that ``deepspeed.initialize`` will use, from its bound arguments."""
    config = bound.get("config") or bound.get("config_params")
    args = bound.get("args")
    for name in ("deepspeed_config", "deepscale_config"):
        if config is None and getattr(args, name, None) is not None:
            config = getattr(args, name)
    return read_ds_config(config)


@functools.wraps(deepspeed.initialize)
def initialize(*args, **kwargs):
    """``deepspeed.initialize`` that first applies the ds_config's ``fp4_moe`` section.

    Takes and returns exactly what ``deepspeed.initialize`` does. The section is validated
    before DeepSpeed starts (a bad key or value raises ValueError naming it); a ds_config
    without the section leaves the model's layers as they are.
    """
    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs).arguments
    ds_config = _ds_config_of(bound)
    model = bound.get("model")
    cfg = None
    if ds_config is not None and model is not None:  # else DeepSpeed reports what is missing
        cfg = _apply(model, ds_config, "ds_fp4.initialize")
    if cfg is not None:
        _autoep().check_ds_config(ds_config, cfg)  # before AutoEP builds its layers
    result = deepspeed.initialize(*args, **kwargs)
    if cfg is not None:
        # AutoEP replaces the model's MoE blocks inside deepspeed.initialize: convert those now
        _autoep().convert_autoep(result[0].module, cfg)
    bf16_start.attach(result[0].module, result[0])   # the step count the layers read
    return result


def configure(engine):
    """Apply the engine's ds_config ``fp4_moe`` section to its model's MoE layers.

    Arguments:
        engine: a ``DeepSpeedEngine`` from ``deepspeed.initialize``.
    Returns:
        ``engine`` (its MoE layers are now FP4MoE; the parameters are the same objects, so
        the optimizer and expert groups stay valid).
    """
    ds_config = getattr(getattr(engine, "_config", None), "_param_dict", None)
    if ds_config is None:
        ds_config = read_ds_config(engine.config)
    _apply(engine.module, ds_config, "ds_fp4.configure")
    bf16_start.attach(engine.module, engine)
    return engine


def _apply(model, ds_config, caller):
    """Convert with the ds_config's section, validated here (the one time); returns it as an
    ``FP4MoEConfig``. Without a section change nothing (and say so) and return None."""
    if SECTION not in ds_config:
        _warn_no_section(caller, ds_config)
        return None
    cfg = FP4MoEConfig.from_whole(ds_config)
    autoep = ds_config.get("expert_parallel")
    if not (isinstance(autoep, dict) and autoep.get("enabled")):  # else deepspeed builds them
        _warn_if_no_layers(caller, model)
    _convert(model, cfg)
    return cfg


def _warn_no_section(caller, ds_config):
    key = misspelt_section(ds_config)
    hint = f" (it has {key!r}: did you mean {SECTION!r}?)" if key else ""
    logger.warning("%s: the ds_config has no %r section%s; the MoE layers are left as they "
                   "are", caller, SECTION, hint)


def _moe_layer_classes():
    """DeepSpeed's MoE layer classes that ds_fp4 converts (AutoEP's where it exists)."""
    try:
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    except ImportError:
        return (MoE,)
    return (MoE, AutoEPMoELayer)


def _warn_if_no_layers(caller, model):
    kinds = _moe_layer_classes()
    if not any(isinstance(m, kinds) for m in model.modules()):
        logger.warning("%s: %s holds no deepspeed.moe.layer.MoE layer, so nothing runs in FP4; "
                       "build its MoE blocks with deepspeed.moe.layer.MoE (or ds_fp4.moe.FP4MoE)",
                       caller, type(model).__name__)
