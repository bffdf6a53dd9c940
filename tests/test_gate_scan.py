"""RowScanCumsum: DeepSpeed's gate counts its slots with the same integers, faster.

Inside it DeepSpeed's ``sharded_moe`` sees a ``torch`` whose ``cumsum`` rewrites only 2-D
integer/bool scans along dim 0 and must give torch's result bit for bit (values and dtype),
and whose ``einsum("se,se->s")`` of gates and a one-hot mask must too (values, gradient);
DeepSpeed's gating functions return the same routes with it; it is gone once the last
context closes; FP4MoE's gate runs inside it (and the layer stays equal to DeepSpeed's:
test_moe_layer)."""

import contextlib

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


_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _DEVICES)
def test_the_gates_mask_products_are_torchs_einsum_bit_for_bit(device):
    """DeepSpeed's ``einsum("se,se->s", gates, mask)``, mask one-hot (rows dropped by the
    capacity all zero), as the stand-in computes it: torch's values and gradient."""
    g = torch.Generator().manual_seed(1)
    for s, e in ((4096, 8), (300, 16), (64, 4), (1, 1)):
        gates = torch.softmax(torch.randn(s, e, generator=g) * 4, dim=1)
        gates[0, 0] = float("nan") if s > 1 else gates[0, 0]   # NaN stays NaN
        mask = torch.nn.functional.one_hot(torch.randint(0, e, (s,), generator=g), e).float()
        mask[torch.rand(s, generator=g) < 0.2] = 0               # dropped routes
        grad = torch.randn(s, generator=g)
        got, want = [], []
        for fn, out in ((lambda a, b: sharded_moe.einsum("se,se->s", a, b), got),
                        (lambda a, b: torch.einsum("se,se->s", a, b), want)):
            a = gates.to(device).requires_grad_()
            with RowScanCumsum() if out is got else contextlib.nullcontext():
                y = fn(a, mask.to(device))
            y.backward(grad.to(device))
            out += [y.detach(), a.grad]
        for x, y in zip(got, want):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x.isnan(), y.isnan())
            assert torch.equal(x.nan_to_num(), y.nan_to_num()), (s, e, device)


def test_other_einsums_go_to_torch():
    a, b = torch.randn(6, 4), torch.randn(6, 3)
    with RowScanCumsum():
        got = sharded_moe.torch.einsum("se,sc->sec", a, b)
        assert sharded_moe.torch.einsum("se,se->s", a, a).shape == (6,)
    assert torch.equal(got, torch.einsum("se,sc->sec", a, b))


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


def recorded_gate_contexts(monkeypatch):
    """The ``RowScanCumsum`` contexts the layer opens from now on (a list that fills), its
    CUDA path forced on the CPU (where the layer leaves torch's scan alone)."""
    made = []

    class Recorded(RowScanCumsum):
        def __init__(self, graphs=None):
            super().__init__(graphs)
            made.append(self)

    monkeypatch.setattr("ds_fp4.moe.layer.RowScanCumsum", Recorded)
    monkeypatch.setattr("ds_fp4.moe.layer._row_scan_for", lambda tokens: True)
    return made


def test_the_layers_gate_runs_inside_the_mode(monkeypatch):
    made = recorded_gate_contexts(monkeypatch)
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
