// MXFP4 token rows -> FP8 E4M3 1x128 along tokens, transposed, per ragged segment
// (FORMATS.md "Column-wise conversion"): bit for bit
//   quantize_fp8(pad(dequantize_mxfp4(x[seg], float32), P_g).T)   for each segment g.
//
// A CTA owns one 128-token tile (a scale group along tokens, never spanning two segments;
// the host lists the tiles; blockIdx.x) times 128 features (blockIdx.y). Token tiles run
// fastest so that the CTAs in flight fill whole output rows (the writes are 2/3 of the
// bytes; rows of the transposed output are written together instead of scattered). 8 warps: token quarter qq = warp & 3 (32
// tokens), feature half h = warp >> 2 (64 features). Lane (j = lane >> 3, cw = lane & 7)
// reads the 4-byte code word cw (8 features) of 8 consecutive tokens: per load instruction
// a warp reads 4 rows x 32 contiguous bytes, whole sectors. The transpose happens in
// registers: an E4M3 pair conversion takes (token r, token r+1) of one feature, so each
// thread writes, per feature, its 8 tokens as 8 contiguous output bytes. The column amax
// is reduced over j by two shuffles and over the 4 token quarters through shared memory
// (one barrier, no smem data transpose, so no bank-conflict padding is needed).
// mxfp4_to_fp8_colwise_counted also counts (ds_fp4.ops.reference.mxfp4_to_fp8_colwise): the
// largest and smallest scale byte of each column group's nonzero elements are reduced like
// the amax, and each CTA adds its inexact and NaN groups (one more barrier, one atomic
// each). A separate instance, so that the plain kernel is compiled as before.
#include "common.cuh"

#if DS_FP4_FP8_GROUP != 128 || DS_FP4_MX_BLOCK != 32
#error "the tile mapping below assumes 128-token groups and 32-element MX blocks"
#endif

#define TILE_FEATURES 128
#define BF16X2_INF 0x7F807F80u

// bf16x2 min/max of three (3-input on sm_90: one instruction)
__device__ __forceinline__ u32 bf16x2_max3(u32 a, u32 b, u32 c) { return bf16x2_max(bf16x2_max(a, b), c); }
__device__ __forceinline__ u32 bf16x2_min3(u32 a, u32 b, u32 c) { return bf16x2_min(bf16x2_min(a, b), c); }

// Per feature of a thread's 8 (code word w[r] of token r, r < 8), over its 8 tokens: the
// largest scale byte of a nonzero element (bytes of .x: features 0-3, .y: 4-7) and 255 - the
// smallest (.z, .w); 0 where no element is nonzero. Reduced over j by two shuffles.
__device__ __forceinline__ uint4 byte_spans(const u32 (&w)[8], const u32 (&b)[8]) {
    uint4 s; s.x = s.y = s.z = s.w = 0;
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        // bit 3 of nibble f set <=> code f has a magnitude bit; spread to bytes 0xFF/0x00
        u32 m = w[r] & 0x77777777u;
        u32 nz = (m << 1) | (m << 2) | (m << 3);
        u32 lo = code_sign_bytes<0>(nz), hi = code_sign_bytes<1>(nz);
        u32 big = b[r] * 0x01010101u, small = (DS_FP4_E8M0_NAN - b[r]) * 0x01010101u;
        s.x = __vmaxu4(s.x, big & lo);
        s.y = __vmaxu4(s.y, big & hi);
        s.z = __vmaxu4(s.z, small & lo);
        s.w = __vmaxu4(s.w, small & hi);
    }
#pragma unroll
    for (int mask = 8; mask <= 16; mask *= 2) {
        s.x = __vmaxu4(s.x, __shfl_xor_sync(0xFFFFFFFFu, s.x, mask));
        s.y = __vmaxu4(s.y, __shfl_xor_sync(0xFFFFFFFFu, s.y, mask));
        s.z = __vmaxu4(s.z, __shfl_xor_sync(0xFFFFFFFFu, s.z, mask));
        s.w = __vmaxu4(s.w, __shfl_xor_sync(0xFFFFFFFFu, s.w, mask));
    }
    return s;
}

// A thread's byte spans (byte_spans) reduced over the CTA's 4 token quarters.
__device__ __forceinline__ uint4 span_of_column(const uint4 (&bred)[4][TILE_FEATURES / 8],
                                                int slot) {
    uint4 s = bred[0][slot];
#pragma unroll
    for (int q = 1; q < 4; ++q) {
        uint4 r = bred[q][slot];
        s.x = __vmaxu4(s.x, r.x); s.y = __vmaxu4(s.y, r.y);
        s.z = __vmaxu4(s.z, r.z); s.w = __vmaxu4(s.w, r.w);
    }
    return s;
}

// The inexact and NaN groups among a thread's 8 features (their group amax `am` as bf16
// pairs, their byte spans), added to the CTA's shared counts.
__device__ __forceinline__ void count_features(const u32 (&am)[4], uint4 span, u32* ncount) {
    u32 inexact = 0, nan = 0;
#pragma unroll
    for (int f = 0; f < 8; ++f) {
        u32 a = (f & 1 ? am[f >> 1] & 0xFFFF0000u : am[f >> 1] << 16);
        bool finite = a < DS_FP4_F32_EXP_MASK;
        u32 shift = 8 * (f & 3);
        u32 hi = ((f < 4 ? span.x : span.y) >> shift) & 0xFFu;
        u32 lo = ((f < 4 ? span.z : span.w) >> shift) & 0xFFu;
        nan += !finite;
        inexact += finite && spread_too_wide(hi, lo);
    }
    if (inexact) atomicAdd(ncount, inexact);
    if (nan) atomicAdd(ncount + 1, nan);
}

#define COLWISE_ARGS                                                                      \
    const u8* __restrict__ data, i64 data_row_bytes, const u8* __restrict__ scales,       \
        i64 scales_row_bytes, const int* __restrict__ tiles, u8* __restrict__ out,         \
        i64 out_row_bytes, float* __restrict__ oscales, u32 k
#define COLWISE_PASS data, data_row_bytes, scales, scales_row_bytes, tiles, out, \
                     out_row_bytes, oscales, k

template <bool COUNT>
__device__ __forceinline__ void convert_tile(COLWISE_ARGS, u64* __restrict__ counts) {
    __shared__ uint4 red[4][TILE_FEATURES / 8];           // per token quarter: 2 features a word
    __shared__ uint4 bred[4][TILE_FEATURES / 8];          // the same for the scale-byte spans
    __shared__ u32 ncount[2];                             // the CTA's inexact, NaN groups
    const u32 tile_id = blockIdx.x, ftile = blockIdx.y;   // grid: (token tiles, feature tiles)
    const int* tile = tiles + 3 * tile_id;
    const int row0 = tile[0], row_end = tile[1], col0 = tile[2];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 qq = warp & 3, h = warp >> 2, cw = lane & 7, j = lane >> 3;
    const u32 fw = ftile * (TILE_FEATURES / 8) + h * 8 + cw;   // word: features 8fw..+7
    const int tok = row0 + 32 * (int)qq + 8 * (int)j;
    const int valid = row_end - tok;      // rows of this thread inside the segment (may be <= 0)

    u32 w[8], b[8];
    const u8* dp = data + (i64)tok * data_row_bytes + 4 * fw;
    const u8* sp = scales + (i64)tok * scales_row_bytes + (fw >> 2);
#pragma unroll
    for (int r = 0; r < 8; ++r) {         // all loads first: 8 independent requests in flight
        w[r] = 0; b[r] = 0;               // padding tokens are zeros (scale byte 0: finite)
        if (r < valid) { w[r] = ld_u32(dp); b[r] = *sp; }
        dp += data_row_bytes;
        sp += scales_row_bytes;
    }
    if (COUNT) {
        // here, while w and b are live anyway: only smem holds the spans past this point
        uint4 span = byte_spans(w, b);
        if (j == 0) bred[qq][h * 8 + cw] = span;
        if (threadIdx.x == 0) ncount[0] = ncount[1] = 0;
    }
    // the bf16 of value(c) as PRMT tables; `one` is 1.0 that the compiler cannot fold, which
    // keeps the tables in ordinary registers instead of re-copying uniform ones per lookup
    const float one = u2f(0x3F800000u | (threadIdx.x >> 31));
    u32 tl0, tl1, th0, th1;
    value_tables<false>(one, tl0, tl1, th0, th1);

    // x[r][p] = bf16 pair (features 2p, 2p+1 of token r) of the dequantized value: exact in
    // bf16 as in float32 (2 significant bits; the same range; >= 2^128 -> Inf).
    u32 x[8][4], mx[4], mn[4];
    bool nan = false;
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        nan |= b[r] == DS_FP4_E8M0_NAN;
        // 2^(b-127) as bf16 in both halves (b = 0: the subnormal 2^-127). A NaN block (255)
        // gets Inf here, so its x are Inf/NaN; max/min skip NaN and `nan` overrides the amax.
        u32 s = b[r] ? b[r] * 0x00800080u : 0x00400040u;
        uint4 v = lookup8_16bit(w[r], tl0, tl1, th0, th1);
        x[r][0] = bf16x2_fma(v.x, s, BF16X2_NEG_ZERO);
        x[r][1] = bf16x2_fma(v.y, s, BF16X2_NEG_ZERO);
        x[r][2] = bf16x2_fma(v.z, s, BF16X2_NEG_ZERO);
        x[r][3] = bf16x2_fma(v.w, s, BF16X2_NEG_ZERO);
    }
    // max |x| per feature = max(max x, -min x): max and min over the 8 tokens
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        u32 a = bf16x2_max3(x[0][p], x[1][p], x[2][p]);
        a = bf16x2_max3(a, x[3][p], x[4][p]);
        a = bf16x2_max3(a, x[5][p], x[6][p]);
        mx[p] = bf16x2_max(a, x[7][p]);
        u32 c = bf16x2_min3(x[0][p], x[1][p], x[2][p]);
        c = bf16x2_min3(c, x[3][p], x[4][p]);
        c = bf16x2_min3(c, x[5][p], x[6][p]);
        mn[p] = bf16x2_min(c, x[7][p]);
    }
    u32 am[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        u32 a = bf16x2_max(mx[p], mn[p] ^ 0x80008000u) & BF16X2_ABS;   // |.|, no -0
        if (nan) a = BF16X2_INF;          // a NaN block poisons its 32 features' groups
        a = bf16x2_max(a, __shfl_xor_sync(0xFFFFFFFFu, a, 8));
        am[p] = bf16x2_max(a, __shfl_xor_sync(0xFFFFFFFFu, a, 16));
    }
    if (j == 0) {
        uint4 v; v.x = am[0]; v.y = am[1]; v.z = am[2]; v.w = am[3];
        red[qq][h * 8 + cw] = v;
    }
    __syncthreads();
    {
        uint4 r0 = red[0][h * 8 + cw], r1 = red[1][h * 8 + cw];
        uint4 r2 = red[2][h * 8 + cw], r3 = red[3][h * 8 + cw];
        am[0] = bf16x2_max(bf16x2_max3(r0.x, r1.x, r2.x), r3.x);
        am[1] = bf16x2_max(bf16x2_max3(r0.y, r1.y, r2.y), r3.y);
        am[2] = bf16x2_max(bf16x2_max3(r0.z, r1.z, r2.z), r3.z);
        am[3] = bf16x2_max(bf16x2_max3(r0.w, r1.w, r2.w), r3.w);
    }

    u8* dst = out + (i64)(8 * fw) * out_row_bytes + col0 + 32 * qq + 8 * j;
    u32 sc[8];
#pragma unroll
    for (int f = 0; f < 8; ++f) {
        const int p = f >> 1, hi = f & 1;
        u32 a = (hi ? am[p] & 0xFFFF0000u : am[p] << 16);    // the group amax as float32 bits
        bool finite = a < DS_FP4_F32_EXP_MASK;
        int e = fp8_exponent_mx(a);       // e in [-126, 119]: 2^-e and 2^e are normal
        u32 t = (u32)(127 - e) * 0x00800080u;                // 2^-e as bf16, both halves
        const u32 sel = hi ? 0x7632 : 0x5410;               // feature f of tokens r, r+1
        u32 q[4];
#pragma unroll
        for (int r = 0; r < 8; r += 2) {
            u32 y = bf16x2_fma(prmt(x[r][p], x[r + 1][p], sel), t, BF16X2_NEG_ZERO);  // exact
            q[r >> 1] = f32x2_to_e4m3x2(u2f(y << 16), u2f(y & 0xFFFF0000u));
        }
        uint2 o;
        o.x = q[0] | (q[1] << 16);
        o.y = q[2] | (q[3] << 16);
        if (!finite) o.x = o.y = DS_FP4_E4M3_NAN * 0x01010101u;
        st_u64(dst, o);
        dst += out_row_bytes;
        sc[f] = finite ? (u32)(127 + e) << 23 : DS_FP4_F32_NAN_BITS;
    }
    if (qq == 0 && j == 0) {              // scales stored [sum P / 128, K]: 8 features contiguous
        u8* sdst = (u8*)(oscales + (i64)(col0 / DS_FP4_FP8_GROUP) * k + 8 * fw);
        uint4 s0, s1;
        s0.x = sc[0]; s0.y = sc[1]; s0.z = sc[2]; s0.w = sc[3];
        s1.x = sc[4]; s1.y = sc[5]; s1.z = sc[6]; s1.w = sc[7];
        st_u128(sdst, s0);
        st_u128(sdst + 16, s1);
    }
    if (COUNT) {
        // after the stores, where the x registers are free
        if (qq == 0 && j == 0) count_features(am, span_of_column(bred, h * 8 + cw), ncount);
        __syncthreads();                  // every count_features is in ncount
        // all groups: 128 per CTA (one per feature of its token tile), added once
        u64 groups = blockIdx.x == 0 && blockIdx.y == 0
                         ? (u64)gridDim.x * gridDim.y * TILE_FEATURES : 0;
        add_exactness_counts(counts, ncount[0], ncount[1], groups);
    }
}

extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) mxfp4_to_fp8_colwise(COLWISE_ARGS) {
    convert_tile<false>(COLWISE_PASS, nullptr);
}
// counts: int64 [3] (inexact, NaN, all groups), added to
extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) mxfp4_to_fp8_colwise_counted(
    COLWISE_ARGS, u64* __restrict__ counts) {
    convert_tile<true>(COLWISE_PASS, counts);
}
