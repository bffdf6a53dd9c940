"""Whether one MoE layer's forward+backward repeats bit for bit, and if not, which tensors
differ (issue 16).

On an H200 training runs of the same seed, code and settings part after a few steps (bf16
after 3-44: ``bench/results/branches_h200_1gpu``), so a "paired" seed
pairs only the initial weights and the data. This runs one layer step of each variant
``--reps`` times on the same weights and inputs and names each tensor (the output, the
input's gradient, every parameter's gradient) that is not the same bytes every time, with
how many elements differ and by how much: where the sum that runs in no fixed order is::

    python tools/repeatability.py --layer h2048-e16-top2 --variants deepspeed-bf16,fp4
"""

import argparse
import json
from pathlib import Path

import torch

import bench_common  # noqa: F401  (puts the checkout on sys.path)
from bench_lib.moe_layer_variants import (CONFIGS, clear_grads, inputs, make_layer,
                                          variant_section)


def step_tensors(layer, x, dy):
    """``{name: tensor}`` of one fwd+bwd from cleared gradients: output, input and
    parameter gradients."""
    clear_grads(layer, x)
    out = layer(x)[0]
    out.backward(dy)
    got = {"output": out.detach().clone(), "input grad": x.grad.clone()}
    got.update({f"grad {n}": p.grad.clone() for n, p in layer.named_parameters()
                if p.grad is not None})
    return got


def differences(first, other):
    """``{name: {"elements": n differing (NaN = NaN), "max_abs": largest difference}}`` of
    the tensors that are not the same bytes in both."""
    out = {}
    for name, a in first.items():
        b = other[name]
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        if not bool(same.all()):
            diff = (a.float() - b.float()).abs()[~same]
            out[name] = {"elements": int((~same).sum()), "of": a.numel(),
                         "max_abs": float(diff.max())}
    return out


def check_variant(cfg, variant, reps, device):
    """The tensors compared, and per repeat after the first its ``differences`` from the
    first."""
    layer = make_layer(cfg, variant, variant_section(variant), 1, 0, device)
    x, dy = inputs(cfg, 0, device)
    first = step_tensors(layer, x, dy)
    return {"compared": sorted(first),
            "repeats": [differences(first, step_tensors(layer, x, dy)) for _ in range(reps - 1)]}


def format_table(report):
    lines = ["| variant | repeat | tensors that differ from the first run |", "|---|---|---|"]
    for variant, got in report.items():
        for i, diffs in enumerate(got["repeats"], start=2):
            cells = "; ".join(f"{n}: {d['elements']} of {d['of']}, max {d['max_abs']:.3g}"
                              for n, d in diffs.items()) or (
                f"none: the same bytes ({len(got['compared'])} tensors)")
            lines.append(f"| {variant} | {i} | {cells} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layer", default="tiny", choices=sorted(CONFIGS))
    p.add_argument("--variants", default="deepspeed-bf16,fp4")
    p.add_argument("--reps", type=int, default=3, help="runs of the step per variant (>= 2)")
    p.add_argument("--out", default=None, help="folder for repeatability.json and .md")
    args = p.parse_args(argv)
    if args.reps < 2:
        p.error(f"--reps {args.reps}: give 2 or more (the first run is the reference)")
    from moe_train.launch import init_one_process
    init_one_process()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {v: check_variant(CONFIGS[args.layer], v, args.reps, device)
              for v in args.variants.split(",")}
    table = format_table(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "repeatability.json").write_text(json.dumps(
            {"layer": args.layer, "device": str(device), "report": report}, indent=2) + "\n")
        (out / "repeatability.md").write_text(table + "\n")
    print(table)
    return report


if __name__ == "__main__":
    main()
