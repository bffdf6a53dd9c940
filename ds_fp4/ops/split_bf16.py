"""A float32 matrix as the exact sum of three bfloat16 numbers per element, parts side by side.

A float32 number is the exact sum of three bfloat16 numbers: its significand's top 8 bits,
the next 8 and the last 8 (``split3``). ``ds_fp4.moe.gate_linear`` runs DeepSpeed's float32
gate Linear as bf16 GEMMs over such parts, laid out as ``cat([part_p for p in pattern],
dim)``: the weight's three parts stacked, the six factors of the input gradient's products,
the logits gradient's parts side by side. Those were three ``torch.compile``d regions of ~0.2
ms of host time each on the H200's host (``bench/results/host_gaps_h200``) for a few
microseconds of GPU work; on CUDA (``backend.uses_kernels``, a contiguous float32 input)
``split_bf16.cu`` writes the same bytes in one launch.

``split_bf16_ref`` is the torch ops (the parts' bits: the float32 steps are exact, and each
part is cast to bf16 as torch does, RNE, which changes nothing but float32 subnormals' low
bits). The kernel writes the twin's bytes but for NaN's bits (0x7FFF, as torch's CUDA cast
writes them; its CPU cast wrote 0xFFFF) and for float32 subnormal parts, which it rounds to
bf16 by the definition (RNE) where torch's casts depend on the machine (on the H200 its
CUDA cast flushed them to zero, and its CPU cast on that machine's host gave other bytes
than on a CI machine). Gate weights and logit gradients below 2**-126 contribute nothing a
float32 logit holds.
"""

import torch

from ds_fp4.ops import _cuda_loader as L
from ds_fp4.ops import backend, checks

__all__ = ["split_bf16", "split_bf16_ref", "split3"]

MAX_PARTS = 16   # pattern codes packed two bits each into one u32 kernel argument


def _top8(t):
    """float32 ``t`` truncated to its top 8 significand bits (a bfloat16 number), through
    its bits: no rounding step that a compiler could fold away."""
    return (t.view(torch.int32) & -65536).view(torch.float32)


def split3(t):
    """float32 ``t`` -> three float32 tensors, each a bfloat16 number (but for float32
    subnormals' low bits), whose sum is ``t`` exactly: its top 8 significand bits, the next
    8, the last 8 (each remainder is exact in float32; non-finite ``t`` gives non-finite
    parts)."""
    t0 = _top8(t)
    r = t - t0
    t1 = _top8(r)
    return t0, t1, r - t1


def _check(x, pattern, dim):
    checks.dtype("x", x, (torch.float32,))
    checks.matrix("x", x)
    if not isinstance(pattern, tuple) or not 0 < len(pattern) <= MAX_PARTS \
            or any(p not in (0, 1, 2) for p in pattern):
        raise ValueError(f"pattern must be a tuple of 1 to {MAX_PARTS} part numbers (0, 1 "
                         f"or 2); got {pattern!r}")
    if dim not in (0, 1):
        raise ValueError(f"dim must be 0 or 1; got {dim!r}")


def split_bf16_ref(x, pattern, dim):
    """The PyTorch twin of ``split_bf16`` (same arguments, same bytes)."""
    _check(x, pattern, dim)
    return _ref(x, pattern, dim)


def _ref(x, pattern, dim):
    parts = split3(x)
    return torch.cat([parts[p] for p in pattern], dim).to(torch.bfloat16)


def split_bf16(x, pattern, dim):
    """``cat([split3(x)[p] for p in pattern], dim)`` as bfloat16.

    Arguments:
        x: float32 ``[R, C]``.
        pattern: tuple of part numbers (0: top 8 significand bits, 1: next 8, 2: last 8).
        dim: 0 (parts stacked: ``[len(pattern) * R, C]``) or 1 (side by side: ``[R,
            len(pattern) * C]``).
    Returns:
        bfloat16 tensor of the parts, contiguous.
    """
    _check(x, pattern, dim)
    if not backend.uses_kernels(x) or not x.is_contiguous():
        return _ref(x, pattern, dim)
    rows, cols = x.shape
    n = len(pattern)
    shape = (n * rows, cols) if dim == 0 else (rows, n * cols)
    out = torch.empty(shape, dtype=torch.bfloat16, device=x.device)
    if x.numel():
        code = sum(p << (2 * i) for i, p in enumerate(pattern))
        L.launch(x.device, "split_bf16", "split_bf16", L.blocks_for(x.numel()),
                 (L.ptr(x), L.i64(rows), L.i64(cols), L.u32(code), L.u32(n), L.u32(dim),
                  L.ptr(out)))
    return out
