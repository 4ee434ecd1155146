#!/usr/bin/env python3
"""The layer's training step on one GPU beside the plain PyTorch layer, in one run: forward +
backward of tpattn's TensorParallelAttention (one rank: the whole layer) and of a plain layer
(QKV Linear, torch SDPA with the flash or cuDNN backend, output Linear) with the same weights,
input and upstream gradient.

Per layer: fwd+bwd ms (CUDA events around y = layer(x); y.backward(dy), gradients set to None
outside the timed interval; median over --iters after --warmup), and the forward alone under
torch.no_grad() (the inference path). --rounds R measures every layer R times, the layers taking
turns (so that a clock drop under the power cap lands on each), and reports the median of the
rounds; `/ cuDNN` is a row's step over the plain cuDNN layer's; host ms, the time the call takes to
return (its launches queued). tpattn's layer runs with its default backward and with deterministic=True;
with --graph (default) each default layer's step also runs captured in one CUDA graph (tpattn's
through `layer.graphed(x, dy=dy)`). Writes PREFIX.json and PREFIX.md (--out, default
benchmarks/train_h200): GPU, versions, command, date (UTC), commit. --profile K also lists, for tpattn's
default layer and the plain cuDNN layer, the GPU kernels of one eager step (torch.profiler, the mean of
five steps): the K longest by GPU time, with their launches per step, and the whole step's kernel time;
--host-profile K the K Python functions that take the host longest in an eager step (cProfile).

    PYTHONPATH=. python scripts/bench_train.py [--seq-len 4096] [--heads 32] [--kv-heads G] [--head-dim 128]
        [--batch B] [--dtype fp16|bf16] [--kernel fused] [--causal] [--rounds 3] [--no-graph] [--profile K] [--host-profile K] [--commit SHA] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tpattn.graphs import step_graph  # noqa: E402
from tpattn.layer import TensorParallelAttention  # noqa: E402
from tpattn.report import versions  # noqa: E402
from tpattn.weights import head_weights, layer_input  # noqa: E402


class Plain(torch.nn.Module):
    """QKV Linear, SDPA, output Linear: the layer as PyTorch users write it (GQA: SDPA's enable_gqa)."""

    def __init__(self, w: dict, heads: int, causal: bool, sdpa):
        super().__init__()
        self.h, self.causal, self.sdpa = heads, causal, sdpa
        self.qkv = torch.nn.Parameter(torch.cat([w["wq"], w["wk"], w["wv"]], 1).detach().clone())
        self.bqkv = torch.nn.Parameter(torch.cat([w["bq"], w["bk"], w["bv"]]).detach().clone())
        self.wo = torch.nn.Parameter(w["wo"].detach().clone())
        self.bo = torch.nn.Parameter(w["bo"].detach().clone())
        self.g = w["wk"].shape[1] * heads // w["wq"].shape[1]

    def forward(self, x):
        B, N, D = x.shape
        d = D // self.h
        qkv = torch.addmm(self.bqkv, x.view(B * N, D), self.qkv).view(B, N, self.h + 2 * self.g, d).transpose(1, 2)
        q, k, v = qkv.split([self.h, self.g, self.g], dim=1)
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel([self.sdpa]):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=self.g != self.h)
        return torch.addmm(self.bo, o.transpose(1, 2).reshape(B * N, D), self.wo).view(B, N, D)


def median_ms(fn, warmup: int, iters: int, params) -> tuple[float, float]:
    """(GPU ms, host ms): the medians of the CUDA-event interval around fn() and of the host's time
    to return from fn() (everything queued, nothing waited for)."""
    ts, hs = [], []
    for i in range(warmup + iters):
        for p in params:
            p.grad = None
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        host = (time.perf_counter() - t0) * 1e3
        b.record()
        b.synchronize()
        if i >= warmup:
            ts.append(a.elapsed_time(b))
            hs.append(host)
    return statistics.median(ts), statistics.median(hs)


def host_table(step, params, steps: int = 20) -> list[tuple[str, int, float, float]]:
    """(function, calls per step, own host us per step, cumulative host us per step) of the Python
    functions step() runs, by their own time, longest first: cProfile over `steps` eager steps after
    three unprofiled (what the host spends issuing a step). The steps run back to back unsynchronized,
    as training runs them: a launch that waits for room in a full launch queue is charged to its
    caller, and cProfile's own cost inflates every call (compare functions, not totals)."""
    import cProfile
    import pstats
    for _ in range(3):
        for q in params:
            q.grad = None
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        for q in params:
            q.grad = None
        step()
    prof.disable()
    rows = []
    for (file, line, fn), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():
        where = f"{Path(file).name}:{line}({fn})" if file != "~" else fn
        rows.append((where, round(calls / steps), own / steps * 1e6, cum / steps * 1e6))
    return sorted(rows, key=lambda r: -r[2])


def kernel_table(step, params, steps: int = 5) -> list[tuple[str, float, float]]:
    """(kernel, launches per step, GPU us per step) of every GPU activity of step(), longest first: the
    mean over `steps` eager steps under torch.profiler (CUDA activity only), after three unprofiled."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        for q in params:
            q.grad = None
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            for q in params:
                q.grad = None
            step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = e.self_cuda_time_total
        if us > 0:
            rows.append((e.key, e.count / steps, us / steps))
    return sorted(rows, key=lambda r: -r[2])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads G (default: the heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--kernel", default="fused")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="turns each layer takes, alternating (default 3)")
    p.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                   help="also time each layer's step captured in one CUDA graph (default on)")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="list the K longest GPU kernels of one eager step of tpattn's layer and the plain cuDNN layer")
    p.add_argument("--host-profile", type=int, default=0, metavar="K",
                   help="list the K Python functions that take the host longest in an eager step of tpattn's "
                        "layer and the plain cuDNN layer (cProfile)")
    p.add_argument("--commit", default=None, help="the commit to record (default: git rev-parse here)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "train_h200"))
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_train.py needs a CUDA GPU (none is visible to torch); run it on a GPU machine", file=sys.stderr)
        return 2
    from torch.nn.attention import SDPBackend
    dev, dt = torch.device("cuda"), {"fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    B, N, H, d = a.batch, a.seq_len, a.heads, a.head_dim
    G = a.kv_heads or H
    D = H * d
    w = head_weights(range(H), H, d, 0, dt, dev, kv_heads=range(G))
    x = layer_input(B, N, D, 0, dt, dev)
    dy = layer_input(B, N, D, 1, dt, dev)
    xg = x.clone().requires_grad_(True)
    layers = {}
    for det in (False, True):
        layers[f"tpattn {a.kernel}" + (" deterministic" if det else "")] = TensorParallelAttention(
            **w, heads=H, kv_heads=G, head_dim=d, backend=a.kernel, causal=a.causal, group=None, deterministic=det)
    for name, be in (("plain flash", SDPBackend.FLASH_ATTENTION), ("plain cuDNN", SDPBackend.CUDNN_ATTENTION)):
        layers[name] = Plain(w, H, a.causal, be)
    # name -> (training step, inference forward or None, the module); what runs inside, per row
    runs = {name: ((lambda m=m: m(xg).backward(dy)), (lambda m=m: m(x)), m) for name, m in layers.items()}

    if a.graph:  # the whole step in one CUDA graph, each layer its own copy (the graph keeps its tensors)
        for name, m in list(layers.items()):
            if "deterministic" in name:
                continue
            g = m.replace() if hasattr(m, "replace") else Plain(w, H, a.causal, m.sdpa)
            try:
                runs[f"{name} graphed"] = (step_graph(g, xg, dy), None, g)
            except RuntimeError as exc:
                runs[f"{name} graphed"] = (None, str(exc).splitlines()[0][:160], g)
    times = {name: {"train": [], "host": [], "fwd": []} for name in runs}
    skipped = {name: r[1] for name, r in runs.items() if r[0] is None}
    for _ in range(a.rounds):
        for name, (train, fwd, m) in runs.items():
            if name in skipped:
                continue
            params = [xg, *m.parameters()]
            try:
                ms, host = median_ms(train, a.warmup, a.iters, params)
                times[name]["train"].append(ms)
                times[name]["host"].append(host)
                if fwd is not None:
                    with torch.no_grad():
                        times[name]["fwd"].append(median_ms(fwd, a.warmup, a.iters, [])[0])
            except RuntimeError as exc:
                skipped[name] = str(exc).splitlines()[0][:160]
    base = statistics.median(times["plain cuDNN"]["train"]) if "plain cuDNN" not in skipped else None
    rows = []
    for name in runs:
        if name in skipped:
            rows.append({"layer": name, "skipped": skipped[name]})
            continue
        train, host = statistics.median(times[name]["train"]), statistics.median(times[name]["host"])
        fwd = statistics.median(times[name]["fwd"]) if times[name]["fwd"] else None
        rows.append({"layer": name, "fwd_ms": round(fwd, 4) if fwd else None, "fwd_bwd_ms": round(train, 4),
                     "host_ms": round(host, 4), "rounds_ms": [round(t, 4) for t in times[name]["train"]],
                     "x_cudnn": round(train / base, 3) if base else None})
        print(f"{name:<36} forward {f'{fwd:8.3f}' if fwd else '       -'} ms   forward + backward {train:8.3f} ms"
              f"   host {host:7.3f} ms{f'   / cuDNN {train / base:.3f}' if base else ''}", flush=True)
    profiles = {}
    for name in (f"tpattn {a.kernel}", "plain cuDNN") if a.profile else ():
        if name in skipped:
            continue
        table = kernel_table(runs[name][0], [xg, *layers[name].parameters()])
        profiles[name] = {"total_us": round(sum(r[2] for r in table), 1),
                          "kernels": [{"kernel": k[:120], "per_step": round(c, 2), "us": round(us, 1)}
                                      for k, c, us in table[:a.profile]]}
        print(f"{name}: GPU kernels of one eager step, {profiles[name]['total_us']:.1f} us in all", flush=True)
        for r in profiles[name]["kernels"]:
            print(f"  {r['us']:9.1f} us  x{r['per_step']:<5g} {r['kernel'][:100]}", flush=True)
    hosts = {}
    for name in (f"tpattn {a.kernel}", "plain cuDNN") if a.host_profile else ():
        if name in skipped:
            continue
        table = host_table(runs[name][0], [xg, *layers[name].parameters()])
        hosts[name] = [{"function": f, "calls": c, "own_us": round(own, 1), "cum_us": round(cum, 1)}
                       for f, c, own, cum in table[:a.host_profile]]
        print(f"{name}: host time of one eager step by function (cProfile, own us, cumulative us, calls)", flush=True)
        for r in hosts[name]:
            print(f"  {r['own_us']:8.1f} {r['cum_us']:9.1f}  x{r['calls']:<4} {r['function'][:100]}", flush=True)
    commit = a.commit or (subprocess_out(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]) or "unknown")
    res = {"gpu": torch.cuda.get_device_name(), "versions": versions(), "command": shlex.join(["python", *sys.argv]),
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit,
           "shape": {"B": B, "N": N, "H": H, "G": G, "d": d, "dtype": a.dtype, "causal": a.causal}, "rows": rows}
    if profiles:
        res["profiles"] = profiles
    if hosts:
        res["host_profiles"] = hosts
    Path(a.out + ".json").write_text(json.dumps(res, indent=2))
    md = ["# Training step on one GPU: tpattn beside the plain PyTorch layer", "",
          f"{res['date']}, {res['gpu']}, commit {commit}; torch {res['versions'].get('torch')}. Command: `{res['command']}`.",
          f"B={B} N={N} H={H} G={G} d={d} {a.dtype}{' causal' if a.causal else ''}; per round the median of {a.iters} "
          f"after {a.warmup} warm-up, the median of {a.rounds} rounds (layers alternating).", "",
          "Host ms: the time until the step's call returns (its launches queued); \"graphed\": the step in one CUDA "
          "graph (tpattn: `layer.graphed(x, dy=dy)`).", "",
          "| layer | forward ms (no_grad) | forward + backward ms | host ms | / cuDNN | rounds ms |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['layer']} | {r.get('fwd_ms') or '-'} | {r.get('fwd_bwd_ms', r.get('skipped', '-'))} | "
           f"{r.get('host_ms', '-')} | {r.get('x_cudnn') or '-'} | {', '.join(map(str, r.get('rounds_ms', [])))} |"
           for r in rows]
    for name, prof in profiles.items():
        md += ["", f"{name}: the GPU kernels of one eager step (torch.profiler, mean of 5 steps), "
                   f"{prof['total_us']} us in all", "", "| kernel | launches per step | us per step |", "|---|---|---|"]
        md += [f"| `{r['kernel']}` | {r['per_step']} | {r['us']} |" for r in prof["kernels"]]
    for name, prof in hosts.items():
        md += ["", f"{name}: host time of one eager step by Python function (cProfile, mean of 20 steps)", "",
               "| function | calls per step | own us | cumulative us |", "|---|---|---|---|"]
        md += [f"| `{r['function']}` | {r['calls']} | {r['own_us']} | {r['cum_us']} |" for r in prof]
    Path(a.out + ".md").write_text("\n".join(md) + "\n")
    return 0


def subprocess_out(cmd) -> str | None:
    import subprocess
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip() or None
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
