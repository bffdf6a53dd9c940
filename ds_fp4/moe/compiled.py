"""Elementwise functions run as one fused kernel through ``torch.compile`` on CUDA.

Several small float32 steps (the FP8 experts' activations and gradients where no quantizer
fuses them: GELU, biases) cost one launch each when run eagerly, and on a host-bound layer
each launch costs tens of microseconds of host time. ``fused`` compiles such a function once
and falls back to the eager function where compiling fails (no Triton, no compiler): the
same math, more launches. A compiled call still costs ~0.2 ms of host (Dynamo's guards and
the wrapper): steps on every layer's hot path are CuPy kernels instead (the gate's bf16
parts: ``ops.split_bf16``).
"""

import warnings

import torch

__all__ = ["fused"]

_compiled = {}


def fused(fn, *tensors):
    """``fn(*tensors)``: on CUDA through ``torch.compile`` when that works, else eagerly.

    ``fn`` must be elementwise math whose compiled form rounds as the eager one does
    (float32 steps and explicit casts; no reductions whose order could change)."""
    if not tensors[0].is_cuda or _compiled.get(fn, True) is None:
        return fn(*tensors)
    try:
        if fn not in _compiled:
            _compiled[fn] = torch.compile(fn, dynamic=None)
        return _compiled[fn](*tensors)
    except Exception as err:  # no triton / no compiler: say so once, keep going eagerly
        warnings.warn(f"ds_fp4: torch.compile of {fn.__name__} failed "
                      f"({type(err).__name__}: {err}); running it eagerly", RuntimeWarning)
        _compiled[fn] = None
        return fn(*tensors)
