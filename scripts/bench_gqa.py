#!/usr/bin/env python3
"""Grouped-query attention benchmark: --kernel fused with fewer K/V heads than query heads, beside
torch SDPA given the same grouped K/V, and beside fused with as many K/V heads as query heads.

For each sequence length N and K/V head count G (default H = 32 query heads, G in 32, 8, 1, d = 128,
N in 4096 and 16384, non-causal and causal, fp16), in one run on one GPU:

  fused             tpattn's fused kernel on q [1, H, N, d] and k, v [1, G, N, d] (each query head
                    reads its group's K/V head in place; K and V never repeated)
  fused[2:...]      the portable mma.sync kernel forced (--fused-configs 2:w4_m1_c64), where the GPU
                    would run the wgmma one
  sdpa_flash, sdpa_cudnn, sdpa_efficient
                    F.scaled_dot_product_attention(q, k, v, enable_gqa=True) under
                    torch.nn.attention.sdpa_kernel([backend]); a backend that refuses grouped K/V is
                    reported as skipped with torch's reason
  sdpa_flash[expanded], sdpa_cudnn[expanded]
                    the same backend on K and V repeated to H heads beforehand (repeat_interleave,
                    not timed): what a layer without GQA support in its kernel runs

Per row: median ms over --iters (CUDA events, after --warmup), TFLOP/s (4 H N^2 d, halved when
causal), the bytes of Q, K, V and O it must move and GB/s, the peak device memory the call
allocates beyond its inputs, and its output's max |diff| / rms against float32 attention on the
expanded K/V (checked once, on 64 query rows of every head; above 2e-2 for fp16, 1e-1 for bf16 the
row says CHECK FAILED: a number for a wrong result is no number). The table then gives, at each N and
causality, fused(G) / fused(G = H) (the issue's "no slower": K/V traffic only shrinks) and
fused / SDPA with the same grouping.

Writes gqa[_causal].json and .md to --out (GPU, versions, command with every number).

    PYTHONPATH=. python scripts/bench_gqa.py [--heads 32] [--kv-heads 32 8 1] [--seq-lens 4096 16384]
        [--causal] [--out results/gqa] [--fused-configs 2:w4_m1_c64]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tpattn.attention import get_backend  # noqa: E402
from tpattn.report import versions  # noqa: E402
from tpattn.timing import Timer  # noqa: E402

CHECK_ROWS = 64  # query rows of every head checked against attention in float32 on expanded K/V
TOL = {"fp16": 2e-2, "bf16": 1e-1}  # max |diff| / rms(ref) beyond which a row is marked CHECK FAILED


def timed(fn, warmup: int, iters: int) -> list[float]:
    """ms of each of `iters` calls of fn(), CUDA events around each, after `warmup` calls."""
    timer = Timer(torch.device("cuda"))
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        with timer.section("call"):
            fn()
        samples.append(timer.collect()["call"])
    return samples


def peak_bytes(fn) -> int:
    """Device memory one call allocates at its peak, beyond what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def sdpa_backends() -> dict:
    from torch.nn.attention import SDPBackend
    return {"sdpa_" + name.split("_")[0].lower(): getattr(SDPBackend, name)
            for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION") if hasattr(SDPBackend, name)}


def with_env(var: str, value: str, fn):
    """fn() with environment variable var set to value for the call."""
    def call():
        old = os.environ.get(var)
        os.environ[var] = value
        try:
            return fn()
        finally:
            if old is None:
                os.environ.pop(var)
            else:
                os.environ[var] = old
    return call


def oracle_rows(q, k, v, causal: bool, rows: torch.Tensor) -> torch.Tensor:
    """Float32 attention of the given query rows (every head) on K/V expanded to every query head."""
    r = q.shape[1] // k.shape[1]
    ke, ve = (t.float().repeat_interleave(r, dim=1) for t in (k, v))
    s = q[:, :, rows].float() @ ke.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        s.masked_fill_(torch.arange(n, device=q.device)[None, :] > rows[:, None], float("-inf"))
    return torch.softmax(s, -1) @ ve


def run(args) -> dict:
    from torch.nn.attention import sdpa_kernel
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    el = torch.empty((), dtype=dtype).element_size()
    fused = get_backend("fused")
    H, d, B = args.heads, args.head_dim, args.batch
    for g in args.kv_heads:
        if g < 1 or H % g:
            raise SystemExit(f"--kv-heads {g} is not a divisor of --heads {H}")
    rows = []
    print(f"{torch.cuda.get_device_name()}: H={H} d={d} B={B} {args.dtype} causal={args.causal}", flush=True)
    for n in args.seq_lens:
        check = torch.linspace(0, n - 1, min(n, CHECK_ROWS), device="cuda").round().long().unique()
        for g in args.kv_heads:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(B, H, n, d, device="cuda", generator=gen, dtype=dtype)
            k, v = (torch.randn(B, g, n, d, device="cuda", generator=gen, dtype=dtype) for _ in range(2))
            ke, ve = (t.repeat_interleave(H // g, dim=1) for t in (k, v))
            ref = oracle_rows(q, k, v, args.causal, check)
            flops = 4 * B * H * n * n * d / (2 if args.causal else 1)
            moved = 2 * B * H * n * d * el + 2 * B * g * n * d * el       # Q and O; K and V (grouped)
            moved_expanded = 4 * B * H * n * d * el
            calls = {"fused": (lambda: fused.forward(q, k, v, args.causal), moved)}
            for cfg in args.fused_configs:
                ver, _, rest = cfg.partition(":")
                name = "fusedh_{suf}_d{d}" if ver == "h" else "fused2_{suf}_d{d}_" + rest
                calls[f"fused[{cfg}]"] = (with_env("TPATTN_FUSED_CFG", name,
                                                   lambda: fused.forward(q, k, v, args.causal)), moved)
            for label, backend in sdpa_backends().items():
                def grouped(backend=backend):
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=args.causal, enable_gqa=True)

                def expanded(backend=backend):
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(q, ke, ve, is_causal=args.causal)
                calls[label] = (grouped, moved)
                if label != "sdpa_efficient" and g < H:
                    calls[f"{label}[expanded]"] = (expanded, moved_expanded)
            for name, (fn, nbytes) in calls.items():
                if args.kernels and name.split("[")[0] not in args.kernels:
                    continue
                try:
                    out = fn()
                    torch.cuda.synchronize()
                    err = (out[:, :, check].float() - ref).abs().max().item() / ref.pow(2).mean().sqrt().item()
                    del out
                    mem = peak_bytes(fn)
                    t = timed(fn, args.warmup, args.iters)
                except (RuntimeError, ValueError, TypeError) as exc:  # a backend that refuses the call
                    why = " ".join(str(exc).split())[:160]
                    rows.append({"kernel": name, "seq_len": n, "kv_heads": g, "skipped": why})
                    print(f"  {name:<22} N={n:<6} G={g:<3} skipped: {why}", flush=True)
                    continue
                ms = statistics.median(t)
                row = {"kernel": name, "batch": B, "heads": H, "kv_heads": g, "seq_len": n, "head_dim": d,
                       "dtype": args.dtype, "causal": args.causal, "ms": ms, "ms_min": min(t), "ms_max": max(t),
                       "tflops": flops / (ms * 1e-3) / 1e12, "bytes": nbytes, "gbps": nbytes / (ms * 1e-3) / 1e9,
                       "peak_bytes": mem, "rel_err": err, "check": "PASS" if err <= TOL[args.dtype] else "FAILED"}
                rows.append(row)
                print(f"  {name:<22} N={n:<6} G={g:<3} {ms:9.3f} ms  {row['tflops']:7.1f} TFLOP/s  "
                      f"{row['gbps']:7.0f} GB/s  {mem / 2**20:8.1f} MiB  err {err:.1e}"
                      + ("" if row["check"] == "PASS" else "  CHECK FAILED"), flush=True)
            del q, k, v, ke, ve, ref
            torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(), "versions": versions(), "command": "python " + shlex.join(sys.argv),
            "config": {"heads": H, "kv_heads": args.kv_heads, "head_dim": d, "batch": B, "dtype": args.dtype,
                       "causal": args.causal, "warmup": args.warmup, "iters": args.iters},
            "rows": rows}


def markdown(res: dict) -> str:
    c = res["config"]
    H = c["heads"]
    lines = [f"# Grouped-query attention on {res['gpu']}", "",
             f"Command: `{res['command']}`  ", f"Versions: {res['versions']}  ",
             f"H = {H} query heads, d = {c['head_dim']}, B = {c['batch']}, {c['dtype']}, "
             f"causal = {c['causal']}; median of {c['iters']} calls after {c['warmup']} warm-up.", "",
             "| N | G | kernel | ms | TFLOP/s | GB/s | peak MiB | vs fused G=H | fused / this | err / rms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    done = [r for r in res["rows"] if "ms" in r]
    by = {(r["seq_len"], r["kv_heads"], r["kernel"]): r for r in done}
    for r in done:
        n, g = r["seq_len"], r["kv_heads"]
        full = by.get((n, H, r["kernel"]))
        vs_full = f"{r['ms'] / full['ms']:.3f}" if full and r["kernel"].startswith("fused") else ""
        f = by.get((n, g, "fused"))
        ratio = f"{f['ms'] / r['ms']:.3f}" if f and not r["kernel"].startswith("fused") else ""
        lines.append(f"| {n} | {g} | {r['kernel']} | {r['ms']:.3f} | {r['tflops']:.1f} | {r['gbps']:.0f} | "
                     f"{r['peak_bytes'] / 2**20:.1f} | {vs_full} | {ratio} | {r['rel_err']:.1e}"
                     f"{'' if r['check'] == 'PASS' else ' CHECK FAILED'} |")
    skipped = [r for r in res["rows"] if "skipped" in r]
    if skipped:
        lines += ["", "Skipped (the backend refused the call):", ""]
        lines += [f"- {r['kernel']} N={r['seq_len']} G={r['kv_heads']}: {r['skipped']}" for r in skipped]
    lines += ["", "vs fused G=H: this fused row's time over fused's with as many K/V heads as query heads "
              "(<= 1: grouping costs nothing). fused / this: fused's time over this peer's at the same N "
              "and G (< 1: fused is faster)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, nargs="+", default=[32, 8, 1])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--causal", action="store_true")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--kernels", nargs="+", default=None,
                   help="rows to run (default all): fused sdpa_flash sdpa_cudnn sdpa_efficient")
    p.add_argument("--fused-configs", nargs="*", default=[], metavar="2:wW_mM_cC|h",
                   help="extra fused rows: 2:wW_mM_cC the mma.sync kernel, h the wgmma one (as bench_kernels.py)")
    p.add_argument("--out", default="benchmarks", help="folder for gqa[_causal].json and .md")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_gqa: needs a CUDA GPU (and CuPy); nothing to measure here", file=sys.stderr)
        return 2
    res = run(args)
    failed = [r for r in res["rows"] if r.get("check") == "FAILED"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "gqa" + ("_causal" if args.causal else "")
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    (out / f"{stem}.md").write_text(markdown(res))
    print(markdown(res))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
