"""Run under mpirun -n 3 by tests/test_layer_api.py: what the layer's Python API refuses and keeps,
on every rank alike. Prints 'LAYER-API PASS rank R' and exits 0, or prints what failed and exits 1."""

import torch

from tpattn.commplan import make_plan
from tpattn.dist import exit_now, init_distributed
from tpattn.errors import ConfigError
from tpattn.layer import TensorParallelAttention

proc = init_distributed(backend="gloo", timeout=60)
W, R = proc.world, proc.rank
torch.manual_seed(0)
E, H = 24, 6
mha = torch.nn.MultiheadAttention(E, H, batch_first=True)
bad = []


def refused(fn, says: str) -> None:
    try:
        fn()
    except (ValueError, ConfigError) as exc:
        if says not in str(exc):
            bad.append(f"refused with {exc!r}, expected {says!r}")
        return
    bad.append(f"not refused: expected {says!r}")


# a layer built differently on one rank: the same line on every rank, not wrong outputs or a hang
full = [torch.randn(E, E) for _ in range(4)]
refused(lambda: TensorParallelAttention.from_full(*full, heads=6 if R != 1 else 3),
        "the ranks built this layer differently (heads: rank 0 has 6, rank 1 has 3; head_dim: rank 0 has 4")
refused(lambda: TensorParallelAttention.from_full(*full, heads=6, causal=R == 2),
        "the ranks built this layer differently (causal: rank 0 has False, rank 2 has True)")
# a rank whose own checks fail: its line there, the same failure named on the others (not a wait)
mine = [torch.randn(E, 8), torch.randn(E, 8), torch.randn(E, 8), torch.randn(8, E)]
refused(lambda: TensorParallelAttention(*mine, heads=6, head_dim=4, causal=True,
                                        rope_theta=float("nan") if R == 1 else 10000.0),
        "rope_theta=nan with head_dim=4" if R == 1 else "rank 1 refused this layer: rope_theta=nan with head_dim=4")
# full weights that do not fit on one rank only (from_full's own checks): the same exchange
refused(lambda: TensorParallelAttention.from_full(*full, torch.randn(E + 1 if R == 2 else E), heads=6),
        "bq has shape (25,), expected (24,)" if R == 2 else "rank 2 refused this layer: bq has shape (25,)")
# K/V heads that only one rank's weights contradict (kv_heads=3 given, rank 1's wk and wv hold 1 head)
kv = E // 6 * (1 if R == 1 else 3)
refused(lambda: TensorParallelAttention.from_full(full[0], torch.randn(E, kv), torch.randn(E, kv), full[3], heads=6,
                                                  kv_heads=3),
        "kv_heads=3 but wk and wv have 1 heads" if R == 1 else "rank 1 refused this layer: kv_heads=3 but wk and wv")
# rows lost without a word: N = 10 over 3 ranks used to give every rank 3 rows and drop row 9
sp = TensorParallelAttention.from_multihead_attention(mha, sequence_parallel=True)
refused(lambda: sp.shard_sequence(torch.randn(1, 10, E)),
        f"sequence_parallel=True needs the rows of x (x.shape[1]) divisible by the world size {W} (got 10)")
# an option accepted and ignored: the CLI refuses the pair, so does the API, with the same line
refused(lambda: TensorParallelAttention.from_multihead_attention(mha, sequence_parallel=True,
                                                                  output_collective="allreduce"),
        "output_collective='allreduce' is for the head-parallel style")
# the collective a call runs depends on the shape and settings, never on the attention backend (head dim
# 32: one the fused kernels take, since a layer refuses at construction a head dim its backend cannot run)
mha32 = torch.nn.MultiheadAttention(H * 32, H, batch_first=True)
for kw in ({"overlap": 4}, {"overlap": 3}, {}):
    plans = {b: TensorParallelAttention.from_multihead_attention(mha32, backend=b, **kw).plan(1, 1000)
             for b in ("reference", "fused")}
    if plans["reference"] != plans["fused"]:
        bad.append(f"{kw}: the reference and fused backends plan differently: {plans}")
    want = make_plan(1, 1000, H * 32, W, elem=4, part_elem=4, **kw)
    if plans["reference"] != want:
        bad.append(f"{kw}: the layer's plan {plans['reference']} is not make_plan's {want}")
# the weights are module state: parameters, state_dict, trainable after from_*, loading another shard refused
layer = TensorParallelAttention.from_multihead_attention(mha)
names = sorted(n for n, _ in layer.named_parameters())
if names != ["bo", "bqkv", "wo", "wqkv"] or not all(p.requires_grad for p in layer.parameters()):
    bad.append(f"parameters: {names}")
state = layer.state_dict()
if set(state) != {"wqkv", "bqkv", "wo", "bo", "_extra_state"} or state["_extra_state"]["rank"] != R:
    bad.append(f"state_dict keys {sorted(state)}")
others = [None] * W
torch.distributed.all_gather_object(others, state)
if W > 1:
    refused(lambda: layer.load_state_dict(others[(R + 1) % W]), f"this checkpoint holds rank {(R + 1) % W} of {W}")
fresh = TensorParallelAttention.from_multihead_attention(torch.nn.MultiheadAttention(E, H, batch_first=True))
fresh.load_state_dict(state)
x = torch.randn(2, 9, E)
with torch.no_grad():
    if not torch.equal(fresh(x), layer(x)):
        bad.append("a layer loaded from state_dict() computes another output")
if bad:
    print(f"LAYER-API FAIL rank {R}: " + "; ".join(bad), flush=True)
else:
    print(f"LAYER-API PASS rank {R} of {W}", flush=True)
torch.distributed.destroy_process_group()
exit_now(1 if bad else 0)
