// The 128x128-tile thread mapping shared by fp8_tiles.cu and fp8_segments.cu (the FP8
// experts' quantizers; the loader inlines this file after common.cuh).
//
// CTAs of DS_FP4_BLOCK = 256 threads and 128x128 tiles. Warp w, lane l: column chunk
// cc = l & 15 (8 elements) of the tile rows r0 + i, r0 = 16 w + 8 (l >> 4), i = 0..7; a
// warp's load instruction reads two whole 256-byte rows. Transposed outputs pass through shared memory
// as 8-byte chunks (8 tokens of one feature) whose chunk index is XOR-swizzled by the
// feature's 8-group, so that both the writes and the row-wise reads are free of bank
// conflicts. Values are multiplied by the power-of-two 2^-e in float32 (exact) and converted
// by f32x2_to_e4m3x2, as fp8_quant.cu does, so the bytes equal quantize_fp8's. Float
// arithmetic goes through common.cuh's PTX fmul_rn/fadd_rn: CuPy compiles with -ftz=true,
// which would flush subnormals in plain C arithmetic.

#if DS_FP4_FP8_GROUP != 128 || DS_FP4_BLOCK != 256
#error "the tile mapping below assumes 128-element groups and 8 warps a CTA"
#endif

#define TILE DS_FP4_FP8_GROUP
#define CHUNKS (TILE / 8)
#define E4M3_NAN4 (DS_FP4_E4M3_NAN * 0x01010101u)

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
