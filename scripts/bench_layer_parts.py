#!/usr/bin/env python3
"""The pieces of the layer, each timed alone on one GPU (CUDA events, median of --iters): the QKV
GEMM with and without its bias, the relayout to heads-first, the output GEMM with an fp16 and an
fp32 result, the output's relayout, the bias and cast, the fused kernel whole and in row chunks.
For the default shape at 1 and 2 ranks' worth of heads (h = 32, 16).

    PYTHONPATH=. python scripts/bench_layer_parts.py [--seq-len 4096 --heads 32 --head-dim 128]
"""

from __future__ import annotations

import argparse
import sys

import torch

from tpattn.attention import get_backend
from tpattn.model.measure import events_ms


def timed(fn, iters: int) -> float:
    return events_ms(fn, 3, iters)  # the planner's calibration times its passes the same way


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=4096, help="rows N (default 4096)")
    ap.add_argument("--heads", type=int, default=32, help="query heads H (default 32)")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim d (default 128)")
    ap.add_argument("--iters", type=int, default=30, help="timed calls, the median printed (default 30)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_layer_parts.py: needs a CUDA GPU (none is visible to torch); run it on a GPU machine",
              file=sys.stderr)
        return 2
    N, H, d = a.seq_len, a.heads, a.head_dim
    D = H * d
    f16 = dict(device="cuda", dtype=torch.float16)
    x = torch.randn(N, D, **f16)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, N={N} H={H} d={d}; ms, median of {a.iters}")
    for h in (H, H // 2):
        hd = h * d
        w = torch.randn(D, 3 * hd, **f16) / 64
        b = torch.randn(3 * hd, **f16)
        wo = torch.randn(hd, D, **f16) / 64
        o = torch.randn(1, h, N, d, **f16)
        qkv = torch.mm(x, w)
        rows = torch.randn(N, hd, **f16)
        part = torch.randn(N, D, device="cuda")
        bo = torch.randn(D, device="cuda")
        y = torch.empty(N, D, **f16)
        q, k, v = (torch.randn(1, h, N, d, **f16) for _ in range(3))
        fused = get_backend("fused")
        out = torch.empty_like(q)
        res = {
            "qkv mm": lambda: torch.mm(x, w),
            "qkv addmm (bias)": lambda: torch.addmm(b, x, w),
            "qkv mm + bias add": lambda: torch.mm(x, w).add_(b),
            "relayout [N,3,h,d]->[3,h,N,d]": lambda: qkv.view(N, 3, h, d).permute(1, 2, 0, 3).contiguous(),
            "qkv bmm per head (x broadcast)": lambda: torch.bmm(x.expand(3 * h, N, D),
                                                                w.view(D, 3 * h, d).transpose(0, 1)),
            "out mm fp16 result": lambda: torch.mm(rows, wo),
            "out mm fp32 result (out_dtype)": lambda: torch.mm(rows, wo, out_dtype=torch.float32),
            "out mm fp32 (fp32 inputs)": lambda: torch.mm(rows.float(), wo.float()),
            "o relayout [h,N,d]->[N,h*d]": lambda: o.transpose(1, 2).reshape(N, hd),
            "bias + cast (one add)": lambda: torch.add(part, bo, out=y),
            "fused, all rows": lambda: fused.forward(q, k, v, False, out=out),
            "fused, 2 row chunks": lambda: [fused.forward(q, k, v, False, out=out, rows=r)
                                            for r in ((0, N // 2), (N // 2, N))],
            "fused, 4 row chunks": lambda: [fused.forward(q, k, v, False, out=out, rows=(i * N // 4, (i + 1) * N // 4))
                                            for i in range(4)],
        }
        try:
            torch.addmm(bo, rows, wo, out_dtype=torch.float32)
            res["out addmm fp32 result (out_dtype, bias)"] = lambda: torch.addmm(bo, rows, wo, out_dtype=torch.float32)
        except (TypeError, RuntimeError) as exc:
            print(f"  (addmm with out_dtype: {str(exc).splitlines()[0][:100]})")
        print(f"h = {h} heads ({'1 rank' if h == H else '2 ranks'}):")
        for name, fn in res.items():
            print(f"  {name:<42}{timed(fn, a.iters):8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
