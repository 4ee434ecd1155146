#!/usr/bin/env python3
"""The peers: the same attention layer written the way PyTorch users write it, timed and checked
against tpattn's in the same processes, beside a bare all-reduce of the same bytes.

    mpirun -n W python scripts/peer_tp.py [python -m tpattn's shape/compute options] --json PATH

Two peers, built from the same four nn.Linear (weights from tpattn.weights with the same seed as
`python -m tpattn`), and tpattn's TensorParallelAttention built from those Linear too
(from_linears), all in the same process group:

- dtensor: a plain nn.Module (four nn.Linear and F.scaled_dot_product_attention) split with
  PyTorch's tensor-parallel API: parallelize_module with ColwiseParallel for q, k and v (each rank
  keeps the output features of its heads) and RowwiseParallel for o (each rank keeps the input
  features of its heads; DTensor all-reduces the partial outputs).
- plain: tensor parallelism by hand, gpt-fast style: this rank's heads of W_q, W_k, W_v packed
  into one Linear (one GEMM), SDPA over the local heads, the output Linear on the local rows
  without bias, one dist.all_reduce in the model dtype, the bias added once after it. Timed with
  SDPA's own backend choice (plain_default) and restricted to flash (plain_flash) and cuDNN
  (plain_cudnn) where those run (CUDA only; elsewhere reported as not available).

Each timed iteration runs the DTensor peer, the plain peer per SDPA backend, then tpattn (CUDA
events on a GPU). Then a bare dist.all_reduce of exactly the bytes of tpattn's all-reduce
(layer.partial_nbytes: fp32 by default) and of the peers' (model dtype), on the same group, after
a barrier each, with its algbw and busbw. One more forward of each peer is recorded: the
collectives it dispatches (op, dtype, bytes), the ops it runs (torch.profiler) and which SDPA
kernel ran. Rank 0 compares every peer's output with tpattn's and with float64 on sampled rows
and writes JSON: {peer_ms (the DTensor peer), ours_ms, plain_ms, peers: {dtensor, plain_default,
plain_flash, plain_cudnn}, host_ms, bare_allreduce: {ours, peer: {bytes, dtype, ms, algbw_GBps,
busbw_GBps}}, ours_allreduce, per_forward, rel_err, pass, checks, ...}. Exit status: 0 PASS,
1 FAIL, 2 bad input.

--backward: the training step instead of the forward, the plain peer (with each SDPA backend) beside
tpattn in the same processes: y = layer(x); y.backward(dy), the layers taking turns. The plain peer
trains through Megatron's pair of maps written in a few lines (the input's copy to every rank, whose
backward all-reduces dX; the output's all-reduce, whose backward is the identity); the DTensor peer is
left out (its forward is timed without --backward). Rank 0 checks the plain peer's x.grad against
tpattn's and writes {train_ms: {ours, plain_default, plain_flash, plain_cudnn}, train_host_ms, checks,
pass, ...}.

Why the DTensor peer is slower on 2 GPUs than on 1 (2.63 -> 4.46 ms on H200s): not from how we
use the API, as far as a CPU run (gloo, the same dispatch and the same collectives) shows it.
- One collective per forward, none with one rank: RowwiseParallel's output is a Partial DTensor
  that redistribute() sums with one functional all_reduce in the model dtype (fp16, B*N*D*2
  bytes: the plain peer's bytes, half of tpattn's fp32 all-reduce). x is not moved:
  ColwiseParallel annotates it as Replicate (from_local, no collective). No all-gather anywhere.
- ColwiseParallel's default use_local_output=True hands q, k and v back as plain local tensors,
  so view(B, N, -1, d), the transposes and SDPA run on plain tensors: the profiler shows the same
  SDPA kernel in both peers (no DTensor SDPA, no math fallback).
- What DTensor adds is host time. Per forward: 16 DTensor dispatches, 4 from_local, 4
  redistribute (3 of them no-ops: ColwiseParallel compares the output's Shard(2) with its default
  Shard(-1) without normalizing the dim), 104 aten ops against the plain peer's 66. With two ranks
  the Partial -> Replicate redistribute really runs and adds the bias divided by the world size
  (a Replicate bias made Partial), an out-of-place copy of the output for the functional
  all_reduce, the AsyncCollectiveTensor and the wait: 113 aten ops. Host time per forward on a
  2-core CPU (1 thread per rank, N=16 H=2 d=8, medians of 300, alternating): one rank, DTensor
  1.0-1.25 ms against 0.12-0.17 ms for the plain peer; two ranks, DTensor 1.9-2.7 ms just to
  issue the forward (before its wait) against 0.2-0.27 ms for the plain peer's local part.
- On the GPU the timed region is CUDA events, so a forward whose host dispatch takes longer than
  its GPU work is timed at the host's pace. One H200 has ~2.3 ms of GPU work, which hides ~1 ms
  of dispatch; two have ~1.1 ms each, less than DTensor's 2-rank dispatch, so the DTensor peer
  gets slower while the plain peer should get faster. The run measures it: host_ms beside ms for
  each peer (DTensor host-bound when its host_ms is about its ms), the plain peer with the same
  all-reduce and GEMM shapes, and the bare all-reduce of the peers' bytes (to rule out the link).
The tensor-parallel API has no eager switch that removes this cost (PyTorch's answer is to
torch.compile the module); ColwiseParallel(output_layouts=Shard(2)) and
RowwiseParallel(input_layouts=Shard(2)) skip the no-op redistributes but saved only 0.06 ms (one
rank) to 0.3 ms (two) here, so the peer keeps the defaults a user writes.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tpattn import dist as tpdist  # noqa: E402
from tpattn.check import TOL_FLOAT64, compare, layer_float64, sample_rows  # noqa: E402
from tpattn.cli import parse  # noqa: E402 - the same options as python -m tpattn
from tpattn.config import ConfigError, resolve, validate  # noqa: E402
from tpattn.layer import TensorParallelAttention  # noqa: E402
from tpattn.report import bus_bandwidth, versions  # noqa: E402
from tpattn.sharding import head_columns, head_range  # noqa: E402
from tpattn.timing import Timer, recorded  # noqa: E402
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
    try:  # (discover makes every rank print its line before any exits)
        proc = tpdist.discover()
    except ConfigError as exc:
        print(f"peer_tp: error: {exc}", file=sys.stderr, flush=True)
        return 2
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


# ---- the plain peer: tensor parallelism by hand, gpt-fast style -------------------------------------

class PlainTP(nn.Module):
    """The layer as a PyTorch user writes tensor parallelism by hand (gpt-fast style): this rank's
    heads of W_q, W_k and W_v packed into ONE nn.Linear [D -> 3*h*d] (one GEMM), the heads viewed
    out of it, F.scaled_dot_product_attention over the local heads, the output nn.Linear on this
    rank's rows of W_o without bias, one dist.all_reduce of the output in the model dtype, and the
    output bias added once, after it. With one rank there is nothing to sum and no collective runs.
    Built from the same four full nn.Linear as the DTensor peer (before parallelize_module)."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear, heads: int, causal: bool):
        super().__init__()
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        D, self.d = q.in_features, q.out_features // heads
        self.h, self.causal = heads // self.world, causal
        cols = head_columns(head_range(heads, self.world, rank), self.d)
        w = q.weight
        hd = self.h * self.d
        self.wqkv = nn.Linear(D, 3 * hd, bias=q.bias is not None, dtype=w.dtype, device=w.device)
        self.wo = nn.Linear(hd, D, bias=False, dtype=w.dtype, device=w.device)
        with torch.no_grad():
            self.wqkv.weight.copy_(torch.cat([lin.weight[cols] for lin in (q, k, v)]))
            if q.bias is not None:
                self.wqkv.bias.copy_(torch.cat([lin.bias[cols] for lin in (q, k, v)]))
            self.wo.weight.copy_(o.weight[:, cols])
        self.bo = None if o.bias is None else nn.Parameter(o.bias.detach().clone())

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's heads, up to the output projection: the part without a collective."""
        B, N, _ = x.shape
        hd = self.h * self.d
        q, k, v = (t.view(B, N, self.h, self.d).transpose(1, 2) for t in self.wqkv(x).split(hd, dim=-1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.wo(o.transpose(1, 2).reshape(B, N, hd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.partial(x)
        if self.world > 1:
            dist.all_reduce(y)
        if self.bo is not None:
            y += self.bo
        return y


    def train_forward(self, x: torch.Tensor) -> torch.Tensor:
        """forward() under autograd: the input copied to the ranks (its backward sums dX) and the output
        summed over them (its backward passes dy on), Megatron's f and g."""
        y = self.partial(_CopyToRanks.apply(x) if self.world > 1 else x)
        if self.world > 1:
            y = _SumOverRanks.apply(y)
        return y + self.bo if self.bo is not None else y


class _CopyToRanks(torch.autograd.Function):
    """Identity; its backward all-reduces the input's gradient (every rank's heads contribute to dX)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _SumOverRanks(torch.autograd.Function):
    """The all-reduce of the partial outputs; its backward is the identity (each partial's gradient is dy)."""

    @staticmethod
    def forward(ctx, y):
        y = y.contiguous().clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, g):
        return g


SDPA_VARIANTS = {"default": None, "flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}


def sdpa_context(variant: str):
    """SDPA's own choice of backend (default), or SDPA restricted to one backend."""
    if SDPA_VARIANTS[variant] is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, SDPA_VARIANTS[variant])])


def sdpa_unavailable(variant: str, plain: PlainTP, x: torch.Tensor) -> str | None:
    """None when SDPA restricted to this backend runs this rank's heads (same shapes, strides and
    dtype as the timed call, no collective), else why not."""
    if SDPA_VARIANTS[variant] is None:
        return None
    if x.device.type != "cuda":
        return f"not available on {x.device.type} (a CUDA backend)"
    try:
        from torch.nn.attention import SDPBackend
        getattr(SDPBackend, SDPA_VARIANTS[variant])
    except (ImportError, AttributeError):
        return f"not available in torch {torch.__version__}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SDPA warns why each backend refused: the message below says it
            with torch.no_grad(), sdpa_context(variant):
                plain.partial(x)
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
    except RuntimeError as exc:
        return "not available for this call: " + " ".join(str(exc).split())[:200]
    return None


# ---- what one forward does: collectives, ops, SDPA kernels -----------------------------------------

COLLECTIVES = ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast", "reduce", "scatter", "gather")


class _Collectives(TorchDispatchMode):
    """Records every collective dispatched (c10d and functional collectives): op, dtype, bytes."""

    def __init__(self):
        super().__init__()
        self.seen: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = getattr(func, "namespace", "")
        name = str(getattr(func, "overloadpacket", func))
        collective = any(c in name.replace("_", "") for c in COLLECTIVES)
        if ns in ("c10d", "_c10d_functional", "c10d_functional") and collective:
            t = next((a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)), None)
            self.seen.append({"op": name, "dtype": None if t is None else str(t.dtype).replace("torch.", ""),
                              "bytes": None if t is None else t.numel() * t.element_size()})
        return func(*args, **(kwargs or {}))


def per_forward(fn) -> dict:
    """One more forward under a dispatch mode (its collectives) and one under torch.profiler (the
    ops it runs, nested ones included, and which SDPA kernel ran)."""
    from torch.profiler import ProfilerActivity, profile
    mode = _Collectives()
    with torch.no_grad(), mode:
        fn()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: dict[str, int] = {}
    for e in prof.events():
        counts[e.name] = counts.get(e.name, 0) + 1
    return {"collectives": mode.seen,
            "aten_ops": sum(c for n, c in counts.items() if n.startswith("aten::")),
            "dtensor_dispatches": counts.get("PythonSubclass", 0),
            "sdpa_kernels": sorted(n for n in counts if n.startswith("aten::_") and "attention" in n),
            "ops": dict(sorted(counts.items(), key=lambda kv: -kv[1]))}


# ---- a bare all-reduce of the same bytes ------------------------------------------------------------

def bare_allreduce(nbytes: int, dtype: torch.dtype, device, world: int, warmup: int, iters: int) -> dict:
    """dist.all_reduce of a tensor of exactly nbytes on the default group, on its own: a barrier,
    then the timed call (CUDA events on a GPU); this rank's median over the timed iterations."""
    size = torch.empty((), dtype=dtype).element_size()
    t = torch.zeros(nbytes // size, dtype=dtype, device=device)
    timer = Timer(device)
    ms = []
    for i in range(warmup + iters):
        dist.barrier()
        with timer.section("allreduce"):
            dist.all_reduce(t)
        got = timer.collect()["allreduce"]
        if i >= warmup:
            ms.append(got)
    return {"bytes": t.numel() * size, "dtype": str(dtype).replace("torch.", ""), "ms": statistics.median(ms)}


def _bandwidth(entry: dict, world: int) -> dict:
    """algbw and busbw (nccl-tests convention) of {bytes, ms}; None with one rank (nothing moves)."""
    algbw, busbw = bus_bandwidth(entry["bytes"], entry["ms"], world)
    return {**entry, "algbw_GBps": algbw if world > 1 else None, "busbw_GBps": busbw if world > 1 else None}


# ---- the run ----------------------------------------------------------------------------------------------

def run(cfg, proc, device) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    H, d, D, dtype = cfg.heads, cfg.head_dim, cfg.model_dim, cfg.torch_dtype
    B, N = cfg.batch, cfg.seq_len
    full = head_weights(range(H), H, d, cfg.seed, dtype, device)
    x = layer_input(B, N, D, cfg.seed, dtype, device)

    peer = Attention(D, H, d, cfg.causal, dtype, device)
    load(peer, full)
    # Both other layers are built from the DTensor peer's own full nn.Linear, before parallelize_module
    # replaces their weights with DTensor shards.
    ours = TensorParallelAttention.from_linears(peer.q, peer.k, peer.v, peer.o, heads=H, backend=cfg.kernel,
                                                causal=cfg.causal, reduce_dtype=cfg.reduce_dtype)
    plain = PlainTP(peer.q, peer.k, peer.v, peer.o, H, cfg.causal)
    mesh = init_device_mesh(device.type, (proc.world,))
    peer = parallelize(peer, mesh)

    # Which SDPA backends run here: every rank must agree, or a collective would be left waiting.
    mine = {v: sdpa_unavailable(v, plain, x) for v in SDPA_VARIANTS}
    verdicts: list = [None] * proc.world
    dist.all_gather_object(verdicts, mine)
    unavailable = {v: next((r[v] for r in verdicts if r[v]), None) for v in SDPA_VARIANTS}
    variants = [v for v in SDPA_VARIANTS if unavailable[v] is None]
    if cfg.backward:
        return train(cfg, proc, device, x, ours, plain, variants, unavailable)

    def plain_call(v):
        def call():
            with sdpa_context(v):
                return plain(x)
        return call

    calls = {"dtensor": lambda: done(peer(x)), **{f"plain_{v}": plain_call(v) for v in variants},
             "ours": lambda: recorded(ours, x, timer)}
    timer = Timer(device)
    samples: dict[str, list[float]] = {}
    host: dict[str, list[float]] = {k: [] for k in calls}
    outs: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i in range(cfg.warmup + cfg.iters):  # alternate, so drift in clocks or neighbours hits all alike
            for name, call in calls.items():
                with timer.section(name):
                    t0 = time.perf_counter()
                    outs[name] = call()
                    host[name].append((time.perf_counter() - t0) * 1e3)
            got = timer.collect()
            if i < cfg.warmup:
                for v in host.values():
                    v.pop()
                continue
            for k, ms in got.items():
                samples.setdefault(k, []).append(ms)
    probe = {"dtensor": per_forward(calls["dtensor"]), "plain_default": per_forward(calls["plain_default"]),
             "ours": per_forward(lambda: ours(x))}

    part_dtype = getattr(ours, "part_dtype", torch.float32 if cfg.reduce_dtype == "fp32" else dtype)
    bare_spec = {"ours": (ours.partial_nbytes(B, N), part_dtype),
                 "peer": (B * N * D * torch.empty((), dtype=dtype).element_size(), dtype)}
    bare_warmup, bare_iters = max(cfg.warmup, 3), max(cfg.iters, 10)
    bare = {}
    for k, (nbytes, dt) in bare_spec.items():
        same = next((b for b in bare.values() if b["bytes"] == nbytes and b["dtype"] == str(dt).replace("torch.", "")),
                    None)
        bare[k] = dict(same) if same else bare_allreduce(nbytes, dt, device, proc.world, bare_warmup, bare_iters)

    mine_stats = {"ms": {k: statistics.median(v) for k, v in samples.items()},
                  "host_ms": {k: statistics.median(v) for k, v in host.items()},
                  "bare_ms": {k: b["ms"] for k, b in bare.items()}}
    everyone: list = [None] * proc.world
    dist.all_gather_object(everyone, mine_stats)
    if proc.rank != 0:
        return 0
    return report(cfg, proc, device, x, full, outs, everyone, unavailable, probe, bare, bare_spec,
                  ours.partial_nbytes(B, N), (bare_warmup, bare_iters))


def train(cfg, proc, device, x, ours, plain, variants, unavailable) -> int:
    """--backward: the training step (y = layer(x); y.backward(dy)) of tpattn and of the plain peer with
    each SDPA backend that runs here, taking turns; each rank's median, then the slowest rank's. Rank 0
    checks the plain peer's x.grad against tpattn's (the same weights, x and dy) and reports."""
    B, N, D = x.shape
    dy = layer_input(B, N, D, cfg.seed + 1, x.dtype, device)
    xg = x.clone().requires_grad_(True)
    grads = {}

    def step(name, fn, params):
        def call():
            for t in params:
                t.grad = None
            fn(xg).backward(dy)
            grads[name] = xg.grad
        return call

    calls = {f"plain_{v}": step(f"plain_{v}", (lambda t, v=v: _in(sdpa_context(v), plain.train_forward, t)),
                                [xg, *plain.parameters()]) for v in variants}
    calls["ours"] = step("ours", ours, [xg, *ours.parameters()])
    timer = Timer(device)
    samples: dict[str, list[float]] = {k: [] for k in calls}
    host: dict[str, list[float]] = {k: [] for k in calls}
    for i in range(cfg.warmup + cfg.iters):  # alternate, so drift in clocks or neighbours hits all alike
        for name, call in calls.items():
            with timer.section(name):
                t0 = time.perf_counter()
                call()
                ms_host = (time.perf_counter() - t0) * 1e3
            got = timer.collect()[name]
            if i >= cfg.warmup:
                samples[name].append(got)
                host[name].append(ms_host)
    mine = {"ms": {k: statistics.median(v) for k, v in samples.items()},
            "host_ms": {k: statistics.median(v) for k, v in host.items()}}
    everyone: list = [None] * proc.world
    dist.all_gather_object(everyone, mine)
    if proc.rank != 0:
        return 0
    tol = TOL_FLOAT64[cfg.dtype]
    checks = {f"{k}_x.grad_vs_ours": {**compare(g, grads["ours"], tol), "what": "x.grad, every element"}
              for k, g in grads.items() if k != "ours"}
    ok = all(c["pass"] for c in checks.values())
    worst = {k: max(r["ms"][k] for r in everyone) for k in calls}
    worst_host = {k: max(r["host_ms"][k] for r in everyone) for k in calls}
    train_ms = {"ours": worst["ours"], **{f"plain_{v}": worst.get(f"plain_{v}") for v in SDPA_VARIANTS}}
    W = proc.world
    say = (lambda s: print(s, flush=True))
    say(f"peer_tp --backward: {W} rank(s), {cfg.dist_backend} on {device.type}, B={cfg.batch} N={cfg.seq_len} "
        f"H={cfg.heads} d={cfg.head_dim} {cfg.dtype}; training step ms, each rank's median then the slowest rank:")
    say(f"  tpattn ({cfg.kernel})            {worst['ours']:.3f} ms  (host {worst_host['ours']:.3f})")
    say_plain(say, worst, worst_host, unavailable, worst["ours"])
    for name, c in checks.items():
        say(f"check {name}: max err {c['max_abs_err']:.3g} = {c['rel_err']:.3g} x rms (tol {tol:g}) "
            f"{'PASS' if c['pass'] else 'FAIL'}")
    say(f"RESULT: {'PASS' if ok else 'FAIL'}")
    if cfg.json:
        res = {"train_ms": train_ms, "train_host_ms": worst_host, "peers_unavailable":
               {f"plain_{v}": why for v, why in unavailable.items() if why}, "checks": checks, "tol": tol, "pass": ok,
               "per_rank_ms": everyone,
               "timing": f"y = layer(x); y.backward(dy), each rank's median over {cfg.iters} steps ({cfg.warmup} "
                         "warm-up), then max over ranks; the layers take turns within each step",
               "world": {"size": W, "launcher": proc.launcher, "backend": cfg.dist_backend, "device": device.type,
                         "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
               "config": {**cfg.fingerprint(), "model_dim": cfg.model_dim, "heads_per_rank": cfg.heads // W},
               "versions": versions(), "command": ["python", "scripts/peer_tp.py", *sys.argv[1:]]}
        with open(cfg.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if ok else EXIT_FAIL


def say_plain(say, ms: dict, host: dict, unavailable: dict, ours: float | None = None) -> None:
    """A line per SDPA backend of the plain peer: its ms and host ms (and, given tpattn's ms, the ratio), or
    why it did not run."""
    for v in SDPA_VARIANTS:
        k = f"plain_{v}"
        if ms.get(k) is None:
            say(f"  plain TP + SDPA {v:<8}     {unavailable[v]}")
            continue
        ratio = f"  / tpattn {ms[k] / ours:.3f}" if ours else ""
        say(f"  plain TP + SDPA {v:<8}     {ms[k]:.3f} ms  (host {host[k]:.3f}){ratio}")


def _in(ctx, fn, *args):
    with ctx:
        return fn(*args)


def report(cfg, proc, device, x, full, outs, everyone, unavailable, probe, bare, bare_spec, ours_bytes,
           bare_iters) -> int:
    H, W = cfg.heads, proc.world
    worst = (lambda key, k: max(r[key][k] for r in everyone) if all(k in r[key] for r in everyone) else None)
    tol = TOL_FLOAT64[cfg.dtype]
    rows = sample_rows(cfg.seq_len)
    ref = layer_float64(x, full, H, cfg.causal, rows)
    y_ours = outs["ours"].double()
    checks = {}
    for name, y in outs.items():
        if name == "ours":
            continue
        label = "peer" if name == "dtensor" else name  # "peer_*": the names scaling.py has always read
        checks[f"{label}_vs_ours"] = {**compare(y, y_ours, tol), "what": f"all {cfg.seq_len} rows"}
        checks[f"{label}_vs_float64"] = {**compare(y[:, rows.to(y.device)], ref, tol),
                                         "what": f"{len(rows)} of {cfg.seq_len} rows"}
    ok = all(c["pass"] for c in checks.values())
    peers = {"dtensor": worst("ms", "dtensor"),
             **{f"plain_{v}": worst("ms", f"plain_{v}") for v in SDPA_VARIANTS}}
    peer_ms, ours_ms = peers["dtensor"], worst("ms", "ours")
    for k, b in bare.items():
        b["ms"] = max(r["bare_ms"][k] for r in everyone)
        bare[k] = _bandwidth(b, W)
    ar_ms = worst("ms", "allreduce")
    ours_ar = _bandwidth({"bytes": ours_bytes, "dtype": str(bare_spec["ours"][1]).replace("torch.", ""),
                          "ms": ar_ms or 0.0}, W) if ar_ms is not None else None
    res = {
        "peer": "PyTorch tensor parallel (parallelize_module: ColwiseParallel q/k/v, RowwiseParallel o) "
                "+ F.scaled_dot_product_attention",
        "plain_peer": "plain PyTorch tensor parallel, gpt-fast style: one packed QKV nn.Linear on the local heads, "
                      "F.scaled_dot_product_attention, output nn.Linear on the local rows (no bias), one "
                      "dist.all_reduce in the model dtype, output bias added once after it",
        "peer_ms": peer_ms, "ours_ms": ours_ms, "ratio_peer_over_ours": peer_ms / ours_ms if ours_ms else None,
        "plain_ms": peers["plain_default"],
        "peers": peers,
        "peers_unavailable": {f"plain_{v}": why for v, why in unavailable.items() if why},
        "host_ms": {k: worst("host_ms", k) for k in everyone[0]["host_ms"]},
        "ours_allreduce": ours_ar,
        "bare_allreduce": {**bare, "timing": f"dist.all_reduce on the default group after a barrier, each rank's "
                                             f"median over {bare_iters[1]} calls ({bare_iters[0]} warm-up), then max "
                                             "over ranks; busbw = algbw x 2(n-1)/n"},
        "per_forward": probe,
        "rel_err": checks["peer_vs_ours"]["rel_err"], "tol": tol, "pass": ok,
        "per_rank_ms": everyone,
        "timing": f"each rank's median over {cfg.iters} iterations ({cfg.warmup} warm-up), then max over ranks; "
                  "in each iteration the DTensor peer, the plain peer with each SDPA backend, then tpattn, one after "
                  "the other; host_ms: time for the Python call to return (on a GPU the launch and dispatch cost, "
                  "the GPU runs behind it; on CPU it includes the compute)",
        "checks": checks,
        "world": {"size": W, "launcher": proc.launcher, "backend": cfg.dist_backend,
                  "device": device.type,
                  "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
        "config": {**cfg.fingerprint(), "model_dim": cfg.model_dim, "heads_per_rank": H // W},
        "versions": versions(),
        "command": ["python", "scripts/peer_tp.py", *sys.argv[1:]],
    }
    say = (lambda s: print(s, flush=True))
    say(f"peer_tp: {W} rank(s), {cfg.dist_backend} on {device.type}, B={cfg.batch} N={cfg.seq_len} H={H} "
        f"d={cfg.head_dim} {cfg.dtype}; ms, each rank's median then the slowest rank, same processes:")
    say(f"  tpattn ({cfg.kernel}, {cfg.reduce_dtype} all-reduce)  {ours_ms:.3f} ms  "
        f"(host {res['host_ms']['ours']:.3f})")
    say(f"  PyTorch TP (DTensor) + SDPA  {peer_ms:.3f} ms  (host {res['host_ms']['dtensor']:.3f})")
    say_plain(say, peers, res["host_ms"], unavailable)
    for k, b in bare.items():
        if k == "timing":
            continue
        bw = f", algbw {b['algbw_GBps']:.2f} GB/s, busbw {b['busbw_GBps']:.2f} GB/s" if b["busbw_GBps"] else ""
        whose = "tpattn's" if k == "ours" else "the peers'"
        say(f"  bare all-reduce of {whose} bytes: {b['bytes']} B of {b['dtype']}, {b['ms']:.3f} ms{bw}")
    if ours_ar and ours_ar["busbw_GBps"]:
        say(f"  tpattn's all-reduce in the layer: {ours_ar['ms']:.3f} ms, busbw {ours_ar['busbw_GBps']:.2f} GB/s")
    for k, p in probe.items():
        coll = ", ".join(f"{c['op']} {c['dtype']} {c['bytes']} B" for c in p["collectives"]) or "none"
        say(f"  per forward, {k}: collectives: {coll}; {p['aten_ops']} aten ops (nested included), "
            f"{p['dtensor_dispatches']} DTensor dispatches, SDPA kernel {', '.join(p['sdpa_kernels']) or '-'}")
    for name, c in checks.items():
        say(f"check {name}: max err {c['max_abs_err']:.3g} = {c['rel_err']:.3g} x rms (tol {tol:g}) "
            f"{'PASS' if c['pass'] else 'FAIL'}  {c['what']}")
    say(f"RESULT: {'PASS' if ok else 'FAIL'}")
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if ok else EXIT_FAIL


if __name__ == "__main__":
    tpdist.exit_now(main())  # not SystemExit: gloo's worker threads can abort the interpreter's finalization
