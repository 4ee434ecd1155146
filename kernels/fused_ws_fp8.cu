// fused_ws_fp8.cu -- fusedw (fused_ws_attention.cu) on e4m3 Q, K and V with their scales: the FP8
// forward at head dim 128 (tpattn/attention/fp8_ws.py), in a module of its own (ARCH_SPECIFIC: sm_90a)
// so that the other modules compile no more kernels than they did.
#define TW_FP8
#include "fused_ws_attention.cu"
