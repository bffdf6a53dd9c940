"""``ds_fp4.convert`` warns where ``initialize`` does and reads what it reads (issue 15, item 5).

A misspelt section (``"fp4-moe"``) or a model without MoE layers must not pass in silence; a
ds_config without batch-size keys must not be taken for the section itself (which reported
every DeepSpeed key as an unknown ``fp4_moe`` key); hjson files load as in ``initialize``.
"""

import logging

import pytest
import torch
from deepspeed.moe.layer import MoE

import ds_fp4
from ds_fp4 import api
from ds_fp4.config import FP4MoEConfig, is_section, misspelt_section
from ds_fp4.moe import FP4MoE
from tests.dist_utils import cpu_env, make_moe

cpu_env()


class _Net(torch.nn.Module):
    def __init__(self, moe=True):
        super().__init__()
        self.proj = torch.nn.Linear(128, 128)
        self.moe = make_moe(hidden=128, num_experts=2, parallel=False) if moe else None


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("ds_config", [
    {"train_micro_batch_size_per_gpu": 1, "fp4-moe": {"dispatch": "fp8"}},
    {"bf16": {"enabled": True}, "fp4-moe": {"dispatch": "fp8"}},     # no batch-size keys
    {"zero_optimization": {"stage": 1}, "FP4_MoE": {}},
])
def test_a_misspelt_section_is_named_and_nothing_changes(ds_config, caplog):
    net = _Net()
    with caplog.at_level(logging.WARNING, logger="ds_fp4.api"):
        ds_fp4.convert(net, ds_config)
    (key,) = [k for k in ds_config if k.lower().startswith("fp4")]
    assert any(f"has no 'fp4_moe' section (it has {key!r}: did you mean 'fp4_moe'?)" in m
               for m in _warnings(caplog)), _warnings(caplog)
    assert type(net.moe) is MoE                                   # left as it was


def test_a_ds_config_without_the_section_warns(caplog):
    net = _Net()
    with caplog.at_level(logging.WARNING, logger="ds_fp4.api"):
        ds_fp4.convert(net, {"bf16": {"enabled": True}, "gradient_clipping": 1.0})
    assert any("has no 'fp4_moe' section;" in m for m in _warnings(caplog)), caplog.text
    assert type(net.moe) is MoE


def test_a_model_without_moe_layers_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="ds_fp4.api"):
        ds_fp4.convert(_Net(moe=False), {"dispatch": "fp8"})
    assert any("_Net holds no deepspeed.moe.layer.MoE layer" in m
               for m in _warnings(caplog)), caplog.text


def test_initialize_names_the_misspelt_section_too(caplog):
    net = _Net()
    with caplog.at_level(logging.WARNING, logger="ds_fp4.api"):
        api._apply(net, {"train_batch_size": 2, "fp4-moe": {}}, "ds_fp4.initialize")
    assert any(m.startswith("ds_fp4.initialize: the ds_config has no 'fp4_moe' section (it "
                            "has 'fp4-moe'") for m in _warnings(caplog)), caplog.text


def test_convert_still_converts_a_section_or_a_ds_config(caplog):
    whole = {"bf16": {"enabled": True}, "fp4_moe": {"dispatch": "fp8"}}
    for config in ({"dispatch": "fp8"}, whole):
        net = _Net()
        with caplog.at_level(logging.WARNING, logger="ds_fp4.api"):
            ds_fp4.convert(net, config)
        assert isinstance(net.moe, FP4MoE) and net.moe.fp4_config.dispatch == "fp8"
    assert not _warnings(caplog), _warnings(caplog)


def test_convert_reads_hjson_like_initialize(tmp_path):
    path = tmp_path / "ds_config.hjson"
    path.write_text("{\n  // hjson: comments, unquoted keys and strings\n"
                    "  train_micro_batch_size_per_gpu: 1\n"
                    "  fp4_moe: {\n    dispatch: fp8\n  }\n}\n")
    net = _Net()
    ds_fp4.convert(net, str(path))
    assert isinstance(net.moe, FP4MoE) and net.moe.fp4_config.dispatch == "fp8"
    assert FP4MoEConfig.from_ds_config(path).dispatch == "fp8"


@pytest.mark.parametrize("cfg, section", [
    ({"dispatch": "fp8"}, True),
    ({"dispach": "fp8"}, True),                     # a section with a typo: reported, not lost
    ({}, True),                                     # the defaults
    ({"bf16": {"enabled": True}, "fp4-moe": {}}, False),
    ({"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}, False),
    ({"train_batch_size": 8}, False),
    ({"fp4_moe": {}}, False),
])
def test_section_or_ds_config(cfg, section):
    assert is_section(cfg) is section


def test_a_section_with_a_typo_still_names_the_key():
    with pytest.raises(ValueError, match="fp4_moe.combin: unknown key"):
        FP4MoEConfig.from_ds_config({"dispatch": "fp8", "combin": "bf16"})


@pytest.mark.parametrize("keys, found", [
    (["fp4-moe"], "fp4-moe"), (["FP4MoE"], "FP4MoE"), (["fp4_mo"], "fp4_mo"),
    (["bf16", "zero_optimization"], None), (["fp8_moe"], "fp8_moe"),
])
def test_misspelt_section(keys, found):
    assert misspelt_section({k: {} for k in keys}) == found


def test_initialize_validates_the_section_once_and_checks_each_layer_once(monkeypatch):
    """``ds_fp4.initialize`` parses ``fp4_moe`` one time and passes the typed config down
    (the pre-DeepSpeed AutoEP check and the post-DeepSpeed AutoEP conversion included);
    each layer's hidden size is checked once."""
    from ds_fp4.moe import layer as layer_module
    net = _Net()
    parsed, checked = [], []
    validate, check_hidden = FP4MoEConfig.model_validate, layer_module.check_hidden
    monkeypatch.setattr(FP4MoEConfig, "model_validate",
                        classmethod(lambda cls, v: parsed.append(v) or validate(v)))
    monkeypatch.setattr(layer_module, "check_hidden",
                        lambda *a: checked.append(a) or check_hidden(*a))

    def fake_initialize(args=None, model=None, config=None, **kwargs):
        return type("Engine", (), {"module": model})(), None, None, None

    monkeypatch.setattr(api.deepspeed, "initialize", fake_initialize)
    ds_config = {"train_batch_size": 2, "fp4_moe": {"dispatch": "fp8", "kernels": "reference"}}
    ds_fp4.initialize(model=net, config=ds_config)
    assert len(parsed) == 1 and len(checked) == 1, (parsed, checked)
    assert isinstance(net.moe, FP4MoE) and net.moe.fp4_config.kernels == "reference"
