"""The caches of ``ds_fp4.moe.cache`` on a CUDA GPU: the routes' outputs that AutoEP's
combines save for the router's gradient, kept as FP8 rows (``RowsCache``), through both of
AutoEP's combines, its eager weighted sum and its Triton ``fused_weighted_restore``, whose
autograd Function saves them with ``ctx.save_for_backward``. The CPU tests cover the eager
combine on the reference path only."""

import contextlib

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
from ds_fp4.config import Format  # noqa: E402
from ds_fp4.moe.alltoall import pack_rows, unpack_rows  # noqa: E402
from ds_fp4.moe.cache import RowsCache  # noqa: E402

ael = pytest.importorskip("deepspeed.module_inject.auto_ep_layer")
fused = pytest.importorskip("deepspeed.ops.triton_ops.autoep_fused_token_ops")

T, K, H = 96, 2, 256   # tokens, top-k, hidden


def _inputs(device):
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(T * K, H, generator=g).bfloat16()
    rows[5, 7] = float("nan")      # a NaN route output must reach the scores' gradient
    scores = torch.rand(T, K, generator=g)
    order = torch.randperm(T * K, generator=g)
    dy = torch.randn(1, T, H, generator=g).bfloat16()
    return [t.to(device) for t in (rows, scores, order, dy)]


def _combine(impl, device, cache):
    """``(output, d rows, d scores, tensors the cache took)`` of one AutoEP combine."""
    rows, scores, order, dy = _inputs(device)
    rows.requires_grad_(True)
    scores.requires_grad_(True)
    keep = RowsCache(T * K, H, torch.bfloat16, Format.FP8)
    with keep.hooks() if cache else contextlib.nullcontext():
        if impl == "fused":
            out = fused.fused_weighted_restore(rows, top_scores=scores,
                                               token_indices_sorted=order, top_k=K,
                                               shape=(1, T, H))
        else:
            out = ael.combine_from_routed(rows, top_scores=scores, token_indices_sorted=order,
                                          top_k=K, score_apply="post",
                                          combine_impl="weighted_sum", shape=(1, T, H))
    out.backward(dy)
    return out.detach(), rows.grad, scores.grad, keep.packed


def _want_scores_grad(device):
    """d score[t, j] = <dy[t], route output (t, j)> over the FP8 copy, in float64."""
    rows, scores, order, dy = _inputs(device)
    kept = unpack_rows(pack_rows(rows, Format.FP8), Format.FP8, torch.bfloat16, H)
    placed = torch.empty_like(kept)
    placed[order] = kept
    return (placed.double().view(T, K, H) * dy.double().view(T, 1, H)).sum(-1)


@pytest.mark.parametrize("impl", ["eager", "fused"])
def test_fp8_copy_reaches_the_scores_gradient(impl):
    out, d_rows, d_scores, taken = _combine(impl, "cuda", cache=True)
    ref_out, ref_rows, ref_scores, _ = _combine(impl, "cuda", cache=False)
    assert taken == 1
    # the forward and the rows' gradient never read the copy: bit for bit
    assert torch.equal(out.isnan(), ref_out.isnan())
    assert torch.equal(out.nan_to_num(), ref_out.nan_to_num())
    assert torch.equal(d_rows, ref_rows)
    # the scores' gradient reads the copy: the float64 product over the same FP8 values
    want = _want_scores_grad("cuda")
    assert torch.equal(d_scores.isnan(), want.isnan()) and d_scores.isnan().any()
    ok = ~want.isnan()
    assert torch.allclose(d_scores[ok].double(), want[ok], rtol=1e-4, atol=1e-4)
    # and it moved away from the bf16 gradient by FP8 error, not more
    err = (d_scores[ok] - ref_scores[ok]).norm() / ref_scores[ok].norm()
    assert 0 < err < 0.05


def test_gpu_copy_equals_the_cpu_copy():
    # the CUDA kernels' FP8 rows are the CPU reference's bytes, so the GPU's scores'
    # gradient equals the CPU eager combine's up to the order of float32 sums
    _, _, gpu, _ = _combine("eager", "cuda", cache=True)
    _, _, cpu, _ = _combine("eager", "cpu", cache=True)
    assert torch.equal(gpu.isnan().cpu(), cpu.isnan())
    ok = ~cpu.isnan()
    assert torch.allclose(gpu.cpu()[ok], cpu[ok], rtol=1e-5, atol=1e-5)
    rows = _inputs("cpu")[0]
    assert torch.equal(pack_rows(rows.cuda(), Format.FP8).cpu(), pack_rows(rows, Format.FP8))
