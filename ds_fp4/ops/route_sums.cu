// Sums of each token's routed rows (ds_fp4/ops/route_sums.py launches them; the twins are
// there). Route r = j * S + t is token t's j-th choice; it reaches row slots[r] of rows, or
// none (a slot outside [0, row_count): DeepSpeed's scratch slot, read as a zero row).
//   route_sum_<dtype>_w : out[t] = dtype(sum over j in route order of f32(row) * gate[j, t])
//   route_sum_<dtype>   : out[t] = dtype(sum over t's slots in ascending order of f32(row))
// float32 products and adds rounded one by one (RNE, no FMA), the sum rounded once to the
// rows' dtype: the bits of the eager ops (the decode's weighted sum; the encode's backward,
// index_add_'s ascending order on the CPU). A CTA a token: its k slots (and gates) into
// shared memory, sorted for the plain sum; then 8 elements a thread at a time.
//   route_sum_<dtype>_w_fp8 : the weighted sum, and from the same reads each route's row as
//                             a packed FP8 1x128 row (quantize_fp8_rows' bytes; a dropped
//                             route's row zeros), what the decode keeps for the gates' gradient
#include "common.cuh"
#include "fp8_tile.cuh"

#define RS_MAX_K 32   // route_sums.MAX_K

#define RS_ARGS                                                                              \
    const u8* __restrict__ rows, i64 row_bytes, i64 row_count, const i64* __restrict__ slots, \
        i64 tokens, u32 top_k, const float* __restrict__ gates, i64 gate_route,                \
        i64 gate_token, i64 m, u8* __restrict__ out, i64 out_row_bytes
#define RS_PASS rows, row_bytes, row_count, slots, tokens, top_k, gates, gate_route, gate_token, \
                m, out, out_row_bytes

// Token t's k slots (and gates) into shared memory (thread 0), the slots sorted ascending
// for the plain sum.
template <bool WEIGHTED>
__device__ __forceinline__ void load_routes(i64* slot, float* gate, RS_ARGS) {
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
}

template <int IN, bool WEIGHTED>
__device__ __forceinline__ void route_sum_cta(RS_ARGS) {
    __shared__ i64 slot[RS_MAX_K];
    __shared__ float gate[RS_MAX_K];
    const i64 t = blockIdx.x;
    load_routes<WEIGHTED>(slot, gate, RS_PASS);
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

// The weighted sum and the routes' FP8 rows (kept + r * kept_row_bytes: m E4M3 bytes, then
// m/128 E8M0 scales). m % 128 == 0: a 128-group is 16 lanes of one warp, all active or all
// not, and every lane of a warp runs the loop the same number of times (the shuffles).
template <int IN>
__device__ __forceinline__ void route_sum_kept_cta(RS_ARGS, u8* __restrict__ kept,
                                                   i64 kept_row_bytes) {
    __shared__ i64 slot[RS_MAX_K];
    __shared__ float gate[RS_MAX_K];
    const i64 t = blockIdx.x;
    load_routes<true>(slot, gate, RS_PASS);
    const int elem = IN == 2 ? 4 : 2;
    const i64 chunks = m / 8;
    for (i64 base = 0; base < chunks; base += blockDim.x) {
        const i64 c = base + threadIdx.x;
        const bool active = c < chunks;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (u32 j = 0; j < top_k; ++j) {
            const i64 s = slot[j];
            float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            if (active && s >= 0 && s < row_count)
                load8_as_f32<IN>(rows + s * row_bytes + c * 8 * elem, v);
            u32 a = 0;
#pragma unroll
            for (int k = 0; k < 8; ++k) a = max(a, abs_bits(v[k]));
#pragma unroll
            for (int o = 1; o < 16; o <<= 1) a = max(a, __shfl_xor_sync(0xFFFFFFFFu, a, o));
            const bool finite = a < DS_FP4_F32_EXP_MASK;
            const int e = fp8_exponent(a);
            if (active) {
                u8* row = kept + ((i64)j * tokens + t) * kept_row_bytes;
                st_chunk(row + c * 8, finite ? e4m3x8(v[0], v[1], v[2], v[3], v[4], v[5], v[6],
                                                      v[7], pow2f(-e))
                                             : (u64)E4M3_NAN4 * 0x100000001ull);
                if ((c & 15) == 0)
                    row[m + (c >> 4)] = finite ? (u8)(e + DS_FP4_E8M0_BIAS) : (u8)DS_FP4_E8M0_NAN;
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const float p = fmul_rn(v[k], gate[j]);
                acc[k] = j == 0 ? p : fadd_rn(acc[k], p);
            }
        }
        if (active) store8_from_f32<IN>(out + t * out_row_bytes + c * 8 * elem, acc);
    }
}

#define RS_KERNEL(name, IN, WEIGHTED) \
    extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) name(RS_ARGS) { \
        route_sum_cta<IN, WEIGHTED>(RS_PASS); }

RS_KERNEL(route_sum_bf16, 0, false)
RS_KERNEL(route_sum_f16, 1, false)
RS_KERNEL(route_sum_f32, 2, false)
RS_KERNEL(route_sum_bf16_w, 0, true)
RS_KERNEL(route_sum_f16_w, 1, true)
RS_KERNEL(route_sum_f32_w, 2, true)

#define RS_KEPT_KERNEL(name, IN) \
    extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK) name( \
        RS_ARGS, u8* __restrict__ kept, i64 kept_row_bytes) { \
        route_sum_kept_cta<IN>(RS_PASS, kept, kept_row_bytes); }

RS_KEPT_KERNEL(route_sum_bf16_w_fp8, 0)
RS_KEPT_KERNEL(route_sum_f16_w_fp8, 1)
RS_KEPT_KERNEL(route_sum_f32_w_fp8, 2)
