// ring_merge.cu -- context parallelism's merge (tpattn/attention/ring.py, merge): a piece's partial
// output o_b (16-bit, the fused kernels' output) and its rows' logsumexp L_b into the running fp32
// output O and logsumexp L, in place, in one pass; written for this project.
//
//   L' = log(e^L + e^L_b),  O = O e^(L - L') + o_b e^(L_b - L'),  L = L'   (both -inf: O, L unchanged)
//
// A row's D columns are D / 4 lanes of one warp (4 columns, one float4, each), so that the lanes of a
// row read its L before lane 0 writes L' (__syncwarp between). O and L may be row slices of a larger
// tensor (the ring's o[:, :, q0:q1]): (batch, head) strides given, rows contiguous; o_b and L_b are
// contiguous [B, H, rows, D] and [B, H, rows]. 64-bit offsets; grid-stride over the rows.

#include "tc_common.cuh"

template <int D, bool BF16>
__device__ __forceinline__ void ring_merge(float *__restrict__ O, float *__restrict__ L, const tc_u16 *__restrict__ Ob,
                                           const float *__restrict__ Lb, long long rows_total, int H, int rows,
                                           long long o_b_stride, long long o_h_stride, long long l_b_stride,
                                           long long l_h_stride) {
    constexpr int LANES = D / 4, PER_WARP = 32 / LANES;
    const int lane = threadIdx.x & 31, sub = lane / LANES, c4 = lane % LANES;
    const long long warps = (long long)gridDim.x * (blockDim.x / 32);
    for (long long w = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; w * PER_WARP < rows_total;
         w += warps) {
        const long long row = w * PER_WARP + sub;  // row of [B, H, rows]
        const bool ok = row < rows_total;
        long long b = 0, h = 0, i = 0;
        if (ok) {
            i = row % rows;
            const long long bh = row / rows;
            h = bh % H;
            b = bh / H;
        }
        float *o = O + b * o_b_stride + h * o_h_stride + i * D;
        float *l = L + b * l_b_stride + h * l_h_stride + i;
        const float la = ok ? *l : TC_NEG_INF, lb = ok ? Lb[row] : TC_NEG_INF;
        const float mx = fmaxf(la, lb);
        float wa = 1.0f, wb = 0.0f, lnew = la;
        if (mx != TC_NEG_INF) {
            const float ea = expf(la - mx), eb = expf(lb - mx);
            lnew = mx + logf(ea + eb);
            wa = expf(la - lnew);
            wb = expf(lb - lnew);
        }
        __syncwarp();
        if (ok) {
            float4 acc = *(float4 *)(o + 4 * c4);
            const tc_u16 *src = Ob + row * D + 4 * c4;
            float x0, x1, x2, x3;
            tc_unpack<BF16>(*(const tc_u32 *)src, x0, x1);
            tc_unpack<BF16>(*(const tc_u32 *)(src + 2), x2, x3);
            acc.x = fmaf(acc.x, wa, x0 * wb), acc.y = fmaf(acc.y, wa, x1 * wb);
            acc.z = fmaf(acc.z, wa, x2 * wb), acc.w = fmaf(acc.w, wa, x3 * wb);
            *(float4 *)(o + 4 * c4) = acc;
            if (c4 == 0) *l = lnew;
        }
    }
}

#define RING_MERGE(SUF, BF16, D)                                                                        \
    extern "C" __global__ void __launch_bounds__(256) ring_merge_##SUF##_d##D(                          \
        float *__restrict__ O, float *__restrict__ L, const tc_u16 *__restrict__ Ob, const float *__restrict__ Lb, \
        long long rows_total, int H, int rows, long long o_b_stride, long long o_h_stride, long long l_b_stride, \
        long long l_h_stride) {                                                                         \
        ring_merge<D, BF16>(O, L, Ob, Lb, rows_total, H, rows, o_b_stride, o_h_stride, l_b_stride, l_h_stride); \
    }
RING_MERGE(f16, false, 64)
RING_MERGE(bf16, true, 64)
RING_MERGE(f16, false, 128)
RING_MERGE(bf16, true, 128)
