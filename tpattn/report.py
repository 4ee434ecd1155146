"""The run's report: stats across ranks, the all-reduce's bandwidth, a table and JSON."""

from __future__ import annotations

import os
import platform
import statistics
import sys

import torch

from .commplan import COLLECTIVES, RING_PASSES
from .errors import __version__
from .memory import estimate, heads_per_rank, heads_world, kv_bytes, kv_heads_per_rank, scores_bytes
from .sharding import describe_blocks, kv_replicated

COMPUTE = ("qkv_proj", "qk", "softmax", "pv", "fused", "out_proj")  # fused: --kernel fused's one pass
PASSES = (*COMPUTE, *COLLECTIVES, "total", "host")  # host: time for the call to return (work queued)
# --backward adds the training step's own passes (attention, bwd_*): shown after these, in the order timed


def is_compute(name: str) -> bool:
    """A pass that computes (every timed pass but the collectives and the whole call's times)."""
    return name not in COLLECTIVES and name not in ("total", "host")


def versions() -> dict:
    v = {"tpattn": __version__, "python": platform.python_version(), "torch": torch.__version__,
         "cuda": torch.version.cuda}
    if "cupy" in sys.modules:
        v["cupy"] = sys.modules["cupy"].__version__
    if "mpi4py" in sys.modules:
        v["mpi4py"] = sys.modules["mpi4py"].__version__
        try:
            from mpi4py import MPI
            # Open MPI's string holds a NUL byte: it made every .md written from it a "binary file"
            v["mpi"] = MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()
        except Exception:  # noqa: BLE001 - informational only
            pass
    if torch.cuda.is_available():
        try:
            v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            pass
    return v


def bus_bandwidth(nbytes: int, ms: float, world: int, kind: str = "allreduce") -> tuple[float, float]:
    """(algbw, busbw) in GB/s by the nccl-tests convention: busbw = algbw * 2(n-1)/n for an
    all-reduce (the one-shot one too), algbw * (n-1)/n for an all-gather or reduce-scatter (nbytes: the
    whole tensor), and
    for the peer reduce-gather, a reduce-scatter of the partials and an all-gather of the output in
    one (nbytes: both tensors)."""
    if ms <= 0 or world < 2:
        return 0.0, 0.0
    algbw = nbytes / (ms * 1e-3) / 1e9
    if kind.startswith("ring"):  # peer to peer: what one rank sends (the ring's weight sums come here as all-reduces)
        return algbw, algbw
    return algbw, algbw * (2 if kind in ("allreduce", "oneshot") else 1) * (world - 1) / world


def last_rank_ms(per_rank: list[list[float]]) -> float:
    """The last rank to arrive at a collective, call by call: in each timed call the minimum over the
    ranks (the others also wait for it, so its time is the transfer's), then the median over the
    calls. Which rank waits changes from call to call, so a rank's own median can hold waits."""
    return statistics.median(min(call) for call in zip(*per_rank))


def collective_stats(stats: dict, nbytes: dict, world: int, dtype: dict, samples: dict | None = None,
                     worlds: dict | None = None) -> dict:
    """Per collective: bytes, the median over ranks and the last-arriving rank's time (last_rank_ms
    from every rank's per-call samples, {name: [per rank [ms per call]]}; without them the smallest
    of the ranks' medians), and bandwidths (over `world` ranks, or worlds[name] for a collective of
    a subgroup: the K/V copies')."""
    out = {}
    for name, n in nbytes.items():
        ranks = (worlds or {}).get(name, world)
        s = stats.get(name, {})
        per_rank = (samples or {}).get(name)
        med = s.get("median", 0.0)
        by_call = bool(per_rank) and all(per_rank) and len({len(r) for r in per_rank}) == 1
        last = last_rank_ms(per_rank) if by_call else s.get("min", 0.0)
        kind = name.removeprefix("bwd_")  # a backward collective: the forward's kind (the copies': all-reduces)
        kind = "allreduce" if kind.startswith(("copies", "ring_weights")) else kind
        algbw, busbw = bus_bandwidth(n, med, ranks, kind)
        _, busbw_last = bus_bandwidth(n, last, ranks, kind)
        out[name] = {"bytes": n, "dtype": dtype[name], "ranks": ranks, "median_ms": med, "last_rank_ms": last,
                     "last_rank_from": "calls" if by_call else "rank medians",
                     "algbw_GBps": algbw, "busbw_GBps": busbw, "busbw_last_rank_GBps": busbw_last}
    return out


def exposure(rank_reports: list[dict]) -> dict | None:
    """Communication the layer waits for: per rank, total - the compute passes (clamped at 0),
    against the collectives' own time; the median over ranks. None without per-pass times."""
    exposed, comm = [], []
    for r in rank_reports:
        p = r["passes"]
        if "total" not in p or not any(is_compute(c) for c in p):
            return None
        coll = sum(p[c]["median"] for c in COLLECTIVES if c in p)
        if not coll:
            return None
        busy = sum(s["median"] for c, s in p.items() if is_compute(c))
        exposed.append(max(0.0, p["total"]["median"] - busy))
        comm.append(coll)
    e, c = statistics.median(exposed), statistics.median(comm)
    return {"exposed_ms": e, "collectives_ms": c, "hidden_share": max(0.0, min(1.0, 1 - e / c)) if c else 0.0}


def exposure_line(e: dict, overlap: int, context_parallel: int = 1) -> str:
    """What the call waits for beyond its compute passes. Only --overlap K > 1 can hide a head-parallel
    collective behind compute; without it the collectives run in line and what is outside the
    compute passes is the collectives plus the host's launches and waits between passes. The ring
    (--context-parallel) posts each pass before its block's attention: its timed passes are the
    posting and the wait the compute left, not the transfer."""
    c, x = e["collectives_ms"], e["exposed_ms"]
    head = f"communication: {c:.3f} ms of collectives; the call spends {x:.3f} ms outside its compute passes"
    if overlap <= 1:
        rest = f"; {x - c:.3f} ms of it launches and waits" if x > c else ""
        if context_parallel > 1:
            return (f"{head} (the ring's passes travel behind the blocks' attention, their times the posting and "
                    f"the wait left after it; the other collectives run in line{rest})")
        return f"{head} (no --overlap: the collectives run in line, none hidden{rest})"
    if x >= c:
        return f"{head} (--overlap {overlap}: none of the collectives hidden behind compute)"
    return f"{head} (--overlap {overlap}: about {100 * e['hidden_share']:.0f}% of the collectives hidden behind compute)"


def balance(rank_reports: list[dict], heads: list[int]) -> dict | None:
    """The load across ranks: each rank's compute (the sum of its compute passes' medians), the
    slowest rank, and the imbalance max/mean of it beside max/mean of the heads (what an uneven
    split predicts: the layer waits for the slowest rank at the collective). None without per-pass
    times (a CUDA graph) or with one rank."""
    if len(rank_reports) < 2:
        return None
    compute = [sum(s["median"] for c, s in r["passes"].items() if is_compute(c)) for r in rank_reports]
    if not all(compute):
        return None
    mean = statistics.fmean(compute)
    slowest = max(range(len(compute)), key=compute.__getitem__)
    return {"compute_ms_by_rank": compute, "slowest_rank": slowest, "slowest_heads": heads[slowest],
            "max_ms": compute[slowest], "mean_ms": mean, "max_over_mean": compute[slowest] / mean,
            "heads_max_over_mean": max(heads) / statistics.fmean(heads)}


def across_ranks(rank_reports: list[dict]) -> dict:
    """Per pass: min, median and max over ranks of each rank's median over iterations."""
    out = {}
    extra = [p for r in rank_reports for p in r["passes"] if p not in PASSES]
    for p in (*PASSES, *dict.fromkeys(extra)):
        meds = [r["passes"][p]["median"] for r in rank_reports if p in r["passes"]]
        if meds:
            out[p] = {"min": min(meds), "median": statistics.median(meds), "max": max(meds)}
    return out


def build(cfg, proc, device, rank_reports: list[dict], collective_bytes: dict, checks: dict,
          verdict: str, command: list[str]) -> dict:
    world = proc.world
    stats = across_ranks(rank_reports)
    model = cfg.storage
    part = "fp32" if cfg.reduce_dtype == "fp32" else model
    dtypes = {"allreduce": part, "allgather": model, "reducescatter": part, "peer": f"{part} in, {model} out",
              "oneshot": f"{part} in, {model} out",
              "bwd_allreduce": model, "bwd_allgather": model, "bwd_reducescatter": model,  # dX, dy, dX
              "bwd_copies": "fp32", "bwd_copies_bias": "fp32"}  # the K/V copies' gradients, summed in fp32
    samples = {k: [r.get("collective_samples", {}).get(k, []) for r in rank_reports] for k in collective_bytes}
    G = cfg.kv_heads or cfg.heads
    copies = {k: world // G for k in ("bwd_copies", "bwd_copies_bias")} if kv_replicated(cfg.heads, G, world) else {}
    C = cfg.context_parallel
    if C > 1:  # the ring's among its C ranks, the heads' sums among the W / C ranks of a heads' group
        copies = {k: C if k.startswith(("ring", "bwd_ring")) else world // C for k in collective_bytes}
        dtypes |= {"ring": model, "bwd_ring": model, "bwd_ring_grads": "fp32", "bwd_ring_weights": "fp32"}
    colls = collective_stats(stats, collective_bytes, world, dtypes, samples, copies) if proc.distributed else {}
    heads = [heads_per_rank(cfg, world, r) for r in range(world)]  # rank 0 holds the most
    h = heads[0]
    g = kv_heads_per_rank(cfg, world)
    T = heads_world(cfg, world)[0]  # the ranks the heads split over (W / C with a ring)
    kv_layout = "one per query head" if G == cfg.heads else ("replicated" if kv_replicated(cfg.heads, G, T)
                                                             else "split")
    sp = scores_bytes(cfg, world)
    kvb = kv_bytes(cfg, world)
    sp_all = sum(scores_bytes(cfg, world, r) for r in range(world))
    kvb_all = sum(kv_bytes(cfg, world, r) for r in range(world))
    style = "sequence-parallel" if cfg.sequence_parallel else \
        f"context-parallel (rings of {C} ranks, heads over {world // C})" if C > 1 else "head-parallel"
    if world > 1:  # the collectives one call runs, in order
        style += " (" + " + ".join(COLLECTIVES[k] for k in collective_bytes) + ")"
    return {
        "tpattn": __version__,
        "command": command,
        "verdict": verdict,
        "notes": cfg.notes,
        "config": {**cfg.fingerprint(), "model_dim": cfg.model_dim, "heads_per_rank": h, "kv_heads_per_rank": g,
                   "heads_by_rank": heads, "uneven": min(heads) != max(heads),
                   "kv_layout": kv_layout, "style": style},
        "world": {"size": world, "launcher": proc.launcher, "backend": cfg.dist_backend if proc.distributed
                  else "none", "device": str(device.type),
                  "ranks": [r["info"] for r in rank_reports]},
        "versions": versions(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},  # rank 0's NCCL settings
        # per rank: rank 0's (with --uneven-heads the largest); totals: the sum over ranks
        "memory": {"S_bytes_per_rank": sp, "P_bytes_per_rank": sp, "S_P_bytes_total": 2 * sp_all,
                   "K_V_bytes_per_rank": kvb, "K_V_bytes_total": kvb_all,
                   # the pre-flight's estimate (rank 0's) and what each rank's allocator held at most (before the checks)
                   "estimate_bytes_per_rank": estimate(cfg, world, 0),
                   "peak_bytes_by_rank": [r["info"].get("peak_bytes") for r in rank_reports]},
        "iterations": {"warmup": cfg.warmup, "timed": cfg.iters},
        "passes": stats,
        "rank0_passes": rank_reports[0]["passes"],
        "per_rank_passes": [r["passes"] for r in rank_reports],
        # the first collective's numbers under the old key (head-parallel: the all-reduce)
        "allreduce": colls.get("allreduce") or colls.get("reducescatter") or colls.get("peer") or colls.get("oneshot") or
                     {"bytes": collective_bytes.get("allreduce", 0), "dtype": dtypes["allreduce"], "median_ms": 0.0,
                      "algbw_GBps": 0.0, "busbw_GBps": 0.0},
        "collectives": colls,
        "exposure": exposure(rank_reports) if proc.distributed else None,
        "balance": balance(rank_reports, heads) if proc.distributed else None,
        "checks": checks,
    }


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _heads(span: str) -> str:
    """'2-3' -> 'heads 2-3', '1-1' -> 'head 1'."""
    a, _, b = span.partition("-")
    return f"head {a}" if a == b else f"heads {span}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def text(rep: dict) -> str:
    c, w = rep["config"], rep["world"]
    lines = [f"tpattn {rep['tpattn']}: {w['size']} rank(s) via {w['launcher']}, backend {w['backend']}, "
             f"kernel {c['kernel']} on {w['device']}"]
    lines += [f"note: {n}" for n in rep["notes"]]
    G = c.get("kv_heads") or c["heads"]
    gqa = G != c["heads"]
    by_rank = c.get("heads_by_rank") or [c["heads_per_rank"]] * w["size"]
    uneven = min(by_rank) != max(by_rank)
    per_rank = f"{max(by_rank)} or {min(by_rank)} (uneven)" if uneven else f"{c['heads_per_rank']}"
    lines.append(f"config: B={c['batch']} N={c['seq_len']} H={c['heads']}" + (f" G={G}" if gqa else "")
                 + f" d={c['head_dim']} D={c['model_dim']} dtype={c['dtype']} causal={c['causal']} "
                 f"heads/rank={per_rank}" + (f" kv-heads/rank={c['kv_heads_per_rank']}" if gqa else "")
                 + f" reduce={c['reduce_dtype']} seed={c['seed']}")
    if uneven:
        if gqa:  # whole K/V groups: a K/V head and its H/G query heads
            what = describe_blocks([n // (c["heads"] // G) for n in by_rank], "K/V groups",
                                   (f" ({max(by_rank)} query heads)", f" ({min(by_rank)})"))
        else:
            what = describe_blocks(by_rank, "heads")
        lines.append(f"uneven heads: {what}; the layer waits at the collective for the slowest rank (heads max/mean "
                     f"{max(by_rank) / (sum(by_rank) / len(by_rank)):.3f})")
    if gqa:  # over the heads' ranks: the world, or with a ring of C its W / C (each holding N / C rows)
        C = c.get("context_parallel", 1)
        T = w["size"] // C
        lines.append(f"K/V heads: {G} for {c['heads']} query heads ({c['heads'] // G} each), {c['kv_layout']} over "
                     f"{T} rank(s)" + (f": each K/V head held by {T // G} ranks" if c["kv_layout"] == "replicated"
                                       else "")
                     + (f" (each of the {C} ranks of a ring holds {c['seq_len'] // C} of its {c['seq_len']} rows)"
                        if C > 1 else ""))
    lines.append(f"style: {c['style']}, overlap {c['overlap']} chunk(s)"
                 + (", CUDA graph (total time only)" if c["cuda_graph"] else ""))
    bal = rep.get("balance")
    for r in w["ranks"]:
        i = r["rank"]
        lines.append(f"  rank {i}: host {r['host']} {r['device']} ({r['device_name']}) heads {r['heads']}"
                     + (f" ({by_rank[i]})" if uneven and i < len(by_rank) else "")
                     + (f", K/V {_heads(r['kv_heads'])}" if gqa and "kv_heads" in r else "")
                     + (f", compute {bal['compute_ms_by_rank'][i]:.3f} ms" if bal else ""))
    m = rep["memory"]
    where = "on rank 0 (the largest)" if uneven else "per rank"
    if m["S_bytes_per_rank"]:
        lines.append(f"S and P: {_mib(m['S_bytes_per_rank'])} each {where}, {_mib(m['S_P_bytes_total'])} in all ranks")
    else:
        lines.append("S and P: never in device memory (fused kernel)")
    if "K_V_bytes_per_rank" in m:
        lines.append(f"K and V: {_mib(m['K_V_bytes_per_rank'])} {where} ({c['kv_heads_per_rank']} K/V head(s)), "
                     f"{_mib(m['K_V_bytes_total'])} in all ranks")
    peaks = [p for p in m.get("peak_bytes_by_rank") or [] if p is not None]
    if peaks:
        lines.append(f"device memory: peak allocated {_gib(max(peaks))} (the most of any rank, before the checks); "
                     f"pre-flight estimate {_gib(m['estimate_bytes_per_rank'])} on rank 0")
    if w["size"] == 1:
        lines.append(f"per pass, ms over {rep['iterations']['timed']} iterations ({rep['iterations']['warmup']} warm-up):")
        col = max(10, *(len(p) + 1 for p in rep["rank0_passes"]))
        lines.append(f"  {'pass':<{col}}{'median':>10}{'min':>10}{'max':>10}")
        for p, s in rep["rank0_passes"].items():
            lines.append(f"  {p:<{col}}{s['median']:>10.3f}{s['min']:>10.3f}{s['max']:>10.3f}")
    else:
        lines.append(f"per pass, ms: each rank's median over {rep['iterations']['timed']} iterations, "
                     "then min / median / max over ranks:")
        col = max(10, *(len(p) + 1 for p in rep["passes"]))
        lines.append(f"  {'pass':<{col}}{'min':>10}{'median':>10}{'max':>10}")
        for p, s in rep["passes"].items():
            lines.append(f"  {p:<{col}}{s['min']:>10.3f}{s['median']:>10.3f}{s['max']:>10.3f}")
        for name, a in rep.get("collectives", {}).items():
            if not a["median_ms"]:  # a CUDA graph: no per-pass times
                continue
            among = f" among {a['ranks']} ranks" if a.get("ranks", rep["world"]["size"]) != rep["world"]["size"] else ""
            if name in RING_PASSES:  # posted before the block's attention: its time is no transfer's
                lines.append(f"{COLLECTIVES[name]}{among}: {_mib(a['bytes'])} of {a['dtype']} a call, {a['median_ms']:.3f} "
                             "ms median over ranks posting the passes and waiting for what the attention did not "
                             "hide (no bandwidth from it: the transfers run behind the compute)")
                continue
            lines.append(f"{COLLECTIVES[name]}{among}: {_mib(a['bytes'])} of {a['dtype']}, {a['median_ms']:.3f} ms median over "
                         f"ranks (busbw {a['busbw_GBps']:.1f} GB/s); {a['last_rank_ms']:.3f} ms on the last rank to "
                         f"arrive{', call by call' if a.get('last_rank_from') == 'calls' else ''} (busbw "
                         f"{a['busbw_last_rank_GBps']:.1f} GB/s), the others also wait for it")
        if bal:
            lines.append(f"balance: compute per rank (the sum of its compute passes' medians) {bal['mean_ms']:.3f} ms "
                         f"mean, slowest rank {bal['slowest_rank']} ({bal['slowest_heads']} heads) "
                         f"{bal['max_ms']:.3f} ms: imbalance max/mean {bal['max_over_mean']:.3f} "
                         f"(heads max/mean {bal['heads_max_over_mean']:.3f})")
        e = rep.get("exposure")
        if e:
            lines.append(exposure_line(e, rep["config"].get("overlap", 1), rep["config"].get("context_parallel", 1)))
    for name, ch in rep["checks"].items():
        err = (f"rms err {ch['rel_err'] * ch['rms_ref']:.3g} = {ch['rel_err']:.3g} x rms (max err {ch['max_abs_err']:.3g})"
               if ch.get("metric") == "rms" else f"max err {ch['max_abs_err']:.3g} = {ch['rel_err']:.3g} x rms")
        lines.append(f"check {name}: {err} (tol {ch['tol']:g}{' + eps*|y| each' if ch.get('ulp_allowed') else ''}) "
                     f"{'PASS' if ch['pass'] else 'FAIL'}{'  ' + ch['what'] if 'what' in ch else ''}")
    lines.append(f"RESULT: {rep['verdict']}")
    return "\n".join(lines)
