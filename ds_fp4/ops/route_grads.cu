// The MoE decode's backward in one pass (ds_fp4/ops/route_grads.py launches it; the twin is
// route_grads_ref there). Route r = j * S + t is token t's j-th choice; it went to slot
// slots[r], or was dropped (a slot outside [0, slot_count): DeepSpeed's scratch slot).
//   d_slots[slots[r]] = dtype(float32(dy[t]) * gate[r])  (DeepSpeed's restore kernel's bits)
//   d_gates[r]        = float32 sum over m of dy[t, m] * kept[r, m]  (kept: zeros if dropped)
//   d_slots[s]        = 0 where no route reaches slot s
// The kept route outputs are packed FP8 rows (dequantized as ops.dequantize_fp8_rows to dy's
// dtype does) or rows of dy's dtype, or absent (no gate gradient). CTAs [0, S) take a token
// each (its dy row read once, from L1 for its k routes); CTAs [S, S + slot_count) a slot
// each, zeroing it if inverse[s] (route_grads_invert) says no route reaches it.
#include "common.cuh"

// inverse[slots[r]] = r for the routes that reach a slot (inverse starts as -1).
extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK)
route_grads_invert(const i64* __restrict__ slots, i64 routes, i64 slot_count,
                   int* __restrict__ inverse) {
    i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= routes) return;
    i64 s = slots[r];
    if (s >= 0 && s < slot_count) inverse[s] = (int)r;
}

// 8 values of a kept route row at chunk c (KEPT 1: packed FP8 row of m + m/128 bytes;
// KEPT 2: a row of dy's type)
template <int IN, int KEPT>
__device__ __forceinline__ void load_kept8(const u8* row, i64 m, u32 c, float (&v)[8]) {
    if (KEPT == 1) {
        e4m3x8_scaled(ld_u64(row + 8 * (i64)c), e8m0_to_f32(row[m + (c >> 4)]), v);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = as_type<IN>(v[k]);
    } else {
        load8_as_f32<IN>(row + (i64)c * 8 * (IN == 2 ? 4 : 2), v);
    }
}

// Sum of one float per thread of the CTA, lanes then warps in order; thread 0 gets it.
__device__ __forceinline__ float cta_sum(float v, float* warp_sums) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v = fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = 0.0f;
    if (threadIdx.x == 0)
        for (u32 w = 0; w < blockDim.x / 32; ++w) total = fadd_rn(total, warp_sums[w]);
    __syncthreads();   // warp_sums is written again by the next call
    return total;
}

#define RG_ARGS                                                                             \
    const u8* __restrict__ grad, i64 grad_row_bytes, i64 tokens, u32 top_k,                  \
        const i64* __restrict__ slots, i64 slot_count, const int* __restrict__ inverse,      \
        const float* __restrict__ gates, i64 gate_route, i64 gate_token,                     \
        const u8* __restrict__ kept, i64 kept_row_bytes, i64 m, u8* __restrict__ d_slots,    \
        i64 d_row_bytes, float* __restrict__ d_gates, float* __restrict__ slot_gates

// IN: dy's type (0 bf16, 1 fp16, 2 fp32); KEPT: 0 none, 1 FP8 rows, 2 rows of dy's type.
// d_slots null: no slot rows (and no slot CTAs launched); slot_gates (or null): each used
// slot's gate, for a consumer that scales dy's rows itself (route_gate_grads).
template <int IN, int KEPT>
__device__ __forceinline__ void route_grads_cta(RG_ARGS) {
    __shared__ float warp_sums[DS_FP4_BLOCK / 32];
    const int elem = IN == 2 ? 4 : 2;
    const u32 chunks = (u32)(m / 8);
    const i64 b = blockIdx.x;
    if (b >= tokens) {                                  // a slot CTA: zeros if unused
        i64 s = b - tokens;
        if (inverse[s] >= 0) return;
        float zero[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (u32 c = threadIdx.x; c < chunks; c += blockDim.x)
            store8_from_f32<IN>(d_slots + s * d_row_bytes + (i64)c * 8 * elem, zero);
        return;
    }
    const u8* dy = grad + b * grad_row_bytes;
    for (u32 j = 0; j < top_k; ++j) {                   // every branch below is CTA-uniform
        const i64 r = (i64)j * tokens + b;
        const i64 s = slots[r];
        const bool used = s >= 0 && s < slot_count;
        if (!used && KEPT == 0) continue;
        const float gate = gates[(i64)j * gate_route + b * gate_token];
        if (used && slot_gates != nullptr && threadIdx.x == 0) slot_gates[s] = gate;
        if (d_slots == nullptr && KEPT == 0) continue;
        float dot = 0.0f;
        for (u32 c = threadIdx.x; c < chunks; c += blockDim.x) {
            float g[8], v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            load8_as_f32<IN>(dy + (i64)c * 8 * elem, g);
            if (used && d_slots != nullptr) {
                float o[8];
#pragma unroll
                for (int k = 0; k < 8; ++k) o[k] = fmul_rn(g[k], gate);
                store8_from_f32<IN>(d_slots + s * d_row_bytes + (i64)c * 8 * elem, o);
            }
            if (KEPT != 0) {
                if (used) load_kept8<IN, KEPT>(kept + r * kept_row_bytes, m, c, v);
#pragma unroll
                for (int k = 0; k < 8; ++k) dot = fadd_rn(dot, fmul_rn(g[k], v[k]));
            }
        }
        if (KEPT != 0) {
            float total = cta_sum(dot, warp_sums);
            if (threadIdx.x == 0) d_gates[r] = total;
        }
    }
}

#define RG_PASS grad, grad_row_bytes, tokens, top_k, slots, slot_count, inverse, gates,     \
                gate_route, gate_token, kept, kept_row_bytes, m, d_slots, d_row_bytes, d_gates, \
                slot_gates
#define RG_KERNEL(name, IN, KEPT) \
    extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) name(RG_ARGS) { \
        route_grads_cta<IN, KEPT>(RG_PASS); }

RG_KERNEL(route_grads_bf16, 0, 0)
RG_KERNEL(route_grads_f16, 1, 0)
RG_KERNEL(route_grads_f32, 2, 0)
RG_KERNEL(route_grads_bf16_fp8, 0, 1)
RG_KERNEL(route_grads_f16_fp8, 1, 1)
RG_KERNEL(route_grads_f32_fp8, 2, 1)
RG_KERNEL(route_grads_bf16_rows, 0, 2)
RG_KERNEL(route_grads_f16_rows, 1, 2)
RG_KERNEL(route_grads_f32_rows, 2, 2)
