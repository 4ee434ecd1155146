// tc_common.cuh -- helpers every tensor-core kernel file shares (tiled_attention.cu,
// fused_attention.cu, and through hopper_common.cuh the two Hopper files): 16-bit storage types,
// cp.async, ldmatrix and mma.sync (sm_80+), fp32 <-> fp16/bf16 packing, exp2 and warp reductions.
// No other headers, so NVRTC (no <math.h>) and nvcc compile it alike; tpattn/cuda.py inlines it
// into each kernel file's source before compiling.
#pragma once

#define TC_NEG_INF __int_as_float(0xff800000)

typedef unsigned short tc_u16;
typedef unsigned int tc_u32;
typedef unsigned long long tc_u64;

struct __attribute__((aligned(16))) tc_u4 {
    tc_u32 x, y, z, w;
};

// element offset of 16-byte chunk ch of row r in a tile of W 16-bit elements a row (W / 8 >= 8
// chunks), XOR-swizzled (chunk ch stored at ch ^ (r & 7)) so ldmatrix and cp.async avoid bank conflicts
template <int W>
__device__ __forceinline__ int tc_swz(int r, int ch) {
    return r * W + ((ch ^ (r & 7)) << 3);
}

// 32-bit shared-window address of a generic pointer into shared memory
__device__ __forceinline__ tc_u32 tc_saddr(const void *p) {
    tc_u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// 16 bytes global -> shared, asynchronously; bytes < 16 zero-fills the rest (0: all zeros)
__device__ __forceinline__ void tc_cp16(tc_u32 dst, const void *src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tc_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>  // wait until at most N committed groups are still in flight
__device__ __forceinline__ void tc_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void tc_ldsm4(tc_u32 *r, tc_u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void tc_ldsm4t(tc_u32 *r, tc_u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

// c (m16n8 fp32 accumulators) += a (m16k16) * b (k16n8), fp16 or bf16 inputs
template <bool BF16>
__device__ __forceinline__ void tc_mma(float *c, const tc_u32 *a, tc_u32 b0, tc_u32 b1) {
    if (BF16)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// two floats -> one 32-bit register holding (lo, hi) in the storage type, round to nearest even
template <bool BF16>
__device__ __forceinline__ tc_u32 tc_pack(float lo, float hi) {
    tc_u32 r;
    if (BF16)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// one 32-bit register of two storage-type values -> (lo, hi) floats
template <bool BF16>
__device__ __forceinline__ void tc_unpack(tc_u32 v, float &lo, float &hi) {
    if (BF16) {
        lo = __uint_as_float(v << 16);
        hi = __uint_as_float(v & 0xffff0000u);
    } else {
        unsigned short a = (unsigned short)(v & 0xffffu), b = (unsigned short)(v >> 16);
        asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(a));
        asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(b));
    }
}

// v, through a value the compiler cannot see into: an offset recomputed from it inside a loop stays
// there instead of being hoisted out and kept live (in registers the inner loops need) across it
__device__ __forceinline__ int tc_opaque(int v) {
    asm volatile("" : "+r"(v));
    return v;
}

__device__ __forceinline__ float tc_exp2(float x) {  // 2^x; -inf -> +0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float tc_log2(float x) {  // log2(x), approximate (lg2.approx)
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

#define TC_POS_INF __int_as_float(0x7f800000)
#define TC_LN2 0.6931471805599453f

// The logsumexp of a row, natural log, from the online softmax's running max m (log2 units of the
// scaled scores) and its sum of exp2(s - m): L = (m + log2(sum)) ln 2. A row with nothing to sum
// (every key masked) gets +inf, so that the backward's P = exp(S - L) is 0 there, never NaN.
__device__ __forceinline__ float tc_logsumexp(float m, float sum) {
    return sum > 0.0f ? (m + tc_log2(sum)) * TC_LN2 : TC_POS_INF;
}

__device__ __forceinline__ float tc_shfl_xor(float v, int m) {
    float r;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;\n" : "=f"(r) : "f"(v), "r"(m));
    return r;
}
__device__ __forceinline__ float tc_warp_max(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, tc_shfl_xor(v, m));
    return v;
}
__device__ __forceinline__ float tc_warp_sum(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v += tc_shfl_xor(v, m);
    return v;
}
