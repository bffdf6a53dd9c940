"""FP4MoE across processes (gloo, CPU): 2 and 4 ranks, expert parallel 1 and 2.

The specification FP4MoE is checked against is DeepSpeed's own layer with its ``_AllToAll``
replaced by "quantize, send, dequantize" in the configured formats (``FakeQuantAllToAll``,
built from the non-row ops): outputs and every gradient must match it bit for bit. Against
DeepSpeed's unmodified layer, FP4MoE must match exactly when nothing is quantized and to
the formats' precision otherwise. Every rank gets different tokens, and every expert
different weights, so a misrouted token or gradient shows.
"""

import argparse
import json
import math
import os

import pytest
import torch

from tests.dist_utils import (DistPool, FakeQuantAllToAll, checkpointed_output, forward_backward,
                              make_moe, mlp_expert, rel_err, route_format, saved_bytes)
from tests.dist_utils import rank as _rank

HIDDEN, FFN = 128, 256
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "ds_config_examples")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FULL = dict(dispatch="mxfp4", combine="bf16", grad="fp8", cache="mxfp4")
# Largest relative L2 error (output, input gradient, any parameter gradient) against
# DeepSpeed's unquantized layer. Measured on these models: MXFP4 (1 mantissa bit) 0.10-0.21,
# FP8 E4M3 (3 bits) 0.04-0.05, bf16 rounding of an fp32 model 0.003.
TOLERANCE = {"mxfp4": 0.3, "fp8": 0.08, "bf16": 0.01}








def _pair(cfg, ep, num_experts, k, drop_tokens, dtype, contiguous_input=True, expert=None):
    """(DeepSpeed's layer, an FP4MoE with the same weights)."""
    from ds_fp4.moe import to_fp4
    if expert is None:
        expert = mlp_expert(HIDDEN, FFN, contiguous_input)
    kw = dict(hidden=HIDDEN, num_experts=num_experts, ep_size=ep, k=k, drop_tokens=drop_tokens,
              dtype=DTYPES[dtype], expert=expert)
    return make_moe(**kw), to_fp4(make_moe(**kw), cfg)


def _inputs(dtype, tokens=32):
    torch.manual_seed(100 + _rank())
    x = torch.randn(2, tokens // 2, HIDDEN).to(DTYPES[dtype])
    g = torch.randn(2, tokens // 2, HIDDEN)
    return x, g


def _max_param_err(a, b):
    assert a.keys() == b.keys()
    return max(rel_err(a[n], b[n]) for n in a)


def _assert_equal(got, want, what):
    """Bit-exact equality of (out, l_aux, x.grad, {param: grad}); NaN equals NaN."""
    names = ("output", "l_aux", "input grad")
    for name, a, b in zip(names, got[:3], want[:3]):
        assert torch.equal(a.isnan(), b.isnan()), f"{what}: {name} NaN pattern differs"
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), \
            f"{what}: {name} differs, rel err {rel_err(a.nan_to_num(), b.nan_to_num()):.3g}"
    assert got[3].keys() == want[3].keys()
    for n in want[3]:
        assert torch.equal(got[3][n], want[3][n]), \
            f"{what}: grad of {n} differs, rel err {rel_err(got[3][n], want[3][n]):.3g}"


# ---- exact against the specification --------------------------------------------------

def check_matches_spec(cfg, ep, num_experts, k, drop_tokens, dtype):
    ref, fp4 = _pair(cfg, ep, num_experts, k, drop_tokens, dtype)
    full = dict(FULL, **cfg)
    x, g = _inputs(dtype)
    fake = FakeQuantAllToAll(full["dispatch"], full["combine"], full["grad"],
                             full.get("scale_rounding", "rceil"), route_format(full))
    want = forward_backward(ref, x, 7, g, fake=fake)
    got = forward_backward(fp4, x, 7, g)
    _assert_equal(got, want, f"{cfg} ep={ep} k={k} drop={drop_tokens} {dtype}")
    assert fake.calls == 2 and fp4.deepspeed_moe.last_handles[0] is not None


SPEC_CASES = [  # (config, k, drop_tokens, dtype)
    ({}, 1, True, "fp32"), ({}, 2, True, "bf16"), ({}, 3, False, "bf16"),
    ({}, 2, False, "fp32"),
    (dict(dispatch="fp8", cache="fp8"), 2, True, "bf16"),
    (dict(combine="mxfp4", grad="bf16"), 2, True, "fp32"),
    (dict(dispatch="bf16", combine="fp8", cache="bf16"), 3, True, "fp32"),
    (dict(scale_rounding="floor"), 2, True, "bf16"),
]


@pytest.mark.parametrize("cfg,k,drop_tokens,dtype", SPEC_CASES)
def test_matches_spec_2_ranks(pool2, cfg, k, drop_tokens, dtype):
    pool2.run(check_matches_spec, cfg, 2, 4, k, drop_tokens, dtype)


def check_dispatch_packs_from_the_tokens(cfg, dtype):
    """An MXFP4 or FP8 dispatch packs the slots' rows from the tokens through the slots'
    source map (``encode_gathered``), and the combine's FP8 gradient wire packs the slots'
    gradient from dy and the slots' gates (``route_gate_grads``), and FP4MoE still equals its
    specification bit for bit; a bf16 dispatch sends the slot buffer itself."""
    from ds_fp4 import ops
    from ds_fp4.moe import routing
    calls, gate_grads = [], []
    real, real_gates = routing.encode_gathered, ops.route_gate_grads
    routing.encode_gathered = lambda *a: calls.append(1) or real(*a)
    ops.route_gate_grads = lambda *a: gate_grads.append(1) or real_gates(*a)
    try:
        check_matches_spec(cfg, 2, 4, 2, True, dtype)
    finally:
        routing.encode_gathered, ops.route_gate_grads = real, real_gates
    gathered = dict(FULL, **cfg)["dispatch"] != "bf16"
    assert len(calls) == gathered
    assert len(gate_grads) == (gathered and dict(FULL, **cfg)["grad"] == "fp8")


@pytest.mark.parametrize("cfg, dtype", [({}, "bf16"), (dict(dispatch="fp8", cache="fp8"), "fp32"),
                                        (dict(dispatch="bf16", cache="bf16"), "bf16"),
                                        (dict(grad="bf16"), "bf16")])
def test_dispatch_packs_from_the_tokens(pool2, cfg, dtype):
    pool2.run(check_dispatch_packs_from_the_tokens, cfg, dtype)


@pytest.mark.parametrize("cfg,k,drop_tokens,dtype", [({}, 2, True, "bf16"), ({}, 1, False, "fp32")])
def test_matches_spec_expert_and_data_parallel(pool4, cfg, k, drop_tokens, dtype):
    pool4.run(check_matches_spec, cfg, 2, 4, k, drop_tokens, dtype)  # 4 ranks: ep 2 x dp 2


# ---- against DeepSpeed's own layer ----------------------------------------------------

def check_vs_deepspeed(cfg, ep, k, drop_tokens, dtype, exact):
    ref, fp4 = _pair(cfg, ep, 4, k, drop_tokens, dtype, contiguous_input=False)
    x, g = _inputs(dtype)
    want = forward_backward(ref, x, 3, g)
    got = forward_backward(fp4, x, 3, g)
    if exact:
        _assert_equal(got, want, f"{cfg} ep={ep} {dtype}")
        return None
    return (rel_err(got[0], want[0]), rel_err(got[2], want[2]), _max_param_err(got[3], want[3]))


ALL_BF16 = dict(dispatch="bf16", combine="bf16", grad="bf16", cache="bf16")


@pytest.mark.parametrize("cfg", [dict(enabled=False), ALL_BF16], ids=["disabled", "all-bf16"])
@pytest.mark.parametrize("world,ep,k,drop_tokens", [(2, 2, 2, True), (2, 1, 1, False),
                                                     (4, 2, 3, True), (4, 1, 2, True)])
def test_exact_when_nothing_is_quantized(pool2, pool4, cfg, world, ep, k, drop_tokens):
    """enabled: false, or every option bf16 in a bf16 model, is DeepSpeed bit for bit."""
    pool = pool2 if world == 2 else pool4
    pool.run(check_vs_deepspeed, cfg, ep, k, drop_tokens, "bf16", True)
    if cfg == dict(enabled=False):
        pool.run(check_vs_deepspeed, cfg, ep, k, drop_tokens, "fp32", True)


@pytest.mark.parametrize("recipe,fmt", [(FULL, "mxfp4"),
                                        (dict(dispatch="fp8", grad="fp8", cache="fp8"), "fp8"),
                                        (ALL_BF16, "bf16")])
@pytest.mark.parametrize("world", [2, 4])
def test_close_to_deepspeed(pool2, pool4, recipe, fmt, world):
    """Quantized recipes stay within their format's precision of DeepSpeed's layer."""
    pool = pool2 if world == 2 else pool4
    for dtype in ("fp32", "bf16"):
        if fmt == "bf16" and dtype == "bf16":
            continue  # exact, see above
        for errs in pool.run(check_vs_deepspeed, recipe, 2, 2, True, dtype, False):
            assert max(errs) < TOLERANCE[fmt], (dtype, errs)
            assert min(errs) > 0, f"{recipe} {dtype}: nothing was quantized? {errs}"


# ---- the all-to-all Function itself ----------------------------------------------------

def check_wire_function(fwd, bwd, dtype):
    """Forward = send Q_fwd(x); backward = send Q_bwd(g): straight through the quantizers."""
    import torch.distributed as tdist
    from deepspeed.utils import groups
    from ds_fp4.config import Format
    from ds_fp4.moe.alltoall import A2AHandle, WirePlan, wire_all_to_all
    from tests.dist_utils import fake_quant
    layer = make_moe(HIDDEN, FFN, num_experts=4, ep_size=2)  # creates the ep group
    group = groups._get_expert_parallel_group(layer.expert_group_name)
    torch.manual_seed(50 + _rank())
    x = torch.randn(4, 6, HIDDEN).to(DTYPES[dtype]).requires_grad_(True)
    g = torch.randn(4, 6, HIDDEN).to(DTYPES[dtype])
    handle = A2AHandle(WirePlan("test", Format(fwd), Format(bwd)), group, 2, 2)
    y = wire_all_to_all(x, handle)
    y.backward(g)

    def a2a(t):
        out = torch.empty_like(t)
        tdist.all_to_all_single(out, t.contiguous(), group=group)
        return out

    assert torch.equal(y.detach(), a2a(fake_quant(x.detach(), fwd)))
    assert torch.equal(x.grad, a2a(fake_quant(g, bwd)))
    assert handle.fwd_bytes == 4 * 6 * _row_bytes(fwd, HIDDEN)
    assert handle.bwd_bytes == 4 * 6 * _row_bytes(bwd, HIDDEN)


@pytest.mark.parametrize("fwd,bwd", [("mxfp4", "fp8"), ("fp8", "bf16"), ("bf16", "fp8")])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_wire_all_to_all_is_straight_through(pool2, fwd, bwd, dtype):
    pool2.run(check_wire_function, fwd, bwd, dtype)


# ---- bytes on the wire ----------------------------------------------------------------

def check_bytes(cfg):
    """Count what each all-to-all hands to torch.distributed; check the comms logger too."""
    import torch.distributed as tdist
    import deepspeed.comm as dist
    from deepspeed.comm.comm import comms_logger
    from ds_fp4.moe import comm_stats
    ref, fp4 = _pair(cfg, 2, 4, 2, True, "bf16")
    x, g = _inputs("bf16")
    sent, original = [], tdist.all_to_all_single

    def counted(output, input, *args, **kwargs):
        sent.append((input.numel() * input.element_size(), output.numel() * output.element_size()))
        return original(output, input, *args, **kwargs)

    tdist.all_to_all_single = counted
    comm_stats.reset()
    dist.configure(enabled=True, prof_all=True, verbose=False)
    try:
        forward_backward(ref, x, 5, g)
        ds_sent, sent[:] = list(sent), []
        forward_backward(fp4, x, 5, g)
    finally:
        tdist.all_to_all_single = original
        logged = {name: sorted(sizes) for name, sizes in comms_logger.comms_dict.items()}
        comms_logger.reset_data()
        dist.configure(enabled=False, prof_all=False)
    dispatch, combine = fp4.deepspeed_moe.last_handles
    handles = [dispatch.fwd_bytes, combine.fwd_bytes, combine.bwd_bytes, dispatch.bwd_bytes]
    return ds_sent, list(sent), comm_stats.snapshot(), logged, handles


def _row_bytes(fmt, m):
    return {"mxfp4": m // 2 + m // 32, "fp8": m + m // 128, "bf16": 2 * m}[fmt]


@pytest.mark.parametrize("cfg", [{}, dict(dispatch="fp8", combine="mxfp4", grad="bf16")])
def test_bytes_per_all_to_all(pool2, cfg):
    full = dict(FULL, **cfg)
    for ds_sent, sent, stats, logged, handles in pool2.run(check_bytes, cfg):
        # DeepSpeed's bf16 layer: dispatch, combine, combine grad, dispatch grad; 2M bytes a row
        assert len(ds_sent) == 4 and len({b for b, _ in ds_sent}) == 1
        rows = ds_sent[0][0] // (2 * HIDDEN)
        want = [rows * _row_bytes(full["dispatch"], HIDDEN),
                rows * _row_bytes(full["combine"], HIDDEN),
                rows * _row_bytes(full["grad"], HIDDEN),
                rows * _row_bytes(full["grad"], HIDDEN)]
        assert [b for b, _ in sent] == want and handles == want
        assert all(i == o for i, o in sent), "send and receive buffers differ in size"
        names = ["fp4_dispatch_fwd", "fp4_combine_fwd", "fp4_combine_bwd", "fp4_dispatch_bwd"]
        assert stats["bytes"] == dict(zip(names, want))
        assert stats["calls"] == dict.fromkeys(names, 1)
        for name, nbytes in zip(names, want):
            assert logged.get(name) == [nbytes], (name, logged)


def test_bytes_mxfp4_row_is_17_per_32():
    assert _row_bytes("mxfp4", HIDDEN) * 32 == 17 * HIDDEN
    assert _row_bytes("fp8", HIDDEN) * 128 == 129 * HIDDEN


# ---- memory kept for backward ---------------------------------------------------------

def check_memory(cfg, ep, num_experts, dtype):
    ref, fp4 = _pair(cfg, ep, num_experts, 2, True, dtype, contiguous_input=False)
    x, _ = _inputs(dtype, tokens=32)
    ds_bytes, fp4_bytes = saved_bytes(ref, x, seed=1), saved_bytes(fp4, x, seed=1)
    assert fp4.deepspeed_moe.cached_views == fp4.num_local_experts
    return ds_bytes, fp4_bytes


def _slots(num_experts, tokens=32, k=2, min_capacity=4):
    """E * C: DeepSpeed's top-k capacity with drop_tokens is ceil(k * S / E) per expert."""
    return num_experts * max(math.ceil(k * tokens / num_experts), min_capacity)


@pytest.mark.parametrize("cache", ["mxfp4", "fp8"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_saved_memory_drops_by_format_factor(pool2, cache, dtype):
    """The experts' saved inputs shrink from E*C*M*elt bytes to E*C*row_bytes, and the
    routes' outputs the decode keeps for the gates' gradient from k*S*M*elt to k*S FP8 rows;
    in a bf16 model the gate's float32 copy of its input (S*M*4) is kept as the input itself
    (S*M*2, which nothing else keeps here); besides that, only DeepSpeed's encode index
    (E*C + 1 int64: slot -> token) is not kept, since ds_fp4.moe.routing's encode backward
    reads the routes' slots that decode keeps anyway."""
    cfg = dict(dispatch=cache, cache=cache)
    elt = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    for ep, num_experts in ((2, 4), (1, 4)):  # with ep 1 the cache quantizes, with 2 it reuses
        rows = _slots(num_experts)
        for ds_bytes, fp4_bytes in pool2.run(check_memory, cfg, ep, num_experts, dtype):
            expert_inputs = rows * HIDDEN * elt
            kept = rows * _row_bytes(cache, HIDDEN)
            routes = 2 * 32                               # k x S
            route_outputs = routes * (HIDDEN * elt - _row_bytes("fp8", HIDDEN))
            encode_index = (rows + 1) * 8
            gate_copy = 32 * HIDDEN * (4 - elt)           # S x M, float32 -> the input
            assert ds_bytes - fp4_bytes == \
                expert_inputs - kept + route_outputs + gate_copy + encode_index, \
                (ep, ds_bytes, fp4_bytes)
            assert kept / expert_inputs == _row_bytes(cache, HIDDEN) / (HIDDEN * elt)


# ---- NaN and Inf ----------------------------------------------------------------------

def check_non_finite(where, value):
    ref, fp4 = _pair({}, 2, 4, 2, True, "bf16")
    x, g = _inputs("bf16")
    if where == "input":
        x[0, 3, 5] = value
    else:
        g[1, 2, 7] = value
    want = forward_backward(ref, x, 9, g)
    got = forward_backward(fp4, x, 9, g)
    bad_tokens = []
    pairs = [(got[0], want[0]), (got[2], want[2])] + [(got[3][n], want[3][n]) for n in want[3]]
    for i, (a, b) in enumerate(pairs):
        assert not (~b.isfinite() & a.isfinite()).any(), "a non-finite value became finite"
        if i < 2:  # output and input gradient: the same tokens are non-finite
            # (in parameter gradients a NaN spreads over its whole quantization block)
            rows_a = (~a.isfinite()).reshape(-1, a.shape[-1]).any(-1)
            rows_b = (~b.isfinite()).reshape(-1, b.shape[-1]).any(-1)
            assert torch.equal(rows_a, rows_b)
            bad_tokens.append(int(rows_a.sum()))
    return bad_tokens


@pytest.mark.parametrize("where", ["input", "grad"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_propagates(pool2, where, value):
    counts = pool2.run(check_non_finite, where, value)
    assert sum(sum(c) for c in counts) > 0  # something was non-finite, and it was checked


# ---- activation checkpointing ---------------------------------------------------------

def _run_output_loss(layer, x, g, mode):
    """Forward (optionally checkpointed) and backward of ``(output * g).sum()`` only."""
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(4)
    out = checkpointed_output(layer, x, mode)
    out.backward(g.to(out.dtype))
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()
                                  if p.grad is not None}


def check_checkpointing(mode, ep):
    _, fp4 = _pair({}, ep, 4, 2, True, "bf16", contiguous_input=False)
    x, g = _inputs("bf16")
    want = _run_output_loss(fp4, x, g, None)
    got = _run_output_loss(fp4, x, g, mode)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    for n in want[2]:
        assert torch.equal(got[2][n], want[2][n]), n


@pytest.mark.parametrize("mode", ["torch", "deepspeed"])
def test_activation_checkpointing(pool2, mode):
    pool2.run(check_checkpointing, mode, 2)


# ---- FP8 experts hand-off -------------------------------------------------------------

def check_fp8_experts_hand_off(dtype):
    from ds_fp4.moe import SwiGLUExpert
    from ds_fp4.moe.fp8_experts import FP8Experts
    ref, fp4 = _pair(dict(fp8_experts=True), 2, 4, 2, True, dtype,
                     expert=SwiGLUExpert(HIDDEN, FFN))
    inner = ref.deepspeed_moe
    inner.experts = FP8Experts.from_experts(inner.experts)  # quantizes what it is given
    x, g = _inputs(dtype)
    want = forward_backward(ref, x, 2, g, fake=FakeQuantAllToAll("mxfp4", "bf16", "fp8",
                                                                       cache="fp8"))
    got = forward_backward(fp4, x, 2, g)
    assert type(fp4.deepspeed_moe.experts).__name__ == "FP8Experts"
    assert fp4.deepspeed_moe.last_handles[0].rows is None  # the experts took them
    _assert_equal(got, want, f"fp8 experts {dtype}")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_fp8_experts_take_the_mxfp4_payload(pool2, dtype):
    pytest.importorskip("ds_fp4.moe.fp8_experts")
    pool2.run(check_fp8_experts_hand_off, dtype)


# ---- DeepSpeed engine: train, save, load into FP4MoE and into DeepSpeed's MoE ----------

class TinyMoENet(torch.nn.Module):
    """Linear -> MoE (residual) -> Linear regression head; loss includes the aux loss."""

    def __init__(self, ep_size, init_seed):
        super().__init__()
        torch.manual_seed(init_seed)
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        self.moe = make_moe(HIDDEN, FFN, num_experts=4, ep_size=ep_size, k=2, seed=init_seed,
                            parallel=False, ep_rank=_rank() % ep_size)
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x, y):
        h = self.inp(x)
        m, l_aux, _ = self.moe(h)
        pred = self.head(h + m).squeeze(-1)
        return torch.nn.functional.mse_loss(pred.float(), y) + 0.01 * l_aux


def _ds_config(example, section=None, stage=None):
    with open(os.path.join(EXAMPLES, example)) as f:
        cfg = json.load(f)
    cfg["train_micro_batch_size_per_gpu"] = 4
    if stage is not None:
        cfg["zero_optimization"] = {"stage": stage}
    if section is not None:
        cfg["fp4_moe"] = section
    return cfg


def _engine(init_seed, cfg, use, ep_size):
    import deepspeed
    import ds_fp4
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    model = TinyMoENet(ep_size, init_seed)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"})
    opt = torch.optim.AdamW(groups, lr=1e-2)
    if use == "ds_fp4":
        engine, *_ = ds_fp4.initialize(model=model, optimizer=opt, config=cfg)
    elif use == "ds_fp4_args":  # the ds_config path from the command line, as scripts do
        args = argparse.Namespace(deepspeed_config=cfg, local_rank=_rank())
        engine, *_ = ds_fp4.initialize(args, model, opt)
    else:
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        if use == "configure":
            ds_fp4.configure(engine)
    return engine


def _train(engine, start, steps):
    losses = []
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(1000 * step + _rank())
        x = torch.randn(4, 8, HIDDEN, generator=gen).to(torch.bfloat16)
        y = torch.randn(4, 8, generator=gen)
        torch.manual_seed(step)  # the gate's random numbers
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _params(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def engine_train_and_save(example, ckpt_dir, ep_size, stage):
    """Train 3 steps, save, train 2 more; also check ``configure`` trains the same."""
    import deepspeed.comm as dist
    from ds_fp4.moe import FP4MoE
    cfg = _ds_config(example, stage=stage)
    a = _engine(1, cfg, "ds_fp4", ep_size)
    assert isinstance(a.module.moe, FP4MoE) and a.module.moe.fp4_config.enabled
    head = _train(a, 0, 3)
    a.save_checkpoint(ckpt_dir, tag="step3")
    torch.save(_params(a), os.path.join(ckpt_dir, f"params_{_rank()}.pt"))
    tail = _train(a, 3, 2)
    dist.barrier()
    e = _engine(1, cfg, "configure", ep_size)  # deepspeed.initialize + ds_fp4.configure
    assert isinstance(e.module.moe, FP4MoE)
    assert _train(e, 0, 3) == head
    return head, tail


def engine_load_and_continue(example, ckpt_dir, ep_size, stage, tails):
    """Load the checkpoint into FP4MoE and into DeepSpeed's MoE; both continue exactly."""
    from ds_fp4.moe import FP4MoE
    cfg = _ds_config(example, stage=stage)
    saved = torch.load(os.path.join(ckpt_dir, f"params_{_rank()}.pt"))
    path = os.path.join(ckpt_dir, f"ds_config_{_rank()}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    b = _engine(2, path, "ds_fp4_args", ep_size)  # other initial weights, then load
    assert isinstance(b.module.moe, FP4MoE) and b.module.moe.fp4_config.enabled
    b.load_checkpoint(ckpt_dir, tag="step3")
    assert all(torch.equal(p, saved[n]) for n, p in _params(b).items())
    assert _train(b, 3, 2) == tails[_rank()], "FP4MoE does not continue identically"

    c = _engine(3, cfg, "deepspeed", ep_size)  # DeepSpeed's own MoE loads it
    assert not isinstance(c.module.moe, FP4MoE)
    c.load_checkpoint(ckpt_dir, tag="step3")
    assert all(torch.equal(p, saved[n]) for n, p in _params(c).items())
    ds_tail = _train(c, 3, 2)
    d = _engine(4, _ds_config(example, {"enabled": False}, stage), "ds_fp4", ep_size)
    d.load_checkpoint(ckpt_dir, tag="step3")
    assert _train(d, 3, 2) == ds_tail, "enabled: false does not continue as DeepSpeed does"


def _save_then_load(save_pool, load_pool, example, ckpt_dir, ep_size, stage):
    results = save_pool.run(engine_train_and_save, example, ckpt_dir, ep_size, stage)
    for head, tail in results:
        assert all(v == v and abs(v) < 1e3 for v in head + tail), (head, tail)
    load_pool.run(engine_load_and_continue, example, ckpt_dir, ep_size, stage,
                  [tail for _, tail in results])


def test_engine_train_save_then_fresh_processes_load(pool2, tmp_path):
    """The loading run is a new set of processes, as after a restart."""
    fresh = DistPool(2)
    try:
        _save_then_load(pool2, fresh, "fp4_moe.json", str(tmp_path), 2, None)
    finally:
        fresh.close()


def test_engine_fp8_recipe_zero0(pool2, tmp_path):
    _save_then_load(pool2, pool2, "fp8_moe.json", str(tmp_path), 2, 0)


def test_engine_expert_and_data_parallel_zero2(pool4, tmp_path):
    _save_then_load(pool4, pool4, "fp4_moe.json", str(tmp_path), 2, 2)
