"""Run under mpirun by tests/test_mpi.py: the Python API against torch.nn.MultiheadAttention.

Every rank builds the same MultiheadAttention (same seed), keeps its slice through
TensorParallelAttention.from_multihead_attention, and compares the all-reduced output with the
unsharded module's. Prints 'API PASS rank R err E' and exits 0, or exits 1.
"""


import torch

from tpattn.dist import exit_now, init_distributed
from tpattn.layer import TensorParallelAttention

proc = init_distributed(backend="gloo", timeout=60)
torch.manual_seed(0)
E, H, N, B = 48, 12, 37, 2
mha = torch.nn.MultiheadAttention(E, H, batch_first=True)  # biases on, as by default
with torch.no_grad():
    mha.in_proj_bias.normal_(0, 0.1)
    mha.out_proj.bias.normal_(0, 0.1)
x = torch.randn(B, N, E)
mask = torch.ones(N, N, dtype=torch.bool).triu(1)
errs = []
for causal in (False, True):
    layer = TensorParallelAttention.from_multihead_attention(mha, backend="reference", causal=causal)
    assert layer.local_heads == H // proc.world
    with torch.no_grad():
        y = layer(x)
        ref, _ = mha(x, x, x, need_weights=False, attn_mask=mask if causal else None)
    errs.append((y - ref).abs().max().item())
# the second style through the API: each rank passes its block of the sequence and gets its block back
x2 = torch.randn(B, 36, E)
for kw in ({"sequence_parallel": True}, {"sequence_parallel": True, "overlap": 2}, {"overlap": 3}):
    layer = TensorParallelAttention.from_multihead_attention(mha, backend="reference", causal=True, **kw)
    if kw.get("overlap", 1) > 1 and kw.get("sequence_parallel") and (36 // proc.world) % kw["overlap"]:
        continue
    with torch.no_grad():
        mine = layer.shard_sequence(x2) if kw.get("sequence_parallel") else x2
        y = layer.gather_sequence(layer(mine)) if kw.get("sequence_parallel") else layer(mine)
        ref, _ = mha(x2, x2, x2, need_weights=False, attn_mask=torch.ones(36, 36, dtype=torch.bool).triu(1))
    errs.append((y - ref).abs().max().item())
# output_collective="p2p" or "oneshot" on CPU: every rank refuses with the same line before any buffer is
# made (both map GPU memory)
for how in ("p2p", "oneshot"):
    refused = []
    layer = TensorParallelAttention.from_multihead_attention(mha, backend="reference", output_collective=how)
    try:
        with torch.no_grad():
            layer(x)
    except ValueError as exc:
        refused.append(str(exc))
    if proc.world > 1 and not (len(refused) == 1 and f"output_collective='{how}': rank 0: it needs CUDA tensors" in
                               refused[0]):
        errs.append(float("inf"))
        print(f"{how} refusal missing or wrong: {refused}", flush=True)
ok = max(errs) < 1e-5
print(f"API {'PASS' if ok else 'FAIL'} rank {proc.rank} of {proc.world} err {max(errs):.2e}", flush=True)
torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
exit_now(0 if ok else 1)  # not sys.exit: see tpattn.dist.exit_now
