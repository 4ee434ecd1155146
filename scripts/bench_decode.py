#!/usr/bin/env python3
"""Decode attention benchmark: one query row per sequence over a KV cache, tpattn's split-K kernel
(kernels/decode_attention.cu) beside torch SDPA (cuDNN, flash) given the same tensors, in one run
on one GPU. Times are CUDA-graph replays (the call captured once, replayed --iters times back to
back: the GPU's time without the host's launch cost; the best of three captures). Bandwidth = the K and V bytes read / time;
the copy bandwidth (device-to-device, read + write) is measured in the same run.

Shapes (B, H, G, L, d): 1 32 32 4096 128; 64 32 8 8192 128; 1 32 32 32768 128; 8 32 8 4096 128;
1 32 8 8192 128; 16 32 1 4096 128 (fp16). tpattn's time is the split it picks; each split's own
time beside it.

Then the whole decode step on one GPU, D = H d = 4096, B = 1, a cache of L = 4096 positions: the
layer's step (QKV GEMV, rotary positions and cache append in one kernel, the split-K kernel, the
output GEMV; one CUDA graph replayed for every step, the length read on the device: the replays
run at lengths L - iters/2 .. L + iters/2) beside a plain PyTorch step given the same weights and
cache (addmm, index_copy_ into the cache, SDPA cuDNN or flash over the first L positions, addmm;
captured at L), without rotary positions and with them (the plain step's: rotate-half in torch ops).
Writes PREFIX.json and PREFIX.md (--out, default benchmarks/decode_h200).

    PYTHONPATH=. python scripts/bench_decode.py [--commit SHA] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import json
import shlex
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

SHAPES = [(1, 32, 32, 4096, 128), (64, 32, 8, 8192, 128), (1, 32, 32, 32768, 128), (8, 32, 8, 4096, 128),
          (1, 32, 8, 8192, 128), (16, 32, 1, 4096, 128)]


def graph_us(fn, iters: int) -> float | None:
    """bench_kernels.graph_ms of fn() in microseconds, the best of three captures (the first call of
    a run was up to 8% slower than the same call later, measured); None where it cannot be captured."""
    got = [graph_ms(lambda _timer: fn(), iters) for _ in range(3)]
    return None if None in got else min(got) * 1e3


def step_rows(iters: int) -> list[dict]:
    """The layer's decode step (one graph, every step) beside a plain PyTorch step (GEMV, SDPA, GEMV)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tpattn.decode import apply_rope
    from tpattn.layer import TensorParallelAttention
    from tpattn.weights import head_weights
    B, H, d, L = 1, 32, 128, 4096
    D = H * d
    rows = []
    for rope in (None, 10000.0):
        w = head_weights(range(H), H, d, 0, torch.float16, "cuda")
        layer = TensorParallelAttention(**w, heads=H, head_dim=d, backend="fused", causal=True, group=None,
                                        rope_theta=rope)
        cache = layer.new_cache(B, L + iters)
        cache.k.normal_()
        cache.v.normal_()
        x = torch.randn(B, 1, D, device="cuda", dtype=torch.float16)
        start = L - iters // 2
        cache.length = start
        cache.pos.fill_(start)
        step = layer.graphed(x, cache)
        times = []
        for _ in range(3):
            cache.length = start
            cache.pos.fill_(start)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(iters):
                step()
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) / iters * 1e3)
        row = {"B": B, "H": H, "d": d, "D": D, "L": L, "rope": rope, "tpattn_us": sorted(times)[1]}
        wqkv, bqkv, wo, bo = (t.detach() for t in (layer.wqkv, layer.bqkv, layer.wo, layer.bo))
        kc, vc = cache.k, cache.v
        at = torch.tensor([L - 1], device="cuda")
        if rope:
            cos, sin = (t[L - 1:L].to(torch.float16) for t in (cache.cos, cache.sin))
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            def plain(be=be):
                qkv = torch.addmm(bqkv, x.view(B, D), wqkv).view(B, 3 * H, 1, d)
                q, k, v = qkv.split([H, H, H], dim=1)
                if rope:  # rotate-half, in the storage dtype as a plain model does
                    q, k = (apply_rope(t, cos, sin) for t in (q, k))
                kc.index_copy_(2, at, k)
                vc.index_copy_(2, at, v)
                with sdpa_kernel([be]):
                    o = torch.nn.functional.scaled_dot_product_attention(q, kc[:, :, :L], vc[:, :, :L])
                return torch.addmm(bo, o.reshape(B, D), wo)
            row[f"plain_{name}_us"] = graph_us(plain, iters)
        rows.append(row)
        print(f"decode step B={B} L={L} D={D} rope={rope}: tpattn {row['tpattn_us']:.1f} us, plain PyTorch "
              f"cuDNN {row['plain_cudnn_us'] or float('nan'):.1f} us, flash {row['plain_flash_us'] or float('nan'):.1f} us",
              flush=True)
    return rows


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
        tk = torch.zeros(B * G, dtype=torch.int32, device="cuda")  # the kernel's counters, made outside the graphs
        row["tpattn_us"] = graph_us(lambda: decode_attention(q, k, v, L, tickets=tk), a.iters)
        import tpattn.decode as dec  # each split everywhere, for comparison
        for kern in ("cores", "mma"):
            dec.SPLIT_KERNEL = kern
            row[f"tpattn_{kern}_us"] = graph_us(lambda: decode_attention(q, k, v, L, tickets=tk), a.iters)
        dec.SPLIT_KERNEL = "auto"
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
        print(f"B={B} H={H} G={G} L={L}: tpattn {row['tpattn_us']:.1f} us ({row['tpattn_TBps']:.2f} TB/s; "
              f"CUDA-core split {row['tpattn_cores_us']:.1f} us, tensor-core split {row['tpattn_mma_us']:.1f} us), "
              f"cuDNN {row['cudnn_us'] or float('nan'):.1f} us, flash {row['flash_us'] or float('nan'):.1f} us, "
              f"err {row['max_err']:.2e}", flush=True)
    steps = step_rows(a.iters)
    res = {"gpu": torch.cuda.get_device_name(), "versions": versions(), "copy_GBps": bw,
           "command": shlex.join(["python", *sys.argv]), "commit": a.commit,
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "rows": rows, "steps": steps}
    Path(a.out + ".json").write_text(json.dumps(res, indent=2))
    f = (lambda x, s="{:.1f}": "-" if x is None else s.format(x))  # noqa: E731
    md = ["# Decode attention: tpattn's split-K kernel beside SDPA", "",
          f"{res['date']}, {res['gpu']}, commit {a.commit}, torch {res['versions'].get('torch')}; command "
          f"`{res['command']}`. CUDA-graph replays, fp16, one query row per sequence. Copy bandwidth "
          f"{bw:.0f} GB/s (bytes read + written by a device-to-device copy: the memory traffic it sustains).", "",
          "| B | H | G | L | d | tpattn µs | TB/s | of copy | CUDA-core split µs | tensor-core split µs | cuDNN µs | TB/s "
          "| flash µs | max err |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['B']} | {r['H']} | {r['G']} | {r['L']} | {r['d']} | {f(r['tpattn_us'])} | "
                  f"{f(r['tpattn_TBps'], '{:.2f}')} | {f(r['tpattn_of_copy_bw'] * 100, '{:.0f}')}% | {f(r['tpattn_cores_us'])} | "
                  f"{f(r['tpattn_mma_us'])} | {f(r['cudnn_us'])} | "
                  f"{f(r['cudnn_TBps'], '{:.2f}')} | {f(r['flash_us'])} | {r['max_err']:.1e} |")
    md += ["", "The decode step (one GPU, B = 1, L = 4096, D = 4096, H = 32, d = 128, fp16, CUDA graphs): the "
           "layer's step beside a plain PyTorch step (GEMV, SDPA, GEMV) with the same weights and cache.", "",
           "| rotary | tpattn µs | plain + cuDNN µs | plain + flash µs |", "|---|---|---|---|"]
    for r in steps:
        md.append(f"| {'theta ' + format(r['rope'], 'g') if r['rope'] else 'off'} | {f(r['tpattn_us'])} | "
                  f"{f(r['plain_cudnn_us'])} | {f(r['plain_flash_us'])} |")
    Path(a.out + ".md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
