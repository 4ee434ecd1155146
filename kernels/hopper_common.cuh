// hopper_common.cuh -- building blocks of the wgmma kernels (fused_hopper_attention.cu,
// tiled_hopper_attention.cu), for compute capability 9.0 compiled as sm_90a: cp.async tile loads
// into the 128-byte-swizzled layout wgmma reads, shared-memory matrix descriptors, the wgmma
// instructions themselves (fp16 / bf16 in, fp32 accumulators) and their fences. Built on tc_common.cuh.
#pragma once

#include "tc_common.cuh"

extern __shared__ __attribute__((aligned(1024))) unsigned char hw_smem[];

// the block's shared memory, rounded up to 1024 bytes (the 128-byte swizzle repeats every 8 rows)
__device__ __forceinline__ tc_u32 hw_smem_base() { return (tc_saddr(hw_smem) + 1023u) & ~1023u; }

// cp.async writes shared memory through the generic proxy, wgmma reads it through the async proxy
__device__ __forceinline__ void hw_fence_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void hw_st_shared(tc_u32 addr, tc_u32 v) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ tc_u4 hw_ld_shared4(tc_u32 addr) {
    tc_u4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}

// Tile layout: ROWS rows of 16-bit values, D / 64 panels of ROWS x 128 bytes; 16-byte chunk c of a
// row (c < D / 8) is in panel c / 8, stored at chunk (c % 8) ^ (row % 8) of that row.
template <int ROWS>
__device__ __forceinline__ tc_u32 hw_swz(int r, int c) {
    return (tc_u32)((c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// rows [row0, row0 + ROWS) x columns [col0, col0 + C) of a matrix with row stride ld (elements)
// into a tile at shared address dst; rows >= nrows and 16-byte chunks at columns >= ncols are zeros
template <int C, int ROWS, int NT>
__device__ __forceinline__ void hw_load(tc_u32 dst, const tc_u16 *g, long long ld, int row0, int nrows, int col0,
                                        int ncols, int tid) {
    constexpr int CH = C / 8;
    static_assert((ROWS * CH) % NT == 0, "tile chunks must split evenly over the threads");
#pragma unroll
    for (int i = 0; i < ROWS * CH / NT; ++i) {
        const int c = tid + i * NT;
        const int r = c / CH, ch = c % CH;
        const bool ok = row0 + r < nrows && col0 + ch * 8 < ncols;
        tc_cp16(dst + hw_swz<ROWS>(r, ch), g + (ok ? (row0 + r) * ld + col0 + ch * 8 : 0), ok ? 16 : 0);
    }
}

// rows [row0, row0 + ROWS) of a [N, D] matrix (all D columns) whose rows are ld elements apart;
// rows >= N are zeros
template <int D, int ROWS, int NT>
__device__ __forceinline__ void hw_load_tile(tc_u32 dst, const tc_u16 *g, int row0, int N, int tid,
                                             long long ld = D) {
    constexpr int CH = D / 8;
    static_assert((ROWS * CH) % NT == 0, "tile chunks must split evenly over the threads");
#pragma unroll
    for (int i = 0; i < ROWS * CH / NT; ++i) {
        const int c = tid + i * NT;
        const int r = c / CH, ch = c % CH;
        const int gr = row0 + r;
        tc_cp16(dst + hw_swz<ROWS>(r, ch), g + (gr < N ? gr : 0) * ld + ch * 8, gr < N ? 16 : 0);
    }
}

// wgmma shared-memory matrix descriptor: start address, leading and stride byte offsets (16-byte
// units), 128-byte swizzle. For K-major operands the 8-row groups are SBO = 1024 bytes apart (LBO
// unused); for the MN-major V tile LBO is the distance between 64-column panels.
__device__ __forceinline__ tc_u64 hw_desc(tc_u32 addr, tc_u32 lbo, tc_u32 sbo) {
    return (tc_u64)((addr & 0x3FFFFu) >> 4) | ((tc_u64)((lbo >> 4) & 0x3FFFu) << 16) |
           ((tc_u64)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}

// the descriptor d with its start address moved by `bytes` (a multiple of 16, the address staying below
// 256 KB): a 32-bit add to the address field in the low word, which cannot carry out of it; inside a
// loop of wgmma this replaces a mask, a shift and an or for every instruction
__device__ __forceinline__ tc_u64 hw_desc_add(tc_u64 d, tc_u32 bytes) {
    return ((d >> 32) << 32) | (tc_u32)((tc_u32)d + (bytes >> 4));
}

__device__ __forceinline__ void hw_wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void hw_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void hw_wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// keep the compiler from moving reads or writes of registers that an asynchronous wgmma owns
// across the fence / wait that guards them: the first U of them (hw_keep_first: a key tile narrower than
// the arrays are sized for, whose rest is never written and would hold registers for nothing), or all
template <int U, int R>
__device__ __forceinline__ void hw_keep_first(float (&r)[R]) {
    static_assert(U <= R, "U of R");
#pragma unroll
    for (int i = 0; i < U; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int U, int R>
__device__ __forceinline__ void hw_keep_first(tc_u32 (&r)[R][4]) {
    static_assert(U <= R, "U of R");
#pragma unroll
    for (int i = 0; i < U; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
}
template <int R>
__device__ __forceinline__ void hw_keep(float (&r)[R]) { hw_keep_first<R>(r); }
template <int R>
__device__ __forceinline__ void hw_keep(tc_u32 (&r)[R][4]) { hw_keep_first<R>(r); }

// The wgmma instructions: D (fp32 accumulators, 64 rows x N over the warpgroup, N / 2 a thread)
// += A (64 x 16: a shared-memory descriptor "ss", or 4 x b32 registers a thread "rs") x B (16 x N,
// shared-memory descriptor; TB = 1 reads it MN-major, transposed). scale_d = 0 ignores D.
#define HW_OPS32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define HW_OPS64 HW_OPS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define HW_F8(d, o) "+f"(d[o]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), \
                    "+f"(d[o + 6]), "+f"(d[o + 7])
#define HW_F32(d) HW_F8(d, 0), HW_F8(d, 8), HW_F8(d, 16), HW_F8(d, 24)
#define HW_F64(d) HW_F32(d), HW_F8(d, 32), HW_F8(d, 40), HW_F8(d, 48), HW_F8(d, 56)
// the instruction text; OPS: the accumulator list, then the operands' numbers after it
#define HW_SS(N, T, OPS, DA, DB, SC, TB) "{\n.reg .pred p;\nsetp.ne.b32 p, " SC ", 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." T "." T " {" OPS "}, " DA ", " DB ", p, 1, 1, 0, " TB ";\n}\n"
#define HW_RS(N, T, OPS, A0, A1, A2, A3, DB, SC, TB) "{\n.reg .pred p;\nsetp.ne.b32 p, " SC ", 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." T "." T " {" OPS "}, {" A0 ", " A1 ", " A2 ", " A3 "}, " DB \
    ", p, 1, 1, " TB ";\n}\n"

template <bool BF16, int TB>
__device__ __forceinline__ void hw_mma_ss_n64(float (&d)[32], tc_u64 da, tc_u64 db, int scale_d) {
    if (BF16)
        asm volatile(HW_SS(64, "bf16", HW_OPS32, "%32", "%33", "%34", "%35") : HW_F32(d)
                     : "l"(da), "l"(db), "r"(scale_d), "n"(TB));
    else
        asm volatile(HW_SS(64, "f16", HW_OPS32, "%32", "%33", "%34", "%35") : HW_F32(d)
                     : "l"(da), "l"(db), "r"(scale_d), "n"(TB));
}

template <bool BF16, int TB>
__device__ __forceinline__ void hw_mma_rs_n64(float (&d)[32], const tc_u32 (&a)[4], tc_u64 db, int scale_d) {
    if (BF16)
        asm volatile(HW_RS(64, "bf16", HW_OPS32, "%32", "%33", "%34", "%35", "%36", "%37", "%38") : HW_F32(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
    else
        asm volatile(HW_RS(64, "f16", HW_OPS32, "%32", "%33", "%34", "%35", "%36", "%37", "%38") : HW_F32(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
}

template <bool BF16, int TB>
__device__ __forceinline__ void hw_mma_ss_n128(float (&d)[64], tc_u64 da, tc_u64 db, int scale_d) {
    if (BF16)
        asm volatile(HW_SS(128, "bf16", HW_OPS64, "%64", "%65", "%66", "%67") : HW_F64(d)
                     : "l"(da), "l"(db), "r"(scale_d), "n"(TB));
    else
        asm volatile(HW_SS(128, "f16", HW_OPS64, "%64", "%65", "%66", "%67") : HW_F64(d)
                     : "l"(da), "l"(db), "r"(scale_d), "n"(TB));
}

template <bool BF16, int TB>
__device__ __forceinline__ void hw_mma_rs_n128(float (&d)[64], const tc_u32 (&a)[4], tc_u64 db, int scale_d) {
    if (BF16)
        asm volatile(HW_RS(128, "bf16", HW_OPS64, "%64", "%65", "%66", "%67", "%68", "%69", "%70") : HW_F64(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
    else
        asm volatile(HW_RS(128, "f16", HW_OPS64, "%64", "%65", "%66", "%67", "%68", "%69", "%70") : HW_F64(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
}

// O += P V at head dims 192 and 256: wgmma m64n192k16 and m64n256k16 (96 and 128 accumulators a
// thread), A from registers, B MN-major
#define HW_OPS96 HW_OPS64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define HW_OPS128 HW_OPS96 ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define HW_F96(d) HW_F64(d), HW_F8(d, 64), HW_F8(d, 72), HW_F8(d, 80), HW_F8(d, 88)
#define HW_F128(d) HW_F96(d), HW_F8(d, 96), HW_F8(d, 104), HW_F8(d, 112), HW_F8(d, 120)
template <bool BF16, int TB>
__device__ __forceinline__ void hw_mma_rs_n192(float (&d)[96], const tc_u32 (&a)[4], tc_u64 db, int scale_d) {
    if (BF16)
        asm volatile(HW_RS(192, "bf16", HW_OPS96, "%96", "%97", "%98", "%99", "%100", "%101", "%102") : HW_F96(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
    else
        asm volatile(HW_RS(192, "f16", HW_OPS96, "%96", "%97", "%98", "%99", "%100", "%101", "%102") : HW_F96(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
}
template <bool BF16, int TB>
__device__ __forceinline__ void hw_mma_rs_n256(float (&d)[128], const tc_u32 (&a)[4], tc_u64 db, int scale_d) {
    if (BF16)
        asm volatile(HW_RS(256, "bf16", HW_OPS128, "%128", "%129", "%130", "%131", "%132", "%133", "%134") : HW_F128(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
    else
        asm volatile(HW_RS(256, "f16", HW_OPS128, "%128", "%129", "%130", "%131", "%132", "%133", "%134") : HW_F128(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
}

// S = Q K^T over a narrower key tile (the last one of a sequence whose length is not a multiple of
// 128): wgmma m64n80k16, writing the first 40 accumulators of d (the same layout as the first 10
// column groups of n128); W = 64 (the key tiles of head dims above 128) m64n64k16, the first 32;
// W = 128 is hw_mma_ss_n128.
#define HW_OPS_W80 HW_OPS32 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define HW_F_W80(d) HW_F32(d), HW_F8(d, 32)
template <int W, bool BF16>
__device__ __forceinline__ void hw_mma_ss_w(float (&d)[64], tc_u64 da, tc_u64 db, int scale_d) {
    if constexpr (W == 80) {
        if (BF16)
            asm volatile(HW_SS(80, "bf16", HW_OPS_W80, "%40", "%41", "%42", "%43") : HW_F_W80(d)
                         : "l"(da), "l"(db), "r"(scale_d), "n"(0));
        else
            asm volatile(HW_SS(80, "f16", HW_OPS_W80, "%40", "%41", "%42", "%43") : HW_F_W80(d)
                         : "l"(da), "l"(db), "r"(scale_d), "n"(0));
    } else if constexpr (W == 64) {
        hw_mma_ss_n64<BF16, 0>(*reinterpret_cast<float(*)[32]>(&d[0]), da, db, scale_d);
    } else {
        static_assert(W == 128, "a key tile of 64, 80 or 128 keys");
        hw_mma_ss_n128<BF16, 0>(d, da, db, scale_d);
    }
}

// The W / 2 fp32 accumulators a thread holds in the wgmma m64nW layout of a two-warpgroup block (rows
// rl and rl + 8 of a 128-row tile, rl = 64 * warpgroup + 16 * warp + lane / 4), row by row scaled by sc0
// and sc1 and rounded to the storage type, into a 128 x W tile at shared address stage
template <int W, bool BF16>
__device__ __forceinline__ void hw_stage_tile(tc_u32 stage, const float (&acc)[W / 2], float sc0, float sc1, int rl,
                                              int lane) {
    constexpr int CH = W / 8;
    const float sc[2] = {sc0, sc1};
#pragma unroll
    for (int j = 0; j < CH; ++j)
#pragma unroll
        for (int i = 0; i < 2; ++i)
            hw_st_shared(stage + hw_swz<128>(rl + 8 * i, j) + (lane & 3) * 4,
                         tc_pack<BF16>(acc[4 * j + 2 * i] * sc[i], acc[4 * j + 2 * i + 1] * sc[i]));
}

// the staged 128 x W tile to rows [q0, q0 + 128) x columns [c0, c0 + W) of a matrix with row stride ld,
// in 16-byte stores for rows < nrows and columns < ncols, by the block's 256 threads (tid 0 .. 255)
template <int W>
__device__ __forceinline__ void hw_copy_tile(tc_u16 *g, long long ld, int q0, int nrows, int c0, int ncols,
                                             tc_u32 stage, int tid) {
    constexpr int CH = W / 8, NT = 256;
#pragma unroll
    for (int i = 0; i < 128 * CH / NT; ++i) {
        const int c = tid + i * NT;
        const int r = c / CH, ch = c % CH;
        if (q0 + r < nrows && c0 + ch * 8 < ncols)
            *(tc_u4 *)(g + (q0 + r) * ld + c0 + ch * 8) = hw_ld_shared4(stage + hw_swz<128>(r, ch));
    }
}

// Rows [q0, q0 + 128) x columns [c0, c0 + W) of a matrix with row stride ld, from the accumulators of a
// two-warpgroup block (hw_stage_tile), staged at shared address stage (128 x W) and leaving in 16-byte
// stores for rows < nrows and columns < ncols. Starts with __syncthreads (so the staging area may
// still hold operands until then); the caller syncs before reusing the area.
template <int W, bool BF16>
__device__ __forceinline__ void hw_store_tile(tc_u16 *g, long long ld, int q0, int nrows, int c0, int ncols,
                                              tc_u32 stage, const float (&acc)[W / 2], float sc0, float sc1,
                                              int rl, int tid) {
    __syncthreads();
    hw_stage_tile<W, BF16>(stage, acc, sc0, sc1, rl, tid & 31);
    __syncthreads();
    hw_copy_tile<W>(g, ld, q0, nrows, c0, ncols, stage, tid);
}

// acc (64 x NB, this warpgroup's rows) = A B^T, the product over D with both operands K-major in
// shared memory: a is the warpgroup's first row in panel 0 of an A tile of AROWS rows, b the first
// row of a B tile of NB rows. Issues D / 16 wgmma m64nNBk16 (the first ignores acc's old values).
template <int D, int AROWS, int NB, bool BF16>
__device__ __forceinline__ void hw_abt(float (&acc)[NB / 2], tc_u32 a, tc_u32 b) {
    static_assert(NB == 64 || NB == 128, "n64 or n128");
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const tc_u64 da = hw_desc(a + (kk >> 2) * (AROWS * 128) + (kk & 3) * 32, 16, 1024);
        const tc_u64 db = hw_desc(b + (kk >> 2) * (NB * 128) + (kk & 3) * 32, 16, 1024);
        if constexpr (NB == 128)
            hw_mma_ss_n128<BF16, 0>(acc, da, db, kk > 0);
        else
            hw_mma_ss_n64<BF16, 0>(acc, da, db, kk > 0);
    }
}

// acc (64 x D) += A B: A (64 x 16 KS) as KS k16 steps of register fragments, B the first 16 KS rows
// of a tile of BROWS rows x D columns in the tile layout, read transposed (MN-major: its 64-column
// panels BROWS * 128 bytes apart). Issues KS wgmma m64nDk16. ADD: the descriptors by hw_desc_add
// from the first (fewer instructions in the forward's loop; the backward's dK/dV kernel spills more
// with it, so it keeps the full hw_desc).
template <int D, int KS, int BROWS, bool BF16, bool ADD = false>
__device__ __forceinline__ void hw_ab(float (&acc)[D / 2], const tc_u32 (&a)[KS][4], tc_u32 b) {
    const tc_u64 db0 = hw_desc(b, BROWS * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        const tc_u64 db = ADD ? hw_desc_add(db0, kk * 16 * 128) : hw_desc(b + kk * 16 * 128, BROWS * 128, 1024);
        if constexpr (D == 128) {
            hw_mma_rs_n128<BF16, 1>(acc, a[kk], db, 1);
        } else if constexpr (D == 64) {
            hw_mma_rs_n64<BF16, 1>(acc, a[kk], db, 1);
        } else if constexpr (D == 192) {
            hw_mma_rs_n192<BF16, 1>(acc, a[kk], db, 1);
        } else {
            static_assert(D == 256, "head dim 64, 128, 192 or 256");
            hw_mma_rs_n256<BF16, 1>(acc, a[kk], db, 1);
        }
    }
}

// S (64 x W, this warpgroup's rows) = Q K^T over the first W keys of a K tile of KROWS rows: sq is the
// warpgroup's first Q row in panel 0 of a Q tile of QROWS rows, sk the first row of the K tile. Issues
// D / 16 wgmma m64nWk16 (W = 128: all of S; fewer: the first W / 2 accumulators).
template <int D, int QROWS, bool BF16, int W = 128, int KROWS = 128>
__device__ __forceinline__ void hw_qk(float (&s)[64], tc_u32 sq, tc_u32 sk) {
    const tc_u64 da0 = hw_desc(sq, 16, 1024), db0 = hw_desc(sk, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        hw_mma_ss_w<W, BF16>(s, hw_desc_add(da0, (kk >> 2) * (QROWS * 128) + (kk & 3) * 32),
                             hw_desc_add(db0, (kk >> 2) * (KROWS * 128) + (kk & 3) * 32), kk > 0);
}

// O (64 x D) += P V: P as A fragments (one k16 step of keys per pa[kk]; the first KS of them), sv the
// first row of a V tile of VROWS keys in the tile layout (read transposed: MN-major, panels VROWS * 128
// bytes apart).
template <int D, bool BF16, int KS = 8, int VROWS = 128>
__device__ __forceinline__ void hw_pv(float (&o)[D / 2], const tc_u32 (&pa)[8][4], tc_u32 sv) {
    hw_ab<D, KS, VROWS, BF16, true>(o, *reinterpret_cast<const tc_u32(*)[KS][4]>(&pa[0][0]), sv);
}

// A fragments from accumulators (n8 block j holds columns 8j..8j+7), rounded to the storage type:
// k16 step kk takes blocks 2kk and 2kk + 1, the register order of an m16n8k16 A fragment. P for
// O += P V from the S accumulators (KS = 8), and the backward's P^T and dS (KS = 4, n64). Only the
// first USE steps (a key tile of 16 USE keys).
template <bool BF16, int KS = 8, int USE = KS>
__device__ __forceinline__ void hw_pack_p(tc_u32 (&pa)[KS][4], const float (&s)[8 * KS]) {
#pragma unroll
    for (int kk = 0; kk < USE; ++kk) {
        pa[kk][0] = tc_pack<BF16>(s[8 * kk + 0], s[8 * kk + 1]);
        pa[kk][1] = tc_pack<BF16>(s[8 * kk + 2], s[8 * kk + 3]);
        pa[kk][2] = tc_pack<BF16>(s[8 * kk + 4], s[8 * kk + 5]);
        pa[kk][3] = tc_pack<BF16>(s[8 * kk + 6], s[8 * kk + 7]);
    }
}

// FP8 (e4m3) products, wgmma m64n128k32: 32 e4m3 values (32 bytes) of the reduced dimension a step,
// both operands K-major (the only layout wgmma takes for 8-bit types; there is no transpose bit).
// A from a shared-memory descriptor ("ss") or from 4 x b32 registers a thread ("rs", four e4m3 a
// register), B a descriptor; fp32 accumulators as the 16-bit ones. The descriptors are the 16-bit
// tiles' byte for byte: 128-byte rows, 128-byte swizzle, 8-row groups 1024 bytes apart.
#define HW_SS8(OPS, DA, DB, SC) "{\n.reg .pred p;\nsetp.ne.b32 p, " SC ", 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" OPS "}, " DA ", " DB ", p, 1, 1;\n}\n"
#define HW_RS8(OPS, A0, A1, A2, A3, DB, SC) "{\n.reg .pred p;\nsetp.ne.b32 p, " SC ", 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" OPS "}, {" A0 ", " A1 ", " A2 ", " A3 "}, " DB ", p, 1, 1;\n}\n"
__device__ __forceinline__ void hw_mma8_ss_n128(float (&d)[64], tc_u64 da, tc_u64 db, int scale_d) {
    asm volatile(HW_SS8(HW_OPS64, "%64", "%65", "%66") : HW_F64(d) : "l"(da), "l"(db), "r"(scale_d));
}
__device__ __forceinline__ void hw_mma8_rs_n128(float (&d)[64], const tc_u32 (&a)[4], tc_u64 db, int scale_d) {
    asm volatile(HW_RS8(HW_OPS64, "%64", "%65", "%66", "%67", "%68", "%69") : HW_F64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

// S (64 x 128) = Q K^T over D e4m3 columns (D bytes, one 128-byte panel at D = 128): sq the warpgroup's
// first Q row, sk the first row of a K tile; D / 32 wgmma m64n128k32
template <int D>
__device__ __forceinline__ void hw_qk8(float (&s)[64], tc_u32 sq, tc_u32 sk) {
    static_assert(D == 128, "the FP8 tiles: one 128-byte panel");
    const tc_u64 da0 = hw_desc(sq, 16, 1024), db0 = hw_desc(sk, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < D / 32; ++kk) hw_mma8_ss_n128(s, hw_desc_add(da0, kk * 32), hw_desc_add(db0, kk * 32), kk > 0);
}

// O (64 x 128) += P V over 128 keys: P as 4 k32 fragments (hw_pack_p8), sv the first row of a V^T tile
// (128 rows of d, each 128 keys in the order hw_pack_p8 gives, K-major)
__device__ __forceinline__ void hw_pv8(float (&o)[64], const tc_u32 (&pa)[8][4], tc_u32 sv) {
    const tc_u64 db0 = hw_desc(sv, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) hw_mma8_rs_n128(o, pa[kk], hw_desc_add(db0, kk * 32), 1);
}

// two fp32 values to e4m3 (round to nearest even, saturating at +-448), x0 in the low byte
__device__ __forceinline__ tc_u32 hw_e4m3x2(float x0, float x1) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(x1), "f"(x0));
    return r;
}

// P (the S accumulators of 128 keys) to the four k32 A fragments of O += P V in e4m3. A thread holds
// keys 8 j + 2 t + {0, 1} of n8 block j (t = lane % 4) and an m64k32 e4m3 fragment wants positions
// 4 t + {0..3} and 16 + 4 t + {0..3} of the step's 32: position 4 t + e of each 16 takes key
// 2 t + (e & 1) + 8 (e >> 1), with no shuffle between lanes, and V^T's keys are stored in that order
// (the host permutes each 16 keys: tpattn/attention/fp8_ws.py, KEY_ORDER)
__device__ __forceinline__ void hw_pack_p8(tc_u32 (&pa)[8][4], const float (&s)[64]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h)      // keys 16 h .. 16 h + 15 of the step: n8 blocks 4 kk + 2 h, + 1
#pragma unroll
            for (int i = 0; i < 2; ++i) {  // row r0 + 8 i
                const float *b = s + 16 * kk + 8 * h + 2 * i;
                pa[kk][2 * h + i] = hw_e4m3x2(b[0], b[1]) | (hw_e4m3x2(b[4], b[5]) << 16);
            }
}

// -inf in S (this thread's rows r0 and r0 + 8 of a warpgroup whose first row is wr0, keys k0 ..
// k0 + 127; the first NC of them held) where a key is past N or (causal) after the row; only tiles
// that cross either are touched
template <int NC = 128>
__device__ __forceinline__ void hw_mask(float (&s)[64], int k0, int N, int causal, int wr0, int r0, int lane) {
    if (k0 + 128 > N || (causal && k0 + 127 > wr0)) {
#pragma unroll
        for (int j = 0; j < NC / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = k0 + j * 8 + (lane & 3) * 2 + (e & 1);
                const int row = r0 + (e >> 1) * 8;
                if (col >= N || (causal && col > row)) s[4 * j + e] = TC_NEG_INF;
            }
    }
}

// 2^x for x <= 127 (P <= 1, or <= 2^LAZY in hw_softmax) on the FMA and integer pipes instead of the MUFU (ex2.approx's unit, 16 results a
// clock an SM: at e4m3 rates one 64 x 128 tile's exponentials take as long as its two products). x is
// clamped to -126 (a masked -inf gives about 2^-126, nothing once P is rounded to e4m3); x = n + f, n the
// nearest integer (the 1.5 * 2^23 rounding add), f in [-1/2, 1/2]; 2^f by a degree-3 polynomial fitted
// for relative error (at most 7.5e-5, against e4m3's 2^-4 steps); n added to its exponent field.
__device__ __forceinline__ float hw_exp2_fma(float x) {
    x = fmaxf(x, -126.0f);
    const float y = x + 12582912.0f;  // 0x1.8p23: n in the low mantissa bits
    const float f = x - (y - 12582912.0f);
    float p = fmaf(0.05517132207751274f, f, 0.24261054396629333f);
    p = fmaf(p, f, 0.6932609677314758f);
    p = fmaf(p, f, 0.9999281167984009f);
    return __int_as_float(__float_as_int(p) + (__float_as_int(y) << 23));
}

// row i's (0: r0, 1: r0 + 8) new running max over the first NC columns of S (hw_softmax's LAZY and TREE)
template <int NC, int LAZY, int TREE>
__device__ __forceinline__ float hw_row_max(const float (&s)[64], int i, float m, float scale_log2, bool &moved) {
    float mx = TC_NEG_INF;
    if constexpr (TREE == 1) {
#pragma unroll
        for (int j = 0; j < NC / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * i], s[4 * j + 2 * i + 1]));
    } else {
        float part[TREE];
#pragma unroll
        for (int t = 0; t < TREE; ++t) part[t] = TC_NEG_INF;
#pragma unroll
        for (int j = 0; j < NC / 8; ++j)
            part[j % TREE] = fmaxf(part[j % TREE], fmaxf(s[4 * j + 2 * i], s[4 * j + 2 * i + 1]));
#pragma unroll
        for (int w = 1; w < TREE; w *= 2)
#pragma unroll
            for (int t = 0; t + w < TREE; t += 2 * w) part[t] = fmaxf(part[t], part[t + w]);
        mx = part[0];
    }
    mx = fmaxf(mx, tc_shfl_xor(mx, 1));
    mx = fmaxf(mx, tc_shfl_xor(mx, 2));
    float mn = fmaxf(m, mx * scale_log2);
    if constexpr (LAZY > 0) {
        if (__any_sync(0xffffffffu, !(mn - m <= (float)LAZY)))  // (m = -inf: it moves)
            moved = true;
        else
            mn = m;
    }
    return mn;
}

// row i's exponentials relative to its new max mn (S becomes P), its sum and factor (hw_softmax's FMA)
template <int NC, int FMA>
__device__ __forceinline__ void hw_row_exp(float (&s)[64], int i, float mn, float (&m)[2], float (&l)[2],
                                           float (&alpha)[2], float scale_log2) {
    const float ms = mn == TC_NEG_INF ? 0.0f : mn;  // a row with nothing seen yet
    alpha[i] = tc_exp2(m[i] - ms);
    m[i] = mn;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < NC / 8; ++j) {
        const bool fma = j >= NC / 8 - FMA;
        const float x0 = fmaf(s[4 * j + 2 * i], scale_log2, -ms);
        const float p0 = fma ? hw_exp2_fma(x0) : tc_exp2(x0);
        const float x1 = fmaf(s[4 * j + 2 * i + 1], scale_log2, -ms);
        const float p1 = fma ? hw_exp2_fma(x1) : tc_exp2(x1);
        s[4 * j + 2 * i] = p0;
        s[4 * j + 2 * i + 1] = p1;
        sum += p0 + p1;
    }
    l[i] = l[i] * alpha[i] + sum;
}

// hw_softmax's default hook: nothing, and each row's exponentials right after its max
struct hw_no_hook {
    static constexpr bool between = false;
    __device__ __forceinline__ void operator()() const {}
};

// online softmax of S in place (S becomes P, relative to the new running max m, in log2 units);
// l the running sums, alpha the factor the accumulators of each of the two rows are rescaled by.
// Only the first NC columns of S (NC / 8 groups of 8) are read and written: a key tile of NC keys.
// FMA: of each row's NC / 8 pairs of a thread, the last FMA take hw_exp2_fma instead of the MUFU.
// LAZY > 0: a row's running max m stays where the tile's max exceeds it by at most LAZY (log2 units),
// unless another row of the warp must move, so P may reach 2^LAZY (P, l and O all relative to the same
// m: the same quotient); returns whether any row of the warp moved (alpha not all 1: O to be rescaled).
// TREE > 1: each row's max over TREE running maxima (every TREE-th pair each) combined at the end, so
// the dependent chain of fmaxf is NC / (8 TREE) long, not NC / 8 (a max is exact: the same bits).
// A hook with between = true runs once both rows' maxima are taken, before the first exponential (the
// FP8 kernel's softmax turn at TW_F8_TURN 2); the default takes the rows one after the other.
template <int NC = 128, int FMA = 0, int LAZY = 0, int TREE = 1, typename Mid = hw_no_hook>
__device__ __forceinline__ bool hw_softmax(float (&s)[64], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                           float scale_log2, Mid mid = {}) {
    static_assert(TREE >= 1 && (NC / 8) % TREE == 0, "TREE divides a row's pairs");
    bool moved = false;
    if constexpr (Mid::between) {
        float mn[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) mn[i] = hw_row_max<NC, LAZY, TREE>(s, i, m[i], scale_log2, moved);
        mid();
#pragma unroll
        for (int i = 0; i < 2; ++i) hw_row_exp<NC, FMA>(s, i, mn[i], m, l, alpha, scale_log2);
    } else {
#pragma unroll
        for (int i = 0; i < 2; ++i)
            hw_row_exp<NC, FMA>(s, i, hw_row_max<NC, LAZY, TREE>(s, i, m[i], scale_log2, moved), m, l, alpha,
                                scale_log2);
    }
    return moved;
}

// The backward's L of this thread's two rows r0 and r0 + 8 (before hw_finish_l: l holds the thread's
// partial sums, m the rows' maxima): the quad's sums, then its first thread writes rows < N of
// Lse[base + row]. A null Lse: nothing (no backward will run).
__device__ __forceinline__ void hw_write_lse(float *Lse, long long base, int r0, int N, const float (&m)[2],
                                             const float (&l)[2], int lane) {
    if (Lse == nullptr) return;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        float sum = l[i] + tc_shfl_xor(l[i], 1);
        sum += tc_shfl_xor(sum, 2);
        if ((lane & 3) == 0 && r0 + 8 * i < N) Lse[base + r0 + 8 * i] = tc_logsumexp(m[i], sum);
    }
}

// the row sums over the quad of threads that share a row, inverted (0 for a row that saw no key). APPROX:
// by the approximate reciprocal (rcp.approx, within 1 ulp) instead of the IEEE division, whose check and
// slow-path call sit on the way from a tile's last product to its output
template <bool APPROX = false>
__device__ __forceinline__ void hw_finish_l(float (&l)[2]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += tc_shfl_xor(l[i], 1);
        l[i] += tc_shfl_xor(l[i], 2);
        if constexpr (APPROX) {
            float r;
            asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(l[i]));
            l[i] = l[i] > 0.0f ? r : 0.0f;
        } else {
            l[i] = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        }
    }
}
