#!/usr/bin/env python3
"""Decode attention benchmark: one query row per sequence over a KV cache, tpattn's split-K kernel
(kernels/decode_attention.cu) beside torch SDPA (cuDNN, flash) given the same tensors, in one run
on one GPU. Times are CUDA-graph replays (the call captured once, replayed --iters times back to
back: the GPU's time without the host's launch cost). Bandwidth = the K and V bytes read / time;
the copy bandwidth (device-to-device, read + write) is measured in the same run.

Shapes (B, H, G, L, d): 1 32 32 4096 128; 64 32 8 8192 128; 1 32 32 32768 128 (fp16).
Writes PREFIX.json and PREFIX.md (--out, default benchmarks/decode_h200).

    PYTHONPATH=. python scripts/bench_decode.py [--commit SHA] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import copy_bandwidth, graph_ms  # noqa: E402
from tpattn.decode import decode_attention  # noqa: E402
from tpattn.report import versions  # noqa: E402

SHAPES = [(1, 32, 32, 4096, 128), (64, 32, 8, 8192, 128), (1, 32, 32, 32768, 128)]


def graph_us(fn, iters: int) -> float | None:
    """bench_kernels.graph_ms of fn() in microseconds (None where the call cannot be captured)."""
    ms = graph_ms(lambda _timer: fn(), iters)
    return None if ms is None else ms * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "decode_h200"))
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode.py needs a CUDA GPU (none is visible to torch); run it on a GPU machine", file=sys.stderr)
        return 2
    from torch.nn.attention import SDPBackend, sdpa_kernel
    bw = copy_bandwidth()
    rows = []
    for B, H, G, L, d in SHAPES:
        q = torch.randn(B, H, 1, d, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(B, G, L, d, device="cuda", dtype=torch.float16) for _ in range(2))
        kv_bytes = 2 * k.numel() * 2
        row = {"B": B, "H": H, "G": G, "L": L, "d": d, "kv_bytes": kv_bytes}
        row["tpattn_us"] = graph_us(lambda: decode_attention(q, k, v, L), a.iters)
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            def sdpa(be=be):
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=G != H)
            row[f"{name}_us"] = graph_us(sdpa, a.iters)  # None: SDPA refused the shape
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=G != H)
        row["max_err"] = (decode_attention(q, k, v, L).float() - ref).abs().max().item()
        for key in ("tpattn", "cudnn", "flash"):
            us = row.get(f"{key}_us")
            row[f"{key}_TBps"] = kv_bytes / (us * 1e-6) / 1e12 if us else None
        row["tpattn_of_copy_bw"] = row["tpattn_TBps"] * 1e3 / bw  # the copy's memory traffic (read + write) per second
        rows.append(row)
        print(f"B={B} H={H} G={G} L={L}: tpattn {row['tpattn_us']:.1f} us ({row['tpattn_TBps']:.2f} TB/s), "
              f"cuDNN {row['cudnn_us'] or float('nan'):.1f} us, flash {row['flash_us'] or float('nan'):.1f} us, "
              f"err {row['max_err']:.2e}", flush=True)
    res = {"gpu": torch.cuda.get_device_name(), "versions": versions(), "copy_GBps": bw,
           "command": " ".join(["python", *sys.argv]), "commit": a.commit,
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "rows": rows}
    Path(a.out + ".json").write_text(json.dumps(res, indent=2))
    f = (lambda x, s="{:.1f}": "-" if x is None else s.format(x))  # noqa: E731
    md = ["# Decode attention: tpattn's split-K kernel beside SDPA", "",
          f"{res['date']}, {res['gpu']}, commit {a.commit}, torch {res['versions'].get('torch')}; command "
          f"`{res['command']}`. CUDA-graph replays, fp16, one query row per sequence. Copy bandwidth "
          f"{bw:.0f} GB/s (bytes read + written by a device-to-device copy: the memory traffic it sustains).", "",
          "| B | H | G | L | d | tpattn µs | TB/s | of copy | cuDNN µs | TB/s | flash µs | max err |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['B']} | {r['H']} | {r['G']} | {r['L']} | {r['d']} | {f(r['tpattn_us'])} | "
                  f"{f(r['tpattn_TBps'], '{:.2f}')} | {f(r['tpattn_of_copy_bw'] * 100, '{:.0f}')}% | {f(r['cudnn_us'])} | "
                  f"{f(r['cudnn_TBps'], '{:.2f}')} | {f(r['flash_us'])} | {r['max_err']:.1e} |")
    Path(a.out + ".md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
