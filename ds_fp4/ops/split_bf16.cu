// A float32 matrix as the exact sum of three bfloat16 numbers per element, the parts laid out
// side by side (ds_fp4/ops/split_bf16.py launches it; its twin is split_bf16_ref there):
//   t0 = t's top 8 significand bits (its bits & 0xFFFF0000), r = t - t0 (exact),
//   t1 = r's top 8 bits, t2 = r - t1 (exact), each rounded to bf16 as torch casts on CUDA
//   (RNE, NaN -> 0x7FFF): exact but for float32 subnormals, whose low bits RNE rounds, as
//   the twin's cast does.
// out = cat([t_{pattern[0]}, t_{pattern[1]}, ...], dim): pattern packs n_parts codes (0-2),
// two bits each, part i at bits 2i.
#include "common.cuh"

// float32 -> bfloat16 bits, RNE, as torch's cast on CUDA (cvt.rn: NaN -> 0x7FFF)
__device__ __forceinline__ u32 bf16_bits_rne(float v) { return f32x2_to_bf16x2(v, 0.0f) & 0xFFFFu; }

__device__ __forceinline__ float top8(float v) { return u2f(f2u(v) & 0xFFFF0000u); }

extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK)
split_bf16(const float* __restrict__ x, i64 rows, i64 cols, u32 pattern, u32 n_parts, u32 dim,
           u16* __restrict__ out) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    i64 r = i / cols, c = i - r * cols;
    float t = x[i];
    float t0 = top8(t);
    float rest = fadd_rn(t, -t0);
    float t1 = top8(rest);
    u32 parts[3] = {bf16_bits_rne(t0), bf16_bits_rne(t1), bf16_bits_rne(fadd_rn(rest, -t1))};
    for (u32 p = 0; p < n_parts; ++p) {
        i64 at = dim == 0 ? ((i64)p * rows + r) * cols + c : r * (n_parts * cols) + p * cols + c;
        out[at] = (u16)parts[(pattern >> (2 * p)) & 3u];
    }
}
