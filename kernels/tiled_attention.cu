// tiled_attention.cu -- still three passes with S and P in device memory, but each pass is built
// for the memory system and the tensor cores (on compute capability 9.0 with d = 64 or 128 the QK
// and PV passes of tiled_hopper_attention.cu, on wgmma, replace the two below; the softmax is shared):
//
//   tiled_qk_SUF      S = Q K^T * scale   a block computes a 128 x 128 tile of S on the tensor cores
//                     (mma.sync m16n8k16, fp32 accumulate; 4 warps, 64 x 64 each), Q and K stream
//                     through shared memory in 64-wide slices of the head dim (cp.async, 16-byte
//                     chunks, double buffered), and the tile leaves through shared memory in 16-byte
//                     coalesced stores (storing straight from the accumulators, 4 bytes a thread,
//                     was measured 1.5x slower: benchmarks/ladder.md). Dynamic shared memory:
//                     2 x (128 + 128) x 64 x 2 = 64 KiB.
//                     Causal: tiles entirely above the diagonal are not computed (nor read later).
//   tiled_softmax_SUF P = softmax(S)      one warp per row, 16-byte loads, warp-shuffle reductions;
//                     rows of up to 4096 columns are read once and kept in registers (and each
//                     exponential computed once); rows of up to 16384 columns are
//                     staged in shared memory (ld * 2 bytes a warp), longer rows are read twice
//                     (an online max/sum pass, then the write pass).
//   tiled_pv_SUF_nDN  O = P V             a block computes 128 rows x DN (64 or 128) columns of O
//                     on the tensor cores; P tiles (128 x 64) and V tiles (64 x DN) are double
//                     buffered in shared memory with cp.async.
//
// Layout: Q, K, V, O are [BH, N, d] contiguous; S and P are [BH, N, ld] with ld = N rounded up to a
// multiple of 8, so that every row starts on 16 bytes. d is a multiple of 8, at most 256. fp16 and
// bf16 only (the tensor-core types). Causal: the softmax writes zeros after the diagonal up to the
// end of the row's 128-row tile, which is as far as the PV pass reads; padding columns [N, ld)
// of P are written as zeros. Every offset that can reach N^2 is 64-bit.
// No headers, so NVRTC (no <math.h>) and nvcc compile it alike.

#define TPT_NEG_INF __int_as_float(0xff800000)
#define TPT_LOG2E 1.4426950408889634f
#define TPT_BM 128   // query rows per tile, in the QK and PV passes (and the causal write bound)
#define TPT_CACHE 16 // 16-byte chunks of a row each lane keeps in registers in the softmax
#define TPT_SMEM_COLS 16384  // longer rows than 32 * TPT_CACHE * 8, up to this, go through shared memory

typedef unsigned short tpt_u16;
typedef unsigned int tpt_u32;

struct __attribute__((aligned(16))) tpt_u4 {
    tpt_u32 x, y, z, w;
};

extern __shared__ __attribute__((aligned(128))) unsigned char tpt_dsmem[];

__device__ __forceinline__ tpt_u32 tpt_saddr(const void *p) {
    tpt_u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ void tpt_cp16(tpt_u32 dst, const void *src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tpt_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void tpt_wait0() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void tpt_wait1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }
__device__ __forceinline__ void tpt_ldsm4(tpt_u32 *r, tpt_u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void tpt_ldsm4t(tpt_u32 *r, tpt_u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
template <bool BF16>
__device__ __forceinline__ void tpt_mma(float *c, const tpt_u32 *a, tpt_u32 b0, tpt_u32 b1) {
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
template <bool BF16>
__device__ __forceinline__ tpt_u32 tpt_pack(float lo, float hi) {
    tpt_u32 r;
    if (BF16)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <bool BF16>
__device__ __forceinline__ void tpt_unpack(tpt_u32 v, float &lo, float &hi) {
    if (BF16) {
        lo = __uint_as_float(v << 16);
        hi = __uint_as_float(v & 0xffff0000u);
    } else {
        unsigned short a = (unsigned short)(v & 0xffffu), b = (unsigned short)(v >> 16);
        asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(a));
        asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(b));
    }
}
__device__ __forceinline__ float tpt_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float tpt_shfl_xor(float v, int m) {
    float r;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;\n" : "=f"(r) : "f"(v), "r"(m));
    return r;
}
__device__ __forceinline__ float tpt_warp_max(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, tpt_shfl_xor(v, m));
    return v;
}
__device__ __forceinline__ float tpt_warp_sum(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v += tpt_shfl_xor(v, m);
    return v;
}
// element offset of 16-byte chunk ch of row r in a tile with W elements per row (W / 8 >= 8 chunks)
template <int W>
__device__ __forceinline__ int tpt_swz(int r, int ch) {
    return r * W + ((ch ^ (r & 7)) << 3);
}

// ------------------------------------------------------------------------------------------------
// S = Q K^T * scale. grid: x over key tiles, y over query tiles, z over BH (stride); block 128;
// 64 KiB of dynamic shared memory.
template <bool BF16>
__device__ __forceinline__ void tpt_qk(const tpt_u16 *__restrict__ Q, const tpt_u16 *__restrict__ K,
                                       tpt_u16 *__restrict__ S, int BH, int N, int d, int ld, float scale,
                                       int causal) {
    tpt_u16 *smem = (tpt_u16 *)tpt_dsmem;  // 2 stages of (Q slice | K slice); then the S tile
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp >> 1, wn = warp & 1;
    const int i0 = blockIdx.y * 128, j0 = blockIdx.x * 128;
    if (causal && j0 > i0 + 127) return;  // every key after every query of the tile
    const int dch = d >> 3;               // 16-byte chunks per row of Q and K
    const int nsl = (d + 63) >> 6;        // 64-wide slices of the head dim
    for (int bh = blockIdx.z; bh < BH; bh += gridDim.z) {
        const tpt_u16 *Qh = Q + (long long)bh * N * d, *Kh = K + (long long)bh * N * d;
        float acc[4][8][4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 8; ++b) acc[a][b][0] = acc[a][b][1] = acc[a][b][2] = acc[a][b][3] = 0.0f;
        auto load = [&](int stage, int c0) {
            tpt_u16 *sA = smem + stage * 2 * 128 * 64, *sB = sA + 128 * 64;
#pragma unroll
            for (int it = 0; it < 8; ++it) {  // 128 rows x 8 chunks = 1024 chunks per operand
                const int c = tid + it * 128;
                const int r = c >> 3, ch = c & 7;
                const int gch = (c0 >> 3) + ch;
                const bool okc = gch < dch;
                const int gi = i0 + r, gj = j0 + r;
                tpt_cp16(tpt_saddr(sA + tpt_swz<64>(r, ch)), Qh + (long long)(gi < N && okc ? gi : 0) * d + (okc ? gch * 8 : 0),
                         gi < N && okc ? 16 : 0);
                tpt_cp16(tpt_saddr(sB + tpt_swz<64>(r, ch)), Kh + (long long)(gj < N && okc ? gj : 0) * d + (okc ? gch * 8 : 0),
                         gj < N && okc ? 16 : 0);
            }
        };
        load(0, 0);
        tpt_commit();
        for (int sl = 0; sl < nsl; ++sl) {
            if (sl + 1 < nsl) load((sl + 1) & 1, (sl + 1) * 64);  // the next slice lands during this one
            tpt_commit();
            tpt_wait1();
            __syncthreads();
            const tpt_u16 *sA = smem + (sl & 1) * 2 * 128 * 64, *sB = sA + 128 * 64;
            const int ks = (d - sl * 64 + 15) >> 4;  // k16 steps with data in this slice
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                if (kk < ks) {
                    tpt_u32 a[4][4];
#pragma unroll
                    for (int mi = 0; mi < 4; ++mi)
                        tpt_ldsm4(a[mi], tpt_saddr(sA + tpt_swz<64>(wm * 64 + mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                                  kk * 2 + (lane >> 4))));
#pragma unroll
                    for (int ni = 0; ni < 8; ni += 2) {
                        tpt_u32 b[4];
                        tpt_ldsm4(b, tpt_saddr(sB + tpt_swz<64>(wn * 64 + ni * 8 + (lane & 7) + ((lane >> 4) << 3),
                                                               kk * 2 + ((lane >> 3) & 1))));
#pragma unroll
                        for (int mi = 0; mi < 4; ++mi) {
                            tpt_mma<BF16>(acc[mi][ni], a[mi], b[0], b[1]);
                            tpt_mma<BF16>(acc[mi][ni + 1], a[mi], b[2], b[3]);
                        }
                    }
                }
            }
            __syncthreads();  // this stage is refilled two slices on (and finally holds the S tile)
        }
        // the 128 x 128 tile, scaled and rounded, into shared memory (16 chunks per row, swizzled)
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
            for (int ni = 0; ni < 8; ++ni)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = wm * 64 + mi * 16 + (lane >> 2) + h * 8;
                    const int col = wn * 64 + ni * 8 + (lane & 3) * 2;
                    *(tpt_u32 *)(smem + tpt_swz<128>(r, col >> 3) + (col & 7)) =
                        tpt_pack<BF16>(acc[mi][ni][2 * h] * scale, acc[mi][ni][2 * h + 1] * scale);
                }
        __syncthreads();
        tpt_u16 *Sh = S + (long long)bh * N * ld;
#pragma unroll
        for (int it = 0; it < 16; ++it) {
            const int c = tid + it * 128;
            const int r = c >> 4, ch = c & 15;
            const int gi = i0 + r, gj = j0 + ch * 8;
            if (gi < N && gj < ld)
                *(tpt_u4 *)(Sh + (long long)gi * ld + gj) = *(const tpt_u4 *)(smem + tpt_swz<128>(r, ch));
        }
        __syncthreads();
    }
}

// ------------------------------------------------------------------------------------------------
// P = softmax(S) over the first len columns of each row (len = N, or i + 1 when causal).
// grid: x over rows / 4 (stride); block 128 = 4 warps, one row per warp. A row of up to 4096 columns
// is read once into registers and each exponential is computed once and kept (fp32) for the write:
// about 150 registers, so blocks of 4 warps (8-warp blocks fit one per SM and ran 1.3x slower).
template <bool BF16>
__device__ __forceinline__ void tpt_row_vals(const tpt_u4 &u, float *v) {
    tpt_unpack<BF16>(u.x, v[0], v[1]);
    tpt_unpack<BF16>(u.y, v[2], v[3]);
    tpt_unpack<BF16>(u.z, v[4], v[5]);
    tpt_unpack<BF16>(u.w, v[6], v[7]);
}

template <bool BF16>
__device__ __forceinline__ void tpt_store_p(tpt_u16 *p, int c, const float *v, int len, float mb, float inv) {
    float q[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) q[e] = c * 8 + e < len ? tpt_exp2(fmaf(v[e], TPT_LOG2E, -mb)) * inv : 0.0f;
    tpt_u4 o;
    o.x = tpt_pack<BF16>(q[0], q[1]);
    o.y = tpt_pack<BF16>(q[2], q[3]);
    o.z = tpt_pack<BF16>(q[4], q[5]);
    o.w = tpt_pack<BF16>(q[6], q[7]);
    *(tpt_u4 *)(p + c * 8) = o;
}

template <bool BF16>
__device__ __forceinline__ void tpt_softmax(const tpt_u16 *__restrict__ S, tpt_u16 *__restrict__ P, long long rows,
                                            int N, int ld, int causal) {
    const int lane = threadIdx.x & 31;
    const long long nw = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += nw) {
        const int i = (int)(r % N);
        const int len = causal ? i + 1 : N;
        int wlen = ld;
        if (causal) {
            const int bound = (i / TPT_BM + 1) * TPT_BM;
            wlen = bound < ld ? bound : ld;
        }
        const int nrc = (len + 7) >> 3, nwc = wlen >> 3;
        const tpt_u16 *s = S + r * ld;
        tpt_u16 *p = P + r * ld;
        if (ld <= 32 * TPT_CACHE * 8) {
            tpt_u4 buf[TPT_CACHE];
            float mx = TPT_NEG_INF;
#pragma unroll
            for (int t = 0; t < TPT_CACHE; ++t) {  // all loads first, unconditionally (clamped address)
                const int c = lane + 32 * t;
                buf[t] = *(const tpt_u4 *)(s + (c < nrc ? c : 0) * 8);
            }
#pragma unroll
            for (int t = 0; t < TPT_CACHE; ++t) {
                const int c = lane + 32 * t;
                if (c < nrc) {
                    float v[8];
                    tpt_row_vals<BF16>(buf[t], v);
#pragma unroll
                    for (int e = 0; e < 8; ++e)
                        if (c * 8 + e < len) mx = fmaxf(mx, v[e]);
                }
            }
            mx = tpt_warp_max(mx);
            const float mb = mx * TPT_LOG2E;
            float sum = 0.0f;
            {  // each exponential once, kept in registers (fp32) for the write
                float ex[TPT_CACHE][8];
#pragma unroll
                for (int t = 0; t < TPT_CACHE; ++t) {
                    const int c = lane + 32 * t;
                    if (c < nrc) {
                        float v[8];
                        tpt_row_vals<BF16>(buf[t], v);
#pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            ex[t][e] = c * 8 + e < len ? tpt_exp2(fmaf(v[e], TPT_LOG2E, -mb)) : 0.0f;
                            sum += ex[t][e];
                        }
                    } else {
#pragma unroll
                        for (int e = 0; e < 8; ++e) ex[t][e] = 0.0f;
                    }
                }
                const float inv = 1.0f / tpt_warp_sum(sum);
#pragma unroll
                for (int t = 0; t < TPT_CACHE; ++t) {
                    const int c = lane + 32 * t;
                    if (c < nwc) {
                        tpt_u4 o;
                        o.x = tpt_pack<BF16>(ex[t][0] * inv, ex[t][1] * inv);
                        o.y = tpt_pack<BF16>(ex[t][2] * inv, ex[t][3] * inv);
                        o.z = tpt_pack<BF16>(ex[t][4] * inv, ex[t][5] * inv);
                        o.w = tpt_pack<BF16>(ex[t][6] * inv, ex[t][7] * inv);
                        *(tpt_u4 *)(p + c * 8) = o;
                    }
                }
            }
        } else if (ld <= TPT_SMEM_COLS) {
            // the row goes to this warp's slice of shared memory (ld elements; cp.async, all of its
            // 16-byte chunks in flight at once), then max, sum and write read it from there: S is
            // read from device memory once
            tpt_u16 *row = (tpt_u16 *)tpt_dsmem + (long long)(threadIdx.x >> 5) * ld;
            for (int c = lane; c < nrc; c += 32) tpt_cp16(tpt_saddr(row + c * 8), s + c * 8, 16);
            tpt_commit();
            tpt_wait0();
            __syncwarp();
            float mx = TPT_NEG_INF;
            for (int c = lane; c < nrc; c += 32) {
                float v[8];
                tpt_row_vals<BF16>(*(const tpt_u4 *)(row + c * 8), v);
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (c * 8 + e < len) mx = fmaxf(mx, v[e]);
            }
            mx = tpt_warp_max(mx);
            const float mb = mx * TPT_LOG2E;
            float sum = 0.0f;
            for (int c = lane; c < nrc; c += 32) {
                float v[8];
                tpt_row_vals<BF16>(*(const tpt_u4 *)(row + c * 8), v);
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (c * 8 + e < len) sum += tpt_exp2(fmaf(v[e], TPT_LOG2E, -mb));
            }
            const float inv = 1.0f / tpt_warp_sum(sum);
            for (int c = lane; c < nwc; c += 32) {
                float v[8];
                if (c < nrc)
                    tpt_row_vals<BF16>(*(const tpt_u4 *)(row + c * 8), v);
                else
#pragma unroll
                    for (int e = 0; e < 8; ++e) v[e] = 0.0f;
                tpt_store_p<BF16>(p, c, v, len, mb, inv);
            }
            __syncwarp();  // every lane is done with the row before the warp's next row lands
        } else {
            float m = TPT_NEG_INF, l = 0.0f;
            for (int c = lane; c < nrc; c += 32) {
                float v[8];
                tpt_row_vals<BF16>(*(const tpt_u4 *)(s + c * 8), v);
                float cm = TPT_NEG_INF;
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (c * 8 + e < len) cm = fmaxf(cm, v[e]);
                if (cm > m) {
                    l *= tpt_exp2((m - cm) * TPT_LOG2E);
                    m = cm;
                }
                const float mb = m * TPT_LOG2E;
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (c * 8 + e < len) l += tpt_exp2(fmaf(v[e], TPT_LOG2E, -mb));
            }
            const float M = tpt_warp_max(m);
            l = m == TPT_NEG_INF ? 0.0f : l * tpt_exp2((m - M) * TPT_LOG2E);
            const float inv = 1.0f / tpt_warp_sum(l);
            const float mb = M * TPT_LOG2E;
            for (int c = lane; c < nwc; c += 32) {
                float v[8];
                if (c < nrc)
                    tpt_row_vals<BF16>(*(const tpt_u4 *)(s + c * 8), v);
                else
#pragma unroll
                    for (int e = 0; e < 8; ++e) v[e] = 0.0f;
                tpt_store_p<BF16>(p, c, v, len, mb, inv);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// O = P V. grid: x over column blocks of DN, y over query tiles, z over BH (stride); block 128.
// Dynamic shared memory: 2 stages x (128 x 64 of P + 64 x DN of V) x 2 bytes.
template <int DN, bool BF16>
__device__ __forceinline__ void tpt_pv(const tpt_u16 *__restrict__ P, const tpt_u16 *__restrict__ V,
                                       tpt_u16 *__restrict__ O, int BH, int N, int d, int ld, int causal) {
    constexpr int STAGE = 128 * 64 + 64 * DN;  // elements per stage
    constexpr int VCH = DN / 8;                // 16-byte chunks per V row in the tile
    constexpr int WN = DN / 2;                 // columns per warp
    tpt_u16 *sm = (tpt_u16 *)tpt_dsmem;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp >> 1, wn = warp & 1;
    const int i0 = blockIdx.y * 128, dc0 = blockIdx.x * DN;
    const int dch = d >> 3;
    int kend = N;
    if (causal && i0 + 128 < N) kend = i0 + 128;
    const int nk = (kend + 63) >> 6;
    for (int bh = blockIdx.z; bh < BH; bh += gridDim.z) {
        const tpt_u16 *Ph = P + (long long)bh * N * ld, *Vh = V + (long long)bh * N * d;
        float acc[4][WN / 8][4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < WN / 8; ++b) acc[a][b][0] = acc[a][b][1] = acc[a][b][2] = acc[a][b][3] = 0.0f;
        auto load = [&](int stage, int k0) {
            tpt_u16 *sP = sm + stage * STAGE, *sV = sP + 128 * 64;
#pragma unroll
            for (int it = 0; it < 8; ++it) {  // P: 128 rows x 8 chunks
                const int c = tid + it * 128;
                const int r = c >> 3, ch = c & 7;
                const int gi = i0 + r, gk = k0 + ch * 8;
                const bool ok = gi < N && gk < ld;
                tpt_cp16(tpt_saddr(sP + tpt_swz<64>(r, ch)), Ph + (ok ? (long long)gi * ld + gk : 0), ok ? 16 : 0);
            }
#pragma unroll
            for (int it = 0; it < 64 * VCH / 128; ++it) {  // V: 64 rows x VCH chunks
                const int c = tid + it * 128;
                const int r = c / VCH, ch = c % VCH;
                const int gk = k0 + r, gch = (dc0 >> 3) + ch;
                const bool ok = gk < N && gch < dch;
                tpt_cp16(tpt_saddr(sV + tpt_swz<DN>(r, ch)), Vh + (ok ? (long long)gk * d + gch * 8 : 0), ok ? 16 : 0);
            }
        };
        load(0, 0);
        tpt_commit();
        for (int kt = 0; kt < nk; ++kt) {
            if (kt + 1 < nk) load((kt + 1) & 1, (kt + 1) * 64);
            tpt_commit();
            tpt_wait1();
            __syncthreads();
            const tpt_u16 *sP = sm + (kt & 1) * STAGE, *sV = sP + 128 * 64;
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                tpt_u32 a[4][4];
#pragma unroll
                for (int mi = 0; mi < 4; ++mi)
                    tpt_ldsm4(a[mi], tpt_saddr(sP + tpt_swz<64>(wm * 64 + mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                              kk * 2 + (lane >> 4))));
#pragma unroll
                for (int nd = 0; nd < WN / 8; nd += 2) {
                    tpt_u32 b[4];
                    tpt_ldsm4t(b, tpt_saddr(sV + tpt_swz<DN>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                                             wn * (WN / 8) + nd + (lane >> 4))));
#pragma unroll
                    for (int mi = 0; mi < 4; ++mi) {
                        tpt_mma<BF16>(acc[mi][nd], a[mi], b[0], b[1]);
                        tpt_mma<BF16>(acc[mi][nd + 1], a[mi], b[2], b[3]);
                    }
                }
            }
            __syncthreads();  // this stage is refilled two iterations on
        }
        tpt_u16 *Oh = O + (long long)bh * N * d;
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
            for (int nd = 0; nd < WN / 8; ++nd)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int gi = i0 + wm * 64 + mi * 16 + (lane >> 2) + h * 8;
                    const int col = dc0 + wn * WN + nd * 8 + (lane & 3) * 2;
                    if (gi < N && col < d)
                        *(tpt_u32 *)(Oh + (long long)gi * d + col) =
                            tpt_pack<BF16>(acc[mi][nd][2 * h], acc[mi][nd][2 * h + 1]);
                }
    }
}

#define TPT_DEFINE(SUF, BF16)                                                                          \
    extern "C" __global__ void __launch_bounds__(128, 3)                                                  \
        tiled_qk_##SUF(const tpt_u16 *__restrict__ Q, const tpt_u16 *__restrict__ K, tpt_u16 *__restrict__ S, \
                       int BH, int N, int d, int ld, float scale, int causal) {                        \
        tpt_qk<BF16>(Q, K, S, BH, N, d, ld, scale, causal);                                            \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                                  \
        tiled_softmax_##SUF(const tpt_u16 *__restrict__ S, tpt_u16 *__restrict__ P, long long rows, int N, \
                            int ld, int causal) {                                                      \
        tpt_softmax<BF16>(S, P, rows, N, ld, causal);                                                  \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                                  \
        tiled_pv_##SUF##_n64(const tpt_u16 *__restrict__ P, const tpt_u16 *__restrict__ V, tpt_u16 *__restrict__ O, \
                             int BH, int N, int d, int ld, int causal) {                               \
        tpt_pv<64, BF16>(P, V, O, BH, N, d, ld, causal);                                               \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                                  \
        tiled_pv_##SUF##_n128(const tpt_u16 *__restrict__ P, const tpt_u16 *__restrict__ V, tpt_u16 *__restrict__ O, \
                              int BH, int N, int d, int ld, int causal) {                              \
        tpt_pv<128, BF16>(P, V, O, BH, N, d, ld, causal);                                              \
    }

TPT_DEFINE(f16, false)
TPT_DEFINE(bf16, true)
