#!/usr/bin/env python3
"""The FP8 (e4m3) attention forward (the Triton kernel, tpattn/attention/triton_fp8.py, and at d = 128 on
compute capability 9.0 the CUDA one, tpattn/attention/fp8_ws.py) beside tpattn's fp16 fused forward
and SDPA's cuDNN and flash backends, in one run on one GPU, and its error against float64 beside
fp16's.

    python scripts/bench_fp8.py [--batch 4] [--heads 32] [--seq-lens 4096 16384] [--head-dim 128]
                                [--causal] [--scaling head] [--rotate] [--rounds 5] [--commit C] [--out PREFIX]

Times: the kernel alone (the FP8 operands, their scales and V's transpose prepared once, outside the
timing, as a model whose K/V already sit in FP8 would hold them), CUDA events over 20 back-to-back
calls, the median of --rounds rounds with the contenders alternating. TFLOP/s: 4 B H N^2 d (halved
causal) over the time. Also the whole call (quantizing q, k, v and transposing V included) and the
quantization alone (fp8_quant's launches beside the same in torch). Error:
RMSE against float64 on B=1 of the same shape (N capped at 4096) with 0.1 % outliers of std 10, as
the accuracy table (benchmarks/fp8_accuracy_cpu.md) measures it. Writes PREFIX.json and PREFIX.md
(default results/fp8) with the GPU, command, date and commit.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from bench_kernels import git_commit, sdpa_backends  # noqa: E402

from tpattn.attention import fp8  # noqa: E402


def timed(fn, reps: int = 20) -> float:
    """ms a call: bench_paged.timed's CUDA events over back-to-back calls."""
    from bench_paged import timed as us
    return us(fn, reps) / 1e3


def contenders(B: int, H: int, N: int, d: int, causal: bool, scaling: str, rotate: bool) -> dict:
    from torch.nn.attention import sdpa_kernel

    from tpattn.attention import fp8_ws, get_backend, triton_fp8
    gen = torch.Generator(device="cuda").manual_seed(N)
    q, k, v = (torch.randn(B, H, N, d, device="cuda", generator=gen).half() for _ in range(3))
    ops = triton_fp8.prepare(q, k, v, scaling, rotate)
    o = torch.empty_like(q)
    sblk = triton_fp8.BLOCK if scaling == "block" else N
    fused = get_backend("fused")
    run = {"fp8 kernel": lambda: triton_fp8.launch(*ops, causal, o, sblk),
           "fp8 whole call": lambda: triton_fp8.attention(q, k, v, causal, scaling, rotate)}
    if fp8_ws.supported(q) is None:  # the CUDA kernel (fusedw8): d = 128 on compute capability 9.0
        ops_ws = (*ops[:2], fp8_ws.vt_for_kernel(ops[2]), *ops[3:])
        run["fp8 CUDA kernel"] = lambda: fp8_ws.launch(*ops_ws, causal, o, scaling == "block")
        run["fp8 CUDA whole call"] = lambda: fp8_ws.attention(q, k, v, causal, scaling, rotate)
    run["tpattn fused fp16"] = lambda: fused.forward(q, k, v, causal)
    # the quantization alone: fp8_quant's launches (one a tensor for block scales, two for a head's), and torch's
    run["fp8 quantization (fp8_quant)"] = lambda: triton_fp8.prepare(q, k, v, scaling, rotate)
    run["fp8 quantization (torch)"] = lambda: triton_fp8.prepare_torch(q, k, v, scaling, rotate)
    for name, backend in sdpa_backends().items():
        if name in ("sdpa_cudnn", "sdpa_flash"):
            def call(backend=backend):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            run[name.replace("_", " ")] = call
    return run


def error_rows(H: int, N: int, d: int, causal: bool, scaling: str, rotate: bool) -> dict:
    from tpattn.attention import fp8_ws, get_backend, triton_fp8
    q, k, v = fp8.inputs(1, H, H, min(N, 4096), d, outliers=1e-3, seed=1)
    ref = fp8.attention_float64(q, k, v, causal)
    q16, k16, v16 = (t.half().cuda() for t in (q, k, v))
    rows = {"fp8 kernel": fp8.rmse(triton_fp8.attention(q16, k16, v16, causal, scaling, rotate).cpu(), ref)}
    if fp8_ws.supported(q16) is None:
        rows["fp8 CUDA kernel"] = fp8.rmse(fp8_ws.attention(q16, k16, v16, causal, scaling, rotate).cpu(), ref)
    return {**rows, "fp8 emulation (torch)": fp8.rmse(fp8.attention_fp8(q, k, v, causal, scaling, rotate), ref),
            "tpattn fused fp16": fp8.rmse(get_backend("fused").forward(q16, k16, v16, causal).cpu(), ref)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/bench_fp8.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4, help="batch (default 4)")
    p.add_argument("--heads", type=int, default=32, help="heads (default 32)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384],
                   help="sequence lengths (default 4096 16384)")
    p.add_argument("--head-dim", type=int, default=128, choices=fp8.KERNEL_HEAD_DIMS, help="head dim (default 128)")
    p.add_argument("--causal", action="store_true", help="causal attention")
    p.add_argument("--scaling", choices=("tensor", "head", "block"), default="head",
                   help="the e4m3 scales: one a tensor, one a head, or one a kernel tile of 128 rows or keys "
                        "(default head)")
    p.add_argument("--rotate", action="store_true", help="Hadamard rotation of Q and K before quantizing")
    p.add_argument("--rounds", type=int, default=5, help="rounds, the contenders alternating in each (default 5)")
    p.add_argument("--commit", help="the commit, where the tree is a copy without its .git")
    p.add_argument("--out", default=str(ROOT / "results" / "fp8"),
                   help="PREFIX of the .json and .md written (default results/fp8)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8: error: needs a CUDA GPU; run it on a GPU machine", file=sys.stderr)
        return 2
    if torch.cuda.get_device_capability() < fp8.CC:
        print(f"bench_fp8: error: FP8 tensor cores need compute capability 8.9 or later (this GPU: "
              f"{torch.cuda.get_device_name()})", file=sys.stderr)
        return 2
    B, H, d = a.batch, a.heads, a.head_dim
    res = {"gpu": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "commit": git_commit(a.commit), "command": "python scripts/bench_fp8.py " + shlex.join(sys.argv[1:] if argv is None else argv),
           "rows": [], "errors": {}}
    print(f"{res['gpu']}: B={B} H={H} d={d}{' causal' if a.causal else ''}, FP8 scaling {a.scaling}"
          f"{' + rotation' if a.rotate else ''}; ms (median of {a.rounds} rounds), TFLOP/s", flush=True)
    for N in a.seq_lens:
        run = contenders(B, H, N, d, a.causal, a.scaling, a.rotate)
        times = {k: [] for k in run}
        for _ in range(a.rounds):
            for name, fn in run.items():
                times[name].append(timed(fn))
        flops = 4 * B * H * N * N * d / (2 if a.causal else 1)
        fp16 = statistics.median(times["tpattn fused fp16"])
        print(f"N={N}")
        for name, ts in times.items():
            ms = statistics.median(ts)
            row = {"N": N, "contender": name, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "vs_fused_fp16": fp16 / ms}
            res["rows"].append(row)
            print(f"  {name:<20} {ms:8.3f} ms  {row['tflops']:7.1f} TFLOP/s  x{row['vs_fused_fp16']:.2f} of fused fp16")
    res["errors"] = error_rows(H, max(a.seq_lens), d, a.causal, a.scaling, a.rotate)
    print("RMSE against float64 (B=1, N <= 4096, 0.1 % outliers of std 10): " +
          ", ".join(f"{k} {v:.2e}" for k, v in res["errors"].items()))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    md = [f"# FP8 attention forward, {res['gpu']}", "", f"{res['date']}, commit {res['commit']}. Command: "
          f"`{res['command']}`.", "", "| N | contender | ms | TFLOP/s | x of fused fp16 |", "|---|---|---:|---:|---:|"]
    md += [f"| {r['N']} | {r['contender']} | {r['ms']:.3f} | {r['tflops']:.1f} | {r['vs_fused_fp16']:.2f} |"
           for r in res["rows"]]
    md += ["", "RMSE against float64: " + ", ".join(f"{k} {v:.2e}" for k, v in res["errors"].items())]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
