// The head-parallel layer's output collective peer to peer over NVLink (--comm p2p, tpattn/peer.py).
//
// Every rank's partial output [R, D] and an inbox [R, D] live in torch symmetric memory, so each
// rank holds device pointers to every other rank's copies. Rank r owns the rows [row0, row0 + rows):
// it sums those rows of every rank's partial in fp32 (ranks in order 0..W-1, the same order on
// every rank), adds the bias when there is one, rounds once to the output dtype and writes the rows
// into its own output and into every other rank's inbox: the reduce-scatter and the all-gather in
// one pass, with the partials read and the output written once each. Ordering (GPU barriers before
// and after) is the caller's.
//
// ptrs: 2W device pointers (as 64-bit integers): every rank's partial, then every rank's inbox (this
// rank's own inbox entry is not used: its rows go to `out`). bias: 0 for none.
// Indices are 64-bit throughout. vec (D % 4 == 0 and 16-byte aligned rows): 4 elements per access.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long i64;

template <typename T> struct Vec;
template <> struct Vec<float> {
    static __device__ __forceinline__ float4 load(const float* p) { return *reinterpret_cast<const float4*>(p); }
    static __device__ __forceinline__ void store(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
    static __device__ __forceinline__ float get(const float* p) { return *p; }
    static __device__ __forceinline__ void put(float* p, float v) { *p = v; }
};
// the 16-bit types: 4 elements as two pairs, converted through the overloads below
__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ void from_floats(float a, float b, __half2* out) { *out = __floats2half2_rn(a, b); }
__device__ __forceinline__ void from_floats(float a, float b, __nv_bfloat162* out) { *out = __floats2bfloat162_rn(a, b); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void from_float(float v, __half* out) { *out = __float2half_rn(v); }
__device__ __forceinline__ void from_float(float v, __nv_bfloat16* out) { *out = __float2bfloat16_rn(v); }

template <typename T, typename T2> struct Vec16 {
    static __device__ __forceinline__ float4 load(const T* p) {
        uint2 u = *reinterpret_cast<const uint2*>(p);
        float2 a = to_float2(*reinterpret_cast<T2*>(&u.x)), b = to_float2(*reinterpret_cast<T2*>(&u.y));
        return make_float4(a.x, a.y, b.x, b.y);
    }
    static __device__ __forceinline__ void store(T* p, float4 v) {
        uint2 u;
        from_floats(v.x, v.y, reinterpret_cast<T2*>(&u.x));
        from_floats(v.z, v.w, reinterpret_cast<T2*>(&u.y));
        *reinterpret_cast<uint2*>(p) = u;
    }
    static __device__ __forceinline__ float get(const T* p) { return to_float(*p); }
    static __device__ __forceinline__ void put(T* p, float v) { from_float(v, p); }
};
template <> struct Vec<__half> : Vec16<__half, __half2> {};
template <> struct Vec<__nv_bfloat16> : Vec16<__nv_bfloat16, __nv_bfloat162> {};

template <typename P, typename O>
__device__ void peer_sum(const i64* __restrict__ ptrs, O* __restrict__ out, const O* __restrict__ bias, int world,
                         int rank, i64 row0, i64 rows, i64 dim, int vec) {
    const i64 base = row0 * dim;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec) {
        const i64 n4 = rows * dim / 4;
        for (i64 i = t; i < n4; i += stride) {
            const i64 at = base + 4 * i;
            float4 s = Vec<P>::load(reinterpret_cast<const P*>(ptrs[0]) + at);
            for (int w = 1; w < world; ++w) {
                float4 v = Vec<P>::load(reinterpret_cast<const P*>(ptrs[w]) + at);
                s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
            }
            if (bias) {
                float4 b = Vec<O>::load(bias + (4 * i) % dim);
                s.x += b.x; s.y += b.y; s.z += b.z; s.w += b.w;
            }
            Vec<O>::store(out + at, s);
            for (int w = 0; w < world; ++w)
                if (w != rank) Vec<O>::store(reinterpret_cast<O*>(ptrs[world + w]) + at, s);
        }
    } else {
        const i64 n = rows * dim;
        for (i64 i = t; i < n; i += stride) {
            const i64 at = base + i;
            float s = Vec<P>::get(reinterpret_cast<const P*>(ptrs[0]) + at);
            for (int w = 1; w < world; ++w)
                s += Vec<P>::get(reinterpret_cast<const P*>(ptrs[w]) + at);
            if (bias)
                s += Vec<O>::get(bias + i % dim);
            Vec<O>::put(out + at, s);
            for (int w = 0; w < world; ++w)
                if (w != rank) Vec<O>::put(reinterpret_cast<O*>(ptrs[world + w]) + at, s);
        }
    }
    __threadfence_system();  // the writes into the peers' inboxes, before the barrier that follows
}

#define PEER_SUM(NAME, P, O)                                                                      \
    extern "C" __global__ void __launch_bounds__(512) NAME(const i64* ptrs, O* out, const O* bias,  \
                                                           int world, int rank, i64 row0, i64 rows, \
                                                           i64 dim, int vec) {                      \
        peer_sum<P, O>(ptrs, out, bias, world, rank, row0, rows, dim, vec);                         \
    }

PEER_SUM(peer_sum_f32_f32, float, float)
PEER_SUM(peer_sum_f32_f16, float, __half)
PEER_SUM(peer_sum_f32_bf16, float, __nv_bfloat16)
PEER_SUM(peer_sum_f16_f16, __half, __half)
PEER_SUM(peer_sum_bf16_bf16, __nv_bfloat16, __nv_bfloat16)
