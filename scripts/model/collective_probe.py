#!/usr/bin/env python3
"""Why a collective inside the layer can take longer than the same collective bare: the in-layer
reduce-scatter beside bare ones of the same bytes, right after the layer's work and after the GPU
has been idle or busy with GEMMs, call by call.

    mpirun -n 2 python scripts/model/collective_probe.py --kernels naive tiled --seq-len 4096

Made for the cost model's one per-pass miss: the naive layer's reduce-scatter at N = 4096 on 2 H200s
measured ~0.25 ms where the same 64 MiB takes ~0.16 inside the tiled and fused layers and bare. It
found the cause: the NVLink link sleeps after 50 ms with no traffic and the next collective pays
~95 us to wake it, unless one rank arrives early enough to wake it (--idle, --skew, --clocks;
benchmarks/link_wake_h200x2.log); the model has it since. For each kernel, iteration by iteration,
every rank:
  * "in layer": the layer's reduce-scatter, the call queued behind a barrier and a GPU spin with an
    event pair around every pass (as tpattn.model.measure.time_layer times it);
  * "bare, right after": a reduce-scatter of a separate buffer of the same bytes, queued on the same
    stream right behind that call;
  * "bare, idle": the same after a synchronize, a 0.3 s pause of the host (the GPU idle) and a barrier;
  * "bare, after GEMMs": the same right behind --burn-ms of fp16 GEMMs (8192^3, the GPU at full power).
Per iteration the last rank to arrive (the minimum over ranks: the transfer), then p10/median/p90
over the iterations, microseconds. Run nvidia-smi beside it to see the clocks (gpu_runs.sh model).

--clocks: the layer timed again by tpattn.model.measure.time_layer with its reduce-scatter bracketed by two
spin kernels of a fixed number of SM cycles (torch.cuda._sleep), each between CUDA events: cycles
over elapsed time is the SM clock right before and right after that very reduce-scatter. Printed call
by call, every rank. --trace DIR: a few time_layer calls under torch.profiler, a Chrome trace per rank
in DIR and, per NCCL kernel, its duration and the gap since the kernel before it ended.
--skew US...: a bare reduce-scatter of the layer's bytes with one rank made late by about US
microseconds (an SM-idle spin, or fp16 GEMMs that fill the SMs), both ranks' times: how the last
rank's time depends on how long the other one waited.
--idle MS...: a bare reduce-scatter after MS milliseconds without any collective, both ranks in step
(a barrier, then the same SM-idle spin or the same fp16 GEMMs on each): what the first transfer over
NVLink after a long computation costs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from host_probe import pct  # noqa: E402  (scripts/model/ is this script's own directory)
from tpattn.model import errors, measure  # noqa: E402


SLEEP_CYCLES = 50_000  # ~25 us at the H200's 1980 MHz: long against the events' ~0.5 us resolution


def clocked_calls(layer, x, iters: int, rank: int, what: str) -> None:
    """measure.time_layer(layer, x, 1, iters) with every reduce-scatter between two clock probes."""
    import torch

    from tpattn import comm as L  # the layer's collectives (patched in place to bracket them)
    from tpattn import ops
    log: list = []
    ptrs: list = []   # (partial, output) addresses: where the caching allocator put them, call by call
    behind: list = []  # whether the GPU was waiting for the host when the reduce-scatter was queued
    op = L._reduce_scatter

    def bracketed(out, inp, group=None):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
        ev[0].record()
        torch.cuda._sleep(SLEEP_CYCLES)
        ev[1].record()
        ev[2].record()
        behind.append(ev[0].query())   # the GPU already reached the clock probe: the host is late
        op(out, inp, group=group)
        ev[3].record()
        ev[4].record()
        torch.cuda._sleep(SLEEP_CYCLES)
        ev[5].record()
        log.append(ev)
        ptrs.append((inp.data_ptr(), out.data_ptr()))

    L._reduce_scatter = bracketed
    try:
        measure.time_layer(layer, x, 1, iters)
    finally:
        L._reduce_scatter = op
    torch.cuda.synchronize()
    segments = sorted((s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot())

    def where(ptr: int) -> str:   # "segment index (its MiB) + offset MiB"
        for i, (a, n) in enumerate(segments):
            if a <= ptr < a + n:
                return f"s{i}({n >> 20})+{(ptr - a) / 2**20:.0f}"
        return "?"
    mine = [(e[0].elapsed_time(e[1]), e[2].elapsed_time(e[3]), e[4].elapsed_time(e[5]), where(p), where(o), late)
            for e, (p, o), late in zip(log, ptrs, behind)]
    every = measure.gather(mine)
    if rank != 0:
        return
    mhz = lambda ms: SLEEP_CYCLES / (ms * 1e3)  # noqa: E731  (cycles per microsecond)
    print(f"== {what}: time_layer with the SM clock around each reduce-scatter (call 0: the warm-up; then "
          f"{iters} back to back, {iters} spun); per rank: reduce-scatter us, MHz before/after, where the "
          f"partial and the output lie (allocator segment index (MiB) + offset MiB); H: the GPU had reached it "
          f"before the host queued it", flush=True)
    for i, calls in enumerate(zip(*every)):
        cells = "  ".join(f"r{r}: {rs * 1e3:4.0f} us {mhz(b):4.0f}/{mhz(f):4.0f} {p} {o}{' H' if late else ''}"
                          for r, (b, rs, f, p, o, late) in enumerate(calls))
        print(f"  call {i:2d}  last rank {min(c[1] for c in calls) * 1e3:5.0f} us   {cells}", flush=True)


def traced_calls(layer, x, out_dir: str, rank: int, what: str) -> None:
    """4 time_layer calls (2 back to back, 2 spun) under torch.profiler: a Chrome trace per rank, and
    per NCCL kernel its duration and the gap since the previous kernel on that GPU ended."""
    import json

    import torch
    from torch.profiler import ProfilerActivity, profile
    measure.time_layer(layer, x, 1, 1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        measure.time_layer(layer, x, 0, 2)
        torch.cuda.synchronize()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / f"trace_{what}_rank{rank}.json"
    prof.export_chrome_trace(str(path))
    kernels = sorted((e for e in json.loads(path.read_text()).get("traceEvents", []) if e.get("cat") == "kernel"),
                     key=lambda e: e["ts"])
    lines, last_end, last_name = [], None, ""
    for e in kernels:
        if "nccl" in e["name"].lower():
            gap = e["ts"] - last_end if last_end is not None else float("nan")
            lines.append(f"    {e['name'][:44]:44s} start {e['ts']:.1f} dur {e['dur']:7.1f} us  gap {gap:7.1f} us "
                         f"after {last_name[:40]}")
        end = e["ts"] + e["dur"]
        if last_end is None or end > last_end:
            last_end, last_name = end, e["name"]
    every = measure.gather(lines)
    if rank == 0:
        print(f"== {what}: NCCL kernels of 4 time_layer calls under torch.profiler (traces in {out_dir})", flush=True)
        for r, ls in enumerate(every):
            print(f"  rank {r}:", flush=True)
            for line in ls:
                print(line, flush=True)


def skewed_calls(skews: list[float], numel: int, iters: int, rank: int, group, device) -> None:
    """A reduce-scatter of numel fp32 elements, rank 1 made late by each skew (us): every call behind
    a barrier and a 2 ms spin on both ranks (all queued before the GPU reaches it), then on rank 1 an
    SM-idle spin ("spin") or 8192x8192x128 fp16 GEMMs ("gemm") of about that long; with "+out" both
    ranks then write the partial with an fp16 GEMM to fp32 first, as the layer's output projection does
    right before its reduce-scatter (half the heads of the default shape)."""
    import torch
    import torch.distributed as dist

    from tpattn import comm as L  # the layer's collectives (patched in place to bracket them)
    from tpattn import ops
    W = dist.get_world_size(group)
    D = 4096
    rows = numel // D
    part = torch.zeros(rows, D, dtype=torch.float32, device=device)
    mine = torch.empty(rows // W, D, dtype=torch.float32, device=device)
    a = torch.randn(8192, 8192, dtype=torch.float16, device=device)
    b = torch.randn(8192, 128, dtype=torch.float16, device=device)
    o = torch.randn(rows, D // W, dtype=torch.float16, device=device)
    wo = torch.randn(D // W, D, dtype=torch.float16, device=device) / 64
    gemm_us = measure.events_ms(lambda: torch.mm(a, b), 3, 10, device) * 1e3
    out_us = measure.events_ms(lambda: ops.mm(o, wo, torch.float32, out=part), 3, 10, device) * 1e3
    cycles_per_us = measure._SLEEP_CYCLES_PER_MS / 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        L._reduce_scatter(mine, part, group=group)
    results = []
    for kind in ("spin", "gemm", "spin+out", "gemm+out"):
        for us in skews:
            got = []
            for _ in range(iters):
                measure.spin_ahead(device, 2.0, group)
                if rank == 1 and us > 0:
                    if kind.startswith("spin"):
                        torch.cuda._sleep(int(us * cycles_per_us))
                    else:
                        for _ in range(max(1, round(us / gemm_us))):
                            torch.mm(a, b)
                if kind.endswith("+out"):
                    ops.mm(o, wo, torch.float32, out=part)
                start.record()
                L._reduce_scatter(mine, part, group=group)
                end.record()
                torch.cuda.synchronize()
                got.append(start.elapsed_time(end))
            results.append((kind, us, got))
    every = measure.gather(results)
    if rank != 0:
        return
    print(f"== bare reduce-scatter of {numel * 4 >> 20} MiB fp32, rank 1 late by a spin or GEMMs ({gemm_us:.0f} us "
          f"each), +out: the partial written by a GEMM ({out_us:.0f} us) first; median over {iters} calls, us", flush=True)
    print("  late by            rank 0 (early)  rank 1 (late)  rank 0 - rank 1", flush=True)
    for i, (kind, us, _) in enumerate(every[0]):
        r0, r1 = (statistics.median(every[r][i][2]) * 1e3 for r in (0, 1))
        print(f"  {kind:8s} {us:6.0f}   {r0:14.0f} {r1:14.0f} {r0 - r1:16.0f}", flush=True)


def idle_calls(idles: list[float], numel: int, iters: int, rank: int, group, device,
               ops: tuple = ("reducescatter",)) -> None:
    """Each collective of `ops` on numel fp32 elements (the all-gather: its output's) after each idle
    time (ms) with no collective: a barrier (its all-reduce is the last NVLink traffic), then on both
    ranks an SM-idle spin ("spin") or fp16 GEMMs 8192^3 ("gemm") of that long, then the collective
    between events; both ranks' times."""
    import torch
    import torch.distributed as dist

    from tpattn import comm as L  # the layer's collectives (patched in place to bracket them)
    from tpattn import ops
    W = dist.get_world_size(group)
    part = torch.zeros(numel, dtype=torch.float32, device=device)
    mine = torch.zeros(numel // W, dtype=torch.float32, device=device)
    run = {"reducescatter": lambda: L._reduce_scatter(mine, part, group=group),
           "allgather": lambda: L._all_gather(part, mine, group=group),
           "allreduce": lambda: dist.all_reduce(part, group=group)}
    g = torch.randn(8192, 8192, dtype=torch.float16, device=device)
    gemm_ms = measure.events_ms(lambda: torch.mm(g, g), 2, 5, device)
    def idle(kind: str, ms: float):
        if kind == "spin":
            return lambda: torch.cuda._sleep(int(ms * measure._SLEEP_CYCLES_PER_MS))
        return lambda: [torch.mm(g, g) for _ in range(max(1, round(ms / gemm_ms)))]
    results = []
    for op in ops:
        for _ in range(3):
            run[op]()
        for kind in ("spin", "gemm"):
            for ms in idles:
                results.append((op, kind, ms, measure.timed_after(run[op], idle(kind, ms), iters, device)[0]))
    every = measure.gather(results)
    if rank != 0:
        return
    print(f"== bare collectives of {numel * 4 >> 20} MiB fp32 after a time with no collective (an SM-idle spin, or "
          f"GEMMs of {gemm_ms:.2f} ms); per call the last rank to arrive, p10/median/p90 over {iters} calls, and the "
          f"median of the ranks' spread (max - min), us", flush=True)
    for i, (op, kind, ms, _) in enumerate(every[0]):
        calls = list(zip(*(every[r][i][3] for r in range(len(every)))))
        last = [min(c) * 1e3 for c in calls]
        apart = statistics.median((max(c) - min(c)) * 1e3 for c in calls)
        print(f"  {op:13s} {kind:4s} {ms:7.1f} ms   {pct(last, 0.1):5.0f} {statistics.median(last):5.0f} "
              f"{pct(last, 0.9):5.0f}   apart {apart:5.0f}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/model/collective_probe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", nargs="*", default=["naive", "tiled"], choices=["naive", "tiled", "fused"])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--burn-ms", type=float, default=70.0, help="GEMMs before the last bare call (default 70)")
    p.add_argument("--as-validation", action="store_true",
                   help="first as scripts/model/validate_model.py does it: the 1-GPU layer (all heads on each rank), then "
                        "the W-rank layer timed by tpattn.model.measure.time_layer (its reduce-scatter: 'in layer, time_layer'); "
                        "then the rows above on that same layer, the probe's buffers made only then")
    p.add_argument("--clocks", action="store_true",
                   help="time_layer again with the SM clock measured right before and after each reduce-scatter")
    p.add_argument("--trace", metavar="DIR", help="a Chrome trace per rank of 4 time_layer calls, and the NCCL kernels' times")
    p.add_argument("--skew", type=float, nargs="+", metavar="US",
                   help="bare reduce-scatters with rank 1 late by each of these microseconds, before the kernels")
    p.add_argument("--idle", type=float, nargs="+", metavar="MS",
                   help="bare reduce-scatters after these milliseconds with no collective, both ranks in step")
    p.add_argument("--idle-ops", nargs="+", default=["reducescatter"], choices=["reducescatter", "allgather", "allreduce"],
                   help="the collectives --idle times (default: reducescatter)")
    a = p.parse_args(argv)
    try:
        proc, device = measure.start_ranks(what="collective_probe.py")
    except errors.PlanError as exc:
        print(f"collective_probe: error: {exc}", file=sys.stderr)
        return 2
    if device.type != "cuda" or proc.world < 2:
        if proc.rank == 0:
            print("collective_probe: error: needs CUDA GPUs and at least 2 ranks (mpirun -n 2)", file=sys.stderr)
        measure.finish_ranks(proc, 2)
        return 2
    import torch
    import torch.distributed as dist

    from tpattn import comm as L  # the layer's collectives (patched in place to bracket them)
    from tpattn import ops
    from tpattn.timing import Timer, recording
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

    if a.idle:
        idle_calls(a.idle, a.seq_len * D, a.iters, proc.rank, group, device, tuple(a.idle_ops))
    if a.skew:
        skewed_calls(a.skew, a.seq_len * D, a.iters, proc.rank, group, device)
    for kernel in a.kernels:
        x = layer_input(1, a.seq_len, D, 0, torch.float16, device)
        rows: dict[str, list[float]] = {}
        if a.as_validation:
            one = measure.build_layer(a.heads, a.heads, a.head_dim, kernel, False, device)
            measure.time_layer(one, x, 1, a.iters)
            del one
            torch.cuda.empty_cache()
        layer = measure.build_layer(a.heads, a.heads, a.head_dim, kernel, False, device, group=group)
        if a.as_validation:
            raw: dict = {}
            measure.time_layer(layer, x, 1, a.iters, raw=raw)
            rs = measure.gather(raw["reducescatter"][-a.iters:])   # the spun calls' (time_layer's second half)
            rows["in layer, time_layer"] = [min(c) for c in zip(*rs)]
        if a.clocks:
            clocked_calls(layer, x, a.iters, proc.rank, f"{kernel} N={a.seq_len} W={W}")
        if a.trace:
            traced_calls(layer, x, a.trace, proc.rank, f"{kernel}_n{a.seq_len}")
        part = torch.zeros(a.seq_len, D, dtype=torch.float32, device=device)   # the layer's partial's bytes
        mine = torch.empty(a.seq_len // W, D, dtype=torch.float32, device=device)
        g = torch.randn(8192, 8192, dtype=torch.float16, device=device)
        gemm_ms = measure.events_ms(lambda: torch.mm(g, g), 2, 5, device)
        burn = max(1, int(a.burn_ms / gemm_ms))
        timer = Timer(device)
        for _ in range(2):
            layer(x)
            bare(mine, part)
        torch.cuda.synchronize()
        for _ in range(a.iters):
            measure.spin_ahead(device, 2.0, group)
            with timer.section("gpu"):
                with recording(timer):
                    layer(x)
            after = ms(bare(mine, part))
            got = {"in layer": timer.collect().get("reducescatter", float("nan")), "bare, right after": after}
            time.sleep(0.3)
            dist.barrier(group=group, device_ids=[device.index])
            got["bare, idle"] = ms(bare(mine, part))
            dist.barrier(group=group, device_ids=[device.index])
            for _ in range(burn):
                torch.mm(g, g)
            got["bare, after GEMMs"] = ms(bare(mine, part))   # one key on every rank (each burns ~--burn-ms)
            every = measure.gather(got)
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
    measure.finish_ranks(proc, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
