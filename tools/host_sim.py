"""The FP8 experts' host time without a GPU: their Python with every launch stubbed.

On the device the host's speed moves by up to 2x between processes (bench/results/
host_cuts28_h200), which hides changes of 0.1 ms to the Python around the launches. Here
CPU tensors take the kernels' path (``backend.uses_kernels``, the grouped GEMMs'
``_use_kernel``), and CuPy's and Triton's launches, the device pointer tables and the SM
count are stubbed, so what is timed is ds_fp4's own code between launches (argument checks,
output allocation, layouts, autograd), not the launches' machinery or the kernels. Not a
prediction of the device's time: a steady yardstick for the glue, on this machine::

    python tools/host_sim.py                 # median us of fwd+bwd through autograd
    python tools/host_sim.py --profile       # and cProfile's top functions
    python tools/host_sim.py --layer tiny --switch gathered_input   # the whole FP4MoE layer
                                             # (gate, routing, experts), a change on and off

With ``OMP_NUM_THREADS=1 taskset -c 1`` in front the rounds are far steadier (the layer's
DeepSpeed gate runs real CPU ops: 3.0-4.0 ms a round against 4.3-7.7 without).

``--layer CONFIG`` times a fwd+bwd of the recipe's layer (``bench_moe_layer``'s config, on
the CPU, FP8 experts and the gate's CUDA paths forced on as on the H200; ``--variant`` another
of its layers, e.g. ``autoep-fp4-fp8experts``); ``--switch NAME`` (one of
``ab_in_process.SWITCHES``) alternates it off and on, round by round. Each setting also
reports the launches and the torch ops (those that would launch a kernel) of one step: counts
that this CPU's noise does not move. AutoEP's own permutation takes its CPU fallback here
(its Triton gather needs a GPU), so its ops are not the GPU path's.

The stubs stay in place for the rest of the process: run it as its own process.
"""

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bench_common  # noqa: F401  first: it puts the checkout on sys.path


LAUNCHES = {"cupy": 0, "triton": 0}   # launches that would have run, counted


def _count(kind):
    LAUNCHES[kind] += 1


def stub_launches():
    """Every op takes the CUDA kernels' path on CPU tensors, and no launch happens."""
    import ds_fp4.ops as ops
    from ds_fp4.ops import _cuda_loader as L
    from ds_fp4.ops import backend, cuda, fp8_tiles, grouped_gemm, grouped_gemm_triton

    class _NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: _count("triton")

    backend.select = ops.select = lambda *tensors: cuda
    backend.uses_kernels = lambda *tensors: True
    grouped_gemm._use_kernel = lambda *tensors: True
    L.launch = lambda *args, **kwargs: _count("cupy")
    L.sm_count = lambda device: 132
    grouped_gemm_triton._programs = lambda index: 264
    grouped_gemm_triton._m_grouped_kernel = grouped_gemm_triton._k_grouped_kernel = _NoLaunch()
    tables = {}   # as the real one: made once per set of addresses (no pinned memory here)
    fp8_tiles._pointer_table = lambda index, addresses: tables.setdefault(
        addresses, torch.tensor(addresses))


def experts_step(n_local=16, slots=256, hidden=512, ffn=256):
    """A function running one fwd+bwd of ``FP8Experts`` on MXFP4 rows, as the legacy layer
    calls it (ep 1, ``used`` given, the grouped GEMMs), through autograd."""
    from ds_fp4 import formats
    from ds_fp4.moe.expert import SwiGLUExpert
    from ds_fp4.moe.fp8_experts import FP8Experts
    from ds_fp4.moe import fp8_expert_passes as passes
    experts = FP8Experts(SwiGLUExpert(hidden, ffn, dtype=torch.bfloat16), n_local)
    experts.plan = passes.dataclasses.replace(experts.plan, gemms="grouped")
    params = list(experts.parameters())
    x = torch.zeros(1, n_local, slots, hidden, dtype=torch.bfloat16, requires_grad=True)
    rows = torch.zeros(1, n_local, slots, formats.mxfp4_row_bytes(hidden), dtype=torch.uint8)
    used = torch.full((n_local,), slots, dtype=torch.int32)
    dy = torch.zeros(1, n_local, slots, hidden, dtype=torch.bfloat16)

    def step():
        experts(x, rows, used).backward(dy)
        for p in params:
            p.grad = None
        x.grad = None
    return step


def layer_step(config, variant="fp4"):
    """A function running one fwd+bwd of ``variant``'s layer (``bench_moe_layer``'s: the fp4
    recipe's FP4MoE by default) at ``config`` on the CPU with the GPU's paths (FP8 experts,
    the gate's split GEMMs) and every launch stubbed."""
    from ds_fp4.moe import fp8_experts, gate_linear
    from bench_lib.moe_layer_variants import CONFIGS, clear_grads, inputs, make_layer, \
        variant_section
    from moe_train.launch import init_one_process
    init_one_process(backend="gloo")
    fp8_experts.fp8_experts_supported = lambda device=None: True
    gate_linear._on = lambda tokens: True
    cfg = CONFIGS[config]
    layer = make_layer(cfg, variant, variant_section(variant), 1, 0, torch.device("cpu"))
    x, dy = inputs(cfg, 0, torch.device("cpu"))

    def step():
        clear_grads(layer, x)
        layer(x)[0].backward(dy)
    return step


# aten ops that only make views or read metadata: no kernel on a GPU
_NO_KERNEL = ("aten.view", "aten._unsafe_view", "aten.detach", "aten.alias", "aten.t.",
              "aten.transpose", "aten.permute", "aten.expand", "aten.as_strided",
              "aten.select", "aten.slice", "aten.unsqueeze", "aten.squeeze", "aten.split",
              "aten.unbind", "aten.unflatten", "aten._reshape_alias", "aten.reshape",
              "aten.lift_fresh", "aten.is_same_size", "aten.sym_", "aten.empty",
              "aten._local_scalar_dense")


class _TorchOps(TorchDispatchMode):
    """Counts the aten ops that would launch work on a GPU (not views, not allocations)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not str(func).startswith(_NO_KERNEL)
        return func(*args, **(kwargs or {}))


def launches_a_step(step):
    """A warm-up step, then ``{"cupy": n, "triton": n, "torch": n}``: the launches one more
    step makes, and its torch ops that would launch (``_TorchOps``): a count of the host's
    work that does not move with this CPU's noise."""
    step()
    LAUNCHES.update(cupy=0, triton=0)
    ops = _TorchOps()
    with ops:
        step()
    return dict(LAUNCHES, torch=ops.count)


def median_us(step, reps):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=200, help="steps per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds; the fastest is printed")
    p.add_argument("--profile", action="store_true", help="also print cProfile's top 30")
    p.add_argument("--layer", help="time the whole fp4 layer of this bench_moe_layer config")
    p.add_argument("--switch", help="with --layer: an ab_in_process switch, off and on")
    p.add_argument("--variant", default="fp4", help="with --layer: bench_moe_layer's variant")
    args = p.parse_args(argv)
    stub_launches()
    step = experts_step() if args.layer is None else layer_step(args.layer, args.variant)
    what = "FP8 experts" if args.layer is None else f"{args.variant} layer {args.layer}"
    if args.switch:
        return _ab(step, args, what)
    per_step = launches_a_step(step)
    best = min(median_us(step, args.reps) for _ in range(args.rounds))
    print(f"{what} fwd+bwd, launches stubbed: {best:.1f} us (median of {args.reps} "
          f"steps, fastest of {args.rounds} rounds); launches a step: {per_step['cupy']} "
          f"CuPy, {per_step['triton']} Triton, {per_step['torch']} torch ops")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return best


def _ab(step, args, what):
    """Rounds alternating the switch off and on; prints each setting's medians and
    launches a step; returns ``{setting: [median us per round]}``."""
    from ab_in_process import SWITCHES
    switch, times, launches = SWITCHES[args.switch], {"off": [], "on": []}, {}
    for _ in range(args.rounds):
        for setting in ("off", "on"):
            switch(setting == "on")
            launches[setting] = launches_a_step(step)
            times[setting].append(median_us(step, args.reps))
    switch(True)
    for setting in ("off", "on"):
        print(f"{what}, {args.switch} {setting}: median {statistics.median(times[setting]):.1f} "
              f"us over {args.rounds} rounds ({' '.join(f'{t:.0f}' for t in times[setting])}); "
              f"launches a step: {launches[setting]['cupy']} CuPy, "
              f"{launches[setting]['triton']} Triton, {launches[setting]['torch']} torch ops")
    return times


if __name__ == "__main__":
    main()
