"""FP8 experts inside AutoEP (ds_fp4.moe.autoep.fp8_experts), on rows that the layer's
``permute_aligned`` (AutoEP's permutation, 128-row alignment) grouped: equal segments give
the legacy FP8Experts' bytes; ragged segments (empty and one-row experts, from two source
ranks) give each expert's bytes alone and stay within FP8 error of AutoEP's own bf16
GroupedExperts on AutoEP's 8-row alignment; padding rows stay zero."""

import os

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")   # before deepspeed is imported

from ds_fp4 import ops
from ds_fp4.moe.autoep.fp8_experts import fp8_experts_problem, run_fp8_experts, slot_map
from ds_fp4.moe.autoep.layer import permute_aligned
from tests.test_fp8_experts import make_experts, make_inputs, rel, run_fp8

ep_experts = pytest.importorskip("deepspeed.moe.ep_experts")
from deepspeed.module_inject.auto_ep_layer import unpermute_by_local_expert  # noqa: E402


class _Weights(nn.Module):
    """AutoEP's GroupedExperts parameters (w1/w3 [E, F, H], w2 [E, H, F]) from legacy experts."""

    def __init__(self, legacy):
        super().__init__()
        ex = list(legacy.deepspeed_experts)
        self.activation = "swiglu"
        self.w1 = nn.Parameter(torch.stack([e.gate.weight.detach() for e in ex]).clone())
        self.w3 = nn.Parameter(torch.stack([e.up.weight.detach() for e in ex]).clone())
        self.w2 = nn.Parameter(torch.stack([e.down.weight.detach() for e in ex]).clone())


def _layout(tokens, local_counts, align=128):
    """What the layer hands the experts: ``(x, its packed MXFP4 rows, aligned counts,
    permuted indices)`` of ``tokens`` ``[sum(local_counts), H]`` in source-major order."""
    local_counts = torch.tensor(local_counts, dtype=torch.int32)
    x, indices, counts, _ = permute_aligned(tokens, local_counts, align)
    rows = permute_aligned(ops.quantize_mxfp4_rows(tokens), local_counts, align)[0]
    return x, rows, counts, indices


def _tokens(n, hidden=256, seed=8):
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)).to(
        torch.bfloat16)


def _run(weights, x, counts, rows, cache="mxfp4", z_cache=None):
    for p in weights.parameters():
        p.grad = None
    xin = x.clone().requires_grad_(True)
    y = run_fp8_experts(weights, xin, counts, rows, cache, z_cache=z_cache)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y.device, y.dtype)
    y.backward(dy)
    return y.detach(), xin.grad, [p.grad for p in (weights.w1, weights.w3, weights.w2)], dy


def test_activation_cache_keeps_z_alone():
    """z_cache fp8 beside cache mxfp4, on received rows: every output and gradient equals
    cache fp8's bit for bit (the rows are kept as they are; z is kept in FP8 by both), and
    the input gradient differs from the all-MXFP4 cache's."""
    weights = _Weights(make_experts(256, 256, 3))
    x, rows, counts, _ = _layout(_tokens(300), [[100, 0, 130], [20, 50, 0]])
    got = _run(weights, x, counts, rows, "mxfp4", z_cache="fp8")
    want = _run(weights, x, counts, rows, "fp8")
    for a, b in zip(got[:2] + tuple(got[2]), want[:2] + tuple(want[2])):
        assert torch.equal(a, b)
    assert not torch.equal(got[1], _run(weights, x, counts, rows, "mxfp4")[1])


@pytest.mark.parametrize("with_rows, cache", [(True, "mxfp4"), (False, "fp8"), (False, "bf16")])
def test_equal_segments_match_legacy_fp8_experts_bit_for_bit(with_rows, cache):
    legacy = make_experts(256, 128, n_local=3, seed=3)
    weights = _Weights(legacy)
    x = make_inputs(1, 3, 128, 256, seed=4)                 # [1, n, C, H]
    flat = x.reshape(3 * 128, 256)
    rows = ops.quantize_mxfp4_rows(flat) if with_rows else None
    counts = torch.full((3,), 128, dtype=torch.int32)
    y, dx, grads, dy = _run(weights, flat, counts, rows, cache)
    y0, dx0, grads0, _ = run_fp8(legacy, x, dy.view(1, 3, 128, 256), cache, with_rows)
    assert torch.equal(y, y0.view_as(y)) and torch.equal(dx, dx0.view_as(dx))
    for name, g, i in (("w1", grads[0], 0), ("w3", grads[1], 1), ("w2", grads[2], 2)):
        assert torch.equal(g, torch.stack([per[i] for per in grads0])), name


def _grouped_experts(weights):
    ge = ep_experts.GroupedExperts(256, 128, 4, use_grouped_mm=False)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(ge, name).copy_(getattr(weights, name))
    return ge


def test_ragged_segments_close_to_autoep_bf16_experts():
    weights = _Weights(make_experts(256, 128, n_local=4, seed=7))
    local = [0, 1, 136, 40]                                     # empty, one row, ragged
    tokens = _tokens(sum(local))
    x, rows, counts, indices = _layout(tokens, local)
    assert counts.tolist() == [128, 128, 256, 128] and x.shape[0] == 768
    y, dx, grads, dy = _run(weights, x, counts, rows)
    assert torch.count_nonzero(y[indices < 0]) == 0               # padding rows: zeros
    # AutoEP's bf16 experts on its own 8-row alignment: the same tokens, in token order
    n = len(tokens)
    ge = _grouped_experts(weights).to(torch.bfloat16)
    xin = ops.dequantize_mxfp4_rows(ops.quantize_mxfp4_rows(tokens), torch.bfloat16, 256)
    xin.requires_grad_(True)
    x8, indices8, counts8, _ = permute_aligned(xin, torch.tensor(local, dtype=torch.int32))
    y_ref = unpermute_by_local_expert(ge(x8, counts8), indices8, n)
    y_ref.backward(unpermute_by_local_expert(dy, indices, n))
    assert rel(unpermute_by_local_expert(y, indices, n), y_ref) < 0.1   # FP8, MXFP4 z cache
    assert rel(unpermute_by_local_expert(dx, indices, n), xin.grad) < 0.2
    for g, ref in zip(grads, (ge.w1.grad, ge.w3.grad, ge.w2.grad)):
        assert torch.count_nonzero(g[0]) == 0          # the empty expert: no gradient
        assert rel(g[1:], ref[1:]) < 0.2


def test_each_expert_gives_its_bytes_alone():
    """Ragged segments from two source ranks in the 128-aligned layout: every expert's
    output, input gradient and weight gradients are bit for bit what it gives run alone
    on its segment: no 128-token group spans two experts, the padding changes nothing."""
    weights = _Weights(make_experts(256, 128, n_local=4, seed=17))
    local = [[3, 0, 200, 9], [0, 0, 1, 130]]                   # [source rank, expert]
    x, rows, counts, _ = _layout(_tokens(343, seed=18), local)
    assert counts.tolist() == [128, 128, 256, 256] and x.shape[0] % 128 == 0
    y, dx, grads, dy = _run(weights, x, counts, rows)
    starts = [0] + counts.cumsum(0).tolist()
    for e in range(4):
        one = _Weights(make_experts(256, 128, n_local=1, seed=0))
        with torch.no_grad():
            for name in ("w1", "w3", "w2"):
                getattr(one, name).copy_(getattr(weights, name)[e:e + 1])
        seg = slice(starts[e], starts[e + 1])
        xin = x[seg].clone().requires_grad_(True)
        y1 = run_fp8_experts(one, xin, counts[e:e + 1], rows[seg])
        y1.backward(dy[seg])
        assert torch.equal(y[seg], y1) and torch.equal(dx[seg], xin.grad), e
        for g, name in zip(grads, ("w1", "w3", "w2")):
            assert torch.equal(g[e], getattr(one, name).grad[0]), (e, name)


def test_nan_row_stays_in_its_expert():
    weights = _Weights(make_experts(256, 128, n_local=2, seed=9))
    counts = torch.tensor([128, 128], dtype=torch.int32)
    x = _tokens(256, seed=10)
    x[3, 5] = float("nan")
    y = run_fp8_experts(weights, x, counts, ops.quantize_mxfp4_rows(x))
    assert y[3].isnan().any() and not y[128:].isnan().any()


def test_problems_are_named():
    weights = _Weights(make_experts(256, 128, n_local=2, seed=1))
    assert fp8_experts_problem(weights) == ""
    weights.activation = "geglu_tanh"
    assert "activation" in fp8_experts_problem(weights)
    odd = _Weights(make_experts(256, 96, n_local=2, seed=1))
    assert "ffn = 96 must be multiples of 128" in fp8_experts_problem(odd)
    with pytest.raises(ValueError, match="cache must be one of"):
        run_fp8_experts(odd, torch.zeros(1, 256), torch.ones(2, dtype=torch.int32), cache="x")
    # rows not in 128-row segments are refused (on the CPU the counts are read too)
    with pytest.raises(ValueError, match="multiple of 128 rows"):
        run_fp8_experts(weights, torch.zeros(200, 256), torch.tensor([128, 72]))
    with pytest.raises(ValueError, match=r"counts must be multiples of 128.*\[100, 28\]"):
        run_fp8_experts(weights, torch.zeros(128, 256), torch.tensor([100, 28]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_equals_the_cpu_twins():
    # The Triton grouped GEMMs and CUDA quantizers against the CPU reference path, on
    # ragged segments with alignment padding (device offsets: no host sync in the path).
    weights = _Weights(make_experts(512, 256, n_local=5, seed=11))
    x, rows, counts, _ = _layout(_tokens(494, 512, seed=12), [0, 1, 300, 129, 64])
    cpu = _run(weights, x, counts, rows)
    gpu = _run(weights.cuda(), x.cuda(), counts.cuda(), rows.cuda())
    for got, want in ((gpu[0], cpu[0]), (gpu[1], cpu[1]), *zip(gpu[2], cpu[2])):
        assert rel(got.cpu(), want) < 2e-2


def test_exactness_counts_the_rows_converted():
    weights = _Weights(make_experts(256, 128, n_local=2, seed=13))
    tokens = _tokens(128, seed=14)
    tokens[7, :128] *= 2.0 ** -20   # one 128-group whose blocks spread by far more than 14
    tokens[7, :32] *= 2.0 ** 20
    # the layout: expert 0's 100 rows, zeros to 128, expert 1's 28, zeros to 256, then
    # AutoEP's bound on the height (made without a host sync): 128 + 2 * 128 = 384 rows
    x, rows, counts, _ = _layout(tokens, [100, 28])
    assert rows.shape[0] == 384
    got = torch.zeros(3, dtype=torch.int64)
    run_fp8_experts(weights, x, counts, rows, exactness=got)
    want = torch.zeros(3, dtype=torch.int64)
    ops.mxfp4_rows_to_fp8(rows, 256, want)
    assert torch.equal(got, want) and want[0] >= 1 and want[2] == 384 * 2
    # the backward's direct column conversion counts too: every column group of the rows
    # (zero padding rows count as exact)
    got = torch.zeros(3, dtype=torch.int64)
    xin = x.clone().requires_grad_(True)
    run_fp8_experts(weights, xin, counts, rows, exactness=got).float().sum().backward()
    col = torch.zeros(3, dtype=torch.int64)
    ops.mxfp4_to_fp8_colwise(*ops.split_mxfp4_rows(rows, 256), [0, 384], col)
    assert col[2] == 256 * 3 and col[0] >= 1           # 256 features x 3 token blocks
    assert torch.equal(got, want + col)


def test_kernels_option_governs_both_passes(monkeypatch):
    """``kernels=`` (the layer's ``fp4_moe.kernels``) is the mode of every op, forward and
    backward, whatever the process setting."""
    seen = []
    quant = ops.segment_quant

    def recording(*args, **kwargs):
        seen.append(ops.get_kernels())
        return quant(*args, **kwargs)

    monkeypatch.setattr(ops, "segment_quant", recording)
    weights = _Weights(make_experts(256, 128, n_local=2, seed=15))
    xin = _tokens(256, seed=16).requires_grad_(True)
    with ops.kernels("auto"):
        y = run_fp8_experts(weights, xin, torch.tensor([128, 128], dtype=torch.int32),
                            kernels="reference")
        y.float().sum().backward()
        assert ops.get_kernels() == "auto"
    assert len(seen) >= 4 and set(seen) == {"reference"}, seen


def _routes(tokens, experts, k, seed, empty=()):
    """``(order, counts)``: each token's k distinct experts (none of ``empty``), the routes
    (``t * k + j``) in expert order and each expert's route count."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.tensor([e for e in range(experts) if e not in empty])
    choice = torch.stack([chosen[torch.randperm(len(chosen), generator=g)[:k]]
                          for _ in range(tokens)])
    order = torch.argsort(choice.view(-1), stable=True)
    return order, torch.bincount(choice.view(-1), minlength=experts).to(torch.int32)


def _gathered_and_copies(weights, tokens, order, counts, k, cache, donate=True):
    """The experts on ``tokens`` routed by ``order`` (k routes a token), reading the rows
    through ``slot_map`` and through AutoEP's two copies (``x[order // k]``, then
    ``permute_aligned``): ``[(y, tokens' grad, weight grads, slots' grad or None)]`` for
    the copies, then the gathered; and the permuted ``indices``. ``donate``: the experts
    write their input's gradient into their output's (the layer's setting)."""
    results, dy = [], None
    for gathered in (False, True):
        for p in weights.parameters():
            p.grad = None
        xin = tokens.clone().requires_grad_(True)
        x, indices, aligned, _ = permute_aligned(xin[order // k], counts, 128)
        if gathered:
            y = run_fp8_experts(weights, xin, aligned, None, cache, donate_grad=donate,
                                gather=slot_map(order, indices, k))
        else:
            x.retain_grad()
            y = run_fp8_experts(weights, x, aligned, None, cache, donate_grad=donate)
        if dy is None:
            dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(24)).to(y)
        y.backward(dy.clone())   # a donated gradient's buffer is written over
        results.append((y.detach(), xin.grad, [p.grad for p in weights.parameters()],
                        None if gathered else x.grad))
    return results, indices


def _check_gathered(results, indices, order, k):
    """The gathered path against the copies' (``_gathered_and_copies``): the output and the
    weight gradients bit for bit; the tokens' gradient is each token's slots' gradients
    (the copies' path's, before its index backward) added in float32 in slot order and
    rounded once, which for k = 2 is also what the copies' path gives."""
    (y0, dx0, grads0, dslots), (y1, dx1, grads1, _) = results
    assert torch.equal(y1, y0) and all(map(torch.equal, grads1, grads0))
    # each token's slots, ascending, from the copies' own layout
    indices, order = indices.cpu(), order.cpu()
    slot_of_route = torch.empty(order.numel(), dtype=torch.int64)
    valid = indices >= 0
    slot_of_route[order[indices[valid].long()]] = torch.arange(len(indices))[valid]
    slots = slot_of_route.view(-1, k).sort(dim=1).values.to(dslots.device)
    want = dslots.float()[slots].sum(1).to(torch.bfloat16)   # in slot order (k <= 3)
    assert torch.equal(dx1, want)
    if k == 2:
        assert torch.equal(dx1, dx0)
    else:
        assert rel(dx1.float().cpu(), dx0.float().cpu()) < 1e-2


@pytest.mark.parametrize("k, cache, donate", [(2, "mxfp4", True), (3, "fp8", True),
                                               (3, "mxfp4", False), (1, "fp8", True)])
def test_gathered_rows_equal_the_copies(k, cache, donate):
    """One rank's layer: the experts reading the tokens through ``slot_map`` against
    AutoEP's two copies (``_check_gathered``), an expert without routes among them."""
    weights = _Weights(make_experts(256, 128, n_local=4, seed=21))
    order, counts = _routes(150, 4, k, seed=23, empty=(2,))
    assert counts[2] == 0
    results, indices = _gathered_and_copies(weights, _tokens(150, seed=22), order, counts,
                                            k, cache, donate)
    _check_gathered(results, indices, order, k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k, cache", [(2, "mxfp4"), (3, "fp8")])
def test_gathered_rows_cuda(monkeypatch, k, cache):
    """The same on the GPU (the gathering kernels, ``ops.slot_sum``'s kernel reading the
    donated buffer, AutoEP's Triton permutation), ragged segments with an empty expert; and
    within FP8 error of the CPU twins."""
    from ds_fp4.ops import _cuda_loader as L
    from tests.kernel_emu.fp8 import cupy_or_skip
    cupy_or_skip()
    launched, launch = [], L.launch
    monkeypatch.setattr(L, "launch", lambda device, module, name, *args, **kwargs: (
        launched.append(name), launch(device, module, name, *args, **kwargs))[1])
    weights = _Weights(make_experts(512, 256, n_local=5, seed=27))
    order, counts = _routes(300, 5, k, seed=28, empty=(1,))
    assert counts[1] == 0
    tokens = _tokens(300, 512, seed=29)
    results, indices = _gathered_and_copies(weights.cuda(), tokens.cuda(), order.cuda(),
                                            counts.cuda(), k, cache)
    assert "route_sum_bf16" in launched and any(n.endswith(("_g", "_g_p", "_g_o3"))
                                                for n in launched), launched
    assert any(n.endswith("_gather") for n in launched), launched   # the cache's rows
    _check_gathered(results, indices, order, k)
    cpu, _ = _gathered_and_copies(weights.cpu(), tokens, order, counts, k, cache)
    for got, want in ((results[1][0], cpu[1][0]), (results[1][1], cpu[1][1])):
        assert rel(got.float().cpu(), want.float()) < 2e-2


def test_slot_map_names_each_rows_token_and_each_routes_slot():
    order, counts = _routes(40, 5, 3, seed=25)
    _, indices, aligned, _ = permute_aligned(torch.zeros(120, 8), counts, 128)
    tokens, slots, handoff = slot_map(order, indices, 3)
    assert handoff is None                              # the layer adds the decode's
    assert tokens.shape == indices.shape and slots.shape == (3, 40)
    for s, i in enumerate(indices.tolist()):
        if i < 0:
            assert tokens[s] >= 40                      # padding: outside the tokens
        else:
            assert tokens[s] == order[i] // 3 and slots[order[i] % 3, order[i] // 3] == s
    assert sorted(slots.flatten().tolist()) == sorted(torch.nonzero(indices >= 0).flatten()
                                                      .tolist())
    # padding as AutoEP's inverse_permutation allows it too: at or past the routes
    past = torch.where(indices >= 0, indices, 120 + torch.arange(len(indices)) % 3)
    assert all(map(torch.equal, slot_map(order, past, 3)[:2], (tokens, slots)))
    # no routes at all: every slot is padding
    empty_tokens, empty_slots, _ = slot_map(torch.zeros(0, dtype=torch.int64),
                                            torch.full((128,), -1), 2)
    assert empty_tokens.shape == (128,) and empty_slots.shape == (2, 0)


def test_gather_needs_bf16_tokens_and_a_quantized_cache():
    weights = _Weights(make_experts(256, 128, n_local=1, seed=26))
    counts = torch.tensor([128], dtype=torch.int32)
    order = torch.arange(100)
    gather = slot_map(order, torch.cat([order, torch.full((28,), -1)]), 1)
    tokens = _tokens(100)
    for x, rows, cache in ((tokens, None, "bf16"), (tokens.float(), None, "mxfp4"),
                           (tokens, ops.quantize_mxfp4_rows(tokens), "mxfp4")):
        with pytest.raises(ValueError, match="gather reads bf16 tokens for an MXFP4 or FP8"):
            run_fp8_experts(weights, x, counts, rows, cache, gather=gather)


def _decode_path(weights, tokens, scores, order, counts, cache, fp8_routes, gathered):
    """The one-rank layer's path from the tokens to the score-weighted sum of their routes'
    outputs, both ways: AutoEP's copies (``x[order // k]``, ``permute_aligned``, the
    experts, ``unpermute_by_local_expert``, its weighted-sum combine, under the layer's
    route-output hooks) or the gathered one (``slot_map`` with the decode's handoff, the
    experts, ``routing.decode``); ``fp8_routes``: the routes' outputs kept for the scores'
    gradient as FP8 rows (else bf16). ``(out, tokens' grad, scores' grad, weight grads)``
    of one fwd+bwd."""
    from deepspeed.module_inject.auto_ep_layer import combine_from_routed
    from ds_fp4.config import Format, FP4MoEConfig
    from ds_fp4.moe import routing
    from ds_fp4.moe.alltoall import wire_plans
    from ds_fp4.moe.cache import route_output_hooks
    k = scores.shape[1]
    for p in weights.parameters():
        p.grad = None
    xin = tokens.clone().requires_grad_(True)
    gates = scores.clone().requires_grad_(True)
    x, indices, aligned, _ = permute_aligned(xin[order // k], counts, 128)
    if gathered:
        routes = slot_map(order, indices, k)
        routes = routes._replace(handoff=routing.GatheredSlots(None, routes.tokens))
        y = run_fp8_experts(weights, xin, aligned, None, cache, donate_grad=True,
                            gather=routes)
        out = routing.decode(y, routes.slots, gates.t(), len(tokens), fp8_routes,
                             routes.handoff)
    else:
        y = run_fp8_experts(weights, x, aligned, None, cache, donate_grad=True)
        routed = unpermute_by_local_expert(y, indices, order.numel())
        plan = wire_plans(FP4MoEConfig.from_section({}))[0]
        with route_output_hooks(Format.FP8 if fp8_routes else Format.BF16, *routed.shape,
                                routed.dtype, plan):
            out = combine_from_routed(routed, gates, order, k, "post", "weighted_sum",
                                      (1, len(tokens), tokens.shape[1]))[0]
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(31)).to(out)
    out.backward(dy)
    return out.detach(), xin.grad, gates.grad, [p.grad for p in weights.parameters()]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("cache, fp8_routes", [("mxfp4", True), ("fp8", True),
                                               ("mxfp4", False)])
def test_gathered_decode_equals_autoep_combine(monkeypatch, device, cache, fp8_routes):
    """The one-rank layer's gathered path (the decode sums the slots' outputs and hands the
    experts dy and the slots' scores: no [T*k, H] copy either way) against AutoEP's copies
    and combine, top-2, an expert without routes: the output, the tokens' and the weights'
    gradients bit for bit; the scores' gradient within float32 rounding (it sums over the
    hidden size in the decode's order; on the CPU, in autograd's). On CUDA through the
    kernels (the decode's sum and its gates' gradient among them)."""
    from ds_fp4.ops import _cuda_loader as L
    launched, launch = [], L.launch
    monkeypatch.setattr(L, "launch", lambda device, module, name, *args, **kwargs: (
        launched.append(name), launch(device, module, name, *args, **kwargs))[1])
    if device == "cuda":
        from tests.kernel_emu.fp8 import cupy_or_skip
        cupy_or_skip()
    weights = _Weights(make_experts(256, 128, n_local=4, seed=32)).to(device)
    order, counts = _routes(150, 4, 2, seed=33, empty=(3,))
    scores = torch.rand(150, 2, generator=torch.Generator().manual_seed(34))
    args = (_tokens(150, seed=35).to(device), scores.to(device), order.to(device),
            counts.to(device), cache, fp8_routes)
    got = _decode_path(weights, *args, gathered=True)
    if device == "cuda":
        assert any(n.startswith("route_sum_bf16_w") for n in launched), launched
        assert any(n.startswith("route_grads_") for n in launched), launched
    want = _decode_path(weights, *args, gathered=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(map(torch.equal, got[3], want[3]))
    assert rel(got[2].cpu(), want[2].cpu()) < 1e-5
