"""One DeepSpeed AutoEP MoE layer of a given size, for ``tools/bench_moe_layer.py``.

AutoEP builds its layers only inside ``deepspeed.initialize``, from a Hugging Face model:
this builds a one-block Qwen3-MoE of the benchmark's sizes (``hf_model``), lets DeepSpeed
turn its MoE MLP into an ``AutoEPMoELayer`` (dropless, grouped experts, variable-split
all-to-alls), converts it with ``ds_fp4`` when a section is given, and wraps it so that it
takes and returns ``[tokens, hidden]`` like the legacy layers in the benchmark.
"""

import argparse

import torch
from torch import nn

from . import hf_model


class AutoEPAdapter(nn.Module):
    """``forward(x [T, H])`` -> ``(y [T, H],)`` through an AutoEP layer (``.layer``)."""

    def __init__(self, layer, engine):
        super().__init__()
        self.layer = layer
        self._engine = engine      # keeps DeepSpeed's process groups and hooks alive

    def forward(self, x):
        out = self.layer(x[None])
        out = out[0] if isinstance(out, tuple) else out
        return (out[0],)


def build(cfg, section, ep_size, seed, device, combine_impl="auto"):
    """An ``AutoEPAdapter`` of ``cfg``'s sizes (hidden, experts, k, ffn) in bf16 on
    ``device``; ``section``: an ``fp4_moe`` section, or None for AutoEP's own layer;
    ``combine_impl``: AutoEP's ``expert_parallel.combine_impl``."""
    import deepspeed
    args = argparse.Namespace(layers=1, hidden=cfg["hidden"], heads=max(1, cfg["hidden"] // 128),
                              experts=cfg["experts"], ffn=cfg["ffn"], top_k=cfg["k"],
                              seq_len=max(64, cfg["tokens"]))
    with torch.device(device):   # DeepSeek sizes would take long to initialize on the host
        model = hf_model.build_hf_model(args, seed=seed).to(dtype=torch.bfloat16)
    # no optimizer and no precision section: the benchmark drives the layer itself, and
    # DeepSpeed's bf16 optimizer wrapper would want MoE param groups
    ds_config = hf_model.with_autoep({"train_micro_batch_size_per_gpu": 1,
                                      "expert_parallel": {"combine_impl": combine_impl}},
                                     ep_size)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    layer = hf_model.moe_layers(engine.module)[0]
    if section is not None:
        from ds_fp4.moe.autoep import to_fp4_autoep
        to_fp4_autoep(layer, section)
    return AutoEPAdapter(layer, engine)
