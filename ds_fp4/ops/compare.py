"""Byte-for-byte comparison of op outputs: how the tests and the benchmarks check a kernel
against its reference (FORMATS.md; NaN payloads are not part of the contract)."""

import torch

__all__ = ["first_mismatch"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def first_mismatch(got, want, what="output"):
    """Where ``got`` differs from ``want``, or None when they are the same.

    Arguments:
        got, want: tensors, or tuples of tensors compared element by element.
        what: the name that the message starts with.
    Returns:
        None when dtype, shape, strides (of tensors with more than one element) and bytes
        agree, NaN meeting NaN for float outputs of 2 or 4 bytes; else a message naming
        the first difference (for bytes: how many differ and the first coordinate, with
        both bit patterns and values).
    """
    if isinstance(want, tuple):
        if not isinstance(got, tuple) or len(got) != len(want):
            return f"{what}: output arity"
        for i, (g, w) in enumerate(zip(got, want)):
            message = first_mismatch(g, w, f"{what}[{i}]")
            if message:
                return message
        return None
    if got.dtype != want.dtype:
        return f"{what}: dtype {got.dtype} != {want.dtype}"
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.numel() > 1 and got.stride() != want.stride():
        return f"{what}: strides {got.stride()} != {want.stride()}"
    g, w = got.detach().cpu(), want.detach().cpu()
    size = g.element_size()
    gb, wb = g.view(_BITS[size]), w.view(_BITS[size])
    bad = gb != wb
    if g.is_floating_point() and size > 1:
        gn, wn = torch.isnan(g), torch.isnan(w)
        bad = (gn != wn) | (bad & ~gn)
    if not bad.any():
        return None
    at = tuple(torch.nonzero(bad)[0].tolist())
    fmt = "0x{:0" + str(2 * size) + "x}"
    gv, wv = int(gb[at]) & (256 ** size - 1), int(wb[at]) & (256 ** size - 1)
    return (f"{what}: {int(bad.sum())} of {bad.numel()} differ; first at {at}: "
            f"got {fmt.format(gv)} ({g[at].float().item()!r}), "
            f"want {fmt.format(wv)} ({w[at].float().item()!r})")
