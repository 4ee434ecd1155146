// The head-parallel layer's output collectives peer to peer (tpattn/peer.py): the reduce-gather over
// NVLink (--output-collective p2p, peer_sum_*) and the one-shot all-reduce for small partials
// (--output-collective oneshot, and auto's choice for them; peer_allreduce_*, at the end of this file).
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
#ifndef __CUDACC_RTC__
#include <cstdio>  // printf (NVRTC, which builds the kernels at run time, declares it itself)
#endif

typedef long long i64;

template <typename T> struct Vec;
template <> struct Vec<float> {
    static __device__ __forceinline__ float4 load(const float* p) { return *reinterpret_cast<const float4*>(p); }
    static __device__ __forceinline__ float4 load_cg(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }
    static __device__ __forceinline__ float get_cg(const float* p) { return __ldcg(p); }
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
    static __device__ __forceinline__ float4 unpack(uint2 u) {
        float2 a = to_float2(*reinterpret_cast<T2*>(&u.x)), b = to_float2(*reinterpret_cast<T2*>(&u.y));
        return make_float4(a.x, a.y, b.x, b.y);
    }
    static __device__ __forceinline__ float4 load(const T* p) { return unpack(*reinterpret_cast<const uint2*>(p)); }
    static __device__ __forceinline__ float4 load_cg(const T* p) { return unpack(__ldcg(reinterpret_cast<const uint2*>(p))); }
    static __device__ __forceinline__ float get_cg(const T* p) {
        const unsigned short u = __ldcg(reinterpret_cast<const unsigned short*>(p));
        return to_float(*reinterpret_cast<const T*>(&u));
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


// ---- the one-shot all-reduce (small partials: decode steps) ---------------------------------------
//
// Every rank's partial [n elements] lives in a buffer that every other rank has mapped (CUDA IPC:
// tpattn/peer.py), beside a signal area. Each rank reads the whole partial of every rank, sums in
// fp32 in rank order 0..W-1 (the same order on every rank, so every rank's y has the same bits),
// adds the bias, rounds once and writes its own output: one kernel, no NCCL, no staging copy. Two
// barriers inside it, per block: at the start (every rank's partial is written: the GEMM before the
// kernel on each rank's stream) and at the end (no rank reads this rank's partial any more, so the
// next call's GEMM may write it). A barrier is a flag each rank stores into every rank's signal area
// (release, system scope) and waits for in its own (acquire, system scope); the flag is the block's
// call count (epoch), kept on the device, so a CUDA graph of the call replays correctly. Block b of
// every rank meets block b of every other: the grid is the same on every rank (it depends on n
// only). A rank that never arrives: after timeout_ns the waiting block prints one line and traps
// (an error on this rank, not a hang).
//
// Signal area of each rank (uint32): start[ONESHOT_BLOCKS][ONESHOT_WORLD] (start[b][w]: rank w's
// block b arrived), end[...] the same for the end, epoch[ONESHOT_BLOCKS] (this rank's own count).
// ptrs: W data pointers (every rank's partial, as mapped here), then W signal-area pointers.

#define ONESHOT_BLOCKS 64
#define ONESHOT_WORLD 16

__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_sys(unsigned* p, unsigned v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned long long globaltimer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Every rank's block blockIdx.x has come to barrier `which` (0 start, 1 end) of call `e`.
__device__ void oneshot_barrier(const i64* sig, int world, int rank, int which, unsigned e, i64 timeout_ns) {
    __syncthreads();  // this block's work before the flag (the end barrier: its reads of the peers' partials)
    const int w = threadIdx.x;
    if (w < world) {
        const i64 at = (i64)which * ONESHOT_BLOCKS * ONESHOT_WORLD + (i64)blockIdx.x * ONESHOT_WORLD;
        st_release_sys(reinterpret_cast<unsigned*>(sig[w]) + at + rank, e);
        const unsigned* mine = reinterpret_cast<const unsigned*>(sig[rank]) + at + w;
        const unsigned long long t0 = globaltimer_ns();
        while (ld_acquire_sys(mine) != e) {
            if ((long long)(globaltimer_ns() - t0) > timeout_ns) {
                printf("tpattn one-shot all-reduce: rank %d waited %lld s for rank %d at its %s barrier; stopping\n",
                       rank, timeout_ns / 1000000000LL, w, which ? "end" : "start");
                __trap();
            }
        }
    }
    __syncthreads();
}

template <typename P, typename O>
__device__ void peer_allreduce(const i64* __restrict__ ptrs, O* __restrict__ out, const O* __restrict__ bias,
                               int world, int rank, i64 n, i64 dim, int vec, i64 timeout_ns) {
    const i64* sig = ptrs + world;
    unsigned* epoch = reinterpret_cast<unsigned*>(sig[rank]) + 2 * ONESHOT_BLOCKS * ONESHOT_WORLD + blockIdx.x;
    __shared__ unsigned call;
    if (threadIdx.x == 0) call = *epoch + 1u;
    __syncthreads();
    const unsigned e = call;
    oneshot_barrier(sig, world, rank, 0, e, timeout_ns);  // every rank's partial is written
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec) {
        for (i64 i = t; i < n / 4; i += stride) {
            float4 s = Vec<P>::load_cg(reinterpret_cast<const P*>(ptrs[0]) + 4 * i);
            for (int w = 1; w < world; ++w) {
                const float4 v = Vec<P>::load_cg(reinterpret_cast<const P*>(ptrs[w]) + 4 * i);
                s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
            }
            if (bias) {
                const float4 b = Vec<O>::load(bias + (4 * i) % dim);
                s.x += b.x; s.y += b.y; s.z += b.z; s.w += b.w;
            }
            Vec<O>::store(out + 4 * i, s);
        }
    } else {
        for (i64 i = t; i < n; i += stride) {
            float s = Vec<P>::get_cg(reinterpret_cast<const P*>(ptrs[0]) + i);
            for (int w = 1; w < world; ++w)
                s += Vec<P>::get_cg(reinterpret_cast<const P*>(ptrs[w]) + i);
            if (bias)
                s += Vec<O>::get(bias + i % dim);
            Vec<O>::put(out + i, s);
        }
    }
    oneshot_barrier(sig, world, rank, 1, e, timeout_ns);  // nobody reads this rank's partial any more
    if (threadIdx.x == 0) *epoch = e;
}

#define PEER_ALLREDUCE(NAME, P, O)                                                                       \
    extern "C" __global__ void __launch_bounds__(512) NAME(const i64* ptrs, O* out, const O* bias, int world,  \
                                                           int rank, i64 n, i64 dim, int vec, i64 timeout_ns) { \
        peer_allreduce<P, O>(ptrs, out, bias, world, rank, n, dim, vec, timeout_ns);                        \
    }

PEER_ALLREDUCE(peer_allreduce_f32_f32, float, float)
PEER_ALLREDUCE(peer_allreduce_f32_f16, float, __half)
PEER_ALLREDUCE(peer_allreduce_f32_bf16, float, __nv_bfloat16)
PEER_ALLREDUCE(peer_allreduce_f16_f16, __half, __half)
PEER_ALLREDUCE(peer_allreduce_bf16_bf16, __nv_bfloat16, __nv_bfloat16)
