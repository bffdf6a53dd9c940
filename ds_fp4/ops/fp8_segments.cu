// FP8 1x128 quantization of token-major activations split into segments of seg_len tokens
// (one per local expert), row-wise (groups along features) and/or column-wise (groups along
// tokens, output transposed, each segment zero padded to a multiple of 128 tokens), from one
// read; optionally computing the value on the way in from bf16 z: SwiGLU h = silu(gate) * up,
// or its gradient dz (ds_fp4/ops/fp8_segments.py launches them, fp8_tile.cuh has the thread
// mapping). One CTA per tile, or, for the plain bf16 source, also persistent CTAs that
// prefetch their next tile (name_p; fp8_segments.py times the variants on first use per
// shape). fdiv_rn, like common.cuh's fmul_rn/fadd_rn, keeps subnormals under -ftz=true.
#include "common.cuh"
#include "fp8_tile.cuh"

#ifndef DS_FP4_HOST_EMU
// IEEE float32 division, round to nearest even, subnormals kept (see fmul_rn).
__device__ __forceinline__ float fdiv_rn(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
#endif


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

// torch's float sigmoid and silu kernels: 1 / (1 + exp(-x)) and x / (1 + exp(-x))
__device__ __forceinline__ float sigmoid_f32(float x) {
    return fdiv_rn(1.0f, fadd_rn(1.0f, expf(-x)));
}

// ---- token segments: row-wise and column-wise 1x128 --------------------------------------
//
// Segment s = blockIdx.z holds tokens s*seg_len .. +seg_len of the source; token tile
// t = blockIdx.y (128 tokens; tokens past seg_len are zeros), feature tile blockIdx.x of the
// k_out output features. Sources (MODE):
//   0 plain: x [tokens, k_out] (IN: bf16/fp16/fp32), x_pitch elements a row; or, with
//     index (int64 [segments * seg_len]), token j is x's row index[j], a zero row where that
//     is outside [0, x_rows): the gathered rows are read in place (plain source only);
//     with row_scale (float32 [segments * seg_len]) token j's values are those of its row
//     times row_scale[j], rounded to x's type (the rows a scaled copy would hold).
//   1 SwiGLU: h[c] = bf16(silu(z[c]) * z[ffn + c]), k_out = ffn.
//   2 SwiGLU gradient: dz[c] = bf16(dh * up * sig * (1 + gate * (1 - sig))) for c < ffn,
//     bf16(dh * gate * sig) for c = ffn + c' (gate = z[c'], up = z[ffn + c'], sig =
//     sigmoid(gate), dh [tokens, ffn] bf16 with dh_pitch), k_out = 2 ffn.
//   z is bf16 [tokens, 2 ffn] (x_pitch elements a row).
// Outputs: ROW: data row_out [tokens, k_out] (token s*seg_len + t), scales float32
//   row_sc [segments, k_out/128, seg_len]; COL: data col_out [segments, k_out, padded],
//   scales col_sc [segments, padded/128, k_out].

#define SEG_ARGS                                                                           \
    const u8* __restrict__ x, i64 x_pitch, const u8* __restrict__ dh, i64 dh_pitch,       \
        u32 ffn, u32 seg_len, u32 k_out, u32 padded, u8* __restrict__ row_out,              \
        float* __restrict__ row_sc, u8* __restrict__ col_out, float* __restrict__ col_sc,   \
        const i64* __restrict__ index, i64 x_rows, const float* __restrict__ row_scale

// The SwiGLU arithmetic (MODE 1: h, MODE 2: dz) of 8 features from their gate g, up u (not
// read for MODE 2 outside the gate half) and dh d (MODE 2) -> f, rounded to bf16.
template <int MODE>
__device__ __forceinline__ void seg_math(bool gate_half, const float* g, const float* u,
                                         const float* d, float* f) {
    if (MODE == 1) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            float silu = fdiv_rn(g[k], fadd_rn(1.0f, expf(-g[k])));
            f[k] = as_type<0>(fmul_rn(silu, u[k]));
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
            f[k] = as_type<0>(r);
        }
    }
}

// The 8 source values of token `tok` (< seg_len rows exist) at output feature c.
template <int MODE, int IN>
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
    load8<0>(x + (tok * x_pitch + cg) * 2, g);
    if (MODE == 1 || gate_half) load8<0>(x + (tok * x_pitch + ffn + cg) * 2, u);
    if (MODE == 2) load8<0>(dh + (tok * dh_pitch + cg) * 2, d);
    seg_math<MODE>(gate_half, g, u, d, f);
}

// The 8 plain values of token tok of the segment starting at token `first`, read through
// the index (zeros past seg_len and for zero rows), times row_scale[j] rounded to IN's
// type where row_scale is given. Only the gathering kernels (name_g*) read an index: in the
// other kernels its code cost registers and spills (nvcc -Xptxas -v, sm_90).
template <int IN>
__device__ __forceinline__ void seg_gathered_values(const u8* x, i64 x_pitch,
                                                    const i64* __restrict__ index, i64 x_rows,
                                                    const float* __restrict__ row_scale,
                                                    i64 first, u32 tok, u32 seg_len, u32 c,
                                                    float* f) {
    const i64 src = tok < seg_len ? gathered_row(index, first + tok, x_rows) : -1;
    if (src < 0) {
#pragma unroll
        for (int k = 0; k < 8; ++k) f[k] = 0.0f;
        return;
    }
    seg_values<0, IN>(x, x_pitch, nullptr, 0, 0, src, c, f);
    if (row_scale != nullptr) {
        const float g = row_scale[first + tok];
#pragma unroll
        for (int k = 0; k < 8; ++k) f[k] = as_type<IN>(fmul_rn(f[k], g));
    }
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
template <int MODE, int IN, bool ROW, bool COL, bool GATHER>
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
        if constexpr (GATHER) {
            seg_gathered_values<IN>(x, x_pitch, index, x_rows, row_scale, first, t0 + r0 + i,
                                    seg_len, c, f);
        } else if (t0 + r0 + i < seg_len) {
            seg_values<MODE, IN>(x, x_pitch, dh, dh_pitch, ffn, first + t0 + r0 + i, c, f);
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

// The thread's 8 raw 16-byte words of tile t (zeros for padding tokens and zero rows).
// Returns the rows read: bit i set where row i is a token's row (GATHER: a row the index
// names), so that a zero row stays zero whatever its row_scale (seg_gathered_values' rule).
template <bool GATHER>
__device__ __forceinline__ u32 seg_load_raw(uint4* raw, SegTile t, const u8* x, i64 x_pitch,
                                            u32 seg_len, const i64* __restrict__ index,
                                            i64 x_rows) {
    const u32 w = threadIdx.x >> 5, lane = threadIdx.x & 31, cc = lane & 15, hs = lane >> 4;
    const u32 r0 = w * 16 + hs * 8, t0 = t.ty * TILE, c = t.tx * TILE + 8 * cc;
    const uint4 zero = {0u, 0u, 0u, 0u};
    u32 read = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32 tok = t0 + r0 + i;
        raw[i] = zero;
        if constexpr (GATHER) {
            const i64 src = tok < seg_len ? gathered_row(index, (i64)t.seg * seg_len + tok, x_rows)
                                          : -1;
            if (src >= 0) {
                raw[i] = ld_u128(x + (src * x_pitch + c) * 2);
                read |= 1u << i;
            }
        } else if (tok < seg_len) {
            raw[i] = ld_u128(x + (((i64)t.seg * seg_len + tok) * x_pitch + c) * 2);
        }
    }
    return read;
}

// Row i of this thread in tile t times its row_scale (if given), rounded to bf16; ``read``:
// seg_load_raw's rows read (a zero row is not scaled: 0 x NaN would be NaN).
__device__ __forceinline__ void seg_scale_row(float* f, const float* __restrict__ row_scale,
                                              SegTile t, u32 seg_len, u32 read, int i) {
    const u32 tok = t.ty * TILE + (threadIdx.x >> 5) * 16 + ((threadIdx.x & 31) >> 4) * 8 + i;
    if (row_scale == nullptr || !((read >> i) & 1u)) return;
    const float g = row_scale[(i64)t.seg * seg_len + tok];
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = as_type<0>(fmul_rn(f[k], g));
}

template <bool ROW, bool COL, bool GATHER>
__device__ __forceinline__ void seg_body_p(SEG_ARGS, u32 segments) {
    const u32 nx = k_out / TILE, ny = padded / TILE, n_tiles = nx * ny * segments;
    u32 tile = blockIdx.x;
    if (tile >= n_tiles) return;
    uint4 raw[8];
    SegTile t = seg_tile_of(tile, nx, ny);
    u32 read = seg_load_raw<GATHER>(raw, t, x, x_pitch, seg_len, index, x_rows);
    for (;;) {
        TileVals<true> v;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float f[8];
            bf16x8_to_f32(raw[i], f);
            if constexpr (GATHER) seg_scale_row(f, row_scale, t, seg_len, read, i);
            v.set(i, f);
        }
        const u32 next = tile + gridDim.x;
        const SegTile tn = seg_tile_of(next, nx, ny);
        if (next < n_tiles) read = seg_load_raw<GATHER>(raw, tn, x, x_pitch, seg_len, index, x_rows);
        seg_store<true, ROW, COL, true>(v, t, seg_len, k_out, padded, row_out, row_sc, col_out,
                                        col_sc);
        if (next >= n_tiles) break;
        tile = next;
        t = tn;
    }
}

#define SEG_PASS x, x_pitch, dh, dh_pitch, ffn, seg_len, k_out, padded, row_out, row_sc, \
                 col_out, col_sc, index, x_rows, row_scale
// Each segment kernel also comes as name_o3: the same code held to 3 CTAs (80 registers) per
// SM, trading a few spills for occupancy; fp8_segments.py times both on first use per shape.
#define SEG_KERNEL(name, MODE, IN, ROW, COL, GATHER) \
    extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) name(SEG_ARGS) { \
        seg_body<MODE, IN, ROW, COL, GATHER>(SEG_PASS); } \
    extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK, 3) name##_o3(SEG_ARGS) { \
        seg_body<MODE, IN, ROW, COL, GATHER>(SEG_PASS); }

SEG_KERNEL(fp8_seg_plain_bf16_r, 0, 0, true, false, false)
SEG_KERNEL(fp8_seg_plain_bf16_c, 0, 0, false, true, false)
SEG_KERNEL(fp8_seg_plain_bf16_rc, 0, 0, true, true, false)
SEG_KERNEL(fp8_seg_plain_f16_r, 0, 1, true, false, false)
SEG_KERNEL(fp8_seg_plain_f16_c, 0, 1, false, true, false)
SEG_KERNEL(fp8_seg_plain_f16_rc, 0, 1, true, true, false)
SEG_KERNEL(fp8_seg_plain_f32_r, 0, 2, true, false, false)
SEG_KERNEL(fp8_seg_plain_f32_c, 0, 2, false, true, false)
SEG_KERNEL(fp8_seg_plain_f32_rc, 0, 2, true, true, false)
SEG_KERNEL(fp8_seg_swiglu_bf16_r, 1, 0, true, false, false)
SEG_KERNEL(fp8_seg_swiglu_bf16_c, 1, 0, false, true, false)
SEG_KERNEL(fp8_seg_swiglu_bf16_rc, 1, 0, true, true, false)
SEG_KERNEL(fp8_seg_swiglu_grad_bf16_r, 2, 0, true, false, false)
SEG_KERNEL(fp8_seg_swiglu_grad_bf16_c, 2, 0, false, true, false)
SEG_KERNEL(fp8_seg_swiglu_grad_bf16_rc, 2, 0, true, true, false)
// The plain source's rows read through an index (and scaled): name_g, name_g_o3
SEG_KERNEL(fp8_seg_plain_bf16_r_g, 0, 0, true, false, true)
SEG_KERNEL(fp8_seg_plain_bf16_c_g, 0, 0, false, true, true)
SEG_KERNEL(fp8_seg_plain_bf16_rc_g, 0, 0, true, true, true)
SEG_KERNEL(fp8_seg_plain_f16_r_g, 0, 1, true, false, true)
SEG_KERNEL(fp8_seg_plain_f16_c_g, 0, 1, false, true, true)
SEG_KERNEL(fp8_seg_plain_f16_rc_g, 0, 1, true, true, true)
SEG_KERNEL(fp8_seg_plain_f32_r_g, 0, 2, true, false, true)
SEG_KERNEL(fp8_seg_plain_f32_c_g, 0, 2, false, true, true)
SEG_KERNEL(fp8_seg_plain_f32_rc_g, 0, 2, true, true, true)

// The pipelined variants name_p (2 CTAs per SM, <= 128 registers): the grid is 2 x the SM
// count (at most the tile count), `segments` the number of segments. Only the plain bf16
// source has them: for the SwiGLU sources (arithmetic-bound: exp and an IEEE division per
// element) holding the next tile's gate/up/dh words spilled or halved the CTAs per SM, and
// both measured slower than name_o3 on the H200 (bench/NOTES_experts.md, run 3).
#define SEG_KERNEL_P(name, ROW, COL, GATHER) \
    extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK, 2) \
        name##_p(SEG_ARGS, u32 segments) { seg_body_p<ROW, COL, GATHER>(SEG_PASS, segments); }

SEG_KERNEL_P(fp8_seg_plain_bf16_r, true, false, false)
SEG_KERNEL_P(fp8_seg_plain_bf16_c, false, true, false)
SEG_KERNEL_P(fp8_seg_plain_bf16_rc, true, true, false)
SEG_KERNEL_P(fp8_seg_plain_bf16_r_g, true, false, true)
SEG_KERNEL_P(fp8_seg_plain_bf16_c_g, false, true, true)
SEG_KERNEL_P(fp8_seg_plain_bf16_rc_g, true, true, true)
