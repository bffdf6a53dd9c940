// Fused FP8 quantizers of the FP8 experts (ds_fp4/moe/fp8_fused.py loads this file after
// the DS_FP4_* defines and ds_fp4/ops/common.cuh).
//
// fp8_tiles_*: 128x128 weight tiles (FORMATS.md power-of-two scales) of many same-shape
//   weights in one launch, written as-is or transposed; one read of each weight.
// fp8_seg_*:   1x128 FP8 quantization of token-major activations split into segments of
//   seg_len tokens (one per local expert), row-wise (groups along features) and/or
//   column-wise (groups along tokens, output transposed, each segment zero padded to a
//   multiple of 128 tokens), from one read; optionally computing the value on the way in:
//   SwiGLU h = silu(gate) * up, or its gradient dz, from z as bf16 or as packed MXFP4 rows.
//
// Both use CTAs of 256 threads and 128x128 tiles: one CTA per tile, or, for the plain bf16
// segment source, also persistent CTAs that prefetch their next tile (name_p; fp8_fused.py
// times the variants on first use per shape). Warp w, lane l: column chunk
// cc = l & 15 (8 elements) of the tile rows r0 + i, r0 = 16 w + 8 (l >> 4), i = 0..7; a
// warp's load instruction reads two whole 256-byte rows. Transposed outputs pass through shared memory
// as 8-byte chunks (8 tokens of one feature) whose chunk index is XOR-swizzled by the
// feature's 8-group, so that both the writes and the row-wise reads are free of bank
// conflicts. Values are multiplied by the power-of-two 2^-e in float32 (exact) and converted
// by f32x2_to_e4m3x2, as fp8_quant.cu does, so the bytes equal quantize_fp8's. Float
// arithmetic goes through common.cuh's PTX fmul_rn/fadd_rn (and fdiv_rn here): CuPy compiles
// with -ftz=true, which would flush subnormals in plain C arithmetic.
#include "common.cuh"

#if DS_FP4_FP8_GROUP != 128
#error "the tile mapping below assumes 128-element groups"
#endif

#define TILE 128
#define CHUNKS (TILE / 8)
#define E4M3_NAN4 (DS_FP4_E4M3_NAN * 0x01010101u)

#ifndef DS_FP4_HOST_EMU
// IEEE float32 division, round to nearest even, subnormals kept (see fmul_rn).
__device__ __forceinline__ float fdiv_rn(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
#endif

// ---- loads ----------------------------------------------------------------------------

// 8 bf16 (16 bytes, element 0 in the lowest half-word) -> 8 exact floats.
__device__ __forceinline__ void bf16x8_to_f32(uint4 q, float* f) {
    const u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        f[2 * j] = u2f(w[j] << 16);
        f[2 * j + 1] = u2f(w[j] & 0xFFFF0000u);
    }
}

// 8 consecutive elements -> 8 exact floats. IN: 0 bf16, 1 fp16, 2 fp32.
template <int IN>
__device__ __forceinline__ void load8(const u8* p, float* f) {
    if (IN == 0) {
        bf16x8_to_f32(ld_u128(p), f);
    } else if (IN == 2) {
        uint4 a = ld_u128(p), b = ld_u128(p + 16);
        f[0] = u2f(a.x); f[1] = u2f(a.y); f[2] = u2f(a.z); f[3] = u2f(a.w);
        f[4] = u2f(b.x); f[5] = u2f(b.y); f[6] = u2f(b.z); f[7] = u2f(b.w);
    } else {
        uint4 q = ld_u128(p);
        u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            f[2 * j] = f16_to_f32((u16)(w[j] & 0xFFFFu));
            f[2 * j + 1] = f16_to_f32((u16)(w[j] >> 16));
        }
    }
}

#if DS_FP4_E2M1_MANT_BITS != 1
#error "the E2M1 decode below assumes one mantissa bit (codes s e1 e0 m)"
#endif

// float32 bits of the E2M1 magnitude code m (0..7), without branches: exponent field
// ef = m >> 1 (0: subnormal, value m * 2^(EMIN - 1)), mantissa bit m & 1.
__device__ __forceinline__ u32 e2m1_mag_bits(u32 m) {
    const u32 ef = m >> DS_FP4_E2M1_MANT_BITS, mf = m & 1u;
    const u32 normal = ((ef + 127u - DS_FP4_E2M1_EXP_BIAS) << 23) |
                       (mf << (23 - DS_FP4_E2M1_MANT_BITS));
    const u32 sub = mf ? (u32)(127 + DS_FP4_E2M1_EMIN - DS_FP4_E2M1_MANT_BITS) << 23 : 0u;
    return ef ? normal : sub;
}

// 8 consecutive MXFP4 elements of a packed row (data bytes, then E8M0 scale bytes at
// row + row_k / 2) starting at element c (c % 8 == 0) -> 8 floats, exactly the values
// dequantize_mxfp4 gives (value(code) * 2^(b-127); NaN for scale byte 255; -0 kept).
__device__ __forceinline__ void load8_mx(const u8* row, u32 row_k, u32 c, float* f) {
    u32 codes = ld_u32(row + c / 2);
    u32 b = row[row_k / 2 + c / DS_FP4_MX_BLOCK];
    float sc = e8m0_to_f32(b);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        u32 code = (codes >> (4 * j)) & 0xFu;
        u32 bits = e2m1_mag_bits(code & 7u) | ((code & DS_FP4_E2M1_SIGN_BIT) << 28);
        f[j] = fmul_rn(u2f(bits), sc);    // exact: a power-of-two scale; the sign rides along
    }
}

// The 64 values a thread holds (rows i = 0..7, columns k = 0..7 of its chunk): as floats, or
// packed two to a register when they are exact bf16 (half the registers, more CTAs per SM).
template <bool PACK>
struct TileVals {
    float f[8][8];
    __device__ __forceinline__ void set(int i, const float* x) {
#pragma unroll
        for (int k = 0; k < 8; ++k) f[i][k] = x[k];
    }
    __device__ __forceinline__ float get(int i, int k) const { return f[i][k]; }
};

template <>
struct TileVals<true> {
    u32 w[8][4];
    __device__ __forceinline__ void set(int i, const float* x) {
#pragma unroll
        for (int j = 0; j < 4; ++j) w[i][j] = (f2u(x[2 * j]) >> 16) | (f2u(x[2 * j + 1]) & 0xFFFF0000u);
    }
    __device__ __forceinline__ float get(int i, int k) const {
        const u32 p = w[i][k >> 1];
        return u2f((k & 1) ? (p & 0xFFFF0000u) : (p << 16));
    }
    // |x| bits of row i's 8 values, two at a time: the halves' maximum as packed bf16 bits
    // (unsigned 16-bit compares order |bf16| bits as the float32 compares of abs_bits do)
    __device__ __forceinline__ u32 row_abs_max2(int i) const {
        u32 a = w[i][0] & BF16X2_ABS;
#pragma unroll
        for (int j = 1; j < 4; ++j) a = __vmaxu2(a, w[i][j] & BF16X2_ABS);
        return a;
    }
    // the same for columns 2j and 2j + 1 over the 8 rows
    __device__ __forceinline__ u32 col_abs_max2(int j) const {
        u32 a = w[0][j] & BF16X2_ABS;
#pragma unroll
        for (int i = 1; i < 8; ++i) a = __vmaxu2(a, w[i][j] & BF16X2_ABS);
        return a;
    }
};

// Packed |bf16| bits (two halves) -> the larger as float32 abs_bits.
__device__ __forceinline__ u32 abs_max2_bits(u32 a) { return max(a << 16, a & 0xFFFF0000u); }

__device__ __forceinline__ float bf16_round(float x) {
    return u2f(f32x2_to_bf16x2(x, 0.0f) << 16);
}

// torch's float sigmoid and silu kernels: 1 / (1 + exp(-x)) and x / (1 + exp(-x))
__device__ __forceinline__ float sigmoid_f32(float x) {
    return fdiv_rn(1.0f, fadd_rn(1.0f, expf(-x)));
}

// ---- E4M3 bytes --------------------------------------------------------------------------

// 8 floats times s -> 8 E4M3 bytes (element 0 in the lowest byte).
__device__ __forceinline__ u64 e4m3x8(float a0, float a1, float a2, float a3, float a4,
                                      float a5, float a6, float a7, float s) {
    u32 lo = f32x2_to_e4m3x2(fmul_rn(a0, s), fmul_rn(a1, s)) |
             (f32x2_to_e4m3x2(fmul_rn(a2, s), fmul_rn(a3, s)) << 16);
    u32 hi = f32x2_to_e4m3x2(fmul_rn(a4, s), fmul_rn(a5, s)) |
             (f32x2_to_e4m3x2(fmul_rn(a6, s), fmul_rn(a7, s)) << 16);
    return (u64)lo | ((u64)hi << 32);
}

__device__ __forceinline__ void st_chunk(u8* p, u64 v) {
    uint2 o;
    o.x = (u32)v;
    o.y = (u32)(v >> 32);
    st_u64(p, o);
}

__device__ __forceinline__ u32 abs_bits(float x) { return f2u(x) & DS_FP4_F32_ABS_MASK; }

// |x| bits compare like |x| (NaN above Inf above every finite value)
__device__ __forceinline__ u32 warp_max(u32 v, int from_mask) {
#pragma unroll
    for (int m = from_mask; m >= 1; m >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, m));
    return v;
}

// ---- transposed store through shared memory ------------------------------------------

// Column k of the thread's chunk (feature cc*8 + k), rows r0..r0+7 as 8 bytes -> smem.
__device__ __forceinline__ void smem_put(u64* tbuf, u32 feature, u32 row_chunk, u64 v) {
    tbuf[feature * CHUNKS + (row_chunk ^ (feature >> 3))] = v;
}

// After a barrier: write the transposed tile, feature f -> out + f * pitch, 128 bytes each
// (row-chunk j = cc of features w*16 + 2*it + (lane >> 4)).
__device__ __forceinline__ void smem_store_transposed(const u64* tbuf, u8* out, i64 pitch) {
    const u32 w = threadIdx.x >> 5, lane = threadIdx.x & 31, cc = lane & 15, hs = lane >> 4;
#pragma unroll
    for (int it = 0; it < 8; ++it) {
        u32 f = w * 16 + 2 * it + hs;
        st_chunk(out + (i64)f * pitch + 8 * cc, tbuf[f * CHUNKS + (cc ^ (f >> 3))]);
    }
}

// ---- 128x128 weight tiles -------------------------------------------------------------
//
// srcs[m]: row-major [rows, cols] weight m (src_pitch elements a row); m = g * per_group + j.
// Tile (tr, tc) = (blockIdx.y, blockIdx.x) of weight m = blockIdx.z. Output element (r, c)
// goes to out + g*out_g + j*out_j + r*out_pitch + c, or + c*out_pitch + r when TRANS;
// the tile's scale to sc + g*sc_g + j*sc_j + tr*sc_r + tc*sc_c (float32 2^e; NaN for a tile
// holding NaN or Inf, whose bytes are then all E4M3 NaN).

#define TILES_ARGS                                                                        \
    const u64* __restrict__ srcs, i64 src_pitch, u32 per_group, u8* __restrict__ out,     \
        i64 out_g, i64 out_j, i64 out_pitch, float* __restrict__ sc, i64 sc_g, i64 sc_j,  \
        i64 sc_r, i64 sc_c

template <int IN, bool TRANS>
__device__ __forceinline__ void tiles_body(TILES_ARGS) {
    __shared__ u32 red[8];
    const u32 w = threadIdx.x >> 5, lane = threadIdx.x & 31, cc = lane & 15, hs = lane >> 4;
    const u32 r0 = w * 16 + hs * 8;
    const u32 m = blockIdx.z, g = m / per_group, j = m - g * per_group;
    const u32 tr = blockIdx.y, tc = blockIdx.x;
    const int es = IN == 2 ? 4 : 2;
    const u8* src = (const u8*)srcs[m] +
                    ((i64)(tr * TILE + r0) * src_pitch + (i64)tc * TILE + 8 * cc) * es;
    float v[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i) load8<IN>(src + (i64)i * src_pitch * es, v[i]);
    u32 amax = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int k = 0; k < 8; ++k) amax = max(amax, abs_bits(v[i][k]));
    amax = warp_max(amax, 16);
    if (lane == 0) red[w] = amax;
    __syncthreads();
#pragma unroll
    for (int q = 0; q < 8; ++q) amax = max(amax, red[q]);
    const bool finite = amax < DS_FP4_F32_EXP_MASK;
    const int e = fp8_exponent(amax);
    const float s = pow2f(-e);
    u8* o = out + (i64)g * out_g + (i64)j * out_j;
    if (!TRANS) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            u64 b = e4m3x8(v[i][0], v[i][1], v[i][2], v[i][3], v[i][4], v[i][5], v[i][6],
                           v[i][7], s);
            if (!finite) b = (u64)E4M3_NAN4 * 0x100000001ull;
            st_chunk(o + (i64)(tr * TILE + r0 + i) * out_pitch + tc * TILE + 8 * cc, b);
        }
    } else {
        __shared__ u64 tbuf[TILE * CHUNKS];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            u64 b = e4m3x8(v[0][k], v[1][k], v[2][k], v[3][k], v[4][k], v[5][k], v[6][k],
                           v[7][k], s);
            if (!finite) b = (u64)E4M3_NAN4 * 0x100000001ull;
            smem_put(tbuf, 8 * cc + k, 2 * w + hs, b);
        }
        __syncthreads();
        smem_store_transposed(tbuf, o + (i64)tc * TILE * out_pitch + tr * TILE, out_pitch);
    }
    if (threadIdx.x == 0)
        sc[(i64)g * sc_g + (i64)j * sc_j + (i64)tr * sc_r + (i64)tc * sc_c] =
            finite ? pow2f(e) : u2f(DS_FP4_F32_NAN_BITS);
}

#define TILES_PASS srcs, src_pitch, per_group, out, out_g, out_j, out_pitch, sc, sc_g, sc_j, \
                   sc_r, sc_c
#define TILES_KERNEL(name, IN, TRANS) \
    extern "C" __global__ void __launch_bounds__(256) name(TILES_ARGS) { \
        tiles_body<IN, TRANS>(TILES_PASS); }

TILES_KERNEL(fp8_tiles_bf16, 0, false)
TILES_KERNEL(fp8_tiles_f16, 1, false)
TILES_KERNEL(fp8_tiles_f32, 2, false)
TILES_KERNEL(fp8_tiles_bf16_t, 0, true)
TILES_KERNEL(fp8_tiles_f16_t, 1, true)
TILES_KERNEL(fp8_tiles_f32_t, 2, true)

// ---- token segments: row-wise and column-wise 1x128 --------------------------------------
//
// Segment s = blockIdx.z holds tokens s*seg_len .. +seg_len of the source; token tile
// t = blockIdx.y (128 tokens; tokens past seg_len are zeros), feature tile blockIdx.x of the
// k_out output features. Sources (MODE):
//   0 plain: x [tokens, k_out] (IN: bf16/fp16/fp32), x_pitch elements a row.
//   1 SwiGLU: h[c] = bf16(silu(z[c]) * z[ffn + c]), k_out = ffn.
//   2 SwiGLU gradient: dz[c] = bf16(dh * up * sig * (1 + gate * (1 - sig))) for c < ffn,
//     bf16(dh * gate * sig) for c = ffn + c' (gate = z[c'], up = z[ffn + c'], sig =
//     sigmoid(gate), dh [tokens, ffn] bf16 with dh_pitch), k_out = 2 ffn.
//   z is bf16 [tokens, 2 ffn] (x_pitch elements a row) or, with ZMX, packed MXFP4 rows of
//   2 ffn elements (x_pitch bytes a row).
// Outputs: ROW: data row_out [tokens, k_out] (token s*seg_len + t), scales float32
//   row_sc [segments, k_out/128, seg_len]; COL: data col_out [segments, k_out, padded],
//   scales col_sc [segments, padded/128, k_out].

#define SEG_ARGS                                                                           \
    const u8* __restrict__ x, i64 x_pitch, const u8* __restrict__ dh, i64 dh_pitch,       \
        u32 ffn, u32 seg_len, u32 k_out, u32 padded, u8* __restrict__ row_out,              \
        float* __restrict__ row_sc, u8* __restrict__ col_out, float* __restrict__ col_sc

// The SwiGLU arithmetic (MODE 1: h, MODE 2: dz) of 8 features from their gate g, up u (not
// read for MODE 2 outside the gate half) and dh d (MODE 2) -> f, rounded to bf16.
template <int MODE>
__device__ __forceinline__ void seg_math(bool gate_half, const float* g, const float* u,
                                         const float* d, float* f) {
    if (MODE == 1) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            float silu = fdiv_rn(g[k], fadd_rn(1.0f, expf(-g[k])));
            f[k] = bf16_round(fmul_rn(silu, u[k]));
        }
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            float sig = sigmoid_f32(g[k]);
            float r;
            if (gate_half) {
                float t = fmul_rn(fmul_rn(d[k], u[k]), sig);
                r = fmul_rn(t, fadd_rn(1.0f, fmul_rn(g[k], fadd_rn(1.0f, -sig))));
            } else {
                r = fmul_rn(fmul_rn(d[k], g[k]), sig);
            }
            f[k] = bf16_round(r);
        }
    }
}

// The 8 source values of token `tok` (< seg_len rows exist) at output feature c.
template <int MODE, int IN, bool ZMX>
__device__ __forceinline__ void seg_values(const u8* x, i64 x_pitch, const u8* dh,
                                           i64 dh_pitch, u32 ffn, i64 tok, u32 c, float* f) {
    if (MODE == 0) {
        const int es = IN == 2 ? 4 : 2;
        load8<IN>(x + (tok * x_pitch + c) * es, f);
        return;
    }
    const bool gate_half = MODE == 1 || c < ffn;
    const u32 cg = gate_half ? c : c - ffn;      // the feature's gate column
    float g[8], u[8], d[8];
    if (ZMX) {
        const u8* row = x + tok * x_pitch;
        load8_mx(row, 2 * ffn, cg, g);
        if (MODE == 1 || gate_half) load8_mx(row, 2 * ffn, ffn + cg, u);
    } else {
        load8<0>(x + (tok * x_pitch + cg) * 2, g);
        if (MODE == 1 || gate_half) load8<0>(x + (tok * x_pitch + ffn + cg) * 2, u);
    }
    if (MODE == 2) load8<0>(dh + (tok * dh_pitch + cg) * 2, d);
    seg_math<MODE>(gate_half, g, u, d, f);
}

// Where a 128x128 tile of the segment quantizers sits: segment, token tile, feature tile.
struct SegTile {
    u32 seg, ty, tx;
};

// Quantize the tile's values v (rows r0..r0+7, columns c..c+7 of this thread) row-wise
// and/or column-wise and store them (all threads of the CTA call it).
template <bool PACK, bool ROW, bool COL, bool PACKED_MAX = false>
__device__ __forceinline__ void seg_store(const TileVals<PACK>& v, SegTile t, u32 seg_len,
                                          u32 k_out, u32 padded, u8* __restrict__ row_out,
                                          float* __restrict__ row_sc, u8* __restrict__ col_out,
                                          float* __restrict__ col_sc) {
    const u32 w = threadIdx.x >> 5, lane = threadIdx.x & 31, cc = lane & 15, hs = lane >> 4;
    const u32 r0 = w * 16 + hs * 8;
    const u32 t0 = t.ty * TILE, c0 = t.tx * TILE, c = c0 + 8 * cc;
    const i64 first = (i64)t.seg * seg_len;      // the segment's first source token
    if (ROW) {
        const u32 groups = k_out / TILE;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            u32 a = 0;
            if constexpr (PACKED_MAX) {
                a = abs_max2_bits(v.row_abs_max2(i));
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k) a = max(a, abs_bits(v.get(i, k)));
            }
            a = warp_max(a, 8);                  // the 16 lanes of this row
            const u32 tok = t0 + r0 + i;
            if (tok < seg_len) {
                const bool finite = a < DS_FP4_F32_EXP_MASK;
                const int e = fp8_exponent(a);
                u64 b = e4m3x8(v.get(i, 0), v.get(i, 1), v.get(i, 2), v.get(i, 3), v.get(i, 4),
                               v.get(i, 5), v.get(i, 6), v.get(i, 7), pow2f(-e));
                if (!finite) b = (u64)E4M3_NAN4 * 0x100000001ull;
                st_chunk(row_out + (first + tok) * k_out + c, b);
                if (cc == 0)
                    row_sc[((i64)t.seg * groups + t.tx) * seg_len + tok] =
                        finite ? pow2f(e) : u2f(DS_FP4_F32_NAN_BITS);
            }
        }
    }
    if (COL) {
        // (a persistent CTA reuses these: the barrier before the next tile's first write
        // comes after every thread's last read of this tile)
        __shared__ u64 tbuf[TILE * CHUNKS];
        __shared__ u32 colmax[8][TILE];
        {
            u32 am[8];
            if constexpr (PACKED_MAX) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    u32 a = v.col_abs_max2(j);
                    a = __vmaxu2(a, __shfl_xor_sync(0xFFFFFFFFu, a, 16));
                    am[2 * j] = a << 16;
                    am[2 * j + 1] = a & 0xFFFF0000u;
                }
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    u32 a = 0;
#pragma unroll
                    for (int i = 0; i < 8; ++i) a = max(a, abs_bits(v.get(i, k)));
                    am[k] = max(a, __shfl_xor_sync(0xFFFFFFFFu, a, 16));
                }
            }
            if (hs == 0)
#pragma unroll
                for (int k = 0; k < 8; ++k) colmax[w][8 * cc + k] = am[k];
        }
        __syncthreads();
        u32 scale_bits[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            u32 a = colmax[0][8 * cc + k];
#pragma unroll
            for (int q = 1; q < 8; ++q) a = max(a, colmax[q][8 * cc + k]);
            const bool finite = a < DS_FP4_F32_EXP_MASK;
            const int e = fp8_exponent(a);
            u64 b = e4m3x8(v.get(0, k), v.get(1, k), v.get(2, k), v.get(3, k), v.get(4, k),
                           v.get(5, k), v.get(6, k), v.get(7, k), pow2f(-e));
            if (!finite) b = (u64)E4M3_NAN4 * 0x100000001ull;
            smem_put(tbuf, 8 * cc + k, 2 * w + hs, b);
            scale_bits[k] = finite ? f2u(pow2f(e)) : DS_FP4_F32_NAN_BITS;
        }
        __syncthreads();
        u8* o = col_out + ((i64)t.seg * k_out + c0) * padded + t0;
        smem_store_transposed(tbuf, o, padded);
        if (w == 0 && hs == 0) {
            float* sp = col_sc + ((i64)t.seg * (padded / TILE) + t.ty) * k_out + c;
#pragma unroll
            for (int k = 0; k < 8; ++k) sp[k] = u2f(scale_bits[k]);
        }
    }
}

// One CTA per tile (blockIdx: feature tile, token tile, segment): load, compute, store.
template <int MODE, int IN, bool ZMX, bool ROW, bool COL>
__device__ __forceinline__ void seg_body(SEG_ARGS) {
    // bf16 inputs and the SwiGLU sources (rounded to bf16) are exact bf16: pack them
    constexpr bool PACK = MODE != 0 || IN == 0;
    const u32 w = threadIdx.x >> 5, lane = threadIdx.x & 31, cc = lane & 15, hs = lane >> 4;
    const u32 r0 = w * 16 + hs * 8;
    const SegTile t = {blockIdx.z, blockIdx.y, blockIdx.x};
    const u32 t0 = t.ty * TILE, c = t.tx * TILE + 8 * cc;
    const i64 first = (i64)t.seg * seg_len;      // the segment's first source token
    TileVals<PACK> v;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float f[8];
        if (t0 + r0 + i < seg_len) {
            seg_values<MODE, IN, ZMX>(x, x_pitch, dh, dh_pitch, ffn, first + t0 + r0 + i, c, f);
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) f[k] = 0.0f;       // padding tokens
        }
        v.set(i, f);
    }
    seg_store<PACK, ROW, COL>(v, t, seg_len, k_out, padded, row_out, row_sc, col_out, col_sc);
}

// ---- persistent, pipelined segment kernels (plain bf16 source) ----------------------------
//
// A grid of a few CTAs per SM walks the tiles (linear index, feature tile fastest) with a
// grid stride. Each CTA keeps the NEXT tile's raw source words in registers: they are
// requested right after the current tile's values are unpacked, and arrive while the
// current tile is quantized and stored, so that DRAM always has loads in flight instead of
// each CTA loading, then computing, then storing. Same math, same bytes as seg_body.

__device__ __forceinline__ SegTile seg_tile_of(u32 tile, u32 nx, u32 ny) {
    const u32 row = tile / nx, seg = row / ny;
    return {seg, row - seg * ny, tile - row * nx};
}

// The thread's 8 raw 16-byte words of tile t (zeros for padding tokens).
__device__ __forceinline__ void seg_load_raw(uint4* raw, SegTile t, const u8* x, i64 x_pitch,
                                             u32 seg_len) {
    const u32 w = threadIdx.x >> 5, lane = threadIdx.x & 31, cc = lane & 15, hs = lane >> 4;
    const u32 r0 = w * 16 + hs * 8, t0 = t.ty * TILE, c = t.tx * TILE + 8 * cc;
    const uint4 zero = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32 tok = t0 + r0 + i;
        raw[i] = zero;
        if (tok < seg_len) raw[i] = ld_u128(x + (((i64)t.seg * seg_len + tok) * x_pitch + c) * 2);
    }
}

template <bool ROW, bool COL>
__device__ __forceinline__ void seg_body_p(SEG_ARGS, u32 segments) {
    const u32 nx = k_out / TILE, ny = padded / TILE, n_tiles = nx * ny * segments;
    u32 tile = blockIdx.x;
    if (tile >= n_tiles) return;
    uint4 raw[8];
    SegTile t = seg_tile_of(tile, nx, ny);
    seg_load_raw(raw, t, x, x_pitch, seg_len);
    for (;;) {
        TileVals<true> v;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float f[8];
            bf16x8_to_f32(raw[i], f);
            v.set(i, f);
        }
        const u32 next = tile + gridDim.x;
        const SegTile tn = seg_tile_of(next, nx, ny);
        if (next < n_tiles) seg_load_raw(raw, tn, x, x_pitch, seg_len);
        seg_store<true, ROW, COL, true>(v, t, seg_len, k_out, padded, row_out, row_sc, col_out,
                                        col_sc);
        if (next >= n_tiles) break;
        tile = next;
        t = tn;
    }
}

#define SEG_PASS x, x_pitch, dh, dh_pitch, ffn, seg_len, k_out, padded, row_out, row_sc, \
                 col_out, col_sc
// Each segment kernel also comes as name_o3: the same code held to 3 CTAs (80 registers) per
// SM, trading a few spills for occupancy; fp8_fused.py times both on first use per shape.
#define SEG_KERNEL(name, MODE, IN, ZMX, ROW, COL) \
    extern "C" __global__ void __launch_bounds__(256) name(SEG_ARGS) { \
        seg_body<MODE, IN, ZMX, ROW, COL>(SEG_PASS); } \
    extern "C" __global__ void __launch_bounds__(256, 3) name##_o3(SEG_ARGS) { \
        seg_body<MODE, IN, ZMX, ROW, COL>(SEG_PASS); }

SEG_KERNEL(fp8_seg_plain_bf16_r, 0, 0, false, true, false)
SEG_KERNEL(fp8_seg_plain_bf16_c, 0, 0, false, false, true)
SEG_KERNEL(fp8_seg_plain_bf16_rc, 0, 0, false, true, true)
SEG_KERNEL(fp8_seg_plain_f16_r, 0, 1, false, true, false)
SEG_KERNEL(fp8_seg_plain_f16_c, 0, 1, false, false, true)
SEG_KERNEL(fp8_seg_plain_f16_rc, 0, 1, false, true, true)
SEG_KERNEL(fp8_seg_plain_f32_r, 0, 2, false, true, false)
SEG_KERNEL(fp8_seg_plain_f32_c, 0, 2, false, false, true)
SEG_KERNEL(fp8_seg_plain_f32_rc, 0, 2, false, true, true)
SEG_KERNEL(fp8_seg_swiglu_bf16_r, 1, 0, false, true, false)
SEG_KERNEL(fp8_seg_swiglu_bf16_c, 1, 0, false, false, true)
SEG_KERNEL(fp8_seg_swiglu_bf16_rc, 1, 0, false, true, true)
SEG_KERNEL(fp8_seg_swiglu_mx_r, 1, 0, true, true, false)
SEG_KERNEL(fp8_seg_swiglu_mx_c, 1, 0, true, false, true)
SEG_KERNEL(fp8_seg_swiglu_mx_rc, 1, 0, true, true, true)
SEG_KERNEL(fp8_seg_swiglu_grad_bf16_r, 2, 0, false, true, false)
SEG_KERNEL(fp8_seg_swiglu_grad_bf16_c, 2, 0, false, false, true)
SEG_KERNEL(fp8_seg_swiglu_grad_bf16_rc, 2, 0, false, true, true)
SEG_KERNEL(fp8_seg_swiglu_grad_mx_r, 2, 0, true, true, false)
SEG_KERNEL(fp8_seg_swiglu_grad_mx_c, 2, 0, true, false, true)
SEG_KERNEL(fp8_seg_swiglu_grad_mx_rc, 2, 0, true, true, true)

// The pipelined variants name_p (2 CTAs per SM, <= 128 registers): the grid is 2 x the SM
// count (at most the tile count), `segments` the number of segments. Only the plain bf16
// source has them: for the SwiGLU sources (arithmetic-bound: exp and an IEEE division per
// element) holding the next tile's gate/up/dh words spilled or halved the CTAs per SM, and
// both measured slower than name_o3 on the H200 (bench/NOTES_experts.md, run 3).
#define SEG_KERNEL_P(name, ROW, COL) \
    extern "C" __global__ void __launch_bounds__(256, 2) name##_p(SEG_ARGS, u32 segments) { \
        seg_body_p<ROW, COL>(SEG_PASS, segments); }

SEG_KERNEL_P(fp8_seg_plain_bf16_r, true, false)
SEG_KERNEL_P(fp8_seg_plain_bf16_c, false, true)
SEG_KERNEL_P(fp8_seg_plain_bf16_rc, true, true)
