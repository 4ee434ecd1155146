#!/usr/bin/env python3
"""A decode step through the layer three ways, on one GPU: eager, under torch.compile (the decode
kernels as the custom ops tpattn::decode_append and tpattn::decode_attention, the cache passed as
an argument) and captured with layer.graphed(). fp16, H = 32, d = 128, D = 4096, fused backend;
for each (B, G): a prefill of 4096 rows, then 200 timed steps (10 warm-up) from the same length,
wall time over the steps / 200 (µs). The compiled step's first call (its compile) is timed apart.

    PYTHONPATH=. python scripts/bench_compiled_decode.py [--shapes 1,8 16,8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tpattn.layer import TensorParallelAttention  # noqa: E402

H, d, L, STEPS = 32, 128, 4096, 200


class Decoder(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.attn = layer

    def forward(self, x, cache):
        return self.attn(x, cache=cache)


def per_step_us(fn, steps: int = STEPS) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1e6


def run(B: int, G: int) -> dict:
    D = H * d
    torch.manual_seed(0)
    w = [torch.randn(D, n, device="cuda", dtype=torch.float16) / D ** 0.5 for n in (D, G * d, G * d)]
    wo = torch.randn(D, D, device="cuda", dtype=torch.float16) / D ** 0.5
    layer = TensorParallelAttention(*w, wo, heads=H, head_dim=d, kv_heads=G, backend="fused", causal=True, group=None)
    cache = layer.new_cache(B, L + 4 * STEPS)
    x = torch.randn(B, 1, D, device="cuda", dtype=torch.float16)
    out = {}
    with torch.no_grad():
        layer(torch.randn(B, L, D, device="cuda", dtype=torch.float16), cache)

        def reset():
            cache.length = L
            cache.pos.fill_(L)
        compiled = torch.compile(Decoder(layer))
        reset()
        t = time.perf_counter()
        compiled(x, cache)
        torch.cuda.synchronize()
        out["compile_s"] = time.perf_counter() - t
        for name, fn in (("eager", lambda: layer(x, cache=cache)), ("compiled", lambda: compiled(x, cache))):
            reset()
            out[name] = per_step_us(fn)
        reset()
        step = layer.graphed(x, cache)
        reset()
        out["graphed"] = per_step_us(step)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["1,8", "16,8"], help="B,G pairs (default: 1,8 16,8)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_compiled_decode.py needs a CUDA GPU (none is visible to torch); run it on a GPU machine",
              file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; H={H} d={d} L={L} fp16, µs a step")
    for shape in args.shapes:
        B, G = (int(v) for v in shape.split(","))
        r = run(B, G)
        print(f"B={B:<3} G={G:<3} eager {r['eager']:7.1f}   compiled {r['compiled']:7.1f}   graphed {r['graphed']:7.1f}"
              f"   (first compiled call {r['compile_s']:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
