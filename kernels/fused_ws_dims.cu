// fused_ws_dims.cu -- fusedw (fused_ws_attention.cu) at the head dims other than 64 and 128, in a module
// of its own (tpattn/attention/fused.py: WS_DIMS_SOURCE), so that the 64/128 module compiles no more
// kernels than it did: 192 and 256 with key tiles of 64 keys, and 32, 80, 96 and 160 on the kernel of
// the next of 64, 128 and 192 (Q, K and V read with zeros past the head dim, O stored up to it).
#define TW_OTHER_DIMS
#include "fused_ws_attention.cu"
