// MXFP4 quantize (bf16/fp16/fp32 -> E2M1 codes + E8M0 block scales) and dequantize.
// Bit for bit ds_fp4/ops/reference.py: quantize_mxfp4 / dequantize_mxfp4 (FORMATS.md).
#include "common.cuh"

#if DS_FP4_E2M1_MAX_CODE != 7 || DS_FP4_MX_BLOCK != 32
#error "the packing below assumes 3-bit E2M1 magnitudes and 32-element blocks"
#endif

// ---- E2M1 rounding by one correctly rounded add --------------------------------------
// For v >= 0 on the E2M1 grid's binade Ev (Ev >= EMIN, the subnormals share EMIN's
// spacing), the grid spacing is 2^(Ev - MANT). Adding M = 2^(Ev + FMANT - MANT) (FMANT:
// mantissa bits of the float format) makes the float's last mantissa place that spacing,
// so the hardware's single RNE rounding is exactly RNE onto the E2M1 grid, ties to the
// even code. Then (r - M) counts grid steps k above 0 in that binade, and the code is
// k + (Ev - EMIN) << MANT.

#define E2M1_ONE_F32 ((u32)(127 + DS_FP4_E2M1_EMIN) << 23)        // 2^EMIN
#define E2M1_MAGIC_F32 ((u32)(23 - DS_FP4_E2M1_MANT_BITS) << 23)
#define E2M1_OFF_SHIFT_F32 (23 - DS_FP4_E2M1_MANT_BITS)
#define E2M1_ONE_BF16X2 (((u32)(127 + DS_FP4_E2M1_EMIN) << 7) * 0x10001u)
#define E2M1_MAGIC_BF16X2 (((u32)(7 - DS_FP4_E2M1_MANT_BITS) << 7) * 0x10001u)
#define E2M1_OFF_SHIFT_BF16 (7 - DS_FP4_E2M1_MANT_BITS)
#define BF16X2_ONE 0x3F803F80u            // 1.0, 1.0: the multiplier of the rounding add
#define BF16X2_EXP 0x7F807F80u

// Codes of two bf16 values (one word) scaled by s2 = 2^-e in both halves: each 16-bit half
// holds a 4-bit code (sign in bit 3).
template <bool FLOOR>
__device__ __forceinline__ u32 e2m1_codes_bf16x2(u32 w, u32 s2) {
    u32 v = bf16x2_fma(w & BF16X2_ABS, s2, BF16X2_NEG_ZERO);   // exact: power-of-two scale
    u32 e2 = bf16x2_max(v & BF16X2_EXP, E2M1_ONE_BF16X2);       // 2^max(Ev, EMIN) per half
    u32 m = e2 + E2M1_MAGIC_BF16X2;
    u32 r = bf16x2_fma(v, BF16X2_ONE, m);                       // the rounding add
    // halves never borrow: r >= m and e2 >= ONE in each half
    u32 code = r - m + ((e2 - E2M1_ONE_BF16X2) >> E2M1_OFF_SHIFT_BF16);
    if (FLOOR) code -= (code >> 3) & 0x00010001u;   // floor rule: 8 (v >= 7) saturates to 7
    return code | ((w >> 12) & (DS_FP4_E2M1_SIGN_BIT * 0x10001u));
}

// Code of one float already known finite, scaled by s = 2^-e.
template <bool FLOOR>
__device__ __forceinline__ u32 e2m1_code_f32(float x, float s) {
    u32 xb = f2u(x);
    float v = fmul_rn(u2f(xb & DS_FP4_F32_ABS_MASK), s);
    u32 e2 = max(f2u(v) & DS_FP4_F32_EXP_MASK, E2M1_ONE_F32);
    u32 m = e2 + E2M1_MAGIC_F32;
    u32 code = f2u(fadd_rn(v, u2f(m))) - m + ((e2 - E2M1_ONE_F32) >> E2M1_OFF_SHIFT_F32);
    if (FLOOR) code = min(code, (u32)DS_FP4_E2M1_MAX_CODE);
    return code | ((xb >> 28) & DS_FP4_E2M1_SIGN_BIT);
}

// Four words of code pairs (as e2m1_codes_bf16x2 returns them) -> 16 bits of 4 nibbles.
__device__ __forceinline__ u32 pack_code_pairs(u32 y0, u32 y1) {
    u32 t = y0 | (y1 << 8);               // nibbles at bits 0, 16 (y0) and 8, 24 (y1)
    return (t | (t >> 12)) & 0xFFFFu;
}

#define MXQ_ARGS                                                                           \
    const u8* __restrict__ x, i64 x_row_bytes, u8* __restrict__ data, i64 data_row_bytes, \
        u8* __restrict__ scales, i64 scales_row_bytes, u32 n_blocks, u32 blocks_per_row,    \
        u32 div_m, u32 div_p

// One thread = one 32-element block: amax, scale and all 32 codes stay in registers.
// GATHER: output row r from input row index[r], zeros where outside [0, x_rows).
template <bool FLOOR, bool GATHER = false>
__device__ __forceinline__ void quantize_block_bf16(MXQ_ARGS,
                                                    const i64* __restrict__ index = nullptr,
                                                    i64 x_rows = 0) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_blocks) return;
    u32 row = fast_div(i, div_m, div_p);
    u32 blk = i - row * blocks_per_row;
    const i64 src_row = GATHER ? gathered_row(index, row, x_rows) : (i64)row;
    const u8* src = x + src_row * x_row_bytes + (i64)blk * (DS_FP4_MX_BLOCK * 2);
    u32 w[16];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        uint4 q = {0u, 0u, 0u, 0u};
        if (src_row >= 0) q = ld_u128(src + 16 * k);
        w[4 * k] = q.x; w[4 * k + 1] = q.y; w[4 * k + 2] = q.z; w[4 * k + 3] = q.w;
    }
    u32 m2 = 0;
#pragma unroll
    for (int k = 0; k < 16; ++k) m2 = bf16x2_max_nan(m2, w[k] & BF16X2_ABS);  // NaN wins
    u32 amax = bf16x2_max_nan(m2, m2 >> 16) & 0xFFFFu;
    u8* dst = data + (i64)row * data_row_bytes + (i64)blk * (DS_FP4_MX_BLOCK / 2);
    u8* sdst = scales + (i64)row * scales_row_bytes + blk;
    uint4 o;
    if (amax >= 0x7F80u) {                // NaN/Inf block: data 0, scale byte NaN
        o.x = o.y = o.z = o.w = 0;
        st_u128(dst, o);
        *sdst = (u8)DS_FP4_E8M0_NAN;
        return;
    }
    int e = mx_exponent<FLOOR>(amax << 16);
    u32 s16 = f2u(pow2f(-e)) >> 16;       // 2^-e is exact in bf16 for e in [-127, 127]
    u32 s2 = s16 | (s16 << 16);
    u32 y[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) y[k] = e2m1_codes_bf16x2<FLOOR>(w[k], s2);
    o.x = pack_code_pairs(y[0], y[1]) | (pack_code_pairs(y[2], y[3]) << 16);
    o.y = pack_code_pairs(y[4], y[5]) | (pack_code_pairs(y[6], y[7]) << 16);
    o.z = pack_code_pairs(y[8], y[9]) | (pack_code_pairs(y[10], y[11]) << 16);
    o.w = pack_code_pairs(y[12], y[13]) | (pack_code_pairs(y[14], y[15]) << 16);
    st_u128(dst, o);
    *sdst = (u8)(e + DS_FP4_E8M0_BIAS);
}

// fp16 / fp32 inputs: the same rule through float32 (exact for both).
template <bool FLOOR, bool F16, bool GATHER = false>
__device__ __forceinline__ void quantize_block_f32(MXQ_ARGS,
                                                   const i64* __restrict__ index = nullptr,
                                                   i64 x_rows = 0) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_blocks) return;
    u32 row = fast_div(i, div_m, div_p);
    u32 blk = i - row * blocks_per_row;
    const int elem = F16 ? 2 : 4;
    const i64 src_row = GATHER ? gathered_row(index, row, x_rows) : (i64)row;
    const u8* src = x + src_row * x_row_bytes + (i64)blk * (DS_FP4_MX_BLOCK * elem);
    float f[32];
#pragma unroll
    for (int k = 0; k < 32; ++k) f[k] = 0.0f;
    if (src_row >= 0) load32_as_f32<F16 ? 1 : 2>(src, f);
    u32 amax = abs_bits_max32(f);
    u8* dst = data + (i64)row * data_row_bytes + (i64)blk * (DS_FP4_MX_BLOCK / 2);
    u8* sdst = scales + (i64)row * scales_row_bytes + blk;
    uint4 o;
    if (amax >= DS_FP4_F32_EXP_MASK) {
        o.x = o.y = o.z = o.w = 0;
        st_u128(dst, o);
        *sdst = (u8)DS_FP4_E8M0_NAN;
        return;
    }
    int e = mx_exponent<FLOOR>(amax);
    float s = pow2f(-e);
    u32 words[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        u32 acc = 0;
#pragma unroll
        for (int n = 0; n < 8; ++n) acc |= e2m1_code_f32<FLOOR>(f[8 * q + n], s) << (4 * n);
        words[q] = acc;
    }
    o.x = words[0]; o.y = words[1]; o.z = words[2]; o.w = words[3];
    st_u128(dst, o);
    *sdst = (u8)(e + DS_FP4_E8M0_BIAS);
}

#define MXQ_PASS x, x_row_bytes, data, data_row_bytes, scales, scales_row_bytes, n_blocks, \
                 blocks_per_row, div_m, div_p

#define MXQ_KERNELS(name, BODY, ...)                                                       \
    extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) name(MXQ_ARGS) {             \
        BODY<__VA_ARGS__>(MXQ_PASS); }                                                      \
    extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) name##_gather(               \
        MXQ_ARGS, const i64* __restrict__ index, i64 x_rows) {                              \
        BODY<__VA_ARGS__, true>(MXQ_PASS, index, x_rows); }

MXQ_KERNELS(mxfp4_quantize_bf16_rceil, quantize_block_bf16, false)
MXQ_KERNELS(mxfp4_quantize_bf16_floor, quantize_block_bf16, true)
MXQ_KERNELS(mxfp4_quantize_f16_rceil, quantize_block_f32, false, true)
MXQ_KERNELS(mxfp4_quantize_f16_floor, quantize_block_f32, true, true)
MXQ_KERNELS(mxfp4_quantize_f32_rceil, quantize_block_f32, false, false)
MXQ_KERNELS(mxfp4_quantize_f32_floor, quantize_block_f32, true, false)

// ---- dequantize ------------------------------------------------------------------
// One thread = 8 elements (one data word). The 8 possible outputs of the block are built
// once (value(c) * 2^(b-127) in float32, exact, Inf beyond range, NaN for b = 255), then
// four codes at a time are looked up through PRMT; the sign bits are ORed into the high
// byte of each 16-bit result.

#define MXD_ARGS                                                                          \
    const u8* __restrict__ data, i64 data_row_bytes, const u8* __restrict__ scales,       \
        i64 scales_row_bytes, u8* __restrict__ out, i64 out_row_bytes, u32 n_chunks,       \
        u32 chunks_per_row, u32 div_m, u32 div_p

// OUT: 0 bf16, 1 fp16, 2 fp32.
template <int OUT>
__device__ __forceinline__ void dequantize_chunk(MXD_ARGS) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_chunks) return;
    u32 row = fast_div(i, div_m, div_p);
    u32 c = i - row * chunks_per_row;
    u32 w = ld_u32(data + (i64)row * data_row_bytes + 4 * (i64)c);
    u32 b = scales[(i64)row * scales_row_bytes + (c >> 2)];
    float sc = e8m0_to_f32(b);
    u8* dst = out + (i64)row * out_row_bytes + (i64)c * (8 * (OUT == 2 ? 4 : 2));
    u32 tl0, tl1, th0, th1;
    if (OUT != 2) {
        value_tables<OUT == 1>(sc, tl0, tl1, th0, th1);
        st_u128(dst, lookup8_16bit(w, tl0, tl1, th0, th1));
    } else {
        // signed bf16 value(c) (exact), widened to float32 and scaled (exact or +-Inf/NaN)
        value_tables<false>(1.0f, tl0, tl1, th0, th1);
        uint4 v = lookup8_16bit(w, tl0, tl1, th0, th1);
        u32 vv[4] = {v.x, v.y, v.z, v.w};
        u32 r[8];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            r[2 * k] = f2u(fmul_rn(u2f(vv[k] << 16), sc));
            r[2 * k + 1] = f2u(fmul_rn(u2f(vv[k] & 0xFFFF0000u), sc));
        }
        uint4 o0, o1;
        o0.x = r[0]; o0.y = r[1]; o0.z = r[2]; o0.w = r[3];
        o1.x = r[4]; o1.y = r[5]; o1.z = r[6]; o1.w = r[7];
        st_u128(dst, o0);
        st_u128(dst + 16, o1);
    }
}

#define MXD_PASS data, data_row_bytes, scales, scales_row_bytes, out, out_row_bytes, n_chunks, \
                 chunks_per_row, div_m, div_p

extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) mxfp4_dequantize_bf16(MXD_ARGS) {
    dequantize_chunk<0>(MXD_PASS);
}
extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) mxfp4_dequantize_f16(MXD_ARGS) {
    dequantize_chunk<1>(MXD_PASS);
}
extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) mxfp4_dequantize_f32(MXD_ARGS) {
    dequantize_chunk<2>(MXD_PASS);
}
