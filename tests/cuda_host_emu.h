// Host emulation of the few CUDA features ds_fp4's kernels use, so that a kernel source can
// be compiled with g++ and run on the CPU (tests/test_fp8_fused.py). Each CTA runs as 256
// std::threads; __syncthreads and warp shuffles are std::barrier phases; __shared__
// variables become statics (CTAs run one after another). Compile with -ffp-contract=off,
// -DDS_FP4_HOST_EMU (common.cuh then takes the PTX helpers from here) and
// -DDS_FP4_SOFT_CVT (the portable E4M3 conversions).
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct emu_dim3 { unsigned x, y, z; };

inline thread_local emu_dim3 threadIdx, blockIdx;
inline emu_dim3 blockDim{256, 1, 1};
inline emu_dim3 gridDim{1, 1, 1};

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__

template <class T> inline T max(T a, T b) { return a > b ? a : b; }
template <class T> inline T min(T a, T b) { return a < b ? a : b; }

inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
inline unsigned __vmaxu2(unsigned a, unsigned b) {      // per 16-bit half, unsigned
    return max(a & 0xFFFFu, b & 0xFFFFu) | max(a & 0xFFFF0000u, b & 0xFFFF0000u);
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline int __float2int_rn(float x) { return (int)std::nearbyint(x); }
inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {
    unsigned char bytes[8];
    std::memcpy(bytes, &a, 4);
    std::memcpy(bytes + 4, &b, 4);
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)bytes[(s >> (4 * i)) & 7] << (8 * i);
    return r;
}

// ---- CTA synchronization ----------------------------------------------------------------

inline std::barrier<>* emu_cta_barrier = nullptr;
inline std::barrier<>* emu_warp_barrier[8] = {};
inline unsigned emu_slots[8][32];

inline void __syncthreads() { emu_cta_barrier->arrive_and_wait(); }

inline unsigned __shfl_xor_sync(unsigned, unsigned v, int m) {
    const unsigned w = threadIdx.x >> 5, l = threadIdx.x & 31;
    emu_slots[w][l] = v;
    emu_warp_barrier[w]->arrive_and_wait();
    unsigned r = emu_slots[w][l ^ (unsigned)m];
    emu_warp_barrier[w]->arrive_and_wait();
    return r;
}

// Run `body()` as a grid of 256-thread CTAs, one CTA at a time.
template <class F>
inline void emu_launch(unsigned gx, unsigned gy, unsigned gz, F body) {
    std::barrier<> cta(256);
    std::vector<std::barrier<>*> warps;
    for (int w = 0; w < 8; ++w) warps.push_back(new std::barrier<>(32));
    emu_cta_barrier = &cta;
    for (int w = 0; w < 8; ++w) emu_warp_barrier[w] = warps[w];
    gridDim = {gx, gy, gz};
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                std::vector<std::thread> threads;
                for (unsigned t = 0; t < 256; ++t)
                    threads.emplace_back([=] {
                        threadIdx = {t, 0, 0};
                        blockIdx = {x, y, z};
                        body();
                    });
                for (auto& th : threads) th.join();
            }
    for (auto* w : warps) delete w;
}

// ---- the PTX helpers common.cuh leaves to a host emulation --------------------------------

inline float fmul_rn(float a, float b) { return a * b; }
inline float fadd_rn(float a, float b) { return a + b; }
inline float fdiv_rn(float a, float b) { return a / b; }

typedef unsigned short u16_emu;

inline float f16_to_f32(u16_emu h) { _Float16 v; std::memcpy(&v, &h, 2); return (float)v; }
inline u16_emu f32_to_f16(float f) { _Float16 v = (_Float16)f; u16_emu h; std::memcpy(&h, &v, 2); return h; }

inline unsigned emu_bf16_rne(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
inline unsigned f32x2_to_bf16x2(float lo, float hi) { return emu_bf16_rne(lo) | (emu_bf16_rne(hi) << 16); }

inline float emu_bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
inline float emu_bf16_hi(unsigned w) { return __uint_as_float(w & 0xFFFF0000u); }
inline unsigned bf16x2_fma(unsigned a, unsigned b, unsigned c) {
    return f32x2_to_bf16x2(std::fma(emu_bf16_lo(a), emu_bf16_lo(b), emu_bf16_lo(c)),
                           std::fma(emu_bf16_hi(a), emu_bf16_hi(b), emu_bf16_hi(c)));
}
inline unsigned emu_bf16x2_pick(unsigned a, unsigned b, bool want_max, bool nan_wins) {
    unsigned r = 0;
    for (int h = 0; h < 2; ++h) {
        unsigned x = (a >> (16 * h)) & 0xFFFFu, y = (b >> (16 * h)) & 0xFFFFu;
        float fx = __uint_as_float(x << 16), fy = __uint_as_float(y << 16);
        unsigned o;
        if (std::isnan(fx) || std::isnan(fy))
            o = nan_wins ? 0x7FFFu : (std::isnan(fx) ? y : x);
        else
            o = ((fx > fy) == want_max) ? x : y;
        r |= o << (16 * h);
    }
    return r;
}
inline unsigned bf16x2_max_nan(unsigned a, unsigned b) { return emu_bf16x2_pick(a, b, true, true); }
inline unsigned bf16x2_max(unsigned a, unsigned b) { return emu_bf16x2_pick(a, b, true, false); }
inline unsigned bf16x2_min(unsigned a, unsigned b) { return emu_bf16x2_pick(a, b, false, false); }
inline unsigned prmt_sign(unsigned a, unsigned b, unsigned s) {
    unsigned char bytes[8];
    std::memcpy(bytes, &a, 4);
    std::memcpy(bytes + 4, &b, 4);
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) {
        unsigned sel = (s >> (4 * i)) & 0xF;
        unsigned char v = bytes[sel & 7];
        if (sel & 8) v = (v & 0x80) ? 0xFF : 0x00;
        r |= (unsigned)v << (8 * i);
    }
    return r;
}
