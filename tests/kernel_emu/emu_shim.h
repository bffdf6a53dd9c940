// Host emulation of the CUDA features ds_fp4's kernels use (ds_fp4/ops/*.cu), so the exact
// kernel text compiles with g++ and runs on the CPU (tests/test_kernels_emulated.py,
// tests/test_fp8_tiles.py and tests/test_fp8_segments.py, through loader.py).
// Threads: a kernel that synchronizes (shuffles, __syncthreads) runs on blockDim std::threads
// that walk the grid's CTAs in order, with std::barrier phases for the synchronization and a
// block barrier between CTAs; the others run their threads one after another (a barrier in
// that mode is an error, not a hang). __shared__ variables become statics (one CTA at a
// time). DS_FP4_HOST_EMU makes common.cuh and fp8_segments.cu take their PTX-instruction helpers
// from here: computed exactly (in double precision where float would round twice) and
// rounded once, as the PTX instructions are specified. Build with -ffp-contract=off, so
// that g++ fuses no multiply-add the device code does not.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>
#include <algorithm>
#include <atomic>
#include <stdexcept>

#define DS_FP4_HOST_EMU 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3e { unsigned x = 0, y = 0, z = 0; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
static thread_local dim3e threadIdx, blockIdx;
static dim3e blockDim, gridDim;

static std::barrier<>* g_block_barrier = nullptr;
static thread_local bool g_threaded = false;     // this launch runs real threads

// thrown (and turned into an error for the loader) when a kernel launched without real
// threads reaches a barrier: it would wait forever
struct emu_needs_threads : std::runtime_error {
    emu_needs_threads() : std::runtime_error("kernel synchronizes") {}
};
inline void emu_require_threads() {
    if (!g_threaded) throw emu_needs_threads();
}
static std::vector<std::barrier<>*> g_warp_barriers;
static unsigned g_shfl[1024];

inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
inline float fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float fadd_rn(float a, float b) { volatile float r = a + b; return r; }
// IEEE division is correctly rounded on the host (SSE, no -ffast-math): div.rn.f32
inline float fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
// per 16-bit half, unsigned maximum
inline unsigned __vmaxu2(unsigned a, unsigned b) {
    return std::max(a & 0xFFFFu, b & 0xFFFFu) | std::max(a & 0xFFFF0000u, b & 0xFFFF0000u);
}
// per byte, unsigned maximum
inline unsigned __vmaxu4(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int k = 0; k < 32; k += 8) r |= std::max((a >> k) & 0xFFu, (b >> k) & 0xFFu) << k;
    return r;
}
// the CTA's threads are real threads here: atomics must be atomic
inline unsigned atomicAdd(unsigned* p, unsigned v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline int atomicMax(int* p, int v) {
    int old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED,
                                                   __ATOMIC_RELAXED)) {
    }
    return old;
}
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
    emu_require_threads();
    unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned u; std::memcpy(&u, &v, 4);
    g_shfl[threadIdx.x] = u;
    g_warp_barriers[warp]->arrive_and_wait();
    unsigned o = g_shfl[(warp << 5) | (lane ^ mask)];
    g_warp_barriers[warp]->arrive_and_wait();
    T r; std::memcpy(&r, &o, 4); return r;
}
inline void __syncthreads() {
    emu_require_threads();
    g_block_barrier->arrive_and_wait();
}
// Two tallies used in turn: thread 0 clears one after everyone has read it, and the next
// call that uses it again comes after another barrier, which thread 0 passes only later.
static std::atomic<int> g_sync_count[2];
static thread_local int g_sync_phase = 0;
inline int __syncthreads_count(int pred) {
    emu_require_threads();
    const int ph = g_sync_phase;
    g_sync_phase ^= 1;
    if (pred) g_sync_count[ph].fetch_add(1);
    g_block_barrier->arrive_and_wait();
    const int n = g_sync_count[ph].load();
    g_block_barrier->arrive_and_wait();
    if (threadIdx.x == 0) g_sync_count[ph].store(0);
    return n;
}

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
static double bf16_round(double d) { return round_fmt(d, 8, -126, 3.3895313892515355e38); }
static unsigned short bf16_of_double(double d) {
    if (std::isnan(d)) return 0x7FFF;
    double r = bf16_round(d);
    float f = (float)r;  // exact
    return __float_as_uint(f) >> 16;
}
static double bf16_to_double(unsigned short h) { return __uint_as_float((unsigned)h << 16); }
inline unsigned f32x2_to_bf16x2(float lo, float hi) {
    return bf16_of_double(lo) | ((unsigned)bf16_of_double(hi) << 16);
}
// bf16 of x*y + z with one rounding: the product is exact in double (8 x 8 bits); the sum
// s = RN(p + z) carries its exact error err (two-sum). bf16 rounding of s differs from that
// of p + z only when s is exactly a bf16 tie (a 9-bit value that is no bf16), and then err
// says which way the exact sum lies.
static unsigned short bf16_fma1(double x, double y, double z) {
    double p = x * y, s = p + z;
    double bb = s - p, err = (p - (s - bb)) + (z - bb);
    if (err != 0 && std::isfinite(s) && round_fmt(s, 9, -126, INFINITY) == s &&
        bf16_round(s) != s)
        s = std::nextafter(s, err > 0 ? INFINITY : -INFINITY);
    return bf16_of_double(s);
}
inline unsigned bf16x2_fma(unsigned a, unsigned b, unsigned c) {
    unsigned r = 0;
    for (int h = 0; h < 2; ++h)
        r |= (unsigned)bf16_fma1(bf16_to_double(a >> (16 * h)), bf16_to_double(b >> (16 * h)),
                                 bf16_to_double(c >> (16 * h))) << (16 * h);
    return r;
}
// Apply pick(x, y, a_half, b_half) -> result half to each bf16 half of a and b.
template <class Pick>
inline unsigned bf16x2_each(unsigned a, unsigned b, Pick pick) {
    unsigned r = 0;
    for (int h = 0; h < 2; ++h) {
        unsigned short ah = a >> (16 * h), bh = b >> (16 * h);
        r |= (unsigned)pick(bf16_to_double(ah), bf16_to_double(bh), ah, bh) << (16 * h);
    }
    return r;
}
// max.NaN: NaN if either is NaN
inline unsigned bf16x2_max_nan(unsigned a, unsigned b) {
    return bf16x2_each(a, b, [](double x, double y, unsigned short ah, unsigned short bh) {
        return (std::isnan(x) || std::isnan(y)) ? (unsigned short)0x7FFF : x >= y ? ah : bh;
    });
}
// max / min: the other operand where one is NaN
inline unsigned bf16x2_max(unsigned a, unsigned b) {
    return bf16x2_each(a, b, [](double x, double y, unsigned short ah, unsigned short bh) {
        return std::isnan(x) ? bh : std::isnan(y) ? ah : x >= y ? ah : bh;
    });
}
inline unsigned bf16x2_min(unsigned a, unsigned b) {
    return bf16x2_each(a, b, [](double x, double y, unsigned short ah, unsigned short bh) {
        return std::isnan(x) ? bh : std::isnan(y) ? ah : x <= y ? ah : bh;
    });
}

// Run `kernel` over the grid, CTA after CTA in x-fastest order. With `sync` (the kernel
// synchronizes) blockDim real threads walk the CTAs together (a thread started per CTA would
// cost more than most CTAs' work); the block barrier after each CTA keeps one CTA at a time,
// as the static __shared__ variables need. Returns 0, or 1 when a kernel run without `sync`
// reached a barrier.
static int emu_launch(unsigned gx, unsigned gy, unsigned gz, unsigned bx, bool sync,
                      const std::function<void()>& kernel) {
    blockDim.x = bx; blockDim.y = blockDim.z = 1;
    gridDim.x = gx; gridDim.y = gy; gridDim.z = gz;
    if (!sync) {
        g_threaded = false;
        try {
            for (unsigned z = 0; z < gz; ++z)
                for (unsigned y = 0; y < gy; ++y)
                    for (unsigned x = 0; x < gx; ++x)
                        for (unsigned t = 0; t < bx; ++t) {
                            blockIdx.x = x; blockIdx.y = y; blockIdx.z = z; threadIdx.x = t;
                            kernel();
                        }
        } catch (const emu_needs_threads&) {
            return 1;
        }
        return 0;
    }
    std::barrier<> block_barrier(bx);
    g_block_barrier = &block_barrier;
    std::vector<std::barrier<>*> warps;
    for (unsigned w = 0; w < (bx + 31) / 32; ++w) warps.push_back(new std::barrier<>(32));
    g_warp_barriers = warps;
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < bx; ++t)
        ts.emplace_back([=, &kernel, &block_barrier] {
            g_threaded = true;
            threadIdx.x = t;
            for (unsigned z = 0; z < gz; ++z)
                for (unsigned y = 0; y < gy; ++y)
                    for (unsigned x = 0; x < gx; ++x) {
                        blockIdx.x = x; blockIdx.y = y; blockIdx.z = z;
                        kernel();
                        block_barrier.arrive_and_wait();     // the CTA is done everywhere
                    }
        });
    for (auto& th : ts) th.join();
    for (auto* w : warps) delete w;
    return 0;
}
