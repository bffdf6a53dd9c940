// FP8 128x128 weight tiles (FORMATS.md power-of-two scales) of many same-shape weights in
// one launch, written as-is or transposed; one read of each weight (ds_fp4/ops/fp8_tiles.py
// launches them, fp8_tile.cuh has the thread mapping). One CTA per tile.
#include "common.cuh"
#include "fp8_tile.cuh"

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
    extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) name(TILES_ARGS) { \
        tiles_body<IN, TRANS>(TILES_PASS); }

TILES_KERNEL(fp8_tiles_bf16, 0, false)
TILES_KERNEL(fp8_tiles_f16, 1, false)
TILES_KERNEL(fp8_tiles_f32, 2, false)
TILES_KERNEL(fp8_tiles_bf16_t, 0, true)
TILES_KERNEL(fp8_tiles_f16_t, 1, true)
TILES_KERNEL(fp8_tiles_f32_t, 2, true)
