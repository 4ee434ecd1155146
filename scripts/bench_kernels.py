#!/usr/bin/env python3
"""Kernel benchmark: the kernel ladder (naive three passes, tiled three passes, fused; triton, the
fused algorithm in OpenAI Triton, where triton is installed), pass by pass, beside torch's
materialized attention (matmul, softmax, matmul) and torch SDPA's backends, in one run.

For each kernel and shape: ms, TFLOP/s (4*B*H*N^2*d, halved when causal), GB/s (bytes it must
move), the ratio to the memory floor of the three-pass algorithm (S and P written and read once,
at the measured copy bandwidth), and the peak device memory the call allocates beyond its inputs
(torch.cuda.max_memory_allocated after reset_peak_memory_stats): N^2 for the three-pass rungs, N
for the fused kernel and SDPA. triton's first call (compile, or load from Triton's disk cache,
and autotune) is timed apart, before any of that, and shown as `first call s`. Writes
benchmarks/kernels[_causal].json and .md (GPU, versions, command).

    PYTHONPATH=. python scripts/bench_kernels.py [--seq-lens 1024 2048 4096 8192] [--heads 1 32]
        [--causal] [--kernels naive tiled fused ...] [--fused-configs 2:w4_m2_c32 h]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tpattn.attention import get_backend  # noqa: E402
from tpattn.report import versions  # noqa: E402
from tpattn.timing import Timer, recording  # noqa: E402

TARGET_NAIVE_MS = 6.2  # one head, N=4096, d=128, fp16: the seed reports 5.75 ms on an H100


def shape(name, b, h, n, d, kv=None, dtype="fp16", causal=False) -> dict:
    return {"name": name, "batch": b, "heads": h, "kv_heads": kv or h, "seq_len": n, "head_dim": d,
            "dtype": dtype, "causal": causal}


# --shapes users: shapes people run, off the default one (the fused kernel against cuDNN on each)
SHAPE_SETS = {"users": [
    shape("default", 1, 32, 4096, 128),
    shape("default causal", 1, 32, 4096, 128, causal=True),
    shape("ViT-B/16", 256, 12, 197, 64),
    shape("ViT-L/14", 128, 16, 257, 64),
    shape("d64 long", 1, 64, 4096, 64),
    shape("d64 causal", 2, 32, 4096, 64, causal=True),
    shape("GQA bf16 causal", 4, 32, 2048, 128, kv=8, dtype="bf16", causal=True),
    shape("GQA bf16", 4, 32, 2048, 128, kv=8, dtype="bf16"),
    shape("long causal", 1, 32, 16384, 128, causal=True),
    shape("batch short", 8, 16, 1024, 128),
    shape("batch short causal", 8, 16, 1024, 128, causal=True),
    shape("d96 (Phi)", 1, 32, 4096, 96),
    shape("d96 causal", 1, 32, 4096, 96, causal=True),
    shape("d256 GQA bf16 causal (Gemma)", 1, 16, 4096, 256, kv=8, dtype="bf16", causal=True),
    shape("d256", 1, 32, 4096, 256),
    shape("d256 causal", 1, 32, 4096, 256, causal=True),
    shape("d192", 1, 32, 4096, 192),
    shape("d192 causal", 1, 32, 4096, 192, causal=True),
]}


def sh(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=Path(__file__).resolve().parents[1])
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit(given: str | None) -> str:
    """The short commit of the tree, '+ uncommitted changes' when tracked files differ from it; `given`
    (--commit) first where the tree is a copy whose .git is not the one it came from."""
    head = sh(["git", "rev-parse", "--short", "HEAD"])
    here = "no git checkout here" if head is None else head + (
        " + uncommitted changes" if sh(["git", "status", "--porcelain", "--untracked-files=no"]) else "")
    return f"{given} (given with --commit; git here: {here})" if given else here


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, GB/s counting bytes read and written."""
    a = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return 2 * a.numel() * 2 / (statistics.median(times) * 1e-3) / 1e9


@contextmanager
def env_set(env: dict):
    """The environment variables in env set inside the block, put back after it."""
    old = {var: os.environ.get(var) for var in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for var, value in old.items():
            if value is None:
                os.environ.pop(var)
            else:
                os.environ[var] = value


def timed(fn, warmup: int, iters: int) -> dict:
    """Median (and min, max) ms per named section over iterations; fn(timer) runs once."""
    timer = Timer(torch.device("cuda"))
    for _ in range(warmup):
        with recording(timer):
            fn(timer)
        timer.collect()
    samples: dict[str, list[float]] = {}
    for _ in range(iters):
        with timer.section("total"), recording(timer):  # the backends time their passes on it
            fn(timer)
        for k, v in timer.collect().items():
            samples.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in samples.items()}


def captured(fn):
    """fn(None) captured in a CUDA graph (after a warm-up call off the capture: compiles,
    workspaces), replayed once; None where torch cannot capture the call."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(None)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(None)
        g.replay()
        return g
    except Exception:  # noqa: BLE001 - a call torch cannot capture: no graph time for it
        torch.cuda.synchronize()
        return None


def replays_ms(g, iters: int) -> float:
    """ms per replay of graph g, `iters` replays back to back between two events."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / iters


def steady_ms(fn, iters: int, seconds: float, window: float = 0.0) -> float | None:
    """graph_ms in the power-capped steady state: the graph replayed for `seconds` first (the H200's
    power takes about a second of sustained load to settle at its 700 W cap, the clock dipping once on
    the way), then `window` seconds of replays (at least `iters`) timed. Every kernel is timed after its
    own load, so the order of a comparison no longer decides its clock, and over a window long enough
    that one dip of the clock does not decide it either."""
    g = captured(fn)
    if g is None:
        return None
    per = replays_ms(g, 10)
    replays_ms(g, max(1, math.ceil(seconds * 1e3 / per)))
    return replays_ms(g, max(iters, math.ceil(window * 1e3 / per)))


def graph_ms(fn, iters: int, pause: float = 0.0) -> float | None:
    """GPU time per call with the host out of the way: one call captured in a CUDA graph, replayed
    `iters` times back to back between two events. For SDPA that is its kernels' time, which the call
    time (`ms`) hides behind torch's dispatch; ours the same. None where the call cannot be captured.
    A short run after a pause runs at the boost clock, a long one at the power cap's (on the H200
    1.98 against ~1.65 GHz: 12.5 % less time at the default shape; scripts/power_probe.py): compare kernels
    measured the same way, and see docs/kernels.md ("Measuring under the power cap"). `pause`: the GPU
    left idle that many seconds between the capture and the timed replays, so that every kernel starts
    them from the same state (the boost clock) instead of from whatever the kernel before it left."""
    g = captured(fn)
    if g is None:
        return None
    if pause > 0:
        torch.cuda.synchronize()
        time.sleep(pause)
    return replays_ms(g, iters)


def peak_bytes(fn) -> int:
    """Device memory one call allocates at its peak, beyond what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    timer = Timer(torch.device("cuda"))
    with recording(timer):
        out = fn(timer)
    timer.collect()
    del out
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def triton_available() -> bool:
    """--kernel triton can run here (the triton package imports)."""
    from tpattn.attention.triton_fused import triton_available as available
    return available()


def first_call_s(fn) -> float:
    """Seconds of fn's first call, synchronized: for triton, compile (or load from ~/.triton/cache)
    and autotune; later calls reuse both."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(None)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def materialized(q, k, v, causal, timer):
    scale = 1.0 / math.sqrt(q.shape[-1])
    with timer.section("qk"):
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        if causal:
            n = q.shape[-2]
            s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    with timer.section("softmax"):
        p = torch.softmax(s, dim=-1)
    with timer.section("pv"):
        return torch.matmul(p, v)


def sdpa_backends() -> dict:
    from torch.nn.attention import SDPBackend
    out = {}
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        if hasattr(SDPBackend, name):
            out["sdpa_" + name.split("_")[0].lower()] = getattr(SDPBackend, name)
    return out


def shapes_of(args) -> list[dict]:
    """The named set (--shapes), or every --heads x --seq-lens with the other options."""
    if args.shapes:
        return SHAPE_SETS[args.shapes]
    return [shape(f"H={h} N={n}", args.batch, h, n, args.head_dim, args.kv_heads, args.dtype, args.causal)
            for h in args.heads for n in args.seq_lens]


def run(args) -> dict:
    from torch.nn.attention import sdpa_kernel
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    rows = []
    naive, tiled, fused = get_backend("naive"), get_backend("tiled"), get_backend("fused")
    triton_rung = get_backend("triton") if triton_available() else None
    if triton_rung is None and (not args.kernels or "triton" in args.kernels):
        print("  triton: skipped (the triton package is not installed)", flush=True)

    def with_env(env: dict, backend):
        """backend.forward with the environment variables in env set for the call."""
        def fn(t, q, k, v, causal):
            with env_set(env):
                return backend.forward(q, k, v, causal)
        return fn

    def fused_cfg(cfg):
        """A fused kernel by shorthand: 2:w4_m2_c32 is fused2_{suf}_d{d}_w4_m2_c32, h is fusedh_{suf}_d{d}
        (wgmma, compute capability 9.0 only), w is fusedw_{suf}_d{d} (warp-specialized, TMA; 9.0 only),
        w:sms, w:static and w:tiles that one with its grid forced persistent (causal tiles from a
        counter), persistent in a fixed order, or a block per tile"""
        ver, _, rest = cfg.partition(":")
        if ver not in ("2", "h", "w") or (ver == "w" and rest not in ("", "sms", "static", "tiles")) or (
                ver == "h" and rest):
            raise SystemExit(f"--fused-configs {cfg}: use 2:wW_mM_cC, h, w, w:sms, w:static or w:tiles")
        env = {"TPATTN_FUSED_CFG": "fused2_{suf}_d{d}_" + rest if ver == "2" else f"fused{ver}_{{suf}}_d{{d}}"}
        if ver == "w" and rest:
            env["TPATTN_FUSED_GRID"] = rest
        return with_env(env, fused)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    for sp in shapes_of(args):
        b, h, kvh, n, d, causal = sp["batch"], sp["heads"], sp["kv_heads"], sp["seq_len"], sp["head_dim"], sp["causal"]
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[sp["dtype"]]
        el = torch.empty((), dtype=dtype).element_size()
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, h, n, d, device="cuda", generator=g, dtype=dtype)
        k, v = (torch.randn(b, kvh, n, d, device="cuda", generator=g, dtype=dtype) for _ in range(2))
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        sp_bytes = b * h * n * n * el
        qkvo = 2 * b * (h + kvh) * n * d * el  # Q and O, K and V
        floor_ms = 4 * sp_bytes / (bw * 1e9) * 1e3   # S written + read, P written + read
        kernels = {
            "naive": (lambda t: naive.forward(q, k, v, causal), 4 * sp_bytes + qkvo),
            "tiled": (lambda t: tiled.forward(q, k, v, causal), 4 * sp_bytes + qkvo),
            "fused": (lambda t: fused.forward(q, k, v, causal), qkvo),
            "torch_materialized": (lambda t: materialized(q, k, v, causal, t), 4 * sp_bytes + qkvo),
        }
        if triton_rung is not None:
            kernels["triton"] = (lambda t: triton_rung.forward(q, k, v, causal), qkvo)
        if hopper:  # the mma.sync QK and PV passes beside the wgmma ones tiled runs here
            kernels["tiled[mma]"] = (lambda t, fn=with_env({"TPATTN_TILED_IMPL": "mma"}, tiled): fn(t, q, k, v, causal),
                                     4 * sp_bytes + qkvo)
        for cfg in args.fused_configs:
            kernels[f"fused[{cfg}]"] = (lambda t, fn=fused_cfg(cfg): fn(t, q, k, v, causal), qkvo)
        for name, backend in sdpa_backends().items():
            def fn(t, backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kvh != h)
            kernels[name] = (fn, qkvo)
        for name, (fn, nbytes) in kernels.items():
            if args.kernels and name.split("[")[0] not in args.kernels:
                continue
            try:
                first = first_call_s(fn) if name == "triton" else None  # before peak_bytes: the autotune allocates
                mem = peak_bytes(fn)
                t = timed(fn, args.warmup, args.iters)
            except (RuntimeError, ValueError) as exc:  # a backend that does not support this shape
                print(f"  {name:<20} {sp['name']:<20} skipped: {str(exc).splitlines()[0][:80]}", flush=True)
                continue
            ms = t["total"]
            gms = graph_ms(fn, args.iters, args.pause) if name.startswith(("fused", "sdpa", "triton")) else None
            row = {"kernel": name, "shape": sp["name"], "batch": b, "heads": h, "kv_heads": kvh, "seq_len": n,
                   "head_dim": d, "dtype": sp["dtype"], "causal": causal, "ms": ms, "graph_ms": gms,
                   "graph_tflops": flops / (gms * 1e-3) / 1e12 if gms else None,
                   "passes_ms": {p: t[p] for p in ("qk", "softmax", "pv", "fused") if p in t},
                   "tflops": flops / (ms * 1e-3) / 1e12, "gbps": nbytes / (ms * 1e-3) / 1e9,
                   "floor_ms": floor_ms, "x_floor": ms / floor_ms, "peak_bytes": mem, "first_call_s": first}
            if args.steady and gms and name in ("fused", "sdpa_cudnn", "sdpa_flash"):
                row["graph_ms_steady"] = steady_ms(fn, args.iters, args.steady, args.steady_window)
            rows.append(row)
            passes = " ".join(f"{p} {x:.3f}" for p, x in row["passes_ms"].items())
            graph = f"  graph {gms:.3f} ms {row['graph_tflops']:.1f} TFLOP/s" if gms else ""
            if row.get("graph_ms_steady"):
                graph += f"  steady {row['graph_ms_steady']:.4f} ms"
            fc = f"  first call {first:.2f} s" if first is not None else ""
            print(f"  {name:<20} {sp['name']:<20} {ms:9.3f} ms  {row['tflops']:7.1f} TFLOP/s "
                  f"{row['gbps']:8.0f} GB/s  {row['x_floor']:6.2f}x floor  {mem / 2**20:9.1f} MiB  {passes}{graph}{fc}",
                  flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(), "copy_GBps": bw, "versions": versions(),
            "command": "python " + shlex.join(sys.argv), "commit": git_commit(args.commit),
            "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "pause_s": args.pause,
            "steady_s": args.steady, "steady_window_s": args.steady_window if args.steady else None, "rows": rows}


def _num(x: float | None, places: int = 3) -> str:
    return "-" if x is None else f"{x:.{places}f}"


def ratios(res: dict) -> str:
    """Per shape: the fused kernel's graph time beside SDPA cuDNN's and flash's, and cuDNN / fused."""
    by = {}
    for r in res["rows"]:
        by.setdefault(r["shape"], {})[r["kernel"]] = r
    steady = any(r.get("graph_ms_steady") for r in res["rows"])
    lines = ["| shape | B | H | G | N | d | dtype | causal | fused graph ms | cuDNN graph ms | flash graph ms "
             "| cuDNN / fused | flash / fused |" + (" fused steady ms | cuDNN steady ms | flash steady ms | "
                                                  "cuDNN / fused steady | flash / fused steady |" if steady else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|---|---|" if steady else "")]
    cudnn_over_fused, steady_ratios = [], []
    for name, ks in by.items():
        f = ks.get("fused")
        if not f or not f.get("graph_ms"):
            continue
        c, fl = (ks.get(x, {}).get("graph_ms") for x in ("sdpa_cudnn", "sdpa_flash"))
        rc = c / f["graph_ms"] if c else None
        if rc is not None:
            cudnn_over_fused.append(rc)
        lines.append(f"| {name} | {f['batch']} | {f['heads']} | {f['kv_heads']} | {f['seq_len']} | {f['head_dim']} "
                     f"| {f['dtype']} | {'yes' if f['causal'] else 'no'} | {_num(f['graph_ms'])} | {_num(c)} "
                     f"| {_num(fl)} | {_num(rc, 2)} | {_num(fl / f['graph_ms'] if fl else None, 2)} |")
        if steady:
            fs, cs, ls = (ks.get(x, {}).get("graph_ms_steady") for x in ("fused", "sdpa_cudnn", "sdpa_flash"))
            rs = cs / fs if cs and fs else None
            if rs is not None:
                steady_ratios.append(rs)
            lines[-1] += (f" {_num(fs, 4)} | {_num(cs, 4)} | {_num(ls, 4)} | {_num(rs, 2)} "
                          f"| {_num(ls / fs if ls and fs else None, 2)} |")
    pause, window = res.get("pause_s"), res.get("steady_window_s")
    if cudnn_over_fused:
        after = f", each kernel's replays timed after {pause:g} s idle" if pause else ""
        lines += ["", f"Lowest cuDNN / fused ratio: {min(cudnn_over_fused):.2f} (graph time, same run{after})."]
    if steady_ratios:
        timed = f"{window:g} s of" if window else "its"
        load = f"{res['steady_s']:g} s" if res.get("steady_s") else "--steady seconds"
        lines += [f"Lowest cuDNN / fused ratio in the steady state: {min(steady_ratios):.2f} (each kernel's graph "
                  f"replayed for {load} before {timed} timed replays: the clock the power cap holds)."]
    return "\n".join(lines)


def markdown(res: dict, target: float) -> str:
    lines = [f"# Kernel benchmark on {res['gpu']}", "",
             f"Command: `{res['command']}`  ", f"Date: {res.get('date_utc', '-')}; commit: {res.get('commit', '-')}  ",
             f"Versions: {res['versions']}  ",
             f"Measured copy bandwidth: {res['copy_GBps']:.0f} GB/s (read + write). Floor = S and P each "
             "written and read once at that bandwidth.", "",
             "Memory = peak device memory the call allocates beyond its inputs. G = K/V heads.", "",
             "`ms`: CUDA events around the whole Python call. `graph ms`: the call captured in a CUDA graph and "
             "replayed back to back, the GPU's time without the host's (for SDPA, its kernels). `first call s`: "
             "triton's first call (compile or disk-cache load, and autotune), timed apart.", "",
             "| kernel | shape | B | H | G | N | d | dtype | causal | ms | qk / softmax / pv ms | TFLOP/s | graph ms "
             "| graph TFLOP/s | GB/s | x floor | memory MiB | first call s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    if any(r.get("shape") for r in res["rows"]) and any(r["kernel"] == "sdpa_cudnn" for r in res["rows"]):
        lines[-2:-2] = ["Graph time, fused against SDPA's cuDNN and flash backends (ratio > 1: fused is faster):",
                        "", ratios(res), ""]
    for r in res["rows"]:
        p = " / ".join(f"{x:.3f}" for x in r["passes_ms"].values()) or "-"
        g = f"{r['graph_ms']:.3f} | {r['graph_tflops']:.1f}" if r.get("graph_ms") else "- | -"
        lines.append(f"| {r['kernel']} | {r.get('shape', '-')} | {r['batch']} | {r['heads']} | {r.get('kv_heads', r['heads'])} "
                     f"| {r['seq_len']} | {r['head_dim']} | {r['dtype']} | {'yes' if r['causal'] else 'no'} "
                     f"| {r['ms']:.3f} | {p} | {r['tflops']:.1f} "
                     f"| {g} | {r['gbps']:.0f} | {r['x_floor']:.2f} | {r.get('peak_bytes', 0) / 2**20:.1f} "
                     f"| {'-' if r.get('first_call_s') is None else format(r['first_call_s'], '.2f')} |")
    one = [r for r in res["rows"] if r["kernel"] == "naive" and r["heads"] == 1 and r["seq_len"] == 4096
           and r["head_dim"] == 128 and not r["causal"]]
    if one:
        ok = one[0]["ms"] <= target
        lines += ["", f"Target: naive, one head, N=4096, d=128: {one[0]['ms']:.3f} ms "
                      f"({'meets' if ok else 'MISSES'} <= {target} ms; the seed reports 5.75 ms on an H100)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192],
                   help="sequence lengths (default 1024 2048 4096 8192)")
    p.add_argument("--heads", type=int, nargs="+", default=[1, 32], help="head counts (default 1 32)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--batch", type=int, default=1, help="batch (default 1)")
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (grouped-query attention; default --heads)")
    p.add_argument("--shapes", choices=sorted(SHAPE_SETS), default=None,
                   help="a named set of shapes instead of --heads x --seq-lens (users: ViT, d=64, GQA bf16, long "
                        "causal, short sequences in large batches, the default shape); the .md adds the fused "
                        "kernel's graph time against SDPA cuDNN's and flash's")
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"], help="default fp16")
    p.add_argument("--causal", action="store_true", help="causal attention")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2)")
    p.add_argument("--iters", type=int, default=10, help="timed calls, the median kept (default 10)")
    p.add_argument("--steady", type=float, default=0.0, metavar="S",
                   help="also time fused and SDPA in the power-capped steady state: each graph replayed for S "
                        "seconds before --steady-window seconds of timed replays (the .md's steady columns; "
                        "default 0: off)")
    p.add_argument("--steady-window", type=float, default=0.5, metavar="W",
                   help="seconds of replays the steady columns time (at least --iters; default 0.5: long enough "
                        "that the clock's one dip as the power reaches its cap does not decide a kernel's time)")
    p.add_argument("--pause", type=float, default=0.0, metavar="P",
                   help="seconds the GPU is left idle before each fused, SDPA and triton graph time of the line, so "
                        "that every kernel's replays start from the same clock (default 0: right after the "
                        "kernel before it, at whatever clock that load left)")
    p.add_argument("--kernels", nargs="+", default=None,
                   help="rows to run (default all): naive tiled fused triton torch_materialized sdpa_flash "
                        "sdpa_cudnn sdpa_efficient")
    p.add_argument("--fused-configs", nargs="*", default=[], metavar="2:wW_mM_cC|h|w[:GRID]",
                   help="extra fused rows (a sweep): 2:wW_mM_cC is the mma.sync kernel with W warps per block, "
                        "M m16 row tiles per warp and C keys per tile (see tpattn/attention/fused.py), "
                        "e.g. 2:w4_m2_c32; h is the wgmma kernel (compute capability 9.0); w the warp-specialized "
                        "one, w:sms, w:static or w:tiles with its grid forced (see TPATTN_FUSED_GRID)")
    p.add_argument("--out", default="benchmarks", help="folder for kernels.json and kernels.md")
    p.add_argument("--name", default=None, help="file stem of the .json and .md (default kernels, kernels_causal; "
                                                 "fused_shapes with --shapes)")
    p.add_argument("--commit", default=None,
                   help="the commit to record, for a tree copied to another machine whose .git differs")
    args = p.parse_args()
    seconds = {"--steady": args.steady, "--steady-window": args.steady_window, "--pause": args.pause}
    bad = [f"{flag} {v:g}" for flag, v in seconds.items() if not (math.isfinite(v) and v >= 0)]
    if bad:
        print(f"bench_kernels: {', '.join(bad)}: seconds are a finite number, 0 or more", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU (and CuPy); nothing to measure here", file=sys.stderr)
        return 2
    res = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or ("fused_shapes" if args.shapes else "kernels" + ("_causal" if args.causal else ""))
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    (out / f"{stem}.md").write_text(markdown(res, TARGET_NAIVE_MS))
    print(markdown(res, TARGET_NAIVE_MS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
