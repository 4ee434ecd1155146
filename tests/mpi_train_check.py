"""Run under mpirun by tests/test_train_mpi.py: the layer's backward over W ranks against float64
autograd of the single-process math, for every style the layer has. Every rank builds the same
full weights (same seed), keeps its slice (from_full), runs forward and backward with the same dy,
and compares x.grad (head-parallel: the whole dX on every rank; sequence parallel: this rank's
block) and full_grads() with torch autograd of plain float64 attention with the full weights.
Accumulation: two backward calls give twice the gradients. Prints 'TRAIN PASS rank R n N' and
exits 0, or prints the failures and exits 1.

    python tests/mpi_train_check.py                          CPU, float64, the reference backend
    python tests/mpi_train_check.py BACKEND DTYPE [nccl]     the GPU (tests/test_gpu_train.py): BACKEND
        (naive, fused, triton) in DTYPE (fp16, bf16) over gloo (ranks may share a GPU) or nccl (one GPU
        a rank); the weights, x and dy rounded to DTYPE, the float64 math from the rounded values, each
        gradient within check.TOL_FLOAT64 x its rms (plus an epsilon of each element's own size)"""

import math
import sys

import torch

from tpattn.check import TOL_FLOAT64, compare
from tpattn.dist import exit_now, init_distributed
from tpattn.errors import ConfigError
from tpattn.layer import TensorParallelAttention

GPU = len(sys.argv) > 1
BACKEND, DTYPE = (sys.argv[1], sys.argv[2]) if GPU else ("reference", "fp64")
proc = init_distributed(backend=sys.argv[3] if len(sys.argv) > 3 else "gloo", timeout=120)
W, R = proc.world, proc.rank
DEV = proc.device if GPU else torch.device("cpu")
LOW = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}[DTYPE]
B, N, d = (2, 96, 64) if GPU else (2, 12, 4)
bad, ran = [], 0


def reference(x, w, H, G, causal):
    """y of plain float64 attention with the full weights (autograd leaves)."""
    D = x.shape[-1]
    q = (x @ w["wq"] + w["bq"]).view(B, N, H, d).transpose(1, 2)
    k = (x @ w["wk"] + w["bk"]).view(B, N, G, d).transpose(1, 2).repeat_interleave(H // G, dim=1)
    v = (x @ w["wv"] + w["bv"]).view(B, N, G, d).transpose(1, 2).repeat_interleave(H // G, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    if causal:
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    o = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, N, H * d)
    return o @ w["wo"] + w["bo"]


def close(name, got, want, tol=1e-9, scale=None):
    """CPU: |got - want| <= tol x max(1, max |want|). GPU: compare() against the float64 math (scale: the
    rms to hold the error to instead of want's own, for b_k's gradient, which is 0 in exact arithmetic)."""
    if GPU:
        c = compare(got, want, TOL_FLOAT64[DTYPE], ulp_of=LOW)
        ok = c["pass"] if scale is None else c["max_abs_err"] <= TOL_FLOAT64[DTYPE] * scale
        if not ok:
            bad.append(f"{name}: max err {c['max_abs_err']:.3g} = {c['rel_err']:.3g} x rms")
        return
    err = (got.double() - want).abs().max().item()
    if not err <= tol * max(1.0, want.abs().max().item()):
        bad.append(f"{name}: max err {err:.3g}")


configs = []
M = 2 if W > 4 else 1  # GPU: 4 heads a layer, 8 past four ranks (a rank holds at least one)
for H, G in ((4 * M, 4 * M), (4 * M, 2 * M), (4 * M, M)) if GPU else ((8, 8), (8, 4), (8, 2), (8, 1), (12, 12), (12, 3), (6, 6)):
    for causal in (False, True):
        for sp in (False, True):
            for overlap in (1, 2):
                configs.append(dict(H=H, G=G, causal=causal, sp=sp, overlap=overlap, uneven=False))
configs += [dict(H=5, G=5, causal=True, sp=False, overlap=1, uneven=True),
            dict(H=6, G=3, causal=False, sp=True, overlap=1, uneven=True)]
for c in configs:
    H, G = c["H"], c["G"]
    g = torch.Generator().manual_seed(H * 100 + G)
    D = H * d
    w_scale = 0.3 if not GPU else 1.0 / math.sqrt(D)  # GPU: unit-sized activations in 16 bits
    # the rounded values are the problem's: the float64 math starts from them
    full = {k: (torch.randn(*s, generator=g, dtype=torch.float64) * w_scale).to(LOW).to(DEV, torch.float64) for k, s in
            dict(wq=(D, H * d), wk=(D, G * d), wv=(D, G * d), wo=(H * d, D), bq=(H * d,), bk=(G * d,), bv=(G * d,),
                 bo=(D,)).items()}
    x = torch.randn(B, N, D, generator=g, dtype=torch.float64).to(LOW).to(DEV, torch.float64)
    dy = torch.randn(B, N, D, generator=g, dtype=torch.float64).to(LOW).to(DEV, torch.float64)
    try:
        layer = TensorParallelAttention.from_full(**{k: t.to(LOW) for k, t in full.items()}, heads=H,
                                                  causal=c["causal"], sequence_parallel=c["sp"],
                                                  overlap=c["overlap"], uneven_heads=c["uneven"], backend=BACKEND)
        mine_x = (layer.shard_sequence(x) if c["sp"] else x).to(LOW).clone().requires_grad_(True)
        mine_dy = (layer.shard_sequence(dy) if c["sp"] else dy).to(LOW)
        for _ in range(2):  # the gradients accumulate
            layer(mine_x).backward(mine_dy)
    except (ConfigError, ValueError) as exc:  # a world size this layout cannot take: every rank alike
        if "rank" in str(exc) and "outside" in str(exc):
            bad.append(f"{c}: {exc}")
        continue
    ran += 1
    leaves = {k: t.clone().requires_grad_(True) for k, t in full.items()}
    xr = x.clone().requires_grad_(True)
    reference(xr, leaves, H, G, c["causal"]).backward(dy)
    want_x = layer.shard_sequence(xr.grad) if c["sp"] else xr.grad
    close(f"{c} x.grad", mine_x.grad, 2 * want_x)
    got = layer.full_grads()
    for k in full:
        scale = (2 * leaves["bq"].grad).pow(2).mean().sqrt().item() if k == "bk" else None
        close(f"{c} {k}", got[k], 2 * leaves[k].grad, scale=scale)
    layer.zero_grad()
    if any(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters()):
        bad.append(f"{c}: zero_grad left gradients")
if bad:
    print(f"TRAIN FAIL rank {R}: " + "; ".join(bad[:6]), flush=True)
else:
    print(f"TRAIN PASS rank {R} of {W} ran {ran} of {len(configs)} ({BACKEND}, {DTYPE}, {DEV.type})", flush=True)
torch.distributed.destroy_process_group()
exit_now(1 if bad else 0)
