// decode_attention_dims.cu -- the decode kernels (decode_attention.cu) at the head dims other than 64
// and 128: the CUDA-core split (dec_split) at 32, 80, 96, 160, 192 and 256, contiguous and paged, in a
// module of their own (tpattn/decode.py: DEC_DIMS_SOURCE). The append kernels come along (small).
#define DEC_OTHER_DIMS
#include "decode_attention.cu"
