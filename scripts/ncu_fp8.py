#!/usr/bin/env python3
"""The CUDA FP8 forward (fusedw8, kernels/fused_ws_fp8.cu) under Nsight Compute: where its time goes.

Three modes. Under ncu (on a GPU of compute capability 9.0), one call of a contender after warm-up,
the profiler on only around it (run ncu with --profile-from-start off): fp8, the FP8 kernel over
operands quantized before the profiled range (a scale per head); fp16, tpattn's fp16 fused forward
of the same inputs, for comparison:

    for c in fp8 fp16; do
      ncu --clock-control none --profile-from-start off --set full --import-source yes -o fwd_$c \\
          python scripts/ncu_fp8.py --contender $c [--seq-len 16384] [--batch 4] [--heads 32] [--causal]
      ncu --import fwd_$c.ncu-rep --csv --page details > fwd_$c.csv
      ncu --import fwd_$c.ncu-rep --csv --page source --print-source sass > fwd_${c}_sass.csv
    done

Then, anywhere (no GPU needed): each contender's kernels (duration, occupancy, issue activity,
throughput, the warp stall reasons; scripts/ncu_backward.py's table)

    python scripts/ncu_fp8.py --report fwd_fp8.csv fwd_fp16.csv

and, from the source page, the warp-stall samples summed by opcode and by stall reason, over the
consumers' key-tile loop: the instructions executed within a factor --min-share of the loop body's
count, the count whose instructions make up the most executed instructions (count x instructions
sharing it; the prologue, the per-tile code and the producer's single thread fall below it, the
waits' polling loops, executed more often by fewer instructions, above it), and the instructions
with the most samples:

    python scripts/ncu_fp8.py --opcodes fwd_fp8_sass.csv [--min-share 0.5] [--top 25]
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def workload(a) -> int:
    """One call of a.contender (after warm-up), the profiler on around it only."""
    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("ncu_fp8: error: the workload needs a GPU of compute capability 9.0 (--report and --opcodes read "
              "CSV files anywhere)", file=sys.stderr)
        return 2
    from tpattn.attention import attention, fp8_ws
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, N, d = a.batch, a.heads, a.seq_len, 128
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    if a.contender == "fp8":
        ops = fp8_ws.prepare(q, k, v, "head", False)
        out = torch.empty_like(q)

        def call():
            fp8_ws.launch(*ops, a.causal, out, False)
    else:
        def call():
            attention(q, k, v, a.causal, backend="fused")
    for _ in range(3):  # warm-up: compile, load
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one forward of {a.contender}: B={B} H={H} N={N} d={d}{' causal' if a.causal else ''}")
    return 0


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source(path: Path) -> tuple[list[dict], list[str]]:
    """The source page's SASS rows: {"sass", "executed", "samples", "reasons": {name: samples}}, and the
    stall reason columns found. ValueError (one line) when the file is not that page."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    head = next((i for i, r in enumerate(rows) if "Source" in r and any("Warp Stall Sampling (All" in c for c in r)),
                None)
    if head is None:
        raise ValueError(f"{path} has no 'Source' and 'Warp Stall Sampling (All Samples)' columns; export it with "
                         "ncu --import REPORT --csv --page source --print-source sass")
    cols = rows[head]
    at = {c: i for i, c in enumerate(cols)}
    samples = next(c for c in cols if c.startswith("Warp Stall Sampling (All"))
    executed = next((c for c in cols if c == "Instructions Executed"), None)
    reasons = [c for c in cols if c.startswith("stall_")]
    out = []
    for r in rows[head + 1:]:
        if len(r) < len(cols):
            continue
        out.append({"sass": r[at["Source"]].strip(), "executed": _number(r[at[executed]]) if executed else 0.0,
                    "samples": _number(r[at[samples]]), "reasons": {c: _number(r[at[c]]) for c in reasons}})
    return out, reasons


def opcode(sass: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers: '@!P0 FFMA.FTZ R1, ...' -> 'FFMA'."""
    words = re.sub(r"^@!?U?P\w+\s+", "", sass).split()
    return words[0].split(".")[0] if words else "?"


def opcodes(path: Path, min_share: float, top: int) -> int:
    try:
        rows, reasons = read_source(path)
    except (OSError, UnicodeDecodeError, csv.Error, ValueError) as exc:
        print(f"ncu_fp8: error: {exc}", file=sys.stderr)
        return 2
    counts = Counter(r["executed"] for r in rows if r["executed"] > 0)
    loop = max(counts, key=lambda c: c * counts[c]) if counts else 0.0  # most executed instructions: the loop body
    hot = [r for r in rows if min_share * loop <= r["executed"] <= loop / min_share] if loop and min_share else rows
    total = sum(r["samples"] for r in hot)
    if not hot or total <= 0:
        print(f"ncu_fp8: error: no warp-stall samples in {path}; profile with --set full (or --section "
              "SourceCounters)", file=sys.stderr)
        return 2
    by_op, by_reason, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for r in hot:
        by_op[opcode(r["sass"])] += r["samples"]
        count[opcode(r["sass"])] += 1
        for c, n in r["reasons"].items():
            by_reason[c] += n
    print(f"== {path.name}: {len(hot)} instructions executed within a factor {min_share:g} of the loop body's "
          f"{loop:.3g} times ({counts[loop] if counts else 0} instructions executed that often); {total:.0f} "
          "warp-stall samples")
    print("by opcode (share of the samples, instructions):")
    for op, n in sorted(by_op.items(), key=lambda x: -x[1]):
        if n / total >= 0.002:
            print(f"  {op:<14} {100 * n / total:5.1f} %  n={count[op]}")
    if by_reason:
        print("by stall reason:")
        for c, n in sorted(by_reason.items(), key=lambda x: -x[1]):
            if n / total >= 0.002:
                print(f"  {c:<28} {100 * n / total:5.1f} %")
    print(f"the {top} instructions with the most samples:")
    for r in sorted(hot, key=lambda r: -r["samples"])[:top]:
        why = max(r["reasons"], key=r["reasons"].get) if r["reasons"] else ""
        print(f"  {100 * r['samples'] / total:5.1f} %  {why:<24} {r['sass'][:90]}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/ncu_fp8.py", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--report", metavar="CSV", nargs="+", help="summarize ncu's --page details --csv exports, one "
                      "per contender (no GPU needed)")
    mode.add_argument("--opcodes", metavar="CSV", help="sum the warp-stall samples of ncu's --page source --csv "
                      "--print-source sass export by opcode and stall reason (no GPU needed)")
    p.add_argument("--min-share", type=float, default=0.5, help="--opcodes: the instructions executed within this "
                   "factor of the loop body's count (default 0.5; 0: all)")
    p.add_argument("--top", type=int, default=25, help="--opcodes: how many single instructions to list (default 25)")
    p.add_argument("--contender", choices=("fp8", "fp16"), default="fp8",
                   help="whose forward runs under the profiler (default fp8)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--causal", action="store_true")
    a = p.parse_args(argv)
    if not 0.0 <= a.min_share <= 1.0:
        p.error(f"--min-share is a share of the most executed instruction's count, 0 to 1 (got {a.min_share})")
    if a.top < 1:
        p.error(f"--top takes a positive count (got {a.top})")
    if min(a.batch, a.heads, a.seq_len) < 1:
        p.error("--batch, --heads and --seq-len take positive sizes")
    for f in (a.report or []) + ([a.opcodes] if a.opcodes else []):
        if not Path(f).is_file():
            print(f"ncu_fp8: error: no file {f}", file=sys.stderr)
            return 2
    if a.report:
        from ncu_backward import report
        return max(report(Path(r)) for r in a.report)
    if a.opcodes:
        return opcodes(Path(a.opcodes), a.min_share, a.top)
    return workload(a)


if __name__ == "__main__":
    sys.exit(main())
