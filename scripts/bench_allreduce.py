#!/usr/bin/env python3
"""The output sum of small partials: the one-shot peer all-reduce (tpattn/peer.py,
kernels/peer_reduce.cu) beside NCCL's all-reduce, 8 KiB to 1 MiB of fp32 partials, in one run.

    mpirun -n W python scripts/bench_allreduce.py [--iters 50] [--out PREFIX]

One GPU per rank (W <= the GPUs of this node): the process group is NCCL's, and each collective is
timed as CUDA-graph replays of --calls calls captured back to back (the GPU's time per call, no
host launch cost), the median of --iters replays, the slowest rank's. What each side does is what
the layer's output sum does: the one-shot kernel reads every rank's fp32 partial, adds b_o and
writes the fp16 output; NCCL all-reduces the fp32 partial in place, then one kernel adds b_o and
rounds (tpattn.ops.add_bias), both timed together and the all-reduce alone. Decode steps of B
sequences at D = 4096 sum B x 16 KiB.

With more ranks than GPUs (ranks sharing a GPU, time-sliced: no speed measurement) it runs over gloo,
eagerly, as a check that every size gives the same sum both ways. Writes PREFIX.json and PREFIX.md
(--out, default benchmarks/allreduce_h200xW).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tpattn import peer  # noqa: E402
from tpattn.comm import Comm, bare  # noqa: E402
from tpattn.dist import exit_now, init_distributed  # noqa: E402
from tpattn.ops import add_bias  # noqa: E402
from tpattn.report import versions  # noqa: E402

SIZES_KIB = (8, 16, 32, 64, 128, 256, 512, 1024)
D = 4096


def timed(fn, calls: int, iters: int, graph: bool) -> float:
    """Microseconds per call: a graph of `calls` calls replayed `iters` times (the median), or eager."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(calls):
                fn()
    got = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        torch.cuda.synchronize()
        got.append(e0.elapsed_time(e1) * 1e3 / calls)
    return statistics.median(got)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=50, help="graph replays per measurement (default 50)")
    p.add_argument("--calls", type=int, default=20, help="calls captured in one graph (default 20)")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default=None, help="PREFIX of the .json and .md (default benchmarks/allreduce_h200xW)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_allreduce: needs CUDA GPUs (this machine has none); run it under mpirun on a GPU node",
              file=sys.stderr)
        return 2
    from tpattn.errors import ConfigError
    try:  # (discover makes every rank print its line before any exits)
        proc = init_distributed(backend="gloo" if torch.cuda.device_count() < _world() else "nccl", timeout=300)
    except ConfigError as exc:
        print(f"bench_allreduce: error: {exc}", file=sys.stderr, flush=True)
        return 2
    W, R, dev = proc.world, proc.rank, proc.device
    if W < 2:
        print("bench_allreduce: run it with 2 or more ranks (mpirun -n 2 ...)", file=sys.stderr)
        exit_now(2)
    shared = torch.cuda.device_count() < W
    group = torch.distributed.group.WORLD
    comm = Comm(group, R, W)
    nccl_sum = bare("allreduce", group)
    lib = "NCCL" if torch.distributed.get_backend(group) == "nccl" else "gloo"  # gloo: ranks sharing a GPU
    rows = []
    for kib in SIZES_KIB:
        n = kib * 1024 // 4
        r, d = max(1, n // D), min(n, D)
        buf = peer.OneShotBuffers(n, torch.float32, torch.float16, dev, R, W)
        why = buf.open(comm.all_gather_object(buf.exported))
        whys = [w for w in comm.all_gather_object(why) if w]
        if whys:
            print(f"bench_allreduce: rank {R}: the ranks cannot map each other's memory: {whys[0]}", file=sys.stderr)
            exit_now(2)
        gen = torch.Generator().manual_seed(kib)
        parts = [torch.randn(r, d, generator=gen) for _ in range(W)]
        bias = torch.randn(d, generator=gen).to(dev, torch.float16)
        buf.partial(r, d).copy_(parts[R])
        mine = parts[R].to(dev)
        out1 = torch.empty(r, d, dtype=torch.float16, device=dev)
        out2 = torch.empty(r, d, dtype=torch.float16, device=dev)
        work = mine.clone()

        def oneshot():
            buf.all_reduce(out1, bias)

        def nccl_alone():
            nccl_sum(work)

        def nccl_and_bias():
            nccl_sum(work)
            add_bias(work, bias, out=out2)

        # the same sum both ways (NCCL's order may differ: within fp32 rounding of the partials)
        oneshot()
        work.copy_(mine)
        nccl_and_bias()
        torch.cuda.synchronize()
        err = (out1.float() - out2.float()).abs().max().item()
        t = {name: timed(fn, a.calls, a.iters, graph=not shared)
             for name, fn in (("oneshot_us", oneshot), ("nccl_us", nccl_alone), ("nccl_bias_us", nccl_and_bias))}
        slowest = {k: max(v[k] for v in comm.all_gather_object(t)) for k in t}
        rows.append({"kib": kib, "shape": [r, d], **slowest, "max_diff": err})
        buf.close()
        if R == 0:
            print(f"{kib:5d} KiB  one-shot {slowest['oneshot_us']:8.1f} us   {lib} {slowest['nccl_us']:8.1f} us   "
                  f"{lib} + b_o {slowest['nccl_bias_us']:8.1f} us   max |diff| {err:.2g}", flush=True)
    if R == 0:
        when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        gpu = torch.cuda.get_device_name(dev)
        how = (f"{W} ranks sharing {torch.cuda.device_count()} GPU(s) over gloo, eager: a check, not a speed measurement"
               if shared else f"{W} x {gpu}, NCCL, CUDA graphs of {a.calls} calls, median of {a.iters} replays")
        out = Path(a.out or ROOT / "benchmarks" / f"allreduce_h200x{W}")
        rep = {"when": when, "commit": a.commit, "gpu": gpu, "world": W, "shared": shared, "how": how,
               "command": shlex.join(["mpirun", "-n", str(W), "python", *sys.argv]), "versions": versions(), "rows": rows}
        out.with_suffix(".json").write_text(json.dumps(rep, indent=1) + "\n")
        lines = [f"# The output sum of small partials: one-shot peer all-reduce beside {lib} ({when}, commit {a.commit})",
                 "", f"{how}. Command: `{rep['command']}`. Times per call, the slowest rank's.", "",
                 f"| fp32 partials | one-shot (+ b_o, fp16 out) | {lib} all-reduce | {lib} + b_o | {lib} + b_o / one-shot |",
                 "|---:|---:|---:|---:|---:|"]
        for row in rows:
            lines.append(f"| {row['kib']} KiB | {row['oneshot_us']:.1f} us | {row['nccl_us']:.1f} us | "
                         f"{row['nccl_bias_us']:.1f} us | {row['nccl_bias_us'] / row['oneshot_us']:.2f} |")
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print(f"wrote {out}.json and {out}.md", flush=True)
    comm.all_gather_object(None)
    exit_now(0)


def _world() -> int:
    from tpattn.dist import discover
    return discover().world


if __name__ == "__main__":
    sys.exit(main())
