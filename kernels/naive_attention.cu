// naive_attention.cu -- the seed's three-pass attention, kept naive on purpose.
//
//   qkKernel       S = Q K^T * scale     one thread per score          (writes S, N x N per head)
//   softmaxKernel  P = softmax(S)        one block per row: max, sum of exp(x - max), normalize
//   pvKernel       O = P V               one thread per output element (reads P, writes O)
//
// Layout: Q and O are [BH, N, d], K and V are [BH / group, N, d] and S, P are [BH, N, N], all
// contiguous, BH = batch * heads. Grouped-query attention: group query heads share one K/V head
// (group = 1: multi-head attention; group = heads: multi-query); query head bh reads K/V head
// bh / group, which is b * (heads / group) + h / group for bh = b * heads + h. K and V are never
// repeated in memory: the query heads of a group read the same rows.
// Storage is the suffix's type (f16, bf16 or f32); every sum is accumulated in float.
// Causal: scores with key index > query index do not contribute (S holds -inf there, P holds 0).
//
// Rules kept here: every offset that can reach N^2 is 64-bit (row pointers are formed with 64-bit
// products, and the inner loops walk pointers, which also keeps 64-bit multiplies out of them); grids loop with a stride so no
// launch needs more than the hardware's grid limits; the file needs no header at all, so NVRTC
// (which has no <math.h>, no INFINITY) and nvcc compile it the same way. Conversions to and
// from half and bfloat16 are written out (round to nearest even, like torch).
//
// This is the baseline every faster kernel is measured against: do not optimize it in place.

#define TPATTN_NEG_INF __int_as_float(0xff800000)

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
// bfloat16 is a distinct type name only for overloading; both are unsigned short, so the
// bf16 kernels use these explicitly named helpers.
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

#define SOFTMAX_THREADS 256

#define TPATTN_DEFINE_NAIVE(SUF, T)                                                            \
/* grid: x over key columns, y over query rows, z over batch*heads; block 16 x 16 */            \
extern "C" __global__ void qkKernel_##SUF(const T *__restrict__ Q, const T *__restrict__ K,    \
                                         T *__restrict__ S, int BH, int N, int d, float scale, \
                                         int causal, int group) {                               \
    const int col = blockIdx.x * blockDim.x + threadIdx.x;                                      \
    if (col >= N) return;                                                                       \
    for (int bh = blockIdx.z; bh < BH; bh += gridDim.z) {                                       \
        for (int row = blockIdx.y * blockDim.y + threadIdx.y; row < N;                          \
             row += gridDim.y * blockDim.y) {                                                   \
            const long long s_off = ((long long)bh * N + row) * (long long)N + col;             \
            if (causal && col > row) {                                                          \
                TP_STORE_##SUF(S, s_off, TPATTN_NEG_INF);                                       \
                continue;                                                                       \
            }                                                                                   \
            const T *q = Q + ((long long)bh * N + row) * (long long)d;                         \
            const T *k = K + ((long long)(bh / group) * N + col) * (long long)d;               \
            float acc = 0.0f;                                                                   \
            for (int i = 0; i < d; ++i)                                                         \
                acc = fmaf(TP_LOAD_##SUF(q, i), TP_LOAD_##SUF(k, i), acc);                      \
            TP_STORE_##SUF(S, s_off, acc * scale);                                              \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* grid: x over rows (all BH * N of them, with a stride); block SOFTMAX_THREADS */              \
extern "C" __global__ void softmaxKernel_##SUF(const T *__restrict__ S, T *__restrict__ P,     \
                                              long long rows, int N, int causal) {              \
    __shared__ float red[SOFTMAX_THREADS];                                                      \
    const int tid = threadIdx.x;                                                                \
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {                                  \
        const long long off = r * (long long)N;                                                 \
        /* with causal masking, row i of a head sees keys 0..i */                               \
        const int len = causal ? (int)(r % N) + 1 : N;                                          \
        float m = TPATTN_NEG_INF;                                                               \
        for (int j = tid; j < len; j += blockDim.x) m = fmaxf(m, TP_LOAD_##SUF(S, off + j));   \
        red[tid] = m;                                                                           \
        __syncthreads();                                                                        \
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {                                          \
            if (tid < s) red[tid] = fmaxf(red[tid], red[tid + s]);                              \
            __syncthreads();                                                                    \
        }                                                                                       \
        const float row_max = red[0];                                                           \
        __syncthreads();                                                                        \
        float sum = 0.0f;                                                                       \
        for (int j = tid; j < len; j += blockDim.x)                                             \
            sum += expf(TP_LOAD_##SUF(S, off + j) - row_max);                                 \
        red[tid] = sum;                                                                         \
        __syncthreads();                                                                        \
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {                                          \
            if (tid < s) red[tid] += red[tid + s];                                              \
            __syncthreads();                                                                    \
        }                                                                                       \
        const float inv = 1.0f / red[0];                                                        \
        __syncthreads();                                                                        \
        for (int j = tid; j < N; j += blockDim.x) {                                             \
            const float p = j < len ? expf(TP_LOAD_##SUF(S, off + j) - row_max) * inv : 0.0f; \
            TP_STORE_##SUF(P, off + j, p);                                                      \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* grid: x over head-dim columns, y over query rows, z over batch*heads; the block's x spans   \
   the head dim (up to 128) so the warps of one row share its P reads in L1 */                   \
extern "C" __global__ void pvKernel_##SUF(const T *__restrict__ P, const T *__restrict__ V,    \
                                         T *__restrict__ O, int BH, int N, int d, int causal,   \
                                         int group) {                                           \
    const int c = blockIdx.x * blockDim.x + threadIdx.x;                                        \
    if (c >= d) return;                                                                         \
    for (int bh = blockIdx.z; bh < BH; bh += gridDim.z) {                                       \
        for (int row = blockIdx.y * blockDim.y + threadIdx.y; row < N;                          \
             row += gridDim.y * blockDim.y) {                                                   \
            const T *p = P + ((long long)bh * N + row) * (long long)N;                         \
            const T *v = V + (long long)(bh / group) * N * (long long)d + c;                    \
            const int len = causal ? row + 1 : N;                                               \
            float acc = 0.0f;                                                                   \
            for (int j = 0; j < len; ++j, v += d)                                               \
                acc = fmaf(TP_LOAD_##SUF(p, j), TP_LOAD_##SUF(v, 0), acc);                      \
            TP_STORE_##SUF(O, ((long long)bh * N + row) * (long long)d + c, acc);               \
        }                                                                                       \
    }                                                                                           \
}

TPATTN_DEFINE_NAIVE(f16, tp_f16)
TPATTN_DEFINE_NAIVE(bf16, tp_bf16)
TPATTN_DEFINE_NAIVE(f32, float)
