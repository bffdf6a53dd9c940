"""Which implementation an op runs: the CUDA kernels or the pure-PyTorch reference.

CPU tensors always run the reference. CUDA tensors run the kernels in mode ``cuda`` (an
error naming the fix if CuPy is missing), the reference in mode ``reference``, and in mode
``auto`` the kernels when CuPy imports, else the reference after a one-time warning, so a
slowdown is never silent. The one rule for every CUDA kernel of ds_fp4: the ops of
``ds_fp4.ops`` and the FP8 experts' quantizers (``fp8_tiles``, ``fp8_segments``).
"""

import contextlib
import warnings

import torch

from ds_fp4 import env
from ds_fp4.ops import reference

_mode = None          # None: read DS_FP4_KERNELS on first use
_cuda_module = None
_warned = False

_MISSING_CUPY = (
    "ds_fp4's CUDA kernels need CuPy, which is not importable ({err}). Install the extra "
    "that matches your CUDA: `pip install ds_fp4[cuda12]` or `pip install ds_fp4[cuda13]`, "
    "or choose the slow pure-PyTorch path with kernels='reference' (DS_FP4_KERNELS=reference).")


def get_kernels() -> str:
    """The current mode: ``auto`` | ``cuda`` | ``reference``."""
    global _mode
    if _mode is None:
        _mode = env.kernels_mode()
    return _mode


def set_kernels(mode: str) -> None:
    """Set the mode for CUDA tensors: ``auto`` | ``cuda`` | ``reference``."""
    global _mode
    if mode not in env.KERNEL_MODES:
        raise ValueError(f"kernels={mode!r} is not one of {env.KERNEL_MODES}")
    _mode = mode


@contextlib.contextmanager
def kernels(mode: str):
    """Context manager: run the ops inside it in ``mode``, then restore the previous one."""
    before = get_kernels()
    set_kernels(mode)
    try:
        yield
    finally:
        set_kernels(before)


def _load_cuda():
    global _cuda_module
    if _cuda_module is None:
        import cupy  # noqa: F401, PLC0415  (the kernels' launcher: missing means no kernels)
        from ds_fp4.ops import cuda
        _cuda_module = cuda
    return _cuda_module


def select(*tensors):
    """The module (``reference`` or ``cuda``) that runs an op on ``tensors``."""
    global _warned
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        return reference
    mode = get_kernels()
    if mode == "reference":
        return reference
    try:
        return _load_cuda()
    except ImportError as err:
        if mode == "cuda":
            raise ImportError(_MISSING_CUPY.format(err=err)) from err
        if not _warned:
            warnings.warn(_MISSING_CUPY.format(err=err) + " Falling back to the reference.",
                          RuntimeWarning, stacklevel=3)
            _warned = True
        return reference


def uses_kernels(*tensors) -> bool:
    """Whether an op on ``tensors`` runs CUDA kernels: ``select`` picks ``cuda`` (the same
    rule for the ops here and the FP8 experts' tile and segment quantizers)."""
    return select(*tensors) is not reference
