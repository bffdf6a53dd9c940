"""A change to the layer switched on and off in one process, rounds alternating.

For a change whose effect on a layer step (~0.5 ms) is below the spread between benchmark
runs in separate processes or on other machines (host speed differs by up to 1.5x between
device calls): the same layer, inputs and process time the step with the change on and off,
alternating, so drift hits both alike. Each round is ``bench_moe_layer.time_steps`` (the
median of ``--iters`` forward+backward steps, each from a synchronized start, as the layer
benchmark times them); memory (``bench_moe_layer.measure_memory``) once per setting::

    python tools/ab_in_process.py --switch encode_routes --configs dsv3-e32-top2 --out /tmp/ab

Switches (``SWITCHES``): ``encode_routes``: ``ops.encode_routes``' kernels (off: its twin,
DeepSpeed's ``_route_slots`` and ``_sparse_encode`` and the used count's ops, the layer's
encode before the kernels); ``split_bf16``: the gate Linear's bf16 parts from
``ops.split_bf16``'s kernel (off: its twin through ``torch.compile``, one compiled region
per layout, as before the kernel); ``route_sums``: the decode's weighted sum and the
encode's backward from ``ops.route_sums``' kernels (off: DeepSpeed's fused restore kernel
with the torch ops around it, the layer's sums before session 27); ``gate_bf16``: a bf16
gate weight used as its own top part (off: split in three parts as a float32 weight is);
``unchecked_gemms``: the FP8 experts' grouped GEMMs through the entries without argument
checks (off: the checked public functions, as before session 28); ``driver_launches``: the
CuPy kernels launched through ``cuLaunchKernel`` with packed arguments (off: CuPy's call, as
before session 29); ``gathered_input``: at EP 1 the FP8 experts read the tokens' rows through
the slots' source map (off: the encode makes the ``[E, C, M]`` slot buffer and they read it,
as before session 30); ``kept_route_rows``: the decode's FP8 route rows from the weighted
sum's own reads (off: a second pass, ``quantize_fp8_rows`` over the routes, as before
session 30); ``autoep_gathered`` (with an AutoEP ``--variant`` with FP8 experts): at EP 1
the layer runs as the legacy layer's EP 1 path, the experts reading the routes' rows from
the tokens through ``slot_map`` and ``routing.decode`` combining their slots' outputs (off:
AutoEP's routed, permuted and unpermuted copies and its combine, as before session 31).

Each round also measures the host's issue time of one step from a synchronized start
(``host_overhead.host_issue_ms``), what the layer targets compare with its GPU time.

Writes ``<out>.json`` and ``<out>.md`` (GPU, versions and date) and prints the table.
"""

import argparse
import functools
import statistics

import torch
import torch.distributed as tdist

import bench_common
import bench_moe_layer as B
from bench_lib.moe_layer_variants import (CONFIGS, clear_grads, inputs, make_layer,
                                          variant_section)
from host_overhead import layer_step, host_issue_ms
from moe_train.launch import init_one_process, local_device


def _encode_routes(on):
    from ds_fp4 import ops
    from ds_fp4.ops.encode_routes import encode_routes, encode_routes_ref
    ops.encode_routes = encode_routes if on else encode_routes_ref


_COMPILED = {}   # layout -> the twin of that layout, compiled once by ``fused``


def _split_bf16(on):
    import importlib
    from ds_fp4.moe import gate_linear
    from ds_fp4.moe.compiled import fused
    module = importlib.import_module("ds_fp4.ops.split_bf16")   # ops.split_bf16: the function

    def compiled(x, pattern, dim):
        fn = _COMPILED.setdefault((pattern, dim), lambda t: module._ref(t, pattern, dim))
        return fused(fn, x)
    gate_linear.split_bf16 = module.split_bf16 if on else compiled


def _restore(rows, slots, scores):
    """DeepSpeed's fused restore (Triton) over ``slots [k, S]`` with ``scores [S, k]``, as
    the layer called it before ``ops.route_sums``: int32 sources, -1 for the scratch slot."""
    from deepspeed.ops.triton_ops.autoep_fused_token_ops import _FusedWeightedRestore
    sources = slots.t().to(torch.int32, memory_format=torch.contiguous_format)
    sources = sources.masked_fill_(sources >= rows.shape[0], -1).view(-1)
    return _FusedWeightedRestore.apply(rows, scores, sources, scores.shape[1])


def _route_sums(on):
    from ds_fp4 import ops
    from ds_fp4.ops import route_sums
    if on:
        ops.weighted_route_sum, ops.slot_sum = route_sums.weighted_route_sum, route_sums.slot_sum
        return
    ops.weighted_route_sum = lambda rows, slots, gates: _restore(rows, slots,
                                                                 gates.t().contiguous())
    ops.slot_sum = lambda rows, slots: _restore(
        rows, torch.sort(slots, dim=0).values,
        rows.new_ones(slots.shape[1], slots.shape[0], dtype=torch.float32))


_GATE = {}   # gate_linear's functions as the library has them


def _gate_bf16(on):
    from ds_fp4.moe import gate_linear as GL
    if not _GATE:
        _GATE.update(parts=GL._weight_parts, factors=GL._grad_factors)
    if on:
        GL._weight_parts, GL._grad_factors = _GATE["parts"], _GATE["factors"]
        return
    GL._weight_parts = lambda w: _GATE["parts"](w.float())
    GL._grad_factors = lambda g, w: _GATE["factors"](g, w.float())


def _unchecked_gemms(on):
    from ds_fp4.moe import fp8_expert_passes as P
    from ds_fp4.ops import grouped_gemm as gg
    if on:
        P.m_grouped_fixed_unchecked = gg.m_grouped_fixed_unchecked
        P.k_grouped_fixed_unchecked = gg.k_grouped_fixed_unchecked
        return
    P.m_grouped_fixed_unchecked = lambda a, sa, w, ws, rows, out=None, used=None: \
        gg.m_grouped_gemm_fp8_nt(a, sa, w, ws, group_rows=rows, out=out, rows_used=used)
    P.k_grouped_fixed_unchecked = lambda a, sa, b, sb, cols, dtype, used=None: \
        gg.k_grouped_gemm_fp8_nt(a, sa, b, sb, group_cols=cols, out_dtype=dtype, cols_used=used)


_PACKED = []   # the loader's _packed as the library has it


def _driver_launches(on):
    from ds_fp4.ops import _cuda_loader as L
    if not _PACKED:
        _PACKED.append(L._packed)
    L._packed = _PACKED[0] if on else (lambda index, module, name, args: None)


_READS_GATHERED = []   # FP8Experts.reads_gathered as the library has it


def _gathered_input(on):
    from ds_fp4.moe.fp8_experts import FP8Experts
    if not _READS_GATHERED:
        _READS_GATHERED.append(FP8Experts.reads_gathered)
    FP8Experts.reads_gathered = _READS_GATHERED[0] if on else (lambda self, shape, device: False)


_KEPT = []   # ops.weighted_route_sum_kept as the library has it


def _kept_route_rows(on):
    from ds_fp4 import ops
    if not _KEPT:
        _KEPT.append(ops.weighted_route_sum_kept)
    ops.weighted_route_sum_kept = _KEPT[0] if on else lambda rows, slots, gates: (
        ops.weighted_route_sum(rows, slots, gates),
        ops.quantize_fp8_rows(rows, index=slots.reshape(-1)))


_AUTOEP_READS = []   # FP4AutoEPMoELayer._reads_gathered as the library has it


def _autoep_gathered(on):
    from ds_fp4.moe.autoep.layer import FP4AutoEPMoELayer
    if not _AUTOEP_READS:
        _AUTOEP_READS.append(FP4AutoEPMoELayer._reads_gathered)
    FP4AutoEPMoELayer._reads_gathered = _AUTOEP_READS[0] if on else (lambda self, x: False)


# name -> function(on: bool) that sets it
SWITCHES = {"encode_routes": _encode_routes, "split_bf16": _split_bf16,
            "route_sums": _route_sums, "gate_bf16": _gate_bf16,
            "unchecked_gemms": _unchecked_gemms, "driver_launches": _driver_launches,
            "gathered_input": _gathered_input, "kept_route_rows": _kept_route_rows,
            "autoep_gathered": _autoep_gathered}


def ab(cfg, variant, switch, args, device):
    """``{"on": [ms per round], "off": [...], "issue_on": [host issue ms per round],
    "issue_off": [...], "memory": {setting: measure_memory}}``."""
    layer = make_layer(cfg, variant, variant_section(variant), 1, args.seed, device)
    x, dy = inputs(cfg, args.seed, device)
    out = {"on": [], "off": [], "issue_on": [], "issue_off": [], "memory": {}}
    # one step first: the first measured setting would count one-time allocations (32 MB
    # more kept and at both peaks at 32 experts, seen on the H200)
    clear_grads(layer, x)
    layer(x)[0].backward(dy)
    for setting in ("off", "on"):
        switch(setting == "on")
        out["memory"][setting] = B.measure_memory(layer, x, dy)
    for _ in range(args.rounds):
        for setting in ("off", "on"):
            switch(setting == "on")
            out[setting].append(B.time_steps(layer, x, dy, args.warmup, args.iters))
            out["issue_" + setting].append(host_issue_ms(functools.partial(
                layer_step, layer, x, dy)))
    switch(True)
    return out


def issue(r):
    """The rounds' median host issue ms, off / on ("-" for results without them)."""
    if not r.get("issue_off"):
        return "-"
    return f"{statistics.median(r['issue_off']):.2f} / {statistics.median(r['issue_on']):.2f}"


def markdown(env, switch, variant, results):
    lines = [bench_common.environment_line(env), "",
             f"# `{switch}` on and off in one process: {variant}, fwd+bwd ms (median of each "
             "round's step medians; rounds alternate off, on)", "",
             "| config | off ms | on ms | on / off | rounds off | rounds on | host issue ms off / on "
             "| fwd peak MB off / on | fwd+bwd peak MB off / on | kept MB off / on |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for config, r in results.items():
        off, on = statistics.median(r["off"]), statistics.median(r["on"])
        mem = r["memory"]

        def pair(key):
            a, b = mem["off"][key], mem["on"][key]
            return "-" if a is None else f"{a:,.1f} / {b:,.1f}"
        lines.append(f"| {config} | {off:.2f} | {on:.2f} | {on / off:.3f} | "
                     f"{' '.join(f'{t:.2f}' for t in r['off'])} | "
                     f"{' '.join(f'{t:.2f}' for t in r['on'])} | {issue(r)} | {pair('fwd_peak_mb')} | "
                     f"{pair('fwd_bwd_peak_mb')} | {pair('kept_mb')} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--switch", required=True, choices=list(SWITCHES))
    p.add_argument("--configs", default="dsv3-e32-top2")
    p.add_argument("--variant", default="fp4")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=str(bench_common.RESULTS / "ab_in_process"))
    args = p.parse_args()
    init_one_process()
    device = local_device()
    results = {c: ab(CONFIGS[c], args.variant, SWITCHES[args.switch], args, device)
               for c in args.configs.split(",")}
    env = bench_common.environment()
    text = markdown(env, args.switch, args.variant, results)
    bench_common.write_report(args.out, {"env": env, "switch": args.switch,
                                         "variant": args.variant, "results": results}, text)
    print(text)
    tdist.barrier()


if __name__ == "__main__":
    main()
