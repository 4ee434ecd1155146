#!/usr/bin/env python3
"""Where the layer's host time goes: the Python call of one eager forward, per rank.

    mpirun -n 2 python scripts/model/host_probe.py --kernels fused tiled --seq-lens 2048 4096
    mpirun --bind-to none -n 2 python scripts/model/host_probe.py ...   # the same, ranks not pinned to a core

For each kernel and N, the W-rank layer (tpattn.model.measure.build_layer over the NCCL group):
  * the host time of --iters un-spun calls (each after a synchronize, as tpattn.model.measure.time_layer's
    first call): p10, median, p90 per rank, ms;
  * the same calls queued behind a GPU spin (the GPU busy while the host launches: a host time that
    changes here waits on the GPU somewhere);
  * the un-spun calls back to back against interleaved with an instrumented call (as time_layer and
    python -m tpattn time them), in alternating blocks of --iters/3;
  * the host cost of the pieces alone, median over 200 calls, microseconds: the QKV GEMM, the
    attention launch, the output GEMM, each collective, the bias pass;
  * with --watch, the un-spun calls again with the collective watch running (python -m tpattn's);
  * with --profile, cProfile of rank 0's calls (with --watch: watched), the functions with the most
    own time.
The CPU cores each rank may run on are printed first (mpirun binds ranks to cores by default).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tpattn import watch  # noqa: E402
from tpattn.model import errors, measure  # noqa: E402


def pct(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))]


def host_calls(layer, x, iters: int, spin_ms: float = 0.0) -> list[float]:
    import torch
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        if spin_ms:
            torch.cuda._sleep(int(spin_ms * measure._SLEEP_CYCLES_PER_MS))
        t0 = time.perf_counter()
        layer(x)
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return out


def host_interleaved(layer, x, iters: int) -> list[float]:
    """The un-spun call's host time as tpattn.model.measure.time_layer (and python -m tpattn) measure it: each
    un-spun call follows the previous iteration's instrumented call (a barrier, a GPU spin, an event
    pair around every pass, a synchronize)."""
    import torch

    from tpattn.timing import Timer, recording
    timer = Timer(x.device)
    group = layer.group if layer.world > 1 else None
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        layer(x)
        host = (time.perf_counter() - t0) * 1e3
        out.append(host)
        measure.spin_ahead(x.device, measure.spin_ms_for(host), group)
        with recording(timer):
            layer(x)
        timer.collect()
    return out


def piece_us(fn, n: int = 200) -> float:
    import torch
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(0.3 * measure._SLEEP_CYCLES_PER_MS))  # the GPU busy: launches only queue
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def pieces(layer, x) -> dict[str, float]:
    """Host microseconds of each piece of the head-parallel forward, alone."""
    import torch
    import torch.distributed as dist

    from tpattn import comm as L  # the layer's collectives (patched in place to bracket them)
    from tpattn import ops
    B, N, D = x.shape
    qkv = ops.mm(x.reshape(B * N, D), layer.wqkv, layer.dtype, layer.bqkv)
    q, k, v = layer._split_heads(qkv.view(B, N, -1, layer.head_dim))
    o_rows = torch.empty(B, N, layer.local_heads, layer.head_dim, dtype=layer.dtype, device=x.device)
    o = o_rows.permute(0, 2, 1, 3)
    part = torch.empty(B * N, D, dtype=layer.part_dtype, device=x.device)
    W = layer.world
    mine = torch.empty(B * N // W, D, dtype=layer.part_dtype, device=x.device)
    y = torch.empty(B * N, D, dtype=layer.dtype, device=x.device)
    got = {
        "qkv GEMM": piece_us(lambda: ops.mm(x.reshape(B * N, D), layer.wqkv, layer.dtype, layer.bqkv)),
        "split heads": piece_us(lambda: layer._split_heads(qkv.view(B, N, -1, layer.head_dim))),
        "attention": piece_us(lambda: layer._attention(q, k, v, o)),
        "out GEMM": piece_us(lambda: ops.mm(o_rows.reshape(B * N, -1), layer.wo, layer.part_dtype, out=part)),
        "torch.empty": piece_us(lambda: torch.empty(B * N, D, dtype=layer.part_dtype, device=x.device)),
        "bias pass": piece_us(lambda: ops.add_bias(mine, layer.bo, out=y[:B * N // W])),
    }
    if W > 1:
        got["reduce-scatter (bare)"] = piece_us(lambda: L._reduce_scatter(mine, part, group=layer.group))
        m = B * N // W  # in place: this rank's block of the output is the input
        got["all-gather (bare)"] = piece_us(lambda: L._all_gather(y, y[layer.rank * m:(layer.rank + 1) * m],
                                                                  group=layer.group))
        got["reduce-scatter (layer)"] = piece_us(lambda: layer.comm._run("reducescatter", L._reduce_scatter, 1,
                                                                           mine, part))
        got["all-reduce (bare)"] = piece_us(lambda: L.bare('allreduce', layer.group)(part))
    return got


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/model/host_probe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", nargs="+", default=["fused", "tiled"])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[2048])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--profile", action="store_true", help="cProfile rank 0's calls (top 20 by own time)")
    p.add_argument("--watch", action="store_true",
                   help="also time the un-spun calls with the collective watch running, as python -m tpattn runs "
                        "it (tpattn.watch), and cProfile those with --profile")
    a = p.parse_args(argv)
    try:
        proc, device = measure.start_ranks(what="scripts/model/host_probe.py")
    except errors.PlanError as exc:
        print(f"host_probe: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if device.type != "cuda":
        print("host_probe: error: it times CUDA launches; run it on the GPU machine", file=sys.stderr, flush=True)
        measure.finish_ranks(proc, 2)
        return 2
    import torch
    import torch.distributed as dist

    from tpattn.weights import layer_input
    r = proc.rank
    group = dist.group.WORLD if proc.world > 1 else None
    cores = sorted(os.sched_getaffinity(0))
    for line in measure.gather(f"rank {r}: pid {os.getpid()}, {len(cores)} core(s) {cores[:8]}"
                            f"{'...' if len(cores) > 8 else ''}, torch threads {torch.get_num_threads()}"):
        if r == 0:
            print(line, flush=True)
    for kernel in a.kernels:
        for n in a.seq_lens:
            layer = measure.build_layer(32 // proc.world, 32, 128, kernel, False, device, group=group)
            x = layer_input(1, n, 4096, 0, torch.float16, device)
            host_calls(layer, x, 5)
            un = host_calls(layer, x, a.iters)
            spun = host_calls(layer, x, a.iters, spin_ms=3.0)
            # back to back against interleaved with the instrumented call, in alternating blocks
            blocks = {"back to back": [], "interleaved": []}
            for _ in range(3):
                blocks["back to back"] += host_calls(layer, x, a.iters // 3)
                blocks["interleaved"] += host_interleaved(layer, x, a.iters // 3)
            parts = pieces(layer, x)
            watched = []
            if a.watch and proc.world > 1:  # a fresh watch per shape, on every rank at once (counts from 0)
                watch.start(proc, 600.0, print)
                host_calls(layer, x, 5)
                watched = host_calls(layer, x, a.iters)
            prof = None
            if a.profile and r == 0:
                prof = cProfile.Profile()
                prof.enable()
            host_calls(layer, x, a.iters if a.profile else 0)
            if prof is not None:
                prof.disable()
            watch.stop()
            rows = measure.gather((r, un, spun, parts, watched, blocks))
            if r == 0:
                print(f"\n== {kernel} N={n} W={proc.world} ({a.iters} calls)", flush=True)
                for rr, u, s, ps, wu, bl in rows:
                    print(f"rank {rr}: host un-spun p10/p50/p90 {pct(u, .1):.3f}/{pct(u, .5):.3f}/{pct(u, .9):.3f} ms; "
                          f"spun {pct(s, .1):.3f}/{pct(s, .5):.3f}/{pct(s, .9):.3f} ms"
                          + (f"; un-spun with the watch {pct(wu, .1):.3f}/{pct(wu, .5):.3f}/{pct(wu, .9):.3f} ms"
                             if wu else ""))
                    print("  pieces (us): " + ", ".join(f"{k} {v:.0f}" for k, v in ps.items()))
                    print("  un-spun, alternating blocks: " + "; ".join(
                        f"{k} p10/p50/p90 {pct(v, .1):.3f}/{pct(v, .5):.3f}/{pct(v, .9):.3f} ms" for k, v in bl.items()))
                if prof is not None:
                    buf = io.StringIO()
                    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(20)
                    print("\n".join(buf.getvalue().splitlines()[:45]), flush=True)
            del layer, x
            torch.cuda.empty_cache()
    measure.finish_ranks(proc, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
