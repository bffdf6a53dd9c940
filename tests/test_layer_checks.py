"""FP8 experts' sizes are checked when the layer is built (issue 15, item 3).

FP8 expert GEMMs use 128x128 weight tiles: ``fp8_experts: true`` with a SwiGLU hidden or ffn
that is not a multiple of 128 must fail at construction (not at the first forward), and
``auto`` must fall back to DeepSpeed's experts with the reason logged, on a device that
could run FP8 experts too (faked here: CPUs cannot).
"""

import logging

import pytest
import torch

from ds_fp4.moe import FP4MoE
from ds_fp4.moe.expert import SwiGLUExpert
from tests.dist_utils import cpu_env

cpu_env()
fp8_experts = pytest.importorskip("ds_fp4.moe.fp8_experts")


def _layer(hidden, ffn, fp8):
    torch.manual_seed(0)
    return FP4MoE(hidden, SwiGLUExpert(hidden, ffn), num_experts=2, k=1, min_capacity=4,
                  fp4_config=dict(fp8_experts=fp8))


@pytest.mark.parametrize("hidden, ffn, named", [
    (128, 192, "ffn = 192"), (96, 128, "hidden = 96"), (160, 200, "ffn = 200, hidden = 160")])
def test_fp8_experts_true_rejects_sizes_when_built(hidden, ffn, named):
    with pytest.raises(ValueError) as err:
        _layer(hidden, ffn, True)
    message = str(err.value)
    assert "fp4_moe.fp8_experts = true" in message and named in message, message
    assert "multiples of 128" in message and 'set it to "auto" or false' in message, message


def test_fp8_experts_true_accepts_multiples_of_128():
    layer = _layer(128, 256, True)
    assert layer.fp4_config.fp8_experts is True


@pytest.fixture
def fp8_capable(monkeypatch):
    """Pretend this CPU runs FP8 expert GEMMs, so that only the sizes decide under auto."""
    monkeypatch.setattr(fp8_experts, "fp8_experts_supported", lambda device=None: True)


def test_auto_falls_back_to_bf16_experts_for_odd_sizes(fp8_capable, caplog):
    layer = _layer(128, 192, "auto")
    x = torch.randn(2, 8, 128)
    with caplog.at_level(logging.WARNING, logger="ds_fp4.moe.layer"):
        out, _, _ = layer(x)
    assert out.shape == x.shape
    assert not isinstance(layer.deepspeed_moe.experts, fp8_experts.FP8Experts)
    assert any("keeps DeepSpeed's bf16 experts" in r.message and "ffn = 192" in r.message
               for r in caplog.records), caplog.text


def test_auto_still_picks_fp8_experts_for_good_sizes(fp8_capable, caplog):
    """The control: with the same fake device, sizes of 128 multiples get FP8 experts."""
    layer = _layer(128, 256, "auto")
    with caplog.at_level(logging.INFO, logger="ds_fp4.moe.layer"):
        assert layer.deepspeed_moe._resolve_fp8_experts(torch.device("cpu")) is True
    assert isinstance(layer.deepspeed_moe.experts, fp8_experts.FP8Experts)
    assert "bf16 experts" not in caplog.text


def test_auto_on_a_cpu_says_why_at_info_level(caplog):
    layer = _layer(128, 256, "auto")
    with caplog.at_level(logging.INFO, logger="ds_fp4.moe.layer"):
        layer(torch.randn(2, 8, 128))
    records = [r for r in caplog.records if "bf16 experts" in r.message]
    assert records and all(r.levelno == logging.INFO for r in records), caplog.text
    assert "not supported on cpu" in records[0].message
