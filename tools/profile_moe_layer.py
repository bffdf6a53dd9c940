"""Where one forward+backward of a benchmark layer spends its GPU time (torch profiler).

For a config and variants of ``tools/bench_moe_layer.py``: the CUDA kernels of one profiled
fwd+bwd (after warm-up) grouped by name, with their share of the GPU time, and the wall
time beside the GPU busy time (host-bound when the wall is larger). Writes
``<out>/profile_<config>_<variant>.txt`` and prints the summary lines::

    python tools/profile_moe_layer.py --config dsv3-e32-top2 \\
        --variants autoep-bf16-fused,autoep-fp4-fp8experts-fused --out /tmp/prof
"""

import argparse
import os
import time
from pathlib import Path

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch.profiler import ProfilerActivity, profile

from bench_lib.moe_layer_variants import (CONFIGS, gemm_mode, inputs, make_layer,
                                          variant_section)
from moe_train.launch import local_device, quiet_deepspeed, single_process_env


def _step(layer, x, dy):
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    layer(x)[0].backward(dy)


def profile_variant(config, variant, warmup, device):
    """``(wall ms, GPU busy ms, [(kernel name, calls, ms)] by time)`` of one fwd+bwd."""
    cfg = CONFIGS[config]
    layer = make_layer(cfg, variant, variant_section(variant), 1, 1234, device)
    x, dy = inputs(cfg, 1234, device)
    os.environ["DS_FP4_EXPERT_GEMMS"] = gemm_mode(variant)
    try:
        for _ in range(warmup):
            _step(layer, x, dy)
        acc = get_accelerator()
        acc.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.is_cuda else [])
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            _step(layer, x, dy)
            acc.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
    finally:
        os.environ.pop("DS_FP4_EXPERT_GEMMS")
    kernels = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:   # none on a CPU run
            n, t = kernels.get(ev.name, (0, 0.0))
            kernels[ev.name] = (n + 1, t + ev.device_time / 1e3)
    rows = sorted(((k, n, t) for k, (n, t) in kernels.items()), key=lambda r: -r[2])
    return wall, sum(t for _, _, t in rows), rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="dsv3-e32-top2", choices=sorted(CONFIGS))
    p.add_argument("--variants", default="autoep-bf16-fused,autoep-fp4-fp8experts-fused")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--top", type=int, default=25, help="kernels listed per variant")
    p.add_argument("--out", default="/tmp/profile_moe_layer")
    args = p.parse_args()
    single_process_env()
    quiet_deepspeed()
    if get_accelerator().device_name() != "cpu":
        get_accelerator().set_device(0)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for variant in args.variants.split(","):
        wall, busy, rows = profile_variant(args.config, variant, args.warmup, local_device())
        lines = [f"{args.config} {variant}: wall {wall:.2f} ms, GPU busy {busy:.2f} ms, "
                 f"{sum(n for _, n, _ in rows)} kernels", "",
                 "| ms | share | calls | kernel |", "|---|---|---|---|"]
        lines += [f"| {t:.3f} | {t / busy:.1%} | {n} | {k[:110]} |"
                  for k, n, t in rows[:args.top]]
        (out / f"profile_{args.config}_{variant}.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines[:1] + lines[2:14]), flush=True)


if __name__ == "__main__":
    main()
