#!/usr/bin/env python3
"""The peer: the same attention layer written the way a PyTorch user would, timed and checked
against tpattn's in the same processes.

    mpirun -n W python scripts/peer_tp.py [python -m tpattn's shape/compute options] --json PATH

The peer is a plain nn.Module (four nn.Linear and F.scaled_dot_product_attention) split with
PyTorch's own tensor-parallel API: parallelize_module with ColwiseParallel for q, k and v (each
rank keeps the output features of its heads) and RowwiseParallel for o (each rank keeps the input
features of its heads; DTensor all-reduces the partial outputs). Its weights come from
tpattn.weights with the same seed as `python -m tpattn`, and tpattn's TensorParallelAttention is
built from the very same nn.Linear layers (from_linears) in the same process group, so both see
the same numbers. Each timed iteration runs the peer, then ours; rank 0 compares the outputs
(and the peer against float64 on sampled rows) and writes JSON:
{peer_ms, ours_ms, rel_err, pass, ...}. Exit status: 0 PASS, 1 FAIL, 2 bad input.
"""

from __future__ import annotations

import inspect
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tpattn import dist as tpdist  # noqa: E402
from tpattn.check import TOL_FLOAT64, compare, layer_float64, sample_rows  # noqa: E402
from tpattn.cli import parse  # noqa: E402 - the same options as python -m tpattn
from tpattn.config import ConfigError, resolve, validate  # noqa: E402
from tpattn.layer import TensorParallelAttention  # noqa: E402
from tpattn.report import versions  # noqa: E402
from tpattn.timing import Timer  # noqa: E402
from tpattn.weights import head_weights, layer_input  # noqa: E402

EXIT_FAIL, EXIT_USAGE = 1, 2


class Attention(nn.Module):
    """Multi-head self-attention as a PyTorch user writes it. After parallelize_module, q/k/v
    produce this rank's heads only (hence the -1 in view) and o sums over this rank's heads."""

    def __init__(self, model_dim: int, heads: int, head_dim: int, causal: bool, dtype, device):
        super().__init__()
        hd = heads * head_dim
        self.head_dim, self.causal = head_dim, causal
        self.q = nn.Linear(model_dim, hd, dtype=dtype, device=device)
        self.k = nn.Linear(model_dim, hd, dtype=dtype, device=device)
        self.v = nn.Linear(model_dim, hd, dtype=dtype, device=device)
        self.o = nn.Linear(hd, model_dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        q, k, v = (p(x).view(B, N, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o(o.transpose(1, 2).reshape(B, N, -1))


def load(m: Attention, w: dict) -> None:
    """tpattn's "x @ W" weights ([in, out]) into nn.Linear ([out, in])."""
    with torch.no_grad():
        for name in ("q", "k", "v", "o"):
            lin = getattr(m, name)
            lin.weight.copy_(w["w" + name].T)
            lin.bias.copy_(w["b" + name])


def done(y: torch.Tensor) -> torch.Tensor:
    """DTensor returns the all-reduced output as an AsyncCollectiveTensor that waits only when
    it is used; the next layer would use it at once, so the timed region waits for it too."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    return y.wait() if isinstance(y, AsyncCollectiveTensor) else y


def parallelize(m: Attention, mesh) -> Attention:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
    kw = {}
    if "src_data_rank" in inspect.signature(parallelize_module).parameters:
        kw["src_data_rank"] = None  # every rank holds the same full weights: slice locally, no scatter
    return parallelize_module(m, mesh, plan, **kw)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    proc = tpdist.discover()
    try:
        cfg = resolve(parse(argv))
        validate(cfg, proc.world, proc.local_world, check_json=proc.rank == 0)
        if getattr(cfg, "load", None):
            raise ConfigError("--load is not supported by the peer: it builds the weights and input from --seed, "
                              "as python -m tpattn does without --load")
    except ConfigError as exc:
        print(f"peer_tp: rank {proc.rank}: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    try:
        device = tpdist.pick_device(proc, cfg.device)
        tpdist.rendezvous(proc, cfg.timeout)
        # A process group even for one process: the device mesh needs one.
        tpdist.init_process_group(proc, cfg.dist_backend, device, cfg.timeout)
        code = run(cfg, proc, device)
        dist.barrier()  # rank 0 hosts the store: nobody may still need it when rank 0 leaves
        dist.destroy_process_group()
        return code
    except BaseException as exc:  # noqa: BLE001 - say it, then end the whole job (no rank left waiting)
        if isinstance(exc, SystemExit):
            raise
        import traceback
        traceback.print_exc()
        print(f"peer_tp: rank {proc.rank}: failed: {type(exc).__name__}: {exc}; ending the job",
              file=sys.stderr, flush=True)
        proc.abort(EXIT_FAIL)
        return EXIT_FAIL


def run(cfg, proc, device) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    H, d, D, dtype = cfg.heads, cfg.head_dim, cfg.model_dim, cfg.torch_dtype
    full = head_weights(range(H), H, d, cfg.seed, dtype, device)
    x = layer_input(cfg.batch, cfg.seq_len, D, cfg.seed, dtype, device)

    peer = Attention(D, H, d, cfg.causal, dtype, device)
    load(peer, full)
    ours = TensorParallelAttention.from_linears(peer.q, peer.k, peer.v, peer.o, heads=H, backend=cfg.kernel,
                                                causal=cfg.causal, reduce_dtype=cfg.reduce_dtype)
    mesh = init_device_mesh(device.type, (proc.world,))
    peer = parallelize(peer, mesh)

    timer = Timer(device)
    with torch.no_grad():
        for _ in range(cfg.warmup):
            done(peer(x))
            ours(x)
        samples: dict[str, list[float]] = {"peer": [], "ours": []}
        for _ in range(cfg.iters):  # alternate, so drift in clocks or neighbours hits both alike
            with timer.section("peer"):
                y_peer = done(peer(x))
            with timer.section("ours"):
                y_ours = ours(x)
            for k, ms in timer.collect().items():
                samples[k].append(ms)
    mine = {k: statistics.median(v) for k, v in samples.items()}
    everyone: list = [None] * proc.world
    dist.all_gather_object(everyone, mine)
    if proc.rank != 0:
        return 0

    tol = TOL_FLOAT64[cfg.dtype]
    rows = sample_rows(cfg.seq_len)
    ref = layer_float64(x, full, H, cfg.causal, rows)
    checks = {
        "peer_vs_ours": {**compare(y_peer, y_ours.double(), tol), "what": f"all {cfg.seq_len} rows"},
        "peer_vs_float64": {**compare(y_peer[:, rows.to(y_peer.device)], ref, tol),
                            "what": f"{len(rows)} of {cfg.seq_len} rows"},
    }
    ok = all(c["pass"] for c in checks.values())
    peer_ms = max(r["peer"] for r in everyone)
    ours_ms = max(r["ours"] for r in everyone)
    res = {
        "peer": "PyTorch tensor parallel (parallelize_module: ColwiseParallel q/k/v, RowwiseParallel o) "
                "+ F.scaled_dot_product_attention",
        "peer_ms": peer_ms, "ours_ms": ours_ms, "ratio_peer_over_ours": peer_ms / ours_ms if ours_ms else None,
        "rel_err": checks["peer_vs_ours"]["rel_err"], "tol": tol, "pass": ok,
        "per_rank_ms": everyone,
        "timing": f"each rank's median over {cfg.iters} iterations ({cfg.warmup} warm-up), then max over ranks",
        "checks": checks,
        "world": {"size": proc.world, "launcher": proc.launcher, "backend": cfg.dist_backend,
                  "device": device.type,
                  "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
        "config": {**cfg.fingerprint(), "model_dim": D, "heads_per_rank": H // proc.world},
        "versions": versions(),
        "command": ["python", "scripts/peer_tp.py", *sys.argv[1:]],
    }
    line = (f"peer_tp: {proc.world} rank(s), {cfg.dist_backend} on {device.type}, B={cfg.batch} N={cfg.seq_len} "
            f"H={H} d={d} {cfg.dtype}: PyTorch TP + SDPA {peer_ms:.3f} ms, tpattn ({cfg.kernel}) "
            f"{ours_ms:.3f} ms in the same processes")
    print(line, flush=True)
    for name, c in checks.items():
        print(f"check {name}: max err {c['max_abs_err']:.3g} = {c['rel_err']:.3g} x rms (tol {tol:g}) "
              f"{'PASS' if c['pass'] else 'FAIL'}  {c['what']}", flush=True)
    print(f"RESULT: {'PASS' if ok else 'FAIL'}", flush=True)
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if ok else EXIT_FAIL


if __name__ == "__main__":
    raise SystemExit(main())
