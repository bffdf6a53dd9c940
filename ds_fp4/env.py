"""Environment knobs, all prefixed ``DS_FP4_`` and read here only.

- ``DS_FP4_KERNELS``: ``auto`` (default) | ``cuda`` | ``reference``: which implementation
  CUDA tensors get (see ``ds_fp4.ops.backend``). A ds_config ``fp4_moe.kernels`` value
  overrides it for what its layers run. ``Kernels`` is the one vocabulary of the three
  (this variable, ``ops.set_kernels`` and the ds_config key).
- ``DS_FP4_EXPERT_GEMMS``: ``auto`` (default) | ``grouped`` | ``loop``: how the FP8
  experts run their GEMMs on Hopper (``ds_fp4.moe.fp8_expert_passes``): one grouped launch per
  GEMM kind, one cuBLASLt call per expert, or by rows per expert. For benchmarks.
"""

import os
from enum import Enum


class Kernels(str, Enum):
    """Which implementation CUDA tensors get: the CUDA kernels, the pure-PyTorch reference,
    or the kernels where CuPy imports (``auto``). Here, not in ``ds_fp4.config``, so that
    ``ds_fp4.ops`` (torch only) shares it."""
    AUTO = "auto"
    CUDA = "cuda"
    REFERENCE = "reference"

    def __str__(self):
        return self.value


KERNEL_MODES = tuple(mode.value for mode in Kernels)


def kernels_mode() -> str:
    mode = os.environ.get("DS_FP4_KERNELS", "auto").strip().lower()
    if mode not in KERNEL_MODES:
        raise ValueError(
            f"DS_FP4_KERNELS={mode!r} is not one of {KERNEL_MODES}; unset it or pick one of those")
    return mode


EXPERT_GEMM_MODES = ("auto", "grouped", "loop")


def expert_gemms_mode() -> str:
    mode = os.environ.get("DS_FP4_EXPERT_GEMMS", "auto").strip().lower()
    if mode not in EXPERT_GEMM_MODES:
        raise ValueError(f"DS_FP4_EXPERT_GEMMS={mode!r} is not one of {EXPERT_GEMM_MODES}; "
                         f"unset it or pick one of those")
    return mode
