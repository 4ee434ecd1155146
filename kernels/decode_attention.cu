// decode_attention.cu -- attention of one query row per sequence over a KV cache, split along the
// cache ("flash-decoding"), written for this project.
//
// A decode step is memory-bound: every key and value of the cache is read once to produce one row
// per head. One block per (sequence, K/V head) would leave most SMs idle at small batch, so the
// cache length is split into S chunks: block (s, b * G + g) reads chunk s of K/V head g of sequence
// b once for all the query heads of its group (grouped-query attention: GQ = H / G query heads share
// each K/V tile, read in place), keeps an online softmax per head, and writes a partial output and
// its logsumexp; a second kernel combines the S partials of each head:
//   o = sum_s exp(L_s - L) o_s,   L = log sum_s exp(L_s)
//
//   dec_split   128 threads = 8 groups of 16 lanes; a group takes one key at a time (16 lanes x 8
//               elements = 128 = d; d = 64: 8 lanes, 16 groups), 16-byte loads, the dot product
//               reduced over the group's lanes with shuffles; per head a running max m, sum l and
//               8 (or 4) output columns per lane; then the groups' partials are merged through
//               shared memory and written: Op [B, H, S, D] fp32, Lp [B, H, S] fp32 (log2 units).
//   dec_combine one warp per (b, h): the S partials into O [B, H, D] (storage dtype).
// The kernel is built for GQ = 1, 2, 4 and 8 query heads at a time (registers per head: its q
// and its output columns); a group of more heads than 8 is done in passes of 8 over the chunk
// (multi-query attention with many heads re-reads K and V from L2). Each group of lanes keeps
// DEC_UNROLL keys' loads in flight.
//
// Layout: Q [B, H, D] (one row per sequence), K, V [B, G, LMAX, D] contiguous (the cache), the first
// L positions valid. 16-bit storage (fp16 or bf16), fp32 accumulation, D = 64 or 128. Offsets that
// scale with B * G * LMAX are 64-bit; grid y over B * G with a stride beyond 65535.

#include "tc_common.cuh"

#define DEC_THREADS 128
#define DEC_UNROLL 4

template <bool BF16>
__device__ __forceinline__ void dec_load8(const tc_u16 *p, float (&x)[8]) {
    const tc_u4 v = *(const tc_u4 *)p;
    tc_unpack<BF16>(v.x, x[0], x[1]);
    tc_unpack<BF16>(v.y, x[2], x[3]);
    tc_unpack<BF16>(v.z, x[4], x[5]);
    tc_unpack<BF16>(v.w, x[6], x[7]);
}

template <int D, int GQ, bool BF16>
__device__ __forceinline__ void dec_split(const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K,
                                          const tc_u16 *__restrict__ V, float *__restrict__ Op,
                                          float *__restrict__ Lp, int BG, int G, int group, int L, int LMAX,
                                          int S, int chunk, float scale_log2) {
    constexpr int LANES = D / 8;                  // lanes per key (8 elements each)
    constexpr int NGRP = DEC_THREADS / LANES;     // key groups per block
    constexpr int U = DEC_UNROLL;                 // keys per group in flight (their loads issued first)
    __shared__ float sm[NGRP][GQ], sl[NGRP][GQ];
    __shared__ float so[NGRP][GQ][D];
    const int tid = threadIdx.x, grp = tid / LANES, lane = tid % LANES;
    const int s = blockIdx.x, k0 = s * chunk, k1 = min(L, k0 + chunk);
    for (int bg = blockIdx.y; bg < BG; bg += gridDim.y) {
        const int b = bg / G, g = bg - b * G;
        const long long kv = (long long)bg * LMAX * D;
        for (int h0 = 0; h0 < group; h0 += GQ) {  // GQ heads of the group at a time
            const int nh = min(GQ, group - h0);
            float q[GQ][8], o[GQ][8], m[GQ], l[GQ];
#pragma unroll
            for (int i = 0; i < GQ; ++i) {
                m[i] = TC_NEG_INF;
                l[i] = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; ++e) o[i][e] = q[i][e] = 0.0f;
                if (i < nh) {
                    const long long bh = (long long)b * G * group + (long long)g * group + h0 + i;
                    dec_load8<BF16>(Q + bh * D + lane * 8, q[i]);
                }
            }
            // every lane runs every iteration (the shuffles need the whole warp); a key past the
            // chunk's end loads nothing and leaves the state as it is
            for (int base = k0; base < k1; base += U * NGRP) {
                float kx[U][8], vx[U][8];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int key = base + u * NGRP + grp;
                    if (key < k1) {
                        dec_load8<BF16>(K + kv + (long long)key * D + lane * 8, kx[u]);
                        dec_load8<BF16>(V + kv + (long long)key * D + lane * 8, vx[u]);
                    } else {
#pragma unroll
                        for (int e = 0; e < 8; ++e) kx[u][e] = vx[u][e] = 0.0f;
                    }
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const bool ok = base + u * NGRP + grp < k1;
#pragma unroll
                    for (int i = 0; i < GQ; ++i) {
                        float dot = 0.0f;
#pragma unroll
                        for (int e = 0; e < 8; ++e) dot = fmaf(q[i][e], kx[u][e], dot);
#pragma unroll
                        for (int w = LANES / 2; w > 0; w >>= 1) dot += tc_shfl_xor(dot, w);
                        if (!ok || i >= nh) continue;
                        const float sc = dot * scale_log2, mn = fmaxf(m[i], sc);
                        const float a = tc_exp2(m[i] - mn), p = tc_exp2(sc - mn);
                        m[i] = mn;
                        l[i] = l[i] * a + p;
#pragma unroll
                        for (int e = 0; e < 8; ++e) o[i][e] = fmaf(o[i][e], a, p * vx[u][e]);
                    }
                }
            }
            // merge the NGRP groups' partials (every lane of a group holds the same m and l)
#pragma unroll
            for (int i = 0; i < GQ; ++i) {
                if (lane == 0) sm[grp][i] = m[i], sl[grp][i] = l[i];
#pragma unroll
                for (int e = 0; e < 8; ++e) so[grp][i][lane * 8 + e] = o[i][e];
            }
            __syncthreads();
            for (int t = tid; t < nh * D; t += DEC_THREADS) {
                const int i = t / D, c = t - i * D;
                float mx = TC_NEG_INF;
                for (int r = 0; r < NGRP; ++r) mx = fmaxf(mx, sm[r][i]);
                float lsum = 0.0f, acc = 0.0f;
                if (mx != TC_NEG_INF)
                    for (int r = 0; r < NGRP; ++r) {
                        const float w = tc_exp2(sm[r][i] - mx);
                        lsum += sl[r][i] * w;
                        acc += so[r][i][c] * w;
                    }
                const long long bh = (long long)b * G * group + (long long)g * group + h0 + i;
                Op[(bh * S + s) * D + c] = lsum > 0.0f ? acc / lsum : 0.0f;
                if (c == 0) Lp[bh * S + s] = lsum > 0.0f ? mx + tc_log2(lsum) : TC_NEG_INF;
            }
            __syncthreads();
        }
    }
}

// one warp per (b, h): O = sum_s 2^(Lp_s - Lmax) Op_s / sum_s 2^(Lp_s - Lmax); Lse (may be null): ln
template <int D, bool BF16>
__device__ __forceinline__ void dec_combine(const float *__restrict__ Op, const float *__restrict__ Lp,
                                            tc_u16 *__restrict__ O, float *__restrict__ Lse, long long BH, int S) {
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long bh = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); bh < BH; bh += warps) {
        float mx = TC_NEG_INF;
        for (int s = lane; s < S; s += 32) mx = fmaxf(mx, Lp[bh * S + s]);
        mx = tc_warp_max(mx);
        float acc[D / 32];
#pragma unroll
        for (int j = 0; j < D / 32; ++j) acc[j] = 0.0f;
        float lsum = 0.0f;
        for (int s = 0; s < S; ++s) {
            const float lp = Lp[bh * S + s];
            if (lp == TC_NEG_INF) continue;
            const float w = tc_exp2(lp - mx);
            lsum += w;
#pragma unroll
            for (int j = 0; j < D / 32; ++j) acc[j] = fmaf(w, Op[(bh * S + s) * D + j * 32 + lane], acc[j]);
        }
        const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;
#pragma unroll
        for (int j = 0; j < D / 32; ++j) O[bh * D + j * 32 + lane] = (tc_u16)(tc_pack<BF16>(acc[j] * inv, 0.0f) & 0xffffu);
        if (Lse != nullptr && lane == 0) Lse[bh] = lsum > 0.0f ? (mx + tc_log2(lsum)) * TC_LN2 : TC_POS_INF;
    }
}

#define DEC_SPLIT(SUF, BF16, D, GQ)                                                                     \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS) dec_split_##SUF##_d##D##_g##GQ(          \
        const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K, const tc_u16 *__restrict__ V,      \
        float *__restrict__ Op, float *__restrict__ Lp, int BG, int G, int group, int L, int LMAX, int S, \
        int chunk, float scale_log2) {                                                                  \
        dec_split<D, GQ, BF16>(Q, K, V, Op, Lp, BG, G, group, L, LMAX, S, chunk, scale_log2);           \
    }
#define DEC_DEFINE(SUF, BF16, D)                                                                        \
    DEC_SPLIT(SUF, BF16, D, 1) DEC_SPLIT(SUF, BF16, D, 2) DEC_SPLIT(SUF, BF16, D, 4) DEC_SPLIT(SUF, BF16, D, 8) \
    extern "C" __global__ void __launch_bounds__(256) dec_combine_##SUF##_d##D(                         \
        const float *__restrict__ Op, const float *__restrict__ Lp, tc_u16 *__restrict__ O,              \
        float *__restrict__ Lse, long long BH, int S) {                                                 \
        dec_combine<D, BF16>(Op, Lp, O, Lse, BH, S);                                                    \
    }
DEC_DEFINE(f16, false, 64)
DEC_DEFINE(bf16, true, 64)
DEC_DEFINE(f16, false, 128)
DEC_DEFINE(bf16, true, 128)
