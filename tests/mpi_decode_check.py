"""Run under mpirun by tests/test_decode.py: a Llama attention from transformers, tensor-parallel.

Every rank builds the same LlamaAttention (random weights from a LlamaConfig, the same seed; nothing
downloaded), keeps its slice (TensorParallelAttention.from_hf_llama), and compares with the module's
own output over the whole sequence: a forward over all rows, and a prefill of N rows followed by T
decode steps of one row through a KV cache. GQA with K/V heads split and replicated over the ranks.
Prints 'DECODE PASS rank R' and exits 0, or the failures and exit 1."""

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from tpattn.dist import exit_now, init_distributed
from tpattn.layer import TensorParallelAttention

proc = init_distributed(backend="gloo", timeout=120)
W, R = proc.world, proc.rank
bad, ran = [], 0
B, N, T = 2, 9, 6
for heads, kv, bias in ((8, 8, False), (8, 2, True), (8, 4, False), (4, 1, True)):
    torch.manual_seed(heads * 10 + kv)
    cfg = LlamaConfig(hidden_size=heads * 16, num_attention_heads=heads, num_key_value_heads=kv, head_dim=16,
                      rope_theta=10000.0, attention_bias=bias)
    cfg._attn_implementation = "sdpa"
    attn = LlamaAttention(cfg, 0).double()
    if bias:
        with torch.no_grad():
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                lin.bias.normal_(0, 0.1)
    x = torch.randn(B, N + T, heads * 16, dtype=torch.float64)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(N + T)[None].expand(B, -1))
    with torch.no_grad():
        ref, _ = attn(x, position_embeddings=(cos.to(x.dtype), sin.to(x.dtype)), attention_mask=None)
    try:
        layer = TensorParallelAttention.from_hf_llama(attn)
    except ValueError:  # a world size this layout cannot take (every rank alike)
        continue
    ran += 1
    with torch.no_grad():
        full = layer(x)
        cache = layer.new_cache(B, N + T)
        steps = [layer(x[:, :N], cache=cache)] + [layer(x[:, N + t:N + t + 1], cache=cache) for t in range(T)]
    for name, y in (("forward", full), ("prefill + decode", torch.cat(steps, 1))):
        err = (y - ref).abs().max().item()
        if not err < 1e-5:
            bad.append(f"H={heads} G={kv}: {name} max err {err:.3g}")
    if cache.length != N + T or cache.k.shape[1] != layer.local_kv_heads:
        bad.append(f"H={heads} G={kv}: cache length {cache.length}, {cache.k.shape[1]} K/V heads")
print(f"DECODE {'FAIL' if bad else 'PASS'} rank {R} of {W} ran {ran}: " + "; ".join(bad), flush=True)
torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
exit_now(1 if bad else 0)
