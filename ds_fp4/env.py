"""Environment knobs, all prefixed ``DS_FP4_`` and read here only.

- ``DS_FP4_KERNELS``: ``auto`` (default) | ``cuda`` | ``reference``: which implementation
  CUDA tensors get (see ``ds_fp4.ops.backend``). A ds_config ``fp4_moe.kernels`` value
  overrides it.
"""

import os

KERNEL_MODES = ("auto", "cuda", "reference")


def kernels_mode() -> str:
    mode = os.environ.get("DS_FP4_KERNELS", "auto").strip().lower()
    if mode not in KERNEL_MODES:
        raise ValueError(
            f"DS_FP4_KERNELS={mode!r} is not one of {KERNEL_MODES}; unset it or pick one of those")
    return mode
