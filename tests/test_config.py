"""The ``fp4_moe`` ds_config section: parsing, defaults, errors that name the key."""

import json
import os

import pytest

from ds_fp4.config import Format, FP4MoEConfig, Kernels, ScaleRounding
from tests.dist_utils import cpu_env

cpu_env()
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "ds_config_examples")
EXAMPLE_FILES = ("bf16_moe.json", "fp8_moe.json", "fp4_moe.json")


def test_defaults_are_the_papers_recipe():
    cfg = FP4MoEConfig()
    assert cfg.enabled is True
    assert (cfg.dispatch, cfg.combine, cfg.grad, cfg.cache) == ("mxfp4", "bf16", "fp8", "mxfp4")
    assert cfg.scale_rounding == ScaleRounding.RCEIL and cfg.kernels is None
    assert cfg.fp8_experts == "auto" and cfg.expert_graphs == "auto"
    assert cfg.bf16_start_steps == 0


def test_every_key_is_read():
    section = {"enabled": False, "dispatch": "fp8", "combine": "mxfp4", "grad": "bf16",
               "cache": "bf16", "scale_rounding": "floor", "kernels": "reference",
               "fp8_experts": True, "expert_graphs": True}
    cfg = FP4MoEConfig.from_ds_config(section)
    assert cfg.enabled is False and cfg.fp8_experts is True and cfg.expert_graphs is True
    assert (cfg.dispatch, cfg.combine, cfg.grad, cfg.cache) == (
        Format.FP8, Format.MXFP4, Format.BF16, Format.BF16)
    assert cfg.scale_rounding == ScaleRounding.FLOOR and cfg.kernels == Kernels.REFERENCE
    assert str(cfg.dispatch) == "fp8"


def test_whole_ds_config_section_or_path(tmp_path):
    ds_config = {"train_micro_batch_size_per_gpu": 2, "fp4_moe": {"dispatch": "fp8"}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config))
    for source in (ds_config, str(path), path, {"dispatch": "fp8"}):
        assert FP4MoEConfig.from_ds_config(source).dispatch == "fp8"
    assert FP4MoEConfig.from_ds_config(None) == FP4MoEConfig()
    assert FP4MoEConfig.from_ds_config({}) == FP4MoEConfig()
    assert FP4MoEConfig.from_ds_config({"train_batch_size": 8, "fp4_moe": None}) == FP4MoEConfig()
    cfg = FP4MoEConfig(cache="fp8")
    assert FP4MoEConfig.from_ds_config(cfg) is cfg


def test_ds_config_without_the_section_is_disabled():
    assert FP4MoEConfig.from_ds_config({"train_batch_size": 8}).enabled is False
    assert FP4MoEConfig.from_whole({"train_micro_batch_size_per_gpu": 1}).enabled is False


@pytest.mark.parametrize("key,value", [
    ("dispatch", "mxfp8"), ("dispatch", 4), ("combine", "fp4"), ("grad", "mxfp4"),
    ("cache", "int8"), ("scale_rounding", "nearest"), ("kernels", "gpu"),
    ("enabled", "yes"), ("enabled", 1), ("fp8_experts", "maybe"), ("fp8_experts", 1),
    ("expert_graphs", "maybe"), ("expert_graphs", 1),
    ("bf16_start_steps", -1), ("bf16_start_steps", 2.5), ("bf16_start_steps", "1000"),
    ("bf16_start_steps", True),
])
def test_bad_value_names_the_key(key, value):
    with pytest.raises(ValueError) as err:
        FP4MoEConfig.from_ds_config({"train_batch_size": 8, "fp4_moe": {key: value}})
    msg = str(err.value)
    assert f"fp4_moe.{key}:" in msg and repr(value) in msg
    assert msg.count("fp4_moe.") == 1  # one clear line, not one per union member


def test_unknown_key_names_it_and_lists_the_keys():
    with pytest.raises(ValueError) as err:
        FP4MoEConfig.from_ds_config({"dispach": "mxfp4"})  # a section with a typo
    msg = str(err.value)
    assert "fp4_moe.dispach: unknown key" in msg and "dispatch" in msg.split("keys are")[1]


def test_section_must_be_an_object():
    with pytest.raises(ValueError, match="fp4_moe must be a JSON object"):
        FP4MoEConfig.from_ds_config({"train_batch_size": 8, "fp4_moe": "mxfp4"})
    with pytest.raises(TypeError, match="got list"):
        FP4MoEConfig.from_ds_config([("dispatch", "fp8")])


def test_config_is_immutable():
    cfg = FP4MoEConfig()
    with pytest.raises(Exception):
        cfg.dispatch = "fp8"


@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_examples_are_valid_deepspeed_configs(name):
    from deepspeed.runtime.config import DeepSpeedConfig
    path = os.path.join(EXAMPLES, name)
    with open(path) as f:
        raw = json.load(f)
    ds = DeepSpeedConfig(dict(raw))  # DeepSpeed's own validation (extra keys in its sections fail)
    assert ds.train_micro_batch_size_per_gpu >= 1 and "optimizer" not in raw
    assert raw["bf16"]["enabled"] is True
    cfg = FP4MoEConfig.from_ds_config(path)
    assert cfg == FP4MoEConfig.from_whole(raw)


def test_examples_are_the_three_recipes():
    recipes = {name: FP4MoEConfig.from_ds_config(os.path.join(EXAMPLES, name))
               for name in EXAMPLE_FILES}
    assert recipes["bf16_moe.json"].enabled is False  # DeepSpeed's own layer: the baseline
    assert recipes["fp4_moe.json"] == FP4MoEConfig(kernels="auto")  # the paper: the defaults
    fp8 = recipes["fp8_moe.json"]
    assert (fp8.dispatch, fp8.combine, fp8.cache) == ("fp8", "bf16", "fp8")


def test_activation_cache_defaults_to_the_cache():
    assert FP4MoEConfig().activation_cache is None and FP4MoEConfig().z_cache == Format.MXFP4
    cfg = FP4MoEConfig.from_section({"cache": "mxfp4", "activation_cache": "fp8"})
    assert (cfg.cache, cfg.z_cache) == (Format.MXFP4, Format.FP8)
    assert FP4MoEConfig.from_section({"cache": "bf16"}).z_cache == Format.BF16
    with pytest.raises(ValueError, match="fp4_moe.activation_cache"):
        FP4MoEConfig.from_section({"activation_cache": "fp4"})


def test_removed_key_says_what_replaced_it():
    with pytest.raises(ValueError, match=r"fp4_moe.gemm_streams: removed: .*delete the key"):
        FP4MoEConfig.from_section({"gemm_streams": 1})


ABLATIONS = os.path.join(os.path.dirname(EXAMPLES), "bench", "ablation_configs")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(ABLATIONS) if f.endswith(".json")))
def test_ablation_recipes_differ_from_the_paper_in_what_their_name_says(name):
    """Each ablation recipe parses and takes exactly the pieces its README names out of
    the paper's recipe (a typo in a key or value would otherwise only show on the GPU)."""
    cfg = FP4MoEConfig.from_ds_config(os.path.join(ABLATIONS, name))
    paper = FP4MoEConfig(kernels="auto")
    changed = {k for k in vars(paper) if getattr(cfg, k) != getattr(paper, k)}
    expected = {"fp4_bf16experts.json": {"fp8_experts"},
                "bf16wires_fp8experts.json": {"dispatch", "grad", "cache", "fp8_experts"},
                "fp4_gradbf16.json": {"grad"}, "fp4_eager_experts.json": {"expert_graphs"},
                "fp4_cachebf16.json": {"cache"}, "fp4_floor.json": {"scale_rounding"},
                "fp4_zfp8.json": {"activation_cache"}, "fp4_zbf16.json": {"activation_cache"},
                "fp4_xfp8.json": {"cache", "activation_cache"},
                "fp4_bf16start1000.json": {"bf16_start_steps"}}
    assert changed == expected[name], changed
