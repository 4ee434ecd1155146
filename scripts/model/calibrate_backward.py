#!/usr/bin/env python3
"""Calibration points of the fused attention backward (the five-product kernels: hbwd_pre, hbwd5_kv,
hbwd_dq_out) for the cost model's "fused.bwd" pass, or with --deterministic of the seven-product pair
(--backward --deterministic) for its "fused.bwd_det" pass, in the machine file's format. Each point: B=1, h
heads, N rows, d=128, fp16, the backward of one call (o, L from the fused forward) replayed in a CUDA
graph (GPU time only: the training step's host time is not a model number), the median of 7 replays
of 5 calls. Prints {"fused.bwd": [...], "fused.bwd:causal": [...]} (or the "fused.bwd_det" pair) as
JSON; paste it into the machine file's "passes".

    PYTHONPATH=. python scripts/model/calibrate_backward.py [--deterministic] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GRID_H, GRID_N = (1, 2, 4, 8, 16, 32), (1024, 2048, 4096, 8192, 16384)
CAUSAL = ((16, 4096), (32, 4096), (32, 8192), (32, 16384))


def time_backward(be, h: int, n: int, causal: bool, reps: int = 5, deterministic: bool = False) -> float:
    import torch
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, h, n, 128, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
    o, lse = be.forward_for_backward(q, k, v, causal)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        be.backward(q, k, v, o, lse, do, causal, deterministic)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            be.backward(q, k, v, o, lse, do, causal, deterministic)
    graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        z.record()
        z.synchronize()
        ts.append(a.elapsed_time(z) / reps)
    return statistics.median(ts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deterministic", action="store_true", help="the seven-product pair (\"fused.bwd_det\")")
    p.add_argument("--quick", action="store_true", help="h in 8, 32 and N in 1024, 4096 only")
    p.add_argument("--commit", default="unknown", help="the commit measured (recorded in each point's src)")
    p.add_argument("--out", metavar="FILE", help="also write the JSON to FILE")
    a = p.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("calibrate_backward.py: no CUDA GPU here; run it on the GPU machine", file=sys.stderr)
        return 2
    from tpattn.attention import get_backend
    be = get_backend("fused")
    grid_h, grid_n = ((8, 32), (1024, 4096)) if a.quick else (GRID_H, GRID_N)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    src = (f"scripts/model/calibrate_backward.py, {torch.cuda.get_device_name()}, {when}, commit {a.commit}: "
           f"the {'seven' if a.deterministic else 'five'}-product backward, CUDA-graph replays")
    key = "fused.bwd_det" if a.deterministic else "fused.bwd"
    out: dict[str, list] = {key: [], key + ":causal": []}
    for causal, shapes in ((False, [(h, n) for h in grid_h for n in grid_n]), (True, CAUSAL)):
        for h, n in shapes:
            ms = time_backward(be, h, n, causal, deterministic=a.deterministic)
            out[key + ":causal" if causal else key].append(
                {"B": 1, "h": h, "N": n, "d": 128, "dtype": "fp16", "causal": causal, "ms": round(ms, 6), "src": src})
            print(f"  h={h:2d} N={n:5d} causal={causal}: {ms:.4f} ms", file=sys.stderr, flush=True)
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
