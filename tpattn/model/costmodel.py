"""A cost model of the layer: predicted time of every pass, per world size, before it runs.

What one call of the layer does on one rank is written down as a list of steps (layer_steps), the
same passes that tpattn/layer.py runs and its timers name:

    qkv_proj    one GEMM [B*N, D] x [D, 3*h*d] (bias in its epilogue); kernels that need contiguous
                q, k, v (naive, tiled) also copy them out of the GEMM's output inside this pass
    qk, softmax, pv (naive, tiled) or fused      the local attention of h = H/W heads (--uneven-heads:
                rank 0's ceil(H/W), the most any rank holds, which the collective waits for)
    out_proj    one GEMM [B*N, h*d] x [h*d, D]: fp32 partials when W > 1 and --reduce-dtype fp32,
                the model dtype with the bias in its epilogue when W = 1
    the collectives, by the names and bytes of layer.collective_nbytes(B, N)
    other       untimed work in the call: the bias + cast of the summed partials, the copy of o
                into the output GEMM's rows (naive, tiled), and a per-call overhead

A compute step costs its roofline time, max(FLOPs / peak FLOP rate, bytes / memory bandwidth),
divided by an efficiency that calibration measured for that step (kernel pass) on the machine,
interpolated in log(roofline time) between the calibration points (clamped at both ends): naive's
qk runs at ~2 % of the fp32 roofline, tiled's softmax at ~90 % of the memory roofline. A
collective costs the alpha-beta time of NCCL's ring: base + steps x alpha + the bus bytes / bus
bandwidth, where an all-reduce moves 2(W-1)/W of the tensor and takes 2(W-1) steps, an all-gather
or a reduce-scatter (W-1)/W and W-1 steps. Over several nodes the collective is hierarchical:
inside each node over NVLink, across nodes over every GPU's own network link carrying 1/g of the
bytes (g GPUs per node); NCCL pipelines the chunks through both, so the slower phase's bandwidth
term sets the time and every step's latency adds.

The end to end time is max(GPU time, host time) + stall: the sum of the steps plus the per-call
overhead, unless the Python call itself takes longer: its host time, calibrated per kernel and world
size (layer.host_ms_by_world: the W-rank layer's host time as --calibrate measures it, its quietest
round: the host of a quiet machine, which another process only ever slows), or for a
world size not calibrated (and in files without it) the 1-rank host_ms + host_ms_per_collective
each. The stall is the time of an eager call that neither accounts for: the GPU idle until the
call's first launch, and at a collective until the last rank's launch reaches it (layer.stall_ms,
layer.stall_ms_by_world: the un-spun call's end to end minus max(its host time, its GPU time), as
--calibrate measures them; 0 in files without them and under a CUDA graph).

The layer's steps are in tpattn/model/steps.py, the machine files (tpattn/model/machines/*.json or any
path) are read by tpattn/model/machine.py (load_machine; docs/plan.md has the fields). Everything here is pure Python: no GPU needed.
"""


from __future__ import annotations

import dataclasses
import math
import statistics

from .errors import ModelError
from .machine import Machine, roofline_ms
from .steps import COLLECTIVE_NAMES, Shape, Step, backward_steps, layer_steps


def _interp(pts: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through sorted (x, y) points (equal x averaged), clamped at both ends."""
    merged: list[list] = []
    for px, py in pts:
        if merged and abs(merged[-1][0] - px) < 1e-9:
            merged[-1][1].append(py)
        else:
            merged.append([px, [py]])
    xy = [(px, sum(ys) / len(ys)) for px, ys in merged]
    if x <= xy[0][0]:
        return xy[0][1]
    for (x0, y0), (x1, y1) in zip(xy, xy[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return xy[-1][1]


def efficiency(m: Machine, step: Step, roof_ms: float) -> float:
    """The calibrated efficiency of a step. An attention pass: interpolated in log N along each
    calibrated batch x heads, then in log(batch x heads) between them; a GEMM or a copy:
    interpolated in log(roofline time). Piecewise linear, clamped at the ends of the calibrated
    range. Causal points where the machine has them, else the non-causal ones."""
    key = step.key
    full = m.curves.get(key)
    curve = (m.curves.get(key + ":causal") if step.causal else None) or full
    if not curve:
        how = "python -m tpattn.plan --calibrate"
        if key.startswith("fused.bwd"):  # the backward's passes: their own script
            how = "PYTHONPATH=. python scripts/model/calibrate_backward.py"
            if key == "fused.bwd_det":
                how += " --deterministic"
        raise ModelError(f"machine {m.name} has no calibration for the pass {key}; run {how} on that machine, or "
                         "use a machine file that has it")
    if isinstance(curve, dict):
        x = math.log(max(step.n, 1))
        along = sorted((math.log(hb), _causal_past(pts, x, full, hb) if curve is not full else _interp(pts, x))
                       for hb, pts in curve.items())
        return _interp(along, math.log(max(step.bh, 1)))
    return _interp(curve, math.log(max(roof_ms, 1e-12)))


def _at(curve: dict, hb: float, x: float) -> float:
    """A (batch x heads, log N) curve's efficiency at hb and x."""
    return _interp(sorted((math.log(h), _interp(pts, x)) for h, pts in curve.items()), math.log(max(hb, 1)))


def _causal_past(pts: list[tuple[float, float]], x: float, full, hb: float) -> float:
    """A causal attention pass's efficiency at log N = x along one batch x heads: the calibrated
    points, and past the longest one (N_c) the extra time of the diagonal band measured there
    (per unit of roofline: 1/eff_causal - 1/eff_full at N_c) shrinking as N_c / N, as the band's
    tiles do among all of them; so a long causal pass tends to the full one's efficiency instead
    of keeping the short one's."""
    last_x, last_e = max(pts)
    if x <= last_x or not isinstance(full, dict):
        return _interp(pts, x)
    extra = max(0.0, 1.0 / last_e - 1.0 / _at(full, hb, last_x))
    return 1.0 / (1.0 / _at(full, hb, x) + extra * math.exp(last_x - x))


def step_ms(m: Machine, step: Step) -> dict:
    roof, bound = roofline_ms(m, step)
    eff = efficiency(m, step, roof)
    floor = m.layer("launch_us", default=3.0) / 1e3
    return {"pass": step.name, "key": step.key, "what": step.what, "flops": step.flops, "bytes": step.bytes,
            "roofline_ms": roof, "bound": bound, "efficiency": eff, "ms": max(roof / eff, floor)}


# ---- the collectives: alpha-beta ---------------------------------------------------------------------


def _link_params(link: dict, kind: str) -> tuple[float, float, float]:
    """(bus bandwidth GB/s, alpha us per step, base us) of a link for one collective."""
    c = (link.get("per_collective") or {}).get(kind, {})
    return (float(c.get("busbw_GBps", link["busbw_GBps"])), float(link["step_us"]),
            float(c.get("base_us", link["base_us"])))


def ring_steps_and_share(kind: str, p: int) -> tuple[int, float]:
    """(ring steps, share of the whole tensor each rank sends) for p ranks in NCCL's ring: an
    all-reduce 2(p-1) steps and 2(p-1)/p, an all-gather or a reduce-scatter p-1 and (p-1)/p."""
    if p <= 1:
        return 0, 0.0
    if kind == "allreduce":
        return 2 * (p - 1), 2 * (p - 1) / p
    return p - 1, (p - 1) / p


def wake_share(apart_us: float, wake_us: float) -> float:
    """The share of the link's wake-up that the last rank to arrive at a collective still waits for,
    when the first rank arrived apart_us before it: the first rank's traffic starts waking the link.
    On the lent H200s (scripts/model/collective_probe.py --skew and --idle, benchmarks/link_wake_h200x2.log)
    all of it up to a lead of half the wake-up, none from twice the wake-up on, linear between."""
    if wake_us <= 0:
        return 0.0
    return min(1.0, max(0.0, (2.0 * wake_us - apart_us) / (1.5 * wake_us)))


def link_wake_us(m: Machine, idle_before_ms: float, apart_us: float = 0.0) -> float:
    """What the NVLink link's wake-up adds to a collective that follows idle_before_ms without traffic
    on it (links.nvlink wake_us after idle_ms; 0 for a file without them), the ranks arriving apart_us
    apart (0: together, the whole wake-up)."""
    nvl = m.link("nvlink") or {}
    if nvl.get("wake_us") is None or idle_before_ms < float(nvl["idle_ms"]):
        return 0.0
    return float(nvl["wake_us"]) * wake_share(apart_us, float(nvl["wake_us"]))


def collective_ms(m: Machine, kind: str, nbytes: int, world: int, gpus_per_node: int | None = None,
                  in_layer: bool = False, idle_before_ms: float = 0.0) -> dict:
    """Predicted time of one collective of nbytes (the whole tensor, nccl-tests' size) over `world`
    ranks, g per node.

    One node: NCCL's ring over NVLink, base + steps * alpha + share * bytes / busbw.
    Several nodes (hierarchical): inside each node over NVLink (the share of g ranks, of the whole
    tensor), across the n nodes over the network, each GPU's own link carrying 1/g of the tensor (the
    share of n ranks); the chunks are pipelined through both, so the slower of the two bandwidth
    terms counts, and the latency of every step adds (NVLink steps at its alpha, network steps at the
    network's).

    in_layer: the collective as the layer runs it, after its compute: + the NVLink link's
    per_collective layer_extra_us, which calibration measures as the layer's collective (on the last
    rank to arrive) minus the bare one's model (ranks arriving apart, the collective's kernel next to
    the layer's, the partial's allocation).

    idle_before_ms: how long the NVLink link carried nothing before this collective. From the link's
    idle_ms on (where the file has it) the link sleeps and the collective pays its wake_us, the ranks
    arriving together (link_wake_us): the naive layer's reduce-scatter after 89 ms of attention."""
    if kind not in COLLECTIVE_NAMES:
        raise ModelError(f"unknown collective {kind}")
    g = gpus_per_node or m.gpus_per_node
    if world <= 1:
        return {"ms": 0.0, "algorithm": "none (one rank)", "bytes": nbytes, "bound": "-"}
    nodes = 1 if world <= g else world // g
    local = world if nodes == 1 else g
    nvl = m.link("nvlink")
    if nvl is None and local > 1:
        raise ModelError(f"machine {m.name} has no NVLink numbers (\"links.nvlink\"): calibrate it with "
                         "mpirun -n 2 python -m tpattn.plan --calibrate, or add them")
    steps_l, share_l = ring_steps_and_share(kind, local)
    lat, bw_l_us, bw_n_us, base = 0.0, 0.0, 0.0, 0.0
    if local > 1:
        bw, alpha, base = _link_params(nvl, kind)
        lat += steps_l * alpha
        bw_l_us = share_l * nbytes / (bw * 1e3)
    if nodes > 1:
        net = m.link("network")
        if net is None:
            raise ModelError(f"machine {m.name} has no network numbers (\"links.network\"): it describes one node "
                             f"of {m.gpus_per_node} GPUs; use a cluster machine file (e.g. h200 or h100_cluster)")
        bw_n, alpha_n, base_n = _link_params(net, kind)
        steps_n, share_n = ring_steps_and_share(kind, nodes)
        lat += steps_n * alpha_n
        bw_n_us = share_n * (nbytes / local) / (bw_n * 1e3)
        base = max(base, base_n)
    extra = 0.0
    if in_layer and nvl is not None:
        extra = float(((nvl.get("per_collective") or {}).get(kind) or {}).get("layer_extra_us", 0.0))
    wake = link_wake_us(m, idle_before_ms) if local > 1 else 0.0
    us = max(0.0, base + lat + max(bw_l_us, bw_n_us) + extra + wake)
    algo = (f"ring over {world} GPUs (NVLink)" if nodes == 1 else
            f"hierarchical: {local} GPUs/node (NVLink) x {nodes} nodes (network)")
    bound = "latency" if base + lat > max(bw_l_us, bw_n_us) else ("network" if bw_n_us > bw_l_us else "NVLink")
    return {"ms": us / 1e3, "algorithm": algo, "bytes": nbytes, "latency_us": base + lat,
            "nvlink_us": bw_l_us, "network_us": bw_n_us, "layer_extra_us": extra, "wake_us": wake,
            "idle_before_ms": idle_before_ms, "bound": bound}


def ring_pass_ms(m: Machine, nbytes: int, ring: int, gpus_per_node: int | None = None) -> dict:
    """One pass of the ring (--context-parallel): every rank sends nbytes to the next and receives
    as many from the previous, all at once: one step of NCCL's ring all-gather, base + alpha +
    bytes / bus bandwidth, over NVLink when the ring's C consecutive ranks are on one node, else at
    the network's (the slowest hop sets the pace)."""
    g = gpus_per_node or m.gpus_per_node
    kind = "nvlink" if ring <= g else "network"
    link = m.link(kind)
    if link is None:
        raise ModelError(f"machine {m.name} has no {kind} numbers (\"links.{kind}\"): the ring of {ring} ranks "
                         f"runs over it; calibrate it or use a machine file that has them")
    bw, alpha, base = _link_params(link, "allgather")
    us = base + alpha + nbytes / (bw * 1e3)
    return {"ms": us / 1e3, "link": "NVLink" if kind == "nvlink" else "network",
            "bound": "latency" if base + alpha > nbytes / (bw * 1e3) else kind}


def ring_ms(m: Machine, shape: Shape, world: int, gpus_per_node: int | None = None) -> dict:
    """The ring's transfers at world size W: each pass posted before the compute of the block in
    hand and waited after it, so what it adds to the call is max(0, transfer - that step's compute)
    per step ("ms", the exposed time); "transfer_ms" the passes' whole time."""
    from .steps import ring_plan
    exposed = transfer = 0.0
    steps = ring_plan(shape, world)
    one = None
    for st in steps:
        if not st["send_bytes"]:
            continue
        one = ring_pass_ms(m, st["send_bytes"], shape.context_parallel, gpus_per_node)
        comp = sum(step_ms(m, s)["ms"] for s in st["compute"])
        transfer += one["ms"]
        exposed += max(0.0, one["ms"] - comp)
    C = shape.context_parallel
    return {"ms": exposed, "transfer_ms": transfer, "bytes": sum(s["send_bytes"] for s in steps),
            "pass_bytes": steps[0]["send_bytes"], "passes": C - 1, "bound": one["bound"] if one else "-",
            "algorithm": f"{C - 1} pass(es) of K/V to the next rank of a ring of {C} ({one['link'] if one else '-'}), "
                         f"each under a ring step's compute"}


def ring_backward_ms(m: Machine, shape: Shape, world: int, gpus_per_node: int | None = None) -> dict:
    """The ring's backward transfers at world size W (steps.ring_backward_plan): in step s the next K/V
    block and the previous step's dK, dV sums travel together under step s's compute, so each step
    adds max(0, their time - that compute); the last sums' hop home has no compute to travel under
    and adds all of its time ("ms", the exposed time; "transfer_ms" every pass's)."""
    from .steps import ring_backward_plan
    C = shape.context_parallel
    exposed = transfer = before = 0.0
    link = "-"
    plan = ring_backward_plan(shape, world)
    for st in plan:
        kv = ring_pass_ms(m, st["send_bytes"], C, gpus_per_node)["ms"] if st["send_bytes"] else 0.0
        comp = sum(step_ms(m, s)["ms"] for s in st["compute"])
        exposed += max(0.0, kv + before - comp)
        one = ring_pass_ms(m, st["sums_bytes"], C, gpus_per_node)
        before, link = one["ms"], one["link"]
        transfer += kv + before
    exposed += before
    return {"ms": exposed, "transfer_ms": transfer, "passes": 2 * C - 1,
            "bytes": sum(st["send_bytes"] + st["sums_bytes"] for st in plan),
            "algorithm": f"{C - 1} K/V pass(es) and {C} of the dK, dV sums to the next rank of a ring of {C} "
                         f"({link}), each under a ring step's compute but the sums' last hop home"}


def fit_alpha_beta(points: list[tuple[int, float]], kind: str, world: int, step_us: float) -> dict:
    """{base_us, busbw_GBps} of  t = base + steps*alpha + share*bytes/busbw  from measured
    (bytes, ms) points at one world size, alpha (step_us) given: least squares on the relative
    error (residuals weighted 1/t), so the small sizes count as much as the large ones."""
    steps, share = ring_steps_and_share(kind, world)
    if not points or share == 0:
        raise ValueError("fit_alpha_beta needs measured points at a world size of 2 or more")
    sw = sx = sy = sxx = sxy = 0.0
    for nbytes, ms in points:
        t, x = ms * 1e3, share * nbytes
        w = 1.0 / (t * t)
        sw, sx, sy, sxx, sxy = sw + w, sx + w * x, sy + w * t, sxx + w * x * x, sxy + w * x * t
    den = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / den if len(points) > 1 and den > 0 else 0.0
    a = (sy - b * sx) / sw if b > 0 else 0.0
    if b <= 0:  # one point, or times that do not grow with the bytes: the largest point's bandwidth
        nbytes, ms = max(points)
        b, a = ms * 1e3 / (share * nbytes), 0.0
    return {"base_us": round(max(0.0, a - steps * step_us), 2), "busbw_GBps": sig(1.0 / b / 1e3)}


WAKE_MIN_US = 20.0   # a collective this much slower after an idle than after a short one: the link slept


def fit_link_wake(points: list[tuple[float, float, float]]) -> dict | None:
    """{wake_us, idle_ms} from (idle ms, collective ms, ranks apart us) points (tpattn.model.measure.link_wake):
    the awake collective is the quickest point (noise only adds time); idle_ms = the shortest idle
    from which on every point took WAKE_MIN_US or more longer (the link sleeps from there on: one
    slow point before it does not count); wake_us = the median of that excess over those points.
    None when no idle shows it (the link does not sleep, or not within the idles tried)."""
    pts = sorted(points)
    if len(pts) < 2:
        return None
    awake = min(ms for _, ms, _ in pts)
    excess = [(idle, (ms - awake) * 1e3) for idle, ms, _ in pts]
    first = len(excess)
    while first > 0 and excess[first - 1][1] >= WAKE_MIN_US:
        first -= 1
    if first == len(excess) or first == 0:   # the last idle shows none, or even the shortest one did
        return None
    return {"wake_us": round(statistics.median(us for _, us in excess[first:]), 1), "idle_ms": excess[first][0]}


def sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits (a rate of 0.004 GB/s stays 0.004, not 0.0)."""
    return float(f"{x:.{digits}g}")


# ---- the prediction ------------------------------------------------------------------------------------


def _config(shape: Shape):
    from ..config import Config
    names = {f.name for f in dataclasses.fields(Config)}
    kw = dict(seq_len=shape.seq_len, heads=shape.heads, head_dim=shape.head_dim, batch=shape.batch,
              dtype=shape.dtype, kernel=shape.kernel, causal=shape.causal, device="cuda", check=False,
              reduce_dtype=shape.reduce_dtype, sequence_parallel=shape.sequence_parallel, overlap=shape.overlap,
              output_collective=shape.output_collective, kv_heads=shape.kv, uneven_heads=shape.uneven_heads,
              context_parallel=shape.context_parallel)
    return Config(**{k: v for k, v in kw.items() if k in names})


def memory_per_rank(shape: Shape, world: int, free_bytes: int) -> tuple[int, int, bool]:
    """(bytes one rank allocates, the largest --seq-len that fits in free_bytes, whether this one
    fits) by tpattn.memory, the CLI's own pre-flight estimate, without the checks' baseline. Rank 0's:
    it holds the most heads (--uneven-heads), and without --check every rank allocates the same
    for the same heads."""
    from .. import memory
    cfg = _config(shape)
    need = memory.estimate(cfg, world, 0)
    return need, memory.largest_n(cfg, world, 0, free_bytes), need <= free_bytes * memory.HEADROOM


def output_collective(colls) -> str | None:
    """The collective that sums the partial outputs (the one after the compute): the reduce-scatter
    where there is one, else the all-reduce."""
    return next((k for k in ("reducescatter", "allreduce") if k in colls), None)


def predict(m: Machine, shape: Shape, world: int, gpus_per_node: int | None = None) -> dict:
    """The predicted call at world size W: per pass, collectives, other, GPU, host, end to end, memory."""
    g = gpus_per_node or m.gpus_per_node
    if world > g and world % g:
        raise ModelError(f"{world} ranks do not fill nodes of {g} GPUs; use a multiple of {g}")
    nodes = 1 if world <= g else world // g
    if m.max_nodes is not None and nodes > m.max_nodes:
        raise ModelError(f"machine {m.name} is {m.max_nodes} node(s) of {m.gpus_per_node} GPUs "
                         f"({m.max_nodes * m.gpus_per_node} at most); {world} ranks need {nodes} nodes: "
                         "use a cluster machine file (h200, h100_cluster)")
    steps, colls = layer_steps(shape, world)
    detail = [step_ms(m, s) for s in steps]
    passes: dict[str, float] = {}
    for s in detail:
        passes[s["pass"]] = passes.get(s["pass"], 0.0) + s["ms"]
    overhead = 0.0 if shape.cuda_graph else m.layer("overhead_ms", shape.kernel, 0.1)
    other = passes.pop("other", 0.0) + overhead
    compute = sum(passes.values())
    # the collective that sums the partials comes after the call's compute, with nothing on the link
    # since the previous call's last collective (the all-gather of x, in sequence parallel, comes right
    # after the previous call's reduce-scatter); "other" (the bias pass after it, overheads) left out
    after = output_collective(colls)
    C = shape.context_parallel
    t, g_heads = world // C, max(1, g // C)  # a heads' group: every C-th rank, g / C of them on a node
    coll = {k: collective_ms(m, k, n, t, g_heads, in_layer=True, idle_before_ms=compute if k == after else 0.0)
            for k, n in colls.items()}
    if C > 1:
        coll = {"ring": ring_ms(m, shape, world, g), **coll}
    comm = sum(c["ms"] for c in coll.values())
    gpu = compute + comm + other
    host, host_src = (0.0, "none (a CUDA graph)") if shape.cuda_graph else m.host_ms(shape.kernel, world, len(coll))
    stall = 0.0 if shape.cuda_graph else m.stall_ms(shape.kernel, world)
    total = max(gpu, host) + stall
    mem, fit_n, fits = memory_per_rank(shape, world, m.memory_bytes)
    by_rank = shape.heads_by_rank(world)
    parts = {**{k: v for k, v in passes.items()}, **{k: c["ms"] for k, c in coll.items()}, "other": other}
    if host > gpu:
        dominant = "host (the Python call)"
    else:
        dominant = max(parts, key=parts.get)
    return {
        "world": world, "nodes": nodes, "gpus_per_node": min(world, g), "heads_per_rank": by_rank[0],
        "heads_by_rank": by_rank, "imbalance": max(by_rank) / (sum(by_rank) / len(by_rank)),
        "passes": passes, "collectives": coll, "other_ms": other, "overhead_ms": overhead,
        "compute_ms": compute, "communication_ms": comm, "gpu_ms": gpu, "host_ms": host, "host_source": host_src,
        "stall_ms": stall,
        "end_to_end_ms": total,
        "host_bound": host > gpu, "dominant": dominant, "steps": detail,
        "memory_bytes": mem, "fits": fits, "largest_seq_len": fit_n,
    }


def predict_training(m: Machine, shape: Shape, world: int, gpus_per_node: int | None = None) -> dict:
    """A training step (the call and its backward) at world size W, GPU time per pass: the forward's
    prediction, the backward's passes (backward_steps) and its collective, the all-reduce of dX
    (with nothing on the link before it: the forward's sum ran a whole attention backward earlier);
    with --context-parallel, the ring's backward passes' exposed time too (ring_backward_ms).
    The host is not a model number here (the backward's was not calibrated): "gpu_ms" is what a
    CUDA-graphed step takes, and an eager step is no faster than it."""
    fwd = predict(m, dataclasses.replace(shape, cuda_graph=True), world, gpus_per_node)
    steps, colls = backward_steps(shape, world)
    detail = [step_ms(m, s) for s in steps]
    passes: dict[str, float] = {}
    for s in detail:
        passes[s["pass"]] = passes.get(s["pass"], 0.0) + s["ms"]
    g = gpus_per_node or m.gpus_per_node
    C = shape.context_parallel
    t, g_heads = shape.heads_world(world), max(1, g // C)  # a heads' group: every C-th rank (as predict's)
    coll = {f"bwd_{k}": collective_ms(m, k, n, t, g_heads, in_layer=True) for k, n in colls.items()}
    if C > 1:
        coll = {"bwd_ring": ring_backward_ms(m, shape, world, g), **coll}
    bwd = sum(passes.values()) + sum(c["ms"] for c in coll.values())
    return {"world": world, "forward_ms": fwd["gpu_ms"], "forward_passes": fwd["passes"],
            "forward_collectives": {k: c["ms"] for k, c in fwd["collectives"].items()},
            "backward_passes": passes, "backward_collectives": {k: c["ms"] for k, c in coll.items()},
            "backward_ms": bwd, "gpu_ms": fwd["gpu_ms"] + bwd, "steps": detail}


def plan(m: Machine, shape: Shape, worlds: list[int], gpus_per_node: int | None = None) -> list[dict]:
    """predict() for each world size; a size the model cannot predict gets {"world", "error"}.
    Speedup and efficiency against the 1-rank prediction (made even when 1 is not asked for; with
    --context-parallel, the 1-rank layer's)."""
    rows = []
    try:
        base = predict(m, dataclasses.replace(shape, context_parallel=1), 1, gpus_per_node)["end_to_end_ms"]
    except ModelError:
        base = None
    for w in worlds:
        try:
            r = predict(m, shape, w, gpus_per_node)
        except ModelError as exc:
            rows.append({"world": w, "error": str(exc)})
            continue
        if base:
            r["ideal_ms"] = base / w
            r["speedup"] = base / r["end_to_end_ms"]
            r["efficiency"] = r["speedup"] / w
        rows.append(r)
    return rows


CROSSOVER_LENGTHS = tuple(2 ** k for k in range(10, 22))  # N from 1024 to 2M


def crossover(m: Machine, shape: Shape, world: int, gpus_per_node: int | None = None,
              lengths: tuple[int, ...] = CROSSOVER_LENGTHS) -> dict:
    """The ring (shape's --context-parallel C) against head parallelism alone (C = 1) at world size
    W, over sequence lengths: {"rows": [{"seq_len", "heads_ms", "ring_ms", "heads_fits", "ring_fits"}],
    "from_n": the shortest N from which the ring's call is faster at every longer N of the grid (None:
    nowhere), "heads_error": why head parallelism alone cannot run W ranks (then the ring is the only
    way), "largest_n": each style's longest sequence in one GPU's memory}."""
    heads_shape = dataclasses.replace(shape, context_parallel=1)
    rows, heads_error = [], None
    for n in lengths:
        if n % (2 * shape.context_parallel):
            continue
        ring = predict(m, dataclasses.replace(shape, seq_len=n), world, gpus_per_node)
        row = {"seq_len": n, "ring_ms": ring["end_to_end_ms"], "ring_fits": ring["fits"],
               "ring_exposed_ms": ring["collectives"]["ring"]["ms"] if "ring" in ring["collectives"] else 0.0}
        try:
            head = predict(m, dataclasses.replace(heads_shape, seq_len=n), world, gpus_per_node)
            row.update(heads_ms=head["end_to_end_ms"], heads_fits=head["fits"])
        except ModelError as exc:
            heads_error = str(exc)
            row.update(heads_ms=None, heads_fits=False)
        rows.append(row)
    from_n = None
    for row in reversed(rows):
        if row["heads_ms"] is not None and row["ring_ms"] >= row["heads_ms"]:
            break
        from_n = row["seq_len"]
    largest = {"ring": predict(m, shape, world, gpus_per_node)["largest_seq_len"]}
    if heads_error is None:
        largest["heads"] = predict(m, heads_shape, world, gpus_per_node)["largest_seq_len"]
    return {"world": world, "context_parallel": shape.context_parallel, "rows": rows, "from_n": from_n,
            "heads_error": heads_error, "largest_n": largest}
