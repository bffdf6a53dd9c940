"""How a DeepSpeed script turns FP4MoE on: ``convert``, ``initialize``, ``configure``.

- ``convert(model, config)``: every ``deepspeed.moe.layer.MoE`` in ``model`` becomes an
  ``FP4MoE`` in place (same parameter objects and names).
- ``initialize(...)``: ``deepspeed.initialize`` with the same arguments and return value; it
  first validates the ds_config's ``fp4_moe`` section and converts the model's MoE layers.
- ``configure(engine)``: the same for an engine that ``deepspeed.initialize`` already made.
"""

import functools
import inspect
import json
import logging
import os

import deepspeed
from deepspeed.moe.layer import MoE

from ds_fp4.config import SECTION, FP4MoEConfig
from ds_fp4.moe.layer import FP4MoE, check_hidden, to_fp4

logger = logging.getLogger(__name__)


def convert(model, config=None):
    """Turn every DeepSpeed MoE layer of ``model`` into an ``FP4MoE``, in place.

    Arguments:
        model: an ``nn.Module`` (or an ``MoE`` itself).
        config: a ds_config (dict or JSON path) or just its ``fp4_moe`` section, or an
            ``FP4MoEConfig``; None: the defaults. FP4MoE layers built with an explicit
            ``fp4_config`` keep theirs.
    Returns:
        ``model``.
    Raises:
        ValueError naming the key for a bad section; ValueError naming the fix when a
        layer's hidden size cannot be packed in the chosen formats.
    """
    cfg = FP4MoEConfig.from_ds_config(config)
    layers = [m for m in model.modules()
              if isinstance(m, MoE) and not (isinstance(m, FP4MoE) and m._fp4_explicit)]
    for layer in layers:  # check every layer first: all are converted or none
        inner = layer.deepspeed_moe
        check_hidden(cfg, inner.gate.wg.weight.shape[1], inner.ep_size)
    for layer in layers:
        to_fp4(layer, cfg, explicit=False)
    logger.info("ds_fp4: %d MoE layer(s) set to %s", len(layers), cfg)
    return model


def _load(config):
    """A ds_config given as dict, path (JSON or hjson) or base64 string, as a dict.

    Read the way ``deepspeed.initialize`` reads it, so both see the same section.
    """
    if isinstance(config, dict) or config is None:
        return config
    if isinstance(config, os.PathLike):
        config = os.fspath(config)
    try:
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
    except ImportError:  # older DeepSpeed: plain JSON files only
        with open(config) as f:
            return json.load(f)
    return load_ds_config(config)


def _ds_config_of(bound):
    """The ds_config that ``deepspeed.initialize`` will use, from its bound arguments."""
    config = bound.get("config") or bound.get("config_params")
    args = bound.get("args")
    for name in ("deepspeed_config", "deepscale_config"):
        if config is None and getattr(args, name, None) is not None:
            config = getattr(args, name)
    return _load(config)


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
    if ds_config is not None and model is not None:  # else DeepSpeed reports what is missing
        _apply(model, ds_config, "ds_fp4.initialize")
    return deepspeed.initialize(*args, **kwargs)


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
        ds_config = _load(engine.config)
    _apply(engine.module, ds_config, "ds_fp4.configure")
    return engine


def _apply(model, ds_config, caller):
    """Convert with the ds_config's section; without a section change nothing (and say so)."""
    if SECTION not in ds_config:
        logger.warning("%s: the ds_config has no %r section; the MoE layers are left as they "
                       "are", caller, SECTION)
        return
    convert(model, FP4MoEConfig.from_whole(ds_config))
