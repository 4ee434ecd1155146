#!/usr/bin/env python3
"""Why a collective inside the layer can take longer than the same collective bare: the in-layer
reduce-scatter beside bare ones of the same bytes, right after the layer's work and after the GPU
has been idle or busy with GEMMs, call by call.

    mpirun -n 2 python scripts/collective_probe.py --kernels naive tiled --seq-len 4096

Found for the cost model's one per-pass miss: the naive layer's reduce-scatter at N = 4096 on 2 H200s
measures ~0.25 ms where the model (and the same 64 MiB inside the tiled and fused layers, and bare)
says ~0.16. For each kernel, iteration by iteration, every rank:
  * "in layer": the layer's reduce-scatter, the call queued behind a barrier and a GPU spin with an
    event pair around every pass (as tpattn.plan.time_layer times it);
  * "bare, right after": a reduce-scatter of a separate buffer of the same bytes, queued on the same
    stream right behind that call;
  * "bare, idle": the same after a synchronize, a 0.3 s pause of the host (the GPU idle) and a barrier;
  * "bare, after GEMMs": the same right behind --burn-ms of fp16 GEMMs (8192^3, the GPU at full power).
Per iteration the last rank to arrive (the minimum over ranks: the transfer), then p10/median/p90
over the iterations, microseconds. Run nvidia-smi beside it to see the clocks (gpu_session.sh model).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpattn import plan  # noqa: E402


def pct(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/collective_probe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", nargs="+", default=["naive", "tiled"], choices=["naive", "tiled", "fused"])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--burn-ms", type=float, default=70.0, help="GEMMs before the last bare call (default 70)")
    p.add_argument("--as-validation", action="store_true",
                   help="first as scripts/validate_model.py does it: the 1-GPU layer (all heads on each rank), then "
                        "the W-rank layer timed by tpattn.plan.time_layer (its reduce-scatter: 'in layer, time_layer'); "
                        "then the rows above on that same layer, the probe's buffers made only then")
    a = p.parse_args(argv)
    try:
        proc, device = plan.start_ranks(what="collective_probe.py")
    except plan.PlanError as exc:
        print(f"collective_probe: error: {exc}", file=sys.stderr)
        return 2
    if device.type != "cuda" or proc.world < 2:
        if proc.rank == 0:
            print("collective_probe: error: needs CUDA GPUs and at least 2 ranks (mpirun -n 2)", file=sys.stderr)
        plan.finish_ranks(proc, 2)
        return 2
    import torch
    import torch.distributed as dist

    from tpattn import layer as L
    from tpattn.timing import Timer
    from tpattn.weights import layer_input
    group, W = dist.group.WORLD, proc.world
    D = a.heads * a.head_dim
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def bare(mine, part) -> tuple:
        start.record()
        L._reduce_scatter(mine, part, group=group)
        end.record()
        return start, end

    def ms(pair) -> float:
        torch.cuda.synchronize()
        return pair[0].elapsed_time(pair[1])

    for kernel in a.kernels:
        x = layer_input(1, a.seq_len, D, 0, torch.float16, device)
        rows: dict[str, list[float]] = {}
        if a.as_validation:
            one = plan.build_layer(a.heads, a.heads, a.head_dim, kernel, False, device)
            plan.time_layer(one, x, 1, a.iters)
            del one
            torch.cuda.empty_cache()
        layer = plan.build_layer(a.heads, a.heads, a.head_dim, kernel, False, device, group=group)
        if a.as_validation:
            raw: dict = {}
            plan.time_layer(layer, x, 1, a.iters, raw=raw)
            rs = plan.gather(raw["reducescatter"][-a.iters:])   # the spun calls' (time_layer's second half)
            rows["in layer, time_layer"] = [min(c) for c in zip(*rs)]
        part = torch.zeros(a.seq_len, D, dtype=torch.float32, device=device)   # the layer's partial's bytes
        mine = torch.empty(a.seq_len // W, D, dtype=torch.float32, device=device)
        g = torch.randn(8192, 8192, dtype=torch.float16, device=device)
        gemm_ms = plan.events_ms(lambda: torch.mm(g, g), 2, 5, device)
        burn = max(1, int(a.burn_ms / gemm_ms))
        timer = Timer(device)
        for _ in range(2):
            layer(x)
            bare(mine, part)
        torch.cuda.synchronize()
        for _ in range(a.iters):
            plan.spin_ahead(device, 2.0, group)
            with timer.section("gpu"):
                layer(x, timer)
            after = ms(bare(mine, part))
            got = {"in layer": timer.collect().get("reducescatter", float("nan")), "bare, right after": after}
            time.sleep(0.3)
            dist.barrier(group=group, device_ids=[device.index])
            got["bare, idle"] = ms(bare(mine, part))
            dist.barrier(group=group, device_ids=[device.index])
            for _ in range(burn):
                torch.mm(g, g)
            got["bare, after GEMMs"] = ms(bare(mine, part))   # one key on every rank (each burns ~--burn-ms)
            every = plan.gather(got)
            for k in got:
                rows.setdefault(k, []).append(min(r[k] for r in every))
        if proc.rank == 0:
            print(f"== {kernel} N={a.seq_len} W={W}: reduce-scatter of {part.numel() * 4 >> 20} MiB fp32, last rank "
                  f"to arrive, {a.iters} calls (us p10/p50/p90); GEMMs: {burn} of {gemm_ms:.2f} ms", flush=True)
            for k, v in rows.items():
                print(f"  {k:28s} {pct(v, 0.1) * 1e3:6.0f} {statistics.median(v) * 1e3:6.0f} {pct(v, 0.9) * 1e3:6.0f}",
                      flush=True)
        layer = x = part = mine = g = None
        torch.cuda.empty_cache()
    plan.finish_ranks(proc, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
