// hopper_async.cuh -- Hopper's asynchronous machinery shared by the warp-specialized kernels
// (fused_ws_attention.cu, the five-product backward in fused_hopper_backward.cu): TMA tensor maps and
// tile loads, mbarriers (arrive, expected transaction bytes, phase waits) and named barriers.
#pragma once

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

// the map's box at column c, row r of head h, batch b -> shared dst; its bytes complete on mbarrier bar
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
