"""Run under mpirun by tests/test_gqa_mpi.py: grouped-query attention through the Python API.

Every rank builds the same module with separate q/k/v/o projections (k and v with G*d outputs, as
Llama-style models have them; same seed everywhere), keeps its slice through
TensorParallelAttention.from_linears, and compares the collective's output with the unsharded
module's, for every K/V head count G that the world size allows (H = 8 and G in 8, 4, 2, 1; with 3
ranks H = 12 and G in 12, 6, 3, 1), causal and not, head-parallel, sequence-parallel and overlapped;
and checks that every other G is refused on every rank with the world sizes that work. One mpirun
covers them all. Prints 'GQA API PASS rank R of W: C configs, err E' and exits 0, or exits 1.
"""

import torch

from tpattn.dist import exit_now, init_distributed
from tpattn.layer import TensorParallelAttention
from tpattn.sharding import kv_world_sizes

from gqa_module import GQAModule  # noqa: E402  (this folder is sys.path[0] under mpirun)

proc = init_distributed(backend="gloo", timeout=60)
W = proc.world
H = 12 if W == 3 else 8
d, N, B = 6, 24, 2


errs, configs, refused = [], 0, 0
for G in [g for g in range(H, 0, -1) if H % g == 0]:
    torch.manual_seed(G)
    m = GQAModule(H * d, H, G)
    x = torch.randn(B, N, H * d)
    if W not in kv_world_sizes(H, G):  # refused, with the same line on every rank, before any collective
        try:
            TensorParallelAttention.from_linears(m.q_proj, m.k_proj, m.v_proj, m.o_proj, heads=H)
        except ValueError as exc:
            ok = ", ".join(map(str, kv_world_sizes(H, G)))
            assert f"{{{ok}}}" in str(exc), str(exc)
            refused += 1
            continue
        raise AssertionError(f"H={H} G={G} over {W} ranks was not refused")
    for kw in ({"causal": False}, {"causal": True}, {"causal": True, "sequence_parallel": True},
               {"causal": False, "overlap": 3}, {"causal": True, "output_collective": "split"}):
        layer = TensorParallelAttention.from_linears(m.q_proj, m.k_proj, m.v_proj, m.o_proj, heads=H, **kw)
        assert layer.kv_heads == G and layer.local_heads == H // W
        assert layer.local_kv_heads == (G // W if G % W == 0 else 1)
        with torch.no_grad():
            sp = kw.get("sequence_parallel", False)
            y = layer.gather_sequence(layer(layer.shard_sequence(x))) if sp else layer(x)
            ref = m(x, kw["causal"])
        errs.append((y - ref).abs().max().item())
        configs += 1
ok = max(errs) < 1e-5 and configs > 0
print(f"GQA API {'PASS' if ok else 'FAIL'} rank {proc.rank} of {W}: {configs} configs, {refused} refused, "
      f"err {max(errs):.2e}", flush=True)
torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
exit_now(0 if ok else 1)  # not sys.exit: see tpattn.dist.exit_now
