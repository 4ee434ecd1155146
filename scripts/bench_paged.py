"""The decode attention kernel on a paged cache against the contiguous cache, and against the GPU's
copy rate.

    python scripts/bench_paged.py [--pages 16 64 256] [--rounds 5] [--layer] [--prefill] [--no-kernel]
                                   [--prefill-backends fused triton] [--prefill-chunk T] [--profile-prefill K]
                                   [--host-profile K] [--fp8 [--fp8-other-build]] [--other-16bit-build] [--graph]
                                   [--both-builds | --staged-pages]
                                   [--json PATH]

For each shape (B sequences, G K/V heads, H = 32 query heads, d = 128, fp16): the split kernel
over a contiguous cache of length L (kernels/decode_attention.cu), the paged kernel (_pg) over
the same lengths in pages of P tokens handed out in a shuffled order, and the paged kernel over
ragged lengths of the same mean L spread x4 (0.4 L to 1.6 L). GB/s: the K and V bytes a step reads
over its time; copy rate: a device-to-device copy of 1 GiB (bytes read + written over its time).
CUDA events over 50 back-to-back launches, the median of --rounds rounds, contenders alternating
(host work included: below B = 64 a launch's host work can exceed its kernel); --graph also times
each kernel alone, one call captured in a CUDA graph and replayed back to back (its GPU time, the
host out of the way; the best of three captures).
--layer: the layer's whole graphed decode step, contiguous against paged and against the plain
PyTorch step (GEMM, the row copied into the cache, SDPA cuDNN or flash, GEMM; graphed) given the same
weights and cache, with rotary positions (--rope-theta; 0: none); --prefill: prefills through
the layer on the paged cache against its forward over the same rows without a cache, with each of
--prefill-backends (fused: the fused kernel per sequence over its gathered K/V; triton: every
sequence in one launch, K/V read through the block table), and with the fused backend the chunks each a
CUDA graph replay too (tpattn.paged.ChunkGraphs); --prefill-chunk: the long prompt's chunk size; --profile-prefill: one call of each under torch.profiler; --host-profile: each one's host time
to issue a call beside its wall time, and cProfile's functions with the most host time. --fp8: also
an FP8 pool (PagedKV(kv_dtype="fp8"): e4m3 pages and a scale a row, the split's _pg8) beside the fp16
pages of each page size, and with --layer its graphed step; its GB/s count the bytes it reads (d + 4
a row where fp16 reads 2d); --fp8-other-build adds each FP8 row of whole-tile pages again through
each build of the tensor-core split that tpattn does not run there ("... fp8 _pg8": any page size;
"_pgt8": whole-tile pages, tpattn's; "_pgt8s": the keys as the products' rows; tpattn.decode's
DEC_F8_TILE_PAGES and DEC_F8_KT); --other-16bit-build adds each 16-bit row of whole-tile pages again
through the tensor-core split's other build there ("... _pgs": the keys as the products' rows,
tpattn.decode.DEC_KT16, off by default). On compute capability 9.0 the staged build of equal-work chunks (_pgb, off
by default: tpattn.decode.DEC_STAGED_PAGED) can run a pool of whole-tile pages whose (sequence, K/V
head) pairs fit on the SMs: --both-builds adds each paged row again with it ("... staged");
--staged-pages runs it throughout, the layer's steps too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tpattn import decode  # noqa: E402
from tpattn.decode import decode_attention, paged_decode_attention  # noqa: E402

SHAPES = [(1, 8, 32768), (16, 8, 4096), (64, 8, 4096), (1, 32, 4096), (16, 32, 4096)]


def decode_shape(fields: str, example: str):
    """An argparse type for the decode scripts' --shapes: comma-separated positive integers named by
    `fields` ("B,G,L", H = 32 query heads; or "B,H,G,L"), G dividing H; else argparse's one-line error."""
    names = fields.split(",")

    def parse(text: str) -> tuple[int, ...]:
        try:
            vals = tuple(int(v) for v in text.split(","))
        except ValueError:
            vals = ()
        if len(vals) != len(names):
            raise argparse.ArgumentTypeError(f"{text!r}: a shape is {fields} ({len(names)} integers), e.g. {example}")
        f = dict(zip(names, vals))
        heads = f.get("H", 32)
        if min(vals) < 1 or heads % f["G"]:
            raise argparse.ArgumentTypeError(f"{text!r}: every field at least 1, and G a divisor of H = {heads}")
        return vals
    return parse


def timed(fn, reps=50) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps * 1e3  # us


def graph_us(fn, reps: int = 50) -> float | None:
    """fn()'s GPU time alone, us: one call captured in a CUDA graph, replayed `reps` times back to back
    between two events, the best of three captures (scripts/bench_kernels.py's graph_ms)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_kernels import graph_ms
    got = [graph_ms(lambda _timer: fn(), reps) for _ in range(3)]
    return None if None in got else min(got) * 1e3


def copy_rate() -> float:
    x = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    y = torch.empty_like(x)
    us = min(timed(lambda: y.copy_(x), 20) for _ in range(3))
    return 2 * x.numel() * 2 / (us * 1e-6) / 1e9


def paged(lens, g, d, page, gen):
    pages = [-(-n // page) for n in lens]
    total = sum(pages)
    pk, pv = (torch.randn(total, g, page, d, device="cuda", generator=gen).half() for _ in range(2))
    order = torch.randperm(total, device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32, device="cuda")
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[at:at + n]
        at += n
    return pk, pv, table, torch.tensor(lens, dtype=torch.int32, device="cuda")


def fp8_pages(pk, pv):
    """An FP8 pool's pages and row scales of the fp16 pages pk, pv (tpattn.attention.fp8.quantize_rows)."""
    from tpattn.attention import fp8
    (k8, ks), (v8, vs) = fp8.quantize_rows(pk), fp8.quantize_rows(pv)
    return k8.to(torch.float8_e4m3fn), v8.to(torch.float8_e4m3fn), (ks.squeeze(-1), vs.squeeze(-1))


def rope_layer(H: int, G: int, d: int, gen: torch.Generator, backend: str = "fused", theta: float | None = 10000.0):
    """The benchmarks' layer: causal, fp16, rotary positions (theta; None: none), the fused backend (or
    `backend`), weights drawn from gen."""
    from tpattn import TensorParallelAttention
    D = H * d
    w = {k: (torch.randn(*s, device="cuda", generator=gen) * 0.02).half() for k, s in
         (("wq", (D, D)), ("wk", (D, G * d)), ("wv", (D, G * d)), ("wo", (D, D)))}
    return TensorParallelAttention(**w, heads=H, kv_heads=G, head_dim=d, causal=True, backend=backend,
                                   rope_theta=theta)


LAYER_SHAPES = [(1, 32, 4096), (1, 8, 32768), (16, 8, 4096), (64, 8, 4096)]


def plain_step(layer, cache, x: torch.Tensor, L: int, backend: str):
    """The same decode step as PyTorch users write it, given the layer's weights and its contiguous
    cache: the QKV GEMM, rotary positions in torch ops where the layer has them, the row copied into the
    cache at position L, SDPA (`backend`: cudnn or flash; GQA: enable_gqa) over the first L + 1
    positions, the output GEMM; captured in a CUDA graph at L (a plain step's shapes follow the
    length; bench_kernels.captured): returns the graph's replay."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tpattn.decode import apply_rope
    B, D = x.shape[0], x.shape[-1]
    H, G, d = layer.heads, cache.k.shape[1], cache.k.shape[-1]
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    w, bias, wo, bo = (None if t is None else t.detach() for t in (layer.wqkv, layer.bqkv, layer.wo, layer.bo))
    rot = None if cache.cos is None else tuple(t[L:L + 1] for t in (cache.cos, cache.sin))

    def step():
        x2 = x.view(B, D)
        qkv = (torch.mm(x2, w) if bias is None else torch.addmm(bias, x2, w)).view(B, H + 2 * G, 1, d)
        q, k, v = qkv.split([H, G, G], dim=1)
        if rot is not None:
            q, k = (apply_rope(t, *rot) for t in (q, k))
        cache.k[:, :, L:L + 1].copy_(k)
        cache.v[:, :, L:L + 1].copy_(v)
        with sdpa_kernel([be]):
            o = torch.nn.functional.scaled_dot_product_attention(q, cache.k[:, :, :L + 1], cache.v[:, :, :L + 1],
                                                                 enable_gqa=G != H)
        o = o.reshape(B, D)
        return torch.mm(o, wo) if bo is None else torch.addmm(bo, o, wo)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_kernels import captured
    graph = captured(lambda _timer: step())
    if graph is None:
        raise RuntimeError(f"SDPA {backend} could not be captured in a CUDA graph here")
    return graph.replay


def layer_steps(H: int, d: int, rounds: int, steps: int = 40, fp8: bool = False, theta: float | None = 10000.0,
                plain: bool = True) -> list[dict]:
    """The layer's whole decode step (QKV GEMM, rotary positions, the cache write, attention, the
    output GEMM), CUDA-graphed, on the contiguous cache (layer.graphed(x_row, cache)) and on the
    paged cache (tpattn.paged.DecodeGraphs), uniform and ragged lengths, and (plain) the plain PyTorch
    step given the same weights and cache (plain_step: SDPA cuDNN, SDPA flash): wall-clock us per step
    over `steps` steps (host work of each step included: the pool's bookkeeping, the tables' copies,
    each graph's launch). Every graphed step takes its row in place and returns its graph's own
    output (DecodeGraphs.input and step(copy=False), as layer.graphed). fp8: also the paged step on
    an FP8 pool (uniform lengths)."""
    import time

    from tpattn.paged import DecodeGraphs, PagedKV
    out = []
    for B, G, L in LAYER_SHAPES:
        if H % G:
            continue
        D = H * d
        gen = torch.Generator(device="cuda").manual_seed(B)
        layer = rope_layer(H, G, d, gen, theta=theta)
        x = torch.randn(B, 1, D, device="cuda", generator=gen).half()
        cache = layer.new_cache(B, L + (rounds + 1) * steps + 8)
        cache.length = L
        cache.pos.fill_(L)
        contiguous = layer.graphed(x, cache)
        runs = {"contiguous": contiguous}
        for be in ("cudnn", "flash") if plain else ():
            try:
                runs[f"plain {be}"] = plain_step(layer, cache, x, L, be)
            except RuntimeError as e:  # (an SDPA backend that does not take the shape: the row says so)
                print(f"  B={B} G={G} L={L}: plain {be}: not run ({str(e).splitlines()[0][:120]})", flush=True)
        ragged = torch.linspace(0.4 * L, 1.6 * L, B).round().int().tolist() if B > 1 else [L]
        for name, lens in (("paged", [L] * B), ("paged ragged", ragged)) + ((("paged fp8", [L] * B),) if fp8 else ()):
            if name == "paged ragged" and B == 1:
                continue
            pool = PagedKV(layer, pages=sum(-(-(n + (rounds + 1) * steps + 8) // 16) for n in lens) + 8, page_size=16,
                           max_seqs=B, kv_dtype="fp8" if name.endswith("fp8") else None)
            ids = [pool.add() for _ in lens]
            with pool.step(ids, lens):  # the prompts' pages taken (their K/V left zero: the bytes read are the same)
                pass
            graphs = DecodeGraphs(pool, lambda xs, st: layer(xs, cache=st.view(0)), x,
                                  max_len=max(lens) + (rounds + 1) * steps + 8, buckets=(B,))
            xin = graphs.input(B)  # the row written in place, the output not copied: layer.graphed's contract
            xin.copy_(x)
            runs[name] = (lambda g=graphs, ids=ids, xin=xin: g.step(ids, xin, copy=False))
        times, issue = {k: [] for k in runs}, {k: [] for k in runs}
        for _ in range(rounds + 1):
            for name, fn in runs.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(steps):
                    fn()
                t1 = time.perf_counter()  # the steps issued (the host's work; the GPU may still be busy)
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - t0) / steps * 1e6)
                issue[name].append((t1 - t0) / steps * 1e6)
        for name, ts in times.items():
            us = statistics.median(ts[1:])  # the first round warms up (captures)
            out.append({"B": B, "G": G, "L": L, "step": name, "us": us, "host_us": statistics.median(issue[name][1:])})
    return out


def prefill_cases(H: int, d: int, backend: str = "fused", G: int = 8, mean: int = 1024, prompts: int = 8,
                  long: int = 8192, chunk: int = 1024) -> tuple[dict, list[int]]:
    """Prefills through the layer on a paged cache (the fused kernel per sequence, K/V gathered
    through the table) against the layer's own forward over the same rows without a cache (one
    fused forward a prompt): `prompts` prompts of ragged lengths (mean `mean`, spread x4) packed in
    one step, and one prompt of `long` rows prefilled in chunks of `chunk` rows, fp16, rotary
    positions. Returns ({name: call}, the prompts' lengths)."""
    from tpattn.paged import PagedKV
    D = H * d
    gen = torch.Generator(device="cuda").manual_seed(7)
    layer = rope_layer(H, G, d, gen, backend)
    lens = torch.linspace(0.4 * mean, 1.6 * mean, prompts).round().int().tolist()
    xs = [torch.randn(1, n, D, device="cuda", generator=gen).half() for n in lens]
    packed = torch.cat(xs, 1)
    x_long = torch.randn(1, long, D, device="cuda", generator=gen).half()
    pool = PagedKV(layer, pages=-(-max(sum(lens), long) // 16) + prompts + 8, page_size=16, max_seqs=prompts)

    def ragged_paged():
        ids = [pool.add() for _ in lens]
        with pool.step(ids, lens) as st:
            layer(packed, cache=st.view(0))
        for i in ids:
            pool.remove(i)

    def chunked_paged():
        sid = pool.add()
        for c0 in range(0, long, chunk):
            with pool.step([sid], [min(chunk, long - c0)]) as st:
                layer(x_long[:, c0:c0 + chunk], cache=st.view(0))
        pool.remove(sid)

    runs = {f"{prompts} ragged prompts: a forward each": lambda: [layer(x) for x in xs],
            f"{prompts} ragged prompts: paged, one step": ragged_paged,
            f"{long} rows: one forward": lambda: layer(x_long),
            f"{long} rows: paged, chunks of {chunk}": chunked_paged}
    from tpattn.paged import ChunkGraphs, chunk_graph_refusal
    if chunk > 1 and chunk_graph_refusal(layer, pool) is None:  # every full chunk one graph replay
        graphs = ChunkGraphs(pool, lambda x, st: layer(x, cache=st.view(0)), x_long[:, :chunk], max_len=long)

        def chunked_graphed():
            sid = pool.add()
            for c0 in range(0, long, chunk):
                if c0 + chunk <= long:
                    graphs.step(sid, x_long[:, c0:c0 + chunk])
                else:  # the last, shorter chunk: eagerly
                    with pool.step([sid], [long - c0]) as st:
                        layer(x_long[:, c0:], cache=st.view(0))
            pool.remove(sid)
        runs[f"{long} rows: paged, chunks of {chunk}, graphed"] = chunked_graphed
    return runs, lens


def prefill_runs(H: int, d: int, rounds: int, backend: str = "fused", chunk: int = 1024) -> list[dict]:
    """prefill_cases' calls, wall-clock ms per call, synchronized (host work included: the pool's
    add, step and remove), median of `rounds` rounds after one, the calls alternating."""
    import time
    runs, lens = prefill_cases(H, d, backend, chunk=chunk)
    times = {k: [] for k in runs}
    with torch.no_grad():
        for _ in range(rounds + 1):
            for name, fn in runs.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - t0) * 1e3)
    return [{"run": k, "backend": backend, "ms": statistics.median(ts[1:]), "lens": lens if "ragged" in k else None}
            for k, ts in times.items()]


def profile_prefills(H: int, d: int, top: int, backend: str = "fused", chunk: int = 1024) -> None:
    """One call of each prefill case (after a warm one) under torch.profiler: its wall time, the host's
    time in torch ops and the GPU's in kernels and copies, and the `top` ops by host time."""
    import time

    from torch.profiler import ProfilerActivity, profile
    runs, _ = prefill_cases(H, d, backend, chunk=chunk)
    with torch.no_grad():
        for name, fn in runs.items():
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) * 1e3
            ev = prof.key_averages()
            gpu = sum(e.self_device_time_total for e in ev) / 1e3
            print(f"{backend}, {name}: wall {wall:.3f} ms, GPU (kernels and copies) {gpu:.3f} ms")
            print(ev.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=48))


def host_profile_prefills(H: int, d: int, top: int, backend: str = "fused", chunk: int = 1024, calls: int = 10) -> None:
    """Each prefill case's host time to issue a call (the calls queued, not waited for) beside its wall
    time, mean of `calls` calls after 3; then the same calls under cProfile: the `top` Python functions
    by their own host time (torch ops appear as built-in methods)."""
    import cProfile
    import io
    import pstats
    import time
    runs, _ = prefill_cases(H, d, backend, chunk=chunk)
    with torch.no_grad():
        for name, fn in runs.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            print(f"{backend}, {name}: host issues a call in {(t1 - t0) / calls * 1e3:.3f} ms, wall "
                  f"{(t2 - t0) / calls * 1e3:.3f} ms")
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
            print(out.getvalue().split("\n\n", 1)[-1].rstrip())


def switched(switches: dict, fn):
    """fn() with tpattn.decode's switches set: DEC_STAGED_PAGED (the staged paged build _pgb where it
    applies), DEC_F8_TILE_PAGES and DEC_F8_KT (an FP8 pool's tensor-core split over whole-tile pages:
    _pgt8, or _pgt8s with both on; _pg8 with neither), DEC_KT16 (16-bit whole-tile pages through _pgs)."""
    was = {k: getattr(decode, k) for k in switches}
    for k, v in switches.items():
        setattr(decode, k, v)
    try:
        return fn()
    finally:
        for k, v in was.items():
            setattr(decode, k, v)


FP8_BUILDS = {"_pg8": {"DEC_F8_TILE_PAGES": False, "DEC_F8_KT": False},
              "_pgt8": {"DEC_F8_TILE_PAGES": True, "DEC_F8_KT": False},
              "_pgt8s": {"DEC_F8_TILE_PAGES": True, "DEC_F8_KT": True}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/bench_paged.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, nargs="+", default=[16, 64, 256], metavar="P")
    p.add_argument("--shapes", type=decode_shape("B,G,L", "16,8,4096"), nargs="+", default=SHAPES, metavar="B,G,L",
                   help="the decode kernel's shapes (--heads query heads; G is checked against the default 32; default: "
                        + " ".join(",".join(map(str, s)) for s in SHAPES) + ")")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    builds = p.add_mutually_exclusive_group()
    builds.add_argument("--both-builds", action="store_true", help="each paged row of the kernel table again with "
                        "the staged build of equal-work chunks (_pgb)")
    builds.add_argument("--staged-pages", action="store_true", help="the staged paged build throughout, the layer's "
                        "steps too (DEC_STAGED_PAGED on)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--layer", action="store_true", help="also the layer's whole graphed decode step, contiguous "
                   "against paged (uniform and ragged lengths)")
    p.add_argument("--prefill", action="store_true", help="also prefills on the paged cache (ragged prompts in one "
                   "step, a long prompt in chunks) against the layer's forward over the same rows")
    p.add_argument("--rope-theta", type=float, default=10000.0, metavar="THETA",
                   help="--layer's rotary positions (the layer's and, in torch ops, the plain step's; 0: none, as "
                   "the plain PyTorch layer has none; default 10000)")
    p.add_argument("--no-kernel", action="store_true", help="skip the decode kernel's table")
    p.add_argument("--graph", action="store_true", help="also each kernel's GPU time alone: one call captured in a "
                   "CUDA graph, replayed back to back")
    p.add_argument("--prefill-backends", nargs="+", choices=("fused", "triton"), default=["fused"],
                   help="the layer's backends for --prefill (triton: the paged prefill in one launch; default fused)")
    p.add_argument("--prefill-chunk", type=int, default=1024, metavar="T",
                   help="--prefill's long prompt (8192 rows) goes in chunks of T rows (default 1024)")
    p.add_argument("--host-profile", type=int, metavar="K", help="also each prefill's host time to issue a call "
                   "beside its wall time, and the K Python functions with the most host time (cProfile)")
    p.add_argument("--fp8", action="store_true", help="also an FP8 pool (e4m3 pages, a scale a row) beside each "
                   "page size's fp16 pages, and with --layer its graphed step")
    p.add_argument("--fp8-other-build", action="store_true", help="with --fp8: each FP8 row of whole-tile pages "
                   "(16, 32, 64, ... tokens) again through each build of the tensor-core split tpattn does not run "
                   "there (_pg8, _pgt8, _pgt8s)")
    p.add_argument("--other-16bit-build", action="store_true", help="each 16-bit row of whole-tile pages again "
                   "through the tensor-core split's other build there: _pgs (the keys as the products' rows, "
                   "tpattn.decode.DEC_KT16) where tpattn runs _pg, _pg where it runs _pgs")
    p.add_argument("--profile-prefill", type=int, metavar="K", help="also one call of each prefill under "
                   "torch.profiler: wall, host and GPU time, and the K ops with the most host time")
    a = p.parse_args(argv)
    if a.fp8_other_build and not a.fp8:
        p.error("--fp8-other-build times the FP8 pool's second build: add --fp8")
    if a.prefill_chunk < 1:
        p.error(f"--prefill-chunk takes a positive row count (got {a.prefill_chunk})")
    if not torch.cuda.is_available():
        print("bench_paged: error: needs a CUDA GPU; run it on a GPU machine", file=sys.stderr)
        return 2
    H, d = a.heads, a.head_dim
    if a.staged_pages:
        decode.DEC_STAGED_PAGED = True
    rate = copy_rate()
    print(f"{torch.cuda.get_device_name()}: H={H} d={d} fp16; copy rate {rate:.0f} GB/s; us per step (median of "
          f"{a.rounds} rounds), GB/s of K and V read, % of the copy rate")
    rows = []
    for B, G, L in [] if a.no_kernel else a.shapes:
        gen = torch.Generator(device="cuda").manual_seed(B + G + L)
        q = torch.randn(B, H, 1, d, device="cuda", generator=gen).half()
        k, v = (torch.randn(B, G, L, d, device="cuda", generator=gen).half() for _ in range(2))
        ragged = torch.linspace(0.4 * L, 1.6 * L, B).round().int().tolist() if B > 1 else [L]
        row16 = 2 * d  # bytes of a K or V row: fp16, and an FP8 pool's e4m3 row with its fp32 scale
        cont = {"contiguous": (lambda: decode_attention(q, k, v, L), B * L, row16)}
        for P in a.pages:
            pk, pv, table, lens = paged([L] * B, G, d, P, gen)
            cont[f"paged {P}"] = ((lambda pk=pk, pv=pv, t=table, n=lens: paged_decode_attention(q[:, :, 0], pk, pv, t, n, L)),
                                  B * L, row16)
            if a.fp8:
                k8, v8, sc = fp8_pages(pk, pv)
                cont[f"paged {P} fp8"] = ((lambda k8=k8, v8=v8, sc=sc, t=table, n=lens:
                                           paged_decode_attention(q[:, :, 0], k8, v8, t, n, L, scales=sc)), B * L, d + 4)
            if B > 1:
                rk, rv, rt, rn = paged(ragged, G, d, P, gen)
                cont[f"paged {P} ragged"] = ((lambda pk=rk, pv=rv, t=rt, n=rn: paged_decode_attention(q[:, :, 0], pk, pv, t, n,
                                                                                               max(ragged))), sum(ragged),
                                             row16)
        if a.both_builds:  # each paged row again with the staged build
            for name in [n for n in cont if n.startswith("paged") and "fp8" not in n]:
                fn, tokens, nbytes = cont[name]
                cont[f"{name} staged"] = (lambda fn=fn: switched({"DEC_STAGED_PAGED": True}, fn), tokens, nbytes)
        if a.other_16bit_build:  # each 16-bit row of whole-tile pages again through _pgs (or _pg)
            other = "_pg" if decode.DEC_KT16 else "_pgs"
            for name in [n for n in cont if n.startswith("paged") and "fp8" not in n and "staged" not in n
                         and decode.tile_pages(int(n.split()[1]))]:
                fn, tokens, nbytes = cont[name]
                cont[f"{name} {other}"] = (lambda fn=fn: switched({"DEC_KT16": not decode.DEC_KT16}, fn), tokens, nbytes)
        if a.fp8_other_build:  # each FP8 row of whole-tile pages again through the builds tpattn does not run
            now = {k: getattr(decode, k) for k in FP8_BUILDS["_pg8"]}
            for name in [n for n in cont if n.endswith("fp8") and decode.tile_pages(int(n.split()[1]))]:
                fn, tokens, nbytes = cont[name]
                for build, switches in FP8_BUILDS.items():
                    if switches != now:
                        cont[f"{name} {build}"] = (lambda fn=fn, sw=switches: switched(sw, fn), tokens, nbytes)
        times = {k: [] for k in cont}
        for _ in range(a.rounds):
            for name, (fn, _, _) in cont.items():
                times[name].append(timed(fn))
        base = statistics.median(times["contiguous"])
        alone = {name: graph_us(fn, 50) for name, (fn, _, _) in cont.items()} if a.graph else {}
        print(f"B={B} G={G} L={L}" + (f" (ragged: {min(ragged)}-{max(ragged)}, mean {sum(ragged) / B:.0f})" if B > 1 else ""))
        for name, (fn, tokens, nbytes) in cont.items():
            us = statistics.median(times[name])
            gbs = 2 * tokens * G * nbytes / (us * 1e-6) / 1e9
            row = {"B": B, "G": G, "L": L, "layout": name, "us": us, "GBps": gbs, "of_copy": gbs / rate,
                   "vs_contiguous_per_token": (us / tokens) / (base / (B * L))}
            line = (f"  {name:<22} {us:8.1f} us  {gbs:6.0f} GB/s  {100 * gbs / rate:5.1f} %  per token x"
                    f"{row['vs_contiguous_per_token']:.3f} of contiguous")
            if alone.get(name) is not None:  # the kernel alone (graph replays)
                g_us = alone[name]
                g_gbs = 2 * tokens * G * nbytes / (g_us * 1e-6) / 1e9
                row.update(graph_us=g_us, graph_GBps=g_gbs, graph_of_copy=g_gbs / rate,
                           graph_vs_contiguous_per_token=(g_us / tokens) / (alone["contiguous"] / (B * L)))
                line += (f" | graphed {g_us:7.1f} us  {100 * g_gbs / rate:5.1f} %  per token "
                         f"x{row['graph_vs_contiguous_per_token']:.3f}")
            rows.append(row)
            print(line)
    steps = []
    if a.layer:
        theta = a.rope_theta or None
        steps = layer_steps(H, d, a.rounds, fp8=a.fp8, theta=theta)
        print(f"the layer's decode step (rotary positions: {'theta ' + format(theta, 'g') if theta else 'none'}), "
              "CUDA-graphed, wall-clock us per step (median of rounds; host work included), [the host's time to "
              "issue a step], (x the layer's contiguous step); the plain PyTorch step with the same weights and cache:")
        for shape in LAYER_SHAPES:
            mine = {r["step"]: r for r in steps if (r["B"], r["G"], r["L"]) == shape}
            if not mine:
                continue
            base = mine["contiguous"]["us"]
            print(f"  B={shape[0]} G={shape[1]} L={shape[2]}: " + ", ".join(
                f"{name} {r['us']:.1f}" + ("" if name == "contiguous" else f" (x{r['us'] / base:.3f})")
                + f" [{r['host_us']:.1f}]" for name, r in mine.items()))
            if "plain cudnn" in mine:
                worst = max(r["us"] for name, r in mine.items() if not name.startswith("plain"))
                print(f"    against the plain step with cuDNN: contiguous x{base / mine['plain cudnn']['us']:.3f}, "
                      f"the slowest of the layer's steps x{worst / mine['plain cudnn']['us']:.3f}")
    prefills = []
    if a.prefill:
        for backend in a.prefill_backends:
            mine = prefill_runs(H, d, a.rounds, backend, a.prefill_chunk)
            prefills += mine
            print(f"prefills through the layer ({backend} backend, G=8, rotary), wall-clock ms per call, synchronized "
                  "(median of rounds):")
            base = None
            for r in mine:  # each case's layer forward first, then its paged runs against it
                if "paged" not in r["run"]:
                    base = r
                    print(f"  {r['run']:<48} {r['ms']:8.3f} ms")
                else:
                    print(f"  {r['run']:<48} {r['ms']:8.3f} ms  x{r['ms'] / base['ms']:.3f}")
    if a.profile_prefill:
        for backend in a.prefill_backends:
            profile_prefills(H, d, a.profile_prefill, backend, a.prefill_chunk)
    if a.host_profile:
        for backend in a.prefill_backends:
            host_profile_prefills(H, d, a.host_profile, backend, a.prefill_chunk)
    if a.json:
        Path(a.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_GBps": rate, "rows": rows,
                                            "layer_steps": steps, "prefills": prefills, "argv": sys.argv}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
