// naive_attention_backward.cu -- the backward of the seed's three-pass attention, kept naive on purpose.
//
// P is recomputed first with the forward's own qkKernel and softmaxKernel (naive_attention.cu: the
// forward saves nothing but q, k, v and o). Then one kernel per line of the math
// (tpattn/attention/autograd.py), each materialized like the forward's S and P:
//
//   dvKernel       dV = P^T dO              one thread per dV element; sums over the group's query heads
//   dpKernel       dP = dO V^T              one thread per score                       (writes dP, N x N)
//   rowDotKernel   D  = rowsum(dO o O)      one thread per row (d terms)               (writes D, BH x N)
//   dsKernel       dS = P o (dP - D)        one thread per score                (dS may overwrite dP)
//   dqKernel       dQ = dS K * scale        one thread per dQ element
//   dkKernel       dK = dS^T Q * scale      one thread per dK element; sums over the group's query heads
//
// Layout: Q, O, dO, dQ are [BH, N, d]; K, V, dK, dV are [BKV, N, d] with BKV = BH / group; P is
// [BH, N, N] in the storage type; dP, dS are [BH, N, N] float; D is [BH, N] float; all contiguous.
// Grouped-query attention: K/V head kv serves query heads kv * group .. kv * group + group - 1 (the
// forward's bh / group, inverted). dK and dV of a K/V head are one thread's sum over those query heads
// and over the query rows, in a fixed order: no atomics, so the gradients are bitwise deterministic.
// Causal: entries with key index j > query index i do not exist (P = 0 there); dpKernel and dsKernel
// write 0 for them (never P * garbage: 0 * NaN is NaN), and the sums skip them (i >= j for dV, dK;
// j <= i for dQ).
//
// Storage of dP and dS: float, not the storage type. dS = P o (dP - D) subtracts from each dP_ij its
// P-weighted row mean D_i; rounding dP (or dS) to fp16/bf16 costs 2^-11 / 2^-8 of |dP| in absolute
// terms, on a difference that is often much smaller than |dP|. Float keeps that rounding out (torch's
// own low-precision autograd rounds both dP and dS to the storage type, so this stays at or below it),
// and because rowDotKernel sums dO_i . O_i in exactly dpKernel's order, a row whose output equals one
// value row (N = 1; causal row 0: O_0 = V_0 exactly) gets dS = 0 exactly, as the math says. The cost
// is 4 bytes per score instead of 2; dsKernel writes dS over dP in place (each thread reads and
// writes its own entry), so the backward holds P (storage type) and one float N x N buffer at a time.
// Every sum is accumulated in float; dQ, dK, dV are stored in the storage type.
//
// Rules kept here (as in naive_attention.cu): every offset that can reach N^2 or BH * N * d is 64-bit
// (row pointers are formed with 64-bit products, inner loops walk pointers); grids loop with a stride
// over heads and rows so no launch needs more than y, z <= 65535; no header is included, so NVRTC
// (no <math.h>, no INFINITY) and nvcc compile it the same way. The small load/store helpers are
// copied from naive_attention.cu, which stays header-free.
//
// This is the baseline every faster backward is measured against: do not optimize it in place.

typedef unsigned short tp_f16;   // IEEE half, bit pattern
typedef unsigned short tp_bf16;  // bfloat16, bit pattern

__device__ __forceinline__ float tp_load(const tp_f16 *p, long long i) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p[i]));
    return f;
}
__device__ __forceinline__ void tp_store(tp_f16 *p, long long i, float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    p[i] = h;
}
__device__ __forceinline__ float tp_load_bf16(const tp_bf16 *p, long long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ void tp_store_bf16(tp_bf16 *p, long long i, float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a quiet NaN
        p[i] = (unsigned short)((u >> 16) | 0x0040u);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    p[i] = (unsigned short)(u >> 16);
}
__device__ __forceinline__ float tp_load(const float *p, long long i) { return p[i]; }
__device__ __forceinline__ void tp_store(float *p, long long i, float f) { p[i] = f; }

#define TP_LOAD_f16(p, i) tp_load((p), (i))
#define TP_STORE_f16(p, i, v) tp_store((p), (i), (v))
#define TP_LOAD_bf16(p, i) tp_load_bf16((p), (i))
#define TP_STORE_bf16(p, i, v) tp_store_bf16((p), (i), (v))
#define TP_LOAD_f32(p, i) tp_load((p), (i))
#define TP_STORE_f32(p, i, v) tp_store((p), (i), (v))

#define TPATTN_DEFINE_NAIVE_BACKWARD(SUF, T)                                                   \
/* dV[kv, j, c] = sum over the group's query heads bh, over rows i (causal: i >= j) of          \
   P[bh, i, j] * dO[bh, i, c].  grid: x over head-dim columns, y over key rows j, z over K/V     \
   heads; the block's x spans the head dim so the warps of one j share its P reads */            \
extern "C" __global__ void dvKernel_##SUF(const T *__restrict__ P, const T *__restrict__ dO,   \
                                         T *__restrict__ dV, int BKV, int N, int d, int causal, \
                                         int group) {                                           \
    const int c = blockIdx.x * blockDim.x + threadIdx.x;                                        \
    if (c >= d) return;                                                                         \
    for (int kv = blockIdx.z; kv < BKV; kv += gridDim.z) {                                      \
        for (int j = blockIdx.y * blockDim.y + threadIdx.y; j < N;                              \
             j += gridDim.y * blockDim.y) {                                                     \
            const int i0 = causal ? j : 0;                                                      \
            float acc = 0.0f;                                                                   \
            for (int t = 0; t < group; ++t) {                                                   \
                const long long bh = (long long)kv * group + t;                                 \
                const T *p = P + (bh * N + i0) * (long long)N + j;                              \
                const T *g = dO + (bh * N + i0) * (long long)d + c;                             \
                for (int i = i0; i < N; ++i, p += N, g += d)                                    \
                    acc = fmaf(TP_LOAD_##SUF(p, 0), TP_LOAD_##SUF(g, 0), acc);                  \
            }                                                                                   \
            TP_STORE_##SUF(dV, ((long long)kv * N + j) * (long long)d + c, acc);                \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* dP[bh, i, j] = sum_c dO[bh, i, c] * V[bh / group, j, c]; causal j > i: 0.                     \
   grid: x over key columns j, y over query rows i, z over batch*heads; block 16 x 16 */         \
extern "C" __global__ void dpKernel_##SUF(const T *__restrict__ dO, const T *__restrict__ V,   \
                                         float *__restrict__ dP, int BH, int N, int d,          \
                                         int causal, int group) {                               \
    const int col = blockIdx.x * blockDim.x + threadIdx.x;                                      \
    if (col >= N) return;                                                                       \
    for (int bh = blockIdx.z; bh < BH; bh += gridDim.z) {                                       \
        for (int row = blockIdx.y * blockDim.y + threadIdx.y; row < N;                          \
             row += gridDim.y * blockDim.y) {                                                   \
            const long long off = ((long long)bh * N + row) * (long long)N + col;               \
            if (causal && col > row) {                                                          \
                dP[off] = 0.0f;                                                                 \
                continue;                                                                       \
            }                                                                                   \
            const T *g = dO + ((long long)bh * N + row) * (long long)d;                        \
            const T *v = V + ((long long)(bh / group) * N + col) * (long long)d;               \
            float acc = 0.0f;                                                                   \
            for (int c = 0; c < d; ++c)                                                         \
                acc = fmaf(TP_LOAD_##SUF(g, c), TP_LOAD_##SUF(v, c), acc);                      \
            dP[off] = acc;                                                                      \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* D[r] = sum_c dO[r, c] * O[r, c] for each of the BH * N rows r, summed in dpKernel's order.    \
   grid: x over rows with a stride; one thread per row */                                       \
extern "C" __global__ void rowDotKernel_##SUF(const T *__restrict__ dO, const T *__restrict__ O,\
                                             float *__restrict__ D, long long rows, int d) {    \
    for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < rows;              \
         r += (long long)gridDim.x * blockDim.x) {                                              \
        const T *g = dO + r * (long long)d;                                                     \
        const T *o = O + r * (long long)d;                                                      \
        float acc = 0.0f;                                                                       \
        for (int c = 0; c < d; ++c)                                                             \
            acc = fmaf(TP_LOAD_##SUF(g, c), TP_LOAD_##SUF(o, c), acc);                          \
        D[r] = acc;                                                                             \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* dS[bh, i, j] = P[bh, i, j] * (dP[bh, i, j] - D[bh, i]); causal j > i: 0. dS may be dP itself  \
   (each thread reads and writes only its own entry), so neither is __restrict__.                \
   grid: x over key columns j, y over query rows i, z over batch*heads; block 16 x 16 */         \
extern "C" __global__ void dsKernel_##SUF(const T *__restrict__ P, const float *dP,            \
                                         const float *__restrict__ D, float *dS, int BH, int N, \
                                         int causal) {                                          \
    const int col = blockIdx.x * blockDim.x + threadIdx.x;                                      \
    if (col >= N) return;                                                                       \
    for (int bh = blockIdx.z; bh < BH; bh += gridDim.z) {                                       \
        for (int row = blockIdx.y * blockDim.y + threadIdx.y; row < N;                          \
             row += gridDim.y * blockDim.y) {                                                   \
            const long long r = (long long)bh * N + row;                                        \
            const long long off = r * (long long)N + col;                                       \
            const float ds = (causal && col > row) ? 0.0f                                       \
                                                   : TP_LOAD_##SUF(P, off) * (dP[off] - D[r]);  \
            dS[off] = ds;                                                                       \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* dQ[bh, i, c] = scale * sum_{j (causal: j <= i)} dS[bh, i, j] * K[bh / group, j, c].           \
   grid: x over head-dim columns, y over query rows, z over batch*heads (as pvKernel) */          \
extern "C" __global__ void dqKernel_##SUF(const float *__restrict__ dS, const T *__restrict__ K,\
                                         T *__restrict__ dQ, int BH, int N, int d, float scale, \
                                         int causal, int group) {                               \
    const int c = blockIdx.x * blockDim.x + threadIdx.x;                                        \
    if (c >= d) return;                                                                         \
    for (int bh = blockIdx.z; bh < BH; bh += gridDim.z) {                                       \
        for (int row = blockIdx.y * blockDim.y + threadIdx.y; row < N;                          \
             row += gridDim.y * blockDim.y) {                                                   \
            const float *s = dS + ((long long)bh * N + row) * (long long)N;                    \
            const T *k = K + (long long)(bh / group) * N * (long long)d + c;                    \
            const int len = causal ? row + 1 : N;                                               \
            float acc = 0.0f;                                                                   \
            for (int j = 0; j < len; ++j, k += d)                                               \
                acc = fmaf(s[j], TP_LOAD_##SUF(k, 0), acc);                                     \
            TP_STORE_##SUF(dQ, ((long long)bh * N + row) * (long long)d + c, acc * scale);      \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* dK[kv, j, c] = scale * sum over the group's query heads bh, over rows i (causal: i >= j) of   \
   dS[bh, i, j] * Q[bh, i, c].  grid and block as dvKernel */                                   \
extern "C" __global__ void dkKernel_##SUF(const float *__restrict__ dS, const T *__restrict__ Q,\
                                         T *__restrict__ dK, int BKV, int N, int d, float scale,\
                                         int causal, int group) {                               \
    const int c = blockIdx.x * blockDim.x + threadIdx.x;                                        \
    if (c >= d) return;                                                                         \
    for (int kv = blockIdx.z; kv < BKV; kv += gridDim.z) {                                      \
        for (int j = blockIdx.y * blockDim.y + threadIdx.y; j < N;                              \
             j += gridDim.y * blockDim.y) {                                                     \
            const int i0 = causal ? j : 0;                                                      \
            float acc = 0.0f;                                                                   \
            for (int t = 0; t < group; ++t) {                                                   \
                const long long bh = (long long)kv * group + t;                                 \
                const float *s = dS + (bh * N + i0) * (long long)N + j;                         \
                const T *q = Q + (bh * N + i0) * (long long)d + c;                              \
                for (int i = i0; i < N; ++i, s += N, q += d)                                    \
                    acc = fmaf(s[0], TP_LOAD_##SUF(q, 0), acc);                                 \
            }                                                                                   \
            TP_STORE_##SUF(dK, ((long long)kv * N + j) * (long long)d + c, acc * scale);        \
        }                                                                                       \
    }                                                                                           \
}

TPATTN_DEFINE_NAIVE_BACKWARD(f16, tp_f16)
TPATTN_DEFINE_NAIVE_BACKWARD(bf16, tp_bf16)
TPATTN_DEFINE_NAIVE_BACKWARD(f32, float)
