"""Environment knobs, all prefixed ``DS_FP4_`` and read here only.

- ``DS_FP4_KERNELS``: ``auto`` (default) | ``cuda`` | ``reference``: which implementation
  CUDA tensors get (see ``ds_fp4.ops.backend``). A ds_config ``fp4_moe.kernels`` value
  overrides it.
- ``DS_FP4_EXPERT_GEMMS``: ``auto`` (default) | ``grouped`` | ``loop``: how the FP8
  experts run their GEMMs on Hopper (``ds_fp4.moe.fp8_experts``): one grouped launch per
  GEMM kind, one cuBLASLt call per expert, or by rows per expert. For benchmarks.
"""

import os

KERNEL_MODES = ("auto", "cuda", "reference")


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
