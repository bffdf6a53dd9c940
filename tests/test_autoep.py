"""FP4AutoEPMoELayer on 2 gloo ranks, with a tiny Hugging Face Qwen3-MoE (random weights).

The model (2 layers, hidden 256, 8 experts, top-2) goes through ``deepspeed.initialize``
with an ``expert_parallel`` section, which replaces its MoE blocks by DeepSpeed's
``AutoEPMoELayer``; a layer is run as AutoEP built it, then converted in place and run
again on the same input. The specification of the recipe is AutoEP's own layer with its
``_AllToAllV`` replaced by "quantize, send with the same splits, dequantize" (built from
the non-row ops): outputs and every gradient must match it bit for bit; with every option
bf16 the FP4 layer must be AutoEP's layer bit for bit. Every rank gets different tokens.
"""

import contextlib
import json
import os

import pytest
import torch

from tests.dist_utils import (fake_quant, kept_route_outputs, kept_rows, rel_err, route_format,
                              saved_bytes)
from tests.dist_utils import rank as _rank

pytest.importorskip("transformers")

HIDDEN, TOKENS = 256, 32
ALL_BF16 = dict(dispatch="bf16", combine="bf16", grad="bf16", cache="bf16")
FULL = dict(dispatch="mxfp4", combine="bf16", grad="fp8", cache="mxfp4")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Largest relative L2 error (output, input gradient, any parameter gradient) against
# AutoEP's unquantized layer; measured on this model: MXFP4 0.12-0.18, FP8 ~0.04.
TOLERANCE = {"mxfp4": 0.3, "fp8": 0.08, "fp8_gemms": 0.3}  # FP8 experts: 0.17-0.24 measured






# ---- the model, the AutoEP layer and the specification ---------------------------------

def tiny_qwen3_moe(dtype=torch.bfloat16, hidden=HIDDEN, seed=0):
    """A 2-layer Qwen3-MoE (8 experts, top-2, byte vocabulary), the same on every rank."""
    import transformers
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=64, norm_topk_prob=True)
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(cfg).to(dtype)


def _ds_config(ep=2, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": "qwen3_moe"}}
    cfg.update(extra)
    return cfg


def _autoep_layer(ep, dtype, hidden=HIDDEN, **autoep):
    """The first MoE layer of a tiny model that ``deepspeed.initialize`` gave to AutoEP
    (``autoep``: more ``expert_parallel`` keys)."""
    import deepspeed
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    cfg = _ds_config(ep)
    cfg["expert_parallel"].update(autoep)
    engine, *_ = deepspeed.initialize(model=tiny_qwen3_moe(DTYPES[dtype], hidden), config=cfg)
    layer = engine.module.model.layers[0].mlp
    assert type(layer) is AutoEPMoELayer and layer.ep_size == ep
    return layer


def _inputs(dtype, hidden=HIDDEN):
    torch.manual_seed(100 + _rank())
    x = torch.randn(2, TOKENS // 2, hidden).to(DTYPES[dtype])
    return x, torch.randn(2, TOKENS // 2, hidden).to(DTYPES[dtype])


class FakeQuantAllToAllV:
    """Test-only stand-in for AutoEP's ``_AllToAllV``: quantize, send, dequantize.

    Patched over ``auto_ep_layer._AllToAllV`` it turns AutoEP's own layer into the
    specification of the FP4 layer: forward calls alternate dispatch, combine; gradients go
    through ``grad``'s format with the reversed splits. With ``cache``, the routes' outputs
    that AutoEP's restore saves for the scores' gradient are rounded through it
    (``kept_route_outputs``); with ``activations``, the ``[N, F]`` tensors its experts save.
    """

    def __init__(self, dispatch, combine, grad, rounding="rceil", cache=None,
                 activations=None):
        import torch.distributed as tdist
        self.formats, self.calls = (dispatch, combine), 0
        self.cache, self.rounding, self.activations = cache, rounding, activations

        def send(t, fmt, out_splits, in_splits, group):
            t = fake_quant(t.contiguous(), fmt, rounding).contiguous()
            out = t.new_empty((sum(out_splits), t.shape[1]))
            tdist.all_to_all_single(out, t, output_split_sizes=out_splits,
                                    input_split_sizes=in_splits, group=group)
            return out

        class _Fn(torch.autograd.Function):

            @staticmethod
            def forward(ctx, group, x, input_splits, output_splits, fmt):
                ctx.args = (group, input_splits, output_splits)
                return send(x, fmt, output_splits, input_splits, group)

            @staticmethod
            def backward(ctx, g):
                group, input_splits, output_splits = ctx.args
                return None, send(g, grad, input_splits, output_splits, group), None, None, None

        self._fn = _Fn

    def apply(self, group, x, input_splits, output_splits):
        fmt = self.formats[self.calls % 2]
        self.calls += 1
        return self._fn.apply(group, x, input_splits, output_splits, fmt)


def forward_backward(layer, x, g, fake=None):
    """``layer(x)`` and its backward of ``g``: ``(output, x.grad, {param name: grad})``."""
    from deepspeed.module_inject import auto_ep_layer
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    saved = auto_ep_layer._AllToAllV
    keep = contextlib.ExitStack()
    if fake is not None:
        auto_ep_layer._AllToAllV = fake
        if fake.cache is not None:
            keep.enter_context(kept_route_outputs(auto_ep_layer, "combine_from_routed",
                                                  fake.cache, fake.rounding,
                                                  lambda out, *_: out.shape[0]))
            # score_apply "pre": the float32 routes that the scaling keeps for the scores
            keep.enter_context(kept_rows(auto_ep_layer, "apply_scores_before_experts_if_enabled",
                                         fake.cache, fake.rounding, lambda rows, *_: rows.shape,
                                         dtype=torch.float32))
        if fake.activations is not None:
            ffn = layer.experts.w1.shape[1]
            keep.enter_context(kept_rows(layer.experts, "forward", fake.activations,
                                         fake.rounding, lambda rows, *_: (rows.shape[0], ffn)))
    try:
        with keep:
            out = layer(x)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(g)
    finally:
        auto_ep_layer._AllToAllV = saved
    assert fake is None or fake.calls == 2
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.detach(), grads


def _assert_equal(got, want, what):
    """Bit-exact equality of (output, input grad, {param: grad}); NaN equals NaN."""
    assert got[2].keys() == want[2].keys() and want[2], what
    pairs = [("output", got[0], want[0]), ("input grad", got[1], want[1])]
    pairs += [(f"grad of {n}", got[2][n], want[2][n]) for n in want[2]]
    for name, a, b in pairs:
        assert torch.equal(a.isnan(), b.isnan()), f"{what}: {name} NaN pattern differs"
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), \
            f"{what}: {name} differs, rel err {rel_err(a.nan_to_num(), b.nan_to_num()):.3g}"


def _errors(got, want):
    return [rel_err(got[0], want[0]), rel_err(got[1], want[1])] + \
        [rel_err(got[2][n], want[2][n]) for n in want[2]]


def _convert(layer, cfg):
    from ds_fp4.moe.autoep import FP4AutoEPMoELayer, to_fp4_autoep
    to_fp4_autoep(layer, cfg)
    assert isinstance(layer, FP4AutoEPMoELayer)
    return layer


# ---- exact: nothing quantized, and against the specification ---------------------------

def check_exact_and_spec(ep, dtype, spec_cfgs, autoep=None):
    """All-bf16 (bf16 model) and ``enabled: false`` are AutoEP bit for bit; each config of
    ``spec_cfgs`` is the fake-quantized AutoEP bit for bit. Returns the cached views."""
    autoep = autoep or {}
    layer = _autoep_layer(ep, dtype, **autoep)
    assert layer.score_apply == autoep.get("score_apply", "post")
    x, g = _inputs(dtype)
    want = forward_backward(layer, x, g)
    _assert_equal(forward_backward(_convert(layer, dict(enabled=False)), x, g), want, "disabled")
    if dtype == "bf16":
        _assert_equal(forward_backward(_convert(layer, ALL_BF16), x, g), want, "all bf16")
    views = []
    for cfg in spec_cfgs:
        full = dict(FULL, **cfg)
        fake = FakeQuantAllToAllV(full["dispatch"], full["combine"], full["grad"],
                                  full.get("scale_rounding", "rceil"), route_format(full),
                                  full.get("activation_cache"))
        _convert(layer, dict(enabled=False))
        spec = forward_backward(layer, x, g, fake)
        got = forward_backward(_convert(layer, cfg), x, g)
        _assert_equal(got, spec, f"{cfg} {dtype}")
        assert min(_errors(got, want)) > 0, f"{cfg}: nothing was quantized?"
        views.append(layer.cached_views)
    return views


SPEC_BF16 = [{}, dict(dispatch="fp8", cache="fp8"), dict(scale_rounding="floor"),
             dict(activation_cache="fp8")]
SPEC_FP32 = [{}, dict(combine="mxfp4", grad="bf16"),
             dict(dispatch="bf16", combine="fp8", cache="bf16")]


@pytest.mark.parametrize("dtype,cfgs,score", [("bf16", SPEC_BF16, "post"),
                                              ("fp32", SPEC_FP32, "post"),
                                              ("bf16", [{}], "pre")])
def test_exact_against_autoep_and_the_spec(pool2, dtype, cfgs, score):
    """``score``: AutoEP's score_apply; with "post" (Qwen3's) the dispatch packs each token
    once and sends its row k times, with "pre" the scaled routes are packed."""
    for views in pool2.run(check_exact_and_spec, 2, dtype, cfgs, dict(score_apply=score)):
        # the grouped GEMMs save the experts' input twice (gate, up): both are the payload
        assert views == [2] * len(cfgs), views


def check_close(ep, dtype, recipe):
    """Relative errors against AutoEP: ``{"output", "input grad", param name: ...}``."""
    layer = _autoep_layer(ep, dtype)
    x, g = _inputs(dtype)
    want = forward_backward(layer, x, g)
    got = forward_backward(_convert(layer, recipe), x, g)
    return dict(zip(["output", "input grad", *want[2]], _errors(got, want))), layer.cached_views


@pytest.mark.parametrize("ep", [2, 1])
def test_recipe_within_format_error(pool2, ep):
    """The recipe, and an FP8 one, stay within their formats' error of AutoEP's layer.

    With one expert-parallel rank nothing is sent: the caches alone quantize, so only the
    weight gradients that read the experts' saved input (w1, w3) change, and the router's
    and the input's, which read the routes' outputs the restore keeps."""
    for recipe, fmt in ((FULL, "mxfp4"), (dict(dispatch="fp8", cache="fp8"), "fp8")):
        for dtype in ("bf16", "fp32"):
            for errs, views in pool2.run(check_close, ep, dtype, recipe):
                assert max(errs.values()) < TOLERANCE[fmt], (recipe, dtype, errs)
                changed = {k for k, v in errs.items() if v > 0}
                assert changed == (set(errs) if ep == 2 else
                                   {k for k in errs if k.endswith(("w1", "w3", "gate.weight"))}
                                   | {"input grad"}), errs
                assert views == 2
    if ep == 1:  # all bf16 with one rank: AutoEP bit for bit
        pool2.run(check_exact_and_spec, 1, "bf16", [])


@pytest.mark.parametrize("ep", [2, 1])
def test_fp8_experts_within_format_error(pool2, ep):
    """fp8_experts: true (grouped FP8 GEMMs inside AutoEP) stays within FP8 error of
    AutoEP's bf16 layer: every output and gradient moves, none by more than the recipe's
    format error allows (one rank: nothing sent, the experts quantize AutoEP's rows)."""
    for errs, views in pool2.run(check_close, ep, "bf16", dict(FULL, fp8_experts=True)):
        assert max(errs.values()) < TOLERANCE["fp8_gemms"], errs
        assert all(v > 0 for v in errs.values()), errs    # the GEMMs really ran in FP8
        assert views == 0                                  # the FP8 experts keep the rows


def check_expert_rows(ep):
    """``(rows, counts)`` the layer hands its experts, with AutoEP's bf16 experts and with
    the FP8 experts, on the same tokens."""
    from ds_fp4.moe.autoep import layer as fp4_layer
    run, seen = fp4_layer.run_local_experts, []

    def recording(experts, x, counts, *args, **kwargs):
        gather = kwargs.get("gather")   # one rank: x is the tokens, the map names the rows
        seen.append((x.shape[0] if gather is None else gather.tokens.numel(), counts.tolist()))
        return run(experts, x, counts, *args, **kwargs)

    layer = _autoep_layer(ep, "bf16")
    x, g = _inputs("bf16")
    fp4_layer.run_local_experts = recording
    try:
        for fp8 in (False, True):
            forward_backward(_convert(layer, dict(FULL, fp8_experts=fp8)), x, g)
    finally:
        fp4_layer.run_local_experts = run
    return seen


@pytest.mark.parametrize("ep", [2, 1])
def test_fp8_experts_get_128_row_segments(pool2, ep):
    """With fp8_experts: true the permutation aligns each expert's segment to 128 rows
    (AutoEP's pieces, its counts rounded up), so the FP8 experts take the rows as they
    are; AutoEP's bf16 experts keep AutoEP's own alignment (8)."""
    for (n8, counts8), (n128, counts128) in pool2.run(check_expert_rows, ep):
        assert n128 % 128 == 0 and sum(counts128) <= n128
        assert counts128 == [-(-c // 128) * 128 for c in counts8], (counts8, counts128)
        assert all(c % 8 == 0 for c in counts8) and any(c % 128 for c in counts8), counts8


def check_gathered_equals_copies(cache):
    """One rank, FP8 experts: the layer with the experts reading the tokens through the
    slots' map and with AutoEP's routed and permuted copies (``_reads_gathered`` off):
    ``(gathered results, copies' results, whether each read through a map, how often the
    decode handed the experts dy and the slots' scores)``."""
    from ds_fp4.moe import routing
    from ds_fp4.moe.autoep import layer as fp4_layer
    run, gathered, handed = fp4_layer.run_local_experts, [], []
    handed_grad = routing.GatheredSlots.handed_grad

    def recording(*args, **kwargs):
        gathered.append(kwargs.get("gather") is not None)
        return run(*args, **kwargs)

    def recording_handoff(self, *args):
        got = handed_grad(self, *args)
        handed.append(got is not None)
        return got

    layer = _convert(_autoep_layer(1, "bf16"), dict(FULL, fp8_experts=True, cache=cache))
    x, g = _inputs("bf16")
    fp4_layer.run_local_experts = recording
    routing.GatheredSlots.handed_grad = recording_handoff
    try:
        got = forward_backward(layer, x, g)
        layer._reads_gathered = lambda x: False
        want = forward_backward(layer, x, g)
    finally:
        fp4_layer.run_local_experts = run
        routing.GatheredSlots.handed_grad = handed_grad
    return got, want, gathered, handed


@pytest.mark.parametrize("cache", ["mxfp4", "fp8"])
def test_one_rank_fp8_experts_read_the_tokens_in_place(pool2, cache):
    """With one rank the FP8 experts read each route's row from the tokens through the
    slots' map and the decode sums their slots' outputs (no ``[T*k, H]`` routed, permuted
    or unpermuted copy), handing the experts' backward dy and the slots' scores: every
    output and gradient bit for bit AutoEP's copies' path (top-2)."""
    for got, want, gathered, handed in pool2.run(check_gathered_equals_copies, cache):
        assert gathered == [True, False] and handed == [True]
        _assert_equal(got, want, f"gathered vs copies, {cache} cache")


def check_activation_cache_reaches_experts(ep):
    """The ``z_cache`` the layer hands its FP8 experts for ``activation_cache: fp8``."""
    from ds_fp4.moe.autoep import layer as fp4_layer
    run, seen = fp4_layer.run_local_experts, []

    def recording(*args, **kwargs):
        seen.append(kwargs.get("z_cache"))
        return run(*args, **kwargs)

    layer = _autoep_layer(ep, "bf16")
    x, g = _inputs("bf16")
    fp4_layer.run_local_experts = recording
    try:
        forward_backward(_convert(layer, dict(FULL, fp8_experts=True, activation_cache="fp8")),
                         x, g)
    finally:
        fp4_layer.run_local_experts = run
    return seen


def test_activation_cache_reaches_the_fp8_experts(pool2):
    for seen in pool2.run(check_activation_cache_reaches_experts, 2):
        assert seen == ["fp8"], seen


# ---- bytes on the wire ----------------------------------------------------------------

def _record_all_to_alls(fn):
    """Run ``fn()``; return ``[(dtype, input bytes, output bytes, input splits, output splits)]``
    of every ``torch.distributed.all_to_all_single`` it made."""
    import torch.distributed as tdist
    calls, original = [], tdist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        calls.append((input.dtype, input.numel() * input.element_size(),
                      output.numel() * output.element_size(),
                      list(input_split_sizes or []), list(output_split_sizes or [])))
        return original(output, input, output_split_sizes, input_split_sizes, **kwargs)

    tdist.all_to_all_single = counted
    try:
        fn()
    finally:
        tdist.all_to_all_single = original
    return calls


def _row_bytes(fmt, m=HIDDEN):
    return {"mxfp4": m // 2 + m // 32, "fp8": m + m // 128, "bf16": 2 * m}[fmt]


def check_bytes(cfg):
    """Each all-to-all sends and receives exactly its rows times its format's row bytes."""
    import deepspeed.comm as dist
    from deepspeed.comm.comm import comms_logger
    from ds_fp4.moe import comm_stats
    full = dict(FULL, **cfg)
    layer = _autoep_layer(2, "bf16")
    x, g = _inputs("bf16")
    ds_calls = _record_all_to_alls(lambda: forward_backward(layer, x, g))
    _convert(layer, cfg)
    comm_stats.reset()
    dist.configure(enabled=True, prof_all=True, verbose=False)
    try:
        calls = _record_all_to_alls(lambda: forward_backward(layer, x, g))
    finally:
        logged = {name: sorted(sizes) for name, sizes in comms_logger.comms_dict.items()}
        comms_logger.reset_data()
        dist.configure(enabled=False, prof_all=False)
    # AutoEP: the split-count exchange, then dispatch, combine, combine grad, dispatch grad
    counts = [c for c in ds_calls if c[0] != torch.bfloat16]
    data = [c for c in ds_calls if c[0] == torch.bfloat16]
    assert len(data) == 4 and [c for c in calls if c[0] != torch.uint8] == counts, \
        "the FP4 layer made other collectives than AutoEP's (besides its 4 all-to-alls)"
    wires = [c for c in calls if c[0] == torch.uint8]
    fmts = [full["dispatch"], full["combine"], full["grad"], full["grad"]]
    for (_, sent, got, ins, outs), ref, fmt in zip(wires, data, fmts):
        assert (ins, outs) == (ref[3], ref[4]), "splits differ from AutoEP's"
        assert sent == sum(ins) * _row_bytes(fmt) and got == sum(outs) * _row_bytes(fmt)
    assert len(wires) == 4
    dispatch, combine = layer.last_handles
    handles = [dispatch.fwd_bytes, combine.fwd_bytes, combine.bwd_bytes, dispatch.bwd_bytes]
    names = ["fp4_dispatch_fwd", "fp4_combine_fwd", "fp4_combine_bwd", "fp4_dispatch_bwd"]
    sent = [c[1] for c in wires]
    assert handles == sent and comm_stats.snapshot()["bytes"] == dict(zip(names, sent))
    for name, nbytes in zip(names, sent):
        assert logged.get(name) == [nbytes], (name, logged)
    return [sum(c[3]) for c in wires]


@pytest.mark.parametrize("cfg", [{}, dict(dispatch="fp8", combine="mxfp4", grad="bf16")])
def test_bytes_per_all_to_all(pool2, cfg):
    rows = pool2.run(check_bytes, cfg)
    # each rank sends its T*k routes, and what it receives differs from rank to rank
    assert all(r[0] == TOKENS * 2 for r in rows)
    assert sum(r[1] for r in rows) == 2 * TOKENS * 2


def test_bytes_mxfp4_row_is_17_per_32():
    assert _row_bytes("mxfp4") * 32 == 17 * HIDDEN and _row_bytes("fp8") * 128 == 129 * HIDDEN


# ---- memory kept for backward ---------------------------------------------------------

def check_memory(fmt, activations=None):
    layer = _autoep_layer(2, "bf16")
    x, _ = _inputs("bf16")
    autoep = saved_bytes(layer, x)
    cfg = dict(dispatch=fmt, cache=fmt, activation_cache=activations)
    fp4 = saved_bytes(_convert(layer, cfg), x)
    return autoep, fp4, layer.last_handles[0].order.indices.numel(), layer.experts.w1.shape[1]


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_experts_input_kept_as_the_received_payload(pool2, fmt):
    """The experts' saved input ``[N', H]`` bf16 (N' received rows with AutoEP's alignment
    padding) is kept as the received rows instead, and the restore's routes' outputs
    ``[T*k, H]`` as FP8 rows: nothing else changes."""
    routes = TOKENS * 2
    for autoep, fp4, rows, _ in pool2.run(check_memory, fmt):
        assert autoep - fp4 == rows * (2 * HIDDEN - _row_bytes(fmt)) \
            + routes * (2 * HIDDEN - _row_bytes("fp8")), (autoep, fp4, rows)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_activation_cache_keeps_the_bf16_experts_activations(pool2, fmt):
    """With ``activation_cache`` set, AutoEP's bf16 experts' four ``[N', F]`` saved tensors
    (gate, up, silu(gate), h) are kept as rows of that format too."""
    routes = TOKENS * 2
    for autoep, fp4, rows, ffn in pool2.run(check_memory, "mxfp4", fmt):
        assert autoep - fp4 == rows * (2 * HIDDEN - _row_bytes("mxfp4")) \
            + routes * (2 * HIDDEN - _row_bytes("fp8")) \
            + 4 * rows * (2 * ffn - _row_bytes(fmt, ffn)), (autoep, fp4, rows)


def check_checkpointing(mode):
    """Under activation checkpointing the FP4 layer computes what it computes without."""
    import deepspeed

    class Checkpointed(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            if mode == "torch":
                return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False)
            return deepspeed.checkpointing.checkpoint(self.layer, x)

    layer = _convert(_autoep_layer(2, "bf16"), {})
    x, g = _inputs("bf16")
    want = forward_backward(layer, x, g)
    got = forward_backward(Checkpointed(layer), x, g)
    renamed = {f"layer.{n}": grad for n, grad in want[2].items()}  # the wrapper's names
    _assert_equal(got, (want[0], want[1], renamed), mode)


@pytest.mark.parametrize("mode", ["torch", "deepspeed"])
def test_activation_checkpointing(pool2, mode):
    pool2.run(check_checkpointing, mode)


# ---- NaN, and empty ranks and experts -------------------------------------------------

def check_nan():
    layer = _autoep_layer(2, "bf16")
    x, g = _inputs("bf16")
    if _rank() == 0:
        x[0, 3, 5] = float("nan")
    want = forward_backward(layer, x, g)
    got = forward_backward(_convert(layer, {}), x, g)
    pairs = [(got[0], want[0]), (got[1], want[1])] + [(got[2][n], want[2][n]) for n in want[2]]
    for i, (a, b) in enumerate(pairs):
        assert not (~b.isfinite() & a.isfinite()).any(), "a non-finite value became finite"
        if i < 2:  # output and input gradient: the same tokens are NaN as in AutoEP
            rows_a = a.isnan().reshape(-1, HIDDEN).any(-1)
            assert torch.equal(rows_a, b.isnan().reshape(-1, HIDDEN).any(-1))
    return int(got[0].isnan().reshape(-1, HIDDEN).any(-1).sum())


def test_nan_in_the_input_comes_out_nan(pool2):
    nan_tokens = pool2.run(check_nan)
    assert nan_tokens[0] == 1 and nan_tokens[1] == 0, nan_tokens


def _steer(layer, experts):
    """Make the router never choose ``experts`` (a forward hook on its gate's logits)."""
    bias = torch.zeros(layer.num_experts)
    bias[list(experts)] = -1e4
    layer.router.gate.register_forward_hook(lambda m, i, out: out + bias.to(out.dtype))


def check_empty(experts):
    layer = _autoep_layer(2, "bf16")
    _steer(layer, experts)
    x, g = _inputs("bf16")
    want = forward_backward(layer, x, g)
    _assert_equal(forward_backward(_convert(layer, ALL_BF16), x, g), want, "all bf16")
    _convert(layer, dict(enabled=False))
    spec = forward_backward(layer, x, g, FakeQuantAllToAllV("mxfp4", "bf16", "fp8",
                                                        cache="fp8"))
    layer.tokens_per_expert.zero_()
    got = forward_backward(_convert(layer, {}), x, g)
    _assert_equal(got, spec, f"no tokens to experts {experts}")
    assert all(t.isfinite().all() for t in (got[0], got[1], *got[2].values()))
    dispatch, _ = layer.last_handles
    return dispatch.input_splits, dispatch.output_splits, layer.tokens_per_expert.tolist()


def test_zero_tokens_to_a_rank_or_an_expert(pool2):
    # experts 4-7 live on rank 1: it receives nothing and every rank sends to rank 0 only
    for rank, (ins, outs, counts) in enumerate(pool2.run(check_empty, (4, 5, 6, 7))):
        assert ins[1] == 0 and sum(ins) == TOKENS * 2
        assert outs == ([TOKENS * 2] * 2 if rank == 0 else [0, 0])
    # expert 1 (rank 0) gets no token; the others do
    for _, _, counts in pool2.run(check_empty, (1,)):
        assert counts[1] == 0 and sum(counts) == TOKENS * 2


# ---- errors ---------------------------------------------------------------------------

def check_layer_errors():
    """Conversion refuses, naming the key, and leaves the layer as AutoEP built it."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    from ds_fp4.moe.autoep import to_fp4_autoep
    layer = _autoep_layer(2, "bf16")
    bad = [(dict(expert_graphs=True), "fp4_moe.expert_graphs"),
           (dict(gemm_streams=2), "fp4_moe.gemm_streams")]
    for cfg, key in bad:
        with pytest.raises(ValueError, match=key):
            to_fp4_autoep(layer, cfg)
        assert type(layer) is AutoEPMoELayer
    for ok in (dict(fp8_experts=False, expert_graphs=False), dict(fp8_experts="auto"),
               dict(fp8_experts=True)):
        to_fp4_autoep(layer, ok)
    layer.experts.activation = "geglu_tanh"      # FP8 experts run swiglu only
    with pytest.raises(ValueError, match="fp4_moe.fp8_experts = true but the experts' activ"):
        to_fp4_autoep(layer, dict(fp8_experts=True))
    layer.experts.activation = "swiglu"
    layer = _autoep_layer(2, "bf16")
    layer.comm_backend = "deepep"
    with pytest.raises(ValueError, match="expert_parallel.comm_backend"):
        to_fp4_autoep(layer, {})
    to_fp4_autoep(layer, dict(enabled=False))  # DeepEP with fp4_moe off is AutoEP's business
    small = _autoep_layer(2, "bf16", hidden=160)  # a multiple of 32, not of 128
    with pytest.raises(ValueError, match="fp4_moe.grad = 'fp8' needs a multiple of 128"):
        to_fp4_autoep(small, {})
    assert type(small) is AutoEPMoELayer
    to_fp4_autoep(small, dict(grad="bf16"))  # MXFP4 dispatch and cache fit 160
    narrow = _autoep_layer(2, "bf16")
    narrow.experts.w1 = torch.nn.Parameter(narrow.experts.w1.detach()[:, :96])   # ffn 96
    with pytest.raises(ValueError, match="fp4_moe.activation_cache = 'fp8' keeps the experts'"):
        to_fp4_autoep(narrow, dict(activation_cache="fp8"))
    assert type(narrow) is AutoEPMoELayer
    to_fp4_autoep(narrow, dict(activation_cache="mxfp4"))   # 96 is three MXFP4 blocks


def test_conversion_errors_name_the_key(pool2):
    pool2.run(check_layer_errors)


def test_ds_config_checked_before_deepspeed_starts():
    from ds_fp4.moe.autoep import check_ds_config
    for section, key in ((dict(expert_graphs=True), "fp4_moe.expert_graphs"),
                         (dict(gemm_streams=4), "fp4_moe.gemm_streams")):
        with pytest.raises(ValueError, match=key):
            check_ds_config(dict(_ds_config(), fp4_moe=section))
    deepep = _ds_config()
    deepep["expert_parallel"]["comm_backend"] = "deepep"
    with pytest.raises(ValueError, match='comm_backend = "deepep"'):
        check_ds_config(dict(deepep, fp4_moe={}))
    check_ds_config(dict(deepep, fp4_moe={"enabled": False}))
    check_ds_config(dict(_ds_config(), fp4_moe=dict(fp8_experts=True),
                         expert_parallel={"enabled": False}))  # no AutoEP: legacy rules
    check_ds_config(dict(_ds_config(), fp4_moe={}))


def test_initialize_refuses_deepep_before_deepspeed(monkeypatch):
    import functools
    import deepspeed
    import ds_fp4

    @functools.wraps(deepspeed.initialize)  # the same signature, which initialize binds
    def must_not_run(*args, **kwargs):
        raise AssertionError("deepspeed.initialize ran")

    monkeypatch.setattr(deepspeed, "initialize", must_not_run)
    cfg = _ds_config()
    cfg["expert_parallel"]["comm_backend"] = "deepep"
    with pytest.raises(ValueError, match="deepep"):
        ds_fp4.initialize(model=torch.nn.Linear(4, 4), config=dict(cfg, fp4_moe={}))


def test_missing_autoep_internals_name_the_version(monkeypatch):
    import types
    from deepspeed.module_inject import auto_ep_layer
    from ds_fp4.moe.autoep import AutoEPVersionError, _internals, convert_autoep

    class Marked(torch.nn.Module):
        _is_autoep_layer = True  # what AutoEP's layers carry

    stripped = types.SimpleNamespace(**{n: getattr(auto_ep_layer, n) for n in dir(auto_ep_layer)
                                        if n != "permute_by_local_expert"})
    monkeypatch.setattr(_internals, "auto_ep_layer", stripped)
    with pytest.raises(AutoEPVersionError, match=r"DeepSpeed 0\.19\.8.*permute_by_local_expert"):
        convert_autoep(torch.nn.Sequential(Marked()), {})
    monkeypatch.undo()
    # the ep_kernels pieces that the FP8 experts' 128-row permutation composes
    from deepspeed.moe import ep_kernels
    monkeypatch.setattr(_internals, "ep_kernels", types.SimpleNamespace(
        **{n: getattr(ep_kernels, n) for n in dir(ep_kernels) if n != "permute_rows"}))
    with pytest.raises(AutoEPVersionError,
                       match=r"0\.19\.8.*lacks deepspeed\.moe\.ep_kernels\.permute_rows\."):
        convert_autoep(torch.nn.Sequential(Marked()), {})
    # fp4_moe off: the layers stay AutoEP's, which needs nothing of those internals
    assert convert_autoep(torch.nn.Sequential(Marked()), {"enabled": False}) == 0
    monkeypatch.setattr(_internals, "auto_ep_layer", None)
    with pytest.raises(AutoEPVersionError, match=r"deepspeed==0\.19\.8"):
        convert_autoep(torch.nn.Sequential(Marked()), {})
    assert convert_autoep(torch.nn.Linear(4, 4), {}) == 0  # nothing to convert: no error
    monkeypatch.undo()
    with pytest.raises(AutoEPVersionError, match="without router"):
        _internals.require_layer(Marked())


# ---- DeepSpeed engine: save with bf16 AutoEP, load into the FP4 layer and back ----------

def _optimizer(params):
    """Called by the engine after AutoEP replaced the experts: their weights (marked
    ``allreduce=False``) get their own MoE param group, which ZeRO 1/2 need."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(params), "name": "params"})
    return torch.optim.AdamW(groups, lr=3e-3)


def _engine(init_seed, cfg, use="ds_fp4"):
    import deepspeed
    import ds_fp4
    model = tiny_qwen3_moe(torch.bfloat16, seed=init_seed)
    kw = dict(model=model, model_parameters=model.parameters(), optimizer=_optimizer, config=cfg)
    if use == "ds_fp4":
        engine, *_ = ds_fp4.initialize(**kw)
    else:
        engine, *_ = deepspeed.initialize(**kw)
        if use == "configure":
            ds_fp4.configure(engine)
    return engine


def _train(engine, start, steps):
    losses = []
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(1000 * step + _rank())
        ids = torch.randint(0, 256, (2, 32), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _params(engine):
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _moe_types(engine):
    return {type(layer.mlp).__name__ for layer in engine.module.model.layers}


def check_checkpoints(ckpt_dir, stage):
    """bf16 AutoEP saves; the FP4 layer loads it and trains close to AutoEP; its own save
    resumes on the same curve (through ``configure``) and loads back into AutoEP."""
    import deepspeed.comm as dist
    base = _ds_config(bf16={"enabled": True}, zero_optimization={"stage": stage})
    fp4 = dict(base, fp4_moe={})
    a = _engine(1, base, "deepspeed")
    assert _moe_types(a) == {"AutoEPMoELayer"}
    _train(a, 0, 2)
    a.save_checkpoint(ckpt_dir, tag="bf16_s2")
    saved = _params(a)
    bf16_tail = _train(a, 2, 2)

    b = _engine(2, fp4)  # other initial weights, then load
    assert _moe_types(b) == {"FP4AutoEPMoELayer"}
    b.load_checkpoint(ckpt_dir, tag="bf16_s2")
    assert all(torch.equal(p, saved[n]) for n, p in _params(b).items())
    fp4_tail = _train(b, 2, 2)
    dist.barrier()
    b.save_checkpoint(ckpt_dir, tag="fp4_s4")
    saved = _params(b)
    fp4_next = _train(b, 4, 1)

    c = _engine(3, fp4, "configure")  # deepspeed.initialize + ds_fp4.configure
    assert _moe_types(c) == {"FP4AutoEPMoELayer"}
    c.load_checkpoint(ckpt_dir, tag="fp4_s4")
    assert _train(c, 4, 1) == fp4_next, "the FP4 layer does not resume on the same curve"

    d = _engine(4, base, "deepspeed")  # AutoEP's own layer loads the FP4 run's checkpoint
    d.load_checkpoint(ckpt_dir, tag="fp4_s4")
    assert all(torch.equal(p, saved[n]) for n, p in _params(d).items())
    return bf16_tail, fp4_tail, fp4_next + _train(d, 4, 1)


@pytest.mark.parametrize("stage", [0, 2])
def test_save_load_resume(pool2, tmp_path, stage):
    for bf16_tail, fp4_tail, next_steps in pool2.run(check_checkpoints, str(tmp_path), stage):
        values = bf16_tail + fp4_tail + next_steps
        assert all(v == v and 0 < v < 10 for v in values), values
        for a, b in zip(bf16_tail + next_steps[:1], fp4_tail + next_steps[1:]):
            assert abs(a - b) / a < 0.02, (bf16_tail, fp4_tail, next_steps)


def check_bf16_start(ckpt_dir):
    """``bf16_start_steps: 2`` through ``ds_fp4.initialize``: AutoEP's own losses for two
    steps, then those of the FP4 layer resumed from AutoEP's step-2 checkpoint."""
    base = _ds_config(bf16={"enabled": True})
    a = _engine(1, base, "deepspeed")
    bf16_head = _train(a, 0, 2)
    a.save_checkpoint(ckpt_dir, tag="s2")
    bf16_tail = _train(a, 2, 2)
    b = _engine(2, dict(base, fp4_moe={}))
    b.load_checkpoint(ckpt_dir, tag="s2")
    fp4_tail = _train(b, 2, 2)
    started = _train(_engine(1, dict(base, fp4_moe={"bf16_start_steps": 2})), 0, 4)
    return bf16_head, bf16_tail, fp4_tail, started


def test_bf16_start_is_autoep_then_the_recipe(pool2, tmp_path):
    for bf16_head, bf16_tail, fp4_tail, started in pool2.run(check_bf16_start, str(tmp_path)):
        assert started == bf16_head + fp4_tail, (bf16_head, bf16_tail, fp4_tail, started)
        assert fp4_tail != bf16_tail     # the recipe acts from step 2 on


def check_hf_model_builder(fp4):
    """tools/moe_train/hf_model.py: the ``--moe autoep`` model trains through AutoEP (ZeRO 1,
    the callable optimizer), converted by ``ds_fp4.initialize`` when ``fp4`` is set."""
    import argparse
    import sys
    import ds_fp4
    tools = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    from moe_train import hf_model
    args = argparse.Namespace(layers=2, hidden=128, heads=4, experts=4, ffn=128, top_k=2,
                              seq_len=32, lr=1e-3)
    model = hf_model.build_hf_model(args, seed=5)
    cfg = hf_model.with_autoep({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 1}}, ep_size=2)
    if fp4:
        cfg["fp4_moe"] = {}
    opt, sched = hf_model.optimizer_factories(args, lambda step: 1.0)
    engine, *_ = ds_fp4.initialize(model=model, model_parameters=model.parameters(),
                                   optimizer=opt, lr_scheduler=sched, config=cfg)
    names = {hf_model.layer_name(m) for m in hf_model.moe_layers(model)}
    losses = []
    for step in range(2):
        ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(step))
        lm, aux = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(lm + 0.01 * aux)
        engine.step()
        losses.append((lm.item(), aux.item()))
    total, expert = hf_model.count_params(model)
    return names, losses, expert, total


def test_hf_model_builder_for_train_moe(pool2):
    for fp4 in (False, True):
        for names, losses, expert, total in pool2.run(check_hf_model_builder, fp4):
            assert names == {"FP4AutoEPMoELayer" if fp4 else "AutoEPMoELayer"}
            assert all(0 < lm < 10 and 0 < aux < 10 for lm, aux in losses), losses
            assert expert == 2 * 2 * 3 * 128 * 128  # 2 layers x 2 local experts x w1, w2, w3
            assert total > expert


def test_example_ds_config_is_valid():
    from ds_fp4.config import FP4MoEConfig
    from ds_fp4.moe.autoep import check_ds_config
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "ds_config_examples", "autoep_fp4_moe.json")
    with open(path) as f:
        cfg = json.load(f)
    assert cfg["expert_parallel"]["enabled"] and FP4MoEConfig.from_whole(cfg).enabled
    check_ds_config(cfg)


def test_train_moe_picks_the_fused_combine_on_cuda_only(monkeypatch):
    import sys
    tools = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    from deepspeed.ops.triton_ops import autoep_fused_token_ops
    from moe_train import hf_model
    assert hf_model.autoep_section(2)["combine_impl"] == "auto"        # this CPU process
    # the config's own choice wins over the pick
    own = hf_model.with_autoep({"expert_parallel": {"combine_impl": "legacy_bmm"}}, 2)
    assert own["expert_parallel"]["combine_impl"] == "legacy_bmm"

    class _Cuda:
        def device_name(self):
            return "cuda"
    import deepspeed.accelerator
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: _Cuda())
    for triton, want in ((True, "fused_weighted_sum"), (False, "auto")):
        monkeypatch.setattr(autoep_fused_token_ops, "is_available", lambda: triton)
        assert hf_model.fused_combine() == want
