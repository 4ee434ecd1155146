#!/usr/bin/env python3
"""Where a block of the warp-specialized fused kernel (kernels/fused_ws_attention.cu, fusedw) spends its
time, tile by tile: the kernel built with TW_TRACE, whose producer thread and the first thread of each
consumer warpgroup write clock64 at marked points (waits for a stage, for a turn, for a product, the
softmax, the epilogue) for the first few blocks. Per shape it prints the mean cycles of each step of a
consumer's tile (over the tiles of the traced blocks, the first tile of each block left out) and how
early the producer freed each tile's Q stage, and writes them to OUT/NAME.json (with --events the raw
events too). The marks cost a few instructions
each and move what ptxas makes of the consumer: read the steps against each other, not as the
untraced kernel's time.

    PYTHONPATH=. python scripts/trace_fused.py [--only "batch short" default] [--out DIR] [--name trace] [--events]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from ab_fused import KERNEL, build, use  # noqa: E402
from bench_kernels import SHAPE_SETS, git_commit  # noqa: E402
from tpattn.cuda import kernel_source  # noqa: E402

BLOCKS, ROLES, LEN = 4, 4, 4096  # TW_TRACE_BLOCKS, producer + up to 3 consumers, TW_TRACE_LEN
EVENTS = {
    1: "tile start", 2: "Q in", 3: "K_0 in", 4: "first: turn", 18: "first: S_0 issued (and O copied)",
    5: "first: S_0 done", 6: "first: softmax done", 7: "step start", 8: "step: K_j, V_j-1 in",
    9: "step: turn", 10: "step: S_j done", 11: "step: softmax done", 12: "step: PV done",
    13: "last start", 14: "last: V in", 15: "last: turn", 16: "last: PV done", 17: "O staged",
    20: "producer: tile start", 21: "producer: Q stage free", 22: "producer: K stage free",
    23: "producer: V stage free"}


def decode(raw: np.ndarray) -> list[list[list[tuple[int, int]]]]:
    """[block][role] -> [(code, clock)] in the order written (a zero word ends a row)."""
    out = []
    for b in range(BLOCKS):
        roles = []
        for r in range(ROLES):
            row = raw[(b * ROLES + r) * LEN:(b * ROLES + r + 1) * LEN]
            row = row[:int(np.argmax(row == 0)) if (row == 0).any() else LEN]
            roles.append([(int(v >> 48), int(v & 0xFFFFFFFFFFFF)) for v in row])
        out.append(roles)
    return out


def tiles_of(events: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """A consumer's events cut at each "tile start" (code 1)."""
    tiles: list[list[tuple[int, int]]] = []
    for code, clk in events:
        if code == 1:
            tiles.append([])
        if tiles:
            tiles[-1].append((code, clk))
    return tiles


def summary(trace) -> dict:
    """Mean cycles from each event to the next in a consumer's tiles (the steps of the key-tile loop
    pooled), the tile's length, and how far ahead of each tile's Q wait the producer freed its stage."""
    gaps: dict[str, list[int]] = {}
    lengths, q_lead = [], []
    for b, roles in enumerate(trace):
        prod_q = [clk for code, clk in roles[0] if code == 21]
        for r in (1, 2, 3):
            tiles = tiles_of(roles[r])
            for n, tile in enumerate(tiles):
                if n + 1 < len(tiles):
                    length = tiles[n + 1][0][1] - tile[0][1]
                    if n > 0:
                        lengths.append(length)
                if n == 0:
                    continue
                for (c0, t0), (c1, t1) in zip(tile, tile[1:]):
                    gaps.setdefault(f"{EVENTS[c0]} -> {EVENTS[c1]}", []).append(t1 - t0)
                q_in = next((clk for code, clk in tile if code == 2), None)
                if r == 1 and q_in is not None and n < len(prod_q):
                    q_lead.append(q_in - prod_q[n])
    return {"tile_cycles": statistics.mean(lengths) if lengths else None, "tiles": len(lengths),
            "q_stage_free_before_q_in": statistics.mean(q_lead) if q_lead else None,
            "steps": {k: {"mean": statistics.mean(v), "count": len(v)} for k, v in gaps.items()}}


def run(args) -> dict:
    import cupy
    import tpattn.cuda as tc
    from tpattn.attention import get_backend
    name = "trace_fused_ws_attention.cu"
    build(name, "#define TW_TRACE\n" + kernel_source(KERNEL))
    use(name)
    mod = tc._modules[(torch.cuda.current_device(), name)]
    ptr = mod.get_global_var("tw_trace")
    ptr = ptr[0] if isinstance(ptr, tuple) else ptr
    nbytes = BLOCKS * ROLES * LEN * 8
    fused = get_backend("fused")
    rows = []
    for s in SHAPE_SETS["users"]:
        if args.only and s["name"] not in args.only:
            continue
        b, h, g, n, d = s["batch"], s["heads"], s["kv_heads"], s["seq_len"], s["head_dim"]
        dtype = torch.bfloat16 if s["dtype"] == "bf16" else torch.float16
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(b, g, n, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
        o = torch.empty_like(q)
        for _ in range(args.warmup):
            fused.forward(q, k, v, s["causal"], out=o)
        torch.cuda.synchronize()
        cupy.cuda.runtime.memset(ptr, 0, nbytes)
        fused.forward(q, k, v, s["causal"], out=o)
        torch.cuda.synchronize()
        raw = np.zeros(BLOCKS * ROLES * LEN, dtype=np.uint64)
        cupy.cuda.runtime.memcpy(raw.ctypes.data, ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToHost)
        trace = decode(raw)
        sm = summary(trace)
        rows.append({**s, "summary": sm, **({"events": trace} if args.events else {})})
        print(f"\n{s['name']}: B={b} H={h} G={g} N={n} d={d} {s['dtype']} causal={s['causal']}: "
              f"{sm['tiles']} tiles, {sm['tile_cycles']:.0f} cycles a tile; the producer freed the Q stage "
              f"{sm['q_stage_free_before_q_in']:.0f} cycles before the consumer found Q in", flush=True)
        for k_, st in sm["steps"].items():
            print(f"  {st['mean']:8.0f}  x{st['count']:<5d} {k_}")
    return {"gpu": torch.cuda.get_device_name(), "command": "python " + shlex.join(sys.argv),
            "commit": git_commit(args.commit), "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="SHAPE", help="users shapes by name (default: all)")
    ap.add_argument("--warmup", type=int, default=5, help="calls before the traced one")
    ap.add_argument("--out", default="benchmarks/fused_shapes_h200", help="folder of the JSON")
    ap.add_argument("--name", default="trace", help="file name of the JSON, without .json")
    ap.add_argument("--events", action="store_true", help="the raw events in the JSON too ([block][role] -> "
                    "[(code, clock)], role 0 the producer; a few MB)")
    ap.add_argument("--commit", help="the commit to record (a copy of the tree without .git)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("trace_fused: needs a CUDA GPU (compute capability 9.0); run it on a GPU machine", file=sys.stderr)
        return 2
    res = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(res) + "\n")
    print(f"wrote {out / args.name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
