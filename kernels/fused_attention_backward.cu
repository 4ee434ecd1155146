// fused_attention_backward.cu -- the fused backward of attention (FlashAttention-2's algorithm),
// mma.sync on the tensor cores, written for this project. Nothing N x N ever reaches device memory:
// the forward saved only O and each row's logsumexp L (fused_attention.cu, fused_ws_attention.cu),
// and the backward recomputes P = exp(S - L) tile by tile on chip.
//
// The math (S = Q K^T / sqrt(d), P = softmax(S), O = P V; dO given):
//   dV = P^T dO    dP = dO V^T    Dl = rowsum(dO o O)    dS = P o (dP - Dl)
//   dQ = dS K / sqrt(d)    dK = dS^T Q / sqrt(d)
//
// Three kernels:
//   fbwd_dot    Dl = rowsum(dO o O), fp32, one warp per row (the "preprocessing" pass);
//   fbwd_kv     a block owns BC = 64 keys of one K/V head (4 warps x 16 keys) and walks the query
//               tiles of every query head of its group (grouped-query attention: dK and dV summed
//               over the group in registers, K and V never repeated). Per query tile of BR rows it
//               recomputes S^T = K Q^T and P^T, then dV += P^T dO, dP^T = V dO^T, dS^T, dK += dS^T Q,
//               all on the tensor cores with the products' A operands (P^T, dS^T) straight from the
//               accumulators; with dq != null, dS goes through shared memory and dQ += dS K is added
//               to an fp32 accumulator in global memory with atomics (the order varies: not bitwise
//               reproducible);
//   fbwd_dq     the deterministic dQ: a block owns 64 query rows of one head (4 warps x 16 rows) and
//               walks the key tiles: S, P, dP = dO V^T, dS and dQ += dS K in registers, written once
//               (no atomics: the same bits every run; it recomputes S and dP a second time).
// Causal: key tiles wholly above a query tile are skipped (fbwd_kv starts at the first query tile
// that reaches its keys; fbwd_dq stops at the last key tile its rows reach); only diagonal tiles are
// masked element by element. Any N >= 1: rows past N load as zeros and their P is 0 (keys past N are
// masked; query rows past N get L = +inf). A row whose L is +inf (every key masked) gets P = 0 and
// zero gradients, never NaN.
//
// Layout: Q, O, dO [B, H, N, D] contiguous; K, V, dK, dV [B, G, N, D] contiguous (G K/V heads, H / G
// query heads each); L and Dl fp32 [B, H, N]; dQacc fp32 [B, H, N, D]. 16-bit storage (fp16 or bf16),
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

// ------------------------------------------------------------------------------------ dK, dV (dQ)
template <int D, int BR, bool BF16>
__device__ __forceinline__ void tpb_kv(const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K,
                                       const tc_u16 *__restrict__ V, const tc_u16 *__restrict__ dO,
                                       const float *__restrict__ L, const float *__restrict__ Dl,
                                       float *__restrict__ dQ, tc_u16 *__restrict__ dK, tc_u16 *__restrict__ dV,
                                       int BG, int G, int group, int N, float scale, int causal) {
    constexpr int BC = 64, NT = 128;
    constexpr int NQ = BR / 8, KQ = BR / 16, ND = D / 8;
    constexpr int RT = BR / 16, WPR = 4 / RT, NDW = ND / WPR;  // dQ: row tiles, warps per row tile, n-tiles per warp
    tc_u16 *sK = (tc_u16 *)tpb_smem, *sV = sK + BC * D, *sQ = sV + BC * D, *sO = sQ + BR * D, *sS = sO + BR * D;
    float *sL = (float *)(sS + BR * BC), *sD = sL + BR;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const float scale_log2 = scale * TPB_LOG2E;
    tc_u32 kA[4], vA[4], qB[4], oB[4], qT[4], oT[4], kT[4], sA[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        kA[i] = tpb_a_base<D>(tc_saddr(sK), warp * 16, lane, i);
        vA[i] = tpb_a_base<D>(tc_saddr(sV), warp * 16, lane, i);
        qB[i] = tpb_b_base<D>(tc_saddr(sQ), lane, i);
        oB[i] = tpb_b_base<D>(tc_saddr(sO), lane, i);
        qT[i] = tpb_t_base<D>(tc_saddr(sQ), lane, i);
        oT[i] = tpb_t_base<D>(tc_saddr(sO), lane, i);
        kT[i] = tpb_t_base<D>(tc_saddr(sK), lane, i);
        sA[i] = tpb_a_base<BC>(tc_saddr(sS), (warp % RT) * 16, lane, i);
    }
    const int k0 = blockIdx.x * BC;
    const int kr = k0 + warp * 16 + (lane >> 2);  // this thread's keys: kr and kr + 8
    const int n_qt = (N + BR - 1) / BR;
    for (int bg = blockIdx.y; bg < BG; bg += gridDim.y) {
        const int b = bg / G, g = bg - b * G;
        const long long kv_off = (long long)bg * N * D;
        __syncthreads();  // the previous head's K and V are no longer read
        tpb_load<D, BC, NT>(sK, K + kv_off, k0, N, tid);
        tpb_load<D, BC, NT>(sV, V + kv_off, k0, N, tid);
        tc_cp_commit();
        float dk[ND][4], dv[ND][4];
#pragma unroll
        for (int d = 0; d < ND; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = 0.0f;
        for (int hq = 0; hq < group; ++hq) {
            const long long bh = (long long)b * G * group + (long long)g * group + hq;
            const tc_u16 *Qh = Q + bh * N * D, *dOh = dO + bh * N * D;
            for (int qt = causal ? k0 / BR : 0; qt < n_qt; ++qt) {
                const int q0 = qt * BR;
                __syncthreads();  // every warp is done with the previous tile's sQ, sO, sS, sL, sD
                tpb_load<D, BR, NT>(sQ, Qh, q0, N, tid);
                tpb_load<D, BR, NT>(sO, dOh, q0, N, tid);
                tc_cp_commit();
                if (tid < BR) {
                    const int r = q0 + tid;
                    sL[tid] = r < N ? L[bh * N + r] * TPB_LOG2E : TC_POS_INF;
                    sD[tid] = r < N ? Dl[bh * N + r] : 0.0f;
                }
                tc_cp_wait<0>();
                __syncthreads();
                // S^T = K Q^T and P^T = exp2(S^T scale log2 e - L log2 e): [16 keys x BR queries] per warp
                float st[NQ][4], dpt[NQ][4];
#pragma unroll
                for (int n = 0; n < NQ; ++n) st[n][0] = st[n][1] = st[n][2] = st[n][3] = 0.0f;
                tpb_abt<D, NQ, BF16>(st, kA, qB);
                const bool edge = k0 + BC > N || (causal && q0 < k0 + BC) || q0 + BR > N;
#pragma unroll
                for (int n = 0; n < NQ; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int qc = n * 8 + (lane & 3) * 2 + (e & 1), key = kr + (e >> 1) * 8;
                        float p = tc_exp2(fmaf(st[n][e], scale_log2, -sL[qc]));
                        if (edge && (key >= N || (causal && q0 + qc < key))) p = 0.0f;
                        st[n][e] = p;
                    }
                // dV += P^T dO
                {
                    tc_u32 pa[KQ][4];
                    tpb_pack<KQ, BF16>(pa, st);
                    tpb_ab<D, KQ, ND, BF16>(dv, pa, oT, 0);
                }
                // dP^T = V dO^T, then dS^T = P^T o (dP^T - Dl) / sqrt(d)
#pragma unroll
                for (int n = 0; n < NQ; ++n) dpt[n][0] = dpt[n][1] = dpt[n][2] = dpt[n][3] = 0.0f;
                tpb_abt<D, NQ, BF16>(dpt, vA, oB);
#pragma unroll
                for (int n = 0; n < NQ; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int qc = n * 8 + (lane & 3) * 2 + (e & 1);
                        dpt[n][e] = st[n][e] * (dpt[n][e] - sD[qc]) * scale;
                    }
                // dK += dS^T Q
                {
                    tc_u32 da[KQ][4];
                    tpb_pack<KQ, BF16>(da, dpt);
                    tpb_ab<D, KQ, ND, BF16>(dk, da, qT, 0);
                }
                if (dQ == nullptr) continue;
                // dS [BR queries x BC keys] through shared memory, then dQ += dS K (atomics)
#pragma unroll
                for (int n = 0; n < NQ; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int qc = n * 8 + (lane & 3) * 2 + (e & 1), kc = warp * 16 + (lane >> 2) + (e >> 1) * 8;
                        sS[tc_swz<BC>(qc, kc >> 3) + (kc & 7)] = tpb_half<BF16>(dpt[n][e]);
                    }
                __syncthreads();
                float dq[NDW][4];
#pragma unroll
                for (int d = 0; d < NDW; ++d) dq[d][0] = dq[d][1] = dq[d][2] = dq[d][3] = 0.0f;
                const int d0 = (warp / RT) * NDW;
                {
                    tc_u32 af[BC / 16][4];  // dS rows of this warp's row tile, all BC keys
#pragma unroll
                    for (int kk = 0; kk < BC / 16; ++kk) tc_ldsm4(af[kk], sA[kk]);
                    tpb_ab<D, BC / 16, NDW, BF16>(dq, af, kT, d0);
                }
                const int qr = q0 + (warp % RT) * 16 + (lane >> 2);
#pragma unroll
                for (int d = 0; d < NDW; ++d)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = qr + (e >> 1) * 8, col = (d0 + d) * 8 + (lane & 3) * 2 + (e & 1);
                        if (row < N) atomicAdd(dQ + (bh * N + row) * D + col, dq[d][e]);
                    }
            }
        }
        // dK and dV of this block's keys (rows < N), rounded once to the storage type
#pragma unroll
        for (int d = 0; d < ND; ++d)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int key = kr + i * 8;
                if (key < N) {
                    const long long off = kv_off + (long long)key * D + d * 8 + (lane & 3) * 2;
                    *(tc_u32 *)(dK + off) = tc_pack<BF16>(dk[d][2 * i], dk[d][2 * i + 1]);
                    *(tc_u32 *)(dV + off) = tc_pack<BF16>(dv[d][2 * i], dv[d][2 * i + 1]);
                }
            }
    }
}

// ------------------------------------------------------------------------------------ dQ, deterministic
template <int D, bool BF16>
__device__ __forceinline__ void tpb_dq(const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K,
                                       const tc_u16 *__restrict__ V, const tc_u16 *__restrict__ dO,
                                       const float *__restrict__ L, const float *__restrict__ Dl,
                                       float *__restrict__ dQ, int BH, int H, int group, int N, float scale,
                                       int causal) {
    constexpr int BR = 64, BC = 64, NT = 128, NS = BC / 8, KC = BC / 16, ND = D / 8;
    tc_u16 *sQ = (tc_u16 *)tpb_smem, *sO = sQ + BR * D, *sK = sO + BR * D, *sV = sK + BC * D;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const float scale_log2 = scale * TPB_LOG2E;
    tc_u32 qA[4], oA[4], kB[4], vB[4], kT[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        qA[i] = tpb_a_base<D>(tc_saddr(sQ), warp * 16, lane, i);
        oA[i] = tpb_a_base<D>(tc_saddr(sO), warp * 16, lane, i);
        kB[i] = tpb_b_base<D>(tc_saddr(sK), lane, i);
        vB[i] = tpb_b_base<D>(tc_saddr(sV), lane, i);
        kT[i] = tpb_t_base<D>(tc_saddr(sK), lane, i);
    }
    const int q0 = blockIdx.x * BR;
    const int r = q0 + warp * 16 + (lane >> 2);  // this thread's rows: r and r + 8
    const int n_kt = causal ? (q0 + BR - 1) / BC + 1 : (N + BC - 1) / BC;
    for (long long bh = blockIdx.y; bh < BH; bh += gridDim.y) {
        const long long kv_off = ((bh / H) * (H / group) + (bh % H) / group) * N * D;
        __syncthreads();
        tpb_load<D, BR, NT>(sQ, Q + bh * N * D, q0, N, tid);
        tpb_load<D, BR, NT>(sO, dO + bh * N * D, q0, N, tid);
        tc_cp_commit();
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
            const int k0 = kt * BC;
            __syncthreads();  // every warp is done with the previous K and V tiles
            tpb_load<D, BC, NT>(sK, K + kv_off, k0, N, tid);
            tpb_load<D, BC, NT>(sV, V + kv_off, k0, N, tid);
            tc_cp_commit();
            tc_cp_wait<0>();
            __syncthreads();
            float s[NS][4], dp[NS][4];
#pragma unroll
            for (int n = 0; n < NS; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
            tpb_abt<D, NS, BF16>(s, qA, kB);
            tpb_abt<D, NS, BF16>(dp, oA, vB);
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
            tpb_ab<D, KC, ND, BF16>(dq, da, kT, 0);
        }
#pragma unroll
        for (int d = 0; d < ND; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = r + (e >> 1) * 8, col = d * 8 + (lane & 3) * 2 + (e & 1);
                if (row < N) dQ[(bh * N + row) * D + col] = dq[d][e];
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
        float *__restrict__ dQ, tc_u16 *__restrict__ dK, tc_u16 *__restrict__ dV, int BG, int G,       \
        int group, int N, float scale, int causal) {                                                   \
        tpb_kv<D, BR, BF16>(Q, K, V, dO, L, Dl, dQ, dK, dV, BG, G, group, N, scale, causal);           \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) fbwd_dq_##SUF##_d##D(                            \
        const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K, const tc_u16 *__restrict__ V,     \
        const tc_u16 *__restrict__ dO, const float *__restrict__ L, const float *__restrict__ Dl,     \
        float *__restrict__ dQ, int BH, int H, int group, int N, float scale, int causal) {            \
        tpb_dq<D, BF16>(Q, K, V, dO, L, Dl, dQ, BH, H, group, N, scale, causal);                       \
    }
// query rows per step of fbwd_kv: 64 at D = 64, 32 at D = 128 (its dK and dV accumulators take 128
// registers a thread there)
TPB_DEFINE(f16, false, 64, 64)
TPB_DEFINE(bf16, true, 64, 64)
TPB_DEFINE(f16, false, 128, 32)
TPB_DEFINE(bf16, true, 128, 32)
