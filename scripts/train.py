#!/usr/bin/env python3
"""Train a small model through the tensor-parallel attention layer on a synthetic task that needs
attention (associative recall), under mpirun, srun, torchrun or as one process.

The model (everything but the attention layer is plain torch, replicated, built from the seed):

    tokens [B, N]
      x = tok_emb[t_i] + prev_emb[t_(i-1)] + pos_emb[i]    (prev_emb: the token before, "smeared key")
      x = x + TensorParallelAttention(LN(x))               causal, heads split over the ranks
      x = x + MLP(LN(x))                                   D -> 4D -> GELU -> D
      logits = head(LN(x))                                 over the value tokens only

The task (associative recall): a sequence of --pairs key-value pairs (distinct keys out of --vocab
keys, values out of --vocab values), then --queries of those keys; at each query the model predicts
the value that followed that key. Loss: cross-entropy at the query positions; chance = log(--vocab).
One attention layer can do it because each position also sees the token before it (prev_emb): a
value's position carries its key, so the query's head matches it there and reads the value.

Head-parallel: x, y and dX are the same on every rank, so the replicated parameters get the same
gradients on every rank without any extra communication (checked every --check-every steps: every
rank's checksum of them gathered through tpattn.comm.gather_objects, exact equality). The attention
layer's full weights come from the seed on every rank and each rank keeps its slice (from_full):
the model is the same at every world size, and so is AdamW, elementwise, on the slices. Batches
come from a torch.Generator seeded by (seed, step): the same on every rank and at every world size.

Precision: fp32 on CPU (--kernel reference). On a GPU (--kernel fused or naive, device cuda) with
--dtype bf16/fp16 the attention layer's parameters are in that dtype (what the kernels read), with
an fp32 master copy that AdamW updates (copied back, rounded, after each step); the rest of the
model stays fp32. fp16 adds a dynamic loss scale (all ranks agree on skipping a step that
overflowed).

Writes PREFIX.json (--out, rank 0): per-step loss and accuracy, config, world size, versions, date,
git commit, timings. --plot PNG draws the curve (matplotlib: pip install -e '.[plot]'). --compare A.json B.json ... (no training) prints the
step-by-step difference of runs' loss curves (e.g. world sizes 1, 2, 3 of one seed) and exits 1
when the max abs difference exceeds --tol.

    mpirun -n 2 python scripts/train.py --out runs/w2 [--steps 60 --heads 6 --kernel reference]
    python scripts/train.py --compare runs/w1.json runs/w2.json runs/w3.json [--tol 1e-4] [--plot cmp.png]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DTYPES = ("fp32", "bf16", "fp16")
LAUNCHED = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID", "WORLD_SIZE")
DEFAULT_TOL = 1e-4  # max abs difference of fp32 CPU loss curves across world sizes (docs/training.md)


class Refusal(Exception):
    """A bad input: one line, exit 2, on every rank."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + error, printed by main() on every rank
        raise Refusal(f"{message} (see --help)")


def need_matplotlib() -> None:
    """--plot draws with matplotlib (the plot extra): without it, one line and exit 2 before any work,
    instead of a traceback after it (scripts/scaling.py names the extra the same way)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        why = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise Refusal(f"--plot needs matplotlib ({why}): pip install -e '.[plot]', or leave out --plot") from None


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0] + " See docs/training.md.",
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--batch", type=int, default=64, help="sequences per step (the same on every rank)")
    p.add_argument("--pairs", type=int, default=8, help="key-value pairs per sequence")
    p.add_argument("--queries", type=int, default=4, help="queried keys after the pairs (answer positions)")
    p.add_argument("--vocab", type=int, default=16, help="number of keys and of values; chance loss = log(vocab)")
    p.add_argument("--heads", type=int, default=6, help="query heads H (split over the ranks)")
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads G (default H; fewer: grouped-query)")
    p.add_argument("--head-dim", type=int, default=16, help="head dim d; model dim D = H*d")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (linear warmup, cosine decay)")
    p.add_argument("--warmup", type=int, default=10, help="warmup steps")
    p.add_argument("--emb-std", type=float, default=1.0, help="std of the embeddings at init")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--seed", type=int, default=0, help="weights and batches")
    p.add_argument("--kernel", default="reference",
                   help="attention backend: reference (CPU or GPU), fused or naive (GPU)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda for the CUDA kernels, else cpu")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="attention layer dtype (default fp32 on CPU, bf16 on a GPU); fp32 master weights")
    p.add_argument("--no-attention", action="store_true",
                   help="ablation: skip the attention layer (the loss then stays near chance)")
    p.add_argument("--uneven-heads", action="store_true", help="a world size that does not divide the heads")
    p.add_argument("--dist-backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="process group backend (auto: nccl on a GPU when every rank has its own, else gloo)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per rank (default: the cores divided among this node's ranks)")
    p.add_argument("--check-every", type=int, default=10,
                   help="compare the replicated parameters' gradient checksums over ranks every N steps (0: never)")
    p.add_argument("--timeout", type=float, default=120, help="seconds for the rendezvous and each collective")
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps (rank 0)")
    p.add_argument("--out", metavar="PREFIX", help="write PREFIX.json (rank 0)")
    p.add_argument("--plot", metavar="PNG", help="draw the loss curve(s) (with --compare: all runs together); "
                   "needs matplotlib, the plot extra: pip install -e '.[plot]'")
    p.add_argument("--compare", nargs="+", metavar="JSON",
                   help="no training: compare the loss curves of these runs step by step")
    p.add_argument("--tol", type=float, default=DEFAULT_TOL,
                   help="--compare: largest allowed abs difference of the losses at any step")
    args = p.parse_args(argv)
    if args.plot:
        need_matplotlib()
    if args.compare is not None:
        if len(args.compare) < 2:
            p.error("--compare needs at least two JSON files")
        if not args.tol >= 0:
            p.error(f"--tol must be >= 0 (got {args.tol})")
        return args
    for name in ("steps", "batch", "pairs", "queries", "vocab", "heads", "head_dim"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if args.kv_heads is not None and args.kv_heads < 1:
        p.error(f"--kv-heads must be >= 1 (got {args.kv_heads})")
    if args.pairs > args.vocab:
        p.error(f"--pairs {args.pairs} needs as many distinct keys: --vocab must be >= {args.pairs}")
    if args.queries > args.pairs:
        p.error(f"--queries {args.queries} asks for distinct keys of the {args.pairs} pairs: at most --pairs")
    if not 0 < args.lr <= 1e6:
        p.error(f"--lr must be finite, > 0 and at most 1e6 (got {args.lr})")
    if not 0 <= args.weight_decay <= 1e6:
        p.error(f"--weight-decay must be finite, >= 0 and at most 1e6 (got {args.weight_decay})")
    if not 0 < args.emb_std <= 1e6:
        p.error(f"--emb-std must be finite, > 0 and at most 1e6 (got {args.emb_std})")
    if not 0 < args.timeout <= 1e6:
        p.error(f"--timeout must be finite, > 0 and at most 1e6 seconds (got {args.timeout})")
    if not 0 <= args.seed < 2 ** 63:
        p.error(f"--seed must be in 0 .. 2^63 - 1 (got {args.seed})")
    for name in ("warmup", "check_every", "log_every"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0 (got {getattr(args, name)})")
    cores = os.cpu_count() or 1
    if args.threads is not None and not 1 <= args.threads <= cores:
        p.error(f"--threads must be 1 .. {cores}, the cores here (got {args.threads})")
    if args.device == "auto":
        args.device = "cpu" if args.kernel == "reference" else "cuda"
    if args.dtype is None:
        args.dtype = "fp32" if args.device == "cpu" else "bf16"
    if args.device == "cpu" and args.dtype != "fp32":
        p.error(f"--dtype {args.dtype} is for the GPU kernels; on CPU use --dtype fp32")
    if args.device == "cpu" and args.dist_backend == "nccl":
        p.error("--dist-backend nccl needs --device cuda (a GPU a rank); use --dist-backend gloo on CPU")
    for flag, path in (("--out", f"{args.out}.json" if args.out else None), ("--plot", args.plot)):
        if path:  # its directory made now, as the run would at the end, and the file opened
            from tpattn.config import check_writable
            from tpattn.errors import ConfigError
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                check_writable(path, flag)
            except OSError as exc:
                p.error(f"{flag} {path}: its directory cannot be made ({exc.strerror or exc}); choose another path")
            except ConfigError as exc:
                p.error(str(exc))
    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    return args


# ---- the task ---------------------------------------------------------------------------------------------

def batch(step: int, args, device):
    """(tokens [B, 2P+Q], targets [B, Q]) of step `step`: the same on every rank and world size.
    Keys are tokens 0..V-1, values V..2V-1; targets are value indices 0..V-1."""
    import torch
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    B, P, Q, V = args.batch, args.pairs, args.queries, args.vocab
    keys = torch.rand(B, V, generator=g).argsort(dim=1)[:, :P]          # P distinct keys per sequence
    values = torch.randint(0, V, (B, P), generator=g)
    which = torch.rand(B, P, generator=g).argsort(dim=1)[:, :Q]          # Q distinct pairs asked for
    tokens = torch.empty(B, 2 * P + Q, dtype=torch.long)
    tokens[:, 0:2 * P:2] = keys
    tokens[:, 1:2 * P:2] = values + V
    tokens[:, 2 * P:] = keys.gather(1, which)
    return tokens.to(device), values.gather(1, which).to(device)


# ---- the model ----------------------------------------------------------------------------------------

def build_model(args, device, layer_dtype):
    import torch
    from torch import nn

    from tpattn.layer import TensorParallelAttention

    H, G, d = args.heads, args.kv_heads, args.head_dim
    D, V, N = H * d, args.vocab, 2 * args.pairs + args.queries

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(args.seed)  # the replicated part: the same on every rank
            self.tok = nn.Embedding(2 * V, D)
            self.prev = nn.Embedding(2 * V + 1, D)  # the token before (2V: none, at position 0)
            self.pos = nn.Embedding(N, D)
            for e in (self.tok, self.prev, self.pos):
                nn.init.normal_(e.weight, std=args.emb_std)
            self.ln1, self.ln2, self.lnf = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
            self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
            self.head = nn.Linear(D, V)
            # the attention layer: full weights from the seed on every rank, this rank's slice kept
            g = torch.Generator().manual_seed(args.seed + 7919)
            full = {k: torch.randn(*s, generator=g) / math.sqrt(s[0]) for k, s in
                    dict(wq=(D, H * d), wk=(D, G * d), wv=(D, G * d), wo=(H * d, D)).items()}
            full["wo"] /= math.sqrt(2.0)
            full.update(bq=torch.zeros(H * d), bk=torch.zeros(G * d), bv=torch.zeros(G * d), bo=torch.zeros(D))
            full = {k: t.to(device=device, dtype=layer_dtype) for k, t in full.items()}
            self.attn = TensorParallelAttention.from_full(**full, heads=H, kv_heads=G, causal=True,
                                                          uneven_heads=args.uneven_heads, backend=args.kernel)

        def forward(self, tokens):
            B, n = tokens.shape
            before = torch.cat([torch.full((B, 1), 2 * V, dtype=tokens.dtype, device=tokens.device),
                                tokens[:, :-1]], dim=1)
            x = self.tok(tokens) + self.prev(before) + self.pos.weight[:n]
            if not args.no_attention:
                x = x + self.attn(self.ln1(x).to(layer_dtype)).float()
            x = x + self.mlp(self.ln2(x))
            return self.head(self.lnf(x))

    return Model().to(device)


def replicated(model):
    return [(n, p) for n, p in model.named_parameters() if not n.startswith("attn.")]


def checksum(model) -> str:
    """A hash of the replicated parameters and their gradients (bitwise): equal on every rank."""
    h = hashlib.sha1()
    for _, p in replicated(model):
        for t in (p.detach(), p.grad):
            if t is not None:
                h.update(t.float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# ---- bookkeeping --------------------------------------------------------------------------------------

def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT, timeout=20)
        if head.returncode:
            return "no git checkout here"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=ROOT, timeout=20).stdout.strip()
        return head.stdout.strip() + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> str:
    import platform
    import torch
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, {platform.node()}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores"


def plot_curves(runs: list[tuple[str, dict]], png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    two = len(runs) > 1
    fig, axes = plt.subplots(2 if two else 1, 1, figsize=(7, 6.5 if two else 4), squeeze=False)
    ax = axes[0][0]
    for label, r in runs:
        ax.plot(range(1, len(r["loss"]) + 1), r["loss"], label=label, lw=1.2)
    chance = runs[0][1]["chance"]
    ax.axhline(chance, color="gray", ls="--", lw=0.8, label=f"chance log({runs[0][1]['config']['vocab']})")
    c = runs[0][1]["config"]
    ax.set(xlabel="step", ylabel="loss (answer positions)", ylim=(0, max(max(r["loss"]) for _, r in runs) * 1.05),
           title=f"associative recall through TensorParallelAttention: H={c['heads']} d={c['head_dim']} "
                 f"{c['kernel']} {c['dtype']}")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    if two:
        ax = axes[1][0]
        base_label, base = runs[0]
        for label, r in runs[1:]:
            n = min(len(base["loss"]), len(r["loss"]))
            ax.semilogy(range(1, n + 1), [abs(a - b) + 1e-12 for a, b in zip(base["loss"][:n], r["loss"][:n])],
                        label=f"|{label} - {base_label}|", lw=1)
        ax.set(xlabel="step", ylabel="abs loss difference (0 drawn at 1e-12)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


# ---- --compare ----------------------------------------------------------------------------------------

COMPARED = ("steps", "batch", "pairs", "queries", "vocab", "heads", "kv_heads", "head_dim", "lr", "warmup",
            "weight_decay", "seed")


def compare(args) -> int:
    runs = []
    for path in args.compare:
        try:
            r = json.loads(Path(path).read_text())
            if not isinstance(r.get("loss"), list) or not r["loss"] or "config" not in r:
                raise ValueError("no loss curve in it")
        except (OSError, ValueError) as exc:
            raise Refusal(f"cannot read {path} as a train.py run: {str(exc).splitlines()[0]}") from None
        runs.append((f"W={r.get('world', '?')} {Path(path).stem}", r))
    base = runs[0][1]
    for path, (_, r) in zip(args.compare[1:], runs[1:]):
        diff = [k for k in COMPARED if r["config"].get(k) != base["config"].get(k)]
        if diff:
            print(f"note: {path} differs from {args.compare[0]} in " +
                  ", ".join(f"{k} ({base['config'].get(k)} vs {r['config'].get(k)})" for k in diff))
    n = min(len(r["loss"]) for _, r in runs)
    if any(len(r["loss"]) != n for _, r in runs):
        print(f"note: the runs have {sorted({len(r['loss']) for _, r in runs})} steps; comparing the first {n}")
    print(f"{len(runs)} runs: " + ", ".join(f"{p} (world {r.get('world')}, {r['config'].get('kernel')} "
                                             f"{r['config'].get('dtype')})" for p, (_, r) in zip(args.compare, runs)))
    print(f"{'step':>5} {'loss (run 1)':>13} {'max |diff|':>11} {'max rel':>9}")
    worst, worst_step, rel_worst = 0.0, 0, 0.0
    every = max(1, n // 20)
    for i in range(n):
        vals = [r["loss"][i] for _, r in runs]
        if not all(math.isfinite(v) for v in vals):
            d = math.inf
        else:
            d = max(vals) - min(vals)
        rel = d / max(abs(vals[0]), 1e-12)
        if d > worst or (d == math.inf and worst_step == 0):
            worst, worst_step = d, i + 1
        rel_worst = max(rel_worst, rel)
        if i % every == 0 or i == n - 1 or d > args.tol:
            print(f"{i + 1:>5} {vals[0]:>13.6f} {d:>11.3e} {rel:>9.2e}" + ("  > tol" if d > args.tol else ""))
    ok = worst <= args.tol
    print(f"max abs difference {worst:.3e} at step {worst_step} (max relative {rel_worst:.2e}) over {n} steps: "
          f"{'PASS' if ok else 'FAIL'} (tol {args.tol:g})")
    if args.plot:
        plot_curves(runs, args.plot)
        print(f"wrote {args.plot}")
    return 0 if ok else 1


# ---- training -----------------------------------------------------------------------------------------

def train(args, proc) -> int:
    import torch
    import torch.nn.functional as F

    from tpattn.attention import get_backend
    from tpattn.comm import gather_objects
    from tpattn.errors import ConfigError

    rank, world = proc.rank, proc.world
    device = proc.device if args.device == "cuda" else torch.device("cpu")
    layer_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    # every refusal before the first collective, the same on every rank
    try:
        get_backend(args.kernel).check_supported(argparse.Namespace(device=args.device, dtype=args.dtype,
                                                                     head_dim=args.head_dim))
        from tpattn.sharding import Shard
        Shard.of(args.heads, args.kv_heads, world, rank, args.uneven_heads)
        model = build_model(args, device, layer_dtype)
    except (ConfigError, ValueError) as exc:  # (a ConfigError's cli_message: in the flags, which train.py shares)
        raise Refusal(getattr(exc, "cli_message", str(exc)).splitlines()[0]) from None

    layer = model.attn
    # fp32 master weights for a bf16/fp16 attention layer (AdamW updates them; the layer gets them rounded)
    if layer_dtype == torch.float32:
        masters = list(layer.parameters())
    else:
        masters = [p.detach().float().clone().requires_grad_(True) for p in layer.parameters()]
    params = [p for _, p in replicated(model)] + masters
    decay = lambda p: p.dim() >= 2  # noqa: E731 - weight matrices and embeddings; not biases or LayerNorms
    opt = torch.optim.AdamW([{"params": [p for p in params if decay(p)], "weight_decay": args.weight_decay},
                             {"params": [p for p in params if not decay(p)], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step):  # step 0-based: linear warmup, cosine decay to 10 %
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    scale = 2.0 ** 14 if args.dtype == "fp16" else 1.0
    good_steps, skipped = 0, 0
    chance = math.log(args.vocab)
    losses, accs, checks = [], [], 0
    if rank == 0:
        print(f"train.py: world {world}, {layer.local_heads} of {args.heads} heads on rank 0 "
              f"({args.kv_heads} K/V heads), D={args.heads * args.head_dim}, kernel {args.kernel} {args.dtype} "
              f"on {device.type}; {sum(p.numel() for p in params)} parameters on rank 0; chance {chance:.4f}", flush=True)
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    step_times = []
    for step in range(args.steps):
        ts = time.perf_counter()
        tokens, targets = batch(step, args, device)
        logits = model(tokens)[:, 2 * args.pairs:]                        # the query positions
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        layer.zero_grad(set_to_none=True)
        (loss * scale).backward()
        if layer_dtype != torch.float32:
            for m, p in zip(masters, layer.parameters()):
                m.grad = None if p.grad is None else p.grad.float()
        finite = True
        if scale != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(scale)
            mine = all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)
            finite = all(gather_objects(mine))  # every rank skips, or none
        if finite:
            opt.step()
            good_steps += 1
            if args.dtype == "fp16" and good_steps % 200 == 0:
                scale *= 2
        else:
            skipped += 1
            scale /= 2
        if layer_dtype != torch.float32:
            with torch.no_grad():
                for m, p in zip(masters, layer.parameters()):
                    p.copy_(m)
        with torch.no_grad():
            acc = (logits.argmax(-1) == targets).float().mean().item()
        losses.append(loss.item())
        accs.append(acc)
        sync()
        step_times.append(time.perf_counter() - ts)
        last = step == args.steps - 1
        if args.check_every and ((step + 1) % args.check_every == 0 or last) and world > 1:
            sums = gather_objects((checksum(model), losses[-1]))
            checks += 1
            if len({s for s in sums}) != 1:
                bad = [r for r, s in enumerate(sums) if s != sums[0]]
                print(f"train.py: rank {rank}: step {step + 1}: the replicated parameters or their gradients "
                      f"differ between ranks (rank(s) {bad} differ from rank 0: {sums})", file=sys.stderr, flush=True)
                return 1
        if rank == 0 and args.log_every and ((step + 1) % args.log_every == 0 or step == 0 or last):
            print(f"step {step + 1:>5}  loss {losses[-1]:.4f}  acc {acc:.3f}  lr {lr_at(step):.2e}"
                  + (f"  scale {scale:g}" if args.dtype == "fp16" else ""), flush=True)
    total = time.perf_counter() - t0
    if not all(math.isfinite(v) for v in losses):
        if rank == 0:
            print("train.py: the loss is not finite", file=sys.stderr, flush=True)
        return 1
    tail = losses[-min(10, len(losses)):]
    if rank == 0:
        print(f"final loss {losses[-1]:.4f} (mean of the last {len(tail)}: {sum(tail) / len(tail):.4f}; chance "
              f"{chance:.4f}), accuracy {accs[-1]:.3f}; {args.steps} steps in {total:.2f} s "
              f"({1000 * sorted(step_times)[len(step_times) // 2]:.1f} ms/step median)"
              + (f"; replicated gradients identical on all {world} ranks ({checks} checks)" if checks else "")
              + (f"; {skipped} fp16 steps skipped" if skipped else ""), flush=True)
        if args.out:
            import torch as _t
            from tpattn.report import versions
            cfg = {k: v for k, v in vars(args).items() if k not in ("out", "plot", "compare", "tol")}
            rec = {"script": "scripts/train.py", "config": cfg, "world": world, "launcher": proc.launcher,
                   "dist_backend": proc.dist_backend, "device": device.type, "machine": machine(),
                   "threads": _t.get_num_threads(), "chance": chance, "loss": losses, "accuracy": accs,
                   "final_loss": losses[-1], "final_loss_mean10": sum(tail) / len(tail),
                   "final_accuracy": accs[-1], "seconds": total,
                   "ms_per_step_median": 1000 * sorted(step_times)[len(step_times) // 2],
                   "replicated_checks": checks, "fp16_skipped_steps": skipped,
                   "heads_per_rank": [len(Shard.of(args.heads, args.kv_heads, world, r, args.uneven_heads).head_range)
                                      for r in range(world)],
                   "versions": versions(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                   "commit": git_commit(), "command": shlex.join(sys.argv)}
            path = Path(args.out + ".json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(rec, indent=1) + "\n")
            print(f"wrote {path}", flush=True)
        if args.plot:
            plot_curves([(f"W={world}", {"loss": losses, "chance": chance, "config": vars(args)})], args.plot)
            print(f"wrote {args.plot}", flush=True)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
    except Refusal as exc:
        args, refused = None, str(exc)
    else:
        refused = None
    if args is not None and args.compare is not None:  # no ranks, no torch
        try:
            return compare(args)
        except Refusal as exc:
            print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
            return 2
    if refused is not None and not any(k in os.environ for k in LAUNCHED):
        print(f"train.py: error: {refused}", file=sys.stderr, flush=True)
        return 2
    import torch

    from tpattn import dist as tdist
    from tpattn.errors import ConfigError
    from tpattn.dist import LaunchError

    try:  # the launcher and the store first, so that a refusal is printed by every rank before any exits
        proc = tdist.discover()
    except ConfigError as exc:  # (discover makes every rank print its line before any exits)
        print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    timeout = args.timeout if args is not None else 60.0
    if refused is None and args.device == "cuda" and not torch.cuda.is_available():
        refused = (f"--kernel {args.kernel} --device cuda needs a CUDA GPU and none is visible; "
                   "use --kernel reference on CPU")
    device = torch.device("cpu")
    if refused is None:
        device = tdist.pick_device(proc, args.device)
        if args.device == "cpu":
            per_rank = max(1, len(os.sched_getaffinity(0)) // max(1, proc.local_world))
            torch.set_num_threads(args.threads or per_rank)
    try:
        tdist.rendezvous(proc, timeout)
    except LaunchError as exc:
        print(f"train.py: rank {proc.rank}: error: {exc}", file=sys.stderr, flush=True)
        tdist.exit_now(1)
    # every rank's arguments and refusal compared before any collective: the lowest rank's refusal, or the
    # arguments that differ, on every rank
    agreed, _ = tdist.agree(proc, {} if args is None else vars(args), refused, {}, timeout)
    refused = refused or agreed
    who = f"rank {proc.rank}: " if proc.world > 1 else ""
    code = 0
    if refused is None:
        backend = args.dist_backend
        if backend == "auto":  # nccl needs a GPU of its own per rank (DESIGN.md, rule 5)
            backend = "nccl" if args.device == "cuda" and proc.local_world <= torch.cuda.device_count() else "gloo"
        proc.dist_backend = backend if proc.distributed else "none"
        proc.device = device
        try:
            if proc.distributed:
                tdist.init_process_group(proc, backend, device, timeout)
            code = train(args, proc)
        except Refusal as exc:
            refused = str(exc)
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    if refused is not None:
        print(f"train.py: {who}error: {refused}", file=sys.stderr, flush=True)
        code = 2
    tdist.leave(proc, timeout, code)  # no rank exits before every rank has printed its line
    tdist.exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
