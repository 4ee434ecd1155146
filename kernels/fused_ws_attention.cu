// fused_ws_attention.cu -- the fused kernel, warp-specialized, on Hopper's TMA, mbarriers and wgmma.
//
// The same algorithm and arithmetic as fused_hopper_attention.cu (online softmax, S and P in
// registers, wgmma with fp32 accumulators, exp2 with the scale folded in), with the work split by
// role instead of every thread doing everything:
//
//   * a block is 1 + NC warpgroups and owns BR = 64 NC query rows of one (batch, head) at a time:
//     warpgroup 0 is the producer, warpgroups 1 .. NC the consumers (64 rows each). fusedw: NC = 2
//     (384 threads, 128 rows); fusedw3 (D = 64): NC = 3 (512 threads, 192 rows), more warps to hide
//     the softmax's latency where the products are half as long (measured 7-14 % faster at D = 64);
//     tpattn/attention/fused.py picks it where 192-row tiles do not pad the rows much more;
//   * the producer warpgroup: its first thread issues TMA loads (cp.async.bulk.tensor, 128-byte swizzle: the
//     layout wgmma reads, zeros past the end of the sequence) of Q tiles into QS stages (two; one at
//     D = 256) and of K and V tiles of BC keys (128; 64 above D = 128) into a ring of KVS K and KVS V
//     stages (KVS = 2, four at D = 64 where they are half the size); each stage has a "full" mbarrier (the TMA completes
//     its bytes on it) and an "empty" one (every consumer warp arrives once it is done reading; for a
//     Q stage the writer warps below, once they have copied the tile's O out of it);
//     the producer never waits for a consumer except for a free stage. With two Q stages the next
//     tile's Q is in shared memory before the consumers finish this one (with one, at D = 256, it
//     loads once the writers have copied this tile's O out): a short tile (N = 197 has
//     two key tiles) no longer waits a TMA round trip between tiles. Its warps 1 .. 3 are the writers:
//     they copy each tile's O, which the consumers stage in the tile's Q stage, to device memory and
//     then free the stage (see O below);
//   * register reallocation: the producer warpgroup drops to 40 registers, the consumers rise to 232
//     (NC = 3: 32 and 160; at 24 the writers spilled), so a 64-row accumulator of D fp32 values, S, and
//     the packed P fit without spills;
//   * inside a consumer, the pipeline of fused_hopper_attention.cu: iteration j issues
//     S_j = Q K_j^T and O += P_{j-1} V_{j-1} together, waits for S_j only, and runs the softmax of
//     S_j while the PV product still runs; at D = 128 the rescale of O by the previous softmax's
//     factors sits between the two issues, so that it runs while S_j does (at D = 64 after the wait);
//   * ping-pong between the consumers: NC named barriers make them take turns (0, 1, .., NC - 1, 0,
//     ...) issuing their products, so one warpgroup's softmax runs while another's GEMMs own the
//     tensor cores;
//   * persistent: the grid may be smaller than the number of (query tile, head) pairs, in
//     head-major order (a head's K and V stay in L2 while its query tiles run; causal: heads in
//     groups, each group's longest tiles first, see tw_tile_of). Block i starts with tile i; then, where
//     every tile is the same work, it takes i + gridDim.x, i + 2 gridDim.x, ... (sched null); where they
//     differ (causal: 1 to N / 128 key tiles; fusedw3's last tile of a head with a warpgroup
//     without rows) its producer asks a counter in device memory for the next tile as it starts one
//     (an atomicAdd), so a block that drew short tiles takes more of them. The producer hands the
//     tile number to the consumers with the Q tile: it writes the number in global memory beside
//     the counter (two slots a block, one per Q stage; -1: no more tiles) before its arrive on the
//     stage's full barrier, and the consumers read it there once the stage is in (compute-sanitizer
//     racecheck follows this handoff; a bulk copy of the number into shared memory it did not, and
//     the two measured the same). The counter goes up by exactly one per tile and per block; the last block to
//     finish puts it back to zero, so the next launch (or graph replay) starts from zero. Which
//     block runs a tile does not change its arithmetic: the output is the same bit for bit;
//   * fusedw3: each consumer warpgroup computes the key tiles of its own 64 rows only: none where they
//     start at or past row_end (a head's last 192-row tile), with causal none past its last row's key
//     tile; the turns of the key tiles it skips are passed on at once and their stages released unread,
//     so every consumer still takes n_kt + 1 turns a tile (the same bits as computing them);
//   * O: each consumer rounds its 64 rows into its own rows of its Q stage (stmatrix, four 8 x 8 blocks
//     a warp at a time) and each of its warps arrives on the stage's "O staged" mbarrier; the writer
//     warps wait for all of them, copy the tile's rows (< row_end) with 16-byte loads and stores, and
//     free the Q stage for the tile after next. The consumers go on to their next tile at once: the
//     copy, which took ~1 500 cycles of a consumer's first turn when the consumers did it (traced with
//     TW_TRACE), is off their path (side by side on one H200, 2026-12-02, with stmatrix: every shape 0-5 %
//     faster, the short batched one 3 %; docs/kernels.md, items 16 and 17);
//   * D = 64, NC = 2: a sequence's last key tile, when it holds at most 80 keys (ViT's N = 197 and
//     257), is computed as 80 keys (wgmma n80, the softmax over 80 columns, 5 k16 steps of P V), see
//     TW_BY_KEYS (NC = 3 has no registers to spare for it: ptxas serialized the wgmma).
//
// Layout (as fused_hopper_attention.cu): Q and O [B, H, N, D], K and V [B, H / group, N, D] or strided
// views (the QKV GEMM output read in place), 16-bit. Q, K and V arrive as TMA tensor maps over
// (D, N, heads, B) with a box of 64 columns x BR rows for Q and 64 x BC for K and V
// (tpattn/attention/fused.py encodes them); O as a pointer and its strides. D = 64 or 128 here, and in
// fused_ws_dims.cu 192 and 256 (key tiles of BC = 64 keys, one Q stage at 256) and, on those kernels,
// head dims DS below D (32, 80, 96, 160; the maps' zeros past DS). Query
// rows [row_begin, row_end) of every head are computed, in tiles of BR rows from row_begin (rows of
// the last tile past row_end are computed and not stored). Grid x: any number of blocks up to the
// tile count (tiles = ceil((row_end - row_begin) / BR) * B * H); block 128 (NC + 1) threads; dynamic shared memory
// (QS * BR + 2 * KVS * BC) * D * 2 + 1024 + 256 bytes (the last 256: the mbarriers). sched: null (the static order) or two int32 zeros in device
// memory that this kernel alone uses (and leaves at zero), 8 bytes of padding, then 32 bytes a block
// for the tile numbers (two 16-byte slots). Needs compute capability 9.0 (sm_90a).

#include "hopper_async.cuh"

// TW_TRACE (scripts/trace_fused.py defines it; the kernels tpattn launches are built without it): the
// producer thread and thread 0 of each consumer warpgroup of blocks 0 .. TW_TRACE_BLOCKS - 1 write
// (event code << 48 | clock64) at the points marked TW_MARK, in order, into tw_trace: per block, one row
// of TW_TRACE_LEN for the producer and one for each consumer
#ifdef TW_TRACE
#define TW_TRACE_BLOCKS 4
#define TW_TRACE_LEN 4096
__device__ unsigned long long tw_trace[TW_TRACE_BLOCKS * 4 * TW_TRACE_LEN];
#define TW_TRACE_COUNT int tr_n = 0
#define TW_MARK(role, code)                                                                              \
    do {                                                                                                 \
        if (blockIdx.x < TW_TRACE_BLOCKS && tr_n < TW_TRACE_LEN) {                                       \
            tc_u64 clk;                                                                                  \
            asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(clk));                                        \
            tw_trace[(blockIdx.x * 4 + (role)) * TW_TRACE_LEN + tr_n++] = ((tc_u64)(code) << 48) | (clk & 0xffffffffffffull); \
        }                                                                                                \
    } while (0)
#define TW_CMARK(code) /* in a consumer warpgroup c: its thread ctid == 0 */ \
    if (ctid == 0) TW_MARK(1 + c, code)
#else
#define TW_TRACE_COUNT
#define TW_MARK(role, code)
#define TW_CMARK(code)
#endif

// the tile numbers a producer hands its consumers, in global memory: written before the producer's
// arrive on the Q stage's full barrier (a release), read after the consumers' wait on it (an acquire)
__device__ __forceinline__ void tw_st_global(long long *p, long long v) {
    asm volatile("st.global.s64 [%0], %1;\n" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ long long tw_ld_global(const long long *p) {
    long long v;
    asm volatile("ld.global.s64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// four 8 x 8 matrices of 16-bit values from a warp's registers (each lane two values of a row: the mma
// accumulator layout) to shared memory, the rows at the addresses lanes 8 k .. 8 k + 7 give for matrix k
__device__ __forceinline__ void tw_stmatrix4(tc_u32 addr, tc_u32 a, tc_u32 b, tc_u32 c, tc_u32 d) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c),
                 "r"(d) : "memory");
}

// the key tiles (of BC keys) of rows that end before row `end`: with causal up to that row's, else all of them
template <int BC = 128>
__device__ __forceinline__ int tw_tile_keys(int end, int N, int causal) {
    const int all = (N + BC - 1) / BC, last = (end - 1) / BC + 1;
    return causal && last < all ? last : all;
}

// the tile sequence every warpgroup walks: tile t -> (batch * head, query tile, key tiles). The heads
// go in groups of hg (the last group may be smaller): a group's tiles run together, so its heads' K
// and V stay in L2. Inside a group, causal: the longest query tiles of all its heads first, then the
// next longest, ... (handed out by the counter, the last tiles of the run are the shortest ones and
// the blocks finish together); without causal hg = 1 and a head's tiles in order.
struct tw_tile {
    int bh, q0, n_kt;  // (batch, head), the tile's first query row, its key tiles
};
template <int BR, int BC = 128>
__device__ __forceinline__ tw_tile tw_tile_of(long long t, int nq, int row_begin, int row_end, int N, int causal, int BH,
                                              int hg) {
    tw_tile x;
    const long long per = (long long)hg * nq;
    const int g = (int)(t / per);
    const int idx = (int)(t - g * per), hn = min(hg, BH - g * hg);  // heads in this group
    const int qi = idx / hn;
    x.bh = g * hg + (idx - qi * hn);
    x.q0 = row_begin + (causal ? nq - 1 - qi : qi) * BR;  // causal: the longest rows first
    x.n_kt = (N + BC - 1) / BC;
    if (causal) {  // up to the key tile of the tile's last row (< row_end: 192-row tiles; with 128 rows from a
                   // row_begin that is a multiple of 128 the same key tile, and ptxas serialized fusedw's wgmma
                   // at D = 64 with the min)
        const int last = ((BR == 128 ? x.q0 + BR : min(x.q0 + BR, row_end)) - 1) / BC + 1;
        x.n_kt = last < x.n_kt ? last : x.n_kt;
    }
    return x;
}

// The statements after w run with W, a constant: TW_NARROW where w is TW_NARROW (at D = 64 only),
// else BC (the kernel's key tile: 128, or 64 above D = 128). At D = 64 a sequence's last key tile, when it holds at most 80 keys (N = 197: 69, N = 257:
// 1), is computed as 80 keys: S = Q K^T with wgmma n80, the softmax over 80 columns, P V over 5 k16
// steps. One extra width only: measured on the H200, each width is more code in the consumer, and
// with eight (16, 32, ..., 112) or two others beside 80 the 128-key loop itself ran up to 20 % slower.
#define TW_NARROW 80
#define TW_BY_KEYS(D, w, ...)              \
    if constexpr (D == 64) {               \
        if ((w) == TW_NARROW) {            \
            constexpr int W = TW_NARROW;   \
            __VA_ARGS__;                   \
        } else {                           \
            constexpr int W = 128;         \
            __VA_ARGS__;                   \
        }                                  \
    } else {                               \
        constexpr int W = BC;              \
        __VA_ARGS__;                       \
    }

// PG (fused_ws_paged.cu): K and V are read through a block table, not from [B, G, N, D] tensors (see the
// paged kernels' comment at the end of the file); table and pshift are that table and log2 of the page size.
// qoff: Q's map and O hold the rows from qoff on (row r at their row r - qoff).
// F8 (fused_ws_fp8.cu): Q, K and V in e4m3 (one byte a value) with scales, O in fp16 or bf16 (BF16), at
// D = 128 with NC = 2 only; see the FP8 kernels' comment at the end of the file. f8: the scales
// (sq [B, H, nblk], sk and sv [B, G, nblk], fp32), nblk (their blocks of 128 rows a head) and kvb (1
// where they are per block; 0: one scale a head, index 0 for every tile)
// TW_F8_FMA: of a thread's 16 pairs of scores a row, how many the FP8 kernel exponentiates on the FMA
// pipes (hw_exp2_fma) rather than the MUFU
#ifndef TW_F8_FMA
#define TW_F8_FMA 0
#endif
// TW_F8_LAZY: the FP8 kernel's running max moves only by more than this many powers of 2 (hw_softmax's
// LAZY; at most 8: P, up to 2^LAZY, stays under e4m3's 448), and O is rescaled only when it moved
#ifndef TW_F8_LAZY
#define TW_F8_LAZY 0
#endif
// TW_F8_TREE: the FP8 kernel's row maxima over this many running maxima each (hw_softmax's TREE; 1: one
// chain of fmaxf over the row's 16 pairs; 2, 4, 8, 16: shorter chains, the same bits)
#ifndef TW_F8_TREE
#define TW_F8_TREE 1
#endif
// TW_F8_TURN: the FP8 kernel's two consumers take turns at the softmax as they do at issuing the products
// (named barriers TURN + NC + c), so that one's exponentials run while the other's products do instead of
// both sharing the MUFU at once. 1: a turn is the whole softmax; 2: its exponentials only (each waits
// for its turn once both rows' maxima are taken, hw_softmax's hook); 0: the softmax as soon as S is in
#ifndef TW_F8_TURN
#define TW_F8_TURN 0
#endif
// hw_softmax's hook at TW_F8_TURN 2: this consumer's turn at the exponentials (named barrier id)
struct tw_exp_turn {
    static constexpr bool between = true;
    int id;
    __device__ __forceinline__ void operator()() const { tw_sync(id, 256); }
};
struct tw_f8s {
    const float *sq, *sk, *sv;
    int nblk, kvb;
};
template <int D, bool BF16, int NC, int DS = D, bool PG = false, bool F8 = false>
__device__ __forceinline__ void tw_fused(const tw_tmap *qm, const tw_tmap *km, const tw_tmap *vm,
                                         tc_u16 *__restrict__ O, float *__restrict__ Lse, int BH, int N,
                                         float scale_log2, int causal,
                                         int row_begin, int row_end, int H, int group, long long o_sb, long long o_sh,
                                         int o_ld, int hg, int *__restrict__ sched,
                                         const int *__restrict__ table = nullptr, int pshift = 0, int qoff = 0,
                                         tw_f8s f8 = {}) {
    // key tiles of BC keys: 128, or 64 above D = 128 (S and P of 64 keys beside a 64 x D accumulator)
    constexpr int BR = 64 * NC, BC = D > 128 ? 64 : 128, EL = F8 ? 1 : 2, PANELS = D * EL / 128;
    static_assert(!F8 || (D == 128 && NC == 2 && !PG), "the FP8 kernel: D = 128, two consumers, contiguous K/V");
    // Q stages: two, one at D = 256; K/V stages: two, four at D = 64. Shared memory: 2 Q + 4 K/V tiles of
    // 128 rows = 192 KB at D = 128; at D = 192 2 Q + 4 K/V tiles of 64 rows, 192 KB; at D = 256 1 + 4, 192 KB
    // F8: K and V tiles of half the bytes, four stages; a Q stage keeps the bytes of a 16-bit tile, where
    // the consumers stage O (QX: the bytes of the Q tile the TMA loads into it)
    constexpr int QS = D == 256 ? 1 : 2, KVS = D == 64 || F8 ? 4 : 2;
    constexpr tc_u32 QB = BR * D * 2, KB = BC * D * EL;  // bytes of one Q stage and of one K or V tile
    constexpr tc_u32 QX = BR * D * EL;
    constexpr int TURN = 1;  // named barrier ids: turns 1 .. NC
    const tc_u32 sQ = hw_smem_base(), sK = sQ + QS * QB, sV = sK + KVS * KB, bars = sV + KVS * KB;
    // mbarriers, 8 bytes each: Q full [QS], Q empty [QS], K full [KVS], K empty [KVS], V full [KVS],
    // V empty [KVS], O staged [QS]
    auto q_full = [&](int s) { return bars + 8 * s; };
    auto q_empty = [&](int s) { return bars + 8 * (QS + s); };
    auto k_full = [&](int s) { return bars + 16 * QS + 8 * s; };
    auto k_empty = [&](int s) { return bars + 16 * QS + 8 * (KVS + s); };
    auto v_full = [&](int s) { return bars + 16 * QS + 8 * (2 * KVS + s); };
    auto v_empty = [&](int s) { return bars + 16 * QS + 8 * (3 * KVS + s); };
    auto o_full = [&](int s) { return bars + 16 * QS + 32 * KVS + 8 * s; };
    // with the counter: the tile number of each Q stage. The producer writes it in global memory beside
    // the counter (this block's QS slots of 16 bytes) before it arrives on the stage's full barrier;
    // the consumers read it there once the stage is in
    long long *ring = sched ? reinterpret_cast<long long *>(sched + 4) + 2 * QS * blockIdx.x : nullptr;
    auto q_stage = [](int n) { return n % QS; };
    auto q_parity = [](int n) { return (n / QS) & 1; };
    // a ring position k (K/V tiles counted over the block's whole run): its stage and phase parity
    auto stage = [](int k) { return k % KVS; };
    auto parity = [](int k) { return (k / KVS) & 1; };
    constexpr int CH = D / 8, CHS = DS / 8;  // 16-byte chunks of a row of O: computed, stored (the head dim's)
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31;
    const int nq = (row_end - row_begin + BR - 1) / BR;
    const long long tiles = (long long)nq * BH;

    if (tid == 0) {
        for (int s = 0; s < QS; ++s) {
            tw_bar_init(q_full(s), 1);
            tw_bar_init(q_empty(s), 3);       // every writer warp, once it has copied the stage's O out
            tw_bar_init(o_full(s), 4 * NC);   // every consumer warp, once it has staged its rows of O
        }
        for (int s = 0; s < KVS; ++s) {
            tw_bar_init(k_full(s), 1);
            tw_bar_init(k_empty(s), 4 * NC);
            tw_bar_init(v_full(s), 1);
            tw_bar_init(v_empty(s), 4 * NC);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        hw_fence_proxy();
    }
    __syncthreads();

    if (wg == 0) {  // ---------------------------------------------------------------- producer
        if constexpr (NC == 2)
            asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        else
            asm volatile("setmaxnreg.dec.sync.aligned.u32 32;\n" ::: "memory");
        if (tid == 0) {
            TW_TRACE_COUNT;
            int kt = 0;  // key tiles loaded so far
            long long t = blockIdx.x;
            // the tile's coordinates (key tiles, first query row, batch, head, K/V head). At D = 128 worked out
            // for the next tile during this tile's last V wait, off the path between the tiles (side by side
            // on one H200: 0-3.3 % faster at D = 128, long causal most, short batched 1 %; 0.4-2.7 % slower
            // at D = 64, which works them out as the tile starts; docs/kernels.md, item 18). D = 256 too; not
            // D = 192, where the coordinates held across the K/V loop spilled the producer's 40 registers
            constexpr bool EARLY = D == 128 || D == 256;
            int n_kt = 0, q0 = 0, b = 0, hh = 0, hk = 0;
            auto coords = [&](long long u) {
                if (EARLY && u >= tiles) return;
                const tw_tile x = tw_tile_of<BR, BC>(u, nq, row_begin, row_end, N, causal, BH, hg);
                n_kt = x.n_kt;
                q0 = x.q0;
                b = x.bh / H;
                hh = x.bh - b * H;
                hk = hh / group;
            };
            if constexpr (EARLY) coords(t);
            for (int n = 0;; ++n) {  // n: query tiles handed over so far
                const int qs = q_stage(n);
                if (!sched && t >= tiles) break;  // the static order: the consumers know where it ends
                TW_MARK(0, 20);
                tw_bar_wait(q_empty(qs), q_parity(n) ^ 1);
                TW_MARK(0, 21);
                if (sched) {  // the tile number (-1: no more) into the stage's slot, before the stage's arrive
                    tw_st_global(ring + 2 * qs, t < tiles ? t : -1ll);
                    if (t >= tiles) {
                        tw_bar_arrive(q_full(qs));
                        break;
                    }
                }
                tw_bar_expect(q_full(qs), QX);
                // the next tile, asked for now so that the atomic's round trip hides behind the loads
                const long long next = sched ? gridDim.x + (long long)atomicAdd(sched, 1) : t + gridDim.x;
                if constexpr (!EARLY) coords(t);
#pragma unroll
                for (int p = 0; p < PANELS; ++p)
                    tw_tma(sQ + qs * QB + p * BR * 128, qm, 128 / EL * p, q0 - qoff, hh, b, q_full(qs));
                const int nk = n_kt, bb = b, hv = hk;  // this tile's, while coords() moves on to the next
                // key tile j of K or V into the stage at dst. PG: in boxes of PB = min(page, BC) keys, each
                // from its page table[key / page] at offset key % page (the map is over the pool
                // [pages, G, page, D]); keys past the sequence read its last page (finite values the
                // mask drops, as it drops the zeros a contiguous map reads there)
                auto kv_tile = [&](tc_u32 dst, const tw_tmap *map, int j, tc_u32 bar, bool vt = false) {
                    if constexpr (F8) {  // K [B, G, N, D]: keys are rows; V^T [B, G, D, N']: keys are columns
                        if (vt)
                            tw_tma(dst, map, j * BC, 0, hv, bb, bar);
                        else
                            tw_tma(dst, map, 0, j * BC, hv, bb, bar);
                    } else if constexpr (PG) {
                        const int P = 1 << pshift, PB = P < BC ? P : BC;
                        for (int k = 0; k < BC; k += PB) {
                            const int key = j * BC + k;
                            const int pg = __ldg(table + ((key < N ? key : N - 1) >> pshift));
#pragma unroll
                            for (int p = 0; p < PANELS; ++p)
                                tw_tma(dst + p * BC * 128 + k * 128, map, 64 * p, key & (P - 1), hv, pg, bar);
                        }
                    } else {
#pragma unroll
                        for (int p = 0; p < PANELS; ++p) tw_tma(dst + p * BC * 128, map, 64 * p, j * BC, hv, bb, bar);
                    }
                };
                for (int j = 0; j < nk; ++j, ++kt) {
                    const int s = stage(kt);
                    tw_bar_wait(k_empty(s), parity(kt) ^ 1);
                    TW_MARK(0, 22);
                    tw_bar_expect(k_full(s), KB);
                    kv_tile(sK + s * KB, km, j, k_full(s));
                    if (EARLY && j == nk - 1) coords(next);
                    tw_bar_wait(v_empty(s), parity(kt) ^ 1);
                    TW_MARK(0, 23);
                    tw_bar_expect(v_full(s), KB);
                    kv_tile(sV + s * KB, vm, j, v_full(s), true);
                }
                t = next;
            }
            // this block asks the counter nothing more: the last block to get here puts it back to zero
            if (sched) {
                __threadfence();
                if (atomicAdd(sched + 1, 1) == (int)gridDim.x - 1) {
                    sched[0] = 0;
                    sched[1] = 0;
                }
            }
        } else if (tid >= 32) {  // warps 1 .. 3, the writers: each tile's O, staged in its Q stage, to device memory
            for (int n = 0;; ++n) {  // the tiles in the consumers' order
                const int qs = q_stage(n);
                long long t = blockIdx.x + (long long)n * gridDim.x;
                if (!sched && t >= tiles) break;
                tw_bar_wait(q_full(qs), q_parity(n));
                if (sched) {
                    t = tw_ld_global(ring + 2 * qs);
                    if (t < 0) break;
                }
                const tw_tile x = tw_tile_of<BR, BC>(t, nq, row_begin, row_end, N, causal, BH, hg);
                const int b = x.bh / H, hh = x.bh - b * H, rows = min(BR, row_end - x.q0);
                tc_u16 *Oh = O + b * o_sb + hh * o_sh + (long long)(x.q0 - qoff) * o_ld;
                const tc_u32 sQs = sQ + qs * QB;
                tw_bar_wait(o_full(qs), q_parity(n));
                for (int e = tid - 32; e < rows * CHS; e += 96) {
                    const int r = e / CHS, ch = e - r * CHS;
                    *(tc_u4 *)(Oh + (long long)r * o_ld + ch * 8) = hw_ld_shared4(sQs + hw_swz<BR>(r, ch));
                }
                hw_fence_proxy();  // these generic reads of the Q stage before a later tile's TMA writes it
                __syncwarp();
                if (lane == 0) tw_bar_arrive(q_empty(qs));
            }
        }
        return;
    }

    // ------------------------------------------------------------------------------ consumers
    if constexpr (NC == 2)
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    else
        asm volatile("setmaxnreg.inc.sync.aligned.u32 160;\n" ::: "memory");
    // the warpgroup index through a shuffle from lane 0, so that the compiler knows it is the same in every
    // lane, and so is what is taken from it (fusedw3's key tile counts: with wg - 1 it took the loops for
    // divergent and moved the ring arithmetic off the uniform datapath, 14 % slower at N = 257; fusedw at
    // D = 128: half the R2UR moves, 2-4 % faster). Not fusedw at D = 64: ptxas serialized its wgmma with it
    const int c = NC == 2 && D == 64 ? wg - 1 : __shfl_sync(0xffffffffu, wg - 1, 0), ctid = tid - 128 * wg,
              warp = ctid >> 5;
    const int rl = c * 64 + warp * 16 + (lane >> 2);  // this thread's rows in the tile: rl and rl + 8
    auto my_turn = [&]() { tw_sync(TURN + c, 256); };
    auto your_turn = [&]() { tw_arrive(TURN + (c + 1) % NC, 256); };
    constexpr bool STURN = F8 && TW_F8_TURN;  // the softmax turns (ids TURN + NC ..): consumer 0 first
    auto my_softmax = [&]() {
        if constexpr (STURN && TW_F8_TURN == 1) tw_sync(TURN + NC + c, 256);
    };
    auto your_softmax = [&]() {
        if constexpr (STURN) tw_arrive(TURN + NC + (c + 1) % NC, 256);
    };
    if (c == NC - 1) your_softmax();
    auto release = [&](tc_u32 bar) {
        __syncwarp();
        if (lane == 0) tw_bar_arrive(bar);
    };
    if (c == NC - 1) your_turn();  // consumer 0 issues first, then 1, ...
    TW_TRACE_COUNT;

    int kt = 0;
    for (int n = 0;; ++n) {
        const int qs = q_stage(n);
        long long t = blockIdx.x + (long long)n * gridDim.x;  // the static order
        if (!sched && t >= tiles) break;
        TW_CMARK(1);
        tw_bar_wait(q_full(qs), q_parity(n));
        TW_CMARK(2);
        if (sched) {
            t = tw_ld_global(ring + 2 * qs);
            if (t < 0) break;
        }
        const tw_tile x = tw_tile_of<BR, BC>(t, nq, row_begin, row_end, N, causal, BH, hg);
        const int q0 = x.q0, n_kt = x.n_kt;
        const int r0 = q0 + rl, wr0 = q0 + c * 64;  // this thread's first row, the warpgroup's first
        const tc_u32 sQs = sQ + qs * QB, sq = sQs + c * 64 * 128;  // the Q stage; this warpgroup's rows (panel 0)
        float o[D / 2], s[64];
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
        float m[2] = {TC_NEG_INF, TC_NEG_INF}, l[2] = {0.0f, 0.0f}, alpha[2];
        bool moved = true;  // F8 with TW_F8_LAZY: whether the last softmax moved a max of the warp's rows
        // F8: key tile j's scores scale (its exponent's factor in log2 units: the query tile's and the key
        // block's scales, 1/sqrt(d), log2(e); at least 2^-126, so that a masked -inf times it stays -inf)
        // and its V block's scale; O is held in units of sv_run, the V scale of the last key tile (a tile
        // of another block rescales it through alpha: sv_run / sv, correctly rounded, 1 exactly where equal)
        float qsc = 0.0f, sv_run = 1.0f;
        long long kvs = 0;
        if constexpr (F8) {
            const int b = x.bh / H, hk = (x.bh - b * H) / group;
            qsc = __ldg(f8.sq + (long long)x.bh * f8.nblk + (q0 >> 7) * f8.kvb) * scale_log2;
            kvs = ((long long)b * (H / group) + hk) * f8.nblk;
        }
        auto f8_c = [&](int j) {
            return fmaxf(qsc * __ldg(f8.sk + kvs + j * f8.kvb), 1.17549435e-38f);
        };
        auto f8_v = [&](int j) { return __ldg(f8.sv + kvs + j * f8.kvb); };
        constexpr int KP = F8 ? 4 : BC / 16;  // the A fragments of P of a whole key tile (k32 or k16 steps)

        // fusedw3: this warpgroup's key tiles. None where its 64 rows start at or past row_end (the last
        // tile of a head: N = 4096 is 21 1/3 tiles of 192 rows); with causal nk, up to the key tile of its
        // last row (< row_end), one key tile before the tile's last for a third of the warpgroups. The
        // key tiles it skips are masked out for all of its rows: its output is the same bits. NC = 2:
        // both warpgroups of a 128-row tile end on the same key tile of 128 keys (row_begin a multiple of
        // 128 from the host), and a second warpgroup without rows (N mod 128 <= 64) computes them as before:
        // with the branch around its products ptxas serialized the wgmma at D = 64. With key tiles of 64
        // (D > 128) the first warpgroup of a causal tile computes one tile past its rows' last, all of it
        // masked (alpha 1, nothing added: the same output; the work is the price of the shared count)
        const bool rows_here = NC == 2 || wr0 < row_end;
        const int nk = NC == 2 ? n_kt : tw_tile_keys<BC>(min(wr0 + 64, row_end), N, causal);
        // keys of the last key tile that are computed: TW_NARROW where it holds that many or fewer (D = 64)
        const int wl = D == 64 && NC == 2 && N - (nk - 1) * BC <= TW_NARROW ? TW_NARROW : BC;
        // O *= alpha, the factors of the last softmax (at D = 128 in the next turn, between the issues of S_j
        // and of P V, so that it runs while S_j does: with the per-warp copy of O below 1.2-2.3 % faster
        // measured, alone within 1 %; at D = 64 it was 2-7 % slower there)
        auto rescale = [&]() {
            if constexpr (F8 && TW_F8_LAZY > 0) {
                if (!moved) return;
            }
#pragma unroll
            for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
        };
        // S_0 = Q K_0^T (W keys), its mask and softmax
        auto first = [&](int w) {
            TW_BY_KEYS(D, w,
                tw_bar_wait(k_full(stage(kt)), parity(kt));
                TW_CMARK(3);
                my_turn();
                TW_CMARK(4);
                hw_keep_first<BC / 2>(s);
                hw_wg_fence();
                if constexpr (F8)
                    hw_qk8<D>(s, sq, sK + stage(kt) * KB);
                else
                    hw_qk<D, BR, BF16, W, BC>(s, sq, sK + stage(kt) * KB);
                hw_wg_commit();
                your_turn();
                hw_wg_wait<0>();
                TW_CMARK(5);
                hw_keep_first<BC / 2>(s);
                release(k_empty(stage(kt)));
                hw_mask<W>(s, 0, N, causal, wr0, r0, lane);
                if constexpr (F8) {
                    my_softmax();
                    if constexpr (TW_F8_TURN == 2)
                        moved = hw_softmax<W, TW_F8_FMA, TW_F8_LAZY, TW_F8_TREE>(s, m, l, alpha, f8_c(0),
                                                                                 tw_exp_turn{TURN + NC + c});
                    else
                        moved = hw_softmax<W, TW_F8_FMA, TW_F8_LAZY, TW_F8_TREE>(s, m, l, alpha, f8_c(0));
                    your_softmax();
                    sv_run = f8_v(0);
                } else {
                    hw_softmax<W>(s, m, l, alpha, scale_log2);
                }
                TW_CMARK(6));
        };
        // iteration j (1 <= j < n_kt): S_j = Q K_j^T (W keys) and O += P_{j-1} V_{j-1} (128 keys)
        auto step = [&](int j, int w) {
            const int kj = kt + j, vj = kj - 1;  // ring positions of K_j and V_{j-1}
            TW_BY_KEYS(D, w,
                TW_CMARK(7);
                tw_bar_wait(k_full(stage(kj)), parity(kj));
                tw_bar_wait(v_full(stage(vj)), parity(vj));
                TW_CMARK(8);
                tc_u32 pa[8][4];
                if constexpr (F8)
                    hw_pack_p8(pa, s);
                else
                    hw_pack_p<BF16, 8, BC / 16>(pa, s);
                my_turn();
                TW_CMARK(9);
                hw_keep(o);
                hw_keep_first<KP>(pa);
                hw_wg_fence();
                if constexpr (F8)
                    hw_qk8<D>(s, sq, sK + stage(kj) * KB);
                else
                    hw_qk<D, BR, BF16, W, BC>(s, sq, sK + stage(kj) * KB);
                hw_wg_commit();
                if constexpr (D >= 128) {  // O rescaled by the last softmax's factors while S_j runs
                    rescale();
                    hw_keep(o);
                    hw_wg_fence();
                }
                if constexpr (F8)
                    hw_pv8(o, pa, sV + stage(vj) * KB);
                else
                    hw_pv<D, BF16, BC / 16, BC>(o, pa, sV + stage(vj) * KB);
                hw_wg_commit();
                your_turn();
                hw_wg_wait<1>();  // S_j is done; the PV product may still run
                TW_CMARK(10);
                hw_keep_first<BC / 2>(s);
                release(k_empty(stage(kj)));
                hw_mask<W>(s, j * BC, N, causal, wr0, r0, lane);
                if constexpr (F8) {
                    my_softmax();
                    if constexpr (TW_F8_TURN == 2)
                        moved = hw_softmax<W, TW_F8_FMA, TW_F8_LAZY, TW_F8_TREE>(s, m, l, alpha, f8_c(j),
                                                                                 tw_exp_turn{TURN + NC + c});
                    else
                        moved = hw_softmax<W, TW_F8_FMA, TW_F8_LAZY, TW_F8_TREE>(s, m, l, alpha, f8_c(j));
                    your_softmax();
                    if (f8.kvb) {  // V of another scale block: O into its units
                        const float sv = f8_v(j), r = __fdiv_rn(sv_run, sv);
                        alpha[0] *= r;
                        alpha[1] *= r;
                        sv_run = sv;
                        moved = true;
                    }
                } else {
                    hw_softmax<W>(s, m, l, alpha, scale_log2);
                }
                TW_CMARK(11);
                hw_wg_wait<0>();
                TW_CMARK(12);
                hw_keep(o);
                hw_keep_first<KP>(pa);
                release(v_empty(stage(vj)));
                if constexpr (D == 64) rescale());
        };
        // the last O += P V (W keys)
        auto last = [&](int w) {
            const int vj = kt + nk - 1;
            TW_BY_KEYS(D, w,
                TW_CMARK(13);
                tw_bar_wait(v_full(stage(vj)), parity(vj));
                TW_CMARK(14);
                tc_u32 pa[8][4];
                if constexpr (F8)
                    hw_pack_p8(pa, s);
                else
                    hw_pack_p<BF16, 8, W / 16>(pa, s);
                if constexpr (D >= 128) rescale();
                my_turn();
                TW_CMARK(15);
                hw_keep(o);
                hw_keep_first<KP>(pa);
                hw_wg_fence();
                if constexpr (F8)
                    hw_pv8(o, pa, sV + stage(vj) * KB);
                else
                    hw_pv<D, BF16, W / 16, BC>(o, pa, sV + stage(vj) * KB);
                hw_wg_commit();
                your_turn();
                hw_wg_wait<0>();
                TW_CMARK(16);
                hw_keep(o);
                hw_keep_first<KP>(pa);
                release(v_empty(stage(vj))));
        };
        // a key tile this warpgroup does not compute: its turn passed on at once (every consumer takes
        // n_kt + 1 turns a tile), its K and V stages released once they are in (an arrive before the
        // stage's full phase would count towards the previous phase of its empty barrier)
        auto skip = [&](int j) {
            const int kj = kt + j;
            my_turn();
            your_turn();
            tw_bar_wait(k_full(stage(kj)), parity(kj));
            release(k_empty(stage(kj)));
            tw_bar_wait(v_full(stage(kj)), parity(kj));
            release(v_empty(stage(kj)));
        };
        // the last key tile apart, so that the loop's copy has 128-key tiles only
        if (rows_here) {
            first(nk == 1 ? wl : BC);
            for (int j = 1; j < nk - 1; ++j) step(j, BC);
            if (nk > 1) step(nk - 1, wl);
            last(wl);
        } else {  // the turn `last` would have taken
            my_turn();
            your_turn();
        }
        if constexpr (NC == 2) {
            kt += n_kt;
        } else {  // n_kt and nk again, from q0 through an opaque copy: held across the loop, they cost a spill there
            int q0o;
            asm volatile("mov.b32 %0, %1;\n" : "=r"(q0o) : "r"(q0));
            const int wr0o = q0o + c * 64, n_kt_o = tw_tile_keys<BC>(min(q0o + BR, row_end), N, causal);
            for (int j = wr0o < row_end ? tw_tile_keys<BC>(min(wr0o + 64, row_end), N, causal) : 0; j < n_kt_o; ++j) skip(j);
            kt += n_kt_o;
        }

        // O = acc / l: this warpgroup's rows, staged in its own rows of the Q stage (its products are
        // done reading them); the writer warps copy the stage out once every consumer warp has arrived
        if (rows_here) {
            hw_write_lse(Lse, (long long)x.bh * N, r0, row_end, m, l, lane);
            hw_finish_l<true>(l);  // by the approximate reciprocal
            if constexpr (F8) {    // O's units: the last V scale
                l[0] *= sv_run;
                l[1] *= sv_run;
            }
            // by stmatrix, chunks j and j + 1 of the warp's 16 rows at a time: lane L gives the address of
            // row L & 7 of matrix L >> 3, the matrices (rows 0-7, j), (8-15, j), (0-7, j + 1), (8-15, j + 1)
            const int srow = c * 64 + warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
            for (int j = 0; j < CH; j += 2)
                tw_stmatrix4(sQs + hw_swz<BR>(srow, j + (lane >> 4)),
                             tc_pack<BF16>(o[4 * j] * l[0], o[4 * j + 1] * l[0]),
                             tc_pack<BF16>(o[4 * j + 2] * l[1], o[4 * j + 3] * l[1]),
                             tc_pack<BF16>(o[4 * j + 4] * l[0], o[4 * j + 5] * l[0]),
                             tc_pack<BF16>(o[4 * j + 6] * l[1], o[4 * j + 7] * l[1]));
        }
        TW_CMARK(17);
        release(o_full(qs));
    }
    if (c == 0) my_turn();  // the last consumer's last turn hand-over, so no barrier is left half arrived
}

// DS: the head dim the tensors have, at most the D the kernel computes with (the tensor maps read zeros
// in Q, K and V's columns past DS, so S is Q K^T over DS columns and O's columns past DS are zeros; the
// writers store DS of them). The kernel's name carries DS.
#define TW_DEFINE_DS(NAME, SUF, BF16, D, NC, DS)                                                        \
    extern "C" __global__ void __launch_bounds__(128 + 128 * NC, 1)                                     \
        NAME##_##SUF##_d##DS(const __grid_constant__ tw_tmap qm, const __grid_constant__ tw_tmap km,    \
                             const __grid_constant__ tw_tmap vm, tc_u16 *__restrict__ O,                 \
                             float *__restrict__ Lse, int BH, int N,                                     \
                             float scale_log2, int causal, int row_begin, int row_end, int H, int group, \
                             long long o_sb, long long o_sh, int o_ld, int hg, int *__restrict__ sched) { \
        tw_fused<D, BF16, NC, DS>(&qm, &km, &vm, O, Lse, BH, N, scale_log2, causal, row_begin, row_end, H, \
                                  group, o_sb, o_sh, o_ld, hg, sched);                                   \
    }
#define TW_DEFINE(NAME, SUF, BF16, D, NC) TW_DEFINE_DS(NAME, SUF, BF16, D, NC, D)
// fused_ws_paged.cu: a prefill's T rows of one sequence over its K and V in a paged pool (tpattn/paged.py),
// read in place through its block table. The sequence's length before the step, L0, is read from device
// memory (*start), so that one CUDA graph of a chunk's step serves every chunk of T rows: the rows are
// positions L0 .. L0 + T - 1, causal over keys 0 .. L0 + T - 1, in row tiles from L0 (any L0). qm: a map over
// the T rows (row 0: position L0), O the same rows; km and vm: maps over the pool [pages, G, page, D]
// (dimensions (D, page, G, pages), a box of 64 columns x min(page, 128) rows); table: the sequence's row of
// the block table (int32 page ids, at least ceil((L0 + T) / page) of them); pshift: log2 of the page size
// (pages of 16 tokens or more, a power of two). One sequence a launch (BH = its query heads; batch 1)
#define TW_DEFINE_PG(NAME, SUF, BF16, D, NC)                                                              \
    extern "C" __global__ void __launch_bounds__(128 + 128 * NC, 1)                                     \
        NAME##_##SUF##_d##D##_pg(const __grid_constant__ tw_tmap qm, const __grid_constant__ tw_tmap km, \
                                 const __grid_constant__ tw_tmap vm, tc_u16 *__restrict__ O, int BH,     \
                                 int T, float scale_log2, int H, int group, long long o_sb, long long o_sh, \
                                 int o_ld, int hg, int *__restrict__ sched, const int *__restrict__ table, \
                                 const int *__restrict__ start, int pshift) {                            \
        const int L0 = __ldg(start);                                                                     \
        tw_fused<D, BF16, NC, D, true>(&qm, &km, &vm, O, nullptr, BH, L0 + T, scale_log2, 1, L0, L0 + T, H, \
                                       group, o_sb, o_sh, o_ld, hg, sched, table, pshift, L0);          \
    }
// fused_ws_fp8.cu: the FP8 forward (tpattn/attention/fp8_ws.py) at D = 128. Q [B, H, N, 128] and K
// [B, G, N, 128] in e4m3 (maps of a box of 128 columns, 128 bytes, by BR or BC rows); V transposed,
// [B, G, 128, N'] (N' >= N a multiple of 16, zeros past N), each 16 keys stored in the order of P's
// fragments (hw_pack_p8), under a map of a box of 128 keys by 128 rows; O [B, H, N, 128] in fp16 (f16)
// or bf16 (bf16). Scores, softmax and O accumulate in fp32; P is rounded to e4m3 for the PV product.
// Scales (fp32): sq [B, H, nblk], sk and sv [B, G, nblk], nblk blocks of 128 rows a head where kvb = 1,
// one a head (nblk = 1) where kvb = 0. scale_log2: log2(e) / sqrt(128). The rows of every head from 0 to N.
#define TW_DEFINE_F8(SUF, BF16)                                                                           \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                \
        fusedw8_##SUF##_d128(const __grid_constant__ tw_tmap qm, const __grid_constant__ tw_tmap km,   \
                             const __grid_constant__ tw_tmap vm, tc_u16 *__restrict__ O, int BH, int N, \
                             float scale_log2, int causal, int H, int group, long long o_sb, long long o_sh, \
                             int o_ld, int hg, int *__restrict__ sched, const float *__restrict__ sq,  \
                             const float *__restrict__ sk, const float *__restrict__ sv, int nblk, int kvb) { \
        tw_fused<128, BF16, 2, 128, false, true>(&qm, &km, &vm, O, nullptr, BH, N, scale_log2, causal, 0, N, H, \
                                                 group, o_sb, o_sh, o_ld, hg, sched, nullptr, 0, 0,     \
                                                 tw_f8s{sq, sk, sv, nblk, kvb});                         \
    }
#if defined(TW_PAGED)
TW_DEFINE_PG(fusedw, f16, false, 64, 2)
TW_DEFINE_PG(fusedw, bf16, true, 64, 2)
TW_DEFINE_PG(fusedw, f16, false, 128, 2)
TW_DEFINE_PG(fusedw, bf16, true, 128, 2)
#elif defined(TW_FP8)
TW_DEFINE_F8(f16, false)
TW_DEFINE_F8(bf16, true)
#elif !defined(TW_OTHER_DIMS)
TW_DEFINE(fusedw, f16, false, 64, 2)
TW_DEFINE(fusedw, bf16, true, 64, 2)
TW_DEFINE(fusedw, f16, false, 128, 2)
TW_DEFINE(fusedw, bf16, true, 128, 2)
TW_DEFINE(fusedw3, f16, false, 64, 3)
TW_DEFINE(fusedw3, bf16, true, 64, 3)
#else  // fused_ws_dims.cu: the other head dims users run, each on the next of 64, 128, 192, 256
TW_DEFINE(fusedw, f16, false, 192, 2)
TW_DEFINE(fusedw, bf16, true, 192, 2)
TW_DEFINE(fusedw, f16, false, 256, 2)
TW_DEFINE(fusedw, bf16, true, 256, 2)
TW_DEFINE_DS(fusedw, f16, false, 64, 2, 32)
TW_DEFINE_DS(fusedw, bf16, true, 64, 2, 32)
TW_DEFINE_DS(fusedw, f16, false, 128, 2, 80)
TW_DEFINE_DS(fusedw, bf16, true, 128, 2, 80)
TW_DEFINE_DS(fusedw, f16, false, 128, 2, 96)
TW_DEFINE_DS(fusedw, bf16, true, 128, 2, 96)
TW_DEFINE_DS(fusedw, f16, false, 192, 2, 160)
TW_DEFINE_DS(fusedw, bf16, true, 192, 2, 160)
#endif
