"""The run's report: stats across ranks, the all-reduce's bandwidth, a table and JSON."""

from __future__ import annotations

import platform
import statistics
import sys

import torch

from . import __version__
from .memory import scores_bytes

PASSES = ("qkv_proj", "qk", "softmax", "pv", "fused", "out_proj", "allreduce", "total")  # fused: --kernel fused's one pass


def versions() -> dict:
    v = {"tpattn": __version__, "python": platform.python_version(), "torch": torch.__version__,
         "cuda": torch.version.cuda}
    if "cupy" in sys.modules:
        v["cupy"] = sys.modules["cupy"].__version__
    if "mpi4py" in sys.modules:
        v["mpi4py"] = sys.modules["mpi4py"].__version__
        try:
            from mpi4py import MPI
            v["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
        except Exception:  # noqa: BLE001 - informational only
            pass
    if torch.cuda.is_available():
        try:
            v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            pass
    return v


def bus_bandwidth(nbytes: int, ms: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s by the nccl-tests convention: busbw = algbw * 2(n-1)/n."""
    if ms <= 0 or world < 2:
        return 0.0, 0.0
    algbw = nbytes / (ms * 1e-3) / 1e9
    return algbw, algbw * 2 * (world - 1) / world


def across_ranks(rank_reports: list[dict]) -> dict:
    """Per pass: min, median and max over ranks of each rank's median over iterations."""
    out = {}
    for p in PASSES:
        meds = [r["passes"][p]["median"] for r in rank_reports if p in r["passes"]]
        if meds:
            out[p] = {"min": min(meds), "median": statistics.median(meds), "max": max(meds)}
    return out


def build(cfg, proc, device, rank_reports: list[dict], allreduce_bytes: int, checks: dict,
          verdict: str, command: list[str]) -> dict:
    world = proc.world
    stats = across_ranks(rank_reports)
    ar = stats.get("allreduce", {}).get("median", 0.0)
    algbw, busbw = bus_bandwidth(allreduce_bytes, ar, world)
    h = cfg.heads // world
    sp = scores_bytes(cfg, world)
    return {
        "tpattn": __version__,
        "command": command,
        "verdict": verdict,
        "notes": cfg.notes,
        "config": {**cfg.fingerprint(), "model_dim": cfg.model_dim, "heads_per_rank": h},
        "world": {"size": world, "launcher": proc.launcher, "backend": cfg.dist_backend if proc.distributed
                  else "none", "device": str(device.type),
                  "ranks": [r["info"] for r in rank_reports]},
        "versions": versions(),
        "memory": {"S_bytes_per_rank": sp, "P_bytes_per_rank": sp, "S_P_bytes_total": 2 * sp * world},
        "iterations": {"warmup": cfg.warmup, "timed": cfg.iters},
        "passes": stats,
        "rank0_passes": rank_reports[0]["passes"],
        "per_rank_passes": [r["passes"] for r in rank_reports],
        "allreduce": {"bytes": allreduce_bytes, "dtype": "fp32" if cfg.reduce_dtype == "fp32" else cfg.dtype,
                      "median_ms": ar, "algbw_GBps": algbw, "busbw_GBps": busbw},
        "checks": checks,
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def text(rep: dict) -> str:
    c, w = rep["config"], rep["world"]
    lines = [f"tpattn {rep['tpattn']}: {w['size']} rank(s) via {w['launcher']}, backend {w['backend']}, "
             f"kernel {c['kernel']} on {w['device']}"]
    lines += [f"note: {n}" for n in rep["notes"]]
    lines.append(f"config: B={c['batch']} N={c['seq_len']} H={c['heads']} d={c['head_dim']} D={c['model_dim']} "
                 f"dtype={c['dtype']} causal={c['causal']} heads/rank={c['heads_per_rank']} "
                 f"reduce={c['reduce_dtype']} seed={c['seed']}")
    for r in w["ranks"]:
        lines.append(f"  rank {r['rank']}: host {r['host']} {r['device']} ({r['device_name']}) heads {r['heads']}")
    m = rep["memory"]
    if m["S_bytes_per_rank"]:
        lines.append(f"S and P: {_mib(m['S_bytes_per_rank'])} each per rank, {_mib(m['S_P_bytes_total'])} in all ranks")
    else:
        lines.append("S and P: never in device memory (fused kernel)")
    if w["size"] == 1:
        lines.append(f"per pass, ms over {rep['iterations']['timed']} iterations ({rep['iterations']['warmup']} warm-up):")
        lines.append(f"  {'pass':<10}{'median':>10}{'min':>10}{'max':>10}")
        for p, s in rep["rank0_passes"].items():
            lines.append(f"  {p:<10}{s['median']:>10.3f}{s['min']:>10.3f}{s['max']:>10.3f}")
    else:
        lines.append(f"per pass, ms: each rank's median over {rep['iterations']['timed']} iterations, "
                     "then min / median / max over ranks:")
        lines.append(f"  {'pass':<10}{'min':>10}{'median':>10}{'max':>10}")
        for p, s in rep["passes"].items():
            lines.append(f"  {p:<10}{s['min']:>10.3f}{s['median']:>10.3f}{s['max']:>10.3f}")
        a = rep["allreduce"]
        lines.append(f"all-reduce: {_mib(a['bytes'])} of {a['dtype']} partials, {a['median_ms']:.3f} ms, "
                     f"algbw {a['algbw_GBps']:.2f} GB/s, busbw {a['busbw_GBps']:.2f} GB/s")
    for name, ch in rep["checks"].items():
        lines.append(f"check {name}: max err {ch['max_abs_err']:.3g} = {ch['rel_err']:.3g} x rms "
                     f"(tol {ch['tol']:g}) {'PASS' if ch['pass'] else 'FAIL'}{'  ' + ch['what'] if 'what' in ch else ''}")
    lines.append(f"RESULT: {rep['verdict']}")
    return "\n".join(lines)
