// Direct MXFP4 -> FP8 E4M3 1x128 conversion (FORMATS.md): bit for bit
// quantize_fp8(dequantize_mxfp4(data, scales, float32)) without any float tensor in memory.
//
// One thread = one 32-element MX block (16 data bytes + 1 scale byte); four adjacent lanes
// = one 128-group. The group scale needs only floor(log2 amax): every E2M1 value has frexp
// mantissa 0.5 or 0.75 <= 448's 0.875 (the loader checks this), so with A = amax the FP8
// exponent is floor(log2 A) + 1 - FP8_VE. floor(log2) of a block's amax follows from the
// largest E2M1 exponent field among its codes (integer work on whole words), plus b - 127.
// Each block then builds the 8 possible E4M3 bytes of its codes (value(c) * 2^(b-127-e),
// RNE, subnormals included) and looks its 32 codes up four at a time with PRMT.
// mxfp4_to_fp8_rows_counted also counts (ds_fp4.ops.reference.mxfp4_to_fp8): the four lanes
// of a group reduce the largest and smallest scale byte of their nonzero blocks and each CTA
// adds its inexact and NaN groups with one atomic each. A separate instance, so that the
// plain kernel keeps its registers (30, against 38 with counting: below full occupancy).
#include "common.cuh"

#if DS_FP4_FP8_GROUP != 4 * DS_FP4_MX_BLOCK || DS_FP4_E2M1_MANT_BITS != 1
#error "this kernel assumes 4 MX blocks per FP8 group and the E2M1 code layout s e1 e0 m"
#endif

// Key of a block: L + b, with L = floor(log2 of the largest |value(c)|) + 1 + E2M1 bias:
// 0 for an all-zero block, 1 if the largest code is the subnormal 0.5, else 1 + its exponent
// field. key - KEY_OFFSET = floor(log2 amax). A scale byte of 255 (NaN block) gives a key
// above every finite one.
#define KEY_NAN 0x10000
#define KEY_OFFSET (DS_FP4_E8M0_BIAS + 1 + DS_FP4_E2M1_EXP_BIAS)

__device__ __forceinline__ int block_key(uint4 q, u32 b) {
    if (b == DS_FP4_E8M0_NAN) return KEY_NAN;
    u32 any = (q.x | q.y | q.z | q.w) & 0x77777777u;            // magnitudes only
    // exponent field e1 e0 = nibble bits 2..1; both set <=> field 3
    u32 both = ((q.x & (q.x << 1)) | (q.y & (q.y << 1)) | (q.z & (q.z << 1)) |
                (q.w & (q.w << 1))) & 0x44444444u;
    int field = both ? 3 : (any & 0x44444444u) ? 2 : (any & 0x22222222u) ? 1 : 0;
    int lmax = field ? field + 1 : (any ? 1 : 0);
    return lmax ? lmax + (int)b : 0;
}

// Exactness counts of the group this lane's block belongs to (`lead`: its first lane).
// Every thread of the CTA must call it (shuffles, barriers).
__device__ __forceinline__ void count_group(uint4 q, u32 b, bool finite, bool lead,
                                            u32 n_blocks, u64* counts) {
    bool nonzero = (q.x | q.y | q.z | q.w) & 0x77777777u;      // any code other than +-0
    u32 v = nonzero ? (b << 16) | (DS_FP4_E8M0_NAN - b) : 0u;  // (b, 255 - b) per half
    v = __vmaxu2(v, __shfl_xor_sync(0xFFFFFFFFu, v, 1));
    v = __vmaxu2(v, __shfl_xor_sync(0xFFFFFFFFu, v, 2));
    bool inexact = lead && finite && spread_too_wide(v >> 16, v & 0xFFFFu);
    u32 n_inexact = __syncthreads_count(inexact);
    u32 n_nan = __syncthreads_count(lead && !finite);
    // all groups: the grid's total, once (n_blocks % 4 == 0)
    u64 groups = blockIdx.x == 0 ? n_blocks / (DS_FP4_FP8_GROUP / DS_FP4_MX_BLOCK) : 0;
    add_exactness_counts(counts, n_inexact, n_nan, groups);
}

#define ROWS_ARGS                                                                            \
    const u8* __restrict__ data, i64 data_row_bytes, const u8* __restrict__ scales,          \
        i64 scales_row_bytes, u8* __restrict__ out, i64 out_row_bytes,                        \
        float* __restrict__ oscales, i64 os_row, i64 os_group, u32 n_blocks,                  \
        u32 blocks_per_row, u32 div_m, u32 div_p
#define ROWS_PASS data, data_row_bytes, scales, scales_row_bytes, out, out_row_bytes, oscales, \
                  os_row, os_group, n_blocks, blocks_per_row, div_m, div_p

template <bool COUNT>
__device__ __forceinline__ void convert_block(ROWS_ARGS, u64* __restrict__ counts) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    bool valid = i < n_blocks;            // n_blocks % 4 == 0: a group is all in or all out
    u32 ii = valid ? i : 0;
    u32 row = fast_div(ii, div_m, div_p);
    u32 blk = ii - row * blocks_per_row;
    uint4 q;
    u32 b = 0;
    q.x = q.y = q.z = q.w = 0;
    if (valid) {
        q = ld_u128(data + (i64)row * data_row_bytes + (i64)blk * (DS_FP4_MX_BLOCK / 2));
        b = scales[(i64)row * scales_row_bytes + blk];
    }
    int key = block_key(q, b);
    key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, 1));
    key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, 2));
    // float32 of the group amax overflows (-> Inf) from 2^128 on; NaN keys are above that
    bool finite = key - KEY_OFFSET < DS_FP4_F32_EXP_OVERFLOW;
    int e = key ? clampi(key - KEY_OFFSET + 1 - DS_FP4_FP8_VE, DS_FP4_FP8_EXP_MIN,
                         DS_FP4_FP8_EXP_MAX)
                : 0;
    // E4M3 bytes of value(c) * 2^d; |d| is clamped where the result is 0 or unused anyway
    int d = clampi((int)b - DS_FP4_E8M0_BIAS - e, -100, 100);
    float p = pow2f(d);
    u32 t01 = f32x2_to_e4m3x2(fmul_rn(DS_FP4_E2M1_V0, p), fmul_rn(DS_FP4_E2M1_V1, p));
    u32 t23 = f32x2_to_e4m3x2(fmul_rn(DS_FP4_E2M1_V2, p), fmul_rn(DS_FP4_E2M1_V3, p));
    u32 t45 = f32x2_to_e4m3x2(fmul_rn(DS_FP4_E2M1_V4, p), fmul_rn(DS_FP4_E2M1_V5, p));
    u32 t67 = f32x2_to_e4m3x2(fmul_rn(DS_FP4_E2M1_V6, p), fmul_rn(DS_FP4_E2M1_V7, p));
    u32 tlo = t01 | (t23 << 16), thi = t45 | (t67 << 16);
    u32 w[4] = {q.x, q.y, q.z, q.w};
    u32 o[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        o[2 * k] = lookup4<0>(tlo, thi, w[k]) | (code_sign_bytes<0>(w[k]) & 0x80808080u);
        o[2 * k + 1] = lookup4<1>(tlo, thi, w[k]) | (code_sign_bytes<1>(w[k]) & 0x80808080u);
        if (!finite) o[2 * k] = o[2 * k + 1] = DS_FP4_E4M3_NAN * 0x01010101u;
    }
    u8* dst = out + (i64)row * out_row_bytes + (i64)blk * DS_FP4_MX_BLOCK;
    store32_pairwise(dst, o, valid);      // blocks 2k, 2k+1 are adjacent in one row
    if (valid && (blk & 3) == 0)
        oscales[(i64)row * os_row + (i64)(blk >> 2) * os_group] =
            finite ? pow2f(e) : u2f(DS_FP4_F32_NAN_BITS);
    if (COUNT) count_group(q, b, finite, valid && (blk & 3) == 0, n_blocks, counts);
}

extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) mxfp4_to_fp8_rows(ROWS_ARGS) {
    convert_block<false>(ROWS_PASS, nullptr);
}
// counts: int64 [3] (inexact, NaN, all groups), added to
extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) mxfp4_to_fp8_rows_counted(
    ROWS_ARGS, u64* __restrict__ counts) {
    convert_block<true>(ROWS_PASS, counts);
}
