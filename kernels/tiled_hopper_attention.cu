// tiled_hopper_attention.cu -- the QK and PV passes of the tiled kernels on Hopper's wgmma.
//
// --kernel tiled on compute capability 9.0 with D = 64 or 128 runs these two passes around the
// softmax pass of tiled_attention.cu (which is bound by memory, not by the tensor cores); other GPUs
// and head dims run tiled_attention.cu's mma.sync passes. Same S and P layout, same results:
//
//   tiledh_qk_SUF_dD  S = Q K^T * scale   a block (two warpgroups, 256 threads) keeps a 128-row Q
//                     tile in shared memory and walks up to KG = 8 key tiles of 128 keys (double
//                     buffered with cp.async): wgmma m64n128k16 per warpgroup, then the tile is
//                     rounded to the storage type, staged through shared memory and written with
//                     16-byte coalesced stores while the next K tile is already loading.
//                     Causal: key tiles entirely after the query tile are not computed.
//   tiledh_pv_SUF_dD  O = P V             a block owns 128 rows of O (all D columns); P tiles
//                     (128 x 64, K-major) and V tiles (64 keys x D, read transposed) stream through
//                     three cp.async stages; wgmma m64nDk16 with both operands in shared memory.
//   Both passes fit two blocks (16 warps) on an SM, so one block's loads and stores overlap the
//   other's tensor-core work.
//                     Causal: key tiles after the query tile are not read (the softmax left zeros
//                     after the diagonal up to the end of the 128-row tile).
//
// Layout: Q and O are [BH, N, D] contiguous, K and V [BH / group, N, D] contiguous (query head bh
// reads K/V head bh / group: grouped-query attention, K and V never repeated); S and P are
// [BH, N, ld], ld = N rounded up to 8
// (padding columns of P are zeros, written by the softmax). Offsets that can reach N^2 are 64-bit.
// Grids: qk (ceil(key tiles / KG), query tiles, BH), pv (query tiles, BH); BH beyond 65535 strides.
// Shared helpers: hopper_common.cuh (compiled for sm_90a).

#include "hopper_common.cuh"

#define TH_KG 8  // key tiles per block in the QK pass

template <int D, bool BF16>
__device__ __forceinline__ void th_qk(const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K,
                                      tc_u16 *__restrict__ S, int BH, int N, int ld, float scale, int causal,
                                      int group) {
    constexpr int BR = 128, BC = 128, NT = 256;
    constexpr tc_u32 QB = BR * D * 2, KB = BC * D * 2;
    // the S tile (128 x 128) is staged in the K tile it was computed from when that is large enough
    // (D = 128), so that Q and two K tiles are all the shared memory and two blocks share an SM
    constexpr bool STAGE_IN_K = KB >= BR * BC * 2;
    const tc_u32 sQ = hw_smem_base(), sK = sQ + QB;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int rl = wg * 64 + warp * 16 + (lane >> 2);  // this thread's rows in the tile: rl, rl + 8
    const int n_kt = (N + BC - 1) / BC;
    const int qt = blockIdx.y, q0 = qt * BR;
    const int t0 = blockIdx.x * TH_KG;
    int t1 = t0 + TH_KG < n_kt ? t0 + TH_KG : n_kt;
    if (causal && t1 > qt + 1) t1 = qt + 1;  // BR == BC: key tile t is after query tile qt when t > qt
    if (t0 >= t1) return;

    for (int bh = blockIdx.z; bh < BH; bh += gridDim.z) {
        const tc_u16 *Qh = Q + (long long)bh * N * D, *Kh = K + (long long)(bh / group) * N * D;
        tc_u16 *Sh = S + (long long)bh * N * ld;
        hw_load_tile<D, BR, NT>(sQ, Qh, q0, N, tid);
        hw_load_tile<D, BC, NT>(sK, Kh, t0 * BC, N, tid);
        tc_cp_commit();
        for (int t = t0; t < t1; ++t) {
            tc_cp_wait<0>();  // K_t (and Q) have landed ...
            hw_fence_proxy();
            __syncthreads();  // ... for all; everyone is done with K_{t-1} and the tile staged in it
            if (t + 1 < t1) hw_load_tile<D, BC, NT>(sK + ((t + 1 - t0) & 1) * KB, Kh, (t + 1) * BC, N, tid);
            tc_cp_commit();
            float s[64];
            hw_keep(s);
            hw_wg_fence();
            const tc_u32 kt = sK + ((t - t0) & 1) * KB;
            hw_qk<D, BR, BF16>(s, sQ + wg * 64 * 128, kt);
            hw_wg_commit();
            hw_wg_wait<0>();
            hw_keep(s);
            // staged in K_t (once both warpgroups are done reading it) or in its own tile
            hw_store_tile<BC, BF16>(Sh, ld, q0, N, t * BC, ld, STAGE_IN_K ? kt : sK + 2 * KB, s, scale, scale, rl, tid);
        }
        __syncthreads();  // the shared tiles are reused for the next (batch, head) when the grid strides
    }
}

template <int D, bool BF16>
__device__ __forceinline__ void th_pv(const tc_u16 *__restrict__ P, const tc_u16 *__restrict__ V,
                                      tc_u16 *__restrict__ O, int BH, int N, int ld, int causal, int group) {
    constexpr int BR = 128, BC = 64, NT = 256, ST = 3;  // BC keys per stage, ST stages
    constexpr tc_u32 PB = BR * BC * 2, VB = BC * D * 2, STAGE = PB + VB;
    static_assert(ST * STAGE >= BR * D * 2, "O is staged in the stages' shared memory");
    const tc_u32 sP = hw_smem_base(), sV = sP + PB;  // stage i at + i * STAGE
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int rl = wg * 64 + warp * 16 + (lane >> 2);
    const int qt = blockIdx.x, q0 = qt * BR;
    int n_kt = (N + BC - 1) / BC;
    if (causal && n_kt > (qt + 1) * (BR / BC)) n_kt = (qt + 1) * (BR / BC);
    auto load = [&](const tc_u16 *Ph, const tc_u16 *Vh, int t) {
        if (t < n_kt) {
            const tc_u32 st = (t % ST) * STAGE;
            hw_load<BC, BR, NT>(sP + st, Ph, ld, q0, N, t * BC, ld, tid);
            hw_load_tile<D, BC, NT>(sV + st, Vh + (long long)t * BC * D, 0, N - t * BC, tid);
        }
        tc_cp_commit();
    };

    for (int bh = blockIdx.y; bh < BH; bh += gridDim.y) {
        const tc_u16 *Ph = P + (long long)bh * N * ld, *Vh = V + (long long)(bh / group) * N * D;
        tc_u16 *Oh = O + (long long)bh * N * D;
        for (int t = 0; t < ST - 1; ++t) load(Ph, Vh, t);
        float o[D / 2];
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
        for (int t = 0; t < n_kt; ++t) {
            tc_cp_wait<ST - 2>();  // P_t and V_t have landed ...
            hw_fence_proxy();
            __syncthreads();       // ... for all; everyone is done with stage (t - 1) % ST
            load(Ph, Vh, t + ST - 1);
            const tc_u32 st = (t % ST) * STAGE;
            hw_keep(o);
            hw_wg_fence();
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk) {
                const tc_u64 da = hw_desc(sP + st + wg * 64 * 128 + kk * 32, 16, 1024);
                const tc_u64 db = hw_desc(sV + st + kk * 16 * 128, BC * 128, 1024);
                if constexpr (D == 128)
                    hw_mma_ss_n128<BF16, 1>(o, da, db, 1);
                else
                    hw_mma_ss_n64<BF16, 1>(o, da, db, 1);
            }
            hw_wg_commit();
            hw_wg_wait<0>();
            hw_keep(o);
        }
        // O staged through the first stages (128 rows x D), then 16-byte stores for rows < N
        tc_cp_wait<0>();
        hw_store_tile<D, BF16>(Oh, D, q0, N, 0, D, sP, o, 1.0f, 1.0f, rl, tid);
        __syncthreads();
    }
}

#define TH_DEFINE(SUF, BF16, D)                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 2)                                              \
        tiledh_qk_##SUF##_d##D(const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K,            \
                               tc_u16 *__restrict__ S, int BH, int N, int ld, float scale, int causal, \
                               int group) {                                                           \
        th_qk<D, BF16>(Q, K, S, BH, N, ld, scale, causal, group);                                     \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, 2)                                              \
        tiledh_pv_##SUF##_d##D(const tc_u16 *__restrict__ P, const tc_u16 *__restrict__ V,            \
                               tc_u16 *__restrict__ O, int BH, int N, int ld, int causal, int group) { \
        th_pv<D, BF16>(P, V, O, BH, N, ld, causal, group);                                            \
    }
TH_DEFINE(f16, false, 64)
TH_DEFINE(bf16, true, 64)
TH_DEFINE(f16, false, 128)
TH_DEFINE(bf16, true, 128)
