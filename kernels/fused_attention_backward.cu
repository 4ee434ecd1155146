// fused_attention_backward.cu -- the fused backward of attention (FlashAttention-2's algorithm),
// mma.sync on the tensor cores, written for this project. Nothing N x N ever reaches device memory:
// the forward saved only O and each row's logsumexp L (fused_attention.cu, fused_ws_attention.cu),
// and the backward recomputes P = exp(S - L) tile by tile on chip.
//
// The math (S = Q K^T / sqrt(d), P = softmax(S), O = P V; dO given):
//   dV = P^T dO    dP = dO V^T    Dl = rowsum(dO o O)    dS = P o (dP - Dl)
//   dQ = dS K / sqrt(d)    dK = dS^T Q / sqrt(d)
//
// Three kernels, no atomics (every sum in a fixed order: the same bits every run):
//   fbwd_dot    Dl = rowsum(dO o O), fp32, one warp per row (the "preprocessing" pass);
//   fbwd_kv     a block owns BC = 64 keys of one K/V head (4 warps x 16 keys) and walks the query
//               tiles of every query head of its group (grouped-query attention: dK and dV summed
//               over the group in registers, K and V never repeated). Per query tile of BR rows it
//               recomputes S^T = K Q^T and P^T, then dV += P^T dO, dP^T = V dO^T, dS^T, dK += dS^T Q,
//               all on the tensor cores with the products' A operands (P^T, dS^T) straight from the
//               accumulators; the next tile's Q and dO load (cp.async) while one computes;
//   fbwd_dq     a block owns 64 query rows of one head (4 warps x 16 rows) and walks the key tiles:
//               S, P, dP = dO V^T, dS and dQ += dS K in registers, written once. It recomputes S and
//               dP a second time; FlashAttention-2 instead adds dS K to an fp32 dQ with atomics from
//               fbwd_kv, which on the H200 was slower here (4.97 against 3.55 ms at B=1 H=32 N=4096
//               d=128, the two kernels without pipelining) and not reproducible bit for bit.
// Causal: key tiles wholly above a query tile are skipped (fbwd_kv starts at the first query tile
// that reaches its keys; fbwd_dq stops at the last key tile its rows reach); only diagonal tiles are
// masked element by element. Any N >= 1: rows past N load as zeros and their P is 0 (keys past N are
// masked; query rows past N get L = +inf). A row whose L is +inf (every key masked) gets P = 0 and
// zero gradients, never NaN.
//
// Layout: Q, O, dO, dQ [B, H, N, D] contiguous; K, V, dK, dV [B, G, N, D] contiguous (G K/V heads,
// H / G query heads each); L and Dl fp32 [B, H, N]. 16-bit storage (fp16 or bf16),
// fp32 accumulation. D = 64 or 128. Every offset that scales with B * H * N is 64-bit. Grid y walks
// batch x heads with a stride beyond 65535. Shared memory rows are XOR-swizzled (tc_swz) so ldmatrix
// and cp.async are free of bank conflicts; the ldmatrix lane patterns are the forward's
// (fused_attention.cu): "A" rows for an m16k16 operand, "B" rows for a k16n8 operand read as K^T
// (non-transposed), "T" rows for one read as V (transposed).

#include "tc_common.cuh"

extern __shared__ __attribute__((aligned(128))) unsigned char tpb_smem[];

#define TPB_LOG2E 1.4426950408889634f

// per-lane ldmatrix bases into a [rows x W] swizzled tile (16-bit elements), for row block r16
template <int W>
__device__ __forceinline__ tc_u32 tpb_a_base(tc_u32 tile, int row0, int lane, int i) {  // A operand rows
    const int x = lane & 7;
    return tile + (row0 + x + ((lane >> 3) & 1) * 8) * W * 2 + (((2 * i) ^ ((lane >> 4) ^ x)) << 4);
}
template <int W>
__device__ __forceinline__ tc_u32 tpb_b_base(tc_u32 tile, int lane, int i) {  // B operand, rows = n
    const int x = lane & 7;
    return tile + (x + ((lane >> 4) << 3)) * W * 2 + (((2 * i) ^ (((lane >> 3) & 1) ^ x)) << 4);
}
template <int W>
__device__ __forceinline__ tc_u32 tpb_t_base(tc_u32 tile, int lane, int i) {  // B operand, rows = k (.trans)
    const int x = lane & 7;
    return tile + (x + (((lane >> 3) & 1) << 3)) * W * 2 + (((2 * i) ^ ((lane >> 4) ^ x)) << 4);
}

// acc[NS][4] (m16 x 8NS) += A (16 rows of a [rows x D] tile, bases a[4]) x B^T (8NS rows of another
// [rows x D] tile, bases b[4]): the product over D, as the forward's S = Q K^T
template <int D, int NS, bool BF16>
__device__ __forceinline__ void tpb_abt(float (*acc)[4], const tc_u32 (&a)[4], const tc_u32 (&b)[4]) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        tc_u32 af[4];
        tc_ldsm4(af, a[kk & 3] + (kk >> 2) * 128);
#pragma unroll
        for (int n = 0; n < NS; n += 2) {
            tc_u32 bf[4];
            tc_ldsm4(bf, b[kk & 3] + (kk >> 2) * 128 + n * 8 * D * 2);
            tc_mma<BF16>(acc[n], af, bf[0], bf[1]);
            tc_mma<BF16>(acc[n + 1], af, bf[2], bf[3]);
        }
    }
}

// acc[ND][4] (m16 x 8ND, columns d0 * 8 on) += A (m16 x 16KT, from registers) x B (16KT rows of a
// [rows x W] tile read transposed, bases t[4]): as the forward's O += P V
template <int W, int KT, int ND, bool BF16>
__device__ __forceinline__ void tpb_ab(float (*acc)[4], const tc_u32 (*a)[4], const tc_u32 (&t)[4], int d0) {
#pragma unroll
    for (int k = 0; k < KT; ++k)
#pragma unroll
        for (int d = 0; d < ND; d += 2) {
            const int dd = d0 + d;
            tc_u32 bf[4];
            tc_ldsm4t(bf, t[(dd >> 1) & 3] + (dd >> 3) * 128 + k * 16 * W * 2);
            tc_mma<BF16>(acc[d], a[k], bf[0], bf[1]);
            tc_mma<BF16>(acc[d + 1], a[k], bf[2], bf[3]);
        }
}

// accumulators (m16 x 8 * 2KT) -> A fragments (m16 x k16 each), rounded to the storage type
template <int KT, bool BF16>
__device__ __forceinline__ void tpb_pack(tc_u32 (*a)[4], const float (*acc)[4]) {
#pragma unroll
    for (int t = 0; t < KT; ++t) {
        a[t][0] = tc_pack<BF16>(acc[2 * t][0], acc[2 * t][1]);
        a[t][1] = tc_pack<BF16>(acc[2 * t][2], acc[2 * t][3]);
        a[t][2] = tc_pack<BF16>(acc[2 * t + 1][0], acc[2 * t + 1][1]);
        a[t][3] = tc_pack<BF16>(acc[2 * t + 1][2], acc[2 * t + 1][3]);
    }
}

// rows [row0, row0 + ROWS) of a contiguous [N, D] matrix into a swizzled shared tile; rows >= N: zeros
template <int D, int ROWS, int NT>
__device__ __forceinline__ void tpb_load(tc_u16 *s, const tc_u16 *g, int row0, int N, int tid) {
    constexpr int CH = D / 8;
#pragma unroll
    for (int i = 0; i < (ROWS * CH + NT - 1) / NT; ++i) {
        const int c = tid + i * NT;
        if ((ROWS * CH) % NT == 0 || c < ROWS * CH) {
            const int r = c / CH, ch = c % CH, gr = row0 + r;
            tc_cp16(tc_saddr(s + tc_swz<D>(r, ch)), g + (long long)(gr < N ? gr : 0) * D + ch * 8, gr < N ? 16 : 0);
        }
    }
}

template <bool BF16>
__device__ __forceinline__ tc_u16 tpb_half(float v) {
    return (tc_u16)(tc_pack<BF16>(v, 0.0f) & 0xffffu);
}

// ------------------------------------------------------------------------------------ Dl
template <int D, bool BF16>
__device__ __forceinline__ void tpb_dot(const tc_u16 *__restrict__ O, const tc_u16 *__restrict__ dO,
                                        float *__restrict__ Dl, long long rows) {
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
        float acc = 0.0f;
#pragma unroll
        for (int c = lane * 2; c < D; c += 64) {
            float o0, o1, g0, g1;
            tc_unpack<BF16>(*(const tc_u32 *)(O + r * D + c), o0, o1);
            tc_unpack<BF16>(*(const tc_u32 *)(dO + r * D + c), g0, g1);
            acc += o0 * g0 + o1 * g1;
        }
        acc = tc_warp_sum(acc);
        if (lane == 0) Dl[r] = acc;
    }
}

// ------------------------------------------------------------------------------------ dK, dV
template <int D, int BR, bool BF16>
__device__ __forceinline__ void tpb_kv(const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K,
                                       const tc_u16 *__restrict__ V, const tc_u16 *__restrict__ dO,
                                       const float *__restrict__ L, const float *__restrict__ Dl,
                                       tc_u16 *__restrict__ dK, tc_u16 *__restrict__ dV, int BG, int G, int group,
                                       int N, float scale, int causal) {
    constexpr int BC = 64, NT = 128;
    constexpr int NQ = BR / 8, KQ = BR / 16, ND = D / 8;
    // shared: K, V (this block's keys), then two buffers of (Q, dO) tiles and their L and Dl
    tc_u16 *sK = (tc_u16 *)tpb_smem, *sV = sK + BC * D, *sQ = sV + BC * D;  // sQ[buf]: sQ + buf * 2 * BR * D, dO after it
    float *sL = (float *)(sQ + 4 * BR * D);                                   // sL[buf][BR], then sD[buf][BR]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const float scale_log2 = scale * TPB_LOG2E;
    tc_u32 kA[4], vA[4], qB[4], oB[4], qT[4], oT[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        kA[i] = tpb_a_base<D>(tc_saddr(sK), warp * 16, lane, i);
        vA[i] = tpb_a_base<D>(tc_saddr(sV), warp * 16, lane, i);
        qB[i] = tpb_b_base<D>(tc_saddr(sQ), lane, i);            // + buf * 2 * BR * D * 2 bytes
        oB[i] = tpb_b_base<D>(tc_saddr(sQ + BR * D), lane, i);
        qT[i] = tpb_t_base<D>(tc_saddr(sQ), lane, i);
        oT[i] = tpb_t_base<D>(tc_saddr(sQ + BR * D), lane, i);
    }
    constexpr int BUF_BYTES = 2 * BR * D * 2;
    const int k0 = blockIdx.x * BC;
    const int kr = k0 + warp * 16 + (lane >> 2);  // this thread's keys: kr and kr + 8
    const int n_qt = (N + BR - 1) / BR, qt_first = causal ? k0 / BR : 0;
    const int steps = group * (n_qt - qt_first);   // (query head of the group, query tile) pairs
    for (int bg = blockIdx.y; bg < BG; bg += gridDim.y) {
        const int b = bg / G, g = bg - b * G;
        const long long kv_off = (long long)bg * N * D, bh0 = (long long)b * G * group + (long long)g * group;
        // step t: query head bh0 + t / (n_qt - qt_first), query tile qt_first + t % (...), into buffer t & 1
        auto issue = [&](int t) {
            const int per = n_qt - qt_first, buf = t & 1;
            const long long bh = bh0 + t / per;
            const int q0 = (qt_first + t % per) * BR;
            tpb_load<D, BR, NT>(sQ + buf * 2 * BR * D, Q + bh * N * D, q0, N, tid);
            tpb_load<D, BR, NT>(sQ + buf * 2 * BR * D + BR * D, dO + bh * N * D, q0, N, tid);
            if (tid < BR) {
                const int r = q0 + tid;
                sL[buf * BR + tid] = r < N ? L[bh * N + r] * TPB_LOG2E : TC_POS_INF;
                sL[2 * BR + buf * BR + tid] = r < N ? Dl[bh * N + r] : 0.0f;
            }
            tc_cp_commit();
        };
        __syncthreads();  // the previous head's K, V and tiles are no longer read
        tpb_load<D, BC, NT>(sK, K + kv_off, k0, N, tid);
        tpb_load<D, BC, NT>(sV, V + kv_off, k0, N, tid);
        tc_cp_commit();
        if (steps > 0) issue(0);
        float dk[ND][4], dv[ND][4];
#pragma unroll
        for (int d = 0; d < ND; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = 0.0f;
        for (int t = 0; t < steps; ++t) {
            const int buf = t & 1, q0 = (qt_first + t % (n_qt - qt_first)) * BR;
            tc_cp_wait<0>();   // this step's tiles (and K, V) have landed ...
            __syncthreads();   // ... for every thread; every warp is done with the other buffer
            if (t + 1 < steps) issue(t + 1);  // the next step's tiles load while this one computes
            const int off = buf * BUF_BYTES;
            const float *cL = sL + buf * BR, *cD = sL + 2 * BR + buf * BR;
            const tc_u32 qb[4] = {qB[0] + off, qB[1] + off, qB[2] + off, qB[3] + off};
            const tc_u32 ob[4] = {oB[0] + off, oB[1] + off, oB[2] + off, oB[3] + off};
            // S^T = K Q^T and P^T = exp2(S^T scale log2 e - L log2 e): [16 keys x BR queries] per warp
            float st[NQ][4], dpt[NQ][4];
#pragma unroll
            for (int n = 0; n < NQ; ++n) st[n][0] = st[n][1] = st[n][2] = st[n][3] = 0.0f;
            tpb_abt<D, NQ, BF16>(st, kA, qb);
            const bool edge = k0 + BC > N || (causal && q0 < k0 + BC);
#pragma unroll
            for (int n = 0; n < NQ; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int qc = n * 8 + (lane & 3) * 2 + (e & 1), key = kr + (e >> 1) * 8;
                    float p = tc_exp2(fmaf(st[n][e], scale_log2, -cL[qc]));
                    if (edge && (key >= N || (causal && q0 + qc < key))) p = 0.0f;
                    st[n][e] = p;
                }
            // dV += P^T dO
            {
                tc_u32 pa[KQ][4];
                tpb_pack<KQ, BF16>(pa, st);
                const tc_u32 ot[4] = {oT[0] + off, oT[1] + off, oT[2] + off, oT[3] + off};
                tpb_ab<D, KQ, ND, BF16>(dv, pa, ot, 0);
            }
            // dP^T = V dO^T, then dS^T = P^T o (dP^T - Dl) / sqrt(d)
#pragma unroll
            for (int n = 0; n < NQ; ++n) dpt[n][0] = dpt[n][1] = dpt[n][2] = dpt[n][3] = 0.0f;
            tpb_abt<D, NQ, BF16>(dpt, vA, ob);
#pragma unroll
            for (int n = 0; n < NQ; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int qc = n * 8 + (lane & 3) * 2 + (e & 1);
                    dpt[n][e] = st[n][e] * (dpt[n][e] - cD[qc]) * scale;
                }
            // dK += dS^T Q
            {
                tc_u32 da[KQ][4];
                tpb_pack<KQ, BF16>(da, dpt);
                const tc_u32 qt_[4] = {qT[0] + off, qT[1] + off, qT[2] + off, qT[3] + off};
                tpb_ab<D, KQ, ND, BF16>(dk, da, qt_, 0);
            }
        }
        tc_cp_wait<0>();  // (no steps: K and V were loaded and never waited for)
        // dK and dV of this block's keys (rows < N), rounded once to the storage type
#pragma unroll
        for (int d = 0; d < ND; ++d)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int key = kr + i * 8;
                if (key < N) {
                    const long long o = kv_off + (long long)key * D + d * 8 + (lane & 3) * 2;
                    *(tc_u32 *)(dK + o) = tc_pack<BF16>(dk[d][2 * i], dk[d][2 * i + 1]);
                    *(tc_u32 *)(dV + o) = tc_pack<BF16>(dv[d][2 * i], dv[d][2 * i + 1]);
                }
            }
    }
}

// ------------------------------------------------------------------------------------ dQ
template <int D, bool BF16>
__device__ __forceinline__ void tpb_dq(const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K,
                                       const tc_u16 *__restrict__ V, const tc_u16 *__restrict__ dO,
                                       const float *__restrict__ L, const float *__restrict__ Dl,
                                       tc_u16 *__restrict__ dQ, int BH, int H, int group, int N, float scale,
                                       int causal) {
    constexpr int BR = 64, BC = 64, NT = 128, NS = BC / 8, KC = BC / 16, ND = D / 8;
    // shared: Q and dO of this block's rows, then two buffers of (K, V) tiles
    tc_u16 *sQ = (tc_u16 *)tpb_smem, *sO = sQ + BR * D, *sK = sO + BR * D;  // sK[buf]: sK + buf * 2 * BC * D, V after it
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const float scale_log2 = scale * TPB_LOG2E;
    constexpr int BUF_BYTES = 2 * BC * D * 2;
    tc_u32 qA[4], oA[4], kB[4], vB[4], kT[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        qA[i] = tpb_a_base<D>(tc_saddr(sQ), warp * 16, lane, i);
        oA[i] = tpb_a_base<D>(tc_saddr(sO), warp * 16, lane, i);
        kB[i] = tpb_b_base<D>(tc_saddr(sK), lane, i);
        vB[i] = tpb_b_base<D>(tc_saddr(sK + BC * D), lane, i);
        kT[i] = tpb_t_base<D>(tc_saddr(sK), lane, i);
    }
    const int q0 = blockIdx.x * BR;
    const int r = q0 + warp * 16 + (lane >> 2);  // this thread's rows: r and r + 8
    const int n_kt = causal ? (q0 + BR - 1) / BC + 1 : (N + BC - 1) / BC;
    for (long long bh = blockIdx.y; bh < BH; bh += gridDim.y) {
        const long long kv_off = ((bh / H) * (H / group) + (bh % H) / group) * N * D;
        auto issue = [&](int kt) {
            tc_u16 *dst = sK + (kt & 1) * 2 * BC * D;
            tpb_load<D, BC, NT>(dst, K + kv_off, kt * BC, N, tid);
            tpb_load<D, BC, NT>(dst + BC * D, V + kv_off, kt * BC, N, tid);
            tc_cp_commit();
        };
        __syncthreads();  // the previous head's tiles are no longer read
        tpb_load<D, BR, NT>(sQ, Q + bh * N * D, q0, N, tid);
        tpb_load<D, BR, NT>(sO, dO + bh * N * D, q0, N, tid);
        tc_cp_commit();
        issue(0);
        float lr[2], dr[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int row = r + 8 * i;
            lr[i] = row < N ? L[bh * N + row] * TPB_LOG2E : TC_POS_INF;
            dr[i] = row < N ? Dl[bh * N + row] : 0.0f;
        }
        float dq[ND][4];
#pragma unroll
        for (int d = 0; d < ND; ++d) dq[d][0] = dq[d][1] = dq[d][2] = dq[d][3] = 0.0f;
        for (int kt = 0; kt < n_kt; ++kt) {
            const int k0 = kt * BC, off = (kt & 1) * BUF_BYTES;
            tc_cp_wait<0>();
            __syncthreads();  // tile kt has landed for all; every warp is done with tile kt - 1
            if (kt + 1 < n_kt) issue(kt + 1);
            const tc_u32 kb[4] = {kB[0] + off, kB[1] + off, kB[2] + off, kB[3] + off};
            const tc_u32 vb[4] = {vB[0] + off, vB[1] + off, vB[2] + off, vB[3] + off};
            float s[NS][4], dp[NS][4];
#pragma unroll
            for (int n = 0; n < NS; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
            tpb_abt<D, NS, BF16>(s, qA, kb);
            tpb_abt<D, NS, BF16>(dp, oA, vb);
            const bool edge = k0 + BC > N || (causal && k0 + BC - 1 > q0);
#pragma unroll
            for (int n = 0; n < NS; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = e >> 1, col = k0 + n * 8 + (lane & 3) * 2 + (e & 1);
                    float p = tc_exp2(fmaf(s[n][e], scale_log2, -lr[i]));
                    if (edge && (col >= N || (causal && col > r + 8 * i))) p = 0.0f;
                    dp[n][e] = p * (dp[n][e] - dr[i]) * scale;
                }
            tc_u32 da[KC][4];
            tpb_pack<KC, BF16>(da, dp);
            const tc_u32 kt_[4] = {kT[0] + off, kT[1] + off, kT[2] + off, kT[3] + off};
            tpb_ab<D, KC, ND, BF16>(dq, da, kt_, 0);
        }
        // dQ rounded once to the storage type (rows < N)
#pragma unroll
        for (int d = 0; d < ND; ++d)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int row = r + 8 * i;
                if (row < N) *(tc_u32 *)(dQ + (bh * N + row) * D + d * 8 + (lane & 3) * 2) = tc_pack<BF16>(dq[d][2 * i], dq[d][2 * i + 1]);
            }
    }
}

#define TPB_DEFINE(SUF, BF16, D, BR)                                                                   \
    extern "C" __global__ void __launch_bounds__(256) fbwd_dot_##SUF##_d##D(                          \
        const tc_u16 *__restrict__ O, const tc_u16 *__restrict__ dO, float *__restrict__ Dl, long long rows) { \
        tpb_dot<D, BF16>(O, dO, Dl, rows);                                                             \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) fbwd_kv_##SUF##_d##D(                            \
        const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K, const tc_u16 *__restrict__ V,     \
        const tc_u16 *__restrict__ dO, const float *__restrict__ L, const float *__restrict__ Dl,     \
        tc_u16 *__restrict__ dK, tc_u16 *__restrict__ dV, int BG, int G, int group, int N, float scale, \
        int causal) {                                                                                  \
        tpb_kv<D, BR, BF16>(Q, K, V, dO, L, Dl, dK, dV, BG, G, group, N, scale, causal);               \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) fbwd_dq_##SUF##_d##D(                            \
        const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K, const tc_u16 *__restrict__ V,     \
        const tc_u16 *__restrict__ dO, const float *__restrict__ L, const float *__restrict__ Dl,     \
        tc_u16 *__restrict__ dQ, int BH, int H, int group, int N, float scale, int causal) {           \
        tpb_dq<D, BF16>(Q, K, V, dO, L, Dl, dQ, BH, H, group, N, scale, causal);                       \
    }
// query rows per step of fbwd_kv: 64 at D = 64, 32 at D = 128 (its dK and dV accumulators take 128
// registers a thread there)
TPB_DEFINE(f16, false, 64, 64)
TPB_DEFINE(bf16, true, 64, 64)
TPB_DEFINE(f16, false, 128, 32)
TPB_DEFINE(bf16, true, 128, 32)
