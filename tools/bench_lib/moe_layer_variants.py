"""The layer sizes and variants of ``tools/bench_moe_layer.py`` and the layer each builds.

A variant names a layer and its ``fp4_moe`` section (see the benchmark's docstring): DeepSpeed's
own layer as it is, FP4MoE in place of it with a recipe and overrides named by suffixes, the
dropless grouped bf16 layer, and DeepSpeed AutoEP's layer with or without a recipe.
"""

import torch
import torch.distributed as tdist
from deepspeed.moe.layer import MoE

from moe_train.data import mix_seed
from moe_train.metrics import A2A_KINDS
from moe_train.model import make_expert
from moe_train.recipes import recipe_section

# Layer sizes. tokens = tokens per rank; capacity factor 1.25 throughout (H200.md baselines).
CONFIGS = {
    "tiny": dict(hidden=256, experts=8, k=2, ffn=512, tokens=512),
    "small": dict(hidden=1024, experts=8, k=2, ffn=1024, tokens=4096),
    # the main job's GPU model's layer (micro batch 8 x 512 tokens: 1280 slots an expert) and
    # the same with 4x the tokens (5120 slots: where FP8Experts' loop rule decides)
    "h512-e8-top2": dict(hidden=512, experts=8, k=2, ffn=512, tokens=4096),
    "h512-e8-top2-16k": dict(hidden=512, experts=8, k=2, ffn=512, tokens=16384),
    "h2048-e16-top2": dict(hidden=2048, experts=16, k=2, ffn=1024, tokens=8192),  # issue 14's
    "h4096-e16-top2": dict(hidden=4096, experts=16, k=2, ffn=2048, tokens=8192),
    "dsv3-e8-top2": dict(hidden=7168, experts=8, k=2, ffn=2048, tokens=8192),
    "dsv3-e16-top8": dict(hidden=7168, experts=16, k=8, ffn=2048, tokens=4096),
    "dsv3-e32-top2": dict(hidden=7168, experts=32, k=2, ffn=2048, tokens=8192),
}
ALL_BF16 = {"enabled": True, "dispatch": "bf16", "combine": "bf16", "grad": "bf16",
            "cache": "bf16", "fp8_experts": False}
VARIANTS = ("deepspeed-bf16", "grouped-bf16", "fp4moe-bf16", "fp8", "fp4", "fp4-eager",
            "fp4-graphs", "fp4-grouped", "fp4-loop", "fp4-bf16experts", "autoep-bf16",
            "autoep-fp4", "autoep-fp4-actfp8", "autoep-fp4-fp8experts", "autoep-bf16-fused",
            "autoep-fp4-fused", "autoep-fp4-fp8experts-fused", "fp4-monitor",
            "autoep-fp4-fp8experts-monitor", "fp4-wcache", "autoep-fp4-fp8experts-wcache",
            "autoep-fp4-fp8experts-wcache-fused")
AUTOEP = "autoep-bf16"     # the AutoEP variants' baseline (same weights among them)
# AutoEP variant suffix: its opt-in Triton combine (expert_parallel.combine_impl), which a
# user may pick over the default eager weighted sum (CUDA only)
FUSED = "-fused"
# variant suffix: the recipe with fp4_moe.monitor_exactness on (its counters' cost, issue 16)
MONITOR = "-monitor"
# variant suffix (before an AutoEP "-fused"): fp4_moe.fp8_weight_cache on; the benchmark's
# steps have no optimizer step in between, so they time the later micro-batches of a step
WEIGHT_CACHE = "-wcache"
GEMM_MODES = {"-grouped": "grouped", "-loop": "loop"}   # variant suffix: DS_FP4_EXPERT_GEMMS
GROUPED = "grouped-bf16"
NO_FP8_EXPERTS = "-bf16experts"   # variant suffix: the recipe with "fp8_experts": false
GRAPHS = {"-graphs": True, "-eager": False}   # variant suffixes: "expert_graphs" forced
RECIPE_VARIANTS = ("fp4", "fp4-eager", "fp4-graphs", "fp4-grouped", "fp4-loop")
BASELINE = "deepspeed-bf16"
CAPACITY_FACTOR = 1.25
# Which ds_config field gives the wire format of each all-to-all.
A2A_FORMAT_KEY = {"dispatch_fwd": "dispatch", "combine_fwd": "combine",
                  "dispatch_bwd": "grad", "combine_bwd": "grad"}


def baselines(variants):
    """``{family: baseline variant}`` among ``variants``: DeepSpeed's bf16 layer for the
    legacy layers ("legacy"); for the AutoEP layers ("autoep") AutoEP bf16 with its fused
    combine where asked for (the faster one, what a user would pick), else without."""
    found = {"legacy": BASELINE} if BASELINE in variants else {}
    for autoep in (AUTOEP + FUSED, AUTOEP):
        if autoep in variants:
            found["autoep"] = autoep
            break
    return found


def family(variant):
    """The family whose baseline a variant is measured against (``baselines``)."""
    return "autoep" if variant.startswith("autoep") else "legacy"


def variant_section(variant):
    """The ``fp4_moe`` section of a variant, or None for DeepSpeed's own layer."""
    if variant.endswith(MONITOR):
        return {**variant_section(variant[:-len(MONITOR)]), "monitor_exactness": True}
    if variant.startswith("autoep") and variant.endswith(FUSED):
        variant = variant[:-len(FUSED)]
    if variant.endswith(WEIGHT_CACHE):
        return {**variant_section(variant[:-len(WEIGHT_CACHE)]), "fp8_weight_cache": True}
    if variant in (BASELINE, GROUPED, AUTOEP):
        return None
    if variant == "autoep-fp4":
        return recipe_section("fp4")
    if variant == "autoep-fp4-actfp8":   # AutoEP's bf16 experts keep their activations in FP8
        return {**recipe_section("fp4"), "activation_cache": "fp8"}
    if variant == "autoep-fp4-fp8experts":
        return {**recipe_section("fp4"), "fp8_experts": True}
    if variant == "fp4moe-bf16":
        return dict(ALL_BF16)
    if variant.endswith(NO_FP8_EXPERTS):
        return {**recipe_section(variant[:-len(NO_FP8_EXPERTS)]), "fp8_experts": False}
    for suffix, graphs in GRAPHS.items():
        if variant.endswith(suffix):
            return {**recipe_section(variant[:-len(suffix)]), "expert_graphs": graphs}
    for suffix in GEMM_MODES:
        if variant.endswith(suffix):
            return recipe_section(variant[:-len(suffix)])
    return recipe_section(variant)


def gemm_mode(variant):
    """``DS_FP4_EXPERT_GEMMS`` for a variant (read when its FP8 experts are made)."""
    return next((m for s, m in GEMM_MODES.items() if variant.endswith(s)), "auto")


def wire_formats(section):
    """``{a2a kind: format}`` of a variant (bf16 everywhere for DeepSpeed's layer)."""
    if section is None or not section.get("enabled", True):
        return {kind: "bf16" for kind in A2A_KINDS}
    from ds_fp4.config import FP4MoEConfig
    cfg = FP4MoEConfig.from_section(section)
    return {kind: str(getattr(cfg, A2A_FORMAT_KEY[kind])) for kind in A2A_KINDS}


def build_layer(cfg, section, ep_size, seed, device):
    """A bf16 MoE layer on ``device`` with the same weights for every variant."""
    torch.manual_seed(seed)
    # Experts are made on the device (DeepSpeed deep-copies this one): 1e9 parameters of
    # DeepSeek-like sizes would take seconds to initialize on the host.
    expert = make_expert(cfg["hidden"], cfg["ffn"]).to(device=device, dtype=torch.bfloat16)
    layer = MoE(hidden_size=cfg["hidden"], expert=expert,
                num_experts=cfg["experts"], ep_size=ep_size, k=cfg["k"],
                capacity_factor=CAPACITY_FACTOR, eval_capacity_factor=CAPACITY_FACTOR,
                min_capacity=4, drop_tokens=True, top2_2nd_expert_sampling=False)
    local = layer.deepspeed_moe.experts.deepspeed_experts
    ep_rank = tdist.get_rank() % ep_size
    for j, expert in enumerate(local):  # distinct experts, independent of the EP size
        g = torch.Generator(device=device).manual_seed(mix_seed(seed, ep_rank * len(local) + j))
        for _, param in sorted(expert.named_parameters()):
            w = torch.randn(param.shape, generator=g, device=device) * param.shape[-1] ** -0.5
            param.data.copy_(w)
    if section is not None:  # FP4MoE in place: same parameter objects
        import ds_fp4
        ds_fp4.convert(layer, config=section)
    layer = layer.to(device=device, dtype=torch.bfloat16)
    layer.set_deepspeed_parallelism()
    return layer


def make_layer(cfg, variant, section, ep_size, seed, device):
    """The layer of ``variant`` (``section``: its ``variant_section``): AutoEP's, the
    grouped bf16 layer (from DeepSpeed's, same weights) or ``build_layer``'s."""
    if variant.startswith("autoep"):
        from moe_train import autoep_layer
        combine = "fused_weighted_sum" if variant.endswith(FUSED) else "auto"
        return autoep_layer.build(cfg, section, ep_size, seed, device, combine)
    layer = build_layer(cfg, section, ep_size, seed, device)
    if variant == GROUPED:
        from moe_train.grouped_bf16 import GroupedBF16MoE
        layer = GroupedBF16MoE.from_deepspeed(layer).to(device)
    return layer


def capture_capacity(layer):
    """Wrap the gate so that the capacity C of the latest forward is kept in a dict (the
    dropless layer has none: C stays the baseline's)."""
    seen = {}
    if not hasattr(layer, "deepspeed_moe"):
        return seen
    gate = layer.deepspeed_moe.gate
    forward = gate.forward

    def wrapped(*a, **kw):
        out = forward(*a, **kw)
        seen["C"] = int(out[1])
        return out

    gate.forward = wrapped
    return seen


def experts_label(layer):
    """The expert module that ran, ``+graphs`` where it replays captured CUDA graphs."""
    if hasattr(layer, "layer"):      # AutoEP (moe_train.autoep_layer.AutoEPAdapter)
        cfg = getattr(layer.layer, "fp4_config", None)
        fp8 = cfg is not None and cfg.enabled and cfg.fp8_experts is True
        return "AutoEP FP8 grouped" if fp8 else "AutoEP GroupedExperts"
    if not hasattr(layer, "deepspeed_moe"):
        return "torch._grouped_mm"
    experts = layer.deepspeed_moe.experts
    graphs = getattr(experts, "graphs", None)
    return type(experts).__name__ + ("+graphs" if graphs is not None and graphs.captures else "")


def clear_grads(layer, x):
    """Forget the layer's and the input's gradients: each timed step starts from none, as
    a step after the optimizer's does (no gradient accumulation counted)."""
    x.grad = None
    for p in layer.parameters():
        p.grad = None


def inputs(cfg, seed, device):
    """``(x, dy)``: this rank's bf16 input (requiring its gradient) and output gradient,
    ``[tokens, hidden]`` each, seeded by ``seed`` and the rank."""
    g = torch.Generator().manual_seed(mix_seed(seed, tdist.get_rank()))
    shape = (cfg["tokens"], cfg["hidden"])
    x = torch.randn(shape, generator=g).to(device, torch.bfloat16).requires_grad_()
    return x, torch.randn(shape, generator=g).to(device, torch.bfloat16)
