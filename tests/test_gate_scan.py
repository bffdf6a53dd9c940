"""RowScanCumsum: DeepSpeed's gate counts its slots with the same integers, faster.

Inside it DeepSpeed's ``sharded_moe`` sees a ``torch`` whose ``cumsum`` rewrites only 2-D
integer/bool scans along dim 0 and must give torch's result bit for bit (values and dtype);
DeepSpeed's gating functions return the same routes with it; it is gone once the last
context closes; FP4MoE's gate runs inside it (and the layer stays equal to DeepSpeed's:
test_moe_layer)."""

import pytest
import torch
from deepspeed.moe import sharded_moe

from ds_fp4.moe.gate_scan import RowScanCumsum
from tests.test_moe_layer import _pair, _run, _x


def _masks():
    g = torch.Generator().manual_seed(0)
    for s, e in ((8192, 32), (37, 5), (1, 1), (0, 4), (5, 1)):
        idx = torch.randint(0, e, (s,), generator=g)
        onehot = torch.nn.functional.one_hot(idx, e)
        yield onehot
        yield onehot.bool()
        yield onehot.to(torch.int32)
        yield torch.randint(-3, 4, (s, e), generator=g, dtype=torch.int16)


@pytest.mark.parametrize("form", ["dim=0", "dim=-2"])
def test_integer_scans_along_dim0_are_rewritten_and_equal(form):
    for mask in _masks():
        want = torch.cumsum(mask, dim=0)
        with RowScanCumsum() as mode:
            seen = sharded_moe.torch      # what DeepSpeed's gating functions call
            got = {"dim=0": lambda: seen.cumsum(mask, dim=0),
                   "dim=-2": lambda: seen.cumsum(mask, -2)}[form]()
        assert mode.calls == 1, (form, mask.shape, mask.dtype)
        assert got.dtype == want.dtype and torch.equal(got, want), (mask.shape, mask.dtype)
        assert got.is_contiguous()


def test_other_calls_go_to_torch_untouched():
    x = torch.randn(64, 8)
    cases = [lambda t: t.cumsum(x, dim=0),                       # float: order matters
             lambda t: t.cumsum(x.long(), dim=1),                # along the rows already
             lambda t: t.cumsum(x.long()[:, 0], dim=0),          # 1-D
             lambda t: t.cumsum(x.long().view(8, 8, 8), dim=0),  # 3-D
             lambda t: t.cumsum(x.long(), dim=0, dtype=torch.int32)]
    for fn in cases:
        with RowScanCumsum() as mode:
            got = fn(sharded_moe.torch)
        want = fn(torch)
        assert mode.calls == 0 and got.dtype == want.dtype and torch.equal(got, want)


def test_deepspeed_sees_torch_again_once_the_last_context_closes():
    assert sharded_moe.torch is torch
    with RowScanCumsum():
        with RowScanCumsum():
            assert sharded_moe.torch is not torch
        assert sharded_moe.torch is not torch          # the outer one is still open
        assert sharded_moe.torch.softmax is torch.softmax   # the rest is torch's own
    assert sharded_moe.torch is torch
    with pytest.raises(RuntimeError, match="inside"):
        with RowScanCumsum():
            raise RuntimeError("an error inside the gate")
    assert sharded_moe.torch is torch


def _gating(fn, *args, **kwargs):
    torch.manual_seed(7)   # the second expert's Gumbel noise
    return fn(*args, **kwargs)


@pytest.mark.parametrize("name, args", [
    ("top1gating", (1.25, 4)), ("top2gating", (1.25, 4)), ("topkgating", (3, 1.25, 4))])
@pytest.mark.parametrize("drop_tokens", [True, False])
def test_deepspeeds_gating_returns_the_same_routes(name, args, drop_tokens):
    fn = getattr(sharded_moe, name)
    logits = torch.randn(300, 8, generator=torch.Generator().manual_seed(3))
    kw = dict(drop_tokens=drop_tokens, sparse_routes=True)
    want = _gating(fn, logits.clone(), *args, **kw)
    with RowScanCumsum() as mode:
        got = _gating(fn, logits.clone(), *args, **kw)
    assert mode.calls >= 1
    for g, w in zip(got, want):
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and torch.equal(g, w)
        else:
            assert g == w


def test_the_layers_gate_runs_inside_the_mode(monkeypatch):
    """(on the CPU the layer leaves torch's scan alone; this forces the CUDA path)"""
    made = []

    class Recorded(RowScanCumsum):
        def __init__(self, graphs=None):
            super().__init__(graphs)
            made.append(self)

    monkeypatch.setattr("ds_fp4.moe.layer.RowScanCumsum", Recorded)
    monkeypatch.setattr("ds_fp4.moe.layer._row_scan_for", lambda tokens: True)   # CUDA's path
    ref, fp4 = _pair(dict(dispatch="bf16", combine="bf16", grad="bf16", cache="bf16"), 2,
                     True, "bf16")
    x = _x("bf16")
    _run(fp4, x)
    assert made and sum(m.calls for m in made) >= 2   # top-2: one scan per choice


def test_the_cpu_gate_uses_torchs_scan(monkeypatch):
    made = []
    monkeypatch.setattr("ds_fp4.moe.layer.RowScanCumsum", lambda *a: made.append(1))
    _, fp4 = _pair(dict(dispatch="bf16", combine="bf16", grad="bf16", cache="bf16"), 2, True,
                   "bf16")
    _run(fp4, _x("bf16"))
    assert not made
