"""Launch each ds_fp4 kernel family once on 16384x7168 bf16 data, for a profiler (ncu).

    ncu --clock-control none -k regex:"mxfp4|fp8" python3 tools/profile_kernels.py
"""

import torch

import bench_common  # noqa: F401 - first: it puts the checkout on sys.path
from ds_fp4.ops import cuda

M, K = 16384, 7168


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    data, scales = cuda.quantize_mxfp4(x)          # mxfp4_quantize_bf16_rceil
    cuda.dequantize_mxfp4(data, scales)            # mxfp4_dequantize_bf16
    cuda.quantize_fp8(x)                           # fp8_quantize_bf16
    cuda.quantize_fp8_rows(x)                      # fp8_quantize_bf16_e8m0
    cuda.mxfp4_to_fp8(data, scales)                # mxfp4_to_fp8_rows
    offsets = torch.tensor([0, 1000, 3000, 3001, 7000, 9000, 12000, 15000, M],
                           dtype=torch.int32, device="cuda")
    cuda.mxfp4_to_fp8_colwise(data, scales, offsets)   # mxfp4_to_fp8_colwise
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
