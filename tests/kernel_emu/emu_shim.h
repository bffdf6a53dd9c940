// Host emulation of the CUDA features ds_fp4/ops/*.cu use, so the exact kernel text compiles
// with g++ and runs on the CPU (tests/test_kernels_emulated.py, through loader.py).
// Threads: a kernel that synchronizes (shuffles, __syncthreads) runs each CTA as blockDim
// std::threads with std::barrier phases; the others run their threads one after another.
// __shared__ variables become statics (one CTA at a time). DS_FP4_HOST_EMU makes common.cuh
// take its PTX-instruction helpers from here: they are computed exactly in double precision
// and rounded once, as the PTX instructions are specified.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>
#include <algorithm>

#define DS_FP4_HOST_EMU 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3e { unsigned x = 0, y = 0, z = 0; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
static thread_local dim3e threadIdx, blockIdx;
static dim3e blockDim, gridDim;

static std::barrier<>* g_block_barrier = nullptr;
static std::vector<std::barrier<>*> g_warp_barriers;
static unsigned g_shfl[1024];

inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
inline float fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }

static unsigned prmt_impl(unsigned a, unsigned b, unsigned sel, bool sign_mode) {
    unsigned long long v = ((unsigned long long)b << 32) | a;
    unsigned r = 0;
    for (int n = 0; n < 4; ++n) {
        unsigned s = (sel >> (4 * n)) & 0xF;
        unsigned byte = (v >> (8 * (s & 7))) & 0xFF;
        if (sign_mode && (s & 8)) byte = (byte & 0x80) ? 0xFF : 0x00;
        r |= byte << (8 * n);
    }
    return r;
}
inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {
    return prmt_impl(a, b, s, false);
}
inline unsigned prmt_sign(unsigned a, unsigned b, unsigned s) { return prmt_impl(a, b, s, true); }

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
    unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned u; std::memcpy(&u, &v, 4);
    g_shfl[threadIdx.x] = u;
    g_warp_barriers[warp]->arrive_and_wait();
    unsigned o = g_shfl[(warp << 5) | (lane ^ mask)];
    g_warp_barriers[warp]->arrive_and_wait();
    T r; std::memcpy(&r, &o, 4); return r;
}
inline void __syncthreads() { g_block_barrier->arrive_and_wait(); }

// ---- the PTX-instruction functions of common.cuh -------------------------------------
inline float f16_to_f32(unsigned short h) {
    unsigned s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float f;
    if (e == 0) f = std::ldexp((float)m, -24);
    else if (e == 31) f = m ? NAN : INFINITY;
    else f = std::ldexp((float)(m | 1024), (int)e - 25);
    return s ? -f : f;
}
// round a double (exactly representable result of an exact op) to nearest-even with
// `bits` significant bits, min exponent emin (subnormal quantum 2^(emin-bits+1)), max finite
static double round_fmt(double d, int bits, int emin, double maxf) {
    if (std::isnan(d) || std::isinf(d) || d == 0) return d;
    int e; std::frexp(d, &e); e -= 1;                    // d = 1.x * 2^e
    int q = std::max(e, emin) - (bits - 1);
    double r = std::nearbyint(std::ldexp(d, -q));
    r = std::ldexp(r, q);
    if (std::fabs(r) > maxf) r = std::copysign(INFINITY, d);
    return r;
}
inline unsigned short f32_to_f16(float f) {
    if (std::isnan(f)) return 0x7FFF;
    double r = round_fmt(f, 11, -14, 65504.0);
    unsigned s = std::signbit(r) ? 0x8000 : 0;
    double a = std::fabs(r);
    if (std::isinf(a)) return s | 0x7C00;
    if (a == 0) return s;
    int e; std::frexp(a, &e); e -= 1;
    if (e < -14) return s | (unsigned)std::ldexp(a, 24);
    unsigned m = (unsigned)(std::ldexp(a, -e) * 1024) - 1024;
    return s | ((e + 15) << 10) | m;
}
static unsigned short bf16_of_double(double d) {
    if (std::isnan(d)) return 0x7FFF;
    double r = round_fmt(d, 8, -126, 3.3895313892515355e38);
    float f = (float)r;  // exact
    return __float_as_uint(f) >> 16;
}
static double bf16_to_double(unsigned short h) { return __uint_as_float((unsigned)h << 16); }
inline unsigned f32x2_to_bf16x2(float lo, float hi) {
    return bf16_of_double(lo) | ((unsigned)bf16_of_double(hi) << 16);
}
inline unsigned bf16x2_fma(unsigned a, unsigned b, unsigned c) {
    unsigned r = 0;
    for (int h = 0; h < 2; ++h) {
        double x = bf16_to_double(a >> (16 * h)), y = bf16_to_double(b >> (16 * h)),
               z = bf16_to_double(c >> (16 * h));
        double p = x * y;  // exact (8 x 8 bits)
        double s = p + z;  // exact for the kernels' uses (p or z dominant, few bits)
        r |= (unsigned)bf16_of_double(s) << (16 * h);
    }
    return r;
}
inline unsigned bf16x2_max_nan(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int h = 0; h < 2; ++h) {
        double x = bf16_to_double(a >> (16 * h)), y = bf16_to_double(b >> (16 * h));
        unsigned short o = (std::isnan(x) || std::isnan(y)) ? 0x7FFF
                           : (unsigned short)((x >= y ? a : b) >> (16 * h));
        r |= (unsigned)o << (16 * h);
    }
    return r;
}
inline unsigned bf16x2_max(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int h = 0; h < 2; ++h) {
        double x = bf16_to_double(a >> (16 * h)), y = bf16_to_double(b >> (16 * h));
        unsigned short o = std::isnan(x) ? (unsigned short)(b >> (16 * h))
                           : std::isnan(y) ? (unsigned short)(a >> (16 * h))
                           : (unsigned short)((x >= y ? a : b) >> (16 * h));
        r |= (unsigned)o << (16 * h);
    }
    return r;
}

inline unsigned bf16x2_min(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int h = 0; h < 2; ++h) {
        double x = bf16_to_double(a >> (16 * h)), y = bf16_to_double(b >> (16 * h));
        unsigned short o = std::isnan(x) ? (unsigned short)(b >> (16 * h))
                           : std::isnan(y) ? (unsigned short)(a >> (16 * h))
                           : (unsigned short)((x <= y ? a : b) >> (16 * h));
        r |= (unsigned)o << (16 * h);
    }
    return r;
}

// Run `kernel` over the grid, CTA after CTA; real threads only when `sync` (the kernel
// synchronizes): a sequential thread would wait at a barrier forever.
static void emu_launch(unsigned gx, unsigned gy, unsigned bx, bool sync,
                       const std::function<void()>& kernel) {
    blockDim.x = bx; blockDim.y = blockDim.z = 1;
    gridDim.x = gx; gridDim.y = gy; gridDim.z = 1;
    std::barrier<> block_barrier(bx);
    g_block_barrier = &block_barrier;
    std::vector<std::barrier<>*> warps;
    for (unsigned w = 0; w < (bx + 31) / 32; ++w) warps.push_back(new std::barrier<>(32));
    g_warp_barriers = warps;
    for (unsigned y = 0; y < gy; ++y)
        for (unsigned x = 0; x < gx; ++x) {
            if (!sync) {
                for (unsigned t = 0; t < bx; ++t) {
                    blockIdx.x = x; blockIdx.y = y; threadIdx.x = t;
                    kernel();
                }
                continue;
            }
            std::vector<std::thread> ts;
            for (unsigned t = 0; t < bx; ++t)
                ts.emplace_back([=, &kernel] {
                    blockIdx.x = x; blockIdx.y = y; threadIdx.x = t;
                    kernel();
                });
            for (auto& th : ts) th.join();
        }
    for (auto* w : warps) delete w;
}
