// FP8 E4M3 with 1x128 power-of-two scales: quantize (bf16/fp16/fp32 -> e4m3 + scales) and
// dequantize. Bit for bit ds_fp4/ops/reference.py: quantize_fp8 / dequantize_fp8 and the
// packed-row twins (scales as E8M0 bytes) of FORMATS.md.
#include "common.cuh"

#if DS_FP4_FP8_GROUP != 128
#error "the lane mapping below assumes 128-element groups (4 threads x 32 elements)"
#endif

// Scales are either float32 (any strides, in elements) or E8M0 bytes (strides in bytes).
#define FP8Q_ARGS                                                                          \
    const u8* __restrict__ x, i64 x_row_bytes, u8* __restrict__ data, i64 data_row_bytes, \
        void* __restrict__ scales, i64 s_row, i64 s_group, u32 n_threads, u32 per_row,     \
        u32 div_m, u32 div_p

// One thread = 32 consecutive elements, four adjacent lanes = one 128-group: the group amax
// takes two shuffles. IN: 0 bf16, 1 fp16, 2 fp32. GATHER: output row r quantizes input row
// index[r], a zero row where index[r] is outside [0, x_rows) (the gathered copy never exists),
// its values times row_scale[r] rounded to IN's type where row_scale is given.
template <int IN, bool E8M0, bool GATHER = false>
__device__ __forceinline__ void quantize_fp8_piece(FP8Q_ARGS,
                                                   const i64* __restrict__ index = nullptr,
                                                   i64 x_rows = 0,
                                                   const float* __restrict__ row_scale = nullptr) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    bool valid = i < n_threads;           // n_threads % 4 == 0: a group is all in or all out
    u32 ii = valid ? i : 0;
    u32 row = fast_div(ii, div_m, div_p);
    u32 piece = ii - row * per_row;
    i64 src_row = row;
    bool read = valid;
    if (GATHER && valid) {
        src_row = gathered_row(index, row, x_rows);
        read = src_row >= 0;
    }
    const int elem = IN == 0 ? 2 : (IN == 1 ? 2 : 4);
    const u8* src = x + (read ? src_row : 0) * x_row_bytes + (i64)piece * (32 * elem);
    float f[32];
    u32 amax = 0;                          // |x| bits: NaN > Inf > every finite value
#pragma unroll
    for (int k = 0; k < 32; ++k) f[k] = 0.0f;
    if (read) {
        load32_as_f32<IN>(src, f);
        if (GATHER && row_scale != nullptr) {
            const float g = row_scale[row];
#pragma unroll
            for (int k = 0; k < 32; ++k) f[k] = as_type<IN>(fmul_rn(f[k], g));
        }
        amax = abs_bits_max32(f);
    }
    amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
    amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
    bool finite = amax < DS_FP4_F32_EXP_MASK;
    int e = fp8_exponent(amax);
    float s = pow2f(-e);
    u32 words[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        u32 lo = f32x2_to_e4m3x2(fmul_rn(f[4 * k], s), fmul_rn(f[4 * k + 1], s));
        u32 hi = f32x2_to_e4m3x2(fmul_rn(f[4 * k + 2], s), fmul_rn(f[4 * k + 3], s));
        words[k] = finite ? (lo | (hi << 16)) : DS_FP4_E4M3_NAN * 0x01010101u;
    }
    u8* dst = data + (i64)row * data_row_bytes + (i64)piece * 32;
    store32_pairwise(dst, words, valid);  // pieces 2k, 2k+1 are adjacent in one row
    if (valid && (piece & 3) == 0) {
        i64 at = (i64)row * s_row + (i64)(piece >> 2) * s_group;
        if (E8M0)
            ((u8*)scales)[at] = finite ? (u8)(e + DS_FP4_E8M0_BIAS) : (u8)DS_FP4_E8M0_NAN;
        else
            ((float*)scales)[at] = finite ? pow2f(e) : u2f(DS_FP4_F32_NAN_BITS);
    }
}

#define FP8Q_PASS x, x_row_bytes, data, data_row_bytes, scales, s_row, s_group, n_threads, \
                  per_row, div_m, div_p
#define FP8Q_KERNEL(name, IN, E8M0) \
    extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) name(FP8Q_ARGS) { \
        quantize_fp8_piece<IN, E8M0>(FP8Q_PASS); }

FP8Q_KERNEL(fp8_quantize_bf16, 0, false)
FP8Q_KERNEL(fp8_quantize_f16, 1, false)
FP8Q_KERNEL(fp8_quantize_f32, 2, false)
FP8Q_KERNEL(fp8_quantize_bf16_e8m0, 0, true)
FP8Q_KERNEL(fp8_quantize_f16_e8m0, 1, true)
FP8Q_KERNEL(fp8_quantize_f32_e8m0, 2, true)

#define FP8Q_GATHER_KERNEL(name, IN)                                                        \
    extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) name(                       \
        FP8Q_ARGS, const i64* __restrict__ index, i64 x_rows,                                \
        const float* __restrict__ row_scale) {                                              \
        quantize_fp8_piece<IN, true, true>(FP8Q_PASS, index, x_rows, row_scale); }

FP8Q_GATHER_KERNEL(fp8_quantize_bf16_e8m0_gather, 0)
FP8Q_GATHER_KERNEL(fp8_quantize_f16_e8m0_gather, 1)
FP8Q_GATHER_KERNEL(fp8_quantize_f32_e8m0_gather, 2)

// ---- dequantize ------------------------------------------------------------------
// One thread = 8 elements: e4m3 -> float32 (exact), times the group scale in float32 (one
// rounding, as the reference's float64 product cast through float32), then to the output.

#define FP8D_ARGS                                                                         \
    const u8* __restrict__ data, i64 data_row_bytes, const void* __restrict__ scales,     \
        i64 s_row, i64 s_group, u8* __restrict__ out, i64 out_row_bytes, u32 n_chunks,     \
        u32 chunks_per_row, u32 div_m, u32 div_p

// OUT: 0 bf16, 1 fp16, 2 fp32.
template <int OUT, bool E8M0>
__device__ __forceinline__ void dequantize_fp8_chunk(FP8D_ARGS) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_chunks) return;
    u32 row = fast_div(i, div_m, div_p);
    u32 c = i - row * chunks_per_row;
    uint2 d = ld_u64(data + (i64)row * data_row_bytes + 8 * (i64)c);
    i64 at = (i64)row * s_row + (i64)(c >> 4) * s_group;
    float sc = E8M0 ? e8m0_to_f32(((const u8*)scales)[at]) : ((const float*)scales)[at];
    float v[8];
    e4m3x8_scaled(d, sc, v);
    store8_from_f32<OUT>(out + (i64)row * out_row_bytes + (i64)c * (8 * (OUT == 2 ? 4 : 2)), v);
}

#define FP8D_PASS data, data_row_bytes, scales, s_row, s_group, out, out_row_bytes, n_chunks, \
                  chunks_per_row, div_m, div_p
#define FP8D_KERNEL(name, OUT, E8M0) \
    extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) name(FP8D_ARGS) { \
        dequantize_fp8_chunk<OUT, E8M0>(FP8D_PASS); }

FP8D_KERNEL(fp8_dequantize_bf16, 0, false)
FP8D_KERNEL(fp8_dequantize_f16, 1, false)
FP8D_KERNEL(fp8_dequantize_f32, 2, false)
FP8D_KERNEL(fp8_dequantize_bf16_e8m0, 0, true)
FP8D_KERNEL(fp8_dequantize_f16_e8m0, 1, true)
FP8D_KERNEL(fp8_dequantize_f32_e8m0, 2, true)
