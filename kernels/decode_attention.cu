// decode_attention.cu -- attention of one query row per sequence over a KV cache, split along the
// cache ("flash-decoding"), and the step's rotary positions + cache append; written for this project.
//
// A decode step is memory-bound: every key and value of the cache is read once to produce one row
// per head. One block per (sequence, K/V head) would leave most SMs idle at small batch, so the
// cache length is split into S chunks: block (s, b * G + g) reads chunk s of K/V head g of sequence
// b once for all the query heads of its group (grouped-query attention: GQ = H / G query heads share
// each K/V tile, read in place), keeps an online softmax per head, and writes a partial output and
// its logsumexp. The last of the S blocks of a (b, g) to finish (a ticket from an atomic counter,
// reset by that block for the next call) combines the S partials of its heads:
//   o = sum_s 2^(L_s - L) o_s,   L = log2 sum_s 2^L_s
// so a step is one launch, and no separate combine kernel waits for a launch and a whole grid.
//
//   dec_split   128 threads = 8 groups of 16 lanes; a group takes DEC_UNROLL keys at a time (16 lanes
//               x 8 elements = 128 = d; d = 64: 8 lanes, 16 groups), 16-byte loads of all of them
//               first, each dot product reduced over the group's lanes with shuffles, then one
//               online-softmax update per head for the DEC_UNROLL keys (one rescale, not one per
//               key); the groups' partials are merged through shared memory and written:
//               Op [B, H, S, D] fp32, Lp [B, H, S] fp32 (log2 units); the last block reads them
//               back (from L2) into O [B, H, D] in the storage dtype.
//               Built for GQ = 1, 2, 4 and 8 query heads at a time (registers per head: its q
//               and its output columns); a group of more heads than 8 is done in passes of 8.
//   dec_mma     the same split on tensor cores (see its comment): the group's heads are the rows
//               of an m16 tile, so a K/V tile costs the same few instructions for 1 or 16 heads.
// tpattn/decode.py runs dec_split for multi-head attention (one head per K/V head: the m16 tile
// would be 15/16 empty, and dec_split is faster there, measured) and dec_mma for grouped heads
// (CUDA cores run out of instructions before memory runs out of bandwidth at 4 heads a group).
//
// The cache length L = Ladd + (*Lpos where Lpos is not null): a CUDA graph of a decode step reads
// the position from device memory, so that one graph serves every step. The chunk length is
// ceil(L / S) for the S of the launch (chosen from the cache's capacity when the length is on the
// device); blocks past L write an empty partial (L_s = -inf, o_s = 0).
//
//   dec_append  the step's q, k, v rows (the QKV GEMM's output [B, H + 2G, D]): q and k rotated
//               (rotary positions at *pos: the cos/sin tables [LMAX, D/2], fp32; null: none;
//               Hugging Face halves or interleaved pairs), q written out [B, H, D], k and v into
//               the cache at position *pos. One launch instead of the slicing, rotation and copies.
//   dec_append_pg  the same for a paged step's R packed rows, each at its own position pos[r] (its
//               angles there), k and v into the pool [pages, G, page, D] at page pidx[r], offset
//               pos[r] % page.
//   dec_append_pg8  an FP8 pool's paged step (sm_89+): a warp per (row, head); q as dec_append_pg's;
//               k (rotated) and v rounded to the storage dtype, as torch holds them, then each row
//               quantized with its own scale s = amax / 448 (0 for a row of zeros): e4m3 bytes into
//               the pool [pages, G, page, D], s into the scales [pages, G, page] (fp32); the bits
//               tpattn.attention.fp8.quantize_rows gives.
//   dec_split_..._pg8  the CUDA-core split over an FP8 pool (sm_89+; every head dim the split takes):
//               8 bytes a lane per key (cvt e4m3x2 -> f16x2), each key's dot product times its K
//               scale, each p times its V scale.
//   dec_mma_..._pg8  the tensor-core split over an FP8 pool (sm_89+; d = 64 and 128, grouped heads):
//               the same fragments from half the bytes (see dec_mma's comment); _pgt8 the same over pages
//               of whole 16-key tiles, unpredicated loads from one base a lane (tpattn/decode.py runs it
//               for such pages: about half _pg8's instructions a tile).
//   pg_prepare  a graphed paged decode step's rows from its inputs, slots, lengths before the step and
//               the page it takes, if any ([4, n], int64, on the device): each row's position and
//               page, its block-table row (the device's mirror [slots + 1, W], the page taken
//               from the inputs and written into the mirror too) and its length after the step;
//               then the lengths advanced by one for the next replay (rows of a live slot), so that
//               a step that continues the last one sends nothing from the host, and one that takes
//               pages sends only the inputs.
//
// Layout: Q [B, H, D] (one row per sequence), K, V [B, G, LMAX, D] contiguous (the cache), the first
// L positions valid. 16-bit storage (fp16 or bf16), fp32 accumulation, D = 64 or 128 (and, dec_split
// alone, 32, 80, 96, 160, 192, 256: decode_attention_dims.cu). Offsets that
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

// 8 e4m3 values of an FP8 page (8 bytes) into floats (exact); the BF16 flag is the query's dtype and
// does not matter here. sm_89+ (cvt e4m3x2 -> f16x2: the low byte into the low half); elsewhere the
// FP8 kernels are never launched (tpattn/decode.py) and this loads zeros.
template <bool BF16>
__device__ __forceinline__ void dec_load8(const unsigned char *p, float (&x)[8]) {
#if __CUDA_ARCH__ >= 890
    const tc_u64 v = *(const tc_u64 *)p;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned short two = (unsigned short)(v >> (16 * i));
        tc_u32 h;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(two));
        tc_unpack<false>(h, x[2 * i], x[2 * i + 1]);
    }
#else
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = 0.0f;
#endif
}

// two e4m3 values (the low and high byte of half HI of the word `four`) -> f16x2, or (BF16) bf16x2:
// exact either way (e4m3's 3 mantissa bits and exponents 2^-9 .. 2^8 fit both). The half is taken by
// a 16-bit move of the word, which ptxas folds into the conversion's operand (F2FP ... R.H1), not a
// shift. sm_89+ only (see dec_load8).
template <bool BF16, int HI = 0>
__device__ __forceinline__ tc_u32 dec_e4m3x2(tc_u32 four) {
    tc_u32 h = 0u;
#if __CUDA_ARCH__ >= 890
    if (HI)
        asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(h) : "r"(four));
    else
        asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(h) : "r"(four));
#endif
    if (BF16) {
        float lo, hi;
        tc_unpack<false>(h, lo, hi);
        h = tc_pack<true>(lo, hi);
    }
    return h;
}

// dec_if<B, T, F>::type: T where B, else F (no <type_traits> under NVRTC); dec_acc<N>: N fragments of
// fp32 accumulators; dec_none: nothing (a member a build without it does not hold)
template <bool B, class T, class F> struct dec_if { using type = T; };
template <class T, class F> struct dec_if<false, T, F> { using type = F; };
template <int N> struct dec_acc { float v[N][4]; };
struct dec_none {};

// an 8 x 8 matrix of 16-bit values, a row a quad of lanes (lane i: row i / 4, elements 2 (i % 4) and
// 2 (i % 4) + 1, the lower in the low half), transposed in place across the warp (sm_75+)
__device__ __forceinline__ tc_u32 dec_trans(tc_u32 x) {
    tc_u32 y = x;
#if __CUDA_ARCH__ >= 750
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
#endif
    return y;
}

// (KT: _pgt8s, _pgs) a tile's scores st of keys r and r + 8 for heads 2c and 2c + 1 (log2 units, -inf where
// masked) -> P in place, relative to the heads' new running maxima m0, m1 (the maxima over the 8 lanes of
// this c); l0, l1 the lane's running sums (over the 8 lanes at the end); a0, a1 the accumulators' factors.
// MV: mv's maximum over the same 8 lanes too (the FP8 tile's largest V scale)
template <bool MV>
__device__ __forceinline__ void dec_kt_softmax(float (&st)[4], float &m0, float &m1, float &l0, float &l1, float &a0,
                                               float &a1, float &mv) {
    float mx0 = fmaxf(st[0], st[2]), mx1 = fmaxf(st[1], st[3]);
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
        mx0 = fmaxf(mx0, tc_shfl_xor(mx0, o));
        mx1 = fmaxf(mx1, tc_shfl_xor(mx1, o));
        if constexpr (MV) mv = fmaxf(mv, tc_shfl_xor(mv, o));
    }
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    const float ref0 = n0 == TC_NEG_INF ? 0.0f : n0, ref1 = n1 == TC_NEG_INF ? 0.0f : n1;
    a0 = tc_exp2(m0 - ref0), a1 = tc_exp2(m1 - ref1);
    m0 = n0, m1 = n1;
    st[0] = tc_exp2(st[0] - ref0), st[2] = tc_exp2(st[2] - ref0);
    st[1] = tc_exp2(st[1] - ref1), st[3] = tc_exp2(st[3] - ref1);
    l0 = l0 * a0 + (st[0] + st[2]);
    l1 = l1 * a1 + (st[1] + st[3]);
}

// a lane's V bytes of its four keys (NT / 4 words of 4 e4m3 values each) widened to f16x2: word i of
// key k = its columns 2i, 2i + 1
template <int NT>
__device__ __forceinline__ void dec_widen_v(const tc_u32 (&v)[4][NT / 4], tc_u32 (&vf)[4][NT / 2]) {
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int i = 0; i < NT / 4; ++i) vf[k][2 * i] = dec_e4m3x2<false>(v[k][i]), vf[k][2 * i + 1] = dec_e4m3x2<false, 1>(v[k][i]);
}

// N 32-bit words of an FP8 page (4N bytes from p, 4N-byte aligned), or zeros where !in
template <int N>
__device__ __forceinline__ void dec_words8(const unsigned char *p, bool in, tc_u32 (&w)[N]) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            const tc_u4 t = in ? ((const tc_u4 *)p)[i] : tc_u4{0u, 0u, 0u, 0u};
            w[4 * i] = t.x, w[4 * i + 1] = t.y, w[4 * i + 2] = t.z, w[4 * i + 3] = t.w;
        }
    } else {
        static_assert(N == 2, "dec_words8: 2 or a multiple of 4 words");
        const tc_u64 t = in ? *(const tc_u64 *)p : 0ull;
        w[0] = (tc_u32)t, w[1] = (tc_u32)(t >> 32);
    }
}

template <bool BF16>
__device__ __forceinline__ tc_u16 dec_round(float x) {
    return (tc_u16)(tc_pack<BF16>(x, 0.0f) & 0xffffu);
}

// the last block of a (b, g): the S partials of each of its `group` heads into O, all heads at once
// (a head at a time would cost a few round trips to L2 per head: ~80 us for 32 heads, measured).
// The weights 2^(L_s - max) / sum go to shared memory (DEC_COMBINE_W of them at a time: as many
// heads as fit; the host keeps S <= DEC_COMBINE_W), a warp a head; then a thread per 4 columns of a
// head sums its S partials, the loads of several partials in flight. Not inlined: inlined, it
// changed how the split's main loop was compiled and slowed the tensor-core split by a fifth at
// B = 64, G = 8 (measured), though it runs once, after that loop.
#define DEC_COMBINE_W 1024
template <int D, bool BF16>
__device__ __noinline__ void dec_combine(const float *__restrict__ Op, const float *__restrict__ Lp,
                                            tc_u16 *__restrict__ O, long long bh0, int group, int S, int n) {
    __shared__ float wts[DEC_COMBINE_W];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int hc = min(group, DEC_COMBINE_W / S);
    for (int h0 = 0; h0 < group; h0 += hc) {
        const int nh = min(hc, group - h0);
        const float *lp = Lp + (bh0 + h0) * S;  // [nh, S]: the heads of a group are consecutive
        for (int e = tid; e < nh * S; e += DEC_THREADS) wts[e] = __ldcg(lp + e);
        __syncthreads();
        for (int i = warp; i < nh; i += DEC_THREADS / 32) {
            float *w = wts + i * S;
            float mx = TC_NEG_INF, sum = 0.0f;
            for (int s = lane; s < n; s += 32) mx = fmaxf(mx, w[s]);
            mx = tc_warp_max(mx);
            const float ref = mx == TC_NEG_INF ? 0.0f : mx;
            for (int s = lane; s < n; s += 32) {  // empty partials: 2^-inf = 0 (and their o_s = 0)
                w[s] = tc_exp2(w[s] - ref);
                sum += w[s];
            }
            sum = tc_warp_sum(sum);
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            for (int s = lane; s < n; s += 32) w[s] *= inv;
        }
        __syncthreads();
        for (int it = tid; it < nh * (D / 4); it += DEC_THREADS) {
            const int i = it / (D / 4), c4 = it - i * (D / 4);
            const long long bh = bh0 + h0 + i;
            const float4 *op = (const float4 *)(Op + bh * S * D) + c4;
            const float *w = wts + i * S;
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
            for (int s = 0; s < n; ++s) {
                const float4 v = __ldcg(op + (long long)s * (D / 4));
                acc.x = fmaf(w[s], v.x, acc.x), acc.y = fmaf(w[s], v.y, acc.y);
                acc.z = fmaf(w[s], v.z, acc.z), acc.w = fmaf(w[s], v.w, acc.w);
            }
            tc_u16 *dst = O + bh * D + 4 * c4;
            dst[0] = dec_round<BF16>(acc.x), dst[1] = dec_round<BF16>(acc.y);
            dst[2] = dec_round<BF16>(acc.z), dst[3] = dec_round<BF16>(acc.w);
        }
        __syncthreads();
    }
}

// Where key `key` of K/V head g of sequence b starts: contiguous, [B, G, LMAX, D]; paged (PAGED),
// the pool [pages, G, page, D] through sequence b's row of the block table [B, tstride] (int32 page
// ids), the key's page table[b][key / page] at offset key % page.
template <int D, bool PAGED>
__device__ __forceinline__ long long dec_at(int b, int g, int G, int key, long long kv, const int *__restrict__ table,
                                            int tstride, int page) {
    if (!PAGED) return kv + (long long)key * D;
    // pages of a power of two tokens (every size PagedKV is measured at): a shift, not a division
    const int blk = (page & (page - 1)) == 0 ? key >> (__ffs(page) - 1) : key / page;
    const long long pg = __ldg(table + (long long)b * tstride + blk);
    return ((pg * G + g) * page + (key - blk * page)) * (long long)D;
}

// dec_at, or (whole: pages holding whole 16-key tiles, dec_mma) tb + the key's place in its tile t0
template <int D, bool PAGED>
__device__ __forceinline__ long long dec_key(bool whole, long long tb, int t0, int b, int g, int G, int key, long long kv,
                                             const int *__restrict__ table, int tstride, int page) {
    if (PAGED && whole) return tb + (long long)(key - t0) * D;
    return dec_at<D, PAGED>(b, g, G, key, kv, table, tstride, page);
}

// The cache length of sequence b: Ladd + *Lpos (one length for the batch), or (PAGED) lens[b].
template <bool PAGED>
__device__ __forceinline__ int dec_len(int b, int Ladd, const long long *__restrict__ Lpos, const int *__restrict__ lens) {
    if (PAGED) return __ldg(lens + b);
    return Ladd + (Lpos != nullptr ? (int)*Lpos : 0);
}

// KV: tc_u16 (the storage dtype's pages or cache) or unsigned char (an FP8 pool's e4m3 pages, with the
// scale of each position's row of K and of V, KS and VS [pages, G, page]).
template <int D, int GQ, bool BF16, bool PAGED, typename KV = tc_u16>
__device__ __forceinline__ void dec_split(const tc_u16 *__restrict__ Q, const KV *__restrict__ K,
                                          const KV *__restrict__ V, float *__restrict__ Op,
                                          float *__restrict__ Lp, tc_u16 *__restrict__ O, int *__restrict__ tickets,
                                          int BG, int G, int group, int Ladd, const long long *__restrict__ Lpos,
                                          int LMAX, int S, float scale_log2, const int *__restrict__ table,
                                          const int *__restrict__ lens, int tstride, int page,
                                          const float *__restrict__ KS = nullptr, const float *__restrict__ VS = nullptr) {
    constexpr bool F8 = sizeof(KV) == 1;
    // lanes per key, 8 elements each: D / 8 rounded up to a power of two (a head dim that is not a
    // power of two, 96 say, leaves the lanes past D / 8 idle: they load zeros and store nothing)
    constexpr int LANES = D / 8 <= 1 ? 1 : D / 8 <= 2 ? 2 : D / 8 <= 4 ? 4 : D / 8 <= 8 ? 8 : D / 8 <= 16 ? 16 : 32;
    static_assert(D % 8 == 0 && D <= 256, "dec_split: a head dim that is a multiple of 8, up to 256");
    constexpr int NGRP = DEC_THREADS / LANES;     // key groups per block
    constexpr int U = DEC_UNROLL;                 // keys per group in flight (their loads issued first)
    __shared__ float sm[NGRP][GQ], sl[NGRP][GQ];
    __shared__ float so[NGRP][GQ][D];
    __shared__ int last;
    const int tid = threadIdx.x, grp = tid / LANES, lane = tid % LANES;
    const bool cols = lane * 8 < D;  // this lane holds columns of the head (all lanes, for a power of two)
    const int s = blockIdx.x;
    for (int bg = blockIdx.y; bg < BG; bg += gridDim.y) {
        const int b = bg / G, g = bg - b * G;
        const int L = dec_len<PAGED>(b, Ladd, Lpos, lens);
        const int chunk = (L + S - 1) / S;
        const int k0 = min(L, s * chunk), k1 = min(L, k0 + chunk);
        const long long kv = (long long)bg * LMAX * D;
        const long long bh0 = ((long long)b * G + g) * group;  // the group's first query head
        for (int h0 = 0; h0 < group; h0 += GQ) {  // GQ heads of the group at a time
            const int nh = min(GQ, group - h0);
            float q[GQ][8], o[GQ][8], m[GQ], l[GQ];
#pragma unroll
            for (int i = 0; i < GQ; ++i) {
                m[i] = TC_NEG_INF;
                l[i] = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; ++e) o[i][e] = q[i][e] = 0.0f;
                if (i < nh && cols) dec_load8<BF16>(Q + (bh0 + h0 + i) * D + lane * 8, q[i]);
            }
            // PAGED: the pages of the keys of the next iteration, looked up one iteration ahead, so that
            // no load waits on its block-table lookup (pages of a power of two: a shift)
            const int pshift = PAGED && (page & (page - 1)) == 0 ? __ffs(page) - 1 : -1;
            int pgn[U];
            auto pages_of = [&](int base) {
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int key = base + u * NGRP + grp;
                    pgn[u] = key < k1 ? __ldg(table + (long long)b * tstride + (pshift >= 0 ? key >> pshift : key / page)) : 0;
                }
            };
            if constexpr (PAGED) pages_of(k0);
            // every lane runs every iteration (the shuffles need the whole warp); a key past the
            // chunk's end loads nothing and adds nothing
            for (int base = k0; base < k1; base += U * NGRP) {
                float kx[U][8], vx[U][8], ks[U], vs[U];
                int pg[U];
                if constexpr (PAGED) {
#pragma unroll
                    for (int u = 0; u < U; ++u) pg[u] = pgn[u];
                    pages_of(base + U * NGRP);
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int key = base + u * NGRP + grp;
                    // FP8: the key's place is found once for its bytes and its row scales, which every lane
                    // of the group reads (they keep the same m and l)
                    const bool in = key < k1;
                    long long at = 0;
                    if constexpr (PAGED) {
                        const int off = pshift >= 0 ? key & (page - 1) : key % page;
                        if (in) at = (((long long)pg[u] * G + g) * page + off) * D;
                    }
                    if (in && cols) {
                        const long long a = PAGED ? at : dec_at<D, PAGED>(b, g, G, key, kv, table, tstride, page);
                        dec_load8<BF16>(K + a + lane * 8, kx[u]);
                        dec_load8<BF16>(V + a + lane * 8, vx[u]);
                    } else {
#pragma unroll
                        for (int e = 0; e < 8; ++e) kx[u][e] = vx[u][e] = 0.0f;
                    }
                    if (F8) {
                        ks[u] = in ? __ldg(KS + at / D) : 0.0f;
                        vs[u] = in ? __ldg(VS + at / D) : 0.0f;
                    }
                }
#pragma unroll
                for (int i = 0; i < GQ; ++i) {
                    float sc[U];
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        float dot = 0.0f;
#pragma unroll
                        for (int e = 0; e < 8; ++e) dot = fmaf(q[i][e], kx[u][e], dot);
                        sc[u] = dot;
                    }
#pragma unroll
                    for (int w = LANES / 2; w > 0; w >>= 1)
#pragma unroll
                        for (int u = 0; u < U; ++u) sc[u] += tc_shfl_xor(sc[u], w);
                    float mn = m[i];
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        sc[u] = base + u * NGRP + grp < k1 ? (F8 ? sc[u] * ks[u] : sc[u]) * scale_log2 : TC_NEG_INF;
                        mn = fmaxf(mn, sc[u]);
                    }
                    const float a = mn == m[i] ? 1.0f : tc_exp2(m[i] - mn);  // (both -inf: nothing yet)
                    m[i] = mn;
                    float ps = 0.0f;
#pragma unroll
                    for (int e = 0; e < 8; ++e) o[i][e] *= a;
                    const float ref = mn == TC_NEG_INF ? 0.0f : mn;  // no key yet: p = 2^-inf = 0, not NaN
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        const float p = tc_exp2(sc[u] - ref);  // masked: 2^-inf = 0
                        ps += p;
                        const float pv = F8 ? p * vs[u] : p;
#pragma unroll
                        for (int e = 0; e < 8; ++e) o[i][e] = fmaf(pv, vx[u][e], o[i][e]);
                    }
                    l[i] = l[i] * a + ps;
                }
            }
            // merge the NGRP groups' partials (every lane of a group holds the same m and l)
#pragma unroll
            for (int i = 0; i < GQ; ++i) {
                if (lane == 0) sm[grp][i] = m[i], sl[grp][i] = l[i];
                if (cols)
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
                const long long bh = bh0 + h0 + i;
                const float y = lsum > 0.0f ? acc / lsum : 0.0f;
                if (S == 1) {  // one chunk: its rows are the output (what the combine of one partial writes)
                    O[bh * D + c] = dec_round<BF16>(y);
                    continue;
                }
                Op[(bh * S + s) * D + c] = y;
                if (c == 0) Lp[bh * S + s] = lsum > 0.0f ? mx + tc_log2(lsum) : TC_NEG_INF;
            }
            __syncthreads();
        }
        // this block's partials are written: take a ticket; the S-th combines (and resets the count).
        // One chunk (S = 1): no partials, no ticket (the counters stay zero)
        if (S == 1) continue;
        __threadfence();
        __syncthreads();
        if (tid == 0) {
            const int t = atomicAdd(tickets + bg, 1);
            last = t == S - 1;
            if (last) tickets[bg] = 0;
        }
        __syncthreads();
        if (last) {
            __threadfence();
            dec_combine<D, BF16>(Op, Lp, O, bh0, group, S, S);
        }
        __syncthreads();
    }
}

// Hopper's bulk copies for the staged tensor-core split (_b kernels, sm_90+): an mbarrier a stage, a
// 1-D cp.async.bulk of a tile's contiguous K (or V) rows into shared memory completing on it.
__device__ __forceinline__ void dec_bar_init(tc_u32 bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
#endif
}
__device__ __forceinline__ void dec_bar_fence_init() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void dec_bar_expect(tc_u32 bar, tc_u32 bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void dec_bar_wait(tc_u32 bar, int parity) {
#if __CUDA_ARCH__ >= 900
    tc_u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
#endif
}
__device__ __forceinline__ void dec_bulk(tc_u32 dst, const void *src, tc_u32 bytes, tc_u32 bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
#endif
}

// The same split on tensor cores (mma.sync m16n8k16, sm_80+): a warp takes 16 keys at a time; the
// group's query heads are the rows of the m16 tile (8 per pass, or 16 when the group has more than
// 8), S = Q Kᵀ in two n8 tiles over D/16 k-steps, then O += P V over D/8 n8 tiles. No shared
// memory on the way: K and V go from global memory straight into the fragments, since a dot
// product does not care in which order its d-columns are summed and the output's columns can be
// put back in order when written. Lane (r, c) = (lane / 4, lane % 4) loads
//   K: keys r and 8 + r of the tile, columns [c D/4, (c + 1) D/4)   -> B of k-step j: words 2j, 2j + 1
//   Q: the same columns of heads r (and r + 8)                       -> A of k-step j: words 2j, 2j + 1
//   V: keys 2c, 2c + 1, 2c + 8, 2c + 9, columns [r D/8, (r + 1) D/8) -> B of n-tile u: the u-th element
//      of each (two keys' halves packed into a word with a byte permute)
// so that output column n of n-tile u is column n D/8 + u of O. 16-byte loads throughout.
// PIPE (the _p kernels): the next tile's K and V loads are issued before the current tile is
// computed (64 more registers a thread: 3 blocks an SM instead of 4 at d = 128).
// KV = unsigned char (_pg8): an FP8 pool's e4m3 pages with row scales kscale, vscale [pages, G, page]
// (fp32). A lane's K and V bytes are half the fp16 ones (the same columns), widened to f16x2 (bf16x2
// for bf16 queries) before the products. The S column of key j is times kscale[j], the row's
// p times vscale[j]: the 16 keys of a tile are the columns of the quad's lanes (2c, 2c + 1, 2c + 8,
// 2c + 9), so each lane reads the scales of the keys whose V it reads. P V runs in fp16 with P's
// row scaled by vscale / m_v (m_v the largest vscale of the tile's keys, so that nothing rounds
// to an fp16 subnormal), and m_v multiplies the tile's product into the accumulators.
// PG: 0 the contiguous cache; paged: 1 a block-table lookup a key (any page size), 2 whole 16-key tiles
// a page (pages of a power of two of 16 tokens or more: one lookup a tile), 3 either, chosen at run
// time (the FP8 kernels). A kernel built for one of 1 or 2 alone leaves out the other's addressing:
// with both, the paged _p kernel at d = 128 took 246 registers instead of 168 (two blocks an SM
// instead of three, and 1.2x the contiguous kernel's time at B = 16, G = 8, measured on an H100).
// STG (the _b kernels, sm_90+, the contiguous cache of the storage dtype): each warp's tiles go
// through a ring of STG stages in shared memory (dynamic, W x STG x 2 x 16 x D values), lane 0
// issuing a tile's K and V rows as two bulk copies (16 rows of D are contiguous) STG - 1 tiles ahead,
// each stage's mbarrier counting their bytes; the lanes read their fragments from the stage as they
// would from global memory. More bytes in flight a warp than PIPE's registers hold, and a load a tile
// instead of a load a lane and row: 0.90-0.99x the time of _p or the plain split on an H100 (B = 1-64,
// G = 8). Over pages, at a pool's usual count, it was 5-12 % slower at B = 16 and 64 (the ragged
// count's two waves of its two blocks an SM); the paged staged build (_pgb) instead sizes its chunks
// from the lengths on the device (EQ, in dec_mma), where the (sequence, K/V head) pairs fit on the SMs.
#ifdef DEC_TRACE
// scripts/trace_decode_blocks.py compiles this file with DEC_TRACE defined: each block of dec_mma's
// first (b, g) pair records, by the global timer (ns), when it started, when its warp 0 had its first
// tile (the staged build; else 0), when its partial rows were written, when it was done (after the combine, if it was the last),
// and its SM and whether it combined. Not in the kernels tpattn launches.
__device__ unsigned long long dec_trace[8 * 65536];
__device__ __forceinline__ unsigned long long dec_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// block (blockIdx.x, blockIdx.y)'s record (by its thread 0)
__device__ __forceinline__ void dec_trace_block(unsigned long long start, unsigned long long first,
                                                unsigned long long rows, bool combined) {
    unsigned r;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
    unsigned long long *e = dec_trace + 8 * ((long long)blockIdx.y * gridDim.x + blockIdx.x);
    e[0] = start, e[1] = first, e[2] = rows, e[3] = dec_now(), e[4] = r, e[5] = combined;
}
#endif
template <int D, bool M16, bool PIPE, bool BF16, int PG, typename KV = tc_u16, int STG = 0, bool KT = false>
__device__ __forceinline__ void dec_mma(const tc_u16 *__restrict__ Q, const KV *__restrict__ K,
                                        const KV *__restrict__ V, float *__restrict__ Op,
                                        float *__restrict__ Lp, tc_u16 *__restrict__ O, int *__restrict__ tickets,
                                        int BG, int G, int group, int Ladd, const long long *__restrict__ Lpos,
                                        int LMAX, int S, float scale_log2, const int *__restrict__ table,
                                        const int *__restrict__ lens, int tstride, int page,
                                        const float *__restrict__ kscale = nullptr,
                                        const float *__restrict__ vscale = nullptr) {
    constexpr bool F8 = sizeof(KV) == 1, PAGED = PG != 0;
    static_assert(!KT || (PG == 2 && !M16 && STG == 0), "KT (_pgt8s, _pgs): pages of whole tiles, 8 heads a pass");
    constexpr int E = D / 4, KS = D / 16, NT = D / 8, ROWS = M16 ? 16 : 8, W = DEC_THREADS / 32;
    __shared__ float sm[W][ROWS], sl[W][ROWS];
    __shared__ float so_own[STG > 0 ? 1 : W][ROWS][D];  // STG: each warp's rows at the start of its own ring
    __shared__ int last;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, r = lane >> 2, c = lane & 3;
    const int s = PG == 2 && STG > 0 ? blockIdx.y : blockIdx.x;  // (EQ: the grid is (pairs, chunks), see below)
#ifdef DEC_TRACE
    const unsigned long long tr_start = dec_now();
    unsigned long long tr_first = 0;
#endif
    static_assert(STG == 0 || (!F8 && (PG == 0 || PG == 2)),
                  "the staged split: the contiguous cache or whole-tile pages, of the storage dtype");
    // EQ (the staged split over pages): chunks of about equal work across the batch's sequences. The
    // work a chunk C is the batch's keys over the LMAX blocks asked for (LMAX: the target count of
    // non-empty blocks; a pool has no LMAX), at least the longest sequence over the S chunks the grid
    // has; sequence b takes Sn = L / C chunks rounded to the nearest (at least 1, at most S: no sliver
    // of a last chunk, which would cost a second block and a combine), each ceil(L / Sn) keys in whole
    // 16-key tiles a warp; the grid's other blocks of it leave at once, and its combine waits for its
    // Sn partials (stored at stride S)
    constexpr bool EQ = PAGED && STG > 0;
    int C = 0;
    if constexpr (EQ) {
        __shared__ long long tot_s[W];
        __shared__ int top_s[W];
        const int B = BG / G;
        long long tot = 0;
        int top = 0;
        for (int i = tid; i < B; i += DEC_THREADS) {
            const int l = __ldg(lens + i);
            tot += l;
            top = max(top, l);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            tot += __shfl_xor_sync(0xffffffffu, tot, o);
            top = max(top, __shfl_xor_sync(0xffffffffu, top, o));
        }
        if (lane == 0) tot_s[warp] = tot, top_s[warp] = top;
        __syncthreads();
        tot = 0, top = 0;
#pragma unroll
        for (int w = 0; w < W; ++w) tot += tot_s[w], top = max(top, top_s[w]);
        const long long want = max(1, LMAX);
        const long long c = max((tot * G + want - 1) / want, (long long)(top + S - 1) / S);
        C = (int)((max(c, 1LL) + 16 * W - 1) / (16 * W) * (16 * W));
    }
    constexpr int TILE = 16 * D;  // values of a tile's K (or V) rows
    static_assert(STG == 0 || ROWS * D * 4 <= STG * 2 * TILE * 2, "a warp's partial rows fit its ring");
    __shared__ __align__(8) unsigned long long bars[W][STG > 0 ? STG : 1];
    extern __shared__ __align__(128) unsigned char dec_ring[];  // STG: [W][STG][K, V][16][D]
    // warp w's partial rows [ROWS][D] (fp32), merged across the warps once every warp's loop is done (STG:
    // in w's ring, whose copies have all landed by then, and which no other warp's copies touch)
    auto so = [&](int w) -> float (*)[D] {
        if constexpr (STG > 0) return (float (*)[D])(dec_ring + (long long)w * STG * 2 * TILE * 2);
        return so_own[w];
    };
    int n_issue = 0, n_use = 0;  // STG: the warp's tiles issued and read, over every pass (the stages' phases)
    if constexpr (STG > 0) {
        if (lane == 0)
#pragma unroll
            for (int i = 0; i < STG; ++i) dec_bar_init(tc_saddr(&bars[warp][i]));
        dec_bar_fence_init();
        __syncwarp();
    }
    // EQ's grid is (pairs, chunks): the blocks are dispatched pairs first, so a batch's non-empty chunks
    // come before the empty ones (a one-length batch's all of them), spread over the SMs
    for (int bg = EQ ? blockIdx.x : blockIdx.y; bg < BG; bg += EQ ? gridDim.x : gridDim.y) {
        const int b = bg / G, g = bg - b * G;
        const int L = dec_len<PAGED>(b, Ladd, Lpos, lens);
        // Sn: the chunks of this sequence (EQ: its own count); whole 16-key tiles per warp
        const int Sn = EQ ? max(1, min(S, (L + C / 2) / C)) : S;
        const int chunk = ((L + Sn - 1) / Sn + 16 * W - 1) / (16 * W) * (16 * W);
        if (EQ && s >= Sn) continue;  // (block-uniform: s and bg are the block's)
        const int k0 = min(L, s * chunk), k1 = min(L, k0 + chunk);
        const long long kv = (long long)bg * LMAX * D;
        const long long bh0 = (long long)bg * group;  // the group's first query head
        for (int h0 = 0; h0 < group; h0 += ROWS) {
            const int nh = min(ROWS, group - h0);
            tc_u32 qa[E / 2], qb[E / 2];
            {
                tc_u4 t[E / 8];
#pragma unroll
                for (int i = 0; i < E / 8; ++i) t[i] = tc_u4{0u, 0u, 0u, 0u};
                if (r < nh)
#pragma unroll
                    for (int i = 0; i < E / 8; ++i) t[i] = ((const tc_u4 *)(Q + (bh0 + h0 + r) * D + c * E))[i];
#pragma unroll
                for (int i = 0; i < E / 8; ++i) qa[4 * i] = t[i].x, qa[4 * i + 1] = t[i].y, qa[4 * i + 2] = t[i].z, qa[4 * i + 3] = t[i].w;
#pragma unroll
                for (int i = 0; i < E / 8; ++i) t[i] = tc_u4{0u, 0u, 0u, 0u};
                if (M16 && r + 8 < nh)
#pragma unroll
                    for (int i = 0; i < E / 8; ++i) t[i] = ((const tc_u4 *)(Q + (bh0 + h0 + r + 8) * D + c * E))[i];
#pragma unroll
                for (int i = 0; i < E / 8; ++i) qb[4 * i] = t[i].x, qb[4 * i + 1] = t[i].y, qb[4 * i + 2] = t[i].z, qb[4 * i + 3] = t[i].w;
            }
            float o[NT][4], m0 = TC_NEG_INF, m1 = TC_NEG_INF, l0 = 0.0f, l1 = 0.0f;
#pragma unroll
            for (int u = 0; u < NT; ++u) o[u][0] = o[u][1] = o[u][2] = o[u][3] = 0.0f;
            // (KT) the warp's rows from O^T's accumulators ot: head 2c (m0, l0) and 2c + 1 (m1, l1) of each lane
            auto kt_rows = [&](const float (&ot)[NT / 2][4]) {
                if constexpr (KT) {
#pragma unroll
                    for (int o = 4; o < 32; o <<= 1) l0 += tc_shfl_xor(l0, o), l1 += tc_shfl_xor(l1, o);
                    if (r == 0) {
                        sm[warp][2 * c] = m0, sl[warp][2 * c] = l0;
                        sm[warp][2 * c + 1] = m1, sl[warp][2 * c + 1] = l1;
                    }
#pragma unroll
                    for (int u = 0; u < NT / 2; ++u) {
                        so(warp)[2 * c][r * NT + 2 * u] = ot[u][0];
                        so(warp)[2 * c + 1][r * NT + 2 * u] = ot[u][1];
                        so(warp)[2 * c][r * NT + 2 * u + 1] = ot[u][2];
                        so(warp)[2 * c + 1][r * NT + 2 * u + 1] = ot[u][3];
                    }
                }
            };
            // the tile's scores sc (fp32, times log2(e) / sqrt(d) here, keys past k1 masked) -> p in place,
            // the rows' running max and sum updated; returns the accumulators' rescale a0 (a1: rows 8-15)
            auto softmax = [&](float (&sc)[2][4], int t0, float &a0, float &a1) {
                float mx0 = TC_NEG_INF, mx1 = TC_NEG_INF;
#pragma unroll
                for (int t = 0; t < 2; ++t)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const bool ok = t0 + 8 * t + 2 * c + (e & 1) < k1;
                        sc[t][e] = ok ? sc[t][e] * scale_log2 : TC_NEG_INF;
                        if (e < 2) mx0 = fmaxf(mx0, sc[t][e]);
                        else mx1 = fmaxf(mx1, sc[t][e]);
                    }
                mx0 = fmaxf(mx0, tc_shfl_xor(mx0, 1));
                mx0 = fmaxf(mx0, tc_shfl_xor(mx0, 2));
                const float n0 = fmaxf(m0, mx0), ref0 = n0 == TC_NEG_INF ? 0.0f : n0;
                a0 = tc_exp2(m0 - ref0);
                m0 = n0;
                float n1 = 0.0f, ref1 = 0.0f;
                a1 = 1.0f;
                if (M16) {
                    mx1 = fmaxf(mx1, tc_shfl_xor(mx1, 1));
                    mx1 = fmaxf(mx1, tc_shfl_xor(mx1, 2));
                    n1 = fmaxf(m1, mx1);
                    ref1 = n1 == TC_NEG_INF ? 0.0f : n1;
                    a1 = tc_exp2(m1 - ref1);
                    m1 = n1;
                }
                float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
                for (int t = 0; t < 2; ++t) {
                    sc[t][0] = tc_exp2(sc[t][0] - ref0);
                    sc[t][1] = tc_exp2(sc[t][1] - ref0);
                    ps0 += sc[t][0] + sc[t][1];
                    if (M16) {
                        sc[t][2] = tc_exp2(sc[t][2] - ref1);
                        sc[t][3] = tc_exp2(sc[t][3] - ref1);
                        ps1 += sc[t][2] + sc[t][3];
                    }
                }
                l0 = l0 * a0 + ps0;
                if (M16) l1 = l1 * a1 + ps1;
            };
            auto compute = [&](const tc_u4 (&kr)[2][E / 8], const tc_u4 (&vr)[4][NT / 8], int t0) {
                float sc[2][4];
#pragma unroll
                for (int t = 0; t < 2; ++t) {
                    sc[t][0] = sc[t][1] = sc[t][2] = sc[t][3] = 0.0f;
                    const tc_u32 *kw = (const tc_u32 *)kr[t];
#pragma unroll
                    for (int j = 0; j < KS; ++j) {
                        const tc_u32 a[4] = {qa[2 * j], M16 ? qb[2 * j] : 0u, qa[2 * j + 1], M16 ? qb[2 * j + 1] : 0u};
                        tc_mma<BF16>(sc[t], a, kw[2 * j], kw[2 * j + 1]);
                    }
                }
                float a0, a1;
                softmax(sc, t0, a0, a1);
                const tc_u32 pa[4] = {tc_pack<BF16>(sc[0][0], sc[0][1]), M16 ? tc_pack<BF16>(sc[0][2], sc[0][3]) : 0u,
                                      tc_pack<BF16>(sc[1][0], sc[1][1]), M16 ? tc_pack<BF16>(sc[1][2], sc[1][3]) : 0u};
                const tc_u32 *v0 = (const tc_u32 *)vr[0], *v1 = (const tc_u32 *)vr[1], *v2 = (const tc_u32 *)vr[2],
                             *v3 = (const tc_u32 *)vr[3];
#pragma unroll
                for (int u = 0; u < NT; ++u) {
                    const unsigned sel = (u & 1) ? 0x7632u : 0x5410u;
                    o[u][0] *= a0;
                    o[u][1] *= a0;
                    if (M16) o[u][2] *= a1, o[u][3] *= a1;
                    tc_mma<BF16>(o[u], pa, __byte_perm(v0[u >> 1], v1[u >> 1], sel), __byte_perm(v2[u >> 1], v3[u >> 1], sel));
                }
            };
            // PAGED: where a tile's keys lie. Pages of a power of two of 16 tokens or more hold whole
            // 16-key tiles (t0 is a multiple of 16): one block-table lookup a tile, issued one load
            // ahead (pg_next: the page of the next tile this warp loads), so that no load waits on a
            // lookup; other pages (PG 1): a lookup a key (dec_at). FP8 pages without PIPE look the tile's
            // page up as it loads: the register carried between tiles made those kernels spill at D = 64
            const bool whole = PG == 2 || (PG == 3 && page >= 16 && (page & (page - 1)) == 0);
            constexpr bool AHEAD = PIPE || sizeof(KV) == 2;
            auto page_of = [&](int t) -> int {
                return whole && t < k1 ? __ldg(table + (long long)b * tstride + (t >> (__ffs(page) - 1))) : 0;
            };
            int pg_next = 0;
            if constexpr (PAGED && AHEAD) pg_next = page_of(k0 + 16 * warp);
            auto tile_base = [&](int t0) -> long long {  // (whole) tile t0's first key, then the next lookup
                if (!whole) return 0;
                int pg;
                if constexpr (AHEAD) {
                    pg = pg_next;
                    pg_next = page_of(t0 + 16 * W);
                } else {
                    pg = page_of(t0);
                }
                return (((long long)pg * G + g) * page + (t0 & (page - 1))) * D;
            };
            // a tile's K and V fragments; keys past the chunk load zeros (and no memory)
            auto load = [&](int t0, tc_u4 (&kr)[2][E / 8], tc_u4 (&vr)[4][NT / 8]) {
                long long tb = 0;
                if constexpr (PAGED) tb = tile_base(t0);
#pragma unroll
                for (int t = 0; t < 2; ++t) {
                    const int key = t0 + 8 * t + r;
                    const long long at = key < k1 ? dec_key<D, PAGED>(whole, tb, t0, b, g, G, key, kv, table, tstride, page) : 0;
#pragma unroll
                    for (int i = 0; i < E / 8; ++i)
                        kr[t][i] = key < k1 ? ((const tc_u4 *)(K + at + c * E))[i] : tc_u4{0u, 0u, 0u, 0u};
                }
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const int key = t0 + (k >> 1) * 8 + 2 * c + (k & 1);
                    const long long at = key < k1 ? dec_key<D, PAGED>(whole, tb, t0, b, g, G, key, kv, table, tstride, page) : 0;
#pragma unroll
                    for (int i = 0; i < NT / 8; ++i)
                        vr[k][i] = key < k1 ? ((const tc_u4 *)(V + at + r * NT))[i] : tc_u4{0u, 0u, 0u, 0u};
                }
            };
            if constexpr (F8) {
                // a tile of e4m3 pages: the lane's K bytes of keys r, 8 + r (E a key), its V bytes of keys
                // 2c, 2c + 1, 2c + 8, 2c + 9 (NT a key) and those four keys' scales
                struct Tile8 {
                    tc_u32 k[2][E / 4], v[4][NT / 4];
                    float ks[4], vs[4];
                };
                auto load8 = [&](int t0, Tile8 &x) {
                    const long long tb = tile_base(t0);
                    if constexpr (PG == 2) {
                        // (_pgt8) whole 16-key tiles a page: the tile's K (and V) rows are 16 D contiguous
                        // bytes and its 16 scales contiguous floats, at an address that is valid for any t0
                        // (past k1 tile_base gives page 0). Every load goes unpredicated from one base a
                        // lane (its offsets in the tile are fixed): keys 2c, 2c + 1 (and 2c + 8, 2c + 9) of
                        // the scales in one 8-byte load. The last tile's keys past k1 are zeroed after
                        // (mask8): what a page holds there may be anything, NaN too
                        const unsigned char *kp = (const unsigned char *)K + tb + r * D + c * E;
                        const unsigned char *vp = (const unsigned char *)V + tb + 2 * c * D + r * NT;
#pragma unroll
                        for (int t = 0; t < 2; ++t) dec_words8<E / 4>(kp + 8 * t * D, true, x.k[t]);
#pragma unroll
                        for (int k = 0; k < 4; ++k) dec_words8<NT / 4>(vp + ((k >> 1) * 8 + (k & 1)) * D, true, x.v[k]);
                        if constexpr (KT) {  // (_pgt8s) the scales of keys r and r + 8, the lane's S columns
                            const long long sb = tb / D + r;
                            x.ks[0] = __ldg(kscale + sb), x.ks[1] = __ldg(kscale + sb + 8);
                            x.vs[0] = __ldg(vscale + sb), x.vs[1] = __ldg(vscale + sb + 8);
                        } else {
                            const long long sb = tb / D + 2 * c;
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                const float2 kq = __ldg((const float2 *)(kscale + sb + 8 * h));
                                const float2 vq = __ldg((const float2 *)(vscale + sb + 8 * h));
                                x.ks[2 * h] = kq.x, x.ks[2 * h + 1] = kq.y, x.vs[2 * h] = vq.x, x.vs[2 * h + 1] = vq.y;
                            }
                        }
                    } else {
#pragma unroll
                        for (int t = 0; t < 2; ++t) {
                            const int key = t0 + 8 * t + r;
                            const long long at = key < k1 ? dec_key<D, PAGED>(whole, tb, t0, b, g, G, key, kv, table, tstride, page) : 0;
                            dec_words8<E / 4>((const unsigned char *)K + at + c * E, key < k1, x.k[t]);
                        }
#pragma unroll
                        for (int k = 0; k < 4; ++k) {
                            const int key = t0 + (k >> 1) * 8 + 2 * c + (k & 1);
                            const bool in = key < k1;
                            const long long at = in ? dec_key<D, PAGED>(whole, tb, t0, b, g, G, key, kv, table, tstride, page) : 0;
                            dec_words8<NT / 4>((const unsigned char *)V + at + r * NT, in, x.v[k]);
                            x.ks[k] = in ? __ldg(kscale + at / D) : 0.0f;
                            x.vs[k] = in ? __ldg(vscale + at / D) : 0.0f;
                        }
                    }
                };
                // (_pgt8) a tile that ends past k1: its keys there get zero V bytes and scales (their scores
                // are masked by the softmax; a K byte there is never used, whatever it is)
                auto mask8 = [&](Tile8 &x, int t0) {
                    if constexpr (PG == 2) {
                        if (t0 + 16 > k1) {  // (warp-uniform: the last tile of the chunk)
#pragma unroll
                            for (int k = 0; k < 4; ++k) {
                                const bool in = t0 + (k >> 1) * 8 + 2 * c + (k & 1) < k1;
#pragma unroll
                                for (int i = 0; i < NT / 4; ++i) x.v[k][i] = in ? x.v[k][i] : 0u;
                                if constexpr (!KT) {
                                    x.ks[k] = in ? x.ks[k] : 0.0f;
                                    x.vs[k] = in ? x.vs[k] : 0.0f;
                                }
                            }
                            if constexpr (KT) {  // (keys r and r + 8)
#pragma unroll
                                for (int h = 0; h < 2; ++h) {
                                    const bool in = t0 + 8 * h + r < k1;
                                    x.ks[h] = in ? x.ks[h] : 0.0f;
                                    x.vs[h] = in ? x.vs[h] : 0.0f;
                                }
                            }
                        }
                    }
                };
                // (_pgt8s) the tile with the keys as the rows of the products: S^T = K Q^T in one m16n8k16 a
                // k-step (A: the lane's K bytes of keys r and r + 8, widened in place; B: q of head r, the
                // fragment it holds across tiles), so no row of A is zeros and no register is copied into
                // an A quad. A lane holds heads 2c, 2c + 1 at keys r, r + 8: their maxima and sums over
                // the 8 lanes of its c. P^T (times V scale / the tile's largest) in fp16 is transposed per
                // 8 x 8 block (movmatrix) into the B fragment of O^T += V^T P^T, whose A rows r and r + 8
                // are columns 2u and 2u + 1 of the lane's NT, at keys 2c, 2c + 1, 2c + 8, 2c + 9 (the V
                // bytes the lane reads): NT / 2 products a tile, into ot [NT / 2][4]
                typename dec_if<KT, dec_acc<NT / 2>, dec_none>::type ot;  // (KT alone: O^T's accumulators)
                if constexpr (KT)
#pragma unroll
                    for (int u = 0; u < NT / 2; ++u) ot.v[u][0] = ot.v[u][1] = ot.v[u][2] = ot.v[u][3] = 0.0f;
                auto compute8t = [&](const Tile8 &x, int t0) {
                    if constexpr (KT) {
                        float st[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // (key r, head 2c), (r, 2c + 1), (r + 8, 2c), (r + 8, 2c + 1)
#pragma unroll
                        for (int j = 0; j < KS; ++j) {
                            const tc_u32 a[4] = {dec_e4m3x2<BF16>(x.k[0][j]), dec_e4m3x2<BF16>(x.k[1][j]),
                                                 dec_e4m3x2<BF16, 1>(x.k[0][j]), dec_e4m3x2<BF16, 1>(x.k[1][j])};
                            tc_mma<BF16>(st, a, qa[2 * j], qa[2 * j + 1]);
                        }
                        const bool in0 = t0 + r < k1, in1 = t0 + r + 8 < k1;
                        const float c0 = x.ks[0] * scale_log2, c1 = x.ks[1] * scale_log2;
                        st[0] = in0 ? st[0] * c0 : TC_NEG_INF;
                        st[1] = in0 ? st[1] * c0 : TC_NEG_INF;
                        st[2] = in1 ? st[2] * c1 : TC_NEG_INF;
                        st[3] = in1 ? st[3] * c1 : TC_NEG_INF;
                        float mv = fmaxf(x.vs[0], x.vs[1]), a0, a1;
                        dec_kt_softmax<true>(st, m0, m1, l0, l1, a0, a1, mv);
                        const float iv = mv > 0.0f ? 1.0f / mv : 0.0f, w0 = x.vs[0] * iv, w1 = x.vs[1] * iv;
                        const tc_u32 b0 = dec_trans(tc_pack<false>(st[0] * w0, st[1] * w0));  // keys 2c, 2c + 1 of head r
                        const tc_u32 b1 = dec_trans(tc_pack<false>(st[2] * w1, st[3] * w1));  // keys 8 + 2c, 9 + 2c
                        tc_u32 vf[4][NT / 2];  // word u = columns 2u, 2u + 1 of the lane's NT
                        dec_widen_v<NT>(x.v, vf);
#pragma unroll
                        for (int u = 0; u < NT / 2; ++u) {
                            const tc_u32 a[4] = {__byte_perm(vf[0][u], vf[1][u], 0x5410u), __byte_perm(vf[0][u], vf[1][u], 0x7632u),
                                                 __byte_perm(vf[2][u], vf[3][u], 0x5410u), __byte_perm(vf[2][u], vf[3][u], 0x7632u)};
                            float pv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                            tc_mma<false>(pv, a, b0, b1);
                            ot.v[u][0] = fmaf(ot.v[u][0], a0, mv * pv[0]);
                            ot.v[u][1] = fmaf(ot.v[u][1], a1, mv * pv[1]);
                            ot.v[u][2] = fmaf(ot.v[u][2], a0, mv * pv[2]);
                            ot.v[u][3] = fmaf(ot.v[u][3], a1, mv * pv[3]);
                        }
                    }
                };
                auto compute8 = [&](const Tile8 &x, int t0) {
                    float sc[2][4];
#pragma unroll
                    for (int t = 0; t < 2; ++t) {
                        sc[t][0] = sc[t][1] = sc[t][2] = sc[t][3] = 0.0f;
#pragma unroll
                        for (int j = 0; j < KS; ++j) {  // word j: columns 4j .. 4j + 3 of the lane's E
                            const tc_u32 a[4] = {qa[2 * j], M16 ? qb[2 * j] : 0u, qa[2 * j + 1], M16 ? qb[2 * j + 1] : 0u};
                            tc_mma<BF16>(sc[t], a, dec_e4m3x2<BF16>(x.k[t][j]), dec_e4m3x2<BF16, 1>(x.k[t][j]));
                        }
#pragma unroll
                        for (int e = 0; e < 4; ++e) sc[t][e] *= x.ks[2 * t + (e & 1)];
                    }
                    float a0, a1;
                    softmax(sc, t0, a0, a1);
                    float mv = fmaxf(fmaxf(x.vs[0], x.vs[1]), fmaxf(x.vs[2], x.vs[3]));
                    mv = fmaxf(mv, tc_shfl_xor(mv, 1));
                    mv = fmaxf(mv, tc_shfl_xor(mv, 2));  // the quad holds the tile's 16 keys
                    const float iv = mv > 0.0f ? 1.0f / mv : 0.0f;
                    float w[4];
#pragma unroll
                    for (int k = 0; k < 4; ++k) w[k] = x.vs[k] * iv;
                    const tc_u32 pa[4] = {tc_pack<false>(sc[0][0] * w[0], sc[0][1] * w[1]),
                                          M16 ? tc_pack<false>(sc[0][2] * w[0], sc[0][3] * w[1]) : 0u,
                                          tc_pack<false>(sc[1][0] * w[2], sc[1][1] * w[3]),
                                          M16 ? tc_pack<false>(sc[1][2] * w[2], sc[1][3] * w[3]) : 0u};
                    tc_u32 vf[4][NT / 2];  // word i = columns 2i, 2i + 1 of the lane's NT
                    dec_widen_v<NT>(x.v, vf);
#pragma unroll
                    for (int u = 0; u < NT; ++u) {
                        const unsigned sel = (u & 1) ? 0x7632u : 0x5410u;
                        float pv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                        tc_mma<false>(pv, pa, __byte_perm(vf[0][u >> 1], vf[1][u >> 1], sel),
                                      __byte_perm(vf[2][u >> 1], vf[3][u >> 1], sel));
                        o[u][0] = fmaf(o[u][0], a0, mv * pv[0]);
                        o[u][1] = fmaf(o[u][1], a0, mv * pv[1]);
                        if (M16) o[u][2] = fmaf(o[u][2], a1, mv * pv[2]), o[u][3] = fmaf(o[u][3], a1, mv * pv[3]);
                    }
                };
                Tile8 x0, x1;
                if (PIPE) {  // the next tile's loads in flight while this one is computed, two tiles an
                    // iteration into two buffers in turn (no copy of a tile's registers from one to the other)
                    load8(k0 + 16 * warp, x0);
                    for (int t0 = k0 + 16 * warp; t0 < k1; t0 += 32 * W) {
                        load8(t0 + 16 * W, x1);
                        mask8(x0, t0);
                        if constexpr (KT) compute8t(x0, t0); else compute8(x0, t0);
                        if (t0 + 16 * W >= k1) break;
                        load8(t0 + 32 * W, x0);
                        mask8(x1, t0 + 16 * W);
                        if constexpr (KT) compute8t(x1, t0 + 16 * W); else compute8(x1, t0 + 16 * W);
                    }
                } else {
                    for (int t0 = k0 + 16 * warp; t0 < k1; t0 += 16 * W) {
                        load8(t0, x0);
                        mask8(x0, t0);
                        if constexpr (KT) compute8t(x0, t0); else compute8(x0, t0);
                    }
                }
                if constexpr (KT) kt_rows(ot.v);
            } else if constexpr (STG > 0) {
                tc_u16 *ring = (tc_u16 *)dec_ring + (long long)warp * STG * 2 * TILE;
                // tile t0's K and V rows (keys t0 .. min(t0 + 16, k1) - 1) into the next stage, by lane 0
                auto issue = [&](int t0) {  // (PAGED: tiles in order, each one's page looked up a tile ahead)
                    const int st = n_issue % STG;
                    ++n_issue;
                    long long at = kv + (long long)t0 * D;
                    if constexpr (PAGED) at = tile_base(t0);
                    if (lane == 0) {
                        const tc_u32 bytes = (tc_u32)(min(16, k1 - t0) * D * 2), bar = tc_saddr(&bars[warp][st]);
                        dec_bar_expect(bar, 2 * bytes);
                        dec_bulk(tc_saddr(ring + st * 2 * TILE), K + at, bytes, bar);
                        dec_bulk(tc_saddr(ring + st * 2 * TILE + TILE), V + at, bytes, bar);
                    }
                };
                tc_u4 kr[2][E / 8], vr[4][NT / 8];
                int tn = k0 + 16 * warp;  // the next tile to issue
#pragma unroll 1
                for (int j = 0; j < STG - 1 && tn < k1; ++j, tn += 16 * W) issue(tn);
#pragma unroll 1
                for (int t0 = k0 + 16 * warp; t0 < k1; t0 += 16 * W) {
                    if (tn < k1) {  // into the stage read last iteration (its reads ordered by that __syncwarp)
                        issue(tn);
                        tn += 16 * W;
                    }
                    const int st = n_use % STG;
                    dec_bar_wait(tc_saddr(&bars[warp][st]), (n_use / STG) & 1);
#ifdef DEC_TRACE
                    if (tr_first == 0) tr_first = dec_now();
#endif
                    ++n_use;
                    const tc_u16 *ks = ring + st * 2 * TILE, *vs = ks + TILE;
#pragma unroll
                    for (int t = 0; t < 2; ++t) {
                        const bool in = t0 + 8 * t + r < k1;
#pragma unroll
                        for (int i = 0; i < E / 8; ++i)
                            kr[t][i] = in ? ((const tc_u4 *)(ks + (8 * t + r) * D + c * E))[i] : tc_u4{0u, 0u, 0u, 0u};
                    }
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        const int row = (k >> 1) * 8 + 2 * c + (k & 1);
                        const bool in = t0 + row < k1;
#pragma unroll
                        for (int i = 0; i < NT / 8; ++i)
                            vr[k][i] = in ? ((const tc_u4 *)(vs + row * D + r * NT))[i] : tc_u4{0u, 0u, 0u, 0u};
                    }
                    __syncwarp();
                    compute(kr, vr, t0);
                }
            } else {
                tc_u4 kr[2][E / 8], vr[4][NT / 8];
                // (_pgs) a 16-bit tile with the keys as the rows of both products, as _pgt8s (compute8t above)
                // without the widening and the scales: S^T = K Q^T, A the lane's K words of keys r and r + 8
                // (the columns q's words hold), B q of head r; P^T by movmatrix into the B fragment of O^T +=
                // V^T P^T, A from the lane's V words of keys 2c, 2c + 1, 2c + 8, 2c + 9 (rows r and r + 8:
                // columns 2u and 2u + 1 of its NT). Keys past k1 load zeros and are masked here
                typename dec_if<KT, dec_acc<NT / 2>, dec_none>::type ot;  // (KT alone: O^T's accumulators)
                auto compute_t = [&](const tc_u4 (&kt)[2][E / 8], const tc_u4 (&vt)[4][NT / 8], int t0) {
                    if constexpr (KT) {
                        float st[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // (key r, head 2c), (r, 2c + 1), (r + 8, 2c), (r + 8, 2c + 1)
                        const tc_u32 *k0w = (const tc_u32 *)kt[0], *k1w = (const tc_u32 *)kt[1];
#pragma unroll
                        for (int j = 0; j < KS; ++j) {
                            const tc_u32 a[4] = {k0w[2 * j], k1w[2 * j], k0w[2 * j + 1], k1w[2 * j + 1]};
                            tc_mma<BF16>(st, a, qa[2 * j], qa[2 * j + 1]);
                        }
                        const bool in0 = t0 + r < k1, in1 = t0 + r + 8 < k1;
                        st[0] = in0 ? st[0] * scale_log2 : TC_NEG_INF;
                        st[1] = in0 ? st[1] * scale_log2 : TC_NEG_INF;
                        st[2] = in1 ? st[2] * scale_log2 : TC_NEG_INF;
                        st[3] = in1 ? st[3] * scale_log2 : TC_NEG_INF;
                        float a0, a1, unused = 0.0f;
                        dec_kt_softmax<false>(st, m0, m1, l0, l1, a0, a1, unused);
                        const tc_u32 b0 = dec_trans(tc_pack<BF16>(st[0], st[1]));  // keys 2c, 2c + 1 of head r
                        const tc_u32 b1 = dec_trans(tc_pack<BF16>(st[2], st[3]));  // keys 8 + 2c, 9 + 2c
                        const tc_u32 *v0 = (const tc_u32 *)vt[0], *v1 = (const tc_u32 *)vt[1],
                                     *v2 = (const tc_u32 *)vt[2], *v3 = (const tc_u32 *)vt[3];
#pragma unroll
                        for (int u = 0; u < NT / 2; ++u) {
                            const tc_u32 a[4] = {__byte_perm(v0[u], v1[u], 0x5410u), __byte_perm(v0[u], v1[u], 0x7632u),
                                                 __byte_perm(v2[u], v3[u], 0x5410u), __byte_perm(v2[u], v3[u], 0x7632u)};
                            ot.v[u][0] *= a0, ot.v[u][1] *= a1, ot.v[u][2] *= a0, ot.v[u][3] *= a1;
                            tc_mma<BF16>(ot.v[u], a, b0, b1);
                        }
                    }
                };
                if constexpr (KT) {
#pragma unroll
                    for (int u = 0; u < NT / 2; ++u) ot.v[u][0] = ot.v[u][1] = ot.v[u][2] = ot.v[u][3] = 0.0f;
                    if (PIPE) {  // two tiles an iteration into two buffers in turn (no copy between them)
                        tc_u4 kn[2][E / 8], vn[4][NT / 8];
                        load(k0 + 16 * warp, kr, vr);
                        for (int t0 = k0 + 16 * warp; t0 < k1; t0 += 32 * W) {
                            load(t0 + 16 * W, kn, vn);
                            compute_t(kr, vr, t0);
                            if (t0 + 16 * W >= k1) break;
                            load(t0 + 32 * W, kr, vr);
                            compute_t(kn, vn, t0 + 16 * W);
                        }
                    } else {
                        for (int t0 = k0 + 16 * warp; t0 < k1; t0 += 16 * W) {
                            load(t0, kr, vr);
                            compute_t(kr, vr, t0);
                        }
                    }
                    kt_rows(ot.v);
                } else {
                    if (PIPE) load(k0 + 16 * warp, kr, vr);
                    for (int t0 = k0 + 16 * warp; t0 < k1; t0 += 16 * W) {
                        if (PIPE) {  // the next tile's loads in flight while this one is computed
                            tc_u4 kn[2][E / 8], vn[4][NT / 8];
                            load(t0 + 16 * W, kn, vn);
                            compute(kr, vr, t0);
#pragma unroll
                            for (int t = 0; t < 2; ++t)
#pragma unroll
                                for (int i = 0; i < E / 8; ++i) kr[t][i] = kn[t][i];
#pragma unroll
                            for (int k = 0; k < 4; ++k)
#pragma unroll
                                for (int i = 0; i < NT / 8; ++i) vr[k][i] = vn[k][i];
                        } else {
                            load(t0, kr, vr);
                            compute(kr, vr, t0);
                        }
                    }
                }
            }
            // the warp's rows: l summed over the quad; output column n of n-tile u is column n NT + u
            // (KT: kt_rows, above)
            if constexpr (!KT) {
                l0 += tc_shfl_xor(l0, 1);
                l0 += tc_shfl_xor(l0, 2);
                if (M16) l1 += tc_shfl_xor(l1, 1), l1 += tc_shfl_xor(l1, 2);
                if (c == 0) {
                    sm[warp][r] = m0, sl[warp][r] = l0;
                    if (M16) sm[warp][r + 8] = m1, sl[warp][r + 8] = l1;
                }
#pragma unroll
                for (int u = 0; u < NT; ++u) {
                    so(warp)[r][(2 * c) * NT + u] = o[u][0];
                    so(warp)[r][(2 * c + 1) * NT + u] = o[u][1];
                    if (M16) so(warp)[r + 8][(2 * c) * NT + u] = o[u][2], so(warp)[r + 8][(2 * c + 1) * NT + u] = o[u][3];
                }
            }
            __syncthreads();
            for (int t = tid; t < nh * D; t += DEC_THREADS) {
                const int i = t / D, col = t - i * D;
                float mx = TC_NEG_INF;
#pragma unroll
                for (int w = 0; w < W; ++w) mx = fmaxf(mx, sm[w][i]);
                float lsum = 0.0f, acc = 0.0f;
                if (mx != TC_NEG_INF)
#pragma unroll
                    for (int w = 0; w < W; ++w) {
                        const float f = tc_exp2(sm[w][i] - mx);
                        lsum += sl[w][i] * f;
                        acc += so(w)[i][col] * f;
                    }
                const long long bh = bh0 + h0 + i;
                const float y = lsum > 0.0f ? acc / lsum : 0.0f;
                if (Sn == 1) {  // one chunk: its rows are the output (what the combine of one partial writes)
                    O[bh * D + col] = dec_round<BF16>(y);
                    continue;
                }
                Op[(bh * S + s) * D + col] = y;
                if (col == 0) Lp[bh * S + s] = lsum > 0.0f ? mx + tc_log2(lsum) : TC_NEG_INF;
            }
            __syncthreads();
        }
#ifdef DEC_TRACE
        const unsigned long long tr_rows = dec_now();
        if (Sn == 1 && tid == 0 && bg == (int)blockIdx.y) dec_trace_block(tr_start, tr_first, tr_rows, false);
#endif
        if (Sn == 1) continue;  // (as in dec_split)
        __threadfence();
        __syncthreads();
        if (tid == 0) {
            const int t = atomicAdd(tickets + bg, 1);
            last = t == Sn - 1;
            if (last) tickets[bg] = 0;
        }
        __syncthreads();
        if (last) {
            __threadfence();
            dec_combine<D, BF16>(Op, Lp, O, bh0, group, S, Sn);
        }
        __syncthreads();
#ifdef DEC_TRACE
        if (tid == 0 && bg == (int)blockIdx.y) dec_trace_block(tr_start, tr_first, tr_rows, last);
#endif
    }
}

// the step's rows: q, k rotated at their position (cosT null: no rotation), q out, k and v into the
// cache. Contiguous (PAGED false): every row at position *pos, K, V [B, G, LMAX, D]. Paged: row b at
// pos[b], K, V the pool [pages, G, LMAX = page, D], row b's page pidx[b], its offset pos[b] % page.
template <bool BF16, bool PAGED>
__device__ __forceinline__ void dec_append(const tc_u16 *__restrict__ QKV, tc_u16 *__restrict__ Qo,
                                           tc_u16 *__restrict__ K, tc_u16 *__restrict__ V,
                                           const float *__restrict__ cosT, const float *__restrict__ sinT,
                                           const long long *__restrict__ pos, const long long *__restrict__ pidx,
                                           int B, int H, int G, int D, int LMAX, int interleaved) {
    const int half = D / 2, rows = H + 2 * G;
    const long long n = (long long)B * rows * half;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < n; t += (long long)gridDim.x * blockDim.x) {
        const int j = (int)(t % half);
        const long long bj = t / half;
        const int r = (int)(bj % rows), b = (int)(bj / rows);
        const long long p0 = PAGED ? pos[b] : *pos;
        const int e0 = interleaved ? 2 * j : j, e1 = interleaved ? 2 * j + 1 : j + half;
        const tc_u16 *src = QKV + bj * D;
        float x0, x1, dummy;
        tc_unpack<BF16>((tc_u32)src[e0], x0, dummy);
        tc_unpack<BF16>((tc_u32)src[e1], x1, dummy);
        if (cosT != nullptr && r < H + G) {  // as torch computes it: products and sums each rounded
            const float c = cosT[p0 * half + j], sn = sinT[p0 * half + j];
            const float y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn));
            const float y1 = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, sn));
            x0 = y0;
            x1 = y1;
        }
        tc_u16 *dst;
        if (r < H) {
            dst = Qo + ((long long)b * H + r) * D;
        } else {
            const int kvh = r < H + G ? r - H : r - H - G;
            dst = (r < H + G ? K : V) + (PAGED ? ((pidx[b] * G + kvh) * LMAX + p0 % LMAX) * D
                                               : (((long long)b * G + kvh) * LMAX + p0) * D);
        }
        dst[e0] = dec_round<BF16>(x0);
        dst[e1] = dec_round<BF16>(x1);
    }
}

// An FP8 pool's step (see the header): a warp per (row b, head r of the H + 2G), DEC_PAIRS column
// pairs a lane (D <= 256). Rows and heads are warp-uniform, so the amax reduction is the whole warp.
#define DEC_PAIRS 4
template <bool BF16>
__device__ __forceinline__ void dec_append_pg8(const tc_u16 *__restrict__ QKV, tc_u16 *__restrict__ Qo,
                                               unsigned char *__restrict__ K, unsigned char *__restrict__ V,
                                               float *__restrict__ KS, float *__restrict__ VS,
                                               const float *__restrict__ cosT, const float *__restrict__ sinT,
                                               const long long *__restrict__ pos, const long long *__restrict__ pidx,
                                               int R, int H, int G, int D, int page, int interleaved) {
#if __CUDA_ARCH__ >= 890
    const int half = D / 2, rows = H + 2 * G, lane = threadIdx.x & 31;
    const long long nw = (long long)R * rows, step = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < nw; w += step) {
        const int r = (int)(w % rows);
        const long long b = w / rows, p0 = pos[b];
        const tc_u16 *src = QKV + w * D;
        float y[2 * DEC_PAIRS];
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < DEC_PAIRS; ++i) {
            const int j = lane + 32 * i;
            y[2 * i] = y[2 * i + 1] = 0.0f;
            if (j >= half) continue;
            const int e0 = interleaved ? 2 * j : j, e1 = interleaved ? 2 * j + 1 : j + half;
            float x0, x1, dummy;
            tc_unpack<BF16>((tc_u32)src[e0], x0, dummy);
            tc_unpack<BF16>((tc_u32)src[e1], x1, dummy);
            if (cosT != nullptr && r < H + G) {  // as dec_append: as torch computes it
                const float c = cosT[p0 * half + j], sn = sinT[p0 * half + j];
                const float y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn));
                const float y1 = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, sn));
                x0 = y0;
                x1 = y1;
            }
            const tc_u16 h0 = dec_round<BF16>(x0), h1 = dec_round<BF16>(x1);
            if (r < H) {
                tc_u16 *dst = Qo + (b * H + r) * D;
                dst[e0] = h0;
                dst[e1] = h1;
            } else {  // the stored dtype's values, as torch quantizes them
                tc_unpack<BF16>((tc_u32)h0, y[2 * i], dummy);
                tc_unpack<BF16>((tc_u32)h1, y[2 * i + 1], dummy);
                amax = fmaxf(amax, fmaxf(fabsf(y[2 * i]), fabsf(y[2 * i + 1])));
            }
        }
        if (r < H) continue;
        amax = tc_warp_max(amax);
        // (as torch divides by a number on the GPU: fp8.quantize_rows); a row of zeros keeps s = 0, its
        // bytes zeros divided by 1 (a scale of 1 there would be a tile's largest V scale in dec_mma's _pg8)
        const float s = amax * (1.0f / 448.0f), div = s > 0.0f ? s : 1.0f;
        const int kvh = r < H + G ? r - H : r - H - G;
        const long long row = (pidx[b] * G + kvh) * page + p0 % page;
        unsigned char *dst = (r < H + G ? K : V) + row * D;
#pragma unroll
        for (int i = 0; i < DEC_PAIRS; ++i) {
            const int j = lane + 32 * i;
            if (j >= half) continue;
            const int e0 = interleaved ? 2 * j : j, e1 = interleaved ? 2 * j + 1 : j + half;
            unsigned short two;  // rounded to nearest even, saturating at +-448; the second operand low
            asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(two) : "f"(y[2 * i + 1] / div), "f"(y[2 * i] / div));
            dst[e0] = (unsigned char)(two & 0xffu);
            dst[e1] = (unsigned char)(two >> 8);
        }
        if (lane == 0) (r < H + G ? KS : VS)[row] = s;
    }
#endif
}

// The contiguous kernels (K, V [B, G, LMAX, D], one length for the batch) and the paged ones (_pg:
// K, V the pool [pages, G, page, D], a block table [B, tstride] and a length per sequence, lens [B]);
// the arguments the other layout does not use are passed as 0.
#define DEC_SPLIT(SUF, BF16, D, GQ, PAGED, PG)                                                          \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS) dec_split_##SUF##_d##D##_g##GQ##PG(      \
        const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K, const tc_u16 *__restrict__ V,      \
        float *__restrict__ Op, float *__restrict__ Lp, tc_u16 *__restrict__ O, int *__restrict__ tickets, \
        int BG, int G, int group, int Ladd, const long long *__restrict__ Lpos, int LMAX, int S,        \
        float scale_log2, const int *__restrict__ table, const int *__restrict__ lens, int tstride, int page) { \
        dec_split<D, GQ, BF16, (PAGED) != 0>(Q, K, V, Op, Lp, O, tickets, BG, G, group, Ladd, Lpos, LMAX, S, \
                                             scale_log2, table, lens, tstride, page);                   \
    }
#define DEC_MMA(SUF, BF16, D, M16, ROWS, PIPE, P, PAGED, PG)                                            \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS) dec_mma_##SUF##_d##D##_r##ROWS##P##PG(     \
        const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K, const tc_u16 *__restrict__ V,      \
        float *__restrict__ Op, float *__restrict__ Lp, tc_u16 *__restrict__ O, int *__restrict__ tickets, \
        int BG, int G, int group, int Ladd, const long long *__restrict__ Lpos, int LMAX, int S,        \
        float scale_log2, const int *__restrict__ table, const int *__restrict__ lens, int tstride, int page) { \
        dec_mma<D, M16, PIPE, BF16, PAGED>(Q, K, V, Op, Lp, O, tickets, BG, G, group, Ladd, Lpos, LMAX, S, \
                                           scale_log2, table, lens, tstride, page);                     \
    }
// the staged tensor-core split (_b: sm_90+; launched with DEC_STAGES stages' dynamic shared memory,
// tpattn/decode.py's dec_ring_bytes), and the same over a pool of whole-tile pages (_pgb: PG 2,
// equal-work chunks; LMAX carries the target count of non-empty blocks, tpattn/decode.py's eq_blocks)
#define DEC_STAGES 3
#define DEC_MMAB(SUF, BF16, D, M16, ROWS, PG, PSUF)                                                    \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS) dec_mma_##SUF##_d##D##_r##ROWS##PSUF(     \
        const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K, const tc_u16 *__restrict__ V,      \
        float *__restrict__ Op, float *__restrict__ Lp, tc_u16 *__restrict__ O, int *__restrict__ tickets, \
        int BG, int G, int group, int Ladd, const long long *__restrict__ Lpos, int LMAX, int S,        \
        float scale_log2, const int *__restrict__ table, const int *__restrict__ lens, int tstride, int page) { \
        dec_mma<D, M16, false, BF16, PG, tc_u16, DEC_STAGES>(Q, K, V, Op, Lp, O, tickets, BG, G, group, Ladd, \
                                                                 Lpos, LMAX, S, scale_log2, table, lens, tstride, page); \
    }
// _pgs: the tensor-core split over 16-bit pages of whole 16-key tiles with the keys as the rows of both
// products (KT: 8 heads a pass, as an FP8 pool's _pgt8s; see dec_mma)
#define DEC_MMAT(SUF, BF16, D, PIPE, P)                                                                 \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS) dec_mma_##SUF##_d##D##_r8##P##_pgs(       \
        const tc_u16 *__restrict__ Q, const tc_u16 *__restrict__ K, const tc_u16 *__restrict__ V,      \
        float *__restrict__ Op, float *__restrict__ Lp, tc_u16 *__restrict__ O, int *__restrict__ tickets, \
        int BG, int G, int group, int Ladd, const long long *__restrict__ Lpos, int LMAX, int S,        \
        float scale_log2, const int *__restrict__ table, const int *__restrict__ lens, int tstride, int page) { \
        dec_mma<D, false, PIPE, BF16, 2, tc_u16, 0, true>(Q, K, V, Op, Lp, O, tickets, BG, G, group, Ladd, Lpos, \
                                                          LMAX, S, scale_log2, table, lens, tstride, page); \
    }
#define DEC_MMATS(SUF, BF16, D) DEC_MMAT(SUF, BF16, D, false, ) DEC_MMAT(SUF, BF16, D, true, _p)
#define DEC_MMABS(SUF, BF16, D)                                                                         \
    DEC_MMAB(SUF, BF16, D, false, 8, 0, _b) DEC_MMAB(SUF, BF16, D, true, 16, 0, _b)                     \
    DEC_MMAB(SUF, BF16, D, false, 8, 2, _pgb)
// the tensor-core split over an FP8 pool (grouped heads at d = 64 and 128; _pg8)
#define DEC_MMA8(SUF, BF16, D, M16, ROWS, PIPE, P, PG, PSUF, KT)                                       \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS) dec_mma_##SUF##_d##D##_r##ROWS##P##PSUF(   \
        const tc_u16 *__restrict__ Q, const unsigned char *__restrict__ K, const unsigned char *__restrict__ V, \
        float *__restrict__ Op, float *__restrict__ Lp, tc_u16 *__restrict__ O, int *__restrict__ tickets, \
        int BG, int G, int group, int S, float scale_log2, const int *__restrict__ table,               \
        const int *__restrict__ lens, int tstride, int page, const float *__restrict__ KS,              \
        const float *__restrict__ VS) {                                                                 \
        dec_mma<D, M16, PIPE, BF16, PG, unsigned char, 0, KT>(Q, K, V, Op, Lp, O, tickets, BG, G, group, 0, nullptr, \
                                                                0, S, scale_log2, table, lens, tstride, page, KS, VS); \
    }
#define DEC_MMAS8P(SUF, BF16, D, PG, PSUF)                                                              \
    DEC_MMA8(SUF, BF16, D, false, 8, false, , PG, PSUF, false)                                          \
    DEC_MMA8(SUF, BF16, D, true, 16, false, , PG, PSUF, false)                                          \
    DEC_MMA8(SUF, BF16, D, false, 8, true, _p, PG, PSUF, false)                                         \
    DEC_MMA8(SUF, BF16, D, true, 16, true, _p, PG, PSUF, false)
// _pg8: any page size (PG 3, whole tiles or a lookup a key chosen at run time); _pgt8: pages of whole
// 16-key tiles alone (PG 2: no run-time choice, no division, a tile's scales in paired loads)
// _pgt8s: _pgt8 with the keys as the rows of both products (KT: 8 heads a pass; see dec_mma)
#define DEC_MMAS8(SUF, BF16, D)                                                                         \
    DEC_MMAS8P(SUF, BF16, D, 3, _pg8) DEC_MMAS8P(SUF, BF16, D, 2, _pgt8)                               \
    DEC_MMA8(SUF, BF16, D, false, 8, false, , 2, _pgt8s, true) DEC_MMA8(SUF, BF16, D, false, 8, true, _p, 2, _pgt8s, true)
// the CUDA-core split over an FP8 pool (_pg8): e4m3 pages and their row scales KS, VS
#define DEC_SPLIT8(SUF, BF16, D, GQ)                                                                    \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS) dec_split_##SUF##_d##D##_g##GQ##_pg8(    \
        const tc_u16 *__restrict__ Q, const unsigned char *__restrict__ K, const unsigned char *__restrict__ V, \
        float *__restrict__ Op, float *__restrict__ Lp, tc_u16 *__restrict__ O, int *__restrict__ tickets, \
        int BG, int G, int group, int S, float scale_log2, const int *__restrict__ table,               \
        const int *__restrict__ lens, int tstride, int page, const float *__restrict__ KS,              \
        const float *__restrict__ VS) {                                                                 \
        dec_split<D, GQ, BF16, true, unsigned char>(Q, K, V, Op, Lp, O, tickets, BG, G, group, 0, nullptr, 0, S, \
                                                    scale_log2, table, lens, tstride, page, KS, VS);    \
    }
#define DEC_SPLITS8(D)                                                                                  \
    DEC_SPLIT8(f16, false, D, 1) DEC_SPLIT8(f16, false, D, 2) DEC_SPLIT8(f16, false, D, 4)              \
    DEC_SPLIT8(f16, false, D, 8) DEC_SPLIT8(bf16, true, D, 1) DEC_SPLIT8(bf16, true, D, 2)              \
    DEC_SPLIT8(bf16, true, D, 4) DEC_SPLIT8(bf16, true, D, 8)
#define DEC_LAYOUT(SUF, BF16, D, PAGED, PG)                                                             \
    DEC_SPLIT(SUF, BF16, D, 1, PAGED, PG) DEC_SPLIT(SUF, BF16, D, 2, PAGED, PG)                         \
    DEC_SPLIT(SUF, BF16, D, 4, PAGED, PG) DEC_SPLIT(SUF, BF16, D, 8, PAGED, PG)                         \
    DEC_MMA(SUF, BF16, D, false, 8, false, , PAGED, PG) DEC_MMA(SUF, BF16, D, true, 16, false, , PAGED, PG) \
    DEC_MMA(SUF, BF16, D, false, 8, true, _p, PAGED, PG) DEC_MMA(SUF, BF16, D, true, 16, true, _p, PAGED, PG)
// contiguous, paged with whole 16-key tiles a page (_pg; the CUDA-core split's only paged build), and
// paged a lookup a key (_pgk)
#define DEC_DEFINE(SUF, BF16, D)                                                                        \
    DEC_LAYOUT(SUF, BF16, D, 0, ) DEC_LAYOUT(SUF, BF16, D, 2, _pg)                                      \
    DEC_MMA(SUF, BF16, D, false, 8, false, , 1, _pgk) DEC_MMA(SUF, BF16, D, true, 16, false, , 1, _pgk) \
    DEC_MMA(SUF, BF16, D, false, 8, true, _p, 1, _pgk) DEC_MMA(SUF, BF16, D, true, 16, true, _p, 1, _pgk)
#ifndef DEC_OTHER_DIMS
DEC_DEFINE(f16, false, 64)
DEC_DEFINE(bf16, true, 64)
DEC_DEFINE(f16, false, 128)
DEC_DEFINE(bf16, true, 128)
DEC_SPLITS8(64)
DEC_SPLITS8(128)
DEC_MMABS(f16, false, 64)
DEC_MMABS(bf16, true, 64)
DEC_MMABS(f16, false, 128)
DEC_MMABS(bf16, true, 128)
DEC_MMAS8(f16, false, 64)
DEC_MMAS8(bf16, true, 64)
DEC_MMAS8(f16, false, 128)
DEC_MMAS8(bf16, true, 128)
DEC_MMATS(f16, false, 64)
DEC_MMATS(bf16, true, 64)
DEC_MMATS(f16, false, 128)
DEC_MMATS(bf16, true, 128)
#else
// the other head dims users run (small models, Phi, vision models, Gemma and long-context models):
// the CUDA-core split only, contiguous and paged (tpattn/decode.py runs it for grouped heads too),
// built from decode_attention_dims.cu (which defines DEC_OTHER_DIMS) so that the common head dims'
// module compiles as fast as before
#define DEC_SPLITS(SUF, BF16, D, PAGED, PG)                                                             \
    DEC_SPLIT(SUF, BF16, D, 1, PAGED, PG) DEC_SPLIT(SUF, BF16, D, 2, PAGED, PG)                         \
    DEC_SPLIT(SUF, BF16, D, 4, PAGED, PG) DEC_SPLIT(SUF, BF16, D, 8, PAGED, PG)
#define DEC_DEFINE_SPLIT(D)                                                                             \
    DEC_SPLITS(f16, false, D, false, ) DEC_SPLITS(f16, false, D, true, _pg)                             \
    DEC_SPLITS(bf16, true, D, false, ) DEC_SPLITS(bf16, true, D, true, _pg) DEC_SPLITS8(D)
DEC_DEFINE_SPLIT(32)
DEC_DEFINE_SPLIT(80)
DEC_DEFINE_SPLIT(96)
DEC_DEFINE_SPLIT(160)
DEC_DEFINE_SPLIT(192)
DEC_DEFINE_SPLIT(256)
#endif
#define DEC_APPEND(SUF, BF16)                                                                           \
    extern "C" __global__ void __launch_bounds__(256) dec_append_##SUF(                                 \
        const tc_u16 *__restrict__ QKV, tc_u16 *__restrict__ Qo, tc_u16 *__restrict__ K, tc_u16 *__restrict__ V, \
        const float *__restrict__ cosT, const float *__restrict__ sinT, const long long *__restrict__ pos, int B, \
        int H, int G, int D, int LMAX, int interleaved) {                                               \
        dec_append<BF16, false>(QKV, Qo, K, V, cosT, sinT, pos, nullptr, B, H, G, D, LMAX, interleaved);  \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) dec_append_pg_##SUF(                              \
        const tc_u16 *__restrict__ QKV, tc_u16 *__restrict__ Qo, tc_u16 *__restrict__ K, tc_u16 *__restrict__ V, \
        const float *__restrict__ cosT, const float *__restrict__ sinT, const long long *__restrict__ pos, \
        const long long *__restrict__ pidx, int R, int H, int G, int D, int page, int interleaved) {     \
        dec_append<BF16, true>(QKV, Qo, K, V, cosT, sinT, pos, pidx, R, H, G, D, page, interleaved);     \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) dec_append_pg8_##SUF(                             \
        const tc_u16 *__restrict__ QKV, tc_u16 *__restrict__ Qo, unsigned char *__restrict__ K,         \
        unsigned char *__restrict__ V, float *__restrict__ KS, float *__restrict__ VS,                   \
        const float *__restrict__ cosT, const float *__restrict__ sinT, const long long *__restrict__ pos, \
        const long long *__restrict__ pidx, int R, int H, int G, int D, int page, int interleaved) {     \
        dec_append_pg8<BF16>(QKV, Qo, K, V, KS, VS, cosT, sinT, pos, pidx, R, H, G, D, page, interleaved); \
    }
DEC_APPEND(f16, false)
DEC_APPEND(bf16, true)

// a graphed paged decode step's rows (see the header): inputs [4, n] (slots, lengths before the step,
// and a page the step itself puts into the mirror: its column and id, column -1 for none), mirror
// [nslots + 1, W] (the last row: the padding rows' scratch pages), out: pos, pidx, poff [n] (int64),
// table [n, W] and lens [n] (int32). Threads over n * W copy the table rows (row b's carried column
// from the inputs, not the mirror); thread b < n also does row b's scalars, writes its carried page
// into the mirror and advances its length (the only writer of inputs[1][b] and of that mirror entry,
// which no other thread reads: rows are distinct slots, and padding rows carry nothing). A carried
// page stays in the inputs for the steps that continue this one; writing it again changes nothing.
extern "C" __global__ void __launch_bounds__(256) pg_prepare(long long *__restrict__ inputs,
                                                            int *__restrict__ mirror,
                                                            long long *__restrict__ pos, long long *__restrict__ pidx,
                                                            long long *__restrict__ poff, int *__restrict__ table,
                                                            int *__restrict__ lens, int n, int W, int page, int nslots) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < (long long)n * W) {
        const long long b = t / W, j = t % W;
        table[t] = j == inputs[2 * n + b] ? (int)inputs[3 * n + b] : mirror[inputs[b] * W + j];
    }
    if (t < n) {
        const long long slot = inputs[t], p = inputs[n + t], col = inputs[2 * n + t];
        const bool live = slot < nslots;
        if (col >= 0) mirror[slot * W + col] = (int)inputs[3 * n + t];
        pos[t] = p;
        pidx[t] = p / page == col ? inputs[3 * n + t] : mirror[slot * W + p / page];
        poff[t] = p % page;
        lens[t] = live ? (int)(p + 1) : 0;
        inputs[n + t] = live ? p + 1 : p;
    }
}
