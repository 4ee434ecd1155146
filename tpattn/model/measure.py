"""Measuring the layer and the links on a GPU: the timing that --calibrate (tpattn/model/calibrate.py)
and scripts/model/validate_model.py share, so that the model is fitted and judged on the same numbers.
They also run on CPU, gloo and the torch reference standing in for every kernel, when
TPATTN_PLAN_ALLOW_CPU=1: a smoke test of the whole flow for CI; the numbers mean nothing."""

from __future__ import annotations

import os
import statistics
import time

from .errors import PlanError
from .steps import COLLECTIVE_NAMES

MiB = 2**20
COLLECTIVE_SIZES = [8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB, 128 * MiB, 256 * MiB]
CPU_SMOKE = "TPATTN_PLAN_ALLOW_CPU"


def host_load() -> dict | None:
    """A snapshot of what competes with this process for the CPU, for host_load_between: /proc/stat's
    jiffies (all CPUs; and the CPUs this process may run on: their steal time is what the hypervisor
    of a virtual machine gave to others) and this process's involuntary context switches (another
    thread or process took its CPU). None where /proc/stat is not there (not Linux)."""
    import resource
    try:
        with open("/proc/stat") as f:
            lines = [ln.split() for ln in f if ln.startswith("cpu")]
    except OSError:
        return None
    mine = {f"cpu{c}" for c in os.sched_getaffinity(0)} if hasattr(os, "sched_getaffinity") else set()
    # fields: user nice system idle iowait irq softirq steal ...
    every = [int(v) for v in lines[0][1:9]]
    own = [sum(int(ln[i]) for ln in lines[1:] if ln[0] in mine) for i in range(1, 9)]
    return {"all": every, "own": own, "nivcsw": resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw}


def host_load_between(a: dict | None, b: dict | None) -> dict | None:
    """Between two host_load snapshots: "busy_pct" (every CPU of the machine not idle, this process
    included), "steal_pct" (of the time of the CPUs this process may run on, given to other virtual
    machines) and "preempted" (this process's involuntary context switches)."""
    if not a or not b:
        return None

    def pct(part: int, whole: int) -> float:
        return round(100.0 * part / whole, 2) if whole > 0 else 0.0
    d_all = [y - x for x, y in zip(a["all"], b["all"])]
    d_own = [y - x for x, y in zip(a["own"], b["own"])]
    return {"busy_pct": pct(sum(d_all) - d_all[3] - d_all[4], sum(d_all)), "steal_pct": pct(d_own[7], sum(d_own)),
            "preempted": b["nivcsw"] - a["nivcsw"]}


def rank_loads(loads: list[dict | None]) -> dict | None:
    """Every rank's host_load_between over one measurement, as one: the machine's busy %, the most
    steal % and the most involuntary switches of any rank."""
    loads = [x for x in loads if x]
    if not loads:
        return None
    return {"busy_pct": max(x["busy_pct"] for x in loads), "steal_pct": max(x["steal_pct"] for x in loads),
            "preempted": max(x["preempted"] for x in loads)}


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def events_ms(fn, warmup: int, iters: int, device=None) -> float:
    """Median over iters of fn() between two CUDA events (on CPU: the clock), after warmup calls."""
    import torch
    cuda = device is None or torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def backend_for(kernel: str, device) -> str:
    """The backend that runs `kernel` here: itself on a GPU, the torch reference on CPU (smoke test)."""
    return kernel if device.type == "cuda" else "reference"


def build_layer(h: int, heads: int, head_dim: int, kernel: str, causal: bool, device, dtype="fp16", group=None,
                reduce_dtype: str = "fp32", seed: int = 0, uneven: bool = False, kv_heads: int | None = None,
                alone: bool = False):
    """A layer whose rank holds h of `heads` query heads: with group=None the compute of one rank of an
    (heads/h)-way layer, without its collective; with a group of W ranks, this rank's heads of the
    W-way layer (h is not used: H/W, or with uneven (--uneven-heads) its ceil/floor block; with
    kv_heads, of G K/V heads); with alone=True, those very heads and weights as a layer of one rank
    (no collective: the W-rank layer's call without its communication)."""
    import torch

    from ..layer import TensorParallelAttention
    from ..sharding import head_range, kv_head_range
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    backend = backend_for(kernel, device)
    if group is not None:
        import torch.distributed as dist
        W, r = dist.get_world_size(group), dist.get_rank(group)
        G = heads if kv_heads is None else kv_heads
        rng = head_range(heads, W, r, uneven, G)
        kv_rng = kv_head_range(heads, G, W, r, uneven) if G != heads else None
        w = _weights(rng, heads, head_dim, seed, dt, device, kv_rng)
        if alone:
            return TensorParallelAttention(**w, heads=len(rng), head_dim=head_dim, backend=backend, causal=causal,
                                           group=None, reduce_dtype=reduce_dtype,
                                           kv_heads=len(kv_rng) if kv_rng is not None else None)
        extra = {k: v for k, v in (("uneven_heads", uneven), ("kv_heads", kv_heads)) if v}
        return TensorParallelAttention(**w, heads=heads, head_dim=head_dim, backend=backend, causal=causal,
                                       group=group, reduce_dtype=reduce_dtype, **extra)
    w = _weights(range(h), heads, head_dim, seed, dt, device)
    return TensorParallelAttention(**w, heads=h, head_dim=head_dim, backend=backend, causal=causal, group=None,
                                   reduce_dtype=reduce_dtype)


_weight_cache: dict = {}


def _weights(rng: range, heads: int, head_dim: int, seed: int, dt, device, kv_rng: range | None = None) -> dict:
    """head_weights, generated once per set of heads (they are made on the CPU: seconds at D = 4096)."""
    from ..weights import head_weights
    kv = None if kv_rng is None else (kv_rng.start, kv_rng.stop)
    key = (rng.start, rng.stop, kv, heads, head_dim, seed, str(dt), str(device))
    if key not in _weight_cache:
        _weight_cache.clear()  # one set at a time: a few hundred MiB of device memory each
        _weight_cache[key] = (head_weights(rng, heads, head_dim, seed, dt, device) if kv_rng is None
                              else head_weights(rng, heads, head_dim, seed, dt, device, kv_heads=kv_rng))
    return _weight_cache[key]


# Per-pass timing queues the calls behind a GPU spin (as bare_collective_ms does): when the call is
# host-bound, the GPU otherwise waits for the host's launches and an event pair around a pass (or an
# in-layer collective, whose ranks arrive apart) measures those gaps, while the model predicts GPU time.
SPIN_MIN_MS = 2.0          # at least this much spin before the per-pass call ...
SPIN_HOST_FACTOR = 1.5     # ... or this many times the host time of the un-spun call, if longer
_SLEEP_CYCLES_PER_CALL = 200_000   # ~0.1 ms of GPU spin per queued call (clock64 cycles at ~2 GHz)
_SLEEP_CYCLES_PER_MS = _SLEEP_CYCLES_PER_CALL * 10


def spin_ahead(device, ms: float, group=None) -> bool:
    """Before a timed call: a barrier over `group` (a multi-rank layer's: every rank's spin starts
    together, so its collectives measure the transfer, not the ranks' arrival skew), then on a GPU a
    spin kernel of about `ms` (torch.cuda._sleep), so that the launches that follow are all queued
    before the GPU reaches them. Returns whether it spun (not on CPU, nor without torch.cuda._sleep)."""
    import torch
    cuda = torch.device(device).type == "cuda"
    if group is not None:
        from ..comm import barrier
        barrier(group, device)
    spin = getattr(torch.cuda, "_sleep", None) if cuda else None
    if spin is None:
        return False
    spin(int(ms * _SLEEP_CYCLES_PER_MS))
    return True


def spin_ms_for(host_ms: float) -> float:
    """The spin that covers the host's launch time of one call (host_ms: the un-spun call's)."""
    return max(SPIN_MIN_MS, SPIN_HOST_FACTOR * host_ms)


def call_stall(p: dict) -> float:
    """The stall of an eager call as time_layer measured it: its end to end beyond both its host time
    and its GPU time (the GPU waiting for the first launch, ranks waiting for each other), ms."""
    return max(0.0, p["total"] - max(p["host"], p["gpu"]))


def time_layer(layer, x, warmup: int, iters: int, raw: dict | None = None) -> dict[str, float]:
    """The layer as --calibrate and scripts/model/validate_model.py time it (this one function):
    - `iters` calls as python -m tpattn times them, un-spun, back to back (each after the previous
      one's end): "total" (CUDA events around it: what users see) and "host" (until it returns);
    - then `iters` calls with a timer around every pass, each queued behind spin_ahead (a barrier over
      the layer's group when it has several ranks, then a GPU spin of spin_ms_for(host)), so each
      event pair measures GPU time only; "gpu": that whole call's GPU time.
    Not interleaved: an un-spun call that follows an instrumented one (its barrier, spin and event
    pairs) took up to twice the host time of one that follows another un-spun call, in the same
    process (scripts/model/host_probe.py on the lent H200s: 0.76 against 0.35 ms). Medians over the
    iterations, ms (raw: filled with every sample, in order). Under torch.no_grad, as the CLI calls it."""
    import torch
    with torch.no_grad():
        return _time_layer(layer, x, warmup, iters, raw)


def _time_layer(layer, x, warmup: int, iters: int, raw: dict | None) -> dict[str, float]:
    from ..timing import Timer, recording
    timer = Timer(x.device)
    group = getattr(layer, "group", None) if getattr(layer, "world", 1) > 1 else None
    for _ in range(warmup):
        layer(x)
    _sync(x.device)
    samples: dict[str, list[float]] = {}
    for _ in range(iters):
        with timer.section("total"):
            t0 = time.perf_counter()
            layer(x)
            host = (time.perf_counter() - t0) * 1e3
        for k, v in {**timer.collect(), "host": host}.items():
            samples.setdefault(k, []).append(v)
    spin = spin_ms_for(statistics.median(samples["host"])) if iters else SPIN_MIN_MS
    for _ in range(iters):
        spin_ahead(x.device, spin, group)
        with timer.section("gpu"):
            with recording(timer):
                layer(x)
        for k, v in timer.collect().items():
            samples.setdefault(k, []).append(v)
    if raw is not None:
        raw.update(samples)
    return {k: statistics.median(v) for k, v in samples.items()}


def quiet_host_ms(by_round: list[float]) -> float:
    """The host time of a call measured in rounds (each the median of that round's calls), as the
    machine file keeps it (layer.host_ms_by_world): the quietest round's. Another process on the host
    only ever adds to a Python call's host time, never takes from it, and on the lent H200s it came
    and went over seconds: in one calibration the 2-rank fused call's rounds were 0.38 to 0.75 ms,
    and the median over them (0.65) predicted the host-bound rows of the validation minutes later
    17-47 % too slow, where their host time was 0.40-0.50 (benchmarks/model_validation_run8.md). The
    model predicts the host of a quiet machine; a measurement on a busy one is slower than it."""
    return min(by_round)


def combine_rounds(rounds: list[dict[str, float]]) -> dict[str, float]:
    """One measurement from several rounds of the same one (each {name: ms}): per name the median over
    the rounds that have it. --calibrate's W-rank layer and scripts/model/validate_model.py both use it."""
    names = dict.fromkeys(k for r in rounds for k in r)
    return {k: statistics.median(r[k] for r in rounds if k in r) for k in names}


def combine_layer_rounds(rounds: list[dict]) -> dict:
    """One measurement of a layer from several rounds of it, as --calibrate and scripts/model/validate_model.py
    both combine them. Each round: {"passes": {name: ms} (already reduced over the ranks), and for
    several ranks "samples_by_rank": [rank]{name: [ms per call]}}. Returns:
    - "passes": per name the median over the rounds (combine_rounds), but a collective from every
      round's calls together: call by call the last rank to arrive, then the median
      (tpattn.report.last_rank_ms);
    - "samples_by_rank": those calls, pooled (None with one rank);
    - "stall_ms": the stall per round (call_stall: quantities of one and the same call), then the median;
    - "rounds": each round's total, host and gpu (and "host_load", where the round has it: what
      competed for the CPU meanwhile, host_load_between)."""
    from ..report import last_rank_ms
    passes = combine_rounds([r["passes"] for r in rounds])
    samples = None
    if rounds[0].get("samples_by_rank"):
        samples = pool_rank_samples([r["samples_by_rank"] for r in rounds])
        for k in samples[0]:
            if k in COLLECTIVE_NAMES:
                passes[k] = last_rank_ms([r[k] for r in samples])
    full = [r["passes"] for r in rounds if {"total", "host", "gpu"} <= set(r["passes"])]
    return {"passes": passes, "samples_by_rank": samples,
            **({"stall_ms": statistics.median(call_stall(p) for p in full)} if full else {}),
            "rounds": [{**{k: r["passes"][k] for k in ("total", "host", "gpu") if k in r["passes"]},
                        **({"host_load": r["host_load"]} if r.get("host_load") else {})} for r in rounds]}


def pool_rank_samples(rounds: list[list[dict[str, list[float]]]]) -> list[dict[str, list[float]]]:
    """Every rank's per-call samples of several rounds, round after round: rounds[i][rank][name] is
    round i's list for that rank; returns [rank][name] -> all its calls, in order (so call j of every
    rank stays call j: tpattn.report.last_rank_ms takes the minimum over ranks call by call)."""
    return [{k: [t for r in rounds for t in r[rank][k]] for k in mine} for rank, mine in enumerate(rounds[0])]


def _collective_fns():
    """(torch.distributed, all-gather(out, inp), reduce-scatter(out, inp)): the bare collectives of
    tpattn.comm, the layer's own."""
    import torch.distributed as dist

    from .. import comm
    return dist, comm.bare("allgather"), comm.bare("reducescatter")


# One bare collective, timed the same way by --calibrate (whose alpha-beta fit is made on these
# numbers) and by scripts/model/validate_model.py (which judges the fit against them): same sizes, same
# warm-up, same barrier, same statistic, through this one function.
COLLECTIVE_WARMUP = 2      # samples run and dropped (each `reps` calls: the first calls set up NCCL's buffers)
COLLECTIVE_SAMPLES = 10    # samples timed
COLLECTIVE_REPS = 10       # calls back to back per sample (nccl-tests' convention): time / reps


def bare_collective_ms(kind: str, nbytes: int, device, warmup: int = COLLECTIVE_WARMUP,
                       samples: int = COLLECTIVE_SAMPLES, reps: int = COLLECTIVE_REPS) -> float:
    """ms of one collective of nbytes (the whole tensor, nccl-tests' size) over the default group, as
    --calibrate and validate_model.py both measure it; a collective call: every rank gets the same value.

    Per sample: a barrier; on a GPU a short spin kernel, so that the start event and the `reps` calls
    are all queued behind it before the GPU reaches them (the host's launch time of the calls is not
    inside the interval); the start event; the calls back to back; the end event; (end - start) / reps.
    The ranks leave the barrier apart by the host's jitter; back to back, only the first call waits
    for the late rank, a 1/reps share. Statistic: per sample the slowest rank, then the median over
    the samples. (On CPU, gloo: the clock, no spin.)"""
    import torch
    from .. import comm
    dist, ag, rs = _collective_fns()
    W = dist.get_world_size()
    dt = torch.float16 if kind == "allgather" else torch.float32
    n = nbytes // torch.empty((), dtype=dt).element_size()
    n -= n % W
    whole = torch.zeros(n, dtype=dt, device=device)   # zeros: sums that stay finite over any number of calls
    part = torch.zeros(n // W, dtype=dt, device=device)
    ar = comm.bare("allreduce")
    op = {"allreduce": lambda: ar(whole), "allgather": lambda: ag(whole, part),
          "reducescatter": lambda: rs(part, whole)}[kind]
    cuda = device.type == "cuda"
    spin = getattr(torch.cuda, "_sleep", None) if cuda else None
    ts = []
    for i in range(warmup + samples):
        if cuda:
            comm.barrier(None, device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if spin is not None:
                spin(_SLEEP_CYCLES_PER_CALL * (reps + 2))
            a.record()
            for _ in range(reps):
                op()
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b) / reps
        else:
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                op()
            ms = (time.perf_counter() - t0) * 1e3 / reps
        if i >= warmup:
            ts.append(ms)
    del whole, part
    if cuda:
        torch.cuda.empty_cache()
    every = gather(ts)
    return statistics.median(max(r[j] for r in every) for j in range(samples))


def bare_collectives(sizes, device, kinds=COLLECTIVE_NAMES) -> dict[str, list[tuple[int, float]]]:
    """{kind: [(bytes, ms)]}: bare_collective_ms of each kind (all-reduce, all-gather, reduce-scatter)
    at each size, in that order; the same call in --calibrate and in validate_model.py."""
    return {kind: [(int(nbytes), bare_collective_ms(kind, int(nbytes), device)) for nbytes in sizes]
            for kind in kinds}


# The NVLink link's wake-up: a reduce-scatter after each of these idle times, both ranks in step
WAKE_IDLE_MS = (1, 10, 20, 30, 40, 50, 60, 80, 120, 160)
WAKE_BYTES = 32 * MiB
WAKE_CALLS = 5


def timed_after(op, before, calls: int, device) -> tuple[list[float], list[float]]:
    """`calls` times: a barrier over the default group, then before() (GPU work queued ahead of op: a
    spin, GEMMs), then op() between CUDA events. ([op ms per call], [before ms per call]), this
    rank's. link_wake and scripts/model/collective_probe.py --idle time a collective after an
    idle link with it."""
    import torch

    from ..comm import barrier
    s, a, b = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    took, waited = [], []
    for _ in range(calls):
        barrier(None, device)
        s.record()
        before()
        a.record()
        op()
        b.record()
        b.synchronize()
        took.append(a.elapsed_time(b))
        waited.append(s.elapsed_time(a))
    return took, waited


def link_wake(device, idles=WAKE_IDLE_MS, nbytes: int = WAKE_BYTES, calls: int = WAKE_CALLS) -> list[tuple]:
    """[(idle ms, reduce-scatter ms, ranks apart us)] for each idle: `calls` times a barrier (its
    all-reduce the last traffic on the link), then on every rank the same GPU spin of about that long
    (SM-idle: the ranks stay in step; its length as timed, the median over the calls, the longest
    rank's), then a reduce-scatter of nbytes fp32 between CUDA events (timed_after); per call the
    last rank to arrive (report.last_rank_ms), and the median spread of the ranks' times (how far
    apart they arrived). A collective call; every rank gets the same list. On the lent H200s the
    reduce-scatter took ~95 us longer after 80 ms than after 1 ms (scripts/model/collective_probe.py
    --idle); tpattn.model.costmodel.fit_link_wake reads the numbers from it."""
    import torch

    from ..report import last_rank_ms
    dist, _, rs = _collective_fns()
    W = dist.get_world_size()
    n = nbytes // 4 - (nbytes // 4) % W
    whole = torch.zeros(n, dtype=torch.float32, device=device)
    part = torch.empty(n // W, dtype=torch.float32, device=device)
    for _ in range(3):
        rs(part, whole)
    mine = [timed_after(lambda: rs(part, whole), lambda: torch.cuda._sleep(int(idle * _SLEEP_CYCLES_PER_MS)),
                        calls, device) for idle in idles]   # cycles: the idle's length in ms is timed
    del whole, part
    torch.cuda.empty_cache()
    every = gather([(took, statistics.median(slept)) for took, slept in mine])
    out = []
    for i in range(len(idles)):
        per_rank = [r[i][0] for r in every]
        out.append((round(max(r[i][1] for r in every), 1), last_rank_ms(per_rank),
                    statistics.median((max(c) - min(c)) * 1e3 for c in zip(*per_rank))))
    return out


def gather(obj) -> list:
    """Every rank's obj on every rank (one rank without a process group: [obj])."""
    from ..comm import gather_objects
    return gather_objects(obj)


def start_ranks(timeout: float = 600.0, what: str = "--calibrate"):
    """(proc, device) for a measurement: launcher discovery, this rank's GPU, and an NCCL process
    group when there are several ranks. One node only: the measurements are of one node."""
    import torch

    from .. import dist as tpdist
    cpu = not torch.cuda.is_available()
    if cpu and os.environ.get(CPU_SMOKE) != "1":
        raise PlanError(f"{what} needs a CUDA GPU and none is visible to torch (torch {torch.__version__}); "
                        "run it on the GPU machine")
    proc = tpdist.discover()
    if proc.world > 1 and proc.local_world != proc.world:
        raise PlanError(f"{proc.world} ranks over several nodes: calibrate one node (its GPUs and NVLink); "
                        "describe the network in the machine file")
    if not cpu and proc.local_world > torch.cuda.device_count():
        raise PlanError(f"{proc.local_world} ranks but {torch.cuda.device_count()} GPU(s): one rank per GPU")
    device = tpdist.pick_device(proc, "cpu" if cpu else "cuda")
    tpdist.rendezvous(proc, timeout)
    if proc.world > 1:
        tpdist.init_process_group(proc, "gloo" if cpu else "nccl", device, timeout)
    return proc, device


def finish_ranks(proc, code: int) -> None:
    import torch.distributed as dist

    from .. import dist as tpdist
    from ..comm import barrier
    if dist.is_available() and dist.is_initialized():
        barrier()
        dist.destroy_process_group()
    if proc.distributed:
        tpdist.exit_now(code)
