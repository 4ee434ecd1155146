"""The layer's output communication on 2+ GPUs, measured several ways in one run.

The head-parallel layer with fp32 partials ends in a reduce-scatter of [B*N, D] fp32 partials and
an all-gather of the rounded [B*N, D] output (tpattn/layer.py). This script times that pair, and
the one all-reduce it replaces, over:

  nccl      torch.distributed on ordinary caching-allocator tensors (what the layer does now)
  nccl-reg  the same tensors allocated from a memory pool registered with NCCL (ncclCommRegister:
            NCCL may read and write them in place instead of staging through its own buffers)
  p2p       peer loads over NVLink through torch's symmetric memory (each rank maps the others'
            buffers): reduce-scatter = this rank's rows of its partial + every peer's, all-gather =
            copy every peer's rows of the output; a GPU-side barrier orders them

Each variant is checked against a float64 sum on the host side of the same data before it is
timed. Run: torchrun --nproc-per-node 2 scripts/model/bench_comm.py [--rows 4096 --dim 4096 --iters 50]
(or mpirun -n 2 with MASTER_ADDR/MASTER_PORT set). Prints one line per variant from rank 0 and,
with --json F, writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4096, help="B*N rows of the partial (default 4096)")
    p.add_argument("--dim", type=int, default=4096, help="model dim D (default 4096)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--variants", nargs="+", default=["nccl", "nccl-reg", "p2p"],
                   help="nccl, nccl-reg, p2p, busy (the reduce-scatter alone after --busy-ms of GEMMs)")
    p.add_argument("--busy-ms", type=float, default=90.0,
                   help="busy: GPU work before each timed reduce-scatter (the naive layer's attention "
                        "takes about 90 ms at N = 4096 on 2 GPUs)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def timed(fn, iters: int, warmup: int) -> float:
    """ms per call: back-to-back calls between two events after a barrier."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(iters):
        fn()
    t1.record()
    t1.synchronize()
    return t0.elapsed_time(t1) / iters


def main(argv=None) -> int:
    a = parse(argv)
    rank, world = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", 0))), \
        int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", 1)))
    if a.rows < 1 or a.rows % world:  # (every rank decides the same, before any collective)
        print(f"bench_comm: error: --rows {a.rows} must be a positive multiple of the world size {world}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"bench_comm: error: {Path(__file__).name} needs a CUDA GPU a rank and torch sees none; run it on the "
              "GPU machine", file=sys.stderr)
        return 2
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    R, D = a.rows, a.dim
    m = R // world
    mine = slice(rank * m, (rank + 1) * m)
    gen = torch.Generator(device="cpu").manual_seed(1234 + rank)
    src = torch.randn(R, D, generator=gen).to(dev)  # this rank's partial (fp32)
    bias = torch.randn(D, generator=torch.Generator().manual_seed(7)).to(dev, torch.float16)
    # the expected output: sum of all ranks' partials + bias, rounded once to fp16
    everyone = [torch.empty_like(src) for _ in range(world)]
    dist.all_gather(everyone, src)
    want = (torch.stack([t.double() for t in everyone]).sum(0) + bias.double()).half()
    del everyone
    rows = []

    def report(name, ms, y):
        bad = (y.float() - want.float()).abs().max().item()
        ok = torch.equal(y, want) or bad <= 2 * torch.finfo(torch.float16).eps * want.float().abs().max().item()
        rec = dict(variant=name, world=world, rows=R, dim=D, ms=round(ms, 4), max_err=bad, ok=bool(ok))
        gathered = [None] * world
        dist.all_gather_object(gathered, rec)
        if rank == 0:
            slow = max(g["ms"] for g in gathered)
            rec["ms_max"] = slow
            rec["ok_all"] = all(g["ok"] for g in gathered)
            print(f"{name:28s} {slow:8.4f} ms (slowest rank)  ranks {[g['ms'] for g in gathered]}  "
                  f"check {'PASS' if rec['ok_all'] else 'FAIL'} max|err| {bad:.3g}", flush=True)
            rows.append(rec)

    def nccl_pair(part, mine32, y):
        def run():
            dist.reduce_scatter_tensor(mine32, part)
            torch.add(mine32, bias, out=y[mine])
            dist.all_gather_into_tensor(y, y[mine])
        return run

    def nccl_ar(part, y):
        buf = torch.empty_like(part)

        def run():
            buf.copy_(part)
            dist.all_reduce(buf)
            torch.add(buf, bias, out=y)
        return run

    for variant in a.variants:
        try:
            if variant == "nccl":
                part, mine32 = src.clone(), torch.empty(m, D, device=dev)
                y = torch.empty(R, D, dtype=torch.float16, device=dev)
                fn = nccl_pair(part, mine32, y)
                fn()
                report("nccl rs+ag", timed(fn, a.iters, a.warmup), y)
                fn = nccl_ar(part, y)
                fn()
                report("nccl allreduce (+copy)", timed(fn, a.iters, a.warmup), y)
            elif variant == "nccl-reg":
                backend = dist.group.WORLD._get_backend(dev)
                pool = torch.cuda.MemPool(backend.mem_allocator)
                with torch.cuda.use_mem_pool(pool):
                    part, mine32 = src.clone(), torch.empty(m, D, device=dev)
                    y = torch.empty(R, D, dtype=torch.float16, device=dev)
                backend.register_mem_pool(pool)
                fn = nccl_pair(part, mine32, y)
                fn()
                report("nccl-reg rs+ag", timed(fn, a.iters, a.warmup), y)
                torch.cuda.synchronize()
                del fn, part, mine32, y
                backend.deregister_mem_pool(pool)  # before the communicator goes, or its teardown aborts
            elif variant == "p2p":
                import torch.distributed._symmetric_memory as symm_mem
                gname = dist.group.WORLD.group_name
                if hasattr(symm_mem, "enable_symm_mem_for_group"):
                    try:
                        symm_mem.enable_symm_mem_for_group(gname)
                    except Exception:
                        pass
                part = symm_mem.empty(R, D, dtype=torch.float32, device=dev)
                ybuf = symm_mem.empty(R, D, dtype=torch.float16, device=dev)
                hp = symm_mem.rendezvous(part, gname)
                hy = symm_mem.rendezvous(ybuf, gname)
                part.copy_(src)
                peers = [p for p in range(world) if p != rank]
                peer_part = {p: hp.get_buffer(p, (R, D), torch.float32) for p in peers}
                peer_y = {p: hy.get_buffer(p, (R, D), torch.float16) for p in peers}
                acc = torch.empty(m, D, device=dev)

                def pull():
                    hp.barrier(channel=0)            # every rank's partial is written
                    torch.add(part[mine], peer_part[peers[0]][mine], out=acc)
                    for p in peers[1:]:
                        acc.add_(peer_part[p][mine])
                    torch.add(acc, bias, out=ybuf[mine])
                    hy.barrier(channel=0)            # every rank's rows of y are written
                    for p in peers:
                        ybuf[p * m:(p + 1) * m].copy_(peer_y[p][p * m:(p + 1) * m])
                    hy.barrier(channel=1)            # nobody reads this rank's buffers any more
                pull()
                report("p2p pull rs+ag", timed(pull, a.iters, a.warmup), ybuf)

                def pull_ce():  # the peer's rows copied by a copy engine, then a local sum
                    hp.barrier(channel=0)
                    for i, p in enumerate(peers):
                        tmp[i].copy_(peer_part[p][mine])
                    torch.add(part[mine], tmp[0], out=acc)
                    for i in range(1, len(peers)):
                        acc.add_(tmp[i])
                    torch.add(acc, bias, out=ybuf[mine])
                    hy.barrier(channel=0)
                    for p in peers:
                        ybuf[p * m:(p + 1) * m].copy_(peer_y[p][p * m:(p + 1) * m])
                    hy.barrier(channel=1)
                tmp = torch.empty(len(peers), m, D, device=dev)
                pull_ce()
                report("p2p copy+add rs+ag", timed(pull_ce, a.iters, a.warmup), ybuf)
            elif variant == "busy":
                # the reduce-scatter alone, timed on each rank between two events; the last rank to
                # arrive (the fastest time) waits for nobody. After idle, then after busy GEMMs.
                part, mine32 = src.clone(), torch.empty(m, D, device=dev)
                g = torch.randn(8192, 8192, device=dev, dtype=torch.float16)
                t_g = timed(lambda: torch.mm(g, g), 5, 2)
                reps = max(1, round(a.busy_ms / t_g))
                for label, n_busy in (("idle", 0), (f"after {reps * t_g:.0f} ms of GEMMs", reps)):
                    times = []
                    for _ in range(7):
                        torch.cuda.synchronize()
                        dist.barrier()
                        for _ in range(n_busy):
                            torch.mm(g, g)
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record()
                        dist.reduce_scatter_tensor(mine32, part)
                        e1.record()
                        e1.synchronize()
                        times.append(e0.elapsed_time(e1))
                    times.sort()
                    allt = [None] * world
                    dist.all_gather_object(allt, times)
                    if rank == 0:
                        print(f"reduce-scatter {label:30s} per rank min/median {[(round(t[0], 4), round(t[3], 4)) for t in allt]}",
                              flush=True)
                        rows.append(dict(variant=f"rs {label}", world=world, per_rank_sorted_ms=allt))
                del g
            else:
                raise SystemExit(f"unknown variant {variant}")
        except Exception as exc:  # a variant this torch or machine lacks: say so, go on
            msg = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            if rank == 0:
                print(f"{variant:28s} unavailable: {type(exc).__name__}: {msg}", flush=True)
            rows.append(dict(variant=variant, error=msg))
        torch.cuda.synchronize()
        dist.barrier()
    if rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(dev), torch=torch.__version__,
                           nccl=".".join(map(str, torch.cuda.nccl.version())), rows=rows), f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
