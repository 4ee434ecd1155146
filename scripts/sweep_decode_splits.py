#!/usr/bin/env python3
"""The decode split kernels' time at each chunk count S beside the count tpattn picks
(tpattn.decode.decode_splits): one query row per sequence, H = 32 heads of d = 128, fp16, over a
contiguous cache, a paged one (pages of 16, every sequence the full length) and a ragged paged one
(lengths spread from 0.4 L to 1.6 L, capped at L). Each time is bench_paged.py's graph_us: one call
captured in a CUDA graph, replayed 20 times back to back, the best of three captures (the GPU's time,
not the host's). A line a shape and layout: the kernel, how many of its blocks an SM holds (the
driver's occupancy), the split before the occupancy is known (S0) and the one picked, and the fastest
count measured; then every count. The paged layouts run the builds whose count the host picks
(tpattn.decode.DEC_STAGED_PAGED off: the staged paged build sizes its chunks from the lengths on the
device, so a forced count would not change its work). --fp8: the two paged layouts over an FP8 pool
instead (e4m3 pages, a scale a row), each with the tensor-core split's pipelined build from 3 chunks on
(tpattn.decode.DEC_F8_PIPE, as tpattn runs it) and again without it ("... nopipe": more blocks an SM),
each through _pgt8 and through _pgt8s ("kt": the keys as the products' rows, tpattn.decode.DEC_F8_KT).

    PYTHONPATH=. python scripts/sweep_decode_splits.py [--shapes B,G,L ...] [--fp8]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_paged import fp8_pages, graph_us  # noqa: E402
from tpattn import decode  # noqa: E402
from tpattn.cuda import resident_blocks  # noqa: E402

SHAPES = ["1,8,32768", "4,8,8192", "16,8,4096", "32,8,2048", "64,8,4096", "1,32,4096", "4,32,4096", "8,32,2048",
          "16,32,4096"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=SHAPES, metavar="B,G,L", help="batch, K/V heads, cache length")
    ap.add_argument("--fp8", action="store_true", help="the paged layouts over an FP8 pool, with and without the "
                    "pipelined build (DEC_F8_PIPE)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sweep_decode_splits.py times the decode kernels on a GPU: run it where torch sees one", file=sys.stderr)
        return 2
    dev, H, d, dt, page = torch.device("cuda"), 32, 128, torch.float16, 16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    picks, one_block = decode.decode_splits, decode.one_block_an_sm
    decode.DEC_STAGED_PAGED = False
    forced = {"S": None}  # a count forced on every rule _split_kernel takes its count from
    decode.decode_splits = lambda *a, **k: forced["S"] or picks(*a, **k)
    decode.one_block_an_sm = lambda *a, **k: forced["S"] or one_block(*a, **k)
    print(f"{torch.cuda.get_device_name(dev)}: H={H} d={d} fp16, us per call (graph replays)")
    g = torch.Generator(device=dev).manual_seed(0)
    for shape in args.shapes:
        B, G, L = (int(x) for x in shape.split(","))
        q = torch.randn(B, H, 1, d, device=dev, dtype=dt, generator=g)
        k, v = (torch.randn(B, G, L, d, device=dev, dtype=dt, generator=g) for _ in range(2))
        n = L // page
        pk, pv = (torch.randn(B * n + 8, G, page, d, device=dev, dtype=dt, generator=g) for _ in range(2))
        table = torch.randperm(B * n + 8, device=dev, generator=g)[:B * n].to(torch.int32).view(B, n)
        full = torch.full((B,), L, dtype=torch.int32, device=dev)
        ragged = torch.tensor([int(L * (0.4 + 1.2 * i / max(1, B - 1))) if B > 1 else L for i in range(B)],
                              dtype=torch.int32, device=dev).clamp(1, L)
        layouts = [("contiguous", None, (True, False)), ("paged", full, (True, False)), ("ragged", ragged, (True, False))]
        sc = None
        if args.fp8:
            pk, pv, sc = fp8_pages(pk, pv)
            layouts = [(f"{name} fp8{' kt' if kt else ''}{'' if pipe else ' nopipe'}", lens, (pipe, kt))
                       for name, lens in (("paged", full), ("ragged", ragged)) for kt in (False, True)
                       for pipe in (True, False)]
        for layout, lens, (pipe, kt) in layouts:
            forced["S"] = None
            decode.DEC_F8_PIPE, decode.DEC_F8_KT = pipe, kt
            source, name, chosen, smem = decode._split_kernel(q[:, :, 0], B, H, G, d, L, page=0 if lens is None else page,
                                                              fp8=sc is not None)
            S0 = picks(B * G, L, sms, 2 if name.startswith("dec_mma") else 4)
            counts = sorted({chosen, S0} | {max(1, S0 * f // 4) for f in range(1, 13)} | set(range(max(1, S0 - 2), S0 + 3)))
            times = {}
            for S in (S for S in counts if S <= min(-(-L // 64), decode.DEC_COMBINE_W)):
                forced["S"] = S
                if lens is None:
                    times[S] = graph_us(lambda: decode.decode_attention(q, k, v, L), 20)
                else:
                    times[S] = graph_us(lambda: decode.paged_decode_attention(q[:, :, 0], pk, pv, table, lens, L, scales=sc), 20)
            best = min(times, key=times.get)
            print(f"B={B} G={G} L={L} {layout:20s} {name:29s} {resident_blocks(source, name, dev, decode.DEC_THREADS, shared_mem=smem)} "
                  f"blocks/SM  S0={S0}: {times[S0]:.1f}  picked S={chosen}: {times[chosen]:.1f} "
                  f"(x{times[chosen] / times[S0]:.3f})  fastest S={best}: {times[best]:.1f}", flush=True)
            print("    " + " ".join(f"{S}:{t:.1f}" for S, t in times.items()), flush=True)
    decode.decode_splits = picks
    decode.DEC_F8_PIPE, decode.DEC_F8_KT = True, False
    return 0


if __name__ == "__main__":
    sys.exit(main())
