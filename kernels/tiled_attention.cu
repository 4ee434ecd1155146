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
//                     exponential computed once); longer rows take an online max/sum pass,
//                     then the write pass, over the row staged in shared memory (up to 16384
//                     columns, ld * 2 bytes a warp) or, beyond that, over S read twice.
//   tiled_pv_SUF_nDN  O = P V             a block computes 128 rows x DN (64 or 128) columns of O
//                     on the tensor cores; P tiles (128 x 64) and V tiles (64 x DN) are double
//                     buffered in shared memory with cp.async.
//
// Layout: Q and O are [BH, N, d] contiguous, K and V [BH / group, N, d] contiguous (grouped-query
// attention: query head bh reads K/V head bh / group, shared in place by the group's query heads;
// group = 1 is multi-head attention); S and P are [BH, N, ld] with ld = N rounded up to a
// multiple of 8, so that every row starts on 16 bytes. d is a multiple of 8, at most 256. fp16 and
// bf16 only (the tensor-core types). Causal: the softmax writes zeros after the diagonal up to the
// end of the row's 128-row tile, which is as far as the PV pass reads; padding columns [N, ld)
// of P are written as zeros. Every offset that can reach N^2 is 64-bit.
// Shared helpers: tc_common.cuh.

#include "tc_common.cuh"

#define TPT_LOG2E 1.4426950408889634f
#define TPT_BM 128   // query rows per tile, in the QK and PV passes (and the causal write bound)
#define TPT_CACHE 16 // 16-byte chunks of a row each lane keeps in registers in the softmax
#define TPT_SMEM_COLS 16384  // longer rows than 32 * TPT_CACHE * 8, up to this, go through shared memory

extern __shared__ __attribute__((aligned(128))) unsigned char tpt_dsmem[];

// ------------------------------------------------------------------------------------------------
// S = Q K^T * scale. grid: x over key tiles, y over query tiles, z over BH (stride); block 128;
// 64 KiB of dynamic shared memory.
template <bool BF16>
__device__ __forceinline__ void tpt_qk(const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K,
                                       tc_u16 *__restrict__ S, int BH, int N, int d, int ld, float scale,
                                       int causal, int group) {
    tc_u16 *smem = (tc_u16 *)tpt_dsmem;  // 2 stages of (Q slice | K slice); then the S tile
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp >> 1, wn = warp & 1;
    const int i0 = blockIdx.y * 128, j0 = blockIdx.x * 128;
    if (causal && j0 > i0 + 127) return;  // every key after every query of the tile
    const int dch = d >> 3;               // 16-byte chunks per row of Q and K
    const int nsl = (d + 63) >> 6;        // 64-wide slices of the head dim
    for (int bh = blockIdx.z; bh < BH; bh += gridDim.z) {
        const tc_u16 *Qh = Q + (long long)bh * N * d, *Kh = K + (long long)(bh / group) * N * d;
        float acc[4][8][4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 8; ++b) acc[a][b][0] = acc[a][b][1] = acc[a][b][2] = acc[a][b][3] = 0.0f;
        auto load = [&](int stage, int c0) {
            tc_u16 *sA = smem + stage * 2 * 128 * 64, *sB = sA + 128 * 64;
#pragma unroll
            for (int it = 0; it < 8; ++it) {  // 128 rows x 8 chunks = 1024 chunks per operand
                const int c = tid + it * 128;
                const int r = c >> 3, ch = c & 7;
                const int gch = (c0 >> 3) + ch;
                const bool okc = gch < dch;
                const int gi = i0 + r, gj = j0 + r;
                tc_cp16(tc_saddr(sA + tc_swz<64>(r, ch)), Qh + (long long)(gi < N && okc ? gi : 0) * d + (okc ? gch * 8 : 0),
                         gi < N && okc ? 16 : 0);
                tc_cp16(tc_saddr(sB + tc_swz<64>(r, ch)), Kh + (long long)(gj < N && okc ? gj : 0) * d + (okc ? gch * 8 : 0),
                         gj < N && okc ? 16 : 0);
            }
        };
        load(0, 0);
        tc_cp_commit();
        for (int sl = 0; sl < nsl; ++sl) {
            if (sl + 1 < nsl) load((sl + 1) & 1, (sl + 1) * 64);  // the next slice lands during this one
            tc_cp_commit();
            tc_cp_wait<1>();
            __syncthreads();
            const tc_u16 *sA = smem + (sl & 1) * 2 * 128 * 64, *sB = sA + 128 * 64;
            const int ks = (d - sl * 64 + 15) >> 4;  // k16 steps with data in this slice
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                if (kk < ks) {
                    tc_u32 a[4][4];
#pragma unroll
                    for (int mi = 0; mi < 4; ++mi)
                        tc_ldsm4(a[mi], tc_saddr(sA + tc_swz<64>(wm * 64 + mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                                  kk * 2 + (lane >> 4))));
#pragma unroll
                    for (int ni = 0; ni < 8; ni += 2) {
                        tc_u32 b[4];
                        tc_ldsm4(b, tc_saddr(sB + tc_swz<64>(wn * 64 + ni * 8 + (lane & 7) + ((lane >> 4) << 3),
                                                               kk * 2 + ((lane >> 3) & 1))));
#pragma unroll
                        for (int mi = 0; mi < 4; ++mi) {
                            tc_mma<BF16>(acc[mi][ni], a[mi], b[0], b[1]);
                            tc_mma<BF16>(acc[mi][ni + 1], a[mi], b[2], b[3]);
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
                    *(tc_u32 *)(smem + tc_swz<128>(r, col >> 3) + (col & 7)) =
                        tc_pack<BF16>(acc[mi][ni][2 * h] * scale, acc[mi][ni][2 * h + 1] * scale);
                }
        __syncthreads();
        tc_u16 *Sh = S + (long long)bh * N * ld;
#pragma unroll
        for (int it = 0; it < 16; ++it) {
            const int c = tid + it * 128;
            const int r = c >> 4, ch = c & 15;
            const int gi = i0 + r, gj = j0 + ch * 8;
            if (gi < N && gj < ld)
                *(tc_u4 *)(Sh + (long long)gi * ld + gj) = *(const tc_u4 *)(smem + tc_swz<128>(r, ch));
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
__device__ __forceinline__ void tpt_row_vals(const tc_u4 &u, float *v) {
    tc_unpack<BF16>(u.x, v[0], v[1]);
    tc_unpack<BF16>(u.y, v[2], v[3]);
    tc_unpack<BF16>(u.z, v[4], v[5]);
    tc_unpack<BF16>(u.w, v[6], v[7]);
}

// max of chunk c's values at columns < len (-inf if none)
__device__ __forceinline__ float tpt_chunk_max(const float *v, int c, int len) {
    float m = TC_NEG_INF;
#pragma unroll
    for (int e = 0; e < 8; ++e)
        if (c * 8 + e < len) m = fmaxf(m, v[e]);
    return m;
}

template <bool BF16>
__device__ __forceinline__ void tpt_store_p(tc_u16 *p, int c, const float *v, int len, float mb, float inv) {
    float q[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) q[e] = c * 8 + e < len ? tc_exp2(fmaf(v[e], TPT_LOG2E, -mb)) * inv : 0.0f;
    tc_u4 o;
    o.x = tc_pack<BF16>(q[0], q[1]);
    o.y = tc_pack<BF16>(q[2], q[3]);
    o.z = tc_pack<BF16>(q[4], q[5]);
    o.w = tc_pack<BF16>(q[6], q[7]);
    *(tc_u4 *)(p + c * 8) = o;
}

template <bool BF16>
__device__ __forceinline__ void tpt_softmax(const tc_u16 *__restrict__ S, tc_u16 *__restrict__ P, long long rows,
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
        const tc_u16 *s = S + r * ld;
        tc_u16 *p = P + r * ld;
        if (ld <= 32 * TPT_CACHE * 8) {
            tc_u4 buf[TPT_CACHE];
            float mx = TC_NEG_INF;
#pragma unroll
            for (int t = 0; t < TPT_CACHE; ++t) {  // all loads first, unconditionally (clamped address)
                const int c = lane + 32 * t;
                buf[t] = *(const tc_u4 *)(s + (c < nrc ? c : 0) * 8);
            }
#pragma unroll
            for (int t = 0; t < TPT_CACHE; ++t) {
                const int c = lane + 32 * t;
                if (c < nrc) {
                    float v[8];
                    tpt_row_vals<BF16>(buf[t], v);
                    mx = fmaxf(mx, tpt_chunk_max(v, c, len));
                }
            }
            mx = tc_warp_max(mx);
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
                            ex[t][e] = c * 8 + e < len ? tc_exp2(fmaf(v[e], TPT_LOG2E, -mb)) : 0.0f;
                            sum += ex[t][e];
                        }
                    } else {
#pragma unroll
                        for (int e = 0; e < 8; ++e) ex[t][e] = 0.0f;
                    }
                }
                const float inv = 1.0f / tc_warp_sum(sum);
#pragma unroll
                for (int t = 0; t < TPT_CACHE; ++t) {
                    const int c = lane + 32 * t;
                    if (c < nwc) {
                        tc_u4 o;
                        o.x = tc_pack<BF16>(ex[t][0] * inv, ex[t][1] * inv);
                        o.y = tc_pack<BF16>(ex[t][2] * inv, ex[t][3] * inv);
                        o.z = tc_pack<BF16>(ex[t][4] * inv, ex[t][5] * inv);
                        o.w = tc_pack<BF16>(ex[t][6] * inv, ex[t][7] * inv);
                        *(tc_u4 *)(p + c * 8) = o;
                    }
                }
            }
        } else {
            // longer rows: staged in this warp's slice of shared memory when they fit (cp.async, the
            // whole row in flight at once, so S is read from device memory once), else read twice
            // from device memory; an online max/sum pass, then the write pass
            const tc_u16 *src = s;
            if (ld <= TPT_SMEM_COLS) {
                tc_u16 *row = (tc_u16 *)tpt_dsmem + (long long)(threadIdx.x >> 5) * ld;
                for (int c = lane; c < nrc; c += 32) tc_cp16(tc_saddr(row + c * 8), s + c * 8, 16);
                tc_cp_commit();
                tc_cp_wait<0>();
                __syncwarp();
                src = row;
            }
            float m = TC_NEG_INF, l = 0.0f;
            for (int c = lane; c < nrc; c += 32) {
                float v[8];
                tpt_row_vals<BF16>(*(const tc_u4 *)(src + c * 8), v);
                const float cm = tpt_chunk_max(v, c, len);
                if (cm > m) {
                    l *= tc_exp2((m - cm) * TPT_LOG2E);
                    m = cm;
                }
                const float mb = m * TPT_LOG2E;
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (c * 8 + e < len) l += tc_exp2(fmaf(v[e], TPT_LOG2E, -mb));
            }
            const float M = tc_warp_max(m);
            l = m == TC_NEG_INF ? 0.0f : l * tc_exp2((m - M) * TPT_LOG2E);
            const float inv = 1.0f / tc_warp_sum(l);
            const float mb = M * TPT_LOG2E;
            for (int c = lane; c < nwc; c += 32) {
                float v[8];
                if (c < nrc)
                    tpt_row_vals<BF16>(*(const tc_u4 *)(src + c * 8), v);
                else
#pragma unroll
                    for (int e = 0; e < 8; ++e) v[e] = 0.0f;
                tpt_store_p<BF16>(p, c, v, len, mb, inv);
            }
            __syncwarp();  // every lane is done with the staged row before the warp's next row lands
        }
    }
}

// ------------------------------------------------------------------------------------------------
// O = P V. grid: x over column blocks of DN, y over query tiles, z over BH (stride); block 128.
// Dynamic shared memory: 2 stages x (128 x 64 of P + 64 x DN of V) x 2 bytes.
template <int DN, bool BF16>
__device__ __forceinline__ void tpt_pv(const tc_u16 *__restrict__ P, const tc_u16 *__restrict__ V,
                                       tc_u16 *__restrict__ O, int BH, int N, int d, int ld, int causal,
                                       int group) {
    constexpr int STAGE = 128 * 64 + 64 * DN;  // elements per stage
    constexpr int VCH = DN / 8;                // 16-byte chunks per V row in the tile
    constexpr int WN = DN / 2;                 // columns per warp
    tc_u16 *sm = (tc_u16 *)tpt_dsmem;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp >> 1, wn = warp & 1;
    const int i0 = blockIdx.y * 128, dc0 = blockIdx.x * DN;
    const int dch = d >> 3;
    int kend = N;
    if (causal && i0 + 128 < N) kend = i0 + 128;
    const int nk = (kend + 63) >> 6;
    for (int bh = blockIdx.z; bh < BH; bh += gridDim.z) {
        const tc_u16 *Ph = P + (long long)bh * N * ld, *Vh = V + (long long)(bh / group) * N * d;
        float acc[4][WN / 8][4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < WN / 8; ++b) acc[a][b][0] = acc[a][b][1] = acc[a][b][2] = acc[a][b][3] = 0.0f;
        auto load = [&](int stage, int k0) {
            tc_u16 *sP = sm + stage * STAGE, *sV = sP + 128 * 64;
#pragma unroll
            for (int it = 0; it < 8; ++it) {  // P: 128 rows x 8 chunks
                const int c = tid + it * 128;
                const int r = c >> 3, ch = c & 7;
                const int gi = i0 + r, gk = k0 + ch * 8;
                const bool ok = gi < N && gk < ld;
                tc_cp16(tc_saddr(sP + tc_swz<64>(r, ch)), Ph + (ok ? (long long)gi * ld + gk : 0), ok ? 16 : 0);
            }
#pragma unroll
            for (int it = 0; it < 64 * VCH / 128; ++it) {  // V: 64 rows x VCH chunks
                const int c = tid + it * 128;
                const int r = c / VCH, ch = c % VCH;
                const int gk = k0 + r, gch = (dc0 >> 3) + ch;
                const bool ok = gk < N && gch < dch;
                tc_cp16(tc_saddr(sV + tc_swz<DN>(r, ch)), Vh + (ok ? (long long)gk * d + gch * 8 : 0), ok ? 16 : 0);
            }
        };
        load(0, 0);
        tc_cp_commit();
        for (int kt = 0; kt < nk; ++kt) {
            if (kt + 1 < nk) load((kt + 1) & 1, (kt + 1) * 64);
            tc_cp_commit();
            tc_cp_wait<1>();
            __syncthreads();
            const tc_u16 *sP = sm + (kt & 1) * STAGE, *sV = sP + 128 * 64;
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                tc_u32 a[4][4];
#pragma unroll
                for (int mi = 0; mi < 4; ++mi)
                    tc_ldsm4(a[mi], tc_saddr(sP + tc_swz<64>(wm * 64 + mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                              kk * 2 + (lane >> 4))));
#pragma unroll
                for (int nd = 0; nd < WN / 8; nd += 2) {
                    tc_u32 b[4];
                    tc_ldsm4t(b, tc_saddr(sV + tc_swz<DN>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                                             wn * (WN / 8) + nd + (lane >> 4))));
#pragma unroll
                    for (int mi = 0; mi < 4; ++mi) {
                        tc_mma<BF16>(acc[mi][nd], a[mi], b[0], b[1]);
                        tc_mma<BF16>(acc[mi][nd + 1], a[mi], b[2], b[3]);
                    }
                }
            }
            __syncthreads();  // this stage is refilled two iterations on
        }
        tc_u16 *Oh = O + (long long)bh * N * d;
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
            for (int nd = 0; nd < WN / 8; ++nd)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int gi = i0 + wm * 64 + mi * 16 + (lane >> 2) + h * 8;
                    const int col = dc0 + wn * WN + nd * 8 + (lane & 3) * 2;
                    if (gi < N && col < d)
                        *(tc_u32 *)(Oh + (long long)gi * d + col) =
                            tc_pack<BF16>(acc[mi][nd][2 * h], acc[mi][nd][2 * h + 1]);
                }
    }
}

#define TPT_DEFINE(SUF, BF16)                                                                          \
    extern "C" __global__ void __launch_bounds__(128, 3)                                                  \
        tiled_qk_##SUF(const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K, tc_u16 *__restrict__ S, \
                       int BH, int N, int d, int ld, float scale, int causal, int group) {             \
        tpt_qk<BF16>(Q, K, S, BH, N, d, ld, scale, causal, group);                                     \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                                  \
        tiled_softmax_##SUF(const tc_u16 *__restrict__ S, tc_u16 *__restrict__ P, long long rows, int N, \
                            int ld, int causal) {                                                      \
        tpt_softmax<BF16>(S, P, rows, N, ld, causal);                                                  \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                                  \
        tiled_pv_##SUF##_n64(const tc_u16 *__restrict__ P, const tc_u16 *__restrict__ V, tc_u16 *__restrict__ O, \
                             int BH, int N, int d, int ld, int causal, int group) {                    \
        tpt_pv<64, BF16>(P, V, O, BH, N, d, ld, causal, group);                                        \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                                  \
        tiled_pv_##SUF##_n128(const tc_u16 *__restrict__ P, const tc_u16 *__restrict__ V, tc_u16 *__restrict__ O, \
                              int BH, int N, int d, int ld, int causal, int group) {                   \
        tpt_pv<128, BF16>(P, V, O, BH, N, d, ld, causal, group);                                       \
    }

TPT_DEFINE(f16, false)
TPT_DEFINE(bf16, true)
