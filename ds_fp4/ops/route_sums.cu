// Sums of each token's routed rows (ds_fp4/ops/route_sums.py launches them; the twins are
// there). Route r = j * S + t is token t's j-th choice; it reaches row slots[r] of rows, or
// none (a slot outside [0, row_count): DeepSpeed's scratch slot, read as a zero row).
//   route_sum_<dtype>_w : out[t] = dtype(sum over j in route order of f32(row) * gate[j, t])
//   route_sum_<dtype>   : out[t] = dtype(sum over t's slots in ascending order of f32(row))
// float32 products and adds rounded one by one (RNE, no FMA), the sum rounded once to the
// rows' dtype: the bits of the eager ops (the decode's weighted sum; the encode's backward,
// index_add_'s ascending order on the CPU). A CTA a token: its k slots (and gates) into
// shared memory, sorted for the plain sum; then 8 elements a thread at a time.
#include "common.cuh"

#define RS_MAX_K 32   // route_sums.MAX_K

template <int IN, bool WEIGHTED>
__device__ __forceinline__ void route_sum_cta(
        const u8* __restrict__ rows, i64 row_bytes, i64 row_count, const i64* __restrict__ slots,
        i64 tokens, u32 top_k, const float* __restrict__ gates, i64 gate_route, i64 gate_token,
        i64 m, u8* __restrict__ out, i64 out_row_bytes) {
    __shared__ i64 slot[RS_MAX_K];
    __shared__ float gate[RS_MAX_K];
    const i64 t = blockIdx.x;
    if (threadIdx.x == 0) {
        for (u32 j = 0; j < top_k; ++j) {
            const i64 s = slots[(i64)j * tokens + t];
            u32 i = j;
            if (WEIGHTED) {
                gate[j] = gates[(i64)j * gate_route + t * gate_token];
            } else {           // insertion into ascending order
                for (; i > 0 && slot[i - 1] > s; --i) slot[i] = slot[i - 1];
            }
            slot[i] = s;
        }
    }
    __syncthreads();
    const int elem = IN == 2 ? 4 : 2;
    for (i64 c = threadIdx.x; c < m / 8; c += blockDim.x) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (u32 j = 0; j < top_k; ++j) {
            const i64 s = slot[j];
            float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            if (s >= 0 && s < row_count) load8_as_f32<IN>(rows + s * row_bytes + c * 8 * elem, v);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const float p = WEIGHTED ? fmul_rn(v[k], gate[j]) : v[k];
                acc[k] = j == 0 ? p : fadd_rn(acc[k], p);
            }
        }
        store8_from_f32<IN>(out + t * out_row_bytes + c * 8 * elem, acc);
    }
}

#define RS_ARGS                                                                              \
    const u8* __restrict__ rows, i64 row_bytes, i64 row_count, const i64* __restrict__ slots, \
        i64 tokens, u32 top_k, const float* __restrict__ gates, i64 gate_route,                \
        i64 gate_token, i64 m, u8* __restrict__ out, i64 out_row_bytes
#define RS_PASS rows, row_bytes, row_count, slots, tokens, top_k, gates, gate_route, gate_token, \
                m, out, out_row_bytes
#define RS_KERNEL(name, IN, WEIGHTED) \
    extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) name(RS_ARGS) { \
        route_sum_cta<IN, WEIGHTED>(RS_PASS); }

RS_KERNEL(route_sum_bf16, 0, false)
RS_KERNEL(route_sum_f16, 1, false)
RS_KERNEL(route_sum_f32, 2, false)
RS_KERNEL(route_sum_bf16_w, 0, true)
RS_KERNEL(route_sum_f16_w, 1, true)
RS_KERNEL(route_sum_f32_w, 2, true)
