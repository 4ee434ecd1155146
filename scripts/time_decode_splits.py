"""Each decode split launch's GPU time alone (d = 128, fp16, the contiguous cache): the kernel and
chunk count tpattn.decode picks, and the best of three times from bench_paged.graph_us (one call
captured in a CUDA graph, replayed back to back). By default at shapes where the split is one chunk
or a few (large batches, H = 32); --shapes B,H,G,L ... times others (e.g. 1,32,8,32768: on an H100
16 chunks, the staged split at one block an SM, and the combine of 16 partials). tpattn comes from
PYTHONPATH, so that two trees can be timed one after the other on one machine:

    PYTHONPATH=path/to/other/tree python scripts/time_decode_splits.py
    PYTHONPATH=. python scripts/time_decode_splits.py [--shapes 1,32,8,32768 16,32,8,4096]
"""
import argparse
import sys
from pathlib import Path

import torch

from tpattn import decode  # (before bench_paged, which puts this tree's root first on the path)
import tpattn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_paged import decode_shape, graph_us  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--shapes", nargs="+", type=decode_shape("B,H,G,L", "1,32,8,32768"), metavar="B,H,G,L",
               default=[(64, 32, 8, 4096), (48, 32, 8, 4096), (128, 32, 8, 1024), (64, 32, 32, 2048), (256, 32, 8, 512)],
               help="the shapes to time (default: five of one chunk or a few)")
args = p.parse_args()
if not torch.cuda.is_available():
    print("time_decode_splits.py times the decode kernels on a GPU: none is visible to torch; run it on a GPU machine",
          file=sys.stderr)
    sys.exit(2)
print(tpattn.__file__, flush=True)
d = 128
for B, H, G, L in args.shapes:
    q = torch.randn(B, H, 1, d, device="cuda").half()
    k = torch.randn(B, G, L, d, device="cuda").half()
    v = torch.randn_like(k)
    S = decode._split_kernel(q, B, H, G, d, L)
    us = min(graph_us(lambda: decode.decode_attention(q, k, v, L)) for _ in range(3))
    print(f"B={B} H={H} G={G} L={L} {S[1]} S={S[2]}: {us:.1f} us", flush=True)
