#!/usr/bin/env python3
"""Builds of the CUDA FP8 forward (kernels/fused_ws_fp8.cu, fusedw8) with its softmax knobs side by
side in one process, each FMA:LAZY, FMA:LAZY:TREE or FMA:LAZY:TREE:TURN:

    FMA   of a thread's 16 pairs of scores a row, how many are exponentiated on the FMA and integer
          pipes (hopper_common.cuh's hw_exp2_fma, a degree-3 polynomial) instead of the MUFU, whose
          16 results a clock an SM take, at e4m3's tensor rate, as long as a tile's two products
          (TW_F8_FMA, 0 to 16)
    LAZY  the running row max moves only by more than LAZY powers of 2 (a warp vote), and O is rescaled
          only where one moved (TW_F8_LAZY, 0 to 8: P stays under e4m3's 448)
    TREE  each row's max over TREE running maxima, so the dependent chain of fmaxf is 16 / TREE long
          (TW_F8_TREE: 1, 2, 4, 8 or 16; default 1, one chain; the same bits at every TREE)
    TURN  1: the two consumer warpgroups take turns at the softmax (named barriers), as they do at
          issuing their products, so that their exponentials do not share the MUFU at once; 2: at
          the exponentials only, each row max taken before the turn (TW_F8_TURN; default 0; the
          same bits)

Every build is compiled under its own name and timed in the same rounds (CUDA events over --calls
calls, the builds alternating, the median of --rounds), on the same prepared operands (a scale per
head), with its RMSE against float64 on two heads of the first 2048 rows. The first build is the
baseline of the ratio column; 0:0 (0:0:1, 0:0:1:0) is the kernel as tpattn builds it by default.

    PYTHONPATH=. python scripts/ab_fp8.py [--builds 0:0 0:0:1:1 0:0:1:2 2:0:1:2 4:0:1:2] [--seq-len 16384] [--causal]

The default builds are the turns (TURN 1 and 2, and TURN 2 with 2 or 4 of a row's 16 pairs on the FMA
pipes, whose issue slots a turn leaves free); the first three knobs alone were timed on an H100 and are
slower than 0:0 (docs/fp8.md).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from ab_fused import build  # noqa: E402  (a build compiled under its own module name)

KERNEL = "fused_ws_fp8.cu"


def parse_build(text: str) -> tuple[int, int, int, int]:
    """(FMA, LAZY, TREE, TURN) of 'FMA:LAZY' (TREE 1, TURN 0), 'FMA:LAZY:TREE' or 'FMA:LAZY:TREE:TURN', or a
    ValueError that says what is wrong in one line."""
    m = re.fullmatch(r"(\d+):(\d+)(?::(\d+)(?::(\d+))?)?", text)
    if not m:
        raise ValueError(f"--builds {text!r}: give FMA:LAZY, FMA:LAZY:TREE or FMA:LAZY:TREE:TURN, such as 4:8, "
                         "0:0:4 or 0:0:1:1")
    fma, lazy, tree, turn = int(m.group(1)), int(m.group(2)), int(m.group(3) or 1), int(m.group(4) or 0)
    if fma > 16:
        raise ValueError(f"--builds {text!r}: FMA counts pairs of a row's 16, at most 16")
    if lazy > 8:
        raise ValueError(f"--builds {text!r}: LAZY is at most 8 (P up to 2^LAZY must stay under e4m3's 448)")
    if tree not in (1, 2, 4, 8, 16):
        raise ValueError(f"--builds {text!r}: TREE is 1, 2, 4, 8 or 16 (it divides a row's 16 pairs)")
    if turn > 2:
        raise ValueError(f"--builds {text!r}: TURN is 0, 1 or 2 (no turns at the softmax, turns at all of it, "
                         "at its exponentials)")
    return fma, lazy, tree, turn


def build_source(fma: int, lazy: int, tree: int = 1, turn: int = 0) -> str:
    """fused_ws_fp8.cu with its headers inlined, TW_F8_FMA, TW_F8_LAZY, TW_F8_TREE and TW_F8_TURN defined first."""
    from tpattn.cuda import kernel_source
    return (f"#define TW_F8_FMA {fma}\n#define TW_F8_LAZY {lazy}\n#define TW_F8_TREE {tree}\n#define TW_F8_TURN {turn}\n"
            + kernel_source(KERNEL))


def label(b: tuple[int, int, int, int]) -> str:
    """A build as --builds names it: FMA:LAZY, with :TREE where it or TURN is not the default, :TURN where it is 1."""
    return ":".join(map(str, b if b[3] else b[:3] if b[2] != 1 else b[:2]))


def run(args, builds: list[tuple[int, int, int, int]]) -> list[dict]:
    from tpattn.attention import fp8, fp8_ws
    B, H, N, d = args.batch, args.heads, args.seq_len, 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16) for _ in range(3))
    ops = fp8_ws.prepare(q, k, v, "head", False)
    n0 = min(N, 2048)
    small = [t[:1, :2, :n0].contiguous() for t in (q, k, v)]
    ref = fp8.attention_float64(*(t.double().cpu() for t in small), args.causal)
    small_ops = fp8_ws.prepare(*small, "head", False)
    rmse, out = {}, torch.empty_like(q)
    for b in builds:
        build(source_name(b), build_source(*b), KERNEL)
        use(b)
        o_small = torch.empty_like(small[0])
        fp8_ws.launch(*small_ops, args.causal, o_small, False)
        rmse[b] = fp8.rmse(o_small.cpu(), ref)
    times = {b: [] for b in builds}
    for _ in range(args.rounds):
        for b in builds:
            use(b)
            fp8_ws.launch(*ops, args.causal, out, False)  # packs this build's launch once
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(args.calls):
                fp8_ws.launch(*ops, args.causal, out, False)
            e1.record()
            torch.cuda.synchronize()
            times[b].append(e0.elapsed_time(e1) / args.calls)
    use(None)
    flops = 4 * B * H * N * N * d / (2 if args.causal else 1)
    med = {b: statistics.median(t) for b, t in times.items()}
    return [{"build": label(b), "fma": b[0], "lazy": b[1], "tree": b[2], "turn": b[3], "ms": med[b], "rounds": times[b],
             "tflops": flops / med[b] / 1e9, "speedup": med[builds[0]] / med[b], "rmse": rmse[b]} for b in builds]


def source_name(b: tuple[int, int, int, int]) -> str:
    return "ab_fp8_fma{}_lazy{}_tree{}_turn{}.cu".format(*b)


def use(b: tuple[int, int, int, int] | None) -> None:
    """fp8_ws's next launches from the build b (None: the default module again)."""
    from tpattn.attention import fp8_ws
    fp8_ws.SOURCE = KERNEL if b is None else source_name(b)
    fp8_ws._prepared.clear()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builds", nargs="+", default=["0:0", "0:0:1:1", "0:0:1:2", "2:0:1:2", "4:0:1:2"],
                   metavar="FMA:LAZY[:TREE[:TURN]]",
                   help="builds to time, the first the ratio's baseline (default 0:0 0:0:1:1 0:0:1:2 2:0:1:2 4:0:1:2)")
    p.add_argument("--seq-len", type=int, default=16384, help="N (default 16384)")
    p.add_argument("--batch", type=int, default=4, help="B (default 4)")
    p.add_argument("--heads", type=int, default=32, help="H (default 32)")
    p.add_argument("--causal", action="store_true", help="causal attention")
    p.add_argument("--rounds", type=int, default=5, help="rounds, the builds alternating (default 5)")
    p.add_argument("--calls", type=int, default=10, help="calls a build's time is taken over (default 10)")
    args = p.parse_args()
    try:
        builds = [parse_build(b) for b in args.builds]
    except ValueError as exc:
        print(f"ab_fp8: {exc}", file=sys.stderr)
        return 2
    if len(set(builds)) != len(builds):
        print("ab_fp8: --builds names a build twice", file=sys.stderr)
        return 2
    for name, value in (("--seq-len", args.seq_len), ("--batch", args.batch), ("--heads", args.heads),
                        ("--rounds", args.rounds), ("--calls", args.calls)):
        if value < 1:
            print(f"ab_fp8: {name} must be at least 1 (got {value})", file=sys.stderr)
            return 2
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("ab_fp8: needs a GPU of compute capability 9.0 (fusedw8 is sm_90a) and CuPy; nothing to measure here",
              file=sys.stderr)
        return 2
    rows = run(args, builds)
    print(f"{torch.cuda.get_device_name()}: fusedw8, B={args.batch} H={args.heads} N={args.seq_len} d=128 "
          f"causal={args.causal}, a scale per head; median of {args.rounds} rounds of {args.calls} calls")
    print("| FMA:LAZY[:TREE[:TURN]] | ms | TFLOP/s | x first | RMSE vs float64 |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['build']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['speedup']:.3f} | {r['rmse']:.3e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
