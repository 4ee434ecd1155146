"""Run under mpirun -n 2, 3 or 4 by tests/test_ring.py (CPU, gloo): context parallelism, the ring
(TensorParallelAttention(..., context_parallel=C), tpattn/comm.py's ring pair), over all ranks and,
at 4 ranks, as rings of 2 beside heads split over 2 ranks, against the single-process layer in
float64: the output of this rank's rows, x's gradient and every weight's
(summed over the ring), causal and not, multi-head and grouped-query, with and without rotary
positions; gather_context; a cache, an FP8 backend, overlap and graphed() refused. Prints 'RING PASS rank R' and exits 0, or what failed.
Argument: the device (default cpu; cuda: the ranks share GPU 0 over gloo, tests/test_gpu_ring.py)."""

import sys

import torch

from tpattn.dist import exit_now, init_distributed
from tpattn.errors import ConfigError
from tpattn.layer import TensorParallelAttention

proc = init_distributed(backend="gloo", timeout=60)
C, R = proc.world, proc.rank
bad = []
dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
E, H, d, B = 32, 4, 8, 2
N = 4 * C  # two chunks of 2 rows per rank (at C = 4; twice that at context_parallel=2)

cases = [(C, G, causal, rope) for G, causal, rope in ((4, True, None), (4, False, 1e4), (2, True, 1e4), (1, True, None))]
if C == 4:  # heads over 2 ranks beside rings of 2: W = 2 x 2
    cases += [(2, G, causal, rope) for G, causal, rope in ((4, True, 1e4), (2, False, None), (1, True, 1e4))]
for cp, G, causal, rope in cases:
    torch.manual_seed(0)
    full = {"wq": torch.randn(E, H * d), "wk": torch.randn(E, G * d), "wv": torch.randn(E, G * d),
            "wo": torch.randn(H * d, E), "bq": torch.randn(H * d), "bk": torch.randn(G * d), "bv": torch.randn(G * d),
            "bo": torch.randn(E)}
    full = {k: (v / 4).double().to(dev) for k, v in full.items()}
    x = torch.randn(B, N, E, dtype=torch.float64).to(dev)
    dy = torch.randn(B, N, E, dtype=torch.float64).to(dev)
    kw = dict(heads=H, kv_heads=G, causal=causal, rope_theta=rope)
    single = TensorParallelAttention.from_full(**full, group=None, **kw)
    xs = x.clone().requires_grad_()
    ys = single(xs)
    (ys * dy).sum().backward()
    ring = TensorParallelAttention.from_full(**full, context_parallel=cp, **kw)
    xr = ring.shard_context(x).requires_grad_()
    yr = ring(xr)
    (yr * ring.shard_context(dy)).sum().backward()
    what = f"C={cp} G={G} causal={causal} rope={rope}"
    if not torch.allclose(yr, ring.shard_context(ys.detach()), atol=1e-10):
        bad.append(f"{what}: y differs by {(yr - ring.shard_context(ys.detach())).abs().max():.2e}")
    if not torch.allclose(xr.grad, ring.shard_context(xs.grad), atol=1e-10):
        bad.append(f"{what}: x.grad differs by {(xr.grad - ring.shard_context(xs.grad)).abs().max():.2e}")
    got, want = ring.full_grads(), single.full_grads()
    for name, g in want.items():
        if g is not None and not torch.allclose(got[name], g, atol=1e-9):
            bad.append(f"{what}: the gradient of {name} differs by {(got[name] - g).abs().max():.2e}")
    if ring.local_heads != H * cp // C:
        bad.append(f"{what}: rank {R} holds {ring.local_heads} heads")
    with torch.no_grad():
        if not torch.allclose(ring.gather_context(ring(ring.shard_context(x))), ys.detach(), atol=1e-10):
            bad.append(f"{what}: gather_context of the rows is not the single-process y")


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().pow(2).mean().sqrt()).item()


if dev.type == "cuda":  # the pieces through the fused kernels (fp16, bf16), against float64
    E2, H2 = 256, 4
    # chunks of 96 rows: partial tiles (each piece's dQ added); of 128: the kernels' dQ sum over the pieces
    for dt, G, causal, m, d2 in ((torch.float16, 4, True, 96, 64), (torch.bfloat16, 2, True, 96, 64),
                                 (torch.float16, 1, False, 96, 64), (torch.float16, 2, True, 128, 64),
                                 (torch.bfloat16, 2, True, 128, 128)):
        N2 = 2 * C * m
        torch.manual_seed(1)
        w2 = {"wq": torch.randn(E2, H2 * d2), "wk": torch.randn(E2, G * d2), "wv": torch.randn(E2, G * d2),
              "wo": torch.randn(H2 * d2, E2)}
        w2 = {k_: (t / E2 ** 0.5).to(dev).to(dt) for k_, t in w2.items()}
        x2, dy2 = torch.randn(2, N2, E2, device=dev).to(dt), torch.randn(2, N2, E2, device=dev).to(dt)
        kw = dict(heads=H2, kv_heads=G, causal=causal)
        ref = TensorParallelAttention.from_full(**{k_: t.double() for k_, t in w2.items()}, group=None, **kw)
        xs2 = x2.double().requires_grad_()
        ref(xs2).backward(dy2.double())
        fr = TensorParallelAttention.from_full(**w2, backend="fused", context_parallel=C, **kw)
        xr2 = fr.shard_context(x2).requires_grad_()
        yr2 = fr(xr2)
        yr2.backward(fr.shard_context(dy2))
        with torch.no_grad():
            ys2 = ref(x2.double())
        # the same layer in one process, in the same dtype: its own error against float64 is the yardstick
        sp = TensorParallelAttention.from_full(**w2, backend="fused", group=None, **kw)
        xsp = x2.clone().requires_grad_()
        ysp = sp(xsp)
        ysp.backward(dy2)
        got, want, own = fr.full_grads(), ref.full_grads(), sp.full_grads()
        what = f"fused {dt} C={C} G={G} causal={causal} chunks of {m} d={d2}"
        for name, a, b, c_ in [("y", yr2, ys2, ysp), ("x.grad", xr2.grad, xs2.grad, xsp.grad),
                               *((f"d{k_}", got[k_], want[k_], own[k_]) for k_ in ("wq", "wk", "wv", "wo"))]:
            if name in ("y", "x.grad"):  # this rank's rows
                b, c_ = fr.shard_context(b), fr.shard_context(c_)
            tol = 2 * rel(c_, b) + 2e-3  # FlashAttention's rule: twice the single process's error, plus rounding
            if not rel(a, b) <= tol:
                bad.append(f"{what}: {name} off by {rel(a, b):.3g} x rms (the single process {rel(c_, b):.3g})")

try:
    with torch.no_grad():
        ring(ring.shard_context(x), cache=object())
    said = "no error"
except ConfigError as exc:
    said = str(exc)
if "a KV cache decodes head-parallel" not in said:
    bad.append(f"a cache with context parallelism: {said}")

# refused on every rank, not run otherwise: an FP8 backend (the ring's pieces would be 16-bit torch
# math), overlap (the ring overlaps its own passes), a CUDA graph of the ring
from tpattn.attention.fp8 import Fp8Backend  # noqa: E402

w16 = {k: v.float() for k, v in full.items() if k in ("wq", "wk", "wv", "wo")}
G = w16["wk"].shape[1] // d  # the last case's K/V heads (on cuda the fused cases above took G for their own)
for kw, says in (({"backend": Fp8Backend()}, f"context_parallel={C} with an FP8 backend: the ring merges 16-bit"),
                 ({"overlap": 2}, f"context_parallel={C} with overlap=2: the ring overlaps its own passes")):
    try:
        TensorParallelAttention.from_full(**w16, heads=H, kv_heads=G, context_parallel=C, **kw)
        said = "no error"
    except ConfigError as exc:
        said = str(exc)
    if says not in said:
        bad.append(f"{kw}: {said}")
try:
    ring.graphed(ring.shard_context(x))
    said = "no error"
except ConfigError as exc:
    said = str(exc)
if f"graphed() with context_parallel={cp}: the ring's passes are not captured" not in said:
    bad.append(f"graphed() with a ring: {said}")

for b in bad:
    print(f"rank {R}: FAIL {b}", flush=True)
if not bad:
    print(f"RING PASS rank {R} ({dev.type})", flush=True)
exit_now(1 if bad else 0)
