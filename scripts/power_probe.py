#!/usr/bin/env python3
"""The fused kernel and SDPA cuDNN at one shape (default B=1 H=32 N=4096 d=128, fp16), each timed
after 3 s of idle (the boost clock) and then sustained (the power cap's clock), twice, as CUDA-graph
replays. Run it with the clocks sampled beside it:

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \\
        --format=csv,noheader -lms 100 > smi.csv &
    PYTHONPATH=. python scripts/power_probe.py [--shape B H N D] [--replays R]; kill %1

Each line: the wall-clock time (to the millisecond, to match the clock samples), the kernel, and ms per
replay of 100 replays after 3 s idle, of R replays right after (3000 by default: about 1.5 s at the
default shape), and of 100 more right after those.
"""
import argparse
import sys
import time
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import captured, replays_ms  # noqa: E402
from tpattn.attention import get_backend  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--shape", nargs=4, type=int, default=[1, 32, 4096, 128], metavar=("B", "H", "N", "D"),
                help="batch, heads, sequence length, head dim (default: 1 32 4096 128)")
ap.add_argument("--replays", type=int, default=3000, help="sustained replays of each kernel (default 3000)")
args = ap.parse_args()
if min(args.shape) < 1 or args.replays < 1:
    ap.error("--shape takes four positive numbers and --replays a positive count")
if not torch.cuda.is_available():
    print("power_probe: needs a CUDA GPU (and CuPy); nothing to measure here", file=sys.stderr)
    raise SystemExit(2)
fused = get_backend("fused")
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(*args.shape, device="cuda", generator=g, dtype=torch.float16) for _ in range(3))
R = args.replays


def now() -> str:
    return datetime.now().strftime("%H:%M:%S.%f")[:-3]


def cudnn(_t):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v)


graphs = {"fused": captured(lambda _t: fused.forward(q, k, v, False)), "cudnn": captured(cudnn)}
for rnd in range(2):
    for name, gr in graphs.items():
        time.sleep(3)
        print(f"{now()} {name} after 3 s idle: {replays_ms(gr, 100):.4f} ms (100 replays)", flush=True)
        t0 = now()
        sustained = replays_ms(gr, R)
        print(f"{now()} {name} {R} replays from {t0}: {sustained:.4f} ms a replay", flush=True)
        print(f"{now()} {name} right after: {replays_ms(gr, 100):.4f} ms (100 replays)", flush=True)
