"""How far each recipe piece moves one MoE layer's output and gradients, and whether it
shrinks them (issue 16: a loss gap that is the same sign on every seed points at a bias).

One legacy MoE layer (DeepSpeed's ``MoE`` with SwiGLU experts, top-2, capacity 1.25) is run
forward and backward on the same weights, input and output gradient:

- in float32: the truth;
- as DeepSpeed's bf16 layer: the baseline's own error;
- as FP4MoE with each recipe (the ds_config examples and ``bench/ablation_configs``), with
  ``fp8_experts: auto`` taken as on a Hopper GPU (on).

On the CPU the recipes run ds_fp4's reference path, which equals the GPU kernels byte for
byte (the FP8 GEMMs: float32 math on the same quantized operands), so the numbers hold for
the GPU.

For each tensor (the output, the input gradient, the router's weight gradient and each expert
projection's weight gradient over all experts) it reports two numbers against the truth, as mean +- std over seeds:

- ``rel``: ``|a - t| / |t|``;
- ``gain``: ``<a, t> / <t, t>``. Below 1 means the recipe shrinks the tensor, like a
  smaller learning rate on it.

A second table runs the FP8 experts alone (the layer's experts, ``cap = tokens / experts``
slots each) on bf16 x and on x's MXFP4 rows. The rows are what a rank receives with
EP > 1, where the forward reads them too.

The input has a few outlier channels, as LLM activations do::

    python tools/grad_numerics.py --out bench/results/grad_numerics_cpu/grad_numerics
"""

import argparse
import statistics

import torch

import bench_common
from bench_lib.moe_layer_variants import build_layer
from moe_train.launch import init_one_process
from moe_train.recipes import recipe_section

RECIPES = ("bf16", "fp8", "fp4", "bench/ablation_configs/fp4_bf16experts.json",
           "bench/ablation_configs/bf16wires_fp8experts.json",
           "bench/ablation_configs/fp4_gradbf16.json",
           "bench/ablation_configs/fp4_cachebf16.json", "bench/ablation_configs/fp4_zfp8.json",
           "bench/ablation_configs/fp4_floor.json")
OUTLIERS = 4          # input channels 20x larger than the rest


def _name(recipe):
    return recipe.rsplit("/", 1)[-1].removesuffix(".json")


def _inputs(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(cfg["tokens"], cfg["hidden"], generator=g)
    x[:, torch.randperm(cfg["hidden"], generator=g)[:OUTLIERS]] *= 20
    dy = torch.randn(cfg["tokens"], cfg["hidden"], generator=g) * 1e-3
    # bf16 values: every layer, the float32 truth too, routes the same tokens
    return x.bfloat16().float(), dy.bfloat16().float()


def _grads(module, x, dy, rows=None):
    """``{tensor: float32 value}`` of one forward+backward of ``module`` (a layer, or
    experts on ``[1, E, C, H]``; FP8 experts also take ``rows``) on ``x`` in its dtype."""
    for p in module.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_()
    y = module(x) if rows is None else module(x, rows)
    y = y[0] if isinstance(y, tuple) else y     # the MoE layer's (output, l_aux, counts)
    y.backward(dy.to(y.dtype))
    out = {"output": y.detach().float(), "input grad": x.grad.float()}
    for n, p in module.named_parameters():
        if p.grad is not None:
            # the router's weight, and each expert projection over all experts
            key = "router" if ".gate.wg." in n else "expert " + n.rsplit(".", 2)[-2]
            out.setdefault(key, []).append(p.grad.float().flatten())
    return {k: torch.cat(v) if isinstance(v, list) else v for k, v in out.items()}


def _compare(a, t):
    diff = (a.double() - t.double()).norm() / t.double().norm()
    gain = (a.double() * t.double()).sum() / (t.double() ** 2).sum()
    return diff.item(), gain.item()


def run(cfg, seeds, recipes):
    """``{recipe: {tensor: [(rel, gain) per seed]}}`` against the float32 layer."""
    res = {}
    for seed in seeds:
        x, dy = _inputs(cfg, seed)
        truth = _grads(build_layer(cfg, None, 1, seed, "cpu").float(), x, dy)
        for recipe in recipes:
            section = recipe_section(recipe if "/" not in recipe
                                     else str(bench_common.REPO / recipe))
            if section.get("fp8_experts") == "auto":   # what auto means on a Hopper GPU
                section["fp8_experts"] = True
            layer = build_layer(cfg, None if not section.get("enabled", True) else section,
                                1, seed, "cpu")
            got = _grads(layer, x.bfloat16(), dy)
            per = res.setdefault(_name(recipe), {})
            for k, t in truth.items():
                per.setdefault(k, []).append(_compare(got[k], t))
            print(seed, _name(recipe), {k: f"{v[-1][0]:.2e}/{v[-1][1]:.4f}" for k, v in per.items()},
                  flush=True)
    return res


def _stat(values):
    m = statistics.mean(values)
    return f"{m:.4g} +- {statistics.stdev(values):.1g}" if len(values) > 1 else f"{m:.4g}"


def markdown(env, cfg, seeds, res):
    tensors = list(next(iter(res.values())))
    lines = [bench_common.environment_line(env), "",
             f"# One MoE layer's error and gain against float32 ({cfg}, seeds {seeds})", "",
             "rel = |a - t| / |t|; gain = <a, t> / <t, t> (< 1: the recipe shrinks it).", "",
             "| recipe | " + " | ".join(f"{t} rel | {t} gain" for t in tensors) + " |",
             "|---|" + "---|---|" * len(tensors)]
    for recipe, per in res.items():
        cells = [f"{_stat([r for r, _ in per[t]])} | {_stat([g for _, g in per[t]])}"
                 for t in tensors]
        lines.append(f"| {recipe} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# (name, cache, activation_cache) of the FP8 experts in the rows table
EXPERT_RECIPES = (("fp8 cache", "fp8", None), ("fp4", "mxfp4", None),
                  ("fp4, activation_cache fp8", "mxfp4", "fp8"))


def run_rows(cfg, seeds):
    """The FP8 experts alone, on bf16 x (one rank) and on x's MXFP4 rows (what a rank
    receives with EP > 1, where the forward reads the rows too), against float32."""
    import copy
    from ds_fp4 import ops
    from ds_fp4.moe.fp8_experts import FP8Experts
    res, n, cap = {}, cfg["experts"], cfg["tokens"] // cfg["experts"]
    for seed in seeds:
        experts = build_layer(cfg, None, 1, seed, "cpu").deepspeed_moe.experts
        x, dy = (t[:n * cap].view(1, n, cap, -1) for t in _inputs(cfg, seed))
        truth = _grads(copy.deepcopy(experts).float(), x, dy)
        xb, rows = x.bfloat16(), ops.quantize_mxfp4_rows(x.bfloat16())
        for name, cache, act in EXPERT_RECIPES:
            module = FP8Experts.from_experts(experts, cache=cache, activation_cache=act)
            for label, r in (("bf16 x", None), ("MXFP4 rows", rows)):
                got = _grads(module, xb, dy, r)
                per = res.setdefault(f"{name}, {label}", {})
                for k, t in truth.items():
                    per.setdefault(k, []).append(_compare(got[k], t))
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--out", default=str(bench_common.RESULTS / "grad_numerics_cpu"))
    args = p.parse_args()
    init_one_process(backend="gloo")   # CPU tensors, on a GPU machine too
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg = dict(hidden=args.hidden, experts=args.experts, k=2, ffn=args.ffn, tokens=args.tokens)
    seeds = [int(s) for s in args.seeds.split(",")]
    res = run(cfg, seeds, args.recipes.split(","))
    rows = run_rows(cfg, seeds)
    env = bench_common.environment(libraries=("deepspeed",))
    text = markdown(env, cfg, seeds, res) + "\n## The FP8 experts alone, x as bf16 or as " \
        "received MXFP4 rows (EP > 1)\n" + markdown(env, cfg, seeds, rows).split("\n", 1)[1]
    bench_common.write_report(args.out, {"config": cfg, "seeds": seeds, "results": res,
                                         "experts_rows": rows, "environment": env}, text)
    print(text)


if __name__ == "__main__":
    main()
