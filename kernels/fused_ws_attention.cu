// fused_ws_attention.cu -- the fused kernel, warp-specialized, on Hopper's TMA, mbarriers and wgmma.
//
// The same algorithm and arithmetic as fused_hopper_attention.cu (online softmax, S and P in
// registers, wgmma with fp32 accumulators, exp2 with the scale folded in), with the work split by
// role instead of every thread doing everything:
//
//   * a block is three warpgroups (384 threads) and owns BR = 128 query rows of one (batch, head)
//     at a time: warpgroup 0 is the producer, warpgroups 1 and 2 the consumers (64 rows each);
//   * the producer is one thread issuing TMA loads (cp.async.bulk.tensor, 128-byte swizzle: the
//     layout wgmma reads, zeros past the end of the sequence) of the Q tile and of K and V tiles of
//     BC = 128 keys into a ring of two K and two V stages; each stage has a "full" mbarrier (the
//     TMA completes its bytes on it) and an "empty" one (every consumer warp arrives once it is done
//     reading); the producer never waits for a consumer except for a free stage;
//   * register reallocation: the producer drops to 40 registers, the consumers rise to 232, so
//     two 64-row accumulators of D fp32 values, S, and the packed P fit without spills;
//   * inside a consumer, the pipeline of fused_hopper_attention.cu: iteration j issues
//     S_j = Q K_j^T and O += P_{j-1} V_{j-1} together, waits for S_j only, and runs the softmax of
//     S_j while the PV product still runs;
//   * ping-pong between the consumers: two named barriers make them take turns issuing their
//     products, so one warpgroup's softmax runs while the other's GEMMs own the tensor cores;
//   * persistent: the grid may be smaller than the number of (query tile, head) pairs; block i
//     takes tiles i, i + gridDim.x, ... (head-major, so a head's K and V stay in L2 while its
//     query tiles run; causal: a head's longest tiles first). The producer loads the next tile's
//     Q and K while the consumers finish the last one;
//   * O: each consumer rounds its 64 rows into its own rows of the Q tile (sQ) and writes them
//     with 16-byte stores for rows < N; then it frees the Q tile for the next one.
//
// Layout (as fused_hopper_attention.cu): Q and O [B, H, N, D], K and V [B, H / group, N, D] or strided
// views (the QKV GEMM output read in place), 16-bit. Q, K and V arrive as TMA tensor maps over
// (D, N, heads, B) with a box of 64 columns x 128 rows (tpattn/attention/fused.py encodes them);
// O as a pointer and its strides. D = 64 or 128. Grid x: any number of blocks up to the tile count
// (tiles = (qt_end - qt_begin) * B * H); block 384 threads; dynamic shared memory
// (BR + 4 * BC) * D * 2 + 1024 + 128 bytes. Needs compute capability 9.0 (sm_90a).

#include "hopper_common.cuh"

struct __align__(64) tw_tmap {  // a CUtensorMap: 128 bytes the driver encodes, opaque here
    tc_u64 v[16];
};

__device__ __forceinline__ void tw_bar_init(tc_u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// arrive and add `bytes` to the transaction count the phase waits for (the TMA completes them)
__device__ __forceinline__ void tw_bar_expect(tc_u32 bar, tc_u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tw_bar_arrive(tc_u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// wait until the phase of parity `parity` has completed (a fresh barrier: parity 1 passes at once)
__device__ __forceinline__ void tw_bar_wait(tc_u32 bar, int parity) {
    tc_u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

// box (64 columns x 128 rows) at column c, row r of head h, batch b -> shared dst; bytes on bar
__device__ __forceinline__ void tw_tma(tc_u32 dst, const tw_tmap *map, int c, int r, int h, int b, tc_u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
        ::"r"(dst), "l"((tc_u64)map), "r"(c), "r"(r), "r"(h), "r"(b), "r"(bar) : "memory");
}

// named barriers: `count` threads take part; arrive does not wait
__device__ __forceinline__ void tw_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void tw_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// the tile sequence every warpgroup walks: tile t -> (batch * head, query tile, key tiles)
struct tw_tile {
    int bh, qt, n_kt;
};
__device__ __forceinline__ tw_tile tw_tile_of(long long t, int nq, int qt_begin, int qt_end, int N, int causal) {
    tw_tile x;
    x.bh = (int)(t / nq);
    const int qi = (int)(t - (long long)x.bh * nq);
    x.qt = causal ? qt_end - 1 - qi : qt_begin + qi;  // causal: a head's longest rows first
    x.n_kt = (N + 127) / 128;
    if (causal) {
        const int last = (x.qt * 128 + 127) / 128 + 1;
        x.n_kt = last < x.n_kt ? last : x.n_kt;
    }
    return x;
}

template <int D, bool BF16>
__device__ __forceinline__ void tw_fused(const tw_tmap *qm, const tw_tmap *km, const tw_tmap *vm,
                                         tc_u16 *__restrict__ O, float *__restrict__ Lse, int BH, int N,
                                         float scale_log2, int causal,
                                         int qt_begin, int qt_end, int H, int group, long long o_sb, long long o_sh,
                                         int o_ld) {
    constexpr int BR = 128, BC = 128, PANELS = D / 64;
    constexpr tc_u32 QB = BR * D * 2, KB = BC * D * 2;  // bytes of the Q tile and of one K or V tile
    constexpr int TURN = 1, EPI = 3;                    // named barrier ids: turns 1, 2; epilogues 3, 4
    const tc_u32 sQ = hw_smem_base(), sK = sQ + QB, sV = sK + 2 * KB, bars = sV + 2 * KB;
    // mbarriers, 8 bytes each: Q full, Q empty, K full [2], K empty [2], V full [2], V empty [2]
    const tc_u32 q_full = bars, q_empty = bars + 8;
    auto k_full = [&](int s) { return bars + 16 + 8 * s; };
    auto k_empty = [&](int s) { return bars + 32 + 8 * s; };
    auto v_full = [&](int s) { return bars + 48 + 8 * s; };
    auto v_empty = [&](int s) { return bars + 64 + 8 * s; };
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31;
    const int nq = qt_end - qt_begin;
    const long long tiles = (long long)nq * BH;

    if (tid == 0) {
        tw_bar_init(q_full, 1);
        tw_bar_init(q_empty, 8);  // every consumer warp
        for (int s = 0; s < 2; ++s) {
            tw_bar_init(k_full(s), 1);
            tw_bar_init(k_empty(s), 8);
            tw_bar_init(v_full(s), 1);
            tw_bar_init(v_empty(s), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        hw_fence_proxy();
    }
    __syncthreads();

    if (wg == 0) {  // ---------------------------------------------------------------- producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (tid == 0) {
            int kt = 0, n_tiles = 0;  // key tiles and query tiles loaded so far
            for (long long t = blockIdx.x; t < tiles; t += gridDim.x, ++n_tiles) {
                const tw_tile x = tw_tile_of(t, nq, qt_begin, qt_end, N, causal);
                const int b = x.bh / H, hh = x.bh - b * H, hk = hh / group;
                for (int j = 0; j < x.n_kt; ++j, ++kt) {
                    const int s = kt & 1, free_parity = ((kt >> 1) & 1) ^ 1;
                    tw_bar_wait(k_empty(s), free_parity);
                    tw_bar_expect(k_full(s), KB);
#pragma unroll
                    for (int p = 0; p < PANELS; ++p)
                        tw_tma(sK + s * KB + p * BC * 128, km, 64 * p, j * BC, hk, b, k_full(s));
                    if (j == 0) {  // K_0 first: it loads while the consumers still write the last tile's O
                        tw_bar_wait(q_empty, (n_tiles & 1) ^ 1);
                        tw_bar_expect(q_full, QB);
#pragma unroll
                        for (int p = 0; p < PANELS; ++p)
                            tw_tma(sQ + p * BR * 128, qm, 64 * p, x.qt * BR, hh, b, q_full);
                    }
                    tw_bar_wait(v_empty(s), free_parity);
                    tw_bar_expect(v_full(s), KB);
#pragma unroll
                    for (int p = 0; p < PANELS; ++p)
                        tw_tma(sV + s * KB + p * BC * 128, vm, 64 * p, j * BC, hk, b, v_full(s));
                }
            }
        }
        return;
    }

    // ------------------------------------------------------------------------------ consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int c = wg - 1, ctid = tid - 128 * wg, warp = ctid >> 5;
    const tc_u32 sq = sQ + c * 64 * 128;         // this warpgroup's 64 rows of Q (panel 0)
    const int rl = c * 64 + warp * 16 + (lane >> 2);  // this thread's rows in the tile: rl and rl + 8
    auto my_turn = [&]() { tw_sync(TURN + c, 256); };
    auto your_turn = [&]() { tw_arrive(TURN + (c ^ 1), 256); };
    auto release = [&](tc_u32 bar) {
        __syncwarp();
        if (lane == 0) tw_bar_arrive(bar);
    };
    if (c == 1) your_turn();  // consumer 0 issues first

    int kt = 0, n_tiles = 0;
    for (long long t = blockIdx.x; t < tiles; t += gridDim.x, ++n_tiles) {
        const tw_tile x = tw_tile_of(t, nq, qt_begin, qt_end, N, causal);
        const int q0 = x.qt * BR, n_kt = x.n_kt;
        const int r0 = q0 + rl, wr0 = q0 + c * 64;  // this thread's first row, the warpgroup's first
        float o[D / 2], s[64];
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
        float m[2] = {TC_NEG_INF, TC_NEG_INF}, l[2] = {0.0f, 0.0f}, alpha[2];

        tw_bar_wait(q_full, n_tiles & 1);
        tw_bar_wait(k_full(kt & 1), (kt >> 1) & 1);
        my_turn();
        hw_keep(s);
        hw_wg_fence();
        hw_qk<D, BR, BF16>(s, sq, sK + (kt & 1) * KB);
        hw_wg_commit();
        your_turn();
        hw_wg_wait<0>();
        hw_keep(s);
        release(k_empty(kt & 1));
        hw_mask(s, 0, N, causal, wr0, r0, lane);
        hw_softmax(s, m, l, alpha, scale_log2);

        // iteration j (1 <= j < n_kt): S_j = Q K_j^T and O += P_{j-1} V_{j-1}; then the last PV
        for (int j = 1; j < n_kt; ++j) {
            const int kj = kt + j, vj = kj - 1;  // ring positions of K_j and V_{j-1}
            tw_bar_wait(k_full(kj & 1), (kj >> 1) & 1);
            tw_bar_wait(v_full(vj & 1), (vj >> 1) & 1);
            tc_u32 pa[8][4];
            hw_pack_p<BF16>(pa, s);
            my_turn();
            hw_keep(o);
            hw_keep(pa);
            hw_wg_fence();
            hw_qk<D, BR, BF16>(s, sq, sK + (kj & 1) * KB);
            hw_wg_commit();
            hw_pv<D, BF16>(o, pa, sV + (vj & 1) * KB);
            hw_wg_commit();
            your_turn();
            hw_wg_wait<1>();  // S_j is done; the PV product may still run
            hw_keep(s);
            release(k_empty(kj & 1));
            hw_mask(s, j * BC, N, causal, wr0, r0, lane);
            hw_softmax(s, m, l, alpha, scale_log2);
            hw_wg_wait<0>();
            hw_keep(o);
            hw_keep(pa);
            release(v_empty(vj & 1));
#pragma unroll
            for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
        }
        {
            const int vj = kt + n_kt - 1;
            tw_bar_wait(v_full(vj & 1), (vj >> 1) & 1);
            tc_u32 pa[8][4];
            hw_pack_p<BF16>(pa, s);
            my_turn();
            hw_keep(o);
            hw_keep(pa);
            hw_wg_fence();
            hw_pv<D, BF16>(o, pa, sV + (vj & 1) * KB);
            hw_wg_commit();
            your_turn();
            hw_wg_wait<0>();
            hw_keep(o);
            hw_keep(pa);
            release(v_empty(vj & 1));
        }
        kt += n_kt;

        // O = acc / l: this warpgroup's rows, staged in its own rows of sQ (its products are done
        // reading them), then 16-byte stores of the rows < N
        hw_write_lse(Lse, (long long)x.bh * N, r0, N, m, l, lane);
        hw_finish_l(l);
        const int b = x.bh / H, hh = x.bh - b * H;
        tc_u16 *Oh = O + b * o_sb + hh * o_sh;
        constexpr int CH = D / 8;
#pragma unroll
        for (int j = 0; j < CH; ++j)
#pragma unroll
            for (int i = 0; i < 2; ++i)
                hw_st_shared(sQ + hw_swz<BR>(rl + 8 * i, j) + (lane & 3) * 4,
                             tc_pack<BF16>(o[4 * j + 2 * i] * l[i], o[4 * j + 2 * i + 1] * l[i]));
        tw_sync(EPI + c, 128);
#pragma unroll
        for (int i = 0; i < 64 * CH / 128; ++i) {
            const int e = ctid + i * 128;
            const int r = c * 64 + e / CH, ch = e % CH;
            if (q0 + r < N) *(tc_u4 *)(Oh + (long long)(q0 + r) * o_ld + ch * 8) = hw_ld_shared4(sQ + hw_swz<BR>(r, ch));
        }
        hw_fence_proxy();  // these generic reads of sQ before the next tile's TMA writes it
        release(q_empty);
    }
    if (c == 0) my_turn();  // consumer 1's last turn hand-over, so no barrier is left half arrived
}

#define TW_DEFINE(SUF, BF16, D)                                                                          \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                \
        fusedw_##SUF##_d##D(const __grid_constant__ tw_tmap qm, const __grid_constant__ tw_tmap km,     \
                            const __grid_constant__ tw_tmap vm, tc_u16 *__restrict__ O,                  \
                            float *__restrict__ Lse, int BH, int N,                                      \
                            float scale_log2, int causal, int qt_begin, int qt_end, int H, int group,    \
                            long long o_sb, long long o_sh, int o_ld) {                                  \
        tw_fused<D, BF16>(&qm, &km, &vm, O, Lse, BH, N, scale_log2, causal, qt_begin, qt_end, H, group, o_sb, \
                          o_sh, o_ld);                                                                   \
    }
TW_DEFINE(f16, false, 64)
TW_DEFINE(bf16, true, 64)
TW_DEFINE(f16, false, 128)
TW_DEFINE(bf16, true, 128)
