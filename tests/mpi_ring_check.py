"""Run under mpirun -n 2, 3 or 4 by tests/test_ring.py (CPU, gloo): context parallelism, the ring
(TensorParallelAttention(..., context_parallel=C), tpattn/comm.py's ring pair) against the
single-process layer in float64: the output of this rank's rows, x's gradient and every weight's
(summed over the ring), causal and not, multi-head and grouped-query, with and without rotary
positions; gather_context; a cache refused. Prints 'RING PASS rank R' and exits 0, or what failed."""

import torch

from tpattn.dist import exit_now, init_distributed
from tpattn.errors import ConfigError
from tpattn.layer import TensorParallelAttention

proc = init_distributed(backend="gloo", timeout=60)
C, R = proc.world, proc.rank
bad = []
E, H, d, B = 32, 4, 8, 2
N = 4 * C  # two chunks of 2 rows per rank

for G, causal, rope in ((4, True, None), (4, False, 1e4), (2, True, 1e4), (1, True, None)):
    torch.manual_seed(0)
    full = {"wq": torch.randn(E, H * d), "wk": torch.randn(E, G * d), "wv": torch.randn(E, G * d),
            "wo": torch.randn(H * d, E), "bq": torch.randn(H * d), "bk": torch.randn(G * d), "bv": torch.randn(G * d),
            "bo": torch.randn(E)}
    full = {k: (v / 4).double() for k, v in full.items()}
    x = torch.randn(B, N, E, dtype=torch.float64)
    dy = torch.randn(B, N, E, dtype=torch.float64)
    kw = dict(heads=H, kv_heads=G, causal=causal, rope_theta=rope)
    single = TensorParallelAttention.from_full(**full, group=None, **kw)
    xs = x.clone().requires_grad_()
    ys = single(xs)
    (ys * dy).sum().backward()
    ring = TensorParallelAttention.from_full(**full, context_parallel=C, **kw)
    xr = ring.shard_context(x).requires_grad_()
    yr = ring(xr)
    (yr * ring.shard_context(dy)).sum().backward()
    what = f"G={G} causal={causal} rope={rope}"
    if not torch.allclose(yr, ring.shard_context(ys.detach()), atol=1e-10):
        bad.append(f"{what}: y differs by {(yr - ring.shard_context(ys.detach())).abs().max():.2e}")
    if not torch.allclose(xr.grad, ring.shard_context(xs.grad), atol=1e-10):
        bad.append(f"{what}: x.grad differs by {(xr.grad - ring.shard_context(xs.grad)).abs().max():.2e}")
    for name, p in ring.named_parameters():
        want = dict(single.named_parameters())[name].grad
        if not torch.allclose(p.grad, want, atol=1e-9):
            bad.append(f"{what}: the gradient of {name} differs by {(p.grad - want).abs().max():.2e}")
    with torch.no_grad():
        if not torch.allclose(ring.gather_context(ring(ring.shard_context(x))), ys.detach(), atol=1e-10):
            bad.append(f"{what}: gather_context of the rows is not the single-process y")

try:
    with torch.no_grad():
        ring(ring.shard_context(x), cache=object())
    said = "no error"
except ConfigError as exc:
    said = str(exc)
if "a KV cache decodes head-parallel" not in said:
    bad.append(f"a cache with context parallelism: {said}")

for b in bad:
    print(f"rank {R}: FAIL {b}", flush=True)
if not bad:
    print(f"RING PASS rank {R}", flush=True)
exit_now(1 if bad else 0)
