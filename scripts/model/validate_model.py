#!/usr/bin/env python3
"""The cost model against the layer: run the layer and predict it, side by side, per pass and end
to end, and the bare NCCL collectives at 8-256 MiB; write DIR/model_validation.md and .json.

    mpirun -n 2 python scripts/model/validate_model.py --machine results/model/h200x2_cal.json --out DIR
    python scripts/model/validate_model.py --machine h200x2 --out DIR          # 1 GPU: no 2-GPU rows

For each kernel (naive, tiled, fused) and N (2048, 4096, 8192; default shape otherwise: B = 1,
H = 32, d = 128, fp16, fp32 partials), the layer runs on 1 GPU (every rank runs its own 1-GPU
layer at the same time; rank 0's numbers are kept) and on all the ranks (tpattn's layer over the
NCCL group), timed by the function --calibrate times it with (tpattn.model.measure.time_layer: per
iteration one un-spun call timed whole with CUDA events, as python -m tpattn times it, and its host
time; then one call with an event pair around every pass, queued behind a barrier over the ranks and
a GPU spin longer than the host's launch time, so each pass's events hold GPU time only, which the
model predicts; medians). Over
several ranks: compute passes, median over ranks (--uneven-heads: rank 0's, which holds the most
heads, as the model predicts); collectives, the last rank to arrive, call by call (the minimum
over ranks in each timed call, the transfer itself, then the median over the calls: which rank
waits changes from call to call, so each rank's own median can hold a wait; the ranks' medians and
every sample are in the JSON); end to end, the slowest rank. The bare collectives are
timed by the very function --calibrate fits its alpha-beta numbers on (tpattn.model.measure.bare_collectives:
same sizes, warm-up, barrier and statistic). The layer is measured in --rounds rounds (each every
kernel, N and world size once, one round after another) and each number is the median over the
rounds (a collective: over the calls of every round): the host's speed drifts over seconds on the
GPU machines measured (scripts/model/host_probe.py), and a host-bound call's end to end moves with it.
The model (tpattn.model.costmodel) predicts the same call from each --machine file; the first is the
one the targets are judged on. Error = (predicted - measured) / measured.

Targets: end to end within 15 %, each pass within 25 %, the all-reduce within 20 % at
8-256 MiB. The table says for each prediction whether the machine file was calibrated at that very
shape (then per-pass agreement is expected by construction; the end to end, the collectives and the
2-GPU rows are predictions all the same).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tpattn.model import costmodel as cm  # noqa: E402
from tpattn.model import errors, measure  # noqa: E402
from tpattn.model import machine as mc  # noqa: E402
from tpattn.model import steps as st  # noqa: E402

TARGET_E2E, TARGET_PASS, TARGET_COLL = 15.0, 25.0, 20.0
HOST_NEAR = 0.8   # a row whose host time is this share of its GPU time or more is listed round by round
PASS_ORDER = ("qkv_proj", "qk", "softmax", "pv", "fused", "out_proj", "allreduce", "reducescatter", "allgather")


def parse(argv):
    p = argparse.ArgumentParser(prog="scripts/model/validate_model.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--machine", nargs="+", required=True, metavar="NAME|FILE",
                   help="machine file(s) to predict with; the first is judged against the targets")
    p.add_argument("--out", default="benchmarks", metavar="DIR", help="where model_validation.md/.json go")
    p.add_argument("--kernels", nargs="+", default=list(st.KERNELS), choices=list(st.KERNELS))
    p.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--uneven-heads", action="store_true",
                   help="as python -m tpattn: a world size that does not divide --heads (ceil/floor(H/W) per "
                        "rank); the compute passes compared are rank 0's, which holds the most, as the model's")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10,
                   help="timed iterations (naive: as many as fit in about 2 s a call kind and round by the "
                        "first machine's prediction, at least 3)")
    p.add_argument("--rounds", type=int, default=3,
                   help="measure every kernel, N and world size this many times, one round after another, and "
                        "take the median over the rounds (default 3): the host's speed drifts over seconds")
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[s // measure.MiB for s in measure.COLLECTIVE_SIZES],
                   help="bare collective sizes, MiB (default those --calibrate measures; timed by the same "
                        "function, tpattn.model.measure.bare_collective_ms)")
    return p.parse_args(argv)


def err_pct(pred: float, meas: float) -> float | None:
    return None if not meas else 100.0 * (pred - meas) / meas


def calibrated_at(m: mc.Machine, kernel: str, h: int, n: int) -> bool:
    """Whether the machine file has a calibration point of this kernel at h heads and length n."""
    def pts(data):
        return (data.get("passes") or {}).get("fused.fused" if kernel == "fused" else f"{kernel}.qk", [])
    data = m.data
    found = pts(data)
    if not found and data.get("passes_from"):
        try:
            found = pts(mc.load_machine(data["passes_from"]).data)
        except errors.MachineError:
            found = []
    return any(p.get("h") == h and p.get("N") == n and not p.get("causal") for p in found)


NAIVE_BUDGET_MS = 2000.0   # the naive layer's timed calls of one kind (un-spun or spun), per round


def iterations(kernel: str, n: int, world: int, a, m: mc.Machine) -> tuple[int, int]:
    """(warm-up, timed) calls. The naive layer takes 20-700 ms a call: 1 warm-up and as many timed
    calls as fit in NAIVE_BUDGET_MS by the machine's prediction, 3 to --iters (3 at N = 4096 left its
    in-layer reduce-scatter resting on 9 calls over 3 rounds). Every rank computes the same number
    from the same file: the ranks must agree on how many collectives they call."""
    if kernel != "naive":
        return a.warmup, a.iters
    try:
        ms = cm.predict(m, st.Shape(seq_len=n, heads=a.heads, head_dim=a.head_dim, kernel=kernel,
                                    uneven_heads=getattr(a, "uneven_heads", False)),
                        world, max(world, m.gpus_per_node))["end_to_end_ms"]
    except errors.ModelError:
        return 1, min(a.iters, 3)
    return 1, max(min(a.iters, 3), min(a.iters, int(NAIVE_BUDGET_MS / max(ms, 1e-3))))


def measure_layer(kernel: str, n: int, world: int, a, device, calls: tuple[int, int]) -> dict:
    """The layer at world size `world` (1: every rank its own 1-GPU layer), `calls` = (warm-up, timed).
    {pass: ms} combined over ranks."""
    import torch
    import torch.distributed as dist

    from tpattn.weights import layer_input
    warm, iters = calls
    group = dist.group.WORLD if world > 1 else None
    cuda = device.type == "cuda"  # on CPU (the smoke test, TPATTN_PLAN_ALLOW_CPU=1): fp32 and the torch reference
    layer = measure.build_layer(a.heads, a.heads, a.head_dim, kernel, False, device, group=group,
                             dtype="fp16" if cuda else "fp32", uneven=getattr(a, "uneven_heads", False))
    x = layer_input(1, n, a.heads * a.head_dim, 0, torch.float16 if cuda else torch.float32, device)
    raw: dict = {}
    before = measure.host_load()
    mine = measure.time_layer(layer, x, warm, iters, raw=raw)
    load = measure.rank_loads(measure.gather(measure.host_load_between(before, measure.host_load())))
    colls = layer.collective_nbytes(1, n) if world > 1 else {}
    del layer, x
    if cuda:
        torch.cuda.empty_cache()
    everyone = measure.gather(mine)
    # every rank's samples of each collective and of the call, iteration by iteration (what the medians
    # hide: which rank waited in which call)
    samples = measure.gather({k: [round(t, 4) for t in v] for k, v in raw.items() if k in st.COLLECTIVE_NAMES or k == "gpu"})
    dtype = "fp16" if cuda else "fp32"
    if world == 1:
        return {"passes": everyone[0], "collectives": {}, "ranks": 1, "dtype": dtype, "host_load": load}
    out, median = {}, {}
    uneven = a.heads % world != 0  # ranks hold different heads: the model predicts rank 0's (the most)
    for k in everyone[0]:
        vals = [r[k] for r in everyone if k in r]
        if k in st.COLLECTIVE_NAMES:  # call by call the last rank to arrive (it waits for nobody)
            calls = zip(*(r[k] for r in samples))
            out[k], median[k] = statistics.median(min(c) for c in calls), statistics.median(vals)
        elif k in ("total", "host"):
            out[k] = max(vals)                                        # the slowest rank
        else:
            out[k] = everyone[0][k] if uneven else statistics.median(vals)
    return {"passes": out, "collectives": colls, "collective_median_over_ranks": median, "ranks": world, "dtype": dtype,
            "samples_by_rank": samples, "host_load": load}


def combine(rounds: list[dict]) -> dict:
    """One measurement of a layer from its rounds (measure_layer's results, one per round), combined
    as --calibrate combines its own (tpattn.model.measure.combine_layer_rounds: per pass the median over the
    rounds; a collective call by call the last rank to arrive over the calls of every round; the
    stall per round, then the median; each round's end to end, host and GPU time in "rounds")."""
    out = {**rounds[0], **measure.combine_layer_rounds(rounds)}
    if "collective_median_over_ranks" in rounds[0]:
        out["collective_median_over_ranks"] = measure.combine_rounds([r["collective_median_over_ranks"] for r in rounds])
    return out


def wake_prediction(m: mc.Machine, c: dict, per_rank: list[list[float]] | None) -> dict | None:
    """A collective the model says pays the NVLink link's wake-up (c: tpattn.model.costmodel.collective_ms's
    prediction, which holds the whole wake-up: ranks arriving together), predicted call by call with the
    ranks' measured arrival spread (their times' max - min: the first rank's traffic wakes the link,
    tpattn.model.costmodel.wake_share), then the median over the calls, as the measurement takes it. None
    without per-call samples."""
    if not per_rank or len(per_rank) < 2:
        return None
    awake = c["ms"] - c["wake_us"] / 1e3
    apart = [(max(call) - min(call)) * 1e3 for call in zip(*per_rank)]
    by_call = [awake + cm.link_wake_us(m, c["idle_before_ms"], us) / 1e3 for us in apart]
    return {"predicted_ms": statistics.median(by_call), "together_ms": c["ms"], "apart_ms": awake,
            "apart_us_median": statistics.median(apart), "idle_before_ms": c["idle_before_ms"],
            "calls_with_wake": sum(b > awake for b in by_call), "calls": len(by_call)}


def compare(m: mc.Machine, kernel: str, n: int, world: int, a, meas: dict) -> dict:
    shape = st.Shape(seq_len=n, heads=a.heads, head_dim=a.head_dim, kernel=kernel, dtype=meas.get("dtype", "fp16"),
                     uneven_heads=getattr(a, "uneven_heads", False))
    pred = cm.predict(m, shape, world, max(world, m.gpus_per_node))
    predicted = {**pred["passes"], **{k: c["ms"] for k, c in pred["collectives"].items()},
                 "total": pred["end_to_end_ms"]}
    samples = meas.get("samples_by_rank") or []
    woke = {k: wake_prediction(m, c, [r[k] for r in samples if k in r])
            for k, c in pred["collectives"].items() if c.get("wake_us")}
    predicted.update({k: w["predicted_ms"] for k, w in woke.items() if w})
    rows = []
    spread = [r["total"] for r in meas.get("rounds", []) if "total" in r]
    for name in (*PASS_ORDER, "total"):
        if name in meas["passes"] and name in predicted:
            rows.append({"pass": name, "measured_ms": meas["passes"][name], "predicted_ms": predicted[name],
                         "error_pct": err_pct(predicted[name], meas["passes"][name]),
                         **({"wake": woke[name]} if woke.get(name) else {})})
    same = set(pred["collectives"]) == set(meas["collectives"])
    return {"kernel": kernel, "N": n, "world": world, "machine": m.name,
            "calibrated_here": calibrated_at(m, kernel, pred["heads_per_rank"], n), "rows": rows,
            "heads_by_rank": pred["heads_by_rank"],
            "host_measured_ms": meas["passes"].get("host"), "host_predicted_ms": pred["host_ms"],
            "gpu_predicted_ms": pred["gpu_ms"], "gpu_measured_ms": meas["passes"].get("gpu"),
            "stall_predicted_ms": pred.get("stall_ms", 0.0),
            "stall_measured_ms": meas.get("stall_ms", measure.call_stall(meas["passes"])
                                          if {"total", "host", "gpu"} <= set(meas["passes"]) else None),
            "collectives_as_predicted": same,
            "rounds": meas.get("rounds", []),
            "total_rounds_range_ms": [min(spread), max(spread)] if spread else None,
            "collectives_measured": meas["collectives"],
            "samples_by_rank": meas.get("samples_by_rank"),
            "collectives_predicted": {k: c["bytes"] for k, c in pred["collectives"].items()}}


def fmt(v, nd=3):
    return "-" if v is None else f"{v:.{nd}f}"


def pct(v):
    return "-" if v is None else f"{v:+.1f}%"


def markdown(doc: dict) -> str:
    primary = doc["machines"][0]["name"]
    L = ["# The cost model against the layer", "",
         f"`{doc['command']}` on {doc['ranks']} x {doc['gpu']}, {doc['date']}; versions: "
         + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()) + ".", "",
         "Machine files: " + "; ".join(f"**{m['name']}** ({m['path']})" for m in doc["machines"])
         + f". Targets are judged on **{primary}**. Shape: B = 1, H = {doc['heads']}, d = {doc['head_dim']}, fp16, "
         "fp32 partials, head-parallel; error = (predicted − measured) / measured. Measured in "
         f"{doc.get('rounds', 1)} round(s), each every kernel, N and world size once, the median over the rounds "
         "(the host's speed drifts over seconds; the rounds' end to end spread is in the table, each round in the JSON); in a "
         "round each rank's median over the timed calls (end to end and host: the call un-spun; per pass: the call queued behind a barrier "
         "and a GPU spin, so each pass's events hold its GPU time, tpattn.model.measure.time_layer); over several ranks the compute passes are the median over ranks, a collective the "
         "last rank to arrive, call by call (the minimum over ranks in each timed call, then the median over the "
         "calls of every round: its transfer; the ranks' own medians, which can include waiting, and every sample are in the JSON) and "
         "end to end the slowest rank. *calibrated here*: the machine file has a calibration point of that kernel "
         "at that heads-per-rank and N, so per-pass agreement there is by construction.", ""]
    s = doc["summary"]
    L += ["## Against the targets", "",
          "| target | result |", "|---|---|",
          f"| end to end within {TARGET_E2E:.0f} % (naive, tiled, fused; N in {doc['seq_lens']}; 1 and {doc['ranks']} GPUs) "
          f"| **{'met' if s['e2e_ok'] == s['e2e_n'] else 'not met'}**: {s['e2e_ok']} of {s['e2e_n']}; worst "
          f"{pct(s['e2e_worst'])} |",
          *([f"| (the same in each row's quietest round: the model predicts a quiet host) | {s['e2e_quiet_ok']} of "
             f"{s['e2e_quiet_n']}; worst {pct(s['e2e_quiet_worst'])} |"] if s.get("e2e_quiet_n") else []),
          f"| each pass within {TARGET_PASS:.0f} % | **{'met' if s['pass_ok'] == s['pass_n'] else 'not met'}**: "
          f"{s['pass_ok']} of {s['pass_n']}; worst {pct(s['pass_worst'])} ({s['pass_worst_what']}) |",
          f"| all-reduce within {TARGET_COLL:.0f} % at 8–256 MiB | "
          + (f"**{'met' if s['ar_ok'] == s['ar_n'] else 'not met'}**: {s['ar_ok']} of {s['ar_n']}; worst "
             f"{pct(s['ar_worst'])} |" if s["ar_n"] else "not measured (one rank) |"), ""]
    L += [f"## End to end ({primary})", "",
          "End to end = max(GPU, host) + stall (tpattn.model.costmodel); the GPU time measured is the spun call's, "
          "the stall measured the end to end beyond max(host, GPU).", "",
          "| kernel | N | GPUs | measured ms | rounds ms (min–max) | predicted ms | error | GPU measured / predicted ms "
          "| host measured / predicted ms | stall measured / predicted ms | calibrated here |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in doc["comparisons"]:
        if c["machine"] != primary:
            continue
        t = next(r for r in c["rows"] if r["pass"] == "total")
        rng = c.get("total_rounds_range_ms")
        L.append(f"| {c['kernel']} | {c['N']} | {c['world']} | {fmt(t['measured_ms'])} | "
                 f"{f'{rng[0]:.3f}–{rng[1]:.3f}' if rng else '-'} | {fmt(t['predicted_ms'])} | "
                 f"{pct(t['error_pct'])} | {fmt(c.get('gpu_measured_ms'))} / {fmt(c['gpu_predicted_ms'])} | "
                 f"{fmt(c['host_measured_ms'])} / {fmt(c['host_predicted_ms'])} | "
                 f"{fmt(c.get('stall_measured_ms'))} / {fmt(c.get('stall_predicted_ms'))} | "
                 f"{'yes' if c['calibrated_here'] else 'no'} |")
    near = [c for c in doc["comparisons"] if c["machine"] == primary and c.get("gpu_measured_ms")
            and (c.get("host_measured_ms") or 0) >= HOST_NEAR * c["gpu_measured_ms"]]
    if near:
        L += ["", "## The host-bound rows, round by round", "",
              f"The rows whose host time is at least {HOST_NEAR:.0%} of their GPU time, where the end to end follows "
              "the host's speed. Each round: end to end / host ms, and what competed for the CPU meanwhile "
              "(tpattn.model.measure.host_load_between; the most of any rank): the machine's CPUs busy (these ranks "
              "included), the steal time of the ranks' CPUs (given by the hypervisor to other machines), the "
              "ranks' involuntary context switches.", "",
              "| kernel | N | GPUs | GPU ms | rounds: end to end / host ms (busy %, steal %, switches) |",
              "|---|---:|---:|---:|---|"]
        for c in near:
            cells = []
            for r in c.get("rounds", []):
                ld = r.get("host_load") or {}
                extra = (f" ({ld['busy_pct']:.0f} %, {ld['steal_pct']:.1f} %, {ld['preempted']})" if ld else "")
                cells.append(f"{fmt(r.get('total'))} / {fmt(r.get('host'))}{extra}")
            L.append(f"| {c['kernel']} | {c['N']} | {c['world']} | {fmt(c['gpu_measured_ms'])} | " + "; ".join(cells) + " |")
    L += ["", f"## Per pass ({primary})", "",
          "| kernel | N | GPUs | pass | measured ms | predicted ms | error |", "|---|---:|---:|---|---:|---:|---:|"]
    for c in doc["comparisons"]:
        if c["machine"] != primary:
            continue
        for r in c["rows"]:
            if r["pass"] != "total":
                L.append(f"| {c['kernel']} | {c['N']} | {c['world']} | {r['pass']} | {fmt(r['measured_ms'])} | "
                         f"{fmt(r['predicted_ms'])} | {pct(r['error_pct'])} |")
    woken = [(c, r) for c in doc["comparisons"] if c["machine"] == primary for r in c["rows"] if r.get("wake")]
    if woken:
        nvl = next(m for m in doc["machines"] if m["name"] == primary).get("nvlink_wake") or {}
        L += ["", "## Collectives after an idle link", "",
              f"The NVLink link sleeps after {fmt(nvl.get('idle_ms'), 0)} ms with no traffic, and the next collective "
              f"pays its wake-up ({fmt(nvl.get('wake_us'), 0)} us, --calibrate: tpattn.model.measure.link_wake) when the ranks "
              "arrive together; when one rank arrives well before the last, its traffic wakes the link meanwhile "
              "(tpattn.model.costmodel.wake_share: all of the wake-up up to a lead of half of it, none from twice it on). "
              "The collective that follows a call's compute of that long is predicted call by call with the ranks' "
              "measured spread (max − min of their times in that call), then the median, as it is measured.", "",
              "| kernel | N | GPUs | pass | compute before, ms | ranks apart, median us | calls with the wake-up "
              "| predicted together / apart ms | predicted ms | measured ms | error |",
              "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for c, r in woken:
            w = r["wake"]
            L.append(f"| {c['kernel']} | {c['N']} | {c['world']} | {r['pass']} | {w['idle_before_ms']:.1f} | "
                     f"{w['apart_us_median']:.0f} | {w['calls_with_wake']} of {w['calls']} | {fmt(w['together_ms'])} / "
                     f"{fmt(w['apart_ms'])} | {fmt(r['predicted_ms'])} | {fmt(r['measured_ms'])} | {pct(r['error_pct'])} |")
    if doc["bare"]:
        L += ["", f"## Bare NCCL collectives over {doc['ranks']} GPUs", "",
              "Timed as --calibrate times them (tpattn.model.measure.bare_collective_ms): per sample a barrier, a GPU spin, "
              f"then {measure.COLLECTIVE_REPS} calls back to back between two CUDA events, / calls; per sample the "
              f"slowest rank; the median of {measure.COLLECTIVE_SAMPLES} samples after {measure.COLLECTIVE_WARMUP} "
              "warm-up ones. size = the whole "
              "tensor (nccl-tests' convention).", "",
              "| collective | MiB | measured us | busbw GB/s | " + " | ".join(f"{m['name']} us (error)" for m in doc["machines"])
              + " |", "|---|---:|---:|---:|" + "---:|" * len(doc["machines"])]
        for b in doc["bare"]:
            preds = " | ".join(f"{p['predicted_ms'] * 1e3:.0f} ({pct(p['error_pct'])})" for p in b["predictions"])
            L.append(f"| {b['kind']} | {b['bytes'] // measure.MiB} | {b['measured_ms'] * 1e3:.0f} | {b['busbw_GBps']:.0f} | {preds} |")
    others = [m["name"] for m in doc["machines"][1:]]
    if others:
        L += ["", "## The other machine files, end to end", "",
              "| kernel | N | GPUs | measured ms | " + " | ".join(f"{o} predicted (error)" for o in others) + " |",
              "|---|---:|---:|---:|" + "---:|" * len(others)]
        keys = [(c["kernel"], c["N"], c["world"]) for c in doc["comparisons"] if c["machine"] == primary]
        for k in keys:
            cs = {c["machine"]: c for c in doc["comparisons"] if (c["kernel"], c["N"], c["world"]) == k}
            meas = next(r for r in cs[primary]["rows"] if r["pass"] == "total")["measured_ms"]
            cells = []
            for o in others:
                t = next((r for r in cs[o]["rows"] if r["pass"] == "total"), None) if o in cs else None
                cells.append(f"{fmt(t['predicted_ms'])} ({pct(t['error_pct'])})" if t else "-")
            L.append(f"| {k[0]} | {k[1]} | {k[2]} | {fmt(meas)} | " + " | ".join(cells) + " |")
    mism = [c for c in doc["comparisons"] if not c["collectives_as_predicted"]]
    if mism:
        L += ["", "**Collectives differ from the model's:** " + "; ".join(
            f"{c['kernel']} N={c['N']} W={c['world']}: ran {c['collectives_measured']}, model {c['collectives_predicted']}"
            for c in mism)]
    return "\n".join(L) + "\n"


def summarize(doc: dict) -> dict:
    primary = doc["machines"][0]["name"]
    e2e, passes = [], []
    for c in doc["comparisons"]:
        if c["machine"] != primary:
            continue
        for r in c["rows"]:
            if r["error_pct"] is None:
                continue
            (e2e if r["pass"] == "total" else passes).append((abs(r["error_pct"]), r["error_pct"],
                                                              f"{c['kernel']} N={c['N']} W={c['world']} {r['pass']}"))
    # end to end in the quietest round (the model predicts a quiet host: tpattn.model.measure.quiet_host_ms)
    quiet = []
    for c in doc["comparisons"]:
        rng = c.get("total_rounds_range_ms")
        t = next((r for r in c["rows"] if r["pass"] == "total"), None)
        if c["machine"] == primary and rng and t:
            e = err_pct(t["predicted_ms"], rng[0])
            quiet.append((abs(e), e))
    ar = [(abs(p["error_pct"]), p["error_pct"]) for b in doc["bare"] if b["kind"] == "allreduce"
          for p in b["predictions"][:1]]
    worst = lambda xs: max(xs)[1] if xs else None  # noqa: E731
    return {"e2e_n": len(e2e), "e2e_ok": sum(a <= TARGET_E2E for a, *_ in e2e), "e2e_worst": worst(e2e),
            "e2e_quiet_n": len(quiet), "e2e_quiet_ok": sum(a <= TARGET_E2E for a, _ in quiet),
            "e2e_quiet_worst": worst(quiet),
            "pass_n": len(passes), "pass_ok": sum(a <= TARGET_PASS for a, *_ in passes),
            "pass_worst": worst(passes), "pass_worst_what": max(passes)[2] if passes else "-",
            "ar_n": len(ar), "ar_ok": sum(a <= TARGET_COLL for a, _ in ar), "ar_worst": worst(ar)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    try:
        machines = [mc.load_machine(x) for x in a.machine]
    except errors.MachineError as exc:
        print(f"validate_model: error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        proc, device = measure.start_ranks(what="validate_model.py")
    except errors.PlanError as exc:
        print(f"validate_model: error: {exc}", file=sys.stderr)
        return 2
    err = st._layout_error(st.Shape(heads=a.heads, uneven_heads=a.uneven_heads), proc.world)
    if err:  # before any layer: rank 0 says it, every rank ends with 2
        if proc.rank == 0:
            print(f"validate_model: error: {err}", file=sys.stderr, flush=True)
        measure.finish_ranks(proc, 2)
        return 2
    import torch

    from tpattn import report
    say = (lambda msg: print(f"[validate] {msg}", flush=True)) if proc.rank == 0 else (lambda msg: None)
    comparisons, bare = [], []
    try:
        worlds = [1] + ([proc.world] if proc.world > 1 else [])
        got: dict[tuple[str, int, int], list[dict]] = {}
        for r in range(max(1, a.rounds)):  # every kernel, N and world size once per round
            for kernel in a.kernels:
                for n in a.seq_lens:
                    for w in worlds:
                        got.setdefault((kernel, n, w), []).append(
                            measure_layer(kernel, n, w, a, device, iterations(kernel, n, w, a, machines[0])))
            if a.rounds > 1:
                say(f"round {r + 1} of {a.rounds} measured")
        for (kernel, n, w), rounds in got.items():
            meas = combine(rounds)
            before = len(comparisons)
            for m in machines:
                try:
                    comparisons.append(compare(m, kernel, n, w, a, meas))
                except errors.ModelError as exc:
                    say(f"{m.name}: no prediction for {kernel} N={n} W={w}: {exc}")
            # the first machine's comparison of this very call (a machine that cannot predict
            # it, e.g. a 1-GPU file at W = 2, adds none)
            c0 = comparisons[before] if len(comparisons) > before else None
            if c0 and c0["machine"] == machines[0].name:
                t = next(r for r in c0["rows"] if r["pass"] == "total")
                say(f"{kernel} N={n} W={w}: measured {t['measured_ms']:.3f} ms, predicted "
                    f"{t['predicted_ms']:.3f} ({pct(t['error_pct'])})")
        if proc.world > 1:
            # the same call, sizes and order as --calibrate's (tpattn.model.measure.bare_collectives)
            measured = measure.bare_collectives([mib * measure.MiB for mib in a.sizes_mib], device)
            for kind, points in measured.items():
                for nbytes, ms in points:
                    steps, share = cm.ring_steps_and_share(kind, proc.world)
                    preds = []
                    for m in machines:
                        try:
                            p = cm.collective_ms(m, kind, nbytes, proc.world, max(proc.world, m.gpus_per_node))["ms"]
                            preds.append({"machine": m.name, "predicted_ms": p, "error_pct": err_pct(p, ms)})
                        except errors.ModelError as exc:
                            preds.append({"machine": m.name, "predicted_ms": float("nan"), "error_pct": None,
                                          "error": str(exc)})
                    bare.append({"kind": kind, "bytes": nbytes, "measured_ms": ms,
                                 "busbw_GBps": share * nbytes / (ms * 1e6), "predictions": preds})
                say(f"{kind}: " + ", ".join(f"{b['bytes'] // measure.MiB} MiB {b['measured_ms'] * 1e3:.0f} us "
                                            f"({pct(b['predictions'][0]['error_pct'])})" for b in bare if b["kind"] == kind))
        if proc.rank == 0:
            doc = {"command": "python scripts/model/validate_model.py " + " ".join(argv)
                              + (f" (under mpirun, {proc.world} ranks)" if proc.world > 1 else ""),
                   "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                   "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke test)", "ranks": proc.world, "versions": report.versions(),
                   "heads": a.heads, "head_dim": a.head_dim, "seq_lens": a.seq_lens, "rounds": max(1, a.rounds),
                   "machines": [{"name": m.name, "path": m.path,
                                 **({"nvlink_wake": {f: (m.link("nvlink") or {}).get(f) for f in mc.WAKE_FIELDS}}
                                    if (m.link("nvlink") or {}).get("wake_us") is not None else {})}
                                for m in machines],
                   "comparisons": comparisons, "bare": bare}
            doc["summary"] = summarize(doc)
            out = Path(a.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "model_validation.json").write_text(json.dumps(doc, indent=1))
            (out / "model_validation.md").write_text(markdown(doc))
            say(f"wrote {out / 'model_validation.md'} and .json: {doc['summary']}")
    except Exception as exc:  # noqa: BLE001 - one line, then end every rank
        print(f"validate_model: rank {proc.rank}: failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        import traceback
        traceback.print_exc()
        proc.abort(1)
    measure.finish_ranks(proc, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
