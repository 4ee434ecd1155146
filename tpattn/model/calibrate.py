"""`python -m tpattn.plan --calibrate`: measure this machine (peaks, every kernel pass inside the layer
at several sizes, the layer's overhead and host time, and under mpirun the NCCL collectives and the
link's wake-up) and write a machine file (build_machine: pure, testable on CPU). The timing itself is
tpattn/model/measure.py's, shared with scripts/model/validate_model.py."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time

from . import costmodel as cm
from .errors import EXIT_FAIL, ModelError, PlanError
from .machine import Machine, _curves, validate_machine
from .measure import (COLLECTIVE_REPS, COLLECTIVE_SAMPLES, COLLECTIVE_SIZES, COLLECTIVE_WARMUP, MiB, WAKE_BYTES,
                      WAKE_CALLS, bare_collectives, build_layer, call_stall, combine_layer_rounds, events_ms,
                      finish_ranks, gather, link_wake, quiet_host_ms, start_ranks, time_layer)
from .steps import COLLECTIVE_NAMES, COMPUTE_ORDER, STRIDED, Shape, layer_steps

# ---- --calibrate -------------------------------------------------------------------------------------


class Sizes:
    """What --calibrate measures: full, --quick, or the CPU smoke test's toy sizes."""
    heads, head_dim = 32, 128
    gemm, fp32_gemm, copy_elems = (4096, 8192), 4096, 2**28
    grid_n, grid_h = (1024, 2048, 4096, 8192, 16384), (1, 2, 4, 8, 16, 32)
    causal = ((16, 4096), (32, 4096), (32, 8192))
    out_heads, out_rows, epilogue_rows = (4, 8, 16, 32), (1024, 4096, 16384), (512, 2048, 4096, 16384)
    collectives, warmup, iters = tuple(COLLECTIVE_SIZES), 2, 5
    # the W-rank layer (every kernel, 16 heads per rank on 2 GPUs): lengths where the call is host-bound
    # or nearly; more iterations than the grid's (cheap: ~1-3 ms a call), its host time is a model number
    multi_n, multi_warmup, multi_iters = (2048, 4096), 2, 20
    # ... in rounds: every kernel and length once per round, the rounds one after another, the median
    # over the rounds per number but the host time (see quiet_host_ms). The host's speed drifts over
    # seconds on a shared machine (the same call's host time moved 0.52-0.81 ms between runs on the
    # lent H200s, scripts/model/host_probe.py); one stretch of back-to-back calls is a snapshot of it,
    # rounds spread the measurement over the drift
    multi_rounds = 5
    naive_work = 32 * 8192**2   # h x N^2 at most: ~0.7 s a call


class QuickSizes(Sizes):
    gemm, grid_n, grid_h, causal = (4096,), (1024, 4096), (8, 32), ((32, 4096),)
    out_rows, epilogue_rows, warmup, iters = (4096,), (4096,), 1, 3   # the collectives: all sizes, as validation


class CpuSizes(Sizes):
    heads, head_dim = 8, 32
    gemm, fp32_gemm, copy_elems = (256,), 256, 2**20
    grid_n, grid_h, causal = (64, 128), (2, 4), ((4, 128),)
    out_heads, out_rows, epilogue_rows = (2, 4), (128,), (128,)
    collectives, warmup, iters = (MiB // 4, MiB // 2), 1, 2
    multi_n, multi_warmup, multi_iters, multi_rounds = (128,), 1, 2, 2


GRID_N, GRID_H, CAUSAL_GRID = Sizes.grid_n, Sizes.grid_h, Sizes.causal


def calibration_shapes(kernel: str, quick: bool = False, free_bytes: int | None = None,
                       sizes: type[Sizes] | None = None) -> list[tuple[int, int, bool]]:
    """(h, N, causal) at which a kernel is calibrated: a grid over heads per rank and sequence length
    (naive kept to <= 32 heads x 8192^2 of work, the score matrices to half the free memory), and
    a few causal shapes."""
    sz = sizes or (QuickSizes if quick else Sizes)
    out = []
    for causal, shapes in ((False, [(h, n) for h in sz.grid_h for n in sz.grid_n]), (True, sz.causal)):
        for h, n in shapes:
            if kernel == "naive" and h * n * n > sz.naive_work:
                continue
            if free_bytes is not None and STRIDED.get(kernel) is False and 2 * h * n * n * 2 > free_bytes // 2:
                continue
            out.append((h, n, causal))
    return out


def build_machine(meas: dict) -> dict:
    """The machine file from calibration measurements (pure: testable on CPU).

    meas: {"gpu", "gpus_per_node", "free_bytes", "command", "date", "versions",
           "peaks": {"tensor": [(m, k, n, ms)], "fp32": [(m, k, n, ms)], "copy": [(bytes, ms)]},
           "layer": [{"kernel", "h", "N", "d", "heads", "causal", "passes": {name: ms}}],   # W = 1, rank 0
           "out_fp32": [(m, k, n, ms)], "relayout": [(bytes, ms)], "epilogue": [(bytes, ms)],
           "collectives": {kind: [(bytes, ms)]}, "world": W, "layer_multi": [{"kernel", "h", "N", "passes"}]}"""
    peaks = meas["peaks"]
    tensor = max(2.0 * m * k * n / (ms * 1e9) for m, k, n, ms in peaks["tensor"])
    fp32 = max(2.0 * m * k * n / (ms * 1e9) for m, k, n, ms in peaks["fp32"])
    bw = max(b / (ms * 1e6) for b, ms in peaks["copy"])
    how = f"measured by `{meas['command']}` on {meas['gpu']}, {meas['date']}"
    passes: dict[str, list] = {}
    add = lambda key, pt: passes.setdefault(key, []).append(pt)  # noqa: E731
    for m_, k_, n_, ms in peaks["tensor"]:
        add("qkv_proj", {"M": m_, "K": k_, "N": n_, "dtype": "fp16", "out": "fp16", "ms": cm.sig(ms, 5), "src": "peak GEMM"})
    for run in meas["layer"]:
        h, n, d, causal = run["h"], run["N"], run["d"], run["causal"]
        D = run["heads"] * d
        p = run["passes"]
        suffix = ":causal" if causal else ""
        for name in ("qk", "softmax", "pv", "fused"):
            if name in p:
                add(f"{run['kernel']}.{name}{suffix}", {"B": 1, "h": h, "N": n, "d": d, "dtype": "fp16", "causal": causal,
                                                       "ms": cm.sig(p[name], 5), "src": "layer, 1 rank"})
        if causal:
            continue
        if STRIDED[run["kernel"]] and "qkv_proj" in p:  # no relayout inside the pass
            add("qkv_proj", {"M": n, "K": D, "N": 3 * h * d, "dtype": "fp16", "out": "fp16", "ms": cm.sig(p["qkv_proj"], 5),
                             "src": f"layer, 1 rank, {run['kernel']}"})
        if "out_proj" in p:
            add("out_proj", {"M": n, "K": h * d, "N": D, "dtype": "fp16", "out": "fp16", "ms": cm.sig(p["out_proj"], 5),
                             "src": "layer, 1 rank (fp16 result, bias in the epilogue)"})
    for m_, k_, n_, ms in meas.get("out_fp32", []):
        add("out_proj", {"M": m_, "K": k_, "N": n_, "dtype": "fp16", "out": "fp32", "ms": cm.sig(ms, 5),
                         "src": "output GEMM with an fp32 result (the partials)"})
    for key in ("relayout", "epilogue"):
        for b, ms in meas.get(key, []):
            add(key, {"bytes": b, "ms": cm.sig(ms, 5), "src": key})
    gpu_word = "".join(c if c.isalnum() else "_" for c in meas["gpu"].replace("NVIDIA ", "").split(" (")[0]).lower()
    name = meas.get("name") or f"{gpu_word}x{meas['world']}"
    data = {
        "name": name,
        "description": f"calibrated: {meas['world']} rank(s) on {meas['gpu']}; {meas['date']}; "
                       + ", ".join(f"{k} {v}" for k, v in meas.get("versions", {}).items()),
        "gpu": meas["gpu"], "gpus_per_node": int(meas["gpus_per_node"]), "max_nodes": 1,
        "memory_GiB": cm.sig(meas["free_bytes"] / 2**30),
        "peaks": {"tensor_tflops": cm.sig(tensor), "fp32_tflops": cm.sig(fp32), "mem_GBps": cm.sig(bw)},
        "passes": passes,
        "sources": {
            "peaks.tensor_tflops": f"{how}: the best fp16 torch.mm of {', '.join(f'{m}x{k}x{n}' for m, k, n, _ in peaks['tensor'])}",
            "peaks.fp32_tflops": f"{how}: fp32 torch.mm (TF32 off) {', '.join(f'{m}x{k}x{n}' for m, k, n, _ in peaks['fp32'])}",
            "peaks.mem_GBps": f"{how}: device-to-device copy, bytes read + written / time",
            "memory_GiB": f"{how}: torch.cuda.mem_get_info free bytes before the calibration",
            "passes": f"{how}: each pass timed inside the layer (1 rank, h of "
                      f"{meas['layer'][0]['heads'] if meas['layer'] else '?'} heads), CUDA events, medians",
        },
    }
    colls = meas.get("collectives") or {}
    W = meas["world"]
    if W > 1 and colls.get("allreduce"):
        step = 3.4  # NCCL's Ring/Simple latency per NVLink step (src/graph/tuning.cc)
        main = cm.fit_alpha_beta(colls["allreduce"], "allreduce", W, step)
        per = {}
        for kind in ("allgather", "reducescatter"):
            if colls.get(kind):
                per[kind] = cm.fit_alpha_beta(colls[kind], kind, W, step)
        data["links"] = {"nvlink": {**main, "step_us": step, "per_collective": per,
                                    "measured": {k: [[b, cm.sig(ms, 5)] for b, ms in v] for k, v in colls.items()}}}
        woke = cm.fit_link_wake(meas.get("link_wake") or [])
        if meas.get("link_wake"):
            data["links"]["nvlink"]["measured"]["after_idle"] = [[i, cm.sig(ms, 5), round(us, 1)]
                                                                 for i, ms, us in meas["link_wake"]]
        if woke:
            data["links"]["nvlink"].update(woke)
        # a collective inside the layer against the bare one's model at the same bytes (not a layer whose
        # compute lets the link sleep: what that adds is wake_us, whole or in part)
        bare = Machine(name="bare", data=data, path="(calibration)")
        extra_us: dict[str, list] = {}
        for run in meas.get("layer_multi", []):
            compute = run["passes"].get("gpu", 0.0) - sum(v for k, v in run["passes"].items() if k in COLLECTIVE_NAMES)
            if woke and compute >= woke["idle_ms"]:   # as predict() counts the idle before the collective
                continue
            for kind, nbytes in (run.get("collective_bytes") or {}).items():
                if kind in run["passes"] and kind in COLLECTIVE_NAMES:
                    model_us = cm.collective_ms(bare, kind, nbytes, W, max(W, int(meas["gpus_per_node"])))["ms"] * 1e3
                    extra_us.setdefault(kind, []).append(run["passes"][kind] * 1e3 - model_us)
        for kind, v in extra_us.items():  # the median over the kernels and lengths the W-rank layer ran
            per.setdefault(kind, {})["layer_extra_us"] = round(statistics.median(v), 1)
        data["sources"]["links.nvlink"] = (f"{how}: NCCL all-reduce, all-gather, reduce-scatter over {W} GPUs at "
                                           f"{', '.join(f'{b // MiB}' for b, _ in colls['allreduce'])} MiB "
                                           "(tpattn.model.measure.bare_collective_ms, as scripts/model/validate_model.py times them: "
                                           f"{COLLECTIVE_WARMUP} warm-up samples, then {COLLECTIVE_SAMPLES} samples of "
                                           f"a barrier, a GPU spin and {COLLECTIVE_REPS} calls back to back between "
                                           "CUDA events, / calls; per sample the slowest rank, the median over the "
                                           "samples), fitted by least squares on "
                                           "the relative error with step_us = 3.4 us (NVIDIA/nccl src/graph/tuning.cc, "
                                           "Ring/Simple over NVLink); layer_extra_us: the same collective inside "
                                           f"the {W}-rank layer (timed behind a barrier and a GPU spin; call by "
                                           "call the last rank to arrive, the median over the calls of every round, "
                                           "as scripts/model/validate_model.py measures it) minus that model, the median "
                                           "over the kernels and lengths the layer ran"
                                           + ("" if not meas.get("link_wake") else
                                              f"; wake_us and idle_ms: a reduce-scatter of {WAKE_BYTES // MiB} MiB "
                                              f"after {', '.join(f'{i:g}' for i, _, _ in meas['link_wake'])} ms with "
                                              "nothing on the link (tpattn.model.measure.link_wake: a barrier, the same GPU "
                                              f"spin on every rank, {WAKE_CALLS} calls, the last rank to arrive, "
                                              "medians; measured.after_idle: idle ms, ms, ranks apart us); idle_ms "
                                              f"is the first idle it took {cm.WAKE_MIN_US:.0f} us or more longer "
                                              "than after the shortest, wake_us the median excess from there on"
                                              + ("" if woke else " (none did: no wake-up modeled)")))
    # the layer's per-call overhead and host time: end to end minus what the model says the passes and
    # the untimed steps cost, with the efficiencies just measured
    tmp = Machine(name=name, data=data, path="(calibration)")
    tmp.curves = _curves(tmp, passes)
    over: dict[str, list] = {}
    host: dict[str, list] = {}
    stall: dict[str, list] = {}
    for run in meas["layer"]:
        if run["causal"] or "total" not in run["passes"]:
            continue
        p = run["passes"]
        shape = Shape(seq_len=run["N"], heads=run["h"], head_dim=run["d"], kernel=run["kernel"])
        try:
            steps, _ = layer_steps(shape, 1)
            untimed = sum(cm.step_ms(tmp, s)["ms"] for s in steps if s.name == "other")
        except ModelError:
            continue
        timed = sum(v for k, v in p.items() if k in COMPUTE_ORDER)
        # the GPU time of the spun call (older measurements: the un-spun call's)
        over.setdefault(run["kernel"], []).append(max(0.0, p.get("gpu", p["total"]) - timed - untimed))
        host.setdefault(run["kernel"], []).append(p.get("host", 0.0))
        if "gpu" in p and "host" in p:
            stall.setdefault(run["kernel"], []).append(call_stall(p))
    layer = {"overhead_ms": {k: round(statistics.median(v), 4) for k, v in over.items()},
             "host_ms": {k: round(statistics.median(v), 4) for k, v in host.items()},
             "host_ms_per_collective": 0.1, "launch_us": 3.0}
    if stall:
        layer["stall_ms"] = {k: round(statistics.median(v), 4) for k, v in stall.items()}
    extra = []
    for run in meas.get("layer_multi", []):
        if not run.get("collectives"):
            continue
        if "host_over_alone_ms" in run:  # paired round by round with the same heads alone
            extra.append(run["host_over_alone_ms"] / run["collectives"])
            continue
        base = [r for r in meas["layer"] if r["kernel"] == run["kernel"] and not r["causal"]
                and r["h"] == run["h"] and r["N"] == run["N"]]
        if base:
            extra.append((run["passes"]["host"] - base[0]["passes"]["host"]) / run["collectives"])
    if extra:
        layer["host_ms_per_collective"] = round(max(0.0, statistics.median(extra)), 4)
    host_w: dict[str, list] = {}
    stall_w: dict[str, list] = {}
    for run in meas.get("layer_multi", []):
        if run.get("host_by_round"):   # the quietest round (quiet_host_ms)
            host_w.setdefault(run["kernel"], []).append(quiet_host_ms(run["host_by_round"]))
        elif "host" in run["passes"]:  # older measurements: one number
            host_w.setdefault(run["kernel"], []).append(run["passes"]["host"])
        if "stall_ms" in run:
            stall_w.setdefault(run["kernel"], []).append(run["stall_ms"])
        elif "host" in run["passes"] and "gpu" in run["passes"]:
            stall_w.setdefault(run["kernel"], []).append(call_stall(run["passes"]))
    if host_w:
        layer["host_ms_by_world"] = {str(W): {k: round(statistics.median(v), 4) for k, v in host_w.items()}}
    if stall_w:
        layer["stall_ms_by_world"] = {str(W): {k: round(statistics.median(v), 4) for k, v in stall_w.items()}}
    data["layer"] = layer
    data["sources"]["layer"] = (f"{how}: overhead = the layer's GPU time (the call timed pass by pass behind a GPU "
                                "spin) - its timed passes - the modeled untimed steps (median over the sizes); "
                                "host = the time for the un-spun call to return (1 rank, median over the sizes); "
                                f"host_ms_by_world: the {W}-rank layer's (the slowest rank's median over a round's calls; "
                                "the quietest of the rounds, each every kernel and length once, since interference on "
                                "the host only ever adds time; then the median over its lengths) "
                                "per kernel; per collective (world sizes not calibrated): the host time of the "
                                "W-rank layer over that of the same heads on each rank alone, timed right after it "
                                "in each round (the median over rounds, per collective); stall = the un-spun call's "
                                "end to end - max(its host time, the spun call's GPU time), median per kernel (1 "
                                "rank: stall_ms; the W-rank layer: stall_ms_by_world, per round, then the median)"
                                + ("" if extra else " (not measured with one rank: 0.1 ms assumed)"))
    validate_machine(data, "the calibrated machine")
    return data


def calibrate(a, argv: list[str]) -> int:
    if not a.out:
        raise PlanError("--calibrate needs --out FILE: where to write the machine file")
    from ..config import check_writable, ConfigError
    try:
        check_writable(a.out, "--out")
    except ConfigError as exc:
        raise PlanError(str(exc)) from None
    proc, device = start_ranks()
    code = EXIT_FAIL
    try:
        meas = _measure(a, proc, device, argv)
        if proc.rank == 0:
            data = build_machine(meas)
            with open(a.out, "w") as f:
                json.dump(data, f, indent=1)
            lk = data.get("links", {}).get("nvlink")
            print(f"[calibrate] wrote {a.out}: tensor {data['peaks']['tensor_tflops']} TFLOP/s, fp32 "
                  f"{data['peaks']['fp32_tflops']} TFLOP/s, copy {data['peaks']['mem_GBps']} GB/s"
                  + (f", NVLink all-reduce busbw {lk['busbw_GBps']} GB/s + {lk['base_us']} us" if lk else
                     " (one rank: no collectives; run it under mpirun -n 2 for those)"), flush=True)
            print(f"[calibrate] layer overhead {data['layer']['overhead_ms']} ms, host {data['layer']['host_ms']} ms",
                  flush=True)
        code = 0
    except Exception as exc:  # noqa: BLE001 - one line, then end every rank
        print(f"tpattn.plan: rank {proc.rank}: calibration failed: {type(exc).__name__}: "
              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}", file=sys.stderr, flush=True)
        if os.environ.get("TPATTN_TRACEBACK"):
            import traceback
            traceback.print_exc()
        proc.abort(EXIT_FAIL)
    finish_ranks(proc, code)
    return code


def _say(proc, msg: str) -> None:
    if proc.rank == 0:
        print(f"[calibrate +{time.monotonic() - _T0:.0f}s] {msg}", flush=True)


_T0 = time.monotonic()


def _measure(a, proc, device, argv) -> dict:
    import torch

    from .. import report
    from ..ops import add_bias as _add_bias
    from ..weights import layer_input
    global _T0
    _T0 = time.monotonic()
    cuda = device.type == "cuda"
    sz = (QuickSizes if a.quick else Sizes) if cuda else CpuSizes
    warm, iters = sz.warmup, sz.iters
    timed = lambda fn, w=warm, i=iters: events_ms(fn, w, i, device)  # noqa: E731
    empty_cache = torch.cuda.empty_cache if cuda else (lambda: None)
    if cuda:
        free, _ = torch.cuda.mem_get_info(device)
        gpu = torch.cuda.get_device_name(device)
    else:
        free, gpu = 8 * 2**30, "cpu (smoke test: the torch reference stands in for every kernel)"
    _say(proc, f"{proc.world} rank(s), {gpu}, {free / 2**30:.1f} GiB free")
    f16 = torch.float16 if cuda else torch.float32  # CPU: fp32 GEMMs (fp16 matmul on CPU is slow or missing)
    peaks = {"tensor": [], "fp32": [], "copy": []}
    for n in sz.gemm:
        x, y = (torch.randn(n, n, device=device, dtype=f16) for _ in range(2))
        out = torch.empty_like(x)
        peaks["tensor"].append((n, n, n, timed(lambda: torch.mm(x, y, out=out), 3, 10)))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        n = sz.fp32_gemm
        x, y = (torch.randn(n, n, device=device) for _ in range(2))
        out = torch.empty_like(x)
        peaks["fp32"].append((n, n, n, timed(lambda: torch.mm(x, y, out=out), 2, 5)))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    src = torch.empty(sz.copy_elems, device=device)
    dst = torch.empty_like(src)
    peaks["copy"].append((2 * src.numel() * 4, timed(lambda: dst.copy_(src), 3, 10)))
    del x, y, out, src, dst
    empty_cache()
    _say(proc, f"peaks: fp16 GEMM {max(2 * m ** 3 / (ms * 1e9) for m, _, _, ms in peaks['tensor']):.0f} TFLOP/s, "
               f"copy {peaks['copy'][0][0] / (peaks['copy'][0][1] * 1e6):.0f} GB/s")
    heads, d = sz.heads, sz.head_dim
    D = heads * d
    dt = torch.float16 if cuda else torch.float32
    runs = []
    for kernel in a.kernels:
        shapes = calibration_shapes(kernel, free_bytes=free, sizes=sz)
        t0 = time.monotonic()
        done = 0
        for h, n, causal in shapes:
            layer = x = None
            try:  # a shape that fails (out of memory, a kernel limit) is left out, the others stay
                layer = build_layer(h, heads, d, kernel, causal, device, dtype="fp16" if cuda else "fp32")
                x = layer_input(1, n, D, 0, dt, device)
                kw, ki = (1, min(iters, 3)) if kernel == "naive" else (warm, iters)
                p = time_layer(layer, x, kw, ki)
                runs.append({"kernel": kernel, "h": h, "N": n, "d": d, "heads": heads, "causal": causal, "passes": p})
                done += 1
            except Exception as exc:  # noqa: BLE001 - said, and the calibration goes on
                first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
                print(f"[calibrate] rank {proc.rank}: {kernel} h={h} N={n}{' causal' if causal else ''} left out: "
                      f"{type(exc).__name__}: {first}", flush=True)
            del layer, x
            empty_cache()
        _say(proc, f"{kernel}: {done} of {len(shapes)} shapes in {time.monotonic() - t0:.0f} s")
    from ..ops import mm as _mm
    out_fp32, relayout, epilogue = [], [], []
    for h in sz.out_heads:
        for n in sz.out_rows:
            o = torch.randn(n, h * d, device=device, dtype=dt)
            wo = torch.randn(h * d, D, device=device, dtype=dt) / 64
            part = torch.empty(n, D, device=device, dtype=torch.float32)
            out_fp32.append((n, h * d, D, timed(lambda: _mm(o, wo, torch.float32, out=part))))
            qkv = torch.randn(1, n, 3, h, d, device=device, dtype=dt)
            relayout.append((2 * qkv.numel() * qkv.element_size(), timed(
                lambda: [t.contiguous() for t in qkv.permute(2, 0, 3, 1, 4).unbind(0)])))
            oc = torch.randn(1, h, n, d, device=device, dtype=dt)
            orow = torch.empty(1, n, h, d, device=device, dtype=dt)
            relayout.append((2 * oc.numel() * oc.element_size(), timed(lambda: orow.permute(0, 2, 1, 3).copy_(oc))))
            del o, wo, part, qkv, oc, orow
    bo = torch.randn(D, device=device, dtype=dt)
    for rows in sz.epilogue_rows:
        part = torch.randn(rows, D, device=device)
        y = torch.empty(rows, D, device=device, dtype=dt)
        epilogue.append((rows * D * (4 + y.element_size()), timed(lambda: _add_bias(part, bo, y))))  # the layer's
        del part, y
    empty_cache()
    _say(proc, "GEMM with fp32 result, relayouts and the bias + cast timed")
    colls: dict[str, list] = {}
    multi = []
    wake = []
    if proc.world > 1:
        colls = bare_collectives(sz.collectives, device)
        _say(proc, "collectives: " + ", ".join(f"{k} {b / MiB:g} MiB {ms * 1e3:.0f} us" for k, v in colls.items()
                                               for b, ms in (v[0], v[-1])))
        if cuda and getattr(torch.cuda, "_sleep", None) is not None:
            wake = link_wake(device)
            _say(proc, f"reduce-scatter of {WAKE_BYTES // MiB} MiB after an idle link: " + ", ".join(
                f"{idle:g} ms {ms * 1e3:.0f} us" for idle, ms, _ in wake))
        import torch.distributed as dist

        from ..sharding import head_range
        # every kernel at a few lengths (sz.multi_n) at the heads per rank of the full shape: the host
        # time per kernel at this world size and the collectives inside the layer. The W-rank layers
        # first, then the 1-rank ones beside them (one set of weights each: generating them is slow)
        h = len(head_range(heads, proc.world, 0, True))   # uneven: rank 0 holds the most
        kernels = [k for k in ("fused", "tiled", "naive") if k in a.kernels]
        t0 = time.monotonic()
        rounds: dict[tuple[str, int], list[dict]] = {}
        coll_bytes: dict[tuple[str, int], dict] = {}
        for _ in range(sz.multi_rounds):   # every kernel and length once per round (see Sizes.multi_rounds)
            for kernel in kernels:
                kw, ki = (1, min(sz.multi_iters, 5)) if kernel == "naive" else (sz.multi_warmup, sz.multi_iters)
                for n in sz.multi_n:
                    mk = lambda alone: build_layer(h, heads, d, kernel, False, device,  # noqa: E731
                                                   dtype="fp16" if cuda else "fp32", group=dist.group.WORLD,
                                                   uneven=heads % proc.world != 0, alone=alone)
                    x = layer_input(1, n, D, 0, dt, device)
                    layer, raw = mk(False), {}
                    mine = time_layer(layer, x, kw, ki, raw=raw)
                    coll_bytes[kernel, n] = dict(layer.collective_nbytes(1, n))
                    del layer
                    # the same heads and weights on each rank alone, at once, right after: the host time
                    # without the collectives, paired with this round's (host_ms_per_collective)
                    lay1 = mk(True)
                    one = time_layer(lay1, x, kw, ki)
                    del lay1, x
                    empty_cache()
                    every = gather((mine, {k: v for k, v in raw.items() if k in COLLECTIVE_NAMES}, one.get("host")))
                    # the slowest rank, but a collective: the last rank to arrive (from the samples, below)
                    p = {k: max(r[0][k] for r in every if k in r[0]) for k in every[0][0] if k not in COLLECTIVE_NAMES}
                    rounds.setdefault((kernel, n), []).append(
                        {"passes": p, "samples_by_rank": [r[1] for r in every],
                         "host_alone": max(r[2] or 0.0 for r in every)})
        for (kernel, n), got in rounds.items():
            comb = combine_layer_rounds(got)  # as scripts/model/validate_model.py combines its rounds
            multi.append({"kernel": kernel, "h": h, "N": n, "passes": comb["passes"], "rounds": len(got),
                          "host_by_round": [round(g["passes"]["host"], 4) for g in got if "host" in g["passes"]],
                          **({"stall_ms": comb["stall_ms"]} if "stall_ms" in comb else {}),
                          "host_over_alone_ms": statistics.median(g["passes"].get("host", 0.0) - g["host_alone"]
                                                                  for g in got),
                          "collectives": len(coll_bytes[kernel, n]), "collective_bytes": coll_bytes[kernel, n]})
        for kernel in kernels:
            kw, ki = (1, min(sz.multi_iters, 5)) if kernel == "naive" else (sz.multi_warmup, sz.multi_iters)
            for n in sz.multi_n:
                if not any(r["kernel"] == kernel and r["h"] == h and r["N"] == n and not r["causal"] for r in runs):
                    lay1 = build_layer(h, heads, d, kernel, False, device, dtype="fp16" if cuda else "fp32")
                    x = layer_input(1, n, D, 0, dt, device)
                    runs.append({"kernel": kernel, "h": h, "N": n, "d": d, "heads": heads, "causal": False,
                                 "passes": time_layer(lay1, x, kw, ki)})
                    del lay1, x
                    empty_cache()
        _say(proc, f"{proc.world}-rank layer: " + ", ".join(
            (f"{r['kernel']} N={r['N']} host {quiet_host_ms(r['host_by_round']):.3f} ms (the quietest of rounds "
             f"{min(r['host_by_round']):.3f}-{max(r['host_by_round']):.3f})" if r["host_by_round"]
             else f"{r['kernel']} N={r['N']} host {r['passes'].get('host', 0):.3f} ms")
            for r in multi)
            + f" ({time.monotonic() - t0:.0f} s)")
    everyone = gather(runs)
    return {"gpu": gpu, "gpus_per_node": torch.cuda.device_count() if cuda else proc.local_world,
            "free_bytes": free, "world": proc.world,
            "command": "python -m tpattn.plan " + " ".join(argv) + (f" ({proc.world} ranks)" if proc.world > 1 else ""),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "versions": {k: v for k, v in report.versions().items() if k in ("torch", "cuda", "cupy", "nccl")},
            "name": a.name, "peaks": peaks, "layer": everyone[0], "out_fp32": out_fp32, "relayout": relayout,
            "epilogue": epilogue, "collectives": colls, "layer_multi": multi,
            **({"link_wake": wake} if wake else {}),
            "host": platform.node()}
