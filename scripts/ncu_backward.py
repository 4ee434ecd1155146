#!/usr/bin/env python3
"""The fused backward beside cuDNN's under Nsight Compute: where the time between them goes.

Two modes. Under ncu (on a GPU), one attention backward of one contender (tpattn's fused backend
or SDPA's cuDNN backend) after warm-up, the profiler on only around it (torch.cuda.profiler.start
and stop: run ncu with --profile-from-start off), the forward outside:

    for c in tpattn cudnn; do
      ncu --clock-control none --profile-from-start off --set full -o bwd_$c \\
          python scripts/ncu_backward.py --contender $c [--seq-len 4096] [--heads 32] [--kv-heads 8] [--causal]
      ncu --import bwd_$c.ncu-rep --csv --page details > bwd_$c.csv
    done

Then, anywhere (no GPU needed), each contender's kernels in launch order:

    python scripts/ncu_backward.py --report bwd_tpattn.csv bwd_cudnn.csv

The table: each kernel's duration, launch shape, registers, shared memory, occupancy, the SM's and
memory's throughput, issue and tensor-pipe activity, and the warp stall reasons that take the most
cycles (what Nsight Compute's details page holds for --set full); the rows ncu did not write are
left out.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (label, section, metric) from the details page; the first match of a metric name wins
ROWS = [
    ("duration", "GPU Speed Of Light Throughput", "Duration"),
    ("SM throughput %", "GPU Speed Of Light Throughput", "Compute (SM) Throughput"),
    ("memory throughput %", "GPU Speed Of Light Throughput", "Memory Throughput"),
    ("DRAM throughput %", "GPU Speed Of Light Throughput", "DRAM Throughput"),
    ("L2 throughput %", "GPU Speed Of Light Throughput", "L2 Cache Throughput"),
    ("grid", "Launch Statistics", "Grid Size"),
    ("block", "Launch Statistics", "Block Size"),
    ("registers / thread", "Launch Statistics", "Registers Per Thread"),
    ("dynamic shared / block", "Launch Statistics", "Dynamic Shared Memory Per Block"),
    ("waves / SM", "Launch Statistics", "Waves Per SM"),
    ("occupancy theoretical %", "Occupancy", "Theoretical Occupancy"),
    ("occupancy achieved %", "Occupancy", "Achieved Occupancy"),
    ("issue slots busy %", "Compute Workload Analysis", "Issue Slots Busy"),
    ("executed IPC", "Compute Workload Analysis", "Executed Ipc Active"),
    ("warp cycles / issued instr.", "Warp State Statistics", "Warp Cycles Per Issued Instruction"),
    ("eligible warps / scheduler", "Scheduler Statistics", "Eligible Warps Per Scheduler"),
    ("no eligible %", "Scheduler Statistics", "No Eligible"),
    ("shared bank conflicts", "Memory Workload Analysis Tables", "Shared Bank Conflicts"),
]


def workload(a) -> int:
    """One backward of a.contender (after warm-up), the profiler on around it only."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tpattn.attention import attention
    if not torch.cuda.is_available():
        print("ncu_backward: error: the workload needs a CUDA GPU (--report reads a CSV anywhere)", file=sys.stderr)
        return 2
    dt = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, G, N, d = a.batch, a.heads, a.kv_heads or a.heads, a.seq_len, a.head_dim
    q = torch.randn(B, H, N, d, device="cuda", dtype=dt, generator=g).requires_grad_(True)
    k, v = (torch.randn(B, G, N, d, device="cuda", dtype=dt, generator=g).requires_grad_(True) for _ in range(2))
    do = torch.randn(B, H, N, d, device="cuda", dtype=dt, generator=g)

    def ours():
        o = attention(q, k, v, a.causal, backend="fused")
        return o, lambda: o.backward(do)

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=a.causal, enable_gqa=G != H)
        return o, lambda: o.backward(do)
    fn = {"tpattn": ours, "cudnn": cudnn}[a.contender]
    for _ in range(3):  # warm-up: compile, load, tune
        fn()[1]()
    _, back = fn()  # the forward outside the profiled range
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    back()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one backward of {a.contender}: B={B} H={H} G={G} N={N} d={d} {a.dtype}"
          f"{' causal' if a.causal else ''}")
    return 0


def read_details(path: Path) -> list[dict]:
    """Kernels in launch order: {"id", "name", "metrics": {(section, metric): value with unit}}."""
    kernels: dict[str, dict] = {}
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    head = next((i for i, r in enumerate(rows) if "Metric Name" in r and "Kernel Name" in r), None)
    if head is None:  # not a details page (another page, or not ncu's CSV): no kernels
        return []
    cols = {c: i for i, c in enumerate(rows[head])}
    need = max(cols[c] for c in ("ID", "Kernel Name", "Section Name", "Metric Name", "Metric Value") if c in cols)
    for r in rows[head + 1:]:
        if len(r) <= need:  # (ncu 2025+ ends a metric's row after its value where no rule applies)
            continue
        kid = r[cols["ID"]]
        k = kernels.setdefault(kid, {"id": int(kid), "name": r[cols["Kernel Name"]], "metrics": {}})
        unit = r[cols["Metric Unit"]] if "Metric Unit" in cols and cols["Metric Unit"] < len(r) else ""
        k["metrics"][(r[cols["Section Name"]], r[cols["Metric Name"]])] = \
            f"{r[cols['Metric Value']]}{' ' + unit if unit and unit != '%' else ''}"
    return sorted(kernels.values(), key=lambda k: k["id"])


def stalls(k: dict, top: int = 5) -> list[str]:
    """The warp states with the most cycles per issued instruction (Warp State Statistics' 'Stall *')."""
    got = []
    for (section, metric), value in k["metrics"].items():
        if section.startswith("Warp State") and metric.lower().startswith("stall"):
            try:
                got.append((float(value.split()[0].replace(",", "")), metric))
            except ValueError:
                pass
    return [f"{m} {v:.2f}" for v, m in sorted(got, reverse=True)[:top]]


def report(path: Path) -> int:
    try:
        kernels = read_details(path)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        print(f"ncu_backward: error: cannot read {path} ({exc})", file=sys.stderr)
        return 2
    if not kernels:
        print(f"ncu_backward: error: no kernels in {path}; export it with --page details --csv", file=sys.stderr)
        return 2
    print(f"\n== {path.name}: {len(kernels)} kernel(s)")
    for k in kernels:
        short = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
        print(f"\n[{k['id']}] {short}")
        for label, section, metric in ROWS:
            value = k["metrics"].get((section, metric))
            if value is None:  # the same metric under another section name (ncu versions differ)
                value = next((v for (s, m), v in k["metrics"].items() if m == metric), None)
            if value is not None:
                print(f"  {label:<28} {value}")
        top = stalls(k)
        if top:
            print(f"  {'stalls (cycles / instr.)':<28} " + "; ".join(top))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/ncu_backward.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--report", metavar="CSV", nargs="+", help="summarize ncu's --page details --csv exports, one "
                   "per contender (no GPU needed)")
    p.add_argument("--contender", choices=("tpattn", "cudnn"), default="tpattn",
                   help="whose backward runs under the profiler (default tpattn)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (default --heads)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    p.add_argument("--causal", action="store_true")
    a = p.parse_args(argv)
    if a.report:
        missing = [r for r in a.report if not Path(r).is_file()]
        if missing:
            print(f"ncu_backward: error: no file {missing[0]}", file=sys.stderr)
            return 2
        return max(report(Path(r)) for r in a.report)
    return workload(a)


if __name__ == "__main__":
    sys.exit(main())
