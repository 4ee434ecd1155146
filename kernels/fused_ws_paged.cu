// fused_ws_paged.cu -- fusedw (fused_ws_attention.cu) reading K and V through a paged pool's block
// table (tpattn/paged.py's prefills: no gather of the sequence's pages first), at head dims 64 and 128,
// in a module of its own (tpattn/attention/fused.py: WS_PAGED_SOURCE) so that the other modules compile
// no more kernels than they did.
#define TW_PAGED
#include "fused_ws_attention.cu"
