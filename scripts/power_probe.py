#!/usr/bin/env python3
"""The fused kernel and SDPA cuDNN at the default shape (B=1 H=32 N=4096 d=128, fp16), each timed
after 3 s of idle (the boost clock) and then sustained (the power cap's clock), twice, as CUDA-graph
replays. Run it with the clocks sampled beside it:

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \\
        --format=csv,noheader -lms 100 > smi.csv &
    PYTHONPATH=. python scripts/power_probe.py; kill %1

Each line: the wall-clock time, the kernel, and ms per replay of 100 replays after 3 s idle, of
3000 replays right after (about 1.5 s), and of 100 more right after those.
"""
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import captured, replays_ms  # noqa: E402
from tpattn.attention import get_backend  # noqa: E402

if not torch.cuda.is_available():
    print("power_probe: needs a CUDA GPU (and CuPy); nothing to measure here", file=sys.stderr)
    raise SystemExit(2)
fused = get_backend("fused")
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(1, 32, 4096, 128, device="cuda", generator=g, dtype=torch.float16) for _ in range(3))


def cudnn(_t):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v)


graphs = {"fused": captured(lambda _t: fused.forward(q, k, v, False)), "cudnn": captured(cudnn)}
for rnd in range(2):
    for name, gr in graphs.items():
        time.sleep(3)
        print(f"{time.strftime('%H:%M:%S')} {name} after 3 s idle: {replays_ms(gr, 100):.4f} ms (100 replays)", flush=True)
        t0 = time.time()
        sustained = replays_ms(gr, 3000)
        print(f"{time.strftime('%H:%M:%S')} {name} 3000 replays from {time.strftime('%H:%M:%S', time.localtime(t0))}: "
              f"{sustained:.4f} ms a replay", flush=True)
        print(f"{time.strftime('%H:%M:%S')} {name} right after: {replays_ms(gr, 100):.4f} ms (100 replays)", flush=True)
