// fused_attention.cu -- one kernel: O = softmax(Q K^T * scale) V with S and P never in device memory.
//
// fused2_* is what --kernel fused runs on GPUs other than compute capability 9.0 (there it runs the
// wgmma kernel of fused_hopper_attention.cu, except for calls too small to fill the GPU with it).
// The straight, unpipelined loop it grew from (fused_*, 1.29 ms in benchmarks/ladder.md) is in the
// git history up to commit 5d28927.
//
// A FlashAttention-2-style forward pass, written for this project:
//   * a block owns BR = 16 * NW query rows of one (batch, head); warp w owns rows 16w..16w+15;
//   * the block's Q tile is copied to shared memory once; each warp reads its rows' mma A
//     fragments from there (ldmatrix) for every key tile;
//   * K and V stream through shared memory in tiles of BC keys, double buffered with cp.async;
//   * S = Q K^T and O += P V run on the tensor cores: mma.sync m16n8k16, fp16 or bf16 inputs,
//     fp32 accumulation; K fragments come from ldmatrix, V fragments from ldmatrix.trans;
//   * softmax is online: each row keeps its running max m (in log2 units, the 1/sqrt(d) scale
//     folded into log2(e)) and its running sum l in registers; P is rounded to the storage type
//     straight from the S accumulators into A fragments, so it never leaves the registers;
//   * causal: key tiles entirely above the block's last row are never loaded, and only tiles that
//     cross the diagonal (or the end of the sequence) are masked element by element;
//   * any N >= 1: rows past N load as zeros (cp.async zero fill) and score -inf; the output is staged
//     through shared memory and written with 16-byte stores for rows < N only.
//
// Lse (may be null): the logsumexp of each row, fp32 [B, H, N], natural log (tc_logsumexp), for the
// backward (fused_attention_backward.cu); null when no backward will run.
//
// Layout: Q and O are [B, H, N, D], K and V [B, H / group, N, D], 16-bit (fp16 or bf16), BH = B * H,
// element (b, h, n, c) at b * sb + h * sh + n * ld + c (q_* for Q; kv_* for K and V, which share
// them; o_* for O: contiguous, or the layer's in-place views of its QKV GEMM output and of the
// output projection's input rows). Grouped-query attention: query head h reads K/V head h / group
// (group = 1: one K/V head per query head; group = H: one for all), in place, never repeated; D = 64
// or 128 (the swizzle below needs D / 8 >= 8 chunks of 16 bytes per row). Every offset that
// scales with BH * N is 64-bit. Shared memory rows are XOR-swizzled (16-byte chunk c of row r is
// stored at chunk c ^ (r & 7)), so ldmatrix and the cp.async stores are free of bank conflicts.
//
// Grid: x over the query tiles [qt_begin, qt_end) (a chunk of the rows, or all; reversed when
// causal, so the longest rows start first), y over batch * heads (with a stride beyond 65535). Block: NW * 32 threads. Dynamic shared memory:
// (BR + 4 * BC) * D * 2 bytes. Shared helpers: tc_common.cuh.

#include "tc_common.cuh"

extern __shared__ __attribute__((aligned(128))) unsigned char tpf_smem[];

// rows [row0, row0 + ROWS) of a [N, D] matrix (rows ld elements apart) into a swizzled shared
// tile; rows >= N become zeros
template <int D, int ROWS, int NT>
__device__ __forceinline__ void tpf_load_tile(tc_u16 *s, const tc_u16 *g, int row0, int N, int tid, long long ld) {
    constexpr int CH = D / 8;
#pragma unroll
    for (int i = 0; i < (ROWS * CH + NT - 1) / NT; ++i) {
        const int c = tid + i * NT;
        if ((ROWS * CH) % NT == 0 || c < ROWS * CH) {
            const int r = c / CH, ch = c % CH;
            const int gr = row0 + r;
            const tc_u16 *src = g + (gr < N ? gr : 0) * ld + ch * 8;
            tc_cp16(tc_saddr(s + tc_swz<D>(r, ch)), src, gr < N ? 16 : 0);
        }
    }
}

// Software pipelined by one key tile: iteration j computes S_{j+1} = Q K_{j+1}^T
// and, in the same basic block, the softmax of S_j and O += P_j V_j: the two are independent, so
// the scheduler can interleave the tensor-core work of one with the exp2/max/rescale work of the
// other instead of every warp of the block alternating between them in step. One __syncthreads
// per key tile (K_{j+2} and V_{j+1} load during iteration j). Each warp owns MT m16 tiles (16 * MT
// query rows), so every K and V fragment read from shared memory feeds MT mma; Q fragments are
// re-read from shared memory per tile (registers go to the accumulators). ldmatrix addresses are a
// few per-lane bases plus compile-time offsets (the swizzle XOR folds: (2k + b) ^ x == 2k ^ (b ^ x)
// for b < 2).
template <int D, int NW, int MT, int BC, bool BF16>
__device__ __forceinline__ void tpf_fused2(const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K,
                                           const tc_u16 *__restrict__ V, tc_u16 *__restrict__ O,
                                           float *__restrict__ Lse, int BH,
                                           int N, float scale_log2, int causal, int qt_begin,
                                           int qt_end, int H, int group, long long q_sb, long long q_sh,
                                           int q_ld, long long kv_sb, long long kv_sh, int kv_ld,
                                           long long o_sb, long long o_sh, int o_ld) {
    constexpr int WR = 16 * MT;   // rows per warp
    constexpr int BR = WR * NW;   // rows per block
    constexpr int NT = 32 * NW;
    constexpr int CH = D / 8;
    constexpr int KD = D / 16;
    constexpr int NS = BC / 8;
    constexpr int ND = D / 8;
    constexpr int KC = BC / 16;
    constexpr int TILE_BYTES = BC * D * 2;
    tc_u16 *sQ = (tc_u16 *)tpf_smem;
    tc_u16 *sK = sQ + BR * D;
    tc_u16 *sV = sK + 2 * BC * D;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int x = lane & 7;
    const int n_kt_all = (N + BC - 1) / BC;
    tc_u32 qa[4], ka[4], va[4];  // per-lane ldmatrix bases (shared window, bytes)
    {
        const int qrow = warp * WR + x + ((lane >> 3) & 1) * 8, qy = (lane >> 4) ^ x;
        const int krow = x + ((lane >> 4) << 3), ky = ((lane >> 3) & 1) ^ x;
        const int vrow = x + (((lane >> 3) & 1) << 3), vy = (lane >> 4) ^ x;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            qa[i] = tc_saddr(sQ) + qrow * D * 2 + (((2 * i) ^ qy) << 4);
            ka[i] = tc_saddr(sK) + krow * D * 2 + (((2 * i) ^ ky) << 4);
            va[i] = tc_saddr(sV) + vrow * D * 2 + (((2 * i) ^ vy) << 4);
        }
    }

    for (int bh = blockIdx.y; bh < BH; bh += gridDim.y) {
        const int b = bh / H, hh = bh - b * H;
        const long long kv = b * kv_sb + (hh / group) * kv_sh;  // the K/V head of query head hh
        const tc_u16 *Kh = K + kv, *Vh = V + kv;
        tc_u16 *Oh = O + b * o_sb + hh * o_sh;
        for (int qi = blockIdx.x; qi < qt_end - qt_begin; qi += gridDim.x) {
            const int qt = causal ? qt_end - 1 - qi : qt_begin + qi;  // causal: the longest rows first
            const int q0 = qt * BR;
            int n_kt = n_kt_all;
            if (causal) {
                const int last = (q0 + BR - 1) / BC + 1;
                n_kt = last < n_kt ? last : n_kt;
            }
            {  // Q's offset is recomputed per tile: not live across the key loop (fewer spills at D = 128)
                const int bq = tc_opaque(bh) / H, hq = tc_opaque(bh) - bq * H;
                tpf_load_tile<D, BR, NT>(sQ, Q + bq * q_sb + hq * q_sh, q0, N, tid, q_ld);
            }
            tpf_load_tile<D, BC, NT>(sK, Kh, 0, N, tid, kv_ld);
            tc_cp_commit();
            if (n_kt > 1) tpf_load_tile<D, BC, NT>(sK + BC * D, Kh, BC, N, tid, kv_ld);
            tc_cp_commit();
            tpf_load_tile<D, BC, NT>(sV, Vh, 0, N, tid, kv_ld);
            tc_cp_commit();
            asm volatile("cp.async.wait_group 2;\n" ::: "memory");
            __syncthreads();

            const int wr0 = q0 + warp * WR;          // the warp's first row
            const int r0 = wr0 + (lane >> 2);        // this thread's rows: r0 + 16 mt + 8 i
            float o[MT][ND][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < ND; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.0f;
            float m[MT][2], l[MT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = TC_NEG_INF, l[mt][0] = l[mt][1] = 0.0f;
            float sc[MT][NS][4], sn[MT][NS][4];

            auto qk = [&](float (*acc)[NS][4], int kb) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int n = 0; n < NS; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < KD; ++kk) {
                    tc_u32 a[MT][4];
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) tc_ldsm4(a[mt], qa[kk & 3] + (kk >> 2) * 128 + mt * 16 * D * 2);
#pragma unroll
                    for (int n = 0; n < NS; n += 2) {
                        tc_u32 b[4];
                        tc_ldsm4(b, ka[kk & 3] + kb * TILE_BYTES + (kk >> 2) * 128 + n * 8 * D * 2);
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            tc_mma<BF16>(acc[mt][n], a[mt], b[0], b[1]);
                            tc_mma<BF16>(acc[mt][n + 1], a[mt], b[2], b[3]);
                        }
                    }
                }
            };
            auto mask = [&](float (*acc)[NS][4], int k0) {
                if (k0 + BC > N || (causal && k0 + BC - 1 > wr0)) {
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int n = 0; n < NS; ++n)
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const int col = k0 + n * 8 + (lane & 3) * 2 + (e & 1);
                                const int row = r0 + mt * 16 + (e >> 1) * 8;
                                if (col >= N || (causal && col > row)) acc[mt][n][e] = TC_NEG_INF;
                            }
                }
            };
            qk(sc, 0);
            mask(sc, 0);

            for (int j = 0; j < n_kt; ++j) {
                tc_cp_wait<0>();       // K tile j + 1 and V tile j have landed ...
                __syncthreads();   // ... for all; everyone is done with K tile j and V tile j - 1
                if (j + 2 < n_kt) tpf_load_tile<D, BC, NT>(sK + (j & 1) * BC * D, Kh, (j + 2) * BC, N, tid, kv_ld);
                if (j + 1 < n_kt) tpf_load_tile<D, BC, NT>(sV + ((j + 1) & 1) * BC * D, Vh, (j + 1) * BC, N, tid, kv_ld);
                tc_cp_commit();
                // S_{j+1} (on the last tile this reads a stale buffer and is discarded)
                qk(sn, (j + 1) & 1);
                // softmax of S_j, then O += P_j V_j
                tc_u32 pa[MT][KC][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        float mx = TC_NEG_INF;
#pragma unroll
                        for (int n = 0; n < NS; ++n) mx = fmaxf(mx, fmaxf(sc[mt][n][2 * i], sc[mt][n][2 * i + 1]));
                        mx = fmaxf(mx, tc_shfl_xor(mx, 1));
                        mx = fmaxf(mx, tc_shfl_xor(mx, 2));
                        const float mn = fmaxf(m[mt][i], mx * scale_log2);
                        const float ms = mn == TC_NEG_INF ? 0.0f : mn;  // a row with nothing seen yet
                        const float alpha = tc_exp2(m[mt][i] - ms);
                        m[mt][i] = mn;
                        float sum = 0.0f;
#pragma unroll
                        for (int n = 0; n < NS; ++n) {
                            const float p0 = tc_exp2(fmaf(sc[mt][n][2 * i], scale_log2, -ms));
                            const float p1 = tc_exp2(fmaf(sc[mt][n][2 * i + 1], scale_log2, -ms));
                            sc[mt][n][2 * i] = p0;
                            sc[mt][n][2 * i + 1] = p1;
                            sum += p0 + p1;
                        }
                        l[mt][i] = l[mt][i] * alpha + sum;
#pragma unroll
                        for (int d = 0; d < ND; ++d) {
                            o[mt][d][2 * i] *= alpha;
                            o[mt][d][2 * i + 1] *= alpha;
                        }
                    }
#pragma unroll
                    for (int t = 0; t < KC; ++t) {
                        pa[mt][t][0] = tc_pack<BF16>(sc[mt][2 * t][0], sc[mt][2 * t][1]);
                        pa[mt][t][1] = tc_pack<BF16>(sc[mt][2 * t][2], sc[mt][2 * t][3]);
                        pa[mt][t][2] = tc_pack<BF16>(sc[mt][2 * t + 1][0], sc[mt][2 * t + 1][1]);
                        pa[mt][t][3] = tc_pack<BF16>(sc[mt][2 * t + 1][2], sc[mt][2 * t + 1][3]);
                    }
                }
#pragma unroll
                for (int t = 0; t < KC; ++t) {
#pragma unroll
                    for (int d = 0; d < ND; d += 2) {
                        tc_u32 b[4];
                        tc_ldsm4t(b, va[(d >> 1) & 3] + (j & 1) * TILE_BYTES + (d >> 3) * 128 + t * 16 * D * 2);
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            tc_mma<BF16>(o[mt][d], pa[mt][t], b[0], b[1]);
                            tc_mma<BF16>(o[mt][d + 1], pa[mt][t], b[2], b[3]);
                        }
                    }
                }
                mask(sn, (j + 1) * BC);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int n = 0; n < NS; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) sc[mt][n][e] = sn[mt][n][e];
            }

            // O = acc / l, staged through the warp's own rows of sQ, then 16-byte stores
            __syncthreads();  // the last (discarded) S_{j+1} read K; every warp is past its Q reads
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    float li = l[mt][i];
                    li += tc_shfl_xor(li, 1);
                    li += tc_shfl_xor(li, 2);
                    const int r = warp * WR + mt * 16 + (lane >> 2) + i * 8;
                    if (Lse != nullptr && (lane & 3) == 0 && q0 + r < N)  // the backward's L, one per row
                        Lse[(long long)bh * N + q0 + r] = tc_logsumexp(m[mt][i], li);
                    li = li > 0.0f ? 1.0f / li : 0.0f;
#pragma unroll
                    for (int d = 0; d < ND; ++d) {
                        tc_u32 *dst = (tc_u32 *)(sQ + tc_swz<D>(r, d) + (lane & 3) * 2);
                        *dst = tc_pack<BF16>(o[mt][d][2 * i] * li, o[mt][d][2 * i + 1] * li);
                    }
                }
            }
            __syncwarp();
#pragma unroll
            for (int i = 0; i < WR * CH / 32; ++i) {
                const int c = lane + i * 32;
                const int r = c / CH, ch = c % CH;
                const int gr = wr0 + r;
                if (gr < N)
                    *(tc_u4 *)(Oh + (long long)gr * o_ld + ch * 8) = *(const tc_u4 *)(sQ + tc_swz<D>(warp * WR + r, ch));
            }
            __syncthreads();  // sQ, sK, sV are reused by the block's next tile (when the grid strides)
        }
    }
}

#define TPF_DEFINE2(SUF, BF16, D, NW, MT, BC)                                                          \
    extern "C" __global__ void __launch_bounds__(NW * 32)                                             \
        fused2_##SUF##_d##D##_w##NW##_m##MT##_c##BC(const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K, \
                                                    const tc_u16 *__restrict__ V, tc_u16 *__restrict__ O, \
                                                    float *__restrict__ Lse,                         \
                                                    int BH, int N, float scale_log2, int causal,     \
                                                    int qt_begin, int qt_end, int H, int group,      \
                                                    long long q_sb, long long q_sh, int q_ld,        \
                                                    long long kv_sb, long long kv_sh, int kv_ld,     \
                                                    long long o_sb, long long o_sh, int o_ld) {      \
        tpf_fused2<D, NW, MT, BC, BF16>(Q, K, V, O, Lse, BH, N, scale_log2, causal, qt_begin, qt_end, H,   \
                                        group, q_sb, q_sh, q_ld, kv_sb, kv_sh, kv_ld, o_sb, o_sh,     \
                                        o_ld);                                                        \
    }
// Configurations (warps, m16 tiles per warp, keys per tile); the default is w4_m1_c64 for both head
// dims (tpattn/attention/fused.py), the others are there for the benchmark's sweep. MT = 2 with
// 64 keys at D = 64 spills registers and is not built.
#define TPF_DEFINE2_ALL(D, NW, MT, BC) TPF_DEFINE2(f16, false, D, NW, MT, BC) TPF_DEFINE2(bf16, true, D, NW, MT, BC)
TPF_DEFINE2_ALL(64, 4, 1, 64)
TPF_DEFINE2_ALL(64, 4, 2, 32)
TPF_DEFINE2_ALL(128, 4, 1, 64)
TPF_DEFINE2_ALL(128, 8, 1, 64)
TPF_DEFINE2_ALL(128, 4, 2, 32)
TPF_DEFINE2_ALL(128, 8, 2, 32)
