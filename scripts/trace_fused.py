#!/usr/bin/env python3
"""Where a block of the warp-specialized fused kernel (kernels/fused_ws_attention.cu, fusedw) spends its
time, tile by tile: the kernel built with TW_TRACE, whose producer thread and the first thread of each
consumer warpgroup write clock64 at marked points (waits for a stage, for a turn, for a product, the
softmax, the epilogue) for the first few blocks. Per shape it prints the mean cycles of each step of a
consumer's tile (over the tiles of the traced blocks, the first tile of each block left out) and how
early the producer freed each tile's Q stage, and writes them to OUT/NAME.json (with --events the raw
events too). The marks cost a few instructions
each and move what ptxas makes of the consumer: read the steps against each other, not as the
untraced kernel's time. --fp8 traces the FP8 kernel (fused_ws_fp8.cu, fusedw8) instead, at B=4 H=32
N=16384 d=128, a scale per head, non-causal and causal, built with --fp8-build's softmax knobs.

    PYTHONPATH=. python scripts/trace_fused.py [--only "batch short" default] [--out DIR] [--name trace] [--events]
    PYTHONPATH=. python scripts/trace_fused.py --fp8 [--fp8-build FMA:LAZY] [--seq-len N]
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


def intervals(events: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """[(clock at `start`, clock at the next `end`)] of one role's events."""
    out, t0 = [], None
    for code, clk in events:
        if code == start:
            t0 = clk
        elif code == end and t0 is not None:
            out.append((t0, clk))
            t0 = None
    return out


def softmax_overlap(trace) -> float | None:
    """Of the cycles consumer 0 spends in a softmax (first: S_0 done -> softmax done; step: S_j done ->
    softmax done), the fraction during which consumer 1 is in one too (the two share the SM's MUFU:
    16 exponentials a clock). The clocks are one SM's (clock64), so a block's roles compare."""
    both = total = 0
    for roles in trace:
        a, b = (sorted(intervals(roles[r], 5, 6) + intervals(roles[r], 10, 11)) for r in (1, 2))
        j = 0
        for s0, e0 in a:  # (each role's intervals are disjoint: one pass over both, in order)
            total += e0 - s0
            while j < len(b) and b[j][1] <= s0:
                j += 1
            k = j
            while k < len(b) and b[k][0] < e0:
                both += min(e0, b[k][1]) - max(s0, b[k][0])
                k += 1
    return both / total if total else None


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
            "softmax_overlap": softmax_overlap(trace),
            "q_stage_free_before_q_in": statistics.mean(q_lead) if q_lead else None,
            "steps": {k: {"mean": statistics.mean(v), "count": len(v)} for k, v in gaps.items()}}


def _fp8_cases(args):
    """The traced module's name and [(shape row, traced call)] of the FP8 kernel: its build from
    --fp8-build, the operands prepared once (fp8_ws.prepare, a scale per head)."""
    from ab_fp8 import build_source, parse_build
    from tpattn.attention import fp8_ws
    b = parse_build(args.fp8_build)
    name = "trace_fp8_fma{}_lazy{}_tree{}_turn{}.cu".format(*b)
    build(name, "#define TW_TRACE\n" + build_source(*b), "fused_ws_fp8.cu")
    fp8_ws.SOURCE = name
    fp8_ws._prepared.clear()
    B, H, N = 4, 32, args.seq_len
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, 128, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
    ops = fp8_ws.prepare(q, k, v, "head", False)
    o = torch.empty_like(q)
    rows = [{"name": f"fp8 {args.fp8_build}" + (" causal" if c else ""), "batch": B, "heads": H, "kv_heads": H,
             "seq_len": N, "head_dim": 128, "dtype": "e4m3", "causal": c} for c in (False, True)]
    return name, [(r, (lambda c=r["causal"]: fp8_ws.launch(*ops, c, o, False))) for r in rows]


def _fp16_cases(args):
    """The traced module's name and [(users shape, traced call)] of fusedw (the shapes' operands made as
    each is traced)."""
    from tpattn.attention import get_backend
    name = "trace_fused_ws_attention.cu"
    build(name, "#define TW_TRACE\n" + kernel_source(KERNEL))
    use(name)
    return name, _fp16_calls(args, get_backend("fused"))


def _fp16_calls(args, fused):
    for s in SHAPE_SETS["users"]:
        if args.only and s["name"] not in args.only:
            continue
        b, h, g, n, d = s["batch"], s["heads"], s["kv_heads"], s["seq_len"], s["head_dim"]
        dtype = torch.bfloat16 if s["dtype"] == "bf16" else torch.float16
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(b, g, n, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
        o = torch.empty_like(q)
        yield s, (lambda q=q, k=k, v=v, o=o, c=s["causal"]: fused.forward(q, k, v, c, out=o))


def run(args) -> dict:
    import cupy
    import tpattn.cuda as tc
    nbytes = BLOCKS * ROLES * LEN * 8
    name, cases = _fp8_cases(args) if args.fp8 else _fp16_cases(args)
    ptr = tc._modules[(torch.cuda.current_device(), name)].get_global_var("tw_trace")
    ptr = ptr[0] if isinstance(ptr, tuple) else ptr
    rows = []
    for s, call in cases:
        b, h, g, n, d = s["batch"], s["heads"], s["kv_heads"], s["seq_len"], s["head_dim"]
        for _ in range(args.warmup):
            call()
        torch.cuda.synchronize()
        cupy.cuda.runtime.memset(ptr, 0, nbytes)
        call()
        torch.cuda.synchronize()
        raw = np.zeros(BLOCKS * ROLES * LEN, dtype=np.uint64)
        cupy.cuda.runtime.memcpy(raw.ctypes.data, ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToHost)
        trace = decode(raw)
        sm = summary(trace)
        rows.append({**s, "summary": sm, **({"events": trace} if args.events else {})})
        print(f"\n{s['name']}: B={b} H={h} G={g} N={n} d={d} {s['dtype']} causal={s['causal']}: "
              f"{sm['tiles']} tiles, {sm['tile_cycles']:.0f} cycles a tile; the producer freed the Q stage "
              f"{sm['q_stage_free_before_q_in']:.0f} cycles before the consumer found Q in; consumer 0's softmax "
              f"overlaps consumer 1's for {100 * (sm['softmax_overlap'] or 0):.0f} % of its cycles", flush=True)
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
    ap.add_argument("--fp8", action="store_true", help="trace the FP8 kernel (fusedw8) instead of the users shapes")
    ap.add_argument("--fp8-build", default="0:0", metavar="FMA:LAZY[:TREE[:TURN]]", help="with --fp8: its softmax knobs, as "
                    "scripts/ab_fp8.py's --builds (default 0:0, the kernel as tpattn builds it)")
    ap.add_argument("--seq-len", type=int, default=16384, help="with --fp8: N (default 16384)")
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
