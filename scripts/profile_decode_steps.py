"""Where a graphed decode step's time goes, contiguous against paged: torch.profiler over ten steps of
the layer's graphed step on the contiguous cache (layer.graphed) and of DecodeGraphs on a paged pool
(pages of 16; ragged lengths 0.4 L to 1.6 L where said), no rotary positions, H = 32, d = 128, fp16:
each GPU kernel's time a step, then the host's (self CPU time a step) for the most costly entries.
B = 1 with 32 K/V heads at L = 4096, and B = 16 with 8 K/V heads, ragged, mean L = 4096.

    PYTHONPATH=. python scripts/profile_decode_steps.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import bench_paged as bp  # noqa: E402
from tpattn.paged import DecodeGraphs, PagedKV  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("profile_decode_steps.py profiles the layer's decode steps on a GPU: run it where torch sees one")
H, d = 32, 128
for B, G, L, ragged in ((1, 32, 4096, False), (16, 8, 4096, True)):
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
    for name, fn in (("contiguous", contiguous), ("paged", lambda: graphs.step(ids, x))):
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
