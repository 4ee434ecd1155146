"""Run under mpirun by tests/test_uneven_mpi.py: uneven heads (issue #17) through the Python API.

Every rank builds the same torch.nn.MultiheadAttention (same seed) with H heads that the world size
W does not divide (W = 8: H = 28, W = 4: H = 6, W = 2: H = 5, W = 3: H = 7), keeps its block of
ceil/floor(H/W) heads through TensorParallelAttention.from_multihead_attention(..., uneven_heads=True)
and compares the collective's output with the unsharded module's: causal and not, head-parallel with
either output collective, overlapped, sequence-parallel. Then grouped-query attention through
from_linears: G = W + 1 groups of 2 query heads (ranks own whole groups), and G = W - 1 refused.
Without uneven_heads the same module is refused, naming the flag. One mpirun covers them all.
Prints 'UNEVEN API PASS rank R of W: C configs, heads N, err E' and exits 0, or exits 1.
"""

import torch

from tpattn.dist import exit_now, init_distributed
from tpattn.layer import TensorParallelAttention
from tpattn.sharding import head_counts

from gqa_module import GQAModule  # noqa: E402  (this folder is sys.path[0] under mpirun)

proc = init_distributed(backend="gloo", timeout=60)
W, R = proc.world, proc.rank
H = {8: 28, 4: 6, 2: 5, 3: 7}.get(W, 2 * W + 1)
d, B, N = 4, 2, 24  # N divides by 2, 3, 4 and 8: sequence parallel at every W
torch.manual_seed(0)
mha = torch.nn.MultiheadAttention(H * d, H, batch_first=True)
with torch.no_grad():
    mha.in_proj_bias.normal_(0, 0.1)
    mha.out_proj.bias.normal_(0, 0.1)
x = torch.randn(B, N, H * d)
mask = torch.ones(N, N, dtype=torch.bool).triu(1)
errs, configs = [], 0

# without the flag: refused on every rank, the line names the flag (W > 1 does not divide H)
if W > 1:
    try:
        TensorParallelAttention.from_multihead_attention(mha, backend="reference")
        raise AssertionError(f"{H} heads over {W} ranks were not refused")
    except ValueError as exc:
        assert "uneven_heads=True" in str(exc) and f"heads={H} is not divisible by world size {W}" in str(exc), exc

for kw in ({"causal": False}, {"causal": True}, {"causal": True, "output_collective": "split"},
           {"causal": False, "overlap": 3}, {"causal": True, "sequence_parallel": True},
           {"causal": False, "sequence_parallel": True, "overlap": 3 if N // W % 3 == 0 else 1}):
    layer = TensorParallelAttention.from_multihead_attention(mha, backend="reference", uneven_heads=True, **kw)
    assert layer.local_heads == head_counts(H, W)[R], (layer.local_heads, head_counts(H, W))
    sp = kw.get("sequence_parallel", False)
    with torch.no_grad():
        y = layer.gather_sequence(layer(layer.shard_sequence(x))) if sp else layer(x)
        ref, _ = mha(x, x, x, need_weights=False, attn_mask=mask if kw["causal"] else None)
    errs.append((y - ref).abs().max().item())
    configs += 1


# GQA: G = W + 1 K/V groups of 2 query heads: the first rank owns 2 whole groups, the others 1
G = W + 1
torch.manual_seed(G)
m = GQAModule(2 * G * d, 2 * G, G)
xg = torch.randn(B, N, 2 * G * d)
for kw in ({"causal": False}, {"causal": True, "sequence_parallel": True}):
    layer = TensorParallelAttention.from_linears(m.q_proj, m.k_proj, m.v_proj, m.o_proj, heads=2 * G,
                                                 uneven_heads=True, **kw)
    assert layer.local_kv_heads == head_counts(G, W)[R] and layer.local_heads == 2 * layer.local_kv_heads
    sp = kw.get("sequence_parallel", False)
    with torch.no_grad():
        y = layer.gather_sequence(layer(layer.shard_sequence(xg))) if sp else layer(xg)
        ref = m(xg, kw["causal"])
    errs.append((y - ref).abs().max().item())
    configs += 1
# G = W - 1 groups of 3: fewer groups than ranks, so a rank would hold part of a group: refused
if W > 2:
    m = GQAModule(3 * (W - 1) * d, 3 * (W - 1), W - 1)
    try:
        TensorParallelAttention.from_linears(m.q_proj, m.k_proj, m.v_proj, m.o_proj, heads=3 * (W - 1),
                                             uneven_heads=True)
        raise AssertionError(f"G = {W - 1} over {W} ranks was not refused")
    except ValueError as exc:
        assert f"is more than the {W - 1} groups" in str(exc), exc

ok = max(errs) < 1e-5 and configs == 8
print(f"UNEVEN API {'PASS' if ok else 'FAIL'} rank {R} of {W}: {configs} configs, heads {H}, "
      f"local {head_counts(H, W)[R]}, err {max(errs):.2e}", flush=True)
torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
exit_now(0 if ok else 1)  # not sys.exit: see tpattn.dist.exit_now
