"""Where a graphed decode step's time goes, contiguous against paged and against the plain PyTorch
step: torch.profiler over ten steps of the layer's graphed step on the contiguous cache
(layer.graphed), of DecodeGraphs on a paged pool (pages of 16; ragged lengths 0.4 L to 1.6 L for a
batch of more than one), and of the plain step with SDPA cuDNN (bench_paged.plain_step: the same
weights and cache), no rotary positions, H = 32, d = 128, fp16: each GPU kernel's time a step, then
the host's (self CPU time a step) for the most costly entries. By default B = 1 with 32 K/V heads at
L = 4096 and B = 16 with 8 K/V heads, mean L = 4096; --shapes B,G,L ... (e.g. the layer rows of
bench_paged.py: 1,32,4096 1,8,32768 16,8,4096 64,8,4096).

    PYTHONPATH=. python scripts/profile_decode_steps.py [--shapes B,G,L ...]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import bench_paged as bp  # noqa: E402
from tpattn.paged import DecodeGraphs, PagedKV  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--shapes", nargs="+", type=bp.decode_shape("B,G,L", "16,8,4096"), default=[(1, 32, 4096), (16, 8, 4096)],
               metavar="B,G,L", help="batch, K/V heads, cache length (ragged lengths of that mean for B > 1)")
args = p.parse_args()
if not torch.cuda.is_available():
    print("profile_decode_steps.py profiles the layer's decode steps on a GPU: none is visible to torch; run it on a GPU machine",
          file=sys.stderr)
    sys.exit(2)
H, d = 32, 128
for B, G, L in args.shapes:
    ragged = B > 1
    gen = torch.Generator(device="cuda").manual_seed(B)
    layer = bp.rope_layer(H, G, d, gen, theta=None)
    x = torch.randn(B, 1, H * d, device="cuda", generator=gen).half()
    cache = layer.new_cache(B, L + 200)
    cache.length = L; cache.pos.fill_(L)
    contiguous = layer.graphed(x, cache)
    lens = torch.linspace(0.4 * L, 1.6 * L, B).round().int().tolist() if ragged else [L] * B
    pool = PagedKV(layer, pages=sum(-(-(n + 200) // 16) for n in lens) + 8, page_size=16, max_seqs=B)
    ids = [pool.add() for _ in lens]
    with pool.step(ids, lens):
        pass
    graphs = DecodeGraphs(pool, lambda xs, st: layer(xs, cache=st.view(0)), x, max_len=max(lens) + 200, buckets=(B,))
    xin = graphs.input(B)  # (in place, the output not copied: as layer.graphed)
    xin.copy_(x)
    runs = [("contiguous", contiguous), ("paged", lambda: graphs.step(ids, xin, copy=False)),
            ("plain cudnn", bp.plain_step(layer, cache, x, L, "cudnn"))]
    for name, fn in runs:
        for _ in range(3): fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(10): fn()
            torch.cuda.synchronize()
        print(f"== B={B} G={G} L={L} ragged={ragged} {name}")
        evs = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                a = evs.setdefault(e.name[:80], [0, 0.0]); a[0] += 1; a[1] += e.device_time
        for k, (n, t) in sorted(evs.items(), key=lambda kv: -kv[1][1])[:12]:
            print(f"   {t / 10:8.1f} us/step  x{n / 10:.1f}  {k}")
        cpu = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)[:8]
        for e in cpu:
            print(f"   cpu {e.self_cpu_time_total / 10:8.1f} us/step x{e.count / 10:.1f} {e.key[:70]}")
        print(flush=True)
