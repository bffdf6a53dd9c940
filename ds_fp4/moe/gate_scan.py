"""DeepSpeed's gate with its slot counting done as a row scan (same integers, faster).

DeepSpeed's ``top1gating``/``top2gating``/``topkgating`` (``deepspeed/moe/sharded_moe.py``)
number each expert's tokens with ``torch.cumsum(mask, dim=0)`` over an int64
``[tokens, experts]`` one-hot mask. Torch runs that as a scan over the outer dimension with
one column per expert, and on an H200 at 8192 tokens x 32 experts the two calls of one
top-2 forward took 3.03 ms: 17% of the GPU time of the whole FP4MoE layer's fwd+bwd
(``bench/results/profile_h200``). The same running sums along the rows of the transposed,
contiguous mask are the same integers (an integer sum does not depend on its order).

``RowScanCumsum`` is a ``TorchFunctionMode``: inside it, ``torch.cumsum`` of a 2-D integer
or bool tensor along dim 0 is computed that way; every other call goes through untouched.
The layer enters it around DeepSpeed's gate only, so DeepSpeed's code runs as it is.
"""

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["RowScanCumsum"]

_CUMSUM = (torch.cumsum, torch.Tensor.cumsum)


def _counted_along_dim0(args, kwargs):
    """The mask when the call is ``cumsum(mask, dim=0)`` of a 2-D integer/bool tensor with
    no other arguments, else None."""
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if len(args) > 2 or set(kwargs) - {"dim"} or x.dim() != 2 or dim not in (0, -2):
        return None
    if x.dtype.is_floating_point or x.dtype.is_complex:
        return None   # float sums depend on their order: leave them to torch
    return x


class RowScanCumsum(TorchFunctionMode):
    """``with RowScanCumsum(): ...`` -- 2-D integer ``cumsum`` along dim 0 as a row scan of
    the transpose (bit-identical; ``calls`` counts the rewritten calls)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CUMSUM:
            x = _counted_along_dim0(args, kwargs)
            if x is not None:
                self.calls += 1
                # torch's integer cumsum (bool included) returns int64
                return torch.cumsum(x.t().contiguous(), dim=1).t().contiguous()
        return func(*args, **kwargs)
