#!/usr/bin/env python3
"""The layer's training step on one GPU beside the plain PyTorch layer, in one run: forward +
backward of tpattn's TensorParallelAttention (one rank: the whole layer) and of a plain layer
(QKV Linear, torch SDPA with the flash or cuDNN backend, output Linear) with the same weights,
input and upstream gradient.

Per layer: fwd+bwd ms (CUDA events around y = layer(x); y.backward(dy), gradients set to None
outside the timed interval; median over --iters after --warmup), and the forward alone under
torch.no_grad() (the inference path). Writes PREFIX.json and PREFIX.md (--out, default
benchmarks/train_h200): GPU, versions, command, date (UTC), commit.

    PYTHONPATH=. python scripts/bench_train.py [--seq-len 4096] [--heads 32] [--head-dim 128]
        [--kernel fused] [--causal] [--commit SHA] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tpattn.layer import TensorParallelAttention  # noqa: E402
from tpattn.report import versions  # noqa: E402
from tpattn.weights import head_weights, layer_input  # noqa: E402


class Plain(torch.nn.Module):
    """QKV Linear, SDPA, output Linear: the layer as PyTorch users write it."""

    def __init__(self, w: dict, heads: int, causal: bool, sdpa):
        super().__init__()
        self.h, self.causal, self.sdpa = heads, causal, sdpa
        self.qkv = torch.nn.Parameter(torch.cat([w["wq"], w["wk"], w["wv"]], 1).detach().clone())
        self.bqkv = torch.nn.Parameter(torch.cat([w["bq"], w["bk"], w["bv"]]).detach().clone())
        self.wo = torch.nn.Parameter(w["wo"].detach().clone())
        self.bo = torch.nn.Parameter(w["bo"].detach().clone())

    def forward(self, x):
        B, N, D = x.shape
        q, k, v = (torch.addmm(self.bqkv, x.view(B * N, D), self.qkv).view(B, N, 3, self.h, D // self.h)
                   .permute(2, 0, 3, 1, 4))
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel([self.sdpa]):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return torch.addmm(self.bo, o.transpose(1, 2).reshape(B * N, D), self.wo).view(B, N, D)


def median_ms(fn, warmup: int, iters: int, params) -> float:
    ts = []
    for i in range(warmup + iters):
        for p in params:
            p.grad = None
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= warmup:
            ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--kernel", default="fused")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--commit", default=None, help="the commit to record (default: git rev-parse here)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "train_h200"))
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_train.py needs a CUDA GPU (none is visible to torch); run it on a GPU machine", file=sys.stderr)
        return 2
    from torch.nn.attention import SDPBackend
    dev, dt = torch.device("cuda"), torch.float16
    B, N, H, d = a.batch, a.seq_len, a.heads, a.head_dim
    D = H * d
    w = head_weights(range(H), H, d, 0, dt, dev)
    x = layer_input(B, N, D, 0, dt, dev)
    dy = layer_input(B, N, D, 1, dt, dev)
    xg = x.clone().requires_grad_(True)
    layers = {f"tpattn {a.kernel}": TensorParallelAttention(**w, heads=H, head_dim=d, backend=a.kernel,
                                                            causal=a.causal, group=None)}
    for name, be in (("plain flash", SDPBackend.FLASH_ATTENTION), ("plain cuDNN", SDPBackend.CUDNN_ATTENTION)):
        layers[name] = Plain(w, H, a.causal, be)
    rows = []
    for name, layer in layers.items():
        params = [xg, *layer.parameters()]
        try:
            train = median_ms(lambda: layer(xg).backward(dy), a.warmup, a.iters, params)
            with torch.no_grad():
                fwd = median_ms(lambda: layer(x), a.warmup, a.iters, [])
        except RuntimeError as exc:
            rows.append({"layer": name, "skipped": str(exc).splitlines()[0][:160]})
            continue
        rows.append({"layer": name, "fwd_ms": round(fwd, 4), "fwd_bwd_ms": round(train, 4)})
        print(f"{name:<16} forward {fwd:8.3f} ms   forward + backward {train:8.3f} ms", flush=True)
    commit = a.commit or (subprocess_out(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]) or "unknown")
    res = {"gpu": torch.cuda.get_device_name(), "versions": versions(), "command": shlex.join(["python", *sys.argv]),
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit,
           "shape": {"B": B, "N": N, "H": H, "d": d, "dtype": "fp16", "causal": a.causal}, "rows": rows}
    Path(a.out + ".json").write_text(json.dumps(res, indent=2))
    md = [f"# Training step on one GPU: tpattn beside the plain PyTorch layer", "",
          f"{res['date']}, {res['gpu']}, commit {commit}; torch {res['versions'].get('torch')}. Command: `{res['command']}`.",
          f"B={B} N={N} H={H} d={d} fp16{' causal' if a.causal else ''}; median of {a.iters} after {a.warmup} warm-up.", "",
          "| layer | forward ms (no_grad) | forward + backward ms |", "|---|---|---|"]
    md += [f"| {r['layer']} | {r.get('fwd_ms', '-')} | {r.get('fwd_bwd_ms', r.get('skipped', '-'))} |" for r in rows]
    Path(a.out + ".md").write_text("\n".join(md) + "\n")
    return 0


def subprocess_out(cmd) -> str | None:
    import subprocess
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip() or None
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
