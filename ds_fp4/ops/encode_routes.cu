// The MoE encode from the gate's sparse routes in two launches (ds_fp4/ops/encode_routes.py
// launches them; its twin is DeepSpeed's _route_slots + _sparse_encode). Route r = j * S + t
// is token t's j-th choice: expert indices[r] (-1: dropped), arrival order locations[r].
//   slots[r]       = e * C + loc for a kept route, E * C (DeepSpeed's scratch slot) otherwise
//   source[s]      = the token t of the route in slot s, -1 where none is
//   out[e * C + c] = tokens[t] of the route in that slot, zeros where none is
//   used[e]        = 1 + the largest location of expert e's kept routes (0 if none)
// Without the rows (route_map), a one-CTA launch writes used instead of the gather.
// A route is kept when 0 <= e < E and 0 <= loc < C (DeepSpeed's gates give nothing else:
// anything else is dropped here, never written out of bounds).
#include "common.cuh"

// Per route: its slot; the slot's source token (source[] starts as -1) and the expert's
// largest location (last[] starts as -1). source and last share one buffer filled with -1.
extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK)
encode_routes_map(const int* __restrict__ indices, const int* __restrict__ locations,
                  i64 routes, i64 tokens, i64 experts, i64 capacity, i64* __restrict__ slots,
                  i64* __restrict__ source, int* __restrict__ last) {
    i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= routes) return;
    int e = indices[r], loc = locations[r];
    bool kept = e >= 0 && e < experts && loc >= 0 && loc < capacity;
    i64 s = kept ? (i64)e * capacity + loc : experts * capacity;
    slots[r] = s;
    if (!kept) return;
    source[s] = r % tokens;
    atomicMax(last + e, loc);
}

// used[] from last[] (one CTA).
__device__ __forceinline__ void write_used(const int* __restrict__ last, i64 experts,
                                           i64* __restrict__ used) {
    for (i64 e = threadIdx.x; e < experts; e += blockDim.x) used[e] = (i64)last[e] + 1;
}

extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK)
encode_routes_used(const int* __restrict__ last, i64 experts, i64* __restrict__ used) {
    write_used(last, experts, used);
}

// CTAs [0, slot_count): slot row s, 16 bytes a thread at a time, from its source token or
// zeros (row_bytes % 16 == 0, rows 16-byte aligned). CTA slot_count: used[] from last[].
extern "C" __global__ void __launch_bounds__(DS_FP4_BLOCK)
encode_routes_gather(const u8* __restrict__ x, i64 x_row_bytes, const i64* __restrict__ source,
                     i64 slot_count, i64 row_bytes, u8* __restrict__ out,
                     const int* __restrict__ last, i64 experts, i64* __restrict__ used) {
    const i64 s = blockIdx.x;
    if (s == slot_count) {
        write_used(last, experts, used);
        return;
    }
    const i64 src = source[s];
    u8* dst = out + s * row_bytes;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (i64 c = (i64)threadIdx.x * 16; c < row_bytes; c += (i64)blockDim.x * 16)
        *(uint4*)(dst + c) = src >= 0 ? *(const uint4*)(x + src * x_row_bytes + c) : zero;
}
