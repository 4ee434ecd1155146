#!/usr/bin/env python3
"""Attention backward benchmark: the kernel ladder (naive, tiled, fused, fused_mma, triton; the torch reference
beside them) through tpattn.attention.attention(...).backward(do), beside torch SDPA's flash, cuDNN
and memory-efficient backends, forward and backward, in one run on one GPU.

Per shape and kernel (all times in milliseconds, median over --iters after --warmup, CUDA events; with
--rounds R every row is timed R times, the kernels taking turns in each round so that a power cap's
clock drop lands on each of them, and the median of the R rounds is reported):
  fwd ms        o = attention(q, k, v) with q, k, v requiring grad (what training runs: it saves
                what the backward needs)
  bwd ms        o.backward(do) alone: the start event is recorded after the forward call, so the
                forward's kernels finish before it; q/k/v.grad are set to None between iterations,
                outside every timed interval
  fwd+bwd ms    one interval around both
  TFLOP/s       forward FLOPs F = 4 B H N^2 d (halved when causal); backward 2.5 F; fwd+bwd 3.5 F
  bwd / flash, bwd / cudnn
                the row's bwd ms over SDPA flash's and cuDNN's in the same run and shape
  graph ms      fused and SDPA only: forward, and forward+backward, captured in a CUDA graph and
                replayed back to back (GPU time without host time); graph bwd = the difference
  peak MiB      device memory the first forward+backward allocates at its peak beyond what was
                allocated before it (q, k, v, do): saved tensors, workspaces and the gradients
  grad err      max over dq, dk, dv of ||g - ref|| / ||ref|| on the first K/V group of batch 0, ref
                in float32 by torch autograd; above 1e-2 (fp16) or 5e-2 (bf16) the row is CHECK
                FAILED and its numbers are not shown in the table

  first call s  triton only: its first forward+backward, synchronized, timed apart before all of the
                above (compile, or load from Triton's disk cache ~/.triton/cache, and autotune of
                its three kernels; later calls in the process reuse both)

fused is the backward this GPU runs by default (wgmma on compute capability 9.0); fused_red the same
calls with TPATTN_FUSED_BWD5=red (the five-product kernel whose threads add dQ with red.global.add, not
the warp-specialized one); fused_det with deterministic=True (seven products); fused_mma with
TPATTN_FUSED_BWD=mma (the portable mma.sync backward, kernels/fused_attention_backward.cu).
A kernel without a backward is a "no backward" row; an SDPA backend that refuses the shape is a
skipped row with torch's reason; triton is a skipped row where the triton package is missing.
naive, tiled and reference write N x N scores (S, P, dP, dS: tens of GB at N = 16384, H = 32), so
they run only at N <= --max-materialized-n (default 4096).
GQA (--kv-heads G < H): the tpattn kernels read the G K/V heads in place; SDPA gets k and v repeated
to H heads by repeat_interleave inside the timed forward (its backward sums them back), the same for
every SDPA backend (--sdpa-gqa native: enable_gqa=True instead).

Defaults: B=1, H=32, G=H, d=128, N in 4096 16384, fp16, causal and not, --warmup 3 --iters 10.
Writes PREFIX.json and PREFIX.md (--out, default benchmarks/backward_h200): GPU, driver, versions,
command, date (UTC), git commit and a table per shape.

    PYTHONPATH=. python scripts/bench_backward.py [--seq-lens 4096 16384] [--heads 32] [--kv-heads 8]
        [--causal | --non-causal | --both-causal] [--kernels fused triton sdpa_flash sdpa_cudnn] [--rounds 3]
        [--out PREFIX]
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import env_set, git_commit, graph_ms, peak_bytes, sdpa_backends, sh, timed  # noqa: E402
from tpattn.attention import attention  # noqa: E402
from tpattn.errors import ConfigError  # noqa: E402
from tpattn.report import versions  # noqa: E402
from tpattn.timing import section  # noqa: E402

RUNGS = ("naive", "tiled", "fused", "fused_red", "fused_det", "fused_mma", "triton", "reference")
RUNG_ENV = {"fused_mma": {"TPATTN_FUSED_BWD": "mma"}, "fused_red": {"TPATTN_FUSED_BWD5": "red"}}  # environment a rung runs under (forward and backward)
FIRST_CALL = ("triton",)  # rungs whose first call compiles and autotunes: timed apart
MATERIALIZED = ("naive", "tiled", "reference")  # write N x N scores and their gradients
SDPA = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient")  # the names bench_kernels.sdpa_backends() gives
TOL = {"fp16": 1e-2, "bf16": 5e-2}  # grad err beyond which a row is CHECK FAILED
PARTS = ("fwd", "bwd", "fwd+bwd")  # the timed intervals of a row
BWD_FLOPS = 2.5  # backward FLOPs per forward FLOP (the usual count: dV, dP, dQ, dK matmuls + recomputed S)


def gpu_info() -> dict:
    p = torch.cuda.get_device_properties(0)
    driver = sh(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"])
    if driver is None:
        try:
            import cupy
            v = cupy.cuda.runtime.driverGetVersion()
            driver = f"CUDA driver API {v // 1000}.{v % 1000 // 10} (nvidia-smi not found)"
        except Exception:  # noqa: BLE001 - informational only
            driver = "unknown"
    cap = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return {"name": torch.cuda.get_device_name(0), "capability": cap,
            "sms": p.multi_processor_count, "memory_GiB": round(p.total_memory / 2**30, 1), "driver": driver}


def reference_grads(q, k, v, do, causal: bool):
    """float32 dq [group, N, d], dk, dv [N, d] of batch 0's first K/V group, one query head at a time."""
    group = q.shape[1] // k.shape[1]
    n, d = q.shape[-2:]
    kf = k[0, 0].detach().float().requires_grad_(True)
    vf = v[0, 0].detach().float().requires_grad_(True)
    dqs = []
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1) if causal else None
    for i in range(group):
        qf = q[0, i].detach().float().requires_grad_(True)
        s = qf @ kf.T / math.sqrt(d)
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        (torch.softmax(s, dim=-1) @ vf).backward(do[0, i].float())
        dqs.append(qf.grad)
        del s
    return torch.stack(dqs), kf.grad, vf.grad


def grad_error(q, k, v, ref) -> float:
    group = q.shape[1] // k.shape[1]
    got = (q.grad[0, :group], k.grad[0, 0], v.grad[0, 0])
    return max(((g.float() - r).norm() / r.norm().clamp_min(1e-30)).item() for g, r in zip(got, ref))


def sdpa_forward(backend, q, k, v, causal: bool, gqa: str):
    from torch.nn.attention import sdpa_kernel
    rep = q.shape[1] // k.shape[1]
    extra = {}
    if rep > 1 and gqa == "repeat":
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    elif rep > 1:
        extra["enable_gqa"] = True
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **extra)


def refusal(exc: BaseException, caught: list) -> str:
    """One line: the exception, and torch's warnings that say why a backend refused."""
    why = [str(w.message).splitlines()[0] for w in caught if "kernel" in str(w.message).lower()
           or "requires" in str(w.message).lower() or "support" in str(w.message).lower()]
    msg = (str(exc).splitlines() or [type(exc).__name__])[0]
    return "; ".join([msg[:160], *[w[:160] for w in why[:3]]])


def first_call(fwd, q, k, v, do) -> float:
    """Seconds of one synchronized forward+backward: for triton the first one in the process compiles
    (or loads from the disk cache) and autotunes; run before peak_bytes, whose number it would skew."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fwd().backward(do)
    torch.cuda.synchronize()
    q.grad = k.grad = v.grad = None
    return time.perf_counter() - t0


def with_times(row: dict, ms: dict, flops: float) -> dict:
    """The row's fwd / bwd / fwd+bwd milliseconds and the TFLOP/s they give."""
    row.update(fwd_ms=ms["fwd"], bwd_ms=ms["bwd"], fwdbwd_ms=ms["fwd+bwd"],
               fwd_tflops=flops / (ms["fwd"] * 1e-3) / 1e12,
               bwd_tflops=BWD_FLOPS * flops / (ms["bwd"] * 1e-3) / 1e12,
               fwdbwd_tflops=(1 + BWD_FLOPS) * flops / (ms["fwd+bwd"] * 1e-3) / 1e12)
    return row


def measure(name, fwd, q, k, v, do, args, flops: float, ref) -> tuple[dict, object]:
    """One kernel's row (peak memory, timed fwd / bwd / fwd+bwd, grad check, graph times) and a callable
    that times fwd / bwd / fwd+bwd again, for the later rounds."""
    def clear():
        q.grad = k.grad = v.grad = None

    def step(timer=None):  # timer: unused, the sections time on the recording one (none in a graph)
        clear()
        with section("fwd+bwd"):
            with section("fwd"):
                o = fwd()
            with section("bwd"):
                o.backward(do)

    clear()
    first = first_call(fwd, q, k, v, do) if name in FIRST_CALL else None
    mem = peak_bytes(step)
    t = timed(step, args.warmup, args.iters)
    err = grad_error(q, k, v, ref)
    gf = gfb = None
    if not args.no_graph and not name.startswith(MATERIALIZED):
        gf = graph_ms(lambda _t: fwd(), args.iters)
        gfb = graph_ms(step, args.iters)
    clear()
    ok = err <= TOL[args.dtype]
    row = {"status": "ok" if ok else "CHECK FAILED",
           "reason": "" if ok else f"grad err {err:.2e} > {TOL[args.dtype]}",
           "rounds_ms": {p: [t[p]] for p in PARTS},
           "passes_ms": {p: x for p, x in t.items() if p not in (*PARTS, "total")},
           "graph_fwd_ms": gf, "graph_fwdbwd_ms": gfb, "graph_bwd_ms": gfb - gf if gf and gfb else None,
           "peak_bytes": mem, "grad_err": err, "first_call_s": first}

    def again() -> dict:
        t = timed(step, args.warmup, args.iters)
        clear()
        return t
    return with_times(row, {p: t[p] for p in PARTS}, flops), again


def later_rounds(rows: list, timers: dict, args, flops: float) -> None:
    """Rounds 2..R: every ok row's kernel timed again, the kernels taking turns in each round (so that a
    power cap's clock drop lands on each of them); a row's times become the median of its rounds'."""
    ok = [r for r in rows if r["status"] == "ok" and r["kernel"] in timers]
    for _ in range(args.rounds - 1):
        for r in ok:
            with warnings.catch_warnings(), env_set(RUNG_ENV.get(r["kernel"], {})):
                warnings.simplefilter("ignore")
                t = timers[r["kernel"]]()
            for p in PARTS:
                r["rounds_ms"][p].append(t[p])
    for r in ok:
        with_times(r, {p: statistics.median(r["rounds_ms"][p]) for p in PARTS}, flops)


def run(args) -> dict:
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    el = torch.empty((), dtype=dtype).element_size()
    b, h, d = args.batch, args.heads, args.head_dim
    sdpa = sdpa_backends()
    wanted = args.kernels or [*RUNGS, *SDPA]
    causals = {"causal": [True], "non-causal": [False], "both": [False, True]}[args.causal_mode]
    rows, broken = [], None
    for g in args.kv_heads:
        for n in args.seq_lens:
            for causal in causals:
                shape = {"batch": b, "heads": h, "kv_heads": g, "seq_len": n, "head_dim": d, "dtype": args.dtype,
                         "causal": causal}
                print(f"B={b} H={h} G={g} N={n} d={d} {args.dtype} {'causal' if causal else 'non-causal'}", flush=True)
                gen = torch.Generator(device="cuda").manual_seed(0)
                q = torch.randn(b, h, n, d, device="cuda", generator=gen, dtype=dtype).requires_grad_(True)
                k, v = (torch.randn(b, g, n, d, device="cuda", generator=gen, dtype=dtype).requires_grad_(True)
                        for _ in range(2))
                do = torch.randn(b, h, n, d, device="cuda", generator=gen, dtype=dtype)
                ref = reference_grads(q, k, v, do, causal)
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                kernels = {}
                for rung in RUNGS:
                    det = args.deterministic or rung == "fused_det"
                    kernels[rung] = lambda rung=rung.split("_")[0], det=det: attention(q, k, v, causal, backend=rung,
                                                                                       deterministic=det)
                for name, backend in sdpa.items():
                    kernels[name] = lambda backend=backend: sdpa_forward(backend, q, k, v, causal, args.sdpa_gqa)
                shape_rows, timers = [], {}
                for name, fwd in kernels.items():
                    if name not in wanted:
                        continue
                    row = {"kernel": name, **shape}
                    if name in MATERIALIZED and n > args.max_materialized_n:
                        gb = 4 * b * h * n * n * el / 1e9
                        row.update(status="skipped", reason=f"writes N x N scores (S, P, dP, dS ~ {gb:.0f} GB); "
                                                            f"N > --max-materialized-n {args.max_materialized_n}")
                    else:
                        try:
                            with warnings.catch_warnings(record=True) as caught, env_set(RUNG_ENV.get(name, {})):
                                warnings.simplefilter("always")
                                got, timers[name] = measure(name, fwd, q, k, v, do, args, flops, ref)
                                row.update(got)
                        except ConfigError as exc:
                            line = str(exc).splitlines()[0]
                            row.update(status="no backward" if "no backward" in line else "skipped", reason=line)
                        except Exception as exc:  # noqa: BLE001 - a refused shape, out of memory: the row says so
                            row.update(status="skipped", reason=refusal(exc, caught))
                        q.grad = k.grad = v.grad = None
                        try:
                            torch.cuda.synchronize()
                            torch.cuda.empty_cache()
                        except Exception as exc:  # noqa: BLE001 - a sticky CUDA error: nothing after it counts
                            broken = f"stopped after {name}: the CUDA context is broken ({refusal(exc, [])})"
                    shape_rows.append(row)
                    print("  " + row_line(row), flush=True)
                    if broken:
                        break
                if not broken and args.rounds > 1:
                    try:
                        later_rounds(shape_rows, timers, args, flops)
                    except Exception as exc:  # noqa: BLE001 - the first round's rows stand; the table says why
                        broken = f"stopped in a later round: {refusal(exc, [])}"
                    for r in shape_rows:
                        if r["status"] == "ok":
                            print(f"  {r['kernel']:<16} bwd ms over {args.rounds} rounds: "
                                  f"{', '.join(f'{x:.3f}' for x in r['rounds_ms']['bwd'])}", flush=True)
                timers.clear()
                base = {s: r["bwd_ms"] for r in shape_rows for s in ("sdpa_flash", "sdpa_cudnn")
                        if r["kernel"] == s and r["status"] == "ok"}
                for r in shape_rows:
                    for s in ("sdpa_flash", "sdpa_cudnn"):
                        ok = r["status"] == "ok" and s in base
                        r[f"bwd_x_{s.split('_')[1]}"] = r["bwd_ms"] / base[s] if ok else None
                rows += shape_rows
                del q, k, v, do, ref
                if broken:
                    print(f"bench_backward: {broken}", file=sys.stderr, flush=True)
                    return results(args, rows, broken)
                torch.cuda.empty_cache()
    return results(args, rows, None)


def results(args, rows: list, broken: str | None) -> dict:
    try:
        import cupy  # noqa: F401 - so that versions() names it
    except ImportError:
        pass
    return {"gpu": gpu_info(), "versions": versions(), "command": "python " + shlex.join(sys.argv),
            "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": git_commit(args.commit),
            "sdpa_gqa": args.sdpa_gqa, "max_materialized_n": args.max_materialized_n, "iters": args.iters,
            "rounds": args.rounds,
            "warmup": args.warmup, "deterministic": args.deterministic, "stopped": broken, "rows": rows}


def row_line(r: dict) -> str:
    if "fwd_ms" not in r:
        return f"{r['kernel']:<16} {r['status']}: {r['reason']}"
    g = f"  graph fwd {r['graph_fwd_ms']:.3f} fwd+bwd {r['graph_fwdbwd_ms']:.3f}" if r.get("graph_fwdbwd_ms") else ""
    fc = f"  first call {r['first_call_s']:.2f} s" if r.get("first_call_s") is not None else ""
    return (f"{r['kernel']:<16} fwd {r['fwd_ms']:8.3f} bwd {r['bwd_ms']:8.3f} fwd+bwd {r['fwdbwd_ms']:8.3f} ms  "
            f"bwd {r['bwd_tflops']:6.1f} TFLOP/s  {r['peak_bytes'] / 2**20:9.1f} MiB  grad err {r['grad_err']:.1e}"
            f"{g}{fc}{'  ' + r['status'] if r['status'] != 'ok' else ''}")


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(res: dict) -> str:
    v, gpu = res["versions"], res["gpu"]
    lines = [f"# Attention forward and backward on {gpu['name']}", "",
             f"- GPU: {gpu['name']} (compute capability {gpu['capability']}, {gpu['sms']} SMs, "
             f"{gpu['memory_GiB']} GiB), driver {gpu['driver']}",
             f"- Versions: torch {v.get('torch')}, CUDA {v.get('cuda')}, cupy {v.get('cupy', 'not loaded')}, "
             f"python {v.get('python')}, tpattn {v.get('tpattn')}",
             f"- Command: `{res['command']}`",
             f"- Date: {res['date_utc']}; commit: {res['commit']}",
             f"- Median over {res['iters']} iterations after {res['warmup']} warm-up ones, CUDA events"
             + (f", then the median of {res['rounds']} such rounds, the kernels taking turns in each "
                "(`bwd rounds ms`)" if res.get("rounds", 1) > 1 else "") + "; "
             f"deterministic={res['deterministic']} (tpattn kernels only)", "",
             *([f"**Incomplete: {res['stopped']}.**", ""] if res.get("stopped") else []),
             "`fwd`: attention(q, k, v) with inputs requiring grad. `bwd`: o.backward(do) alone, started after the "
             "forward's kernels; gradients set to None between iterations, untimed. `fwd+bwd`: one interval around "
             "both. TFLOP/s: forward F = 4·B·H·N²·d (halved when causal), backward 2.5·F, fwd+bwd 3.5·F. "
             "`bwd / flash`, `bwd / cudnn`: the row's bwd ms over SDPA flash's and cuDNN's in this run. "
             "`graph`: forward and forward+backward captured in a CUDA graph and replayed (GPU time without the "
             "host's); graph bwd = their difference. `peak MiB`: device memory the forward+backward allocates "
             "beyond q, k, v and do (gradients included). "
             "`grad err`: max over dq, dk, dv of ‖g − ref‖/‖ref‖ on "
             "batch 0's first K/V group against float32 torch autograd; a CHECK FAILED row shows no times. "
             "`first call s` (triton): its first forward+backward in the process, compile or disk-cache load and "
             "autotune included, timed apart before the rest.", ""]
    if any(r["kv_heads"] != r["heads"] for r in res["rows"]):
        how = ("k and v repeated to H heads with repeat_interleave inside the timed forward (its backward sums "
               "the gradients back), for every SDPA backend alike" if res["sdpa_gqa"] == "repeat"
               else "F.scaled_dot_product_attention(..., enable_gqa=True)")
        lines += [f"GQA: the tpattn kernels read the G K/V heads in place; SDPA: {how}.", ""]
    lines += [f"naive, tiled and reference write N×N scores: run only at N ≤ {res['max_materialized_n']} "
              "(--max-materialized-n).", ""]
    shapes = []
    for r in res["rows"]:
        key = (r["batch"], r["heads"], r["kv_heads"], r["seq_len"], r["head_dim"], r["dtype"], r["causal"])
        if key not in shapes:
            shapes.append(key)
    for key in shapes:
        b, h, g, n, d, dt, causal = key
        lines += [f"## B={b}, H={h}, G={g}, N={n}, d={d}, {dt}, {'causal' if causal else 'non-causal'}", "",
                  "| kernel | fwd ms | bwd ms | fwd+bwd ms | fwd TFLOP/s | bwd TFLOP/s | fwd+bwd TFLOP/s | bwd / flash "
                  "| bwd / cudnn | graph fwd / bwd ms | peak MiB | grad err | first call s | bwd rounds ms | status |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["rows"]:
            if (r["batch"], r["heads"], r["kv_heads"], r["seq_len"], r["head_dim"], r["dtype"], r["causal"]) != key:
                continue
            status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
            if r["status"] != "ok":
                err = fmt(r.get("grad_err"), ".1e")
                lines.append(f"| {r['kernel']} | - | - | - | - | - | - | - | - | - | - | {err} | - | - | {status} |")
                continue
            graph = f"{fmt(r['graph_fwd_ms'], '.3f')} / {fmt(r['graph_bwd_ms'], '.3f')}"
            lines.append(f"| {r['kernel']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} "
                         f"| {r['fwd_tflops']:.1f} | {r['bwd_tflops']:.1f} | {r['fwdbwd_tflops']:.1f} "
                         f"| {fmt(r['bwd_x_flash'], '.2f')} | {fmt(r['bwd_x_cudnn'], '.2f')} | {graph} "
                         f"| {r['peak_bytes'] / 2**20:.1f} | {r['grad_err']:.1e} | {fmt(r.get('first_call_s'), '.2f')} "
                         f"| {', '.join(f'{x:.3f}' for x in r.get('rounds_ms', {}).get('bwd', []))} | ok |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384], help="N values (default 4096 16384)")
    p.add_argument("--heads", type=int, default=32, help="query heads H (default 32)")
    p.add_argument("--kv-heads", type=int, nargs="+", default=None,
                   help="K/V heads G, each dividing H; G < H is GQA (default: H)")
    p.add_argument("--head-dim", type=int, default=128, help="d (default 128)")
    p.add_argument("--batch", type=int, default=1, help="B (default 1)")
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"], help="default fp16")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--causal", dest="causal_mode", action="store_const", const="causal", help="causal only")
    mode.add_argument("--non-causal", dest="causal_mode", action="store_const", const="non-causal",
                      help="non-causal only")
    mode.add_argument("--both-causal", dest="causal_mode", action="store_const", const="both",
                      help="non-causal and causal (the default)")
    p.set_defaults(causal_mode="both")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default 3)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations, the median reported (default 10)")
    p.add_argument("--rounds", type=int, default=1,
                   help="times every row R times, the kernels taking turns in each round, and reports the median "
                        "of the rounds (default 1)")
    p.add_argument("--kernels", nargs="+", default=None, choices=[*RUNGS, *SDPA], metavar="KERNEL",
                   help=f"rows to run (default all): {' '.join([*RUNGS, *SDPA])}")
    p.add_argument("--max-materialized-n", type=int, default=4096,
                   help="largest N at which naive, tiled and reference run (default 4096: they write N x N "
                        "scores, ~69 GB at N=16384, H=32, fp16)")
    p.add_argument("--sdpa-gqa", choices=["repeat", "native"], default="repeat",
                   help="SDPA with G < H: repeat_interleave k and v (default) or enable_gqa=True")
    p.add_argument("--deterministic", action="store_true", help="deterministic=True for the tpattn kernels")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph times")
    p.add_argument("--commit", default=None,
                   help="the commit to record, for a tree copied to another machine whose .git differs "
                        "(default: git rev-parse --short HEAD here, '+ uncommitted changes' when dirty)")
    p.add_argument("--out", default="benchmarks/backward_h200",
                   help="prefix of the .json and .md written (default benchmarks/backward_h200)")
    args = p.parse_args()
    # autograd's device thread says this once when it first calls cuBLAS; it sets the context itself
    warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA context")
    if args.rounds < 1 or args.iters < 1 or args.warmup < 0:
        print("bench_backward: --rounds and --iters must be at least 1, --warmup at least 0", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_backward: needs a CUDA GPU; nothing to measure on this machine", file=sys.stderr)
        return 2
    args.kv_heads = args.kv_heads or [args.heads]
    for g in args.kv_heads:
        if g < 1 or args.heads % g:
            print(f"bench_backward: --kv-heads {g} must divide --heads {args.heads}", file=sys.stderr)
            return 2
    res = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(res, indent=2))
    md = markdown(res)
    Path(f"{out}.md").write_text(md)
    print(md)
    print(f"wrote {out}.json and {out}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
