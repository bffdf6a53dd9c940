// E2M1 codes of scaled values and their packing into nibbles, MXFP4's rounding
// (FORMATS.md), shared by the quantizer (mxfp4_quant.cu) and the SwiGLU segment kernel that
// writes z's MXFP4 rows on the way (fp8_segments.cu); the loader inlines this file after
// common.cuh.

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
