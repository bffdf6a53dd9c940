// Device helpers shared by every ds_fp4 kernel family (FORMATS.md bit tricks).
//
// No CUDA headers are included: NVRTC (CuPy) and nvcc both compile this as is. Every format
// number arrives as a DS_FP4_* #define written by ds_fp4/ops/_cuda_loader.py from
// ds_fp4/formats.py; nothing here retypes a constant of the contract.

#ifndef DS_FP4_E8M0_BIAS
#error "compile through ds_fp4.ops._cuda_loader.module_source(): the DS_FP4_* defines are missing"
#endif

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// Hardware E4M3 conversions exist from sm_89; DS_FP4_SOFT_CVT forces the portable path so
// that it can be tested on a GPU that has both.
#if defined(DS_FP4_SOFT_CVT) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890)
#define DS_FP4_HW_E4M3 0
#else
#define DS_FP4_HW_E4M3 1
#endif

#define DS_FP4_F32_NAN_BITS 0x7FC00000u
#define DS_FP4_F32_EXP_MASK 0x7F800000u
#define DS_FP4_F32_ABS_MASK 0x7FFFFFFFu
#define DS_FP4_F32_EXP_OVERFLOW 128     // float32 values >= 2^128 round to Inf
#define BF16X2_NEG_ZERO 0x80008000u       // -0, -0: addend of an exact fma multiply
#define BF16X2_ABS 0x7FFF7FFFu

__device__ __forceinline__ u32 f2u(float f) { return __float_as_uint(f); }
__device__ __forceinline__ float u2f(u32 u) { return __uint_as_float(u); }

// q = n / d for n < 2^31 with a host-computed (m, p): q = (n * m) >> p.
__device__ __forceinline__ u32 fast_div(u32 n, u32 m, u32 p) {
    return (u32)(((u64)n * m) >> p);
}

// 2^e as float32 for e in [-149, 127] (subnormal below -126); exact.
__device__ __forceinline__ float pow2f(int e) {
    return e >= -126 ? u2f((u32)(e + 127) << 23) : u2f(1u << (e + 149));
}

// frexp of a finite positive float given by its bits: a = (1 + mant/2^23) / 2 * 2^E.
__device__ __forceinline__ void frexp_bits(u32 bits, int& E, u32& mant) {
    int ex = (int)(bits >> 23);
    u32 m = bits & 0x7FFFFFu;
    if (ex == 0) {                       // subnormal: move the leading 1 to bit 23
        int lz = __clz(m) - 8;
        m = (m << lz) & 0x7FFFFFu;
        ex = 1 - lz;
    }
    E = ex - 126;
    mant = m;
}

// Smallest e with a <= vmax * 2^e (vmax = vm * 2^VE, frexp), for finite a > 0:
// e = E - VE if frexp mantissa(a) <= vm else E - VE + 1; MANT_THR is vm's mantissa field.
__device__ __forceinline__ int smallest_pow2_exp(u32 abits, int VE, u32 MANT_THR) {
    int E; u32 mant;
    frexp_bits(abits, E, mant);
    return mant <= MANT_THR ? E - VE : E - VE + 1;
}

__device__ __forceinline__ int clampi(int v, int lo, int hi) { return min(max(v, lo), hi); }

// ---- single PTX instructions ------------------------------------------------------------
// Everything that needs inline PTX sits here, so that a host emulation of the kernels
// (DS_FP4_HOST_EMU, CPU tests) can supply its own versions of exactly these functions.
#ifndef DS_FP4_HOST_EMU

// IEEE float32 multiply / add, round to nearest even, subnormals kept. Written as PTX
// because CuPy compiles with -ftz=true appended after the caller's options, which would
// flush subnormal inputs and results of plain C arithmetic (and of __fmul_rn) to zero.
__device__ __forceinline__ float fmul_rn(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ float fadd_rn(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// float32 pair -> bf16x2, RNE (lo in bits 0-15).
__device__ __forceinline__ u32 f32x2_to_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// packed bf16x2 arithmetic (sm_80+; an fma with a -0 addend is an exact multiply)

__device__ __forceinline__ u32 bf16x2_fma(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

__device__ __forceinline__ u32 bf16x2_max_nan(u32 a, u32 b) {
    u32 r;
    asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

__device__ __forceinline__ u32 bf16x2_max(u32 a, u32 b) {
    u32 r;
    asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

__device__ __forceinline__ u32 bf16x2_min(u32 a, u32 b) {
    u32 r;
    asm("min.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
// PRMT in its default mode, selector bit 3 included (__byte_perm ignores that bit).
__device__ __forceinline__ u32 prmt_sign(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

#if DS_FP4_HW_E4M3
__device__ __forceinline__ u32 hw_f32x2_to_e4m3x2(float lo, float hi) {
    u16 r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void hw_e4m3x2_to_f32x2(u32 v, float& lo, float& hi) {
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((u16)v));
    lo = f16_to_f32((u16)(h2 & 0xFFFFu));
    hi = f16_to_f32((u16)(h2 >> 16));
}
#endif

#endif  // DS_FP4_HOST_EMU

// The input row a gathering kernel reads for index entry j: index[j], or -1 (a zero row, the
// gathered copy's) where that is outside [0, x_rows).
__device__ __forceinline__ i64 gathered_row(const i64* __restrict__ index, i64 j, i64 x_rows) {
    const i64 r = index[j];
    return r >= 0 && r < x_rows ? r : -1;
}

// float32 -> the type IN holds (0 bf16, 1 fp16, 2 fp32) -> float32, RNE: a value as a
// tensor of that dtype stores it
template <int IN>
__device__ __forceinline__ float as_type(float v) {
    if (IN == 0) return u2f(f32x2_to_bf16x2(v, 0.0f) << 16);
    if (IN == 1) return f16_to_f32(f32_to_f16(v));
    return v;
}

// MXFP4 block scale exponent (FORMATS.md): rceil or floor rule, A == 0 -> MX_EXP_MIN, clamped.
template <bool FLOOR>
__device__ __forceinline__ int mx_exponent(u32 abits) {
    if (abits == 0) return DS_FP4_MX_EXP_MIN;
    int e;
    if (FLOOR) {
        int E; u32 mant;
        frexp_bits(abits, E, mant);
        e = E - DS_FP4_MX_FLOOR_SUB;     // floor(log2 A) - emax(E2M1)
    } else {
        e = smallest_pow2_exp(abits, DS_FP4_MX_VE, DS_FP4_MX_MANT_THR);
    }
    return clampi(e, DS_FP4_MX_EXP_MIN, DS_FP4_MX_EXP_MAX);
}

// FP8 1x128 power-of-two scale exponent: smallest e with A <= 448 * 2^e, A == 0 -> 0, clamped.
__device__ __forceinline__ int fp8_exponent(u32 abits) {
    if (abits == 0) return 0;
    int e = smallest_pow2_exp(abits, DS_FP4_FP8_VE, DS_FP4_FP8_MANT_THR);
    return clampi(e, DS_FP4_FP8_EXP_MIN, DS_FP4_FP8_EXP_MAX);
}

// fp8_exponent for an amax that is an exact dequantized MXFP4 value: its frexp mantissa
// (0.5 or 0.75) never exceeds 448's (the loader checks this), so e = E - FP8_VE; a
// subnormal amax (exponent field 0) is far below the clamp.
__device__ __forceinline__ int fp8_exponent_mx(u32 abits) {
    if (abits == 0) return 0;
    return clampi((int)(abits >> 23) - 126 - DS_FP4_FP8_VE, DS_FP4_FP8_EXP_MIN, DS_FP4_FP8_EXP_MAX);
}

// ---- exactness counts of the MXFP4 -> FP8 conversions (ds_fp4.ops.reference) -------------
// counts[0..2]: inexact groups, NaN groups, all groups (EXACTNESS_COUNTS in formats.py).

// Whether a group whose nonzero members' scale bytes span [lo, hi] lies outside the
// exactness bound, given hi and 255 - lo: kernels reduce both with max (so one reduction
// finds the largest and the smallest byte), and a group without a nonzero member has 0, 0.
__device__ __forceinline__ bool spread_too_wide(u32 hi, u32 lo_complement) {
    return hi + lo_complement > DS_FP4_E8M0_NAN + DS_FP4_EXACT_SPREAD;   // hi - lo > spread
}

// A CTA's totals, added by thread 0 with one atomic per nonzero count.
__device__ __forceinline__ void add_exactness_counts(u64* counts, u32 inexact, u32 nan,
                                                     u64 groups) {
    if (threadIdx.x != 0) return;
    if (inexact) atomicAdd(counts, (u64)inexact);
    if (nan) atomicAdd(counts + 1, (u64)nan);
    if (groups) atomicAdd(counts + 2, groups);
}

// E8M0 byte -> float32 2^(b-127) (b = 0 gives the subnormal 2^-127), 255 -> NaN.
__device__ __forceinline__ float e8m0_to_f32(u32 b) {
    return b == DS_FP4_E8M0_NAN ? u2f(DS_FP4_F32_NAN_BITS) : pow2f((int)b - DS_FP4_E8M0_BIAS);
}

// ---- E4M3 <-> float32 -----------------------------------------------------------------

// RNE float32 -> E4M3 byte, saturating to +-448 (the portable twin of cvt...satfinite).
__device__ __forceinline__ u32 soft_f32_to_e4m3(float f) {
    u32 b = f2u(f);
    u32 sign = (b >> 24) & 0x80u;
    u32 a = b & DS_FP4_F32_ABS_MASK;
    if (a > DS_FP4_F32_EXP_MASK) return sign | DS_FP4_E4M3_NAN;
    // comparisons on the bits: no float compare that a flush-to-zero build could alter
    if (a >= f2u(DS_FP4_E4M3_MAX)) return sign | DS_FP4_E4M3_MAX_BYTE;  // >= 448 -> 448
    const int min_normal_exp = 1 - DS_FP4_E4M3_EXP_BIAS;
    if (a < f2u(pow2f(min_normal_exp))) {  // subnormal grid: multiples of 2^(emin - mant bits)
        float scaled = fmul_rn(u2f(a), pow2f(DS_FP4_E4M3_MANT_BITS - min_normal_exp));
        int q = __float2int_rn(scaled);  // (a flushed tiny input rounds to 0 either way)
        return sign | (u32)q;            // q == 8 is exactly the smallest normal's encoding
    }
    const int drop = 23 - DS_FP4_E4M3_MANT_BITS;
    u32 r = (a + ((1u << (drop - 1)) - 1) + ((a >> drop) & 1u)) >> drop;
    u32 code = r - ((u32)(127 - DS_FP4_E4M3_EXP_BIAS) << DS_FP4_E4M3_MANT_BITS);
    return sign | min(code, (u32)DS_FP4_E4M3_MAX_BYTE);
}


__device__ __forceinline__ float soft_e4m3_to_f32(u32 v) {
    u32 sign = (v & 0x80u) << 24;
    u32 mag = v & 0x7Fu;
    if (mag == DS_FP4_E4M3_NAN) return u2f(DS_FP4_F32_NAN_BITS);
    u32 ex = mag >> DS_FP4_E4M3_MANT_BITS;
    u32 m = mag & ((1u << DS_FP4_E4M3_MANT_BITS) - 1);
    float f;
    if (ex == 0)
        f = fmul_rn((float)m, pow2f(1 - DS_FP4_E4M3_EXP_BIAS - DS_FP4_E4M3_MANT_BITS));
    else
        f = u2f(((ex + 127 - DS_FP4_E4M3_EXP_BIAS) << 23) | (m << (23 - DS_FP4_E4M3_MANT_BITS)));
    return u2f(f2u(f) | sign);
}

// Two floats -> two E4M3 bytes (lo in bits 0-7, hi in bits 8-15), RNE, saturating.
__device__ __forceinline__ u32 f32x2_to_e4m3x2(float lo, float hi) {
#if DS_FP4_HW_E4M3
    return hw_f32x2_to_e4m3x2(lo, hi);
#else
    return soft_f32_to_e4m3(lo) | (soft_f32_to_e4m3(hi) << 8);
#endif
}

// Two E4M3 bytes (lo in bits 0-7) -> two exact floats.
__device__ __forceinline__ void e4m3x2_to_f32x2(u32 v, float& lo, float& hi) {
#if DS_FP4_HW_E4M3
    hw_e4m3x2_to_f32x2(v, lo, hi);
#else
    lo = soft_e4m3_to_f32(v & 0xFFu);
    hi = soft_e4m3_to_f32((v >> 8) & 0xFFu);
#endif
}




// ---- float32 -> 16-bit outputs (RNE, as torch's float -> bf16/half casts) --------------

__device__ __forceinline__ u32 f32x2_to_f16x2(float lo, float hi) {
    return (u32)f32_to_f16(lo) | ((u32)f32_to_f16(hi) << 16);
}


// ---- loads and stores whose alignment is only known at run time -------------------------
// Row buffers (e.g. the halves of a packed wire row) can start at any byte; the common,
// aligned case takes one wide access, the rest fall back to narrower ones.

__device__ __forceinline__ u32 ld_u32(const u8* p) {
    if (((u64)p & 3) == 0) return *(const u32*)p;
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

__device__ __forceinline__ uint2 ld_u64(const u8* p) {
    if (((u64)p & 7) == 0) return *(const uint2*)p;
    uint2 r; r.x = ld_u32(p); r.y = ld_u32(p + 4); return r;
}

__device__ __forceinline__ uint4 ld_u128(const u8* p) {
    if (((u64)p & 15) == 0) return *(const uint4*)p;
    uint4 r; r.x = ld_u32(p); r.y = ld_u32(p + 4); r.z = ld_u32(p + 8); r.w = ld_u32(p + 12);
    return r;
}

// 32 consecutive input elements as float32 (exact for all three types), read 16 bytes at a
// time. IN: 0 bf16, 1 fp16, 2 fp32 (the order the quantizers' templates use).
template <int IN>
__device__ __forceinline__ void load32_as_f32(const u8* src, float (&f)[32]) {
    constexpr int elem = IN == 2 ? 4 : 2;
#pragma unroll
    for (int k = 0; k < 32 * elem / 16; ++k) {
        uint4 q = ld_u128(src + 16 * k);
        u32 qq[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (IN == 0) {
                f[8 * k + 2 * j] = u2f(qq[j] << 16);
                f[8 * k + 2 * j + 1] = u2f(qq[j] & 0xFFFF0000u);
            } else if (IN == 1) {
                f[8 * k + 2 * j] = f16_to_f32((u16)(qq[j] & 0xFFFFu));
                f[8 * k + 2 * j + 1] = f16_to_f32((u16)(qq[j] >> 16));
            } else {
                f[4 * k + j] = u2f(qq[j]);
            }
        }
    }
}

// Largest |x| of 32 floats, compared on bits: NaN > Inf > every finite value.
__device__ __forceinline__ u32 abs_bits_max32(const float (&f)[32]) {
    u32 amax = 0;
#pragma unroll
    for (int k = 0; k < 32; ++k) amax = max(amax, f2u(f[k]) & DS_FP4_F32_ABS_MASK);
    return amax;
}

__device__ __forceinline__ void st_u32(u8* p, u32 v) {
    if (((u64)p & 3) == 0) { *(u32*)p = v; return; }
    p[0] = (u8)v; p[1] = (u8)(v >> 8); p[2] = (u8)(v >> 16); p[3] = (u8)(v >> 24);
}

__device__ __forceinline__ void st_u64(u8* p, uint2 v) {
    if (((u64)p & 7) == 0) { *(uint2*)p = v; return; }
    st_u32(p, v.x); st_u32(p + 4, v.y);
}

__device__ __forceinline__ void st_u128(u8* p, uint4 v) {
    if (((u64)p & 15) == 0) { *(uint4*)p = v; return; }
    st_u32(p, v.x); st_u32(p + 4, v.y); st_u32(p + 8, v.z); st_u32(p + 12, v.w);
}

// 8 consecutive elements as float32 (exact), and 8 floats stored as a type, RNE (IN/OUT:
// 0 bf16, 1 fp16, 2 fp32): one 16-byte access for the 16-bit types, two for fp32.
template <int IN>
__device__ __forceinline__ void load8_as_f32(const u8* src, float (&f)[8]) {
#pragma unroll
    for (int h = 0; h < (IN == 2 ? 2 : 1); ++h) {
        uint4 q = ld_u128(src + 16 * h);
        u32 qq[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (IN == 0) {
                f[2 * j] = u2f(qq[j] << 16);
                f[2 * j + 1] = u2f(qq[j] & 0xFFFF0000u);
            } else if (IN == 1) {
                f[2 * j] = f16_to_f32((u16)(qq[j] & 0xFFFFu));
                f[2 * j + 1] = f16_to_f32((u16)(qq[j] >> 16));
            } else {
                f[4 * h + j] = u2f(qq[j]);
            }
        }
    }
}

template <int OUT>
__device__ __forceinline__ void store8_from_f32(u8* dst, const float (&v)[8]) {
    uint4 o;
    if (OUT == 0) {
        o.x = f32x2_to_bf16x2(v[0], v[1]); o.y = f32x2_to_bf16x2(v[2], v[3]);
        o.z = f32x2_to_bf16x2(v[4], v[5]); o.w = f32x2_to_bf16x2(v[6], v[7]);
        st_u128(dst, o);
    } else if (OUT == 1) {
        o.x = f32x2_to_f16x2(v[0], v[1]); o.y = f32x2_to_f16x2(v[2], v[3]);
        o.z = f32x2_to_f16x2(v[4], v[5]); o.w = f32x2_to_f16x2(v[6], v[7]);
        st_u128(dst, o);
    } else {
        o.x = f2u(v[0]); o.y = f2u(v[1]); o.z = f2u(v[2]); o.w = f2u(v[3]);
        st_u128(dst, o);
        o.x = f2u(v[4]); o.y = f2u(v[5]); o.z = f2u(v[6]); o.w = f2u(v[7]);
        st_u128(dst + 16, o);
    }
}

// 8 E4M3 bytes times their group scale: each decoded exactly, then one float32 rounding.
__device__ __forceinline__ void e4m3x8_scaled(uint2 d, float sc, float (&v)[8]) {
    e4m3x2_to_f32x2(d.x & 0xFFFFu, v[0], v[1]);
    e4m3x2_to_f32x2(d.x >> 16, v[2], v[3]);
    e4m3x2_to_f32x2(d.y & 0xFFFFu, v[4], v[5]);
    e4m3x2_to_f32x2(d.y >> 16, v[6], v[7]);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = fmul_rn(v[k], sc);
}

// 32 output bytes per lane (o[0..3] then o[4..7]) where lanes 2k and 2k+1 own adjacent
// 32-byte blocks: the pair swaps halves so that each of the two 16-byte store instructions
// writes whole 32-byte sectors (lane 2k its first half then its partner's first half, lane
// 2k+1 the two second halves) instead of every other 16 bytes. All 32 lanes must call it.
__device__ __forceinline__ void store32_pairwise(u8* dst, const u32 (&o)[8], bool store) {
    const bool odd = threadIdx.x & 1;
    uint4 first, second;
    u32 a[4], c[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        u32 recv = __shfl_xor_sync(0xFFFFFFFFu, odd ? o[q] : o[4 + q], 1);
        a[q] = odd ? recv : o[q];
        c[q] = odd ? o[4 + q] : recv;
    }
    first.x = a[0]; first.y = a[1]; first.z = a[2]; first.w = a[3];
    second.x = c[0]; second.y = c[1]; second.z = c[2]; second.w = c[3];
    if (store) {
        st_u128(dst - (odd ? 16 : 0), first);
        st_u128(dst + (odd ? 16 : 32), second);
    }
}

// ---- E2M1 lookups through PRMT ------------------------------------------------------
// PRMT picks bytes of an 8-byte table by 3-bit indices (bit 3 of each selector nibble would
// switch it to sign replication, hence the & 0x7777 masks), so one instruction looks up four
// E2M1 codes. The sign of four codes is spread to four bytes (0xFF/0x00) the same way.

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) { return __byte_perm(a, b, sel); }

// Bytes [s0, s1, s2, s3] (0xFF if the code is negative) for the codes in nibbles 0-3 of w
// (HALF = 0) or 4-7 (HALF = 1).
template <int HALF>
__device__ __forceinline__ u32 code_sign_bytes(u32 w) {
    return prmt_sign(w << 4, w, HALF ? 0xFBEA : 0xD9C8);
}

// Table bytes [t(c) for c = 0..7] -> the bytes for the codes in nibbles 0-3 (HALF 0) or 4-7.
template <int HALF>
__device__ __forceinline__ u32 lookup4(u32 t_lo, u32 t_hi, u32 w) {
    u32 sel = (HALF ? (w >> 16) : w) & 0x7777u;
    return prmt(t_lo, t_hi, sel);
}

// ---- E2M1 values through PRMT tables ----------------------------------------------

__device__ __forceinline__ float e2m1_value(int c) {
    switch (c) {
        case 0: return DS_FP4_E2M1_V0; case 1: return DS_FP4_E2M1_V1;
        case 2: return DS_FP4_E2M1_V2; case 3: return DS_FP4_E2M1_V3;
        case 4: return DS_FP4_E2M1_V4; case 5: return DS_FP4_E2M1_V5;
        case 6: return DS_FP4_E2M1_V6; default: return DS_FP4_E2M1_V7;
    }
}

// 16-bit outputs of value(c) * sc for c = 0..7 as byte tables: lo bytes (tl0 = c 0-3,
// tl1 = c 4-7) and hi bytes (th0, th1). F16: float16 (RNE), else bfloat16 (exact here).
template <bool F16>
__device__ __forceinline__ void value_tables(float sc, u32& tl0, u32& tl1, u32& th0, u32& th1) {
    u32 t[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        float lo = fmul_rn(e2m1_value(2 * p), sc);
        float hi = fmul_rn(e2m1_value(2 * p + 1), sc);
        // value(c) * 2^k has at most 2 significant bits, so its bf16 is its top 16 bits
        t[p] = F16 ? f32x2_to_f16x2(lo, hi) : prmt(f2u(lo), f2u(hi), 0x7632);
    }
    tl0 = prmt(t[0], t[1], 0x6420); th0 = prmt(t[0], t[1], 0x7531);
    tl1 = prmt(t[2], t[3], 0x6420); th1 = prmt(t[2], t[3], 0x7531);
}

// Eight codes (one word) -> eight 16-bit values with signs, as a uint4.
__device__ __forceinline__ uint4 lookup8_16bit(u32 w, u32 tl0, u32 tl1, u32 th0, u32 th1) {
    u32 lo_a = lookup4<0>(tl0, tl1, w);
    u32 hi_a = lookup4<0>(th0, th1, w) | (code_sign_bytes<0>(w) & 0x80808080u);
    u32 lo_b = lookup4<1>(tl0, tl1, w);
    u32 hi_b = lookup4<1>(th0, th1, w) | (code_sign_bytes<1>(w) & 0x80808080u);
    uint4 o;
    o.x = prmt(lo_a, hi_a, 0x5140); o.y = prmt(lo_a, hi_a, 0x7362);
    o.z = prmt(lo_b, hi_b, 0x5140); o.w = prmt(lo_b, hi_b, 0x7362);
    return o;
}
