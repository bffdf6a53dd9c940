"""ds_fp4.moe.weight_cache: the FP8 experts' weight tiles made once per optimizer step
(``fp4_moe.fp8_weight_cache``), and made again whenever the weights may have changed."""

import pytest
import torch

from ds_fp4.config import FP4MoEConfig
from ds_fp4.moe import weight_cache
from ds_fp4.moe.fp8_experts import FP8Experts
from ds_fp4.ops import fp8_tiles
from tests.test_fp8_experts import make_experts, make_inputs, run_fp8


@pytest.fixture
def made(monkeypatch):
    """The tile_quant(_stacked) calls that made tiles (the cache's misses), as (n weights,
    transpose); a stacked call that falls back to the list form counts once."""
    calls, inside = [], []
    real, real_stacked = fp8_tiles.tile_quant, fp8_tiles.tile_quant_stacked

    def counting(weights, per_group, transpose=False):
        if not inside:
            calls.append((len(weights), transpose))
        return real(weights, per_group, transpose)

    def counting_stacked(stacks, transpose=False):
        calls.append((stacks[0].shape[0] * len(stacks), transpose))
        inside.append(True)
        try:
            return real_stacked(stacks, transpose)
        finally:
            inside.pop()
    monkeypatch.setattr(fp8_tiles, "tile_quant", counting)
    monkeypatch.setattr(fp8_tiles, "tile_quant_stacked", counting_stacked)
    return calls


def _weights(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(128, 256, generator=g).bfloat16()) for _ in range(n)]


def test_tiles_made_once_and_equal(made):
    cache, ws = weight_cache.TileCache(), _weights()
    first = weight_cache.tile_quant(cache, ws, 1)
    again = weight_cache.tile_quant(cache, ws, 1)
    assert made == [(3, False)] and again[0] is first[0]
    want = fp8_tiles.tile_quant_ref(ws, 1)
    assert torch.equal(first[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(first[1], want[1])
    weight_cache.tile_quant(cache, ws, 1, transpose=True)          # another kind: its own entry
    assert made == [(3, False), (3, True)]
    assert cache.nbytes() == 2 * (3 * 128 * 256 + 3 * 2 * 4)


def test_optimizer_step_drops_every_cache(made):
    caches, ws = [weight_cache.TileCache(), weight_cache.TileCache()], _weights()
    for c in caches:
        weight_cache.tile_quant(c, ws, 1)
    opt = torch.optim.SGD(ws, lr=0.1)
    for w in ws:
        w.grad = torch.ones_like(w)
    opt.step()
    assert all(c.nbytes() == 0 for c in caches)     # freed before the optimizer's own work
    got = weight_cache.tile_quant(caches[0], ws, 1)
    want = fp8_tiles.tile_quant_ref(ws, 1)           # the updated weights
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert len(made) == 3


def test_in_place_update_or_new_storage_remakes(made):
    cache, ws = weight_cache.TileCache(), _weights()
    weight_cache.tile_quant(cache, ws, 1)
    with torch.no_grad():
        ws[1].mul_(2)                                 # bumps the version counter
    got = weight_cache.tile_quant(cache, ws, 1)
    assert len(made) == 2
    assert torch.equal(got[1], fp8_tiles.tile_quant_ref(ws, 1)[1])
    ws[2] = torch.nn.Parameter(ws[2].detach().clone())  # another tensor, same values
    weight_cache.tile_quant(cache, ws, 1)
    assert len(made) == 3


def test_stacked_weights_cached_and_remade_on_update(made):
    """AutoEP's stacked ``[E, R, C]`` parameters: one entry per kind, made again when a
    stack changes in place."""
    g = torch.Generator().manual_seed(5)
    stacks = tuple(torch.nn.Parameter(torch.randn(2, 128, 256, generator=g).bfloat16())
                   for _ in range(2))
    cache = weight_cache.TileCache()
    first = weight_cache.tile_quant_stacked(cache, stacks)
    assert weight_cache.tile_quant_stacked(cache, stacks)[0] is first[0]
    assert made == [(4, False)]
    listed = [s[e] for e in range(2) for s in stacks]
    assert torch.equal(first[0].view(torch.uint8),
                       fp8_tiles.tile_quant_ref(listed, 2)[0].view(torch.uint8))
    with torch.no_grad():
        stacks[1][0].mul_(2)                          # one expert of one stack, in place
    got = weight_cache.tile_quant_stacked(cache, stacks)
    assert len(made) == 2
    assert torch.equal(got[1], fp8_tiles.tile_quant_ref([s[e] for e in range(2) for s in stacks],
                                                        2)[1])


def test_drop_all_after_a_data_write(made):
    """``.data`` writes are not seen (their version counter is another): ``drop_all``."""
    cache, ws = weight_cache.TileCache(), _weights()
    weight_cache.tile_quant(cache, ws, 1)
    ws[0].data.mul_(2)
    weight_cache.tile_quant(cache, ws, 1)
    assert len(made) == 1                             # documented: stale until dropped
    weight_cache.drop_all()
    got = weight_cache.tile_quant(cache, ws, 1)
    assert len(made) == 2
    assert torch.equal(got[1], fp8_tiles.tile_quant_ref(ws, 1)[1])


def test_experts_with_cache_equal_without(made):
    experts = make_experts(256, 128, 3)
    x = make_inputs(1, 3, 40, 256)
    dy = torch.randn(x.shape).bfloat16()
    want = run_fp8(experts, x, dy, "mxfp4", True)
    made.clear()
    fp8 = FP8Experts.from_experts(experts, weight_cache=True)
    for step in range(2):
        for p in experts.parameters():
            p.grad = None
        xin = x.clone().requires_grad_(True)
        y = fp8(xin, ops_rows(xin))
        y.backward(dy)
        grads = [[p.grad for p in ex.parameters()] for ex in experts.deepspeed_experts]
        assert torch.equal(y.detach(), want[0]) and torch.equal(xin.grad, want[1])
        assert all(torch.equal(g, r) for gs, rs in zip(grads, want[2]) for g, r in zip(gs, rs))
        # step 0 makes the four kinds (gate+up, down, and their transposes); step 1 none
        assert len(made) == 4, step
    assert fp8.plan.tiles.nbytes() > 0


def ops_rows(x):
    from ds_fp4 import ops
    return ops.quantize_mxfp4_rows(x.detach())


def test_config_checks_name_the_key():
    assert FP4MoEConfig.from_section({"fp8_weight_cache": True}).fp8_weight_cache
    with pytest.raises(ValueError, match="fp8_weight_cache.*fp8_experts"):
        FP4MoEConfig.from_section({"fp8_weight_cache": True, "fp8_experts": False})
    with pytest.raises(ValueError, match="fp8_weight_cache needs expert_graphs .auto. or false"):
        FP4MoEConfig.from_section({"fp8_weight_cache": True, "expert_graphs": True})
    # "auto" (the default) gives way to the cache: no captured passes
    assert FP4MoEConfig.from_section({"fp8_weight_cache": True}).expert_graphs == "auto"
    cached = FP8Experts.from_experts(make_experts(128, 128, 1), graphs="auto", weight_cache=True)
    assert cached.graphs is None and cached.plan.tiles is not None
    with pytest.raises(ValueError, match="fp8_weight_cache"):
        FP4MoEConfig.from_section({"fp8_weight_cache": "yes"})
    with pytest.raises(ValueError, match="needs graphs .auto. or off"):
        FP8Experts.from_experts(make_experts(128, 128, 1), graphs=True, weight_cache=True)


def test_autoep_experts_with_cache_equal_without(made):
    from ds_fp4.moe.autoep.fp8_experts import run_fp8_experts
    from tests.test_autoep_fp8_experts import _Weights, _layout, _tokens
    weights = _Weights(make_experts(256, 128, 2))
    x, rows, counts, _ = _layout(_tokens(200), [120, 80])
    cache = weight_cache.TileCache()
    results = []
    for tiles in (None, cache, cache):
        for p in weights.parameters():
            p.grad = None
        xin = x.clone().requires_grad_(True)
        y = run_fp8_experts(weights, xin, counts, rows, tiles=tiles)
        y.backward(torch.ones_like(y))
        results.append((y.detach(), xin.grad, [p.grad for p in weights.parameters()]))
    assert len(made) == 4 + 4   # uncached: the 4 kinds; cached: the 4 once, then none
    for got in results[1:]:
        assert torch.equal(got[0], results[0][0]) and torch.equal(got[1], results[0][1])
        assert all(torch.equal(a, b) for a, b in zip(got[2], results[0][2]))


def test_tiles_are_freed_with_their_layer():
    """A cache lives with its layer: deleted, its tiles go (the hook holds no tensor)."""
    import gc
    import weakref
    experts = make_experts(256, 128, 2)
    fp8 = FP8Experts.from_experts(experts, weight_cache=True)
    x = make_inputs(1, 2, 8, 256)
    fp8(x.clone().requires_grad_(True), None).sum().backward()
    held = [weakref.ref(t) for _, tiles in fp8.plan.tiles._tiles.values() for t in tiles]
    assert held and all(r() is not None for r in held)
    del fp8
    gc.collect()
    assert all(r() is None for r in held)
