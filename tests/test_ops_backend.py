"""Which implementation runs: CPU tensors the reference; CUDA tensors per the kernels mode."""

import warnings

import pytest
import torch

from ds_fp4 import env, ops
from ds_fp4.ops import backend, reference


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that claims to live on a GPU, to exercise routing without one."""

    @property
    def is_cuda(self):
        return True


@pytest.fixture
def fake_cuda(monkeypatch):
    def missing_cupy():
        raise ImportError("No module named 'cupy'")
    monkeypatch.setattr(backend, "_load_cuda", missing_cupy)
    monkeypatch.setattr(backend, "_warned", False)
    return torch.zeros(4, 32)._make_subclass(FakeCudaTensor, torch.zeros(4, 32))


def test_cpu_tensors_run_the_reference():
    with ops.kernels("cuda"):
        assert backend.select(torch.zeros(2)) is reference


def test_cuda_mode_without_cupy_names_the_fix(fake_cuda):
    with ops.kernels("cuda"), pytest.raises(ImportError, match=r"ds_fp4\[cuda12\]"):
        backend.select(fake_cuda)


def test_auto_mode_without_cupy_warns_once_then_falls_back(fake_cuda):
    with ops.kernels("auto"):
        with pytest.warns(RuntimeWarning, match="Falling back"):
            assert backend.select(fake_cuda) is reference
        with warnings.catch_warnings():
            warnings.simplefilter("error")                   # a second warning would raise
            assert backend.select(fake_cuda) is reference


def test_reference_mode_never_loads_kernels(fake_cuda):
    with ops.kernels("reference"):
        assert backend.select(fake_cuda) is reference


def test_bad_modes_are_rejected(monkeypatch):
    with pytest.raises(ValueError, match="kernels"):
        ops.set_kernels("fast")
    monkeypatch.setenv("DS_FP4_KERNELS", "triton")
    with pytest.raises(ValueError, match="DS_FP4_KERNELS"):
        env.kernels_mode()
    monkeypatch.setenv("DS_FP4_KERNELS", "Reference")
    assert env.kernels_mode() == "reference"


def test_context_restores_the_previous_mode():
    before = ops.get_kernels()
    with ops.kernels("reference"):
        assert ops.get_kernels() == "reference"
    assert ops.get_kernels() == before
