"""The ``fp4_moe`` section of a ds_config, validated.

One pydantic model holds every choice of the FP4MoE layer; the mapping from JSON happens
here only. An unknown key or a bad value raises a ``ValueError`` whose message names the key
(``fp4_moe.dispatch``), what it got and what is allowed.

Example (the paper's recipe, all defaults)::

    "fp4_moe": {"enabled": true, "dispatch": "mxfp4", "combine": "bf16", "grad": "fp8",
                "cache": "mxfp4", "scale_rounding": "rceil", "kernels": "auto",
                "fp8_experts": "auto", "expert_graphs": false}

``bf16`` for a wire or the cache means bf16 values (a bf16 model's tensors travel as they
are; fp32/fp16 tensors are rounded to bf16). ``enabled: false`` gives DeepSpeed's own layer.
"""

import difflib
import json
import os
import re
from enum import Enum
from typing import Annotated, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError,
                      field_validator, model_validator)

from ds_fp4.env import Kernels  # one vocabulary with DS_FP4_KERNELS and ops.set_kernels

SECTION = "fp4_moe"
# Keys that only a whole ds_config has (a section never does).
_DS_CONFIG_MARKERS = ("train_batch_size", "train_micro_batch_size_per_gpu")
# How close (difflib ratio) a key must be to an fp4_moe key, or to "fp4_moe", to be taken for
# a misspelling of it: "dispach" and "fp4-moe" are, no DeepSpeed top-level key is.
_CLOSE = 0.8


class Format(str, Enum):
    """A tensor format on the wire or in the backward cache (FORMATS.md)."""
    MXFP4 = "mxfp4"   # E2M1 elements, one E8M0 scale per 32: K/2 + K/32 bytes per row
    FP8 = "fp8"       # E4M3 elements, one power-of-two scale per 128: K + K/128 bytes per row
    BF16 = "bf16"     # bf16 values: 2K bytes per row

    def __str__(self):
        return self.value


class ScaleRounding(str, Enum):
    """MXFP4 block-scale rule (FORMATS.md): ``rceil`` never clips, ``floor`` is OCP MX v1.0."""
    RCEIL = "rceil"
    FLOOR = "floor"

    def __str__(self):
        return self.value


# Formats each option accepts; the rest of the enum is rejected with the allowed list.
_ALLOWED = {
    "dispatch": (Format.MXFP4, Format.FP8, Format.BF16),
    "combine": (Format.BF16, Format.FP8, Format.MXFP4),
    "grad": (Format.FP8, Format.BF16),
    "cache": (Format.MXFP4, Format.FP8, Format.BF16),
    "activation_cache": (Format.MXFP4, Format.FP8, Format.BF16),
}


class FP4MoEConfig(BaseModel):
    """The ``fp4_moe`` ds_config section.

    Fields:
        enabled: false gives exactly DeepSpeed's own MoE layer.
        dispatch: forward wire of the dispatch all-to-all (tokens -> experts).
        combine: forward wire of the combine all-to-all (experts -> tokens).
        grad: backward wire of both all-to-alls (the gradients).
        cache: format in which the experts' inputs are kept for their backward.
        activation_cache: format in which the FP8 experts keep their activation's input
            (SwiGLU/GELU: z = x W1^T) for backward; None (default): ``cache``. The backward
            reads z twice, for the activation's gradient and for h, the down projection's
            weight-gradient operand. So z's MXFP4 copy doubled the input gradient's error
            and the down weight gradient's error against float32, from ~0.07 at FP8 to
            0.14 / 0.18 (bench/results/grad_numerics_cpu). ``fp8`` costs 2F * 0.48 more
            bytes per routed row, and its copy also feeds the forward's h, so the
            backward's gradient is that of the forward that ran: with it fp4's held-out
            loss went from +0.66% to +0.00% +- 0.42% of bf16's, the fp8 recipe's from
            +0.55% to +0.46% +- 0.28% (15 seeds each, not resolved together:
            bench/results/converge_h200_1gpu_5seeds_3000steps). Below bf16 (mxfp4 or fp8,
            also through ``cache``) it also has the combine keep the routes' outputs for
            the router's gradient as FP8 rows (``moe.cache.route_output_format``). Set
            (not null), it also keeps AutoEP's bf16 experts' ``[N, F]`` activations (gate,
            up, silu(gate), h) in this format (not fed to their forward); null leaves those
            to autograd.
        scale_rounding: MXFP4 block-scale rule.
        kernels: ``auto``/``cuda``/``reference`` for CUDA tensors, applied to every op the
            layer runs, forward and backward (wires, cache, FP8 experts); None keeps the
            process setting (``ops.set_kernels``, ``DS_FP4_KERNELS``).
        fp8_experts: ``auto`` (FP8 expert GEMMs where supported and the experts are
            ``SwiGLUExpert``), true (required: an error if impossible) or false.
        expert_graphs: replay the FP8 experts' passes as CUDA graphs: less host time, memory
            per distinct captured pass, shared by the layers of the same sizes
            (``moe.expert_graphs``). ``auto`` (default): only passes with small GEMMs
            (host-bound) and small inputs to copy in (weights included), within a memory
            budget; true: every pass; false: none. With ``fp8_weight_cache`` ``auto`` means
            none. Measured on an H200 (bench/results/shared_graphs_h200): the main job's
            default GPU model ran faster than eager for a peak still below bf16's.
            ``auto`` and ``true`` also replay DeepSpeed's gating function from per-layer CUDA
            graphs (``moe.gate_graphs``: a few MB a layer).
        monitor_exactness: count, per layer, the 128-groups that the MXFP4 -> FP8
            conversions of the FP8 experts convert outside the exactness bound, and NaN
            groups (``ds_fp4.moe.exactness``); false (default) passes no counters at all.
        fp8_weight_cache: keep the FP8 experts' weight tiles (W and W^T) from their first
            use after an optimizer step until the next step (``ds_fp4.moe.weight_cache``),
            instead of making them on every pass: for gradient accumulation, pipeline
            micro-batches and recomputation. Costs 2 bytes per expert parameter, held
            between steps. False (default). Needs FP8 experts and ``expert_graphs`` not true.
        bf16_start_steps: the first N optimizer steps run DeepSpeed's own layer (bf16
            wires, copies and experts); the recipe from step N on (``moe.bf16_start``: the
            step is the engine's ``global_steps``, so ``ds_fp4.initialize`` or ``configure``
            must see the engine). 0 (default): the recipe from the first step. The loss gap
            to bf16 forms early: branched from bf16 at step 1000 of 3000, fp4 ended +0.22%
            +- 0.03% train / +0.20% +- 0.11% held-out from bf16, fp8 +0.09% / +0.06%, where
            whole runs end +0.70% / +0.66% (fp4) and +0.41% / +0.46% (fp8)
            (bench/results/branches_h200_1gpu, 5 and 15 seeds). Costs those steps at bf16's
            speed and bf16's peak memory (1.15x fp4's on that model).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: StrictBool = True
    dispatch: Format = Format.MXFP4
    combine: Format = Format.BF16
    grad: Format = Format.FP8
    cache: Format = Format.MXFP4
    activation_cache: Optional[Format] = None
    scale_rounding: ScaleRounding = ScaleRounding.RCEIL
    kernels: Optional[Kernels] = None
    fp8_experts: Union[Literal["auto"], StrictBool] = "auto"
    expert_graphs: Union[Literal["auto"], StrictBool] = "auto"
    monitor_exactness: StrictBool = False
    fp8_weight_cache: StrictBool = False
    bf16_start_steps: Annotated[StrictInt, Field(ge=0)] = 0

    @field_validator("fp8_experts", "expert_graphs", mode="before")
    @classmethod
    def _auto_or_bool(cls, value):
        if value == "auto" or value is True or value is False:
            return value
        raise ValueError('must be "auto", true or false')

    @field_validator("dispatch", "combine", "grad", "cache", "activation_cache")
    @classmethod
    def _format_allowed(cls, value, info):
        allowed = _ALLOWED[info.field_name]
        if value is not None and value not in allowed:
            raise ValueError(f"must be one of {', '.join(map(str, allowed))}")
        return value

    @model_validator(mode="after")
    def _weight_cache_applies(self):
        if self.fp8_weight_cache and self.fp8_experts is False:
            raise ValueError("fp4_moe.fp8_weight_cache keeps the FP8 experts' weight tiles: "
                             "it needs fp8_experts \"auto\" or true (got false)")
        if self.fp8_weight_cache and self.expert_graphs is True:
            raise ValueError("fp4_moe.fp8_weight_cache needs expert_graphs \"auto\" or false "
                             "(got true): a captured pass replays the tiles it was captured with")
        return self

    @property
    def z_cache(self) -> Format:
        """How the FP8 experts keep z: ``activation_cache``, else ``cache``."""
        return self.activation_cache or self.cache

    @classmethod
    def from_ds_config(cls, cfg=None):
        """Read the section from a whole ds_config or from the section itself.

        Arguments:
            cfg: None (defaults), an ``FP4MoEConfig``, a dict, or a path (str/PathLike) to a
                JSON or hjson file (read as ``deepspeed.initialize`` reads it). A dict is
                the section itself when ``is_section`` says so, else a whole ds_config (one
                without the section gives ``enabled=False``).
        Returns:
            ``FP4MoEConfig``.
        Raises:
            ValueError naming the key for an unknown key or a bad value; TypeError for a
            ``cfg`` of another type.
        """
        if cfg is None:
            return cls()
        if isinstance(cfg, cls):
            return cfg
        if isinstance(cfg, (str, os.PathLike)):
            cfg = read_ds_config(cfg)
        if not isinstance(cfg, dict):
            raise TypeError(f"fp4_moe config must be a dict, a JSON path or FP4MoEConfig; "
                            f"got {type(cfg).__name__}")
        return cls.from_section(cfg) if is_section(cfg) else cls.from_whole(cfg)

    @classmethod
    def from_whole(cls, ds_config: dict):
        """The section of a whole ds_config dict; ``enabled=False`` when it has none."""
        if SECTION not in ds_config:
            return cls(enabled=False)
        section = ds_config[SECTION]
        if section is None:
            section = {}
        if not isinstance(section, dict):
            raise ValueError(f"{SECTION} must be a JSON object; got {section!r}")
        return cls.from_section(section)

    @classmethod
    def from_section(cls, section):
        """Validate the section dict; errors name ``fp4_moe.<key>``."""
        try:
            return cls.model_validate(section)
        except ValidationError as err:
            raise ValueError(_describe(err)) from None


def choice(enum, value, name: str):
    """``value`` as a member of the str ``enum`` (a member is returned as it is), for the
    modules that also take plain strings from code that builds them directly.

    Raises:
        ValueError ``"<name> must be one of (...); got <value>"``.
    """
    if isinstance(value, enum):
        return value
    try:
        return enum(value)
    except ValueError:
        allowed = tuple(member.value for member in enum)
        raise ValueError(f"{name} must be one of {allowed}; got {value!r}") from None


def read_ds_config(config):
    """A ds_config given as a dict or as a JSON/hjson path (or base64 string), as a dict.

    Read the way ``deepspeed.initialize`` reads it, so that ``convert`` and ``initialize``
    take the same files. None stays None.
    """
    if isinstance(config, dict) or config is None:
        return config
    if isinstance(config, os.PathLike):
        config = os.fspath(config)
    try:
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
    except ImportError:  # older DeepSpeed (or none): plain JSON files only
        with open(config) as f:
            return json.load(f)
    return load_ds_config(config)


def _close(key, names):
    return isinstance(key, str) and bool(difflib.get_close_matches(key, names, 1, _CLOSE))


def is_section(cfg: dict) -> bool:
    """Whether the dict ``cfg`` is the ``fp4_moe`` section itself, not a whole ds_config.

    A dict naming the section or a batch size is a ds_config. Otherwise it is the section
    when one of its keys is an ``fp4_moe`` key or close to one (so that a typo such as
    ``dispach`` is reported as an unknown key, not ignored) and a ds_config when none is:
    a ds_config without batch-size keys whose section is missing or misspelt
    (``fp4-moe``) is not read as a section made of DeepSpeed's keys. ``{}`` is the section
    (the defaults).
    """
    if SECTION in cfg or any(key in cfg for key in _DS_CONFIG_MARKERS):
        return False
    fields = list(FP4MoEConfig.model_fields) + list(_REMOVED)   # a removed key: say so
    return not cfg or any(key in fields or _close(key, fields) for key in cfg)


def misspelt_section(ds_config: dict):
    """The key of ``ds_config`` that looks like a misspelt ``fp4_moe`` (``fp4-moe``,
    ``FP4MoE``, ``fp4_mo``), or None."""
    squash = lambda key: re.sub(r"[^a-z0-9]", "", key.lower())  # noqa: E731
    keys = [key for key in ds_config if isinstance(key, str) and key != SECTION]
    same = [key for key in keys if squash(key) == squash(SECTION)]
    close = difflib.get_close_matches(SECTION, keys, 1, _CLOSE)
    return (same or close or [None])[0]


# Keys of earlier releases, with what replaced them.
_REMOVED = {"gemm_streams": "the FP8 experts now issue one grouped GEMM per kind for all "
                            "local experts (or, for large experts, one cuBLASLt call each), so "
                            "there is nothing to spread over streams; delete the key"}


def _describe(err):
    lines = []
    for e in err.errors():
        key = ".".join([SECTION] + [str(p) for p in e["loc"]])
        if e["type"] == "extra_forbidden" and e["loc"][-1] in _REMOVED:
            lines.append(f"{key}: removed: {_REMOVED[e['loc'][-1]]}")
        elif e["type"] == "extra_forbidden":
            known = ", ".join(FP4MoEConfig.model_fields)
            lines.append(f"{key}: unknown key; the keys are {known}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{key}: {msg} (got {e.get('input')!r})")
    return "invalid ds_config section:\n  " + "\n  ".join(lines)
