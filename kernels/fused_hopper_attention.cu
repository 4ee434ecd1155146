// fused_hopper_attention.cu -- the fused kernel on Hopper's warpgroup tensor-core instructions.
//
// The same algorithm as fused_attention.cu (one kernel, online softmax, S and P never leave the
// registers), rebuilt on wgmma, the asynchronous warpgroup matrix multiply that Hopper (compute
// capability 9.0, compiled for sm_90a) added beside mma.sync. --kernel fused runs this file on
// compute capability 9.0 and fused_attention.cu elsewhere (tpattn/attention/fused.py).
//
//   * a block is two warpgroups (256 threads) and owns BR = 128 query rows of one (batch, head);
//     warpgroup w owns rows 64w..64w+63 and keeps its own running max and sum;
//   * Q (BR x D), and K and V tiles of BC = 128 keys, sit in shared memory in the layout wgmma
//     reads directly: 64-column panels of 128-byte rows, 128-byte swizzle (16-byte chunk c of row
//     r stored at chunk c ^ (r & 7)), so no ldmatrix and no bank conflicts; cp.async fills them,
//     K and V double buffered;
//   * S = Q K^T: wgmma m64n128k16 with both operands in shared memory (K-major), fp32 accumulators;
//   * O += P V: wgmma m64nDk16 with P straight from the S accumulators (rounded to the storage
//     type, the A operand in registers) and V from shared memory read transposed (MN-major);
//   * software pipeline: iteration j issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} together
//     (asynchronously), waits for S_j only, and runs the softmax of S_j while the tensor cores
//     still work on the PV product; one __syncthreads per key tile, K_{j+1} and V_j load meanwhile;
//   * causal: key tiles after the block's last row are never visited, the longest query tiles
//     start first, and only tiles that cross the diagonal (or the end of the sequence) are masked;
//   * any N >= 1: rows past N load as zeros (cp.async zero fill) and score -inf; O is staged
//     through shared memory and written with 16-byte stores for rows < N only.
//
// Layout: Q and O are [B, H, N, D], K and V [B, H / group, N, D], 16-bit (fp16 or bf16), BH = B * H,
// element (b, h, n, c) at b * sb + h * sh + n * ld + c (q_* for Q; kv_* for K and V, which share
// them; o_* for O). Grouped-query attention: query head h reads K/V head h / group in place (the
// group's query heads share it; K and V are never repeated). Contiguous tensors, or Q, K and V read
// in place from the QKV GEMM's [B, N, H + 2 H / group, D] output and O written straight into the
// [B, N, H, D] rows the output projection reads (no relayout copies);
// D = 64 or 128. Offsets that scale with BH * N are 64-bit. Grid: x over the query tiles
// [qt_begin, qt_end) (all of them: 0 and ceil(N / 128); fewer: a chunk of the rows, which the layer
// uses to overlap its communication with the next chunk), y over batch * heads (with a stride
// beyond 65535); block 256 threads; dynamic shared memory
// (BR + 4 * BC) * D * 2 + 1024 bytes (the 1024 aligns the swizzle atoms). Shared helpers:
// hopper_common.cuh.
// hw_probe_* are one-warpgroup kernels that run a single S or PV product through the same
// helpers, so a GPU test can check the descriptors and fragment layouts on their own.

#include "hopper_common.cuh"

template <int D, bool BF16>
__device__ __forceinline__ void hw_fused(const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K,
                                         const tc_u16 *__restrict__ V, tc_u16 *__restrict__ O,
                                         float *__restrict__ Lse, int BH, int N,
                                         float scale_log2, int causal, int qt_begin, int qt_end, int H,
                                         int group, long long q_sb, long long q_sh, int q_ld, long long kv_sb,
                                         long long kv_sh, int kv_ld, long long o_sb, long long o_sh, int o_ld) {
    constexpr int BR = 128, BC = 128, NT = 256;
    constexpr tc_u32 QB = BR * D * 2, KB = BC * D * 2;  // bytes of the Q tile and of one K or V tile
    const tc_u32 sQ = hw_smem_base(), sK = sQ + QB, sV = sK + 2 * KB;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int n_kt_all = (N + BC - 1) / BC;
    const tc_u32 sq = sQ + wg * 64 * 128;               // this warpgroup's 64 rows of Q
    const int rl = wg * 64 + warp * 16 + (lane >> 2);  // this thread's rows: rl and rl + 8 (in the tile)

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
            const int r0 = q0 + rl;           // this thread's first row in the sequence
            const int wr0 = q0 + wg * 64;     // the warpgroup's first row
            {  // Q's offset is recomputed per tile: not live across the key loop (fewer spills at D = 128)
                const int bq = tc_opaque(bh) / H, hq = tc_opaque(bh) - bq * H;
                hw_load_tile<D, BR, NT>(sQ, Q + bq * q_sb + hq * q_sh, q0, N, tid, q_ld);
            }
            hw_load_tile<D, BC, NT>(sK, Kh, 0, N, tid, kv_ld);
            tc_cp_commit();
            if (n_kt > 1) hw_load_tile<D, BC, NT>(sK + KB, Kh, BC, N, tid, kv_ld);
            hw_load_tile<D, BC, NT>(sV, Vh, 0, N, tid, kv_ld);
            tc_cp_commit();

            float o[D / 2], s[64];
#pragma unroll
            for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
            float m[2] = {TC_NEG_INF, TC_NEG_INF}, l[2] = {0.0f, 0.0f}, alpha[2];

            tc_cp_wait<1>();  // Q and K_0 have landed
            hw_fence_proxy();
            __syncthreads();
            hw_keep(s);
            hw_wg_fence();
            hw_qk<D, BR, BF16>(s, sq, sK);
            hw_wg_commit();
            hw_wg_wait<0>();
            hw_keep(s);
            hw_mask(s, 0, N, causal, wr0, r0, lane);
            hw_softmax(s, m, l, alpha, scale_log2);

            // iteration j (1 <= j < n_kt): S_j = Q K_j^T and O += P_{j-1} V_{j-1}; then the last PV
            for (int j = 1; j < n_kt; ++j) {
                tc_cp_wait<0>();  // K_j and V_{j-1} have landed ...
                hw_fence_proxy();
                __syncthreads();  // ... for every thread; every warpgroup is done with K_{j-1} and V_{j-2}
                if (j + 1 < n_kt) hw_load_tile<D, BC, NT>(sK + ((j + 1) & 1) * KB, Kh, (j + 1) * BC, N, tid, kv_ld);
                hw_load_tile<D, BC, NT>(sV + (j & 1) * KB, Vh, j * BC, N, tid, kv_ld);
                tc_cp_commit();
                tc_u32 pa[8][4];
                hw_pack_p<BF16>(pa, s);
                hw_keep(o);
                hw_keep(pa);
                hw_wg_fence();
                hw_qk<D, BR, BF16>(s, sq, sK + (j & 1) * KB);
                hw_wg_commit();
                hw_pv<D, BF16>(o, pa, sV + ((j - 1) & 1) * KB);
                hw_wg_commit();
                hw_wg_wait<1>();  // S_j is done; the PV product may still run
                hw_keep(s);
                hw_mask(s, j * BC, N, causal, wr0, r0, lane);
                hw_softmax(s, m, l, alpha, scale_log2);
                hw_wg_wait<0>();
                hw_keep(o);
                hw_keep(pa);
#pragma unroll
                for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
            }
            {
                tc_cp_wait<0>();  // V_{n_kt - 1} has landed
                hw_fence_proxy();
                __syncthreads();
                tc_u32 pa[8][4];
                hw_pack_p<BF16>(pa, s);
                hw_keep(o);
                hw_keep(pa);
                hw_wg_fence();
                hw_pv<D, BF16>(o, pa, sV + ((n_kt - 1) & 1) * KB);
                hw_wg_commit();
                hw_wg_wait<0>();
                hw_keep(o);
                hw_keep(pa);
            }

            hw_write_lse(Lse, (long long)bh * N, r0, N, m, l, lane);
            hw_finish_l(l);
            // O = acc / l, staged through sQ (every warpgroup is past its reads of it), 16-byte stores
            hw_store_tile<D, BF16>(Oh, o_ld, q0, N, 0, D, sQ, o, l[0], l[1], rl, tid);
            __syncthreads();  // sQ, sK, sV are reused by the block's next tile (when the grid strides)
        }
    }
}

#define HW_DEFINE(SUF, BF16, D)                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 1)                                              \
        fusedh_##SUF##_d##D(const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K,              \
                            const tc_u16 *__restrict__ V, tc_u16 *__restrict__ O,                     \
                            float *__restrict__ Lse, int BH, int N,                                   \
                            float scale_log2, int causal, int qt_begin, int qt_end, int H, int group, \
                            long long q_sb, long long q_sh, int q_ld, long long kv_sb, long long kv_sh, \
                            int kv_ld, long long o_sb, long long o_sh, int o_ld) {                   \
        hw_fused<D, BF16>(Q, K, V, O, Lse, BH, N, scale_log2, causal, qt_begin, qt_end, H, group, q_sb, q_sh, \
                          q_ld, kv_sb, kv_sh, kv_ld, o_sb, o_sh, o_ld);                              \
    }
HW_DEFINE(f16, false, 64)
HW_DEFINE(bf16, true, 64)
HW_DEFINE(f16, false, 128)
HW_DEFINE(bf16, true, 128)

// ------------------------------------------------------------------------------------------------
// Probes (one block of one warpgroup, fp16, D = 128): C[64 x 128] (fp32) = A[64 x 128] B[128 x 128]^T
// through hw_qk, and C[64 x 128] = P[64 x 128] V[128 x 128] through hw_pack_p and hw_pv. A test
// compares them with torch.matmul, so a wrong descriptor or fragment layout shows on its own.

__device__ __forceinline__ void hw_store_acc(float *C, const float (&acc)[64], int tid) {
    const int warp = tid >> 5, lane = tid & 31;
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            C[(warp * 16 + (lane >> 2) + (e >> 1) * 8) * 128 + j * 8 + (lane & 3) * 2 + (e & 1)] = acc[4 * j + e];
}

extern "C" __global__ void __launch_bounds__(128) hw_probe_qk_f16(const tc_u16 *A, const tc_u16 *B, float *C) {
    const tc_u32 sA = hw_smem_base(), sB = sA + 64 * 128 * 2;
    const int tid = threadIdx.x;
    hw_load_tile<128, 64, 128>(sA, A, 0, 64, tid);
    hw_load_tile<128, 128, 128>(sB, B, 0, 128, tid);
    tc_cp_commit();
    tc_cp_wait<0>();
    hw_fence_proxy();
    __syncthreads();
    float s[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) s[i] = 0.0f;
    hw_keep(s);
    hw_wg_fence();
    hw_qk<128, 64, false>(s, sA, sB);
    hw_wg_commit();
    hw_wg_wait<0>();
    hw_keep(s);
    hw_store_acc(C, s, tid);
}

extern "C" __global__ void __launch_bounds__(128) hw_probe_pv_f16(const tc_u16 *P, const tc_u16 *V, float *C) {
    const tc_u32 sV = hw_smem_base();
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    hw_load_tile<128, 128, 128>(sV, V, 0, 128, tid);
    tc_cp_commit();
    // P as fp32 accumulators would hold it, then packed exactly as the fused kernel packs it
    float s[64];
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const tc_u16 h = P[(warp * 16 + (lane >> 2) + (e >> 1) * 8) * 128 + j * 8 + (lane & 3) * 2 + (e & 1)];
            asm("cvt.f32.f16 %0, %1;\n" : "=f"(s[4 * j + e]) : "h"(h));
        }
    tc_u32 pa[8][4];
    hw_pack_p<false>(pa, s);
    tc_cp_wait<0>();
    hw_fence_proxy();
    __syncthreads();
    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    hw_keep(o);
    hw_keep(pa);
    hw_wg_fence();
    hw_pv<128, false>(o, pa, sV);
    hw_wg_commit();
    hw_wg_wait<0>();
    hw_keep(o);
    hw_store_acc(C, o, tid);
}
