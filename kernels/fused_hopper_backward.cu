// fused_hopper_backward.cu -- the fused backward of attention on Hopper's wgmma (compute capability
// 9.0, compiled as sm_90a), in two forms:
//   five products (the default): hbwd_pre (Dl, and the fp32 dQ sum zeroed), hbwd5_kv (per step S^T,
//     dP^T, dV, dK and dQ += dS K, the last added to the sum: see "dQ by adds"), hbwd_dq_out (the sum
//     to dQ). The adds arrive in any order, so dQ's last bits may differ from run to run.
//   seven products (deterministic=True): fused_attention_backward.cu's algorithm (FlashAttention-2's,
//     with dQ in a kernel of its own instead of atomics, so every sum runs in a fixed order and the
//     result is the same bits every run), below.
// The products run on the asynchronous warpgroup instructions, whose operands come straight from
// shared memory in the layout the forward's wgmma kernels use (hopper_common.cuh).
//
// The math (S = Q K^T / sqrt(d), P = softmax(S) = exp(S - L) with the forward's logsumexp L, O = P V):
//   dV = P^T dO    dP = dO V^T    Dl = rowsum(dO o O)    dS = P o (dP - Dl)
//   dQ = dS K / sqrt(d)    dK = dS^T Q / sqrt(d)
// Two launches: hbwd_dq first (it also computes Dl of its rows from O and dO and writes it), then
// hbwd_kv (which reads Dl).
//
//   hbwd_kv   a block is two warpgroups and owns BC = 128 keys of one K/V head (warpgroup w: keys
//             64w..64w+63) and walks BM = 64 query rows at a time over every query head of its group
//             (grouped-query attention: dK and dV summed over the group in registers, K and V never
//             repeated). Per step, in each warpgroup:
//               S^T = K Q^T and dP^T = V dO^T   wgmma m64n64k16, both operands in shared memory;
//               P^T = exp2(S^T log2e / sqrt(d) - L log2e), dS^T = P^T o (dP^T - Dl) / sqrt(d), in registers;
//               dV += P^T dO and dK += dS^T Q   wgmma m64nDk16, A from the registers just computed
//                                               (rounded to the storage type), B read transposed;
//             the next step's Q and dO tiles (and their L, Dl) load with cp.async meanwhile.
//   hbwd_dq   a block is two warpgroups and owns BR = 128 query rows of one head (64 a warpgroup)
//             and walks BN = 64 keys at a time: S = Q K^T and dP = dO V^T (shared x shared), P, dS,
//             then dQ += dS K (registers x shared, K read transposed). Software pipelined: the
//             product dQ += dS_{j-1} K_{j-1} runs behind S_j and dP_j while dS_j is computed; K and
//             V tiles in three buffers, the next one loading meanwhile. It recomputes S and dP:
//             seven products in all where FlashAttention-2 does five, the price of no atomics.
// Causal: query tiles wholly before a key block are never visited (hbwd_kv starts at the first query
// tile that reaches its keys; hbwd_dq stops at the last key tile its rows reach; its longest tiles
// start first); only tiles that cross the diagonal or the end of the sequence are masked element by
// element. Any N >= 1: rows past N load as zeros (cp.async zero fill); keys past N get P = 0, query
// rows past N get L = +inf (P = 0); a row whose L is +inf (every key masked) gets zero gradients,
// never NaN. dK, dV and dQ leave through shared memory in 16-byte stores, rows < N only.
//
// Layout: Q, O, dO, dQ [B, H, N, D] contiguous; K, V, dK, dV [B, G, N, D] contiguous (G K/V heads,
// group = H / G query heads each); L and Dl fp32 [B, H, N]. 16-bit storage (fp16 or bf16), fp32
// accumulation, D = 64 or 128. Offsets that scale with B * H * N are 64-bit; grid y walks batch x
// heads with a stride beyond 65535. Block 256 threads, one block an SM (registers); dynamic shared
// memory: hbwd_kv 2 * 128 * D * 2 + 4 * 64 * D * 2 + 1024 + 1024 bytes (hbwd5_kv: + 2 * 128 * 64 * 2
// for two dS^T buffers), hbwd_dq 2 * 128 * D * 2 + 6 * 64 * D * 2 + 1024 (the 1024 aligns the swizzle atoms).

#include "hopper_async.cuh"

#define HB_LOG2E 1.4426950408889634f

// ------------------------------------------------------------------------------------ dQ by adds
// The five-product kernel's dQ: each step's dS K (64 query rows x D) added to an fp32 sum dQa that
// hbwd_pre zeroed. Warpgroup w computes, from dS^T in shared memory (A, MN-major) and the K tile (B,
// MN-major): at D = 128 columns 64w..64w+63 over all 128 keys (at D = 64, below, a column half). dQa
// is laid out as the accumulators are held, so that each thread adds its 32 in eight 16-byte
// reductions (red.global.add.v4.f32) and a warp's reductions cover 512 contiguous bytes:
//   dQa[bh][query tile of 64][D / 64 column panels][g 8][thread 128][4]   (fp32)
// holds, for thread t = 32 warp + lane and accumulator i = 4 g + e (the m64n64 layout), row
// 16 warp + lane / 4 + 8 (e >> 1) and column 64 panel + 8 g + 2 (lane % 4) + (e & 1) of the tile;
// hbwd_dq_out turns it into dQ. At D = 64 each warpgroup takes a column half over all 128 keys instead
// (m64n32, 16 accumulators, groups 4 w + g of the layout), so each element is added once a step. The
// adds of a step run behind the next step's S^T and dP^T (hb_kv's rotated loop), not in its path.
// (A bulk reduce-add of each warpgroup's 64 x 64 from shared memory, as FlashAttention-3 does, measured 1.87 ms against 1.68 for these reductions at B=1 H=32 N=4096
// d=128 on the H200, before the adds moved behind the next step: the staging stores and the waits for
// the bulk copy's reads cost more.)
#define HB_SS_T(N, T, OPS, DA, DB, SC) "{\n.reg .pred p;\nsetp.ne.b32 p, " SC ", 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." T "." T " {" OPS "}, " DA ", " DB ", p, 1, 1, 1, 1;\n}\n"

// acc (64 x 64) = A B with A and B both MN-major in shared memory (transposed reads)
template <bool BF16>
__device__ __forceinline__ void hb_mma_tt_n64(float (&d)[32], tc_u64 da, tc_u64 db, int scale_d) {
    if (BF16)
        asm volatile(HB_SS_T(64, "bf16", HW_OPS32, "%32", "%33", "%34") : HW_F32(d) : "l"(da), "l"(db), "r"(scale_d));
    else
        asm volatile(HB_SS_T(64, "f16", HW_OPS32, "%32", "%33", "%34") : HW_F32(d) : "l"(da), "l"(db), "r"(scale_d));
}

// the same with the accumulators written, not read (scale-d 0): the first k-step of a product, so that the
// registers are dead until it
#define HB_SS_T0(N, T, OPS, DA, DB) "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." T "." T " {" OPS "}, " DA ", " DB ", 0, 1, 1, 1, 1;\n"
#define HW_F8W(d, o) "=f"(d[o]), "=f"(d[o + 1]), "=f"(d[o + 2]), "=f"(d[o + 3]), "=f"(d[o + 4]), "=f"(d[o + 5]), \
                     "=f"(d[o + 6]), "=f"(d[o + 7])
template <bool BF16>
__device__ __forceinline__ void hb_mma_tt_n64_first(float (&d)[32], tc_u64 da, tc_u64 db) {
    if (BF16)
        asm volatile(HB_SS_T0(64, "bf16", HW_OPS32, "%32", "%33")
                     : HW_F8W(d, 0), HW_F8W(d, 8), HW_F8W(d, 16), HW_F8W(d, 24) : "l"(da), "l"(db));
    else
        asm volatile(HB_SS_T0(64, "f16", HW_OPS32, "%32", "%33")
                     : HW_F8W(d, 0), HW_F8W(d, 8), HW_F8W(d, 16), HW_F8W(d, 24) : "l"(da), "l"(db));
}

template <int D, bool BF16>
__device__ __forceinline__ void hb_dq_product(float (&dq)[32], tc_u32 sDS, tc_u32 sK, int wg) {
    static_assert(D == 128, "D = 64 takes the column-half product below");
    const tc_u32 col = wg * 128 * 128;  // the column panel of K (128 rows x 128 bytes)
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {  // k16 steps of keys
        const tc_u32 row = kk * 16 * 128;
        const tc_u64 da = hw_desc(sDS + row, 128 * 128, 1024), db = hw_desc(sK + col + row, 128 * 128, 1024);
        if (kk == 0)
            hb_mma_tt_n64_first<BF16>(dq, da, db);
        else
            hb_mma_tt_n64<BF16>(dq, da, db, 1);
    }
}

// D = 64 (HALF in hb_kv): warpgroup w computes columns 32w..32w+31 of the step's dQ over
// all 128 keys (m64n32), so that each element is added once a step, not once per warpgroup
#define HW_OPS16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
template <bool BF16>
__device__ __forceinline__ void hb_mma_tt_n32(float (&d)[16], tc_u64 da, tc_u64 db, int first) {
    if (first) {
        if (BF16)
            asm volatile(HB_SS_T0(32, "bf16", HW_OPS16, "%16", "%17") : HW_F8W(d, 0), HW_F8W(d, 8) : "l"(da), "l"(db));
        else
            asm volatile(HB_SS_T0(32, "f16", HW_OPS16, "%16", "%17") : HW_F8W(d, 0), HW_F8W(d, 8) : "l"(da), "l"(db));
    } else {
        if (BF16)
            asm volatile(HB_SS_T(32, "bf16", HW_OPS16, "%16", "%17", "%18") : HW_F8(d, 0), HW_F8(d, 8)
                         : "l"(da), "l"(db), "r"(1));
        else
            asm volatile(HB_SS_T(32, "f16", HW_OPS16, "%16", "%17", "%18") : HW_F8(d, 0), HW_F8(d, 8)
                         : "l"(da), "l"(db), "r"(1));
    }
}

template <int D, bool BF16>
__device__ __forceinline__ void hb_dq_product(float (&dq)[16], tc_u32 sDS, tc_u32 sK, int wg) {
    static_assert(D == 64, "the split dQ product is D = 64's");
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
        const tc_u32 row = kk * 16 * 128;
        hb_mma_tt_n32<BF16>(dq, hw_desc(sDS + row, 128 * 128, 1024), hw_desc(sK + wg * 64 + row, 128 * 128, 1024),
                            kk == 0);
    }
}

// its 64 x 32 added to columns 32 wg.. of the 64 x 64 at dst: the accumulator groups g = 0..3 of an
// m64n32 are groups 4 wg + g of the m64n64 layout
__device__ __forceinline__ void hb_dq_add(float *__restrict__ dst, const float (&dq)[16], int tid) {
    float *p = dst + (tid >> 7) * 4 * 512 + (tid & 127) * 4;
#pragma unroll
    for (int g = 0; g < 4; ++g)
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p + g * 512), "f"(dq[4 * g]),
                     "f"(dq[4 * g + 1]), "f"(dq[4 * g + 2]), "f"(dq[4 * g + 3]) : "memory");
}

// the warpgroup's dq added to the 64 x 64 of dQa at dst: eight 16-byte reductions a thread
// (red.global.add.v4.f32), a warp's covering 512 contiguous bytes
__device__ __forceinline__ void hb_dq_add(float *__restrict__ dst, const float (&dq)[32], int tid) {
    float *p = dst + (tid & 127) * 4;
#pragma unroll
    for (int g = 0; g < 8; ++g)
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p + g * 512), "f"(dq[4 * g]),
                     "f"(dq[4 * g + 1]), "f"(dq[4 * g + 2]), "f"(dq[4 * g + 3]) : "memory");
}

// element strides of a [B, H, N, D] tensor whose rows are contiguous (a view of a packed [B, N, H', D] one,
// or contiguous): batch, head and row; rows and their starts 16-byte aligned
struct hb_strides {
    long long b, h, n;
    __device__ __forceinline__ long long at(int bi, int hi, int ni) const { return bi * b + hi * h + ni * n; }
};

// Dl = rowsum(dO o O) of every row (fp32, a warp a row), and the zeros of dQa (n4 16-byte chunks):
// the five-product backward's first pass
template <int D, bool BF16>
__device__ __forceinline__ void hb_pre(const tc_u16 *__restrict__ O, const tc_u16 *__restrict__ dO,
                                       float *__restrict__ Dl, float4 *__restrict__ dQa, long long rows, long long n4,
                                       int H, int N, hb_strides so, hb_strides sd) {
    constexpr int E = D / 32;  // elements a lane: 4 or 2
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
        const long long bh = r / N;
        const int n = (int)(r - bh * N), b = (int)(bh / H), h = (int)(bh - (long long)b * H);
        const tc_u32 *o = (const tc_u32 *)(O + so.at(b, h, n) + lane * E), *g = (const tc_u32 *)(dO + sd.at(b, h, n) + lane * E);
        float acc = 0.0f;
#pragma unroll
        for (int w = 0; w < E / 2; ++w) {
            float o0, o1, g0, g1;
            tc_unpack<BF16>(o[w], o0, o1);
            tc_unpack<BF16>(g[w], g0, g1);
            acc = fmaf(o0, g0, fmaf(o1, g1, acc));
        }
        acc = tc_warp_sum(acc);
        if (lane == 0) Dl[r] = acc;
    }
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += warps * 32)
        dQa[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// dQ from dQa: a block per 64 x 64 tile (a query tile's column panel) gathers it into shared memory
// in row order, then writes rows < N in 16-byte stores, rounded to the storage type
template <int D, bool BF16>
__device__ __forceinline__ void hb_dq_out(const float4 *__restrict__ dQa, tc_u16 *__restrict__ dQ, int N,
                                          long long tiles, int H, hb_strides sq) {
    __shared__ float tile[64][68];  // rows 68 floats apart: 16-byte aligned, few bank conflicts
    constexpr int P = D / 64;
    const int n_qt = (N + 63) / 64, tid = threadIdx.x;
    for (long long x = blockIdx.x; x < tiles; x += gridDim.x) {
        const long long bh = x / ((long long)n_qt * P);
        const int qt = (int)(x / P % n_qt), panel = (int)(x % P);
        __syncthreads();  // the previous tile is written out
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int f = tid + 256 * k, t = f & 127, g = f >> 7, lane = t & 31;
            const int r = (t >> 5) * 16 + (lane >> 2), c = g * 8 + (lane & 3) * 2;
            const float4 v = dQa[x * 1024 + f];
            tile[r][c] = v.x;
            tile[r][c + 1] = v.y;
            tile[r + 8][c] = v.z;
            tile[r + 8][c + 1] = v.w;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int ch = tid + 256 * k, r = ch >> 3, c = (ch & 7) * 8, row = qt * 64 + r;
            if (row < N) {
                const float *src = &tile[r][c];
                tc_u4 w;
                w.x = tc_pack<BF16>(src[0], src[1]);
                w.y = tc_pack<BF16>(src[2], src[3]);
                w.z = tc_pack<BF16>(src[4], src[5]);
                w.w = tc_pack<BF16>(src[6], src[7]);
                *(tc_u4 *)(dQ + sq.at((int)(bh / H), (int)(bh % H), row) + panel * 64 + c) = w;
            }
        }
    }
}

// P^T = exp2(S^T scale log2 e - L log2 e) (0 where masked) and dS^T = P^T o (dP^T - Dl) scale of a
// warpgroup's 64 keys x a step's 64 queries, from the accumulators st and dpt of the products in flight
// (SPLIT: S^T committed apart, so P^T runs while dP^T is still in the tensor cores), rounded into pa and
// da (A operands of dV and dK); kr: this thread's first key, q0: the step's first query row
template <bool BF16, bool SPLIT>
__device__ __forceinline__ void hb_p_ds(tc_u32 (&pa)[4][4], tc_u32 (&da)[4][4], float (&st)[32], float (&dpt)[32],
                                        const float *cL, const float *cD, int kr, int q0, bool edge, int N, int causal,
                                        float scale_log2, float scale, int lane) {
    hw_wg_wait<SPLIT ? 1 : 0>();
    hw_keep(st);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int qc = j * 8 + (lane & 3) * 2 + (e & 1), key = kr + (e >> 1) * 8;
            float p = tc_exp2(fmaf(st[4 * j + e], scale_log2, -cL[qc]));
            if (edge && (key >= N || (causal && q0 + qc < key))) p = 0.0f;
            st[4 * j + e] = p;
        }
    hw_wg_wait<0>();
    hw_keep(dpt);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int qc = j * 8 + (lane & 3) * 2 + (e & 1);
            dpt[4 * j + e] = st[4 * j + e] * (dpt[4 * j + e] - cD[qc]) * scale;
        }
    hw_pack_p<BF16>(pa, st);
    hw_pack_p<BF16>(da, dpt);
}

// ------------------------------------------------------------------------------------ dK, dV
// DQ (the five-product kernel): dQ += dS K of the step's 64 query rows too, added to the fp32 dQa.
// L, Dl and dQa may hold more rows per head than the call's N (the ring's pieces, summed into one set of
// query rows): head bh's row r is at L[bh ldn + qoff + r], and its dQa tile at bh ceil(ldn / 64) +
// (qoff + r) / 64 (qoff a multiple of 64); a plain call has ldn = N, qoff = 0
template <int D, bool BF16, bool DQ>
__device__ __forceinline__ void hb_kv(const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K,
                                      const tc_u16 *__restrict__ V, const tc_u16 *__restrict__ dO,
                                      const float *__restrict__ L, const float *__restrict__ Dl,
                                      tc_u16 *__restrict__ dK, tc_u16 *__restrict__ dV, float *__restrict__ dQa,
                                      int BG, int G, int group, int N, float scale, int causal, int ldn, int qoff) {
    constexpr int BC = 128, BM = 64, NT = 256;
    constexpr tc_u32 KB = BC * D * 2, MB = BM * D * 2;  // bytes of a K (or V) tile, of a Q (or dO) tile
    // shared: K, V (this block's keys), two buffers of (Q, dO), then L and Dl of each buffer; with DQ
    // then dS^T (128 keys x 64 queries, the tile layout)
    const tc_u32 sK = hw_smem_base(), sV = sK + KB, sB = sV + KB;  // buffer b: Q at sB + 2 b MB, dO + MB
    float *sLD = (float *)(hw_smem + (sB + 4 * MB - tc_saddr(hw_smem)));  // [buffer][L 64, Dl 64]
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int rl = wg * 64 + warp * 16 + (lane >> 2);  // this thread's keys in the block: rl and rl + 8
    // The five-product kernel's choices, measured on the H200 (docs/backward.md): DEFER, the dQ product
    // waited for and added behind the next step's S^T and dP^T; SPLIT (D = 128), P^T computed while dP^T
    // is still in the tensor cores (at D = 64 it measured no better); HALF (D = 64), each warpgroup a
    // column half of dQ over all 128 keys, so that each element is added once a step, not twice
    constexpr bool SPLIT = DQ && D == 128, DEFER = DQ, HALF = DQ && D == 64;
    const tc_u32 sDS0 = sB + 4 * MB + 1024;
    const float scale_log2 = scale * HB_LOG2E;
    const int k0 = blockIdx.x * BC, kr = k0 + rl;
    const int n_qt = (N + BM - 1) / BM, qt_first = causal ? k0 / BM : 0, per = n_qt - qt_first;
    const int ld_qt = (ldn + BM - 1) / BM;  // dQa's query tiles a head
    L += qoff;  // (the call's first row of each head)
    Dl += qoff;
    if constexpr (DQ) dQa += (long long)(qoff / BM) * (D / 64) * 4096;
    const int steps = group * per;  // (query head of the group, query tile) pairs
    for (int bg = blockIdx.y; bg < BG; bg += gridDim.y) {
        const long long kv_off = (long long)bg * N * D, bh0 = (long long)bg * group;  // bg = b G + g
        // step t: query head bh0 + t / per, query tile qt_first + (t + rot) % per, into buffer t & 1. DQ:
        // the key blocks of a head start at tiles spread over its query tiles (rot), so that they do not
        // all add to the same dQ tile at once
        const int rot = DQ ? (int)(((long long)blockIdx.x * per) / gridDim.x) : 0;
        auto issue = [&](int t) {
            const int buf = t & 1;
            const long long bh = bh0 + t / per;
            const int q0 = (qt_first + (t + rot) % per) * BM;
            hw_load_tile<D, BM, NT>(sB + buf * 2 * MB, Q + bh * N * D, q0, N, tid);
            hw_load_tile<D, BM, NT>(sB + buf * 2 * MB + MB, dO + bh * N * D, q0, N, tid);
            if (tid < 2 * BM) {
                const int r = q0 + (tid & (BM - 1));
                float x;
                if (tid < BM)
                    x = r < N ? L[bh * ldn + r] * HB_LOG2E : TC_POS_INF;
                else
                    x = r < N ? Dl[bh * ldn + r] : 0.0f;
                sLD[buf * 2 * BM + tid] = x;
            }
            tc_cp_commit();
        };
        __syncthreads();  // the previous head's tiles are no longer read
        hw_load_tile<D, BC, NT>(sK, K + kv_off, k0, N, tid);
        hw_load_tile<D, BC, NT>(sV, V + kv_off, k0, N, tid);
        tc_cp_commit();
        issue(0);  // steps >= 1: k0 < N, so the first query tile that reaches it exists
        float dk[D / 2], dv[D / 2];
        float dq[HALF ? 16 : 32];  // the dQ product of the step back() issued, added in the next front()
        float *dq_dst = nullptr;
#pragma unroll
        for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.0f;
        tc_u32 pa[4][4], da[4][4];  // the step's P^T and dS^T, rounded: A operands of dV and dK's products
        // The loop is rotated: iteration it finishes step it - 1 (back: dV += P^T dO, dK += dS^T Q and, DQ,
        // dQ += dS K) and begins step it (front: its tiles in, S^T and dP^T, P^T and dS^T into pa and da).
        // Without DEFER, back waits for all three products and adds dQ; DEFER: it waits for dV and dK's
        // only (the Q, dO buffer is then free), and front waits for dQ's behind the issue of S^T and dP^T
        // and adds it to dQa while they run. Either way each product is issued and waited for in one
        // iteration.
        for (int it = 0; it <= steps; ++it) {
            if (it > 0) {
                const int t = it - 1, buf = t & 1, q0 = (qt_first + (t + rot) % per) * BM;
                const tc_u32 sq = sB + buf * 2 * MB, sdo = sq + MB;
                // DEFER: two dS^T buffers (the other warpgroup's previous dQ product may still read the other one)
                const tc_u32 sDS = DEFER ? sDS0 + (t & 1) * 128 * 64 * 2 : sDS0;
                if constexpr (DQ) {
                    // dS^T into shared memory (rows: keys), the A operand of dQ = dS K read MN-major
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            hw_st_shared(sDS + hw_swz<128>(rl + 8 * (e & 1), 2 * kk + (e >> 1)) + (lane & 3) * 4, da[kk][e]);
                    hw_fence_proxy();
                }
                hw_keep(dv);
                hw_keep(dk);
                hw_keep(pa);
                hw_keep(da);
                hw_wg_fence();
                hw_ab<D, 4, BM, BF16>(dv, pa, sdo);  // dV += P^T dO
                hw_ab<D, 4, BM, BF16>(dk, da, sq);   // dK += dS^T Q
                hw_wg_commit();
                if constexpr (DQ) {
                    // dq: this warpgroup's 64 x 64 of the step's dQ (see hb_dq_product)
                    __syncthreads();  // dS^T of both warpgroups is in (the products above run meanwhile)
                    hw_wg_fence();
                    hb_dq_product<D, BF16>(dq, sDS, sK, wg);
                    hw_wg_commit();
                    const long long tile = ((bh0 + t / per) * ld_qt + q0 / BM) * (D / 64) + (D == 128 ? wg : 0);
                    dq_dst = dQa + tile * 4096;
                    if constexpr (DEFER) {
                        hw_wg_wait<1>();
                        hw_keep(dv);
                        hw_keep(dk);
                        hw_keep(pa);
                        hw_keep(da);
                    } else {
                        hw_wg_wait<0>();
                        hw_keep(dq);
                        hw_keep(dv);
                        hw_keep(dk);
                        hw_keep(pa);
                        hw_keep(da);
                        hb_dq_add(dq_dst, dq, tid);
                    }
                } else {
                    hw_wg_wait<0>();
                    hw_keep(dv);
                    hw_keep(dk);
                    hw_keep(pa);
                    hw_keep(da);
                }
            }
            if (it < steps) {
                const int t = it, buf = t & 1, q0 = (qt_first + (t + rot) % per) * BM;
                tc_cp_wait<0>();  // this step's tiles (and K, V) have landed ...
                hw_fence_proxy();
                __syncthreads();  // ... for every thread; both warpgroups are done with the other buffer
                if (t + 1 < steps) issue(t + 1);
                const tc_u32 sq = sB + buf * 2 * MB, sdo = sq + MB;
                const float *cL = sLD + buf * 2 * BM, *cD = cL + BM;
                float st[32], dpt[32];  // S^T and dP^T: this warpgroup's 64 keys x the step's 64 queries
                hw_keep(st);
                hw_keep(dpt);
                hw_wg_fence();
                hw_abt<D, BC, BM, BF16>(st, sK + wg * 64 * 128, sq);
                if constexpr (SPLIT) hw_wg_commit();
                hw_abt<D, BC, BM, BF16>(dpt, sV + wg * 64 * 128, sdo);
                hw_wg_commit();
                if constexpr (DEFER) {
                    // the previous step's dQ product, its adds beside S^T and dP^T (at t = 0 nothing
                    // older than those two is pending: the wait passes)
                    hw_wg_wait<SPLIT ? 2 : 1>();
                    if (t > 0) {
                        hw_keep(dq);
                        hb_dq_add(dq_dst, dq, tid);
                    }
                }
                const bool edge = k0 + BC > N || (causal && q0 < k0 + BC);
                hb_p_ds<BF16, SPLIT>(pa, da, st, dpt, cL, cD, kr, q0, edge, N, causal, scale_log2, scale, lane);
            } else if constexpr (DEFER) {  // the last step's dQ product
                hw_wg_wait<0>();
                hw_keep(dq);
                hb_dq_add(dq_dst, dq, tid);
            }
        }
        tc_cp_wait<0>();
        // dK and dV of this block's keys (rows < N), rounded once, staged through the Q/dO buffers
        hw_store_tile<D, BF16>(dK + kv_off, D, k0, N, 0, D, sB, dk, 1.0f, 1.0f, rl, tid);
        __syncthreads();
        hw_store_tile<D, BF16>(dV + kv_off, D, k0, N, 0, D, sB, dv, 1.0f, 1.0f, rl, tid);
    }
}

// ------------------------------------------------------------------------------------ five products, warp-specialized
// hbwd5_kv: the five-product kernel with its work split by role (FlashAttention-3's arrangement). A block
// is three warpgroups and owns BC = 128 keys of one K/V head, walking BM = 64 query rows a step over every
// query head of the group, as hb_kv:
//   * warpgroup 0 (40 registers): its warp 0 loads, its warp 1 adds dQ. The loader's lane 0 brings K and
//     V in by TMA once per K/V head, and each step's Q and dO tiles into one of two stages (TMA, 64 x 64
//     boxes, zeros past N). Each stage has a "full" mbarrier (lane 0's arrive with the TMA bytes) and an
//     "empty" one (every consumer warp, once its products have read the stage). The step's L (times
//     log2 e; +inf past N) and Dl (0 past N) are the consumers' to bring (see ld_of): so that every
//     generic write to shared memory is ordered by a named barrier, not an mbarrier. The adder waits for a
//     step's dQ tile staged in shared memory (fp32, the dQa layout, so one contiguous run of D / 64 x
//     16 KiB) and adds it to dQa with one bulk reduce-add (cp.reduce.async.bulk .add.f32), then frees
//     the staging buffer once the copy has read it: the adds leave the consumers' path whole;
//   * warpgroups 1 and 2 (232 registers), 64 keys each: per step S^T = K Q^T and dP^T = V dO^T, P^T and
//     dS^T in registers (hb_sdp), dS^T to shared memory (two buffers), dV += P^T dO and dK += dS^T Q
//     issued, a named barrier (both halves of dS^T are in), dQ = dS K issued; the stage is freed once
//     dV and dK are done, and dQ staged once it is (two buffers, named barriers with the adder).
// dK and dV leave at the end of each K/V head through the K and V tiles' shared memory.
// Shared memory: K, V 2 x 128 D x 2; Q, dO 2 stages x 2 x 64 D x 2; dS^T 2 x 128 x 64 x 2; dQ staging
// 2 x 64 D x 4; L and Dl 1024; mbarriers 64; + 1024 for the alignment (bwd5_shared_mem in fused.py).
#define HB_DS_BAR 1   // named barriers: dS^T in (the consumers, 256 threads)
#define HB_DQF_BAR 2  // staging buffer s holds a dQ tile (2 + s; consumers and adder, 288)
#define HB_DQE_BAR 4  // staging buffer s is free (4 + s; 288)
#define HB_ST_BAR 6   // the consumers' dK, dV staging (256)

__device__ __forceinline__ void hb_st_shared4(tc_u32 addr, float a, float b, float c, float d) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// S^T and dP^T of a warpgroup's 64 keys (K, V rows at sk, sv) x a step's 64 queries (Q, dO tiles at sq,
// sdo; L log2 e and Dl at cL, cD), then P^T and dS^T rounded into pa and da (hb_p_ds);
// kr: this thread's first key, q0: the step's first query row. SPLIT: P^T while dP^T is still in the
// tensor cores. Returns with no product in flight.
template <int D, bool BF16, bool SPLIT>
__device__ __forceinline__ void hb_sdp(tc_u32 (&pa)[4][4], tc_u32 (&da)[4][4], tc_u32 sk, tc_u32 sv, tc_u32 sq,
                                       tc_u32 sdo, const float *cL, const float *cD, int kr, int q0, bool edge,
                                       int N, int causal, float scale_log2, float scale, int lane) {
    float st[32], dpt[32];
    hw_keep(st);
    hw_keep(dpt);
    hw_wg_fence();
    hw_abt<D, 128, 64, BF16>(st, sk, sq);
    if constexpr (SPLIT) hw_wg_commit();
    hw_abt<D, 128, 64, BF16>(dpt, sv, sdo);
    hw_wg_commit();
    hb_p_ds<BF16, SPLIT>(pa, da, st, dpt, cL, cD, kr, q0, edge, N, causal, scale_log2, scale, lane);
}

template <int D, bool BF16>
__device__ __forceinline__ void hb_kv5(const tw_tmap *qm, const tw_tmap *km, const tw_tmap *vm, const tw_tmap *dom,
                                       const float *__restrict__ L, const float *__restrict__ Dl,
                                       tc_u16 *__restrict__ dK, tc_u16 *__restrict__ dV, float *__restrict__ dQa,
                                       int BG, int G, int group, int N, float scale, int causal, hb_strides skv,
                                       int ldn, int qoff) {
    constexpr int BC = 128, BM = 64, P = D / 64, NQ = 288;  // NQ: the dQ barriers' threads
    constexpr tc_u32 KB = BC * D * 2, MB = BM * D * 2, SB = BC * BM * 2, QB = BM * D * 4;
    const tc_u32 sK = hw_smem_base(), sV = sK + KB, sQ0 = sV + KB, sDS0 = sQ0 + 4 * MB, sDQ0 = sDS0 + 2 * SB,
                 sLD = sDQ0 + 2 * QB, bars = sLD + 1024;
    auto q_full = [&](int s) { return bars + 8 * s; };
    auto q_empty = [&](int s) { return bars + 16 + 8 * s; };
    const tc_u32 kv_full = bars + 32, kv_empty = bars + 40;
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31;
    const int k0 = blockIdx.x * BC;
    const int n_qt = (N + BM - 1) / BM, qt_first = causal ? k0 / BM : 0, per = n_qt - qt_first;
    const int ld_qt = (ldn + BM - 1) / BM;  // as hb_kv's: dQa's query tiles a head, from the call's first row on
    L += qoff;
    Dl += qoff;
    dQa += (long long)(qoff / BM) * P * 4096;
    const int steps = group * per;  // (query head of the group, query tile) pairs, >= 1 (k0 < N)
    // the key blocks of a head start at query tiles spread over its tiles, so that they do not all add to
    // the same dQ tile at once
    const int rot = (int)(((long long)blockIdx.x * per) / gridDim.x);
    const int total = (blockIdx.y < BG ? ((BG - 1 - (int)blockIdx.y) / (int)gridDim.y + 1) : 0) * steps;
    auto q0_of = [&](int t) { return (qt_first + (t + rot) % per) * BM; };
    if (tid == 0) {
        for (int s = 0; s < 2; ++s) {
            tw_bar_init(q_full(s), 1);
            tw_bar_init(q_empty(s), 8);
        }
        tw_bar_init(kv_full, 1);
        tw_bar_init(kv_empty, 8);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        hw_fence_proxy();
    }
    __syncthreads();

    if (wg == 0) {  // ------------------------------------------------------------ loader and adder
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        const int warp = tid >> 5;
        int n = 0;  // steps so far, over the block's K/V heads
        if (warp == 0) {
            for (int i = 0, bg = blockIdx.y; bg < BG; ++i, bg += gridDim.y) {
                const int b = bg / G, hk = bg - b * G;
                if (lane == 0) {
                    tw_bar_wait(kv_empty, (i & 1) ^ 1);
                    tw_bar_expect(kv_full, 2 * KB);
#pragma unroll
                    for (int p = 0; p < P; ++p) {
                        tw_tma(sK + p * BC * 128, km, 64 * p, k0, hk, b, kv_full);
                        tw_tma(sV + p * BC * 128, vm, 64 * p, k0, hk, b, kv_full);
                    }
                }
                for (int t = 0; t < steps; ++t, ++n) {
                    const int s = n & 1, q0 = q0_of(t), h = hk * group + t / per;
                    if (lane == 0) {
                        tw_bar_wait(q_empty(s), ((n >> 1) & 1) ^ 1);
                        tw_bar_expect(q_full(s), 2 * MB);
#pragma unroll
                        for (int p = 0; p < P; ++p) {
                            tw_tma(sQ0 + s * 2 * MB + p * BM * 128, qm, 64 * p, q0, h, b, q_full(s));
                            tw_tma(sQ0 + s * 2 * MB + MB + p * BM * 128, dom, 64 * p, q0, h, b, q_full(s));
                        }
                    }
                }
            }
        } else if (warp == 1) {
            // both staging buffers start free; each is freed again only for a step that will use it
            if (total > 0) tw_arrive(HB_DQE_BAR, NQ);
            if (total > 1) tw_arrive(HB_DQE_BAR + 1, NQ);
            for (int bg = blockIdx.y; bg < BG; bg += gridDim.y)
                for (int t = 0; t < steps; ++t, ++n) {
                    const int s = n & 1;
                    const long long tile = (((long long)bg * group + t / per) * ld_qt + q0_of(t) / BM) * P;
                    tw_sync(HB_DQF_BAR + s, NQ);
                    if (lane == 0) {
                        asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                                     ::"l"(dQa + tile * 4096), "r"(sDQ0 + s * QB), "r"(QB) : "memory");
                        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
                        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
                    }
                    __syncwarp();
                    if (n + 2 < total) tw_arrive(HB_DQE_BAR + s, NQ);
                }
            if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
        }
        return;
    }

    // ------------------------------------------------------------------------------ consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int c = __shfl_sync(0xffffffffu, wg - 1, 0), ctid = tid - 128, warp = (ctid >> 5) & 3;
    const int rl = c * 64 + warp * 16 + (lane >> 2), kr = k0 + rl;  // this thread's keys: rl and rl + 8
    const float scale_log2 = scale * HB_LOG2E;
    auto release = [&](tc_u32 bar) {
        __syncwarp();
        if (lane == 0) tw_bar_arrive(bar);
    };
    int n = 0;
    for (int i = 0, bg = blockIdx.y; bg < BG; ++i, bg += gridDim.y) {
        tw_bar_wait(kv_full, i & 1);
        float dk[D / 2], dv[D / 2];
#pragma unroll
        for (int x = 0; x < D / 2; ++x) dk[x] = dv[x] = 0.0f;
        // L log2 e and Dl of step t's rows into slot n & 1 of sLD by consumer threads 0..127 (a value
        // each: L for 0..63, Dl for 64..127; +inf and 0 past N): step 0's before the loop, step t + 1's
        // during step t, loaded at its start and stored before the barrier on dS^T (after which every
        // consumer reads it, and by which every consumer has read the slot's step t - 1)
        auto ld_of = [&](int t) {
            const int r = q0_of(t) + (ctid & 63);
            const long long row = ((long long)bg * group + t / per) * ldn + r;
            return r >= N ? (ctid < 64 ? TC_POS_INF : 0.0f) : ctid < 64 ? L[row] * HB_LOG2E : Dl[row];
        };
        float *sld = (float *)(hw_smem + (sLD - tc_saddr(hw_smem)));
        if (ctid < 128) sld[(n & 1) * 128 + ctid] = ld_of(0);
        tw_sync(HB_ST_BAR, 256);
        for (int t = 0; t < steps; ++t, ++n) {
            const int s = n & 1, q0 = q0_of(t);
            const tc_u32 sq = sQ0 + s * 2 * MB, sdo = sq + MB, sDS = sDS0 + s * SB, sDQ = sDQ0 + s * QB;
            const float *cL = sld + s * 128, *cD = cL + 64;
            const bool edge = k0 + BC > N || (causal && q0 < k0 + BC);
            const bool next = ctid < 128 && t + 1 < steps;
            const float ld_next = next ? ld_of(t + 1) : 0.0f;
            tw_bar_wait(q_full(s), (n >> 1) & 1);
            tc_u32 pa[4][4], da[4][4];
            hb_sdp<D, BF16, D == 128>(pa, da, sK + c * 64 * 128, sV + c * 64 * 128, sq, sdo, cL, cD, kr, q0, edge, N,
                                      causal, scale_log2, scale, lane);
            // dS^T into shared memory (rows: keys), the A operand of dQ = dS K read MN-major
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    hw_st_shared(sDS + hw_swz<128>(rl + 8 * (e & 1), 2 * kk + (e >> 1)) + (lane & 3) * 4, da[kk][e]);
            hw_fence_proxy();
            // dV and dK need only this warpgroup's P^T and dS^T: issued before the wait for the other
            // warpgroup's dS^T, so that the tensor cores run them while it finishes its softmax
            float dq[D == 128 ? 32 : 16];
            hw_keep(dv);
            hw_keep(dk);
            hw_keep(pa);
            hw_keep(da);
            hw_wg_fence();
            hw_ab<D, 4, BM, BF16>(dv, pa, sdo);  // dV += P^T dO
            hw_ab<D, 4, BM, BF16>(dk, da, sq);   // dK += dS^T Q
            hw_wg_commit();
            if (next) sld[(s ^ 1) * 128 + ctid] = ld_next;
            tw_sync(HB_DS_BAR, 256);  // both warpgroups' dS^T is in (and the next step's L and Dl)
            hb_dq_product<D, BF16>(dq, sDS, sK, c);
            hw_wg_commit();
            hw_wg_wait<1>();  // dV and dK: the stage's Q and dO are read
            hw_keep(dv);
            hw_keep(dk);
            hw_keep(pa);
            hw_keep(da);
            release(q_empty(s));
            hw_wg_wait<0>();
            hw_keep(dq);
            // dq into staging buffer s in dQa's layout: group g of this warpgroup's accumulators is group
            // gg of the step's D / 64 panels (D = 128: panel c; D = 64: groups 4 c .. 4 c + 3 of the one panel)
            tw_sync(HB_DQE_BAR + s, NQ);
#pragma unroll
            for (int g = 0; g < (D == 128 ? 8 : 4); ++g) {
                const int gg = D == 128 ? 8 * c + g : 4 * c + g;
                hb_st_shared4(sDQ + (gg * 128 + (ctid & 127)) * 16, dq[4 * g], dq[4 * g + 1], dq[4 * g + 2],
                              dq[4 * g + 3]);
            }
            hw_fence_proxy();
            tw_arrive(HB_DQF_BAR + s, NQ);
        }
        // dK and dV of this block's keys (rows < N), rounded once, staged in the K and V tiles
        tw_sync(HB_ST_BAR, 256);  // both warpgroups' products are done with K and V
        hw_stage_tile<D, BF16>(sK, dk, 1.0f, 1.0f, rl, lane);
        hw_stage_tile<D, BF16>(sV, dv, 1.0f, 1.0f, rl, lane);
        tw_sync(HB_ST_BAR, 256);
        const long long kv_off = skv.at(bg / G, bg % G, 0);
        hw_copy_tile<D>(dK + kv_off, skv.n, k0, N, 0, D, sK, ctid);
        hw_copy_tile<D>(dV + kv_off, skv.n, k0, N, 0, D, sV, ctid);
        hw_fence_proxy();  // these generic reads before the next K/V head's TMA writes
        release(kv_empty);
    }
}

// ------------------------------------------------------------------------------------ dQ
// Dl of this thread's rows r and r + 8 (rowsum(dO o O), the quad of threads that shares the rows
// splitting D in 16-byte chunks), written to Dl[base + row] for rows < N by the quad's first thread
template <int D, bool BF16>
__device__ __forceinline__ void hb_rowdot(float (&dr)[2], const tc_u16 *__restrict__ O, const tc_u16 *__restrict__ dO,
                                          float *__restrict__ Dl, long long base, int r, int N, int lane) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int row = r + 8 * i;
        float acc = 0.0f;
        if (row < N) {
            const tc_u4 *o = (const tc_u4 *)(O + (base + row) * D), *g = (const tc_u4 *)(dO + (base + row) * D);
#pragma unroll
            for (int c = lane & 3; c < D / 8; c += 4) {
                const tc_u4 ov = o[c], gv = g[c];
                const tc_u32 ow[4] = {ov.x, ov.y, ov.z, ov.w}, gw[4] = {gv.x, gv.y, gv.z, gv.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float o0, o1, g0, g1;
                    tc_unpack<BF16>(ow[e], o0, o1);
                    tc_unpack<BF16>(gw[e], g0, g1);
                    acc = fmaf(o0, g0, fmaf(o1, g1, acc));
                }
            }
        }
        acc += tc_shfl_xor(acc, 1);
        acc += tc_shfl_xor(acc, 2);
        dr[i] = acc;
        if ((lane & 3) == 0 && row < N) Dl[base + row] = acc;
    }
}

template <int D, bool BF16>
__device__ __forceinline__ void hb_dq(const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K,
                                      const tc_u16 *__restrict__ V, const tc_u16 *__restrict__ O,
                                      const tc_u16 *__restrict__ dO, const float *__restrict__ L,
                                      float *__restrict__ Dl, tc_u16 *__restrict__ dQ, int BH, int H, int group,
                                      int N, float scale, int causal) {
    constexpr int BR = 128, BN = 64, NT = 256;
    constexpr tc_u32 QB = BR * D * 2, NB = BN * D * 2;  // bytes of a Q (or dO) tile, of a K (or V) tile
    // shared: Q and dO of this block's rows, then three buffers of (K, V) tiles
    const tc_u32 sQ = hw_smem_base(), sO = sQ + QB, sB = sO + QB;  // buffer b: K at sB + 2 b NB, V + NB
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int rl = wg * 64 + warp * 16 + (lane >> 2);  // this thread's rows in the tile: rl and rl + 8
    const float scale_log2 = scale * HB_LOG2E;
    const int n_qt = (N + BR - 1) / BR, n_kt_all = (N + BN - 1) / BN;
    const int qt = causal ? n_qt - 1 - blockIdx.x : blockIdx.x;  // causal: the longest rows first
    const int q0 = qt * BR, r = q0 + rl, wr0 = q0 + wg * 64;
    int n_kt = n_kt_all;
    if (causal) {
        const int last = (q0 + BR - 1) / BN + 1;
        n_kt = last < n_kt ? last : n_kt;
    }
    for (long long bh = blockIdx.y; bh < BH; bh += gridDim.y) {
        const long long kv_off = ((bh / H) * (H / group) + (bh % H) / group) * N * D;
        auto issue = [&](int kt) {
            const tc_u32 dst = sB + (kt % 3) * 2 * NB;
            hw_load_tile<D, BN, NT>(dst, K + kv_off, kt * BN, N, tid);
            hw_load_tile<D, BN, NT>(dst + NB, V + kv_off, kt * BN, N, tid);
            tc_cp_commit();
        };
        __syncthreads();  // the previous head's tiles are no longer read
        hw_load_tile<D, BR, NT>(sQ, Q + bh * N * D, q0, N, tid);
        hw_load_tile<D, BR, NT>(sO, dO + bh * N * D, q0, N, tid);
        tc_cp_commit();
        issue(0);
        float lr[2], dr[2];
        hb_rowdot<D, BF16>(dr, O, dO, Dl, bh * N, r, N, lane);  // (hbwd_kv, launched after, reads Dl)
#pragma unroll
        for (int i = 0; i < 2; ++i) lr[i] = r + 8 * i < N ? L[bh * N + r + 8 * i] * HB_LOG2E : TC_POS_INF;
        float dq[D / 2], s[32], dp[32];  // S and dP: this warpgroup's 64 rows x a tile's 64 keys
        tc_u32 da[4][4];
#pragma unroll
        for (int i = 0; i < D / 2; ++i) dq[i] = 0.0f;
        // dS of tile kt in dp (S and dP in, rows r and r + 8 x keys kt * BN ..), rounded into da
        auto dsoft = [&](int kt) {
            const int k0 = kt * BN;
            const bool edge = k0 + BN > N || (causal && k0 + BN - 1 > wr0);
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = e >> 1, col = k0 + j * 8 + (lane & 3) * 2 + (e & 1);
                    float p = tc_exp2(fmaf(s[4 * j + e], scale_log2, -lr[i]));
                    if (edge && (col >= N || (causal && col > r + 8 * i))) p = 0.0f;
                    dp[4 * j + e] = p * (dp[4 * j + e] - dr[i]) * scale;
                }
        };
        // tile 0 alone; then iteration kt issues S_kt = Q K_kt^T and dP_kt = dO V_kt^T, and dQ += dS_{kt-1}
        // K_{kt-1} behind them, computing dS_kt while that product runs; then the last dQ product. K and V
        // sit in three buffers: tile kt + 1 loads into the one tile kt - 2 used.
        tc_cp_wait<0>();
        hw_fence_proxy();
        __syncthreads();
        if (n_kt > 1) issue(1);
        hw_keep(s);
        hw_keep(dp);
        hw_wg_fence();
        hw_abt<D, BR, BN, BF16>(s, sQ + wg * 64 * 128, sB);
        hw_abt<D, BR, BN, BF16>(dp, sO + wg * 64 * 128, sB + NB);
        hw_wg_commit();
        hw_wg_wait<0>();
        hw_keep(s);
        hw_keep(dp);
        dsoft(0);
        hw_pack_p<BF16>(da, dp);
        for (int kt = 1; kt < n_kt; ++kt) {
            tc_cp_wait<0>();
            hw_fence_proxy();
            __syncthreads();  // tile kt has landed for all; both warpgroups are done with tile kt - 2
            if (kt + 1 < n_kt) issue(kt + 1);
            const tc_u32 sk = sB + (kt % 3) * 2 * NB;
            hw_keep(s);
            hw_keep(dp);
            hw_keep(dq);
            hw_keep(da);
            hw_wg_fence();
            hw_abt<D, BR, BN, BF16>(s, sQ + wg * 64 * 128, sk);
            hw_abt<D, BR, BN, BF16>(dp, sO + wg * 64 * 128, sk + NB);
            hw_wg_commit();
            hw_ab<D, 4, BN, BF16>(dq, da, sB + ((kt - 1) % 3) * 2 * NB);  // dQ += dS K
            hw_wg_commit();
            hw_wg_wait<1>();  // S_kt and dP_kt are done; the dQ product may still run
            hw_keep(s);
            hw_keep(dp);
            dsoft(kt);
            hw_wg_wait<0>();  // the dQ product no longer reads da
            hw_keep(dq);
            hw_keep(da);
            hw_pack_p<BF16>(da, dp);
        }
        hw_keep(dq);
        hw_keep(da);
        hw_wg_fence();
        hw_ab<D, 4, BN, BF16>(dq, da, sB + ((n_kt - 1) % 3) * 2 * NB);
        hw_wg_commit();
        hw_wg_wait<0>();
        hw_keep(dq);
        hw_keep(da);
        tc_cp_wait<0>();
        // dQ of this block's rows (rows < N), rounded once, staged through the K/V buffers
        hw_store_tile<D, BF16>(dQ + bh * N * D, D, q0, N, 0, D, sB, dq, 1.0f, 1.0f, rl, tid);
    }
}

#define HB_DEFINE(SUF, BF16, D)                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 1) hbwd_kv_##SUF##_d##D(                        \
        const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K, const tc_u16 *__restrict__ V,     \
        const tc_u16 *__restrict__ dO, const float *__restrict__ L, const float *__restrict__ Dl,     \
        tc_u16 *__restrict__ dK, tc_u16 *__restrict__ dV, int BG, int G, int group, int N, float scale, \
        int causal) {                                                                                  \
        hb_kv<D, BF16, false>(Q, K, V, dO, L, Dl, dK, dV, nullptr, BG, G, group, N, scale, causal, N, 0); \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256, 1) hbwd5_kv_##SUF##_d##D(                       \
        const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K, const tc_u16 *__restrict__ V,     \
        const tc_u16 *__restrict__ dO, const float *__restrict__ L, const float *__restrict__ Dl,     \
        tc_u16 *__restrict__ dK, tc_u16 *__restrict__ dV, float *__restrict__ dQa, int BG, int G,     \
        int group, int N, float scale, int causal, int ldn, int qoff) {                                \
        hb_kv<D, BF16, true>(Q, K, V, dO, L, Dl, dK, dV, dQa, BG, G, group, N, scale, causal, ldn, qoff); \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(384, 1) hbwd5w_kv_##SUF##_d##D(                      \
        const __grid_constant__ tw_tmap qm, const __grid_constant__ tw_tmap km,                       \
        const __grid_constant__ tw_tmap vm, const __grid_constant__ tw_tmap dom,                      \
        const float *__restrict__ L, const float *__restrict__ Dl, tc_u16 *__restrict__ dK,           \
        tc_u16 *__restrict__ dV, float *__restrict__ dQa, int BG, int G, int group, int N, float scale, \
        int causal, long long sk0, long long sk1, long long sk2, int ldn, int qoff) {                  \
        hb_kv5<D, BF16>(&qm, &km, &vm, &dom, L, Dl, dK, dV, dQa, BG, G, group, N, scale, causal,       \
                        hb_strides{sk0, sk1, sk2}, ldn, qoff);                                         \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) hbwd_pre_##SUF##_d##D(                          \
        const tc_u16 *__restrict__ O, const tc_u16 *__restrict__ dO, float *__restrict__ Dl,          \
        float4 *__restrict__ dQa, long long rows, long long n4, int H, int N, long long so0,           \
        long long so1, long long so2, long long sd0, long long sd1, long long sd2) {                   \
        hb_pre<D, BF16>(O, dO, Dl, dQa, rows, n4, H, N, hb_strides{so0, so1, so2}, hb_strides{sd0, sd1, sd2}); \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) hbwd_dq_out_##SUF##_d##D(                       \
        const float4 *__restrict__ dQa, tc_u16 *__restrict__ dQ, int N, long long tiles, int H,       \
        long long sq0, long long sq1, long long sq2) {                                                 \
        hb_dq_out<D, BF16>(dQa, dQ, N, tiles, H, hb_strides{sq0, sq1, sq2});                           \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256, 1) hbwd_dq_##SUF##_d##D(                        \
        const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K, const tc_u16 *__restrict__ V,     \
        const tc_u16 *__restrict__ O, const tc_u16 *__restrict__ dO, const float *__restrict__ L,     \
        float *__restrict__ Dl, tc_u16 *__restrict__ dQ, int BH, int H, int group, int N, float scale, \
        int causal) {                                                                                  \
        hb_dq<D, BF16>(Q, K, V, O, dO, L, Dl, dQ, BH, H, group, N, scale, causal);                     \
    }
HB_DEFINE(f16, false, 64)
HB_DEFINE(bf16, true, 64)
HB_DEFINE(f16, false, 128)
HB_DEFINE(bf16, true, 128)
