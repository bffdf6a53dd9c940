"""``out=`` of every op: the result is written into the given tensors (contiguous or
row-strided views of wider buffers) and equals the op's own output byte for byte, in the
reference, in the kernels under the host emulation (g++) and on a GPU; bad ``out`` raises."""

import importlib.util

import pytest
import torch

from ds_fp4 import formats as F
from ds_fp4 import ops
from ds_fp4.ops import _cuda_loader, reference
from ds_fp4.ops.compare import first_mismatch
from tests.kernel_emu import loader

M, K = 70, 256
_GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


@pytest.fixture(params=["reference", "emulated", "cuda"])
def impl(request, monkeypatch):
    """``(ops module, device)``: the reference, the kernels on CPU tensors under the host
    emulation, or the kernels on a GPU."""
    if request.param == "reference":
        return reference, "cpu"
    from ds_fp4.ops import cuda
    if request.param == "cuda":
        if not _GPU:
            pytest.skip("needs a CUDA GPU and CuPy")
        return cuda, "cuda"
    if loader.gxx() is None:
        pytest.skip("g++ is not on PATH")
    monkeypatch.setattr(_cuda_loader, "launch", loader.HostKernels().launch)
    return cuda, "cpu"


def _cases(device):
    """``{op: (args, kwargs)}`` on ``device``, every op of ``ds_fp4.ops``."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(M, K, generator=g) * 10).to(torch.bfloat16)
    data, scales = reference.quantize_mxfp4(x)
    rows = reference.quantize_mxfp4_rows(x)
    fdata, fscales = reference.quantize_fp8(x)
    frows = reference.quantize_fp8_rows(x)
    on = lambda *ts: tuple(t.to(device) for t in ts)  # noqa: E731
    return {
        "quantize_mxfp4": (on(x), {"rounding": "floor"}),
        "quantize_mxfp4_rows": (on(x), {}),
        "dequantize_mxfp4": (on(data, scales), {"dtype": torch.float32}),
        "dequantize_mxfp4_rows": (on(rows), {}),
        "quantize_fp8": (on(x), {}),
        "quantize_fp8_rows": (on(x), {}),
        "dequantize_fp8": (on(fdata, fscales), {"dtype": torch.float16}),
        "dequantize_fp8_rows": (on(frows), {}),
        "mxfp4_to_fp8": (on(data, scales), {}),
        "mxfp4_rows_to_fp8": (on(rows), {}),
        "mxfp4_to_fp8_colwise": (on(data, scales), {"offsets": [0, 30, 30, M]}),
    }


def _garbage(shape, dtype, device):
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.numel():
        t.view(torch.uint8).random_()
    return t


def _like(t, padded):
    """A tensor holding garbage with ``t``'s shape, dtype and strides, or (``padded``, for
    row-major 2-D ``t``) a row-strided view into a wider buffer."""
    if padded and t.dim() == 2 and t.stride(-1) == 1:
        wide = _garbage((t.shape[0], t.shape[1] + 24), t.dtype, t.device)
        return wide[:, 8:8 + t.shape[1]]
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(_garbage(t.shape, t.dtype, t.device))


@pytest.mark.parametrize("padded", [False, True], ids=["contiguous", "row_strided"])
@pytest.mark.parametrize("op", sorted(_cases("cpu")))
def test_out_receives_the_result(impl, op, padded):
    module, device = impl
    args, kwargs = _cases(device)[op]
    want = getattr(reference, op)(*args, **kwargs)
    wants = want if isinstance(want, tuple) else (want,)
    outs = tuple(_like(w, padded) for w in wants)
    got = getattr(module, op)(*args, **kwargs, out=outs if isinstance(want, tuple) else outs[0])
    gots = got if isinstance(got, tuple) else (got,)
    assert [t.data_ptr() for t in gots] == [t.data_ptr() for t in outs]
    message = first_mismatch(tuple(t.contiguous() for t in gots),
                             tuple(t.contiguous() for t in wants), op)
    assert message is None, message


def test_ops_pass_out_through():
    x = torch.randn(4, 128).to(torch.bfloat16)
    data = torch.empty(4, 128, dtype=F.FP8_DTYPE)
    scales = torch.empty(4, 1)
    got = ops.quantize_fp8(x, out=(data, scales))
    assert got[0] is data and got[1] is scales


@pytest.mark.parametrize("module", ["reference", "emulated"])
def test_bad_out_is_rejected(module, monkeypatch):
    if module == "emulated":
        if loader.gxx() is None:
            pytest.skip("g++ is not on PATH")
        monkeypatch.setattr(_cuda_loader, "launch", loader.HostKernels().launch)
        from ds_fp4.ops import cuda as impl
    else:
        impl = reference
    x = torch.randn(8, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"out\[0\] must be torch.float8_e4m3fn \(8, 128\)"):
        impl.quantize_fp8(x, out=(torch.empty(8, 64, dtype=F.FP8_DTYPE), torch.empty(8, 1)))
    with pytest.raises(ValueError, match="out must be 2 tensor"):
        impl.quantize_mxfp4(x, out=torch.empty(8, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="out must be torch.bfloat16"):
        impl.dequantize_fp8(*reference.quantize_fp8(x), out=torch.empty(8, 128))


def test_kernel_out_layouts_are_checked(monkeypatch):
    # what the kernels write through: unit last stride, rows of one stride, and the
    # column-wise scales in the layout the op returns
    if loader.gxx() is None:
        pytest.skip("g++ is not on PATH")
    monkeypatch.setattr(_cuda_loader, "launch", loader.HostKernels().launch)
    from ds_fp4.ops import cuda
    x = torch.randn(8, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match="unit stride"):
        cuda.quantize_fp8_rows(x, out=torch.empty(129, 8, dtype=torch.uint8).t())
    data, scales = reference.quantize_mxfp4(x)
    offsets = [0, 4, 8]                       # two segments: 256 columns, 2 scale groups
    colwise = (torch.empty(128, 256, dtype=F.FP8_DTYPE), torch.empty(2, 128).t())
    with pytest.raises(ValueError, match="scales' \\(1, K\\) layout"):
        cuda.mxfp4_to_fp8_colwise(data, scales, offsets, out=(colwise[0], torch.empty(128, 2)))
    got = cuda.mxfp4_to_fp8_colwise(data, scales, offsets, out=colwise)
    assert first_mismatch(got, reference.mxfp4_to_fp8_colwise(data, scales, offsets)) is None
