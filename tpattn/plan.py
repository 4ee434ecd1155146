"""`python -m tpattn.plan`: predict the layer before it runs, per pass and per world size, from a
machine description (tpattn/costmodel.py has the model); `--calibrate` measures a machine file.

    python -m tpattn.plan --machine h200 --world-sizes 1 2 4 8 [shape options of python -m tpattn]
    python -m tpattn.plan --machine h100_cluster --nodes 1 2 4 --json plan.json --plot speedup.png
    python -m tpattn.plan --calibrate --out my_gpu.json                 # on one GPU
    mpirun -n 2 python -m tpattn.plan --calibrate --out my_node.json    # + NCCL collectives

Exit status: 0, or 2 for a bad input (an option, a machine file) with one line that names the fix;
1 when the calibration fails on a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

from . import costmodel as cm
from .sharding import describe_blocks

EXIT_FAIL, EXIT_USAGE = 1, 2
# the shape and style options, taken from python -m tpattn's own parser (same names, choices, help)
SHAPE_OPTIONS = ("seq_len", "heads", "head_dim", "kv_heads", "batch", "causal", "dtype", "kernel", "reduce_dtype",
                 "sequence_parallel", "output_collective", "overlap", "cuda_graph", "uneven_heads")
EPILOG = """\
machine files: a path, or a shipped name: {names}
  (tpattn/machines/*.json; fields in docs/plan.md). --calibrate writes one for the machine it runs on.
examples:
  python -m tpattn.plan --machine h200 --world-sizes 1 2 4 8
  python -m tpattn.plan --machine h100_cluster --nodes 1 2 4 --seq-len 32768 --kernel fused
  mpirun -n 2 python -m tpattn.plan --calibrate --out node.json
exit status: 0, 2 bad input (one line that names the fix), 1 a calibration that failed.
"""


class PlanError(ValueError):
    """A bad input: one line that names the fix (exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise PlanError(f"{message} (see python -m tpattn.plan --help)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m tpattn.plan", formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=EPILOG.format(names=", ".join(cm.machine_names())),
                description="Predict the tensor-parallel attention layer before it runs: the time of every pass "
                            "(QKV projection, qk / softmax / pv or fused, output projection, each collective), end "
                            "to end, speedup and efficiency per world size, memory per rank and the largest "
                            "sequence that fits, from a machine description (roofline x calibrated efficiency "
                            "for compute, alpha-beta ring model for NCCL). --calibrate measures a machine file.")
    _shape_options(p.add_argument_group(
        "shape and style (as python -m tpattn)",
        "The plan always starts from the GPU defaults, N 4096, 32 heads, d 128 and --kernel naive, whatever "
        "machine it runs on; --kernel reference has no cost model; --overlap is not modeled."))
    m = p.add_argument_group("machine and world sizes")
    m.add_argument("--machine", default="h200", metavar="NAME|FILE",
                   help="machine description: a JSON file or a shipped name (default h200: 8 H200s per node, "
                        "400 Gb/s per GPU between nodes)")
    w = m.add_mutually_exclusive_group()
    w.add_argument("--world-sizes", type=int, nargs="+", metavar="W", help="total ranks (GPUs) to predict "
                   "(default 1 2 4 8, or those that split the heads); above one node's GPUs, whole nodes")
    w.add_argument("--nodes", type=int, nargs="+", metavar="N", help="predict N nodes of --gpus-per-node GPUs each "
                   "(world size N x G) instead of --world-sizes")
    m.add_argument("--gpus-per-node", type=int, metavar="G", help="GPUs used per node (default: the machine's)")
    o = p.add_argument_group("output")
    o.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write the prediction as JSON to PATH "
                   "(no PATH: print JSON instead of the table)")
    o.add_argument("--markdown", action="store_true", help="print the table as markdown")
    o.add_argument("--plot", metavar="FILE", help="plot predicted speedup against ideal and the time per pass "
                   "(PNG; needs matplotlib)")
    c = p.add_argument_group("calibration (on a GPU machine)")
    c.add_argument("--calibrate", action="store_true", help="measure this machine (GEMM and copy peaks, every "
                   "kernel pass inside the layer at several sizes, the layer's overhead and host time, NCCL "
                   "all-reduce / all-gather / reduce-scatter at 8-256 MiB when launched with several ranks) and "
                   "write a machine file to --out")
    c.add_argument("--out", metavar="FILE", help="where --calibrate writes the machine file")
    c.add_argument("--name", help="the calibrated machine's name (default: GPU name and count)")
    c.add_argument("--kernels", nargs="+", default=list(cm.KERNELS), choices=list(cm.KERNELS),
                   help="kernels to calibrate (default all)")
    c.add_argument("--quick", action="store_true", help="fewer sizes and iterations (a smoke test)")
    return p


def _shape_options(group) -> None:
    """The shape options of python -m tpattn's parser, as they are there (names, choices, help)."""
    taken = set()
    try:
        from .cli import parser as tpattn_parser
        for action in tpattn_parser()._actions:
            if action.dest in SHAPE_OPTIONS:
                group._add_action(action)
                taken.add(action.dest)
    except Exception:  # noqa: BLE001 - the CLI cannot be imported: own definitions below
        pass
    own = {
        "seq_len": (("--seq-len",), dict(type=int, metavar="N", help="sequence length (default 4096)")),
        "heads": (("--heads",), dict(type=int, metavar="H", help="attention heads (default 32)")),
        "head_dim": (("--head-dim",), dict(type=int, metavar="d", help="head dim (default 128)")),
        "kv_heads": (("--kv-heads",), dict(type=int, metavar="G", help="K/V heads, GQA (default: --heads)")),
        "batch": (("--batch",), dict(type=int, default=1, metavar="B", help="batch size (default 1)")),
        "causal": (("--causal",), dict(action="store_true", help="causal mask")),
        "dtype": (("--dtype",), dict(default="fp16", choices=list(cm.ELEM), help="storage dtype (default fp16)")),
        "kernel": (("--kernel",), dict(choices=list(cm.KERNELS), help="attention kernel (default naive)")),
        "reduce_dtype": (("--reduce-dtype",), dict(default="fp32", choices=["fp32", "model"],
                                                   help="dtype of the partial outputs (default fp32)")),
        "sequence_parallel": (("--sequence-parallel",), dict(action="store_true", help="sequence parallelism")),
        "output_collective": (("--output-collective",), dict(default="auto", choices=["auto", "allreduce", "split"],
                                                             help="head-parallel: all-reduce or reduce-scatter + all-gather")),
        "overlap": (("--overlap",), dict(type=int, default=1, metavar="K", help="row chunks (not modeled)")),
        "cuda_graph": (("--cuda-graph",), dict(action="store_true", help="no host time (a CUDA graph)")),
        "uneven_heads": (("--uneven-heads",), dict(action="store_true", help="world sizes that do not divide the "
                                                   "heads: ceil/floor(H/W) per rank, rank 0's predicted")),
    }
    for dest, (flags, kw) in own.items():
        if dest not in taken:
            group.add_argument(*flags, dest=dest, **kw)


def shape_from(a) -> cm.Shape:
    from .config import GPU_DEFAULTS
    kernel = a.kernel or "naive"
    if kernel not in cm.KERNELS:
        raise PlanError(f"--kernel {kernel} has no cost model; use one of {', '.join(cm.KERNELS)} (reference is "
                        "the torch check, not a kernel to plan for)")
    pick = lambda v, k: GPU_DEFAULTS[k] if v is None else v  # noqa: E731
    s = cm.Shape(seq_len=pick(a.seq_len, "seq_len"), heads=pick(a.heads, "heads"),
                 head_dim=pick(a.head_dim, "head_dim"), batch=a.batch, dtype=a.dtype, kernel=kernel,
                 causal=a.causal, reduce_dtype=a.reduce_dtype, sequence_parallel=a.sequence_parallel,
                 overlap=a.overlap, cuda_graph=a.cuda_graph, output_collective=getattr(a, "output_collective", "auto"),
                 kv_heads=getattr(a, "kv_heads", None), uneven_heads=bool(getattr(a, "uneven_heads", False)))
    for flag, v in (("--seq-len", s.seq_len), ("--heads", s.heads), ("--head-dim", s.head_dim),
                    ("--batch", s.batch), ("--overlap", s.overlap)):
        if v < 1:
            raise PlanError(f"{flag} must be at least 1 (got {v})")
    if s.kv_heads is not None and (s.kv_heads < 1 or s.heads % s.kv_heads):
        raise PlanError(f"--kv-heads {s.kv_heads} must divide --heads {s.heads}")
    from .attention import get_backend
    backend = get_backend(kernel)
    err = backend.head_dim_error(s.head_dim) if hasattr(backend, "head_dim_error") else None
    if err:
        raise PlanError(err)
    if s.dtype not in backend.dtypes:
        raise PlanError(f"--kernel {kernel} does not support --dtype {s.dtype}; use one of {', '.join(backend.dtypes)}")
    return s


def world_sizes(a, shape: cm.Shape, g: int) -> list[int]:
    if a.nodes:
        if any(n < 1 for n in a.nodes):
            raise PlanError(f"--nodes must be at least 1 (got {min(a.nodes)})")
        return [n * g for n in a.nodes]
    if a.world_sizes:
        if any(w < 1 for w in a.world_sizes):
            raise PlanError(f"--world-sizes must be at least 1 (got {min(a.world_sizes)})")
        return list(a.world_sizes)
    if shape.uneven_heads:  # any W the layout takes (W <= H; with K/V groups, W <= G or an even layout)
        return [w for w in (1, 2, 4, 8) if cm._layout_error(shape, w) is None]
    return [w for w in (1, 2, 4, 8) if shape.heads % w == 0]


# ---- the table ---------------------------------------------------------------------------------------


def _gib(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


COLL_LABEL = {"allreduce": "all-reduce", "allgather": "all-gather", "reducescatter": "reduce-scatter"}


def columns(rows: list[dict]) -> tuple[list[str], list[str]]:
    ok = [r for r in rows if "error" not in r]
    comp = [p for p in cm.COMPUTE_ORDER if any(p in r["passes"] for r in ok)]
    coll = [c for c in cm.COLLECTIVE_NAMES if any(c in r["collectives"] for r in ok)]
    coll.sort(key=lambda c: min((list(r["collectives"]).index(c) for r in ok if c in r["collectives"]), default=9))
    return comp, coll


def header(m: cm.Machine, shape: cm.Shape, g: int) -> list[str]:
    style = "sequence-parallel" if shape.sequence_parallel else "head-parallel"
    kv = f" G={shape.kv}" if shape.kv != shape.heads else ""
    lines = [f"tpattn plan: kernel {shape.kernel}, B={shape.batch} N={shape.seq_len} H={shape.heads}{kv} "
             f"d={shape.head_dim} D={shape.model_dim} {shape.dtype}{' causal' if shape.causal else ''}, {style}, "
             f"partials {shape.reduce_dtype}" + (", CUDA graph" if shape.cuda_graph else ""),
             f"machine {m.name}: {m.data['gpu']}, {g} GPU(s)/node"
             + (f" (of {m.gpus_per_node})" if g != m.gpus_per_node else "")
             + f", {m.data['memory_GiB']:g} GiB each; {m.path}"]
    if shape.overlap > 1:
        lines.append(f"note: --overlap {shape.overlap} is not modeled: the prediction runs the collectives after the "
                     "compute, as --overlap 1 does")
    return lines


def table(m: cm.Machine, shape: cm.Shape, rows: list[dict], g: int, markdown: bool = False) -> str:
    comp, coll = columns(rows)
    heads = (["GPUs", "nodes", "heads/rank"] + comp + [COLL_LABEL[c] for c in coll]
             + ["other", "end to end", "ideal", "speedup", "efficiency", "memory/rank", "largest N", "dominant"])
    body, missing = [], []
    for r in rows:
        if "error" in r:
            missing.append(f"W={r['world']}: not predicted: {r['error']}")
            continue
        f = lambda v: f"{v:.3f}" if v < 100 else f"{v:.1f}"  # noqa: E731
        by_rank = r.get("heads_by_rank") or [r["heads_per_rank"]]
        hpr = str(max(by_rank)) + (f" or {min(by_rank)}" if min(by_rank) != max(by_rank) else "")
        cells = [str(r["world"]), str(r["nodes"]), hpr]
        cells += [f(r["passes"][p]) if p in r["passes"] else "-" for p in comp]
        cells += [f(r["collectives"][c]["ms"]) if c in r["collectives"] else "-" for c in coll]
        cells += [f(r["other_ms"]), f(r["end_to_end_ms"]) + (" (host)" if r["host_bound"] else ""),
                  f(r["ideal_ms"]) if "ideal_ms" in r else "-",
                  f"{r['speedup']:.2f}" if "speedup" in r else "-",
                  f"{100 * r['efficiency']:.0f}%" if "efficiency" in r else "-",
                  _gib(r["memory_bytes"]) + ("" if r["fits"] else " (does not fit)"),
                  str(r["largest_seq_len"]), r["dominant"]]
        body.append(cells)
    out = header(m, shape, g)
    if markdown:
        out += ["", "| " + " | ".join(heads) + " |", "|" + "|".join("---:" if i < len(heads) - 1 else "---"
                                                                  for i in range(len(heads))) + "|"]
        out += ["| " + " | ".join(c) + " |" for c in body]
        out.append("")
    elif body:
        uneven = any(len(set(r.get("heads_by_rank", [0]))) > 1 for r in rows if "error" not in r)
        out.append("predicted ms per call on one rank (every rank does the same work):" if not uneven else
                   "predicted ms per call on rank 0 (with uneven heads it holds the most; the others wait for it "
                   "at the collective):")
        widths = [max(len(h), *(len(c[i]) for c in body)) for i, h in enumerate(heads)]
        out.append("  " + "  ".join(h.rjust(w) for h, w in zip(heads, widths)))
        for c in body:
            out.append("  " + "  ".join(x.rjust(w) if i < len(c) - 1 else x for i, (x, w) in enumerate(zip(c, widths))))
    out += missing
    for r in rows:
        if "error" in r:
            continue
        by = r.get("heads_by_rank") or []
        if len(set(by)) > 1:
            out.append(f"W={r['world']}: uneven heads: {describe_blocks(by)}; heads max/mean {r['imbalance']:.3f} (the useful share "
                       f"of the compute {100 / r['imbalance']:.1f} %); predicted: rank 0's")
        for c, info in r["collectives"].items():
            woke = (f", of which {info['wake_us']:.0f} us the NVLink link's wake-up after {info['idle_before_ms']:.0f} ms "
                    f"of compute (the ranks arriving together; none when one arrives {2 * info['wake_us']:.0f} us or more "
                    "before the last)" if info.get("wake_us") else "")
            out.append(f"W={r['world']}: {COLL_LABEL[c]} of {_gib(info['bytes'])}: {info['algorithm']}, "
                       f"{info['ms'] * 1e3:.0f} us ({info['bound']}-bound){woke}")
    out.append("other = the bias + cast of the partials, the o relayout (naive, tiled) and the per-call overhead; "
               "end to end = max(GPU, host) + stall; (host): the Python call takes longer than the GPU work; memory/rank "
               "by tpattn.memory (the CLI's pre-flight, without --check's baseline)")
    return "\n".join(out)


def as_json(m: cm.Machine, shape: cm.Shape, rows: list[dict], g: int, argv: list[str]) -> dict:
    from . import __version__
    return {
        "tpattn": __version__, "command": ["python", "-m", "tpattn.plan", *argv],
        "machine": {"name": m.name, "path": m.path, "gpu": m.data["gpu"], "gpus_per_node": g,
                    "memory_GiB": m.data["memory_GiB"], "peaks": m.data["peaks"], "links": m.data.get("links", {})},
        "config": {**{k: getattr(shape, k) for k in cm.Shape.__dataclass_fields__}, "model_dim": shape.model_dim},
        "rows": rows,
    }


def plot(path: str, m: cm.Machine, shape: cm.Shape, rows: list[dict]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlanError("--plot needs matplotlib, which is not installed: pip install matplotlib "
                        "(or pip install 'tpattn[plot]'), or drop --plot") from None
    ok = [r for r in rows if "error" not in r and "speedup" in r]
    if not ok:
        raise PlanError("--plot: no world size could be predicted, nothing to plot")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(14, 5))
    ws = [r["world"] for r in ok]
    a1.plot(ws, ws, "--", color="gray", label="ideal")
    a1.plot(ws, [r["speedup"] for r in ok], "o-", label=f"predicted ({shape.kernel})")
    a1.set_xscale("log", base=2)
    a1.set_yscale("log", base=2)
    a1.set_xticks(ws, [str(w) for w in ws])
    a1.set_xlabel("GPUs")
    a1.set_ylabel("speedup over 1 GPU")
    a1.set_title(f"predicted speedup, {m.name}")
    a1.legend()
    comp, coll = columns(rows)
    bottom = [0.0] * len(ok)
    labels = [str(w) for w in ws]
    for name in comp + coll + ["other"]:
        vals = [100 * (r["passes"].get(name, r["collectives"].get(name, {}).get("ms", 0.0)) if name != "other"
                       else r["other_ms"]) / r["gpu_ms"] for r in ok]
        a2.bar(labels, vals, bottom=bottom, label=COLL_LABEL.get(name, name))
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, r in zip(labels, ok):
        a2.annotate(f"{r['end_to_end_ms']:.3g} ms" + ("\nhost-bound" if r["host_bound"] else ""), (x, 101),
                    ha="center", va="bottom", fontsize=8)
    a2.set_ylim(0, 118)
    a2.set_xlabel("GPUs")
    a2.set_ylabel("share of the GPU time per call, %")
    a2.set_title(f"N={shape.seq_len} H={shape.heads} d={shape.head_dim}, {shape.kernel}: where the time goes")
    a2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise PlanError(f"--plot {path}: cannot write it ({exc.strerror}); choose another path") from None
    plt.close(fig)


def _write(path: str, text: str, flag: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise PlanError(f"{flag} {path}: cannot write it ({exc.strerror}); choose another path") from None


def run_plan(a, argv: list[str]) -> int:
    shape = shape_from(a)
    try:
        m = cm.load_machine(a.machine)
    except cm.MachineError as exc:
        raise PlanError(str(exc)) from None
    g = a.gpus_per_node or m.gpus_per_node
    if g < 1 or g > m.gpus_per_node:
        raise PlanError(f"--gpus-per-node {g}: machine {m.name} has {m.gpus_per_node} GPU(s) per node; use 1 to "
                        f"{m.gpus_per_node}")
    worlds = world_sizes(a, shape, g)
    rows = cm.plan(m, shape, worlds, g)
    if a.plot:
        plot(a.plot, m, shape, rows)
    doc = as_json(m, shape, rows, g, argv)
    if a.json == "-":
        print(json.dumps(doc, indent=1))
    else:
        if a.json:
            _write(a.json, json.dumps(doc, indent=1), "--json")
        print(table(m, shape, rows, g, a.markdown))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        a = parser().parse_args(argv)
        if a.calibrate:
            return calibrate(a, argv)
        if a.out:
            raise PlanError("--out is where --calibrate writes; add --calibrate (or use --json for a prediction)")
        return run_plan(a, argv)
    except (PlanError, cm.MachineError) as exc:
        print(f"tpattn.plan: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except cm.ModelError as exc:
        print(f"tpattn.plan: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE


# ---- measuring on a GPU: shared by --calibrate and scripts/validate_model.py ---------------------------
# (they also run on CPU, gloo and the torch reference standing in for every kernel, when
# TPATTN_PLAN_ALLOW_CPU=1: a smoke test of the whole flow for CI; the numbers mean nothing)

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

    from .layer import TensorParallelAttention
    from .sharding import head_range, kv_head_range
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
    from .weights import head_weights
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
        import torch.distributed as dist
        if cuda:
            dist.barrier(group=group, device_ids=[torch.device(device).index])
        else:
            dist.barrier(group=group)
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
    """The layer as --calibrate and scripts/validate_model.py time it (this one function):
    - `iters` calls as python -m tpattn times them, un-spun, back to back (each after the previous
      one's end): "total" (CUDA events around it: what users see) and "host" (until it returns);
    - then `iters` calls with a timer around every pass, each queued behind spin_ahead (a barrier over
      the layer's group when it has several ranks, then a GPU spin of spin_ms_for(host)), so each
      event pair measures GPU time only; "gpu": that whole call's GPU time.
    Not interleaved: an un-spun call that follows an instrumented one (its barrier, spin and event
    pairs) took up to twice the host time of one that follows another un-spun call, in the same
    process (scripts/host_probe.py on the lent H200s: 0.76 against 0.35 ms). Medians over the
    iterations, ms (raw: filled with every sample, in order)."""
    from .timing import Timer
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
            layer(x, timer)
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
    the rounds that have it. --calibrate's W-rank layer and scripts/validate_model.py both use it."""
    names = dict.fromkeys(k for r in rounds for k in r)
    return {k: statistics.median(r[k] for r in rounds if k in r) for k in names}


def combine_layer_rounds(rounds: list[dict]) -> dict:
    """One measurement of a layer from several rounds of it, as --calibrate and scripts/validate_model.py
    both combine them. Each round: {"passes": {name: ms} (already reduced over the ranks), and for
    several ranks "samples_by_rank": [rank]{name: [ms per call]}}. Returns:
    - "passes": per name the median over the rounds (combine_rounds), but a collective from every
      round's calls together: call by call the last rank to arrive, then the median
      (tpattn.report.last_rank_ms);
    - "samples_by_rank": those calls, pooled (None with one rank);
    - "stall_ms": the stall per round (call_stall: quantities of one and the same call), then the median;
    - "rounds": each round's total, host and gpu (and "host_load", where the round has it: what
      competed for the CPU meanwhile, host_load_between)."""
    from .report import last_rank_ms
    passes = combine_rounds([r["passes"] for r in rounds])
    samples = None
    if rounds[0].get("samples_by_rank"):
        samples = pool_rank_samples([r["samples_by_rank"] for r in rounds])
        for k in samples[0]:
            if k in cm.COLLECTIVE_NAMES:
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
    import torch.distributed as dist
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return dist, ag, rs


# One bare collective, timed the same way by --calibrate (whose alpha-beta fit is made on these
# numbers) and by scripts/validate_model.py (which judges the fit against them): same sizes, same
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
    dist, ag, rs = _collective_fns()
    W = dist.get_world_size()
    dt = torch.float16 if kind == "allgather" else torch.float32
    n = nbytes // torch.empty((), dtype=dt).element_size()
    n -= n % W
    whole = torch.zeros(n, dtype=dt, device=device)   # zeros: sums that stay finite over any number of calls
    part = torch.zeros(n // W, dtype=dt, device=device)
    op = {"allreduce": lambda: dist.all_reduce(whole), "allgather": lambda: ag(whole, part),
          "reducescatter": lambda: rs(part, whole)}[kind]
    cuda = device.type == "cuda"
    spin = getattr(torch.cuda, "_sleep", None) if cuda else None
    ts = []
    for i in range(warmup + samples):
        if cuda:
            dist.barrier(device_ids=[device.index])
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
            dist.barrier()
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


def bare_collectives(sizes, device, kinds=cm.COLLECTIVE_NAMES) -> dict[str, list[tuple[int, float]]]:
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
    rank's. tpattn.plan.link_wake and scripts/collective_probe.py --idle time a collective after an
    idle link with it."""
    import torch
    import torch.distributed as dist
    s, a, b = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    took, waited = [], []
    for _ in range(calls):
        dist.barrier(device_ids=[device.index])
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
    reduce-scatter took ~95 us longer after 80 ms than after 1 ms (scripts/collective_probe.py
    --idle); tpattn.costmodel.fit_link_wake reads the numbers from it."""
    import torch

    from .report import last_rank_ms
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
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def start_ranks(timeout: float = 600.0, what: str = "--calibrate"):
    """(proc, device) for a measurement: launcher discovery, this rank's GPU, and an NCCL process
    group when there are several ranks. One node only: the measurements are of one node."""
    import torch

    from . import dist as tpdist
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

    from . import dist as tpdist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if proc.distributed:
        tpdist.exit_now(code)


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
    # lent H200s, scripts/host_probe.py); one stretch of back-to-back calls is a snapshot of it,
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
            if free_bytes is not None and cm.STRIDED.get(kernel) is False and 2 * h * n * n * 2 > free_bytes // 2:
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
        if cm.STRIDED[run["kernel"]] and "qkv_proj" in p:  # no relayout inside the pass
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
        bare = cm.Machine(name="bare", data=data, path="(calibration)")
        extra_us: dict[str, list] = {}
        for run in meas.get("layer_multi", []):
            compute = run["passes"].get("gpu", 0.0) - sum(v for k, v in run["passes"].items() if k in cm.COLLECTIVE_NAMES)
            if woke and compute >= woke["idle_ms"]:   # as predict() counts the idle before the collective
                continue
            for kind, nbytes in (run.get("collective_bytes") or {}).items():
                if kind in run["passes"] and kind in cm.COLLECTIVE_NAMES:
                    model_us = cm.collective_ms(bare, kind, nbytes, W, max(W, int(meas["gpus_per_node"])))["ms"] * 1e3
                    extra_us.setdefault(kind, []).append(run["passes"][kind] * 1e3 - model_us)
        for kind, v in extra_us.items():  # the median over the kernels and lengths the W-rank layer ran
            per.setdefault(kind, {})["layer_extra_us"] = round(statistics.median(v), 1)
        data["sources"]["links.nvlink"] = (f"{how}: NCCL all-reduce, all-gather, reduce-scatter over {W} GPUs at "
                                           f"{', '.join(f'{b // MiB}' for b, _ in colls['allreduce'])} MiB "
                                           "(tpattn.plan.bare_collective_ms, as scripts/validate_model.py times them: "
                                           f"{COLLECTIVE_WARMUP} warm-up samples, then {COLLECTIVE_SAMPLES} samples of "
                                           f"a barrier, a GPU spin and {COLLECTIVE_REPS} calls back to back between "
                                           "CUDA events, / calls; per sample the slowest rank, the median over the "
                                           "samples), fitted by least squares on "
                                           "the relative error with step_us = 3.4 us (NVIDIA/nccl src/graph/tuning.cc, "
                                           "Ring/Simple over NVLink); layer_extra_us: the same collective inside "
                                           f"the {W}-rank layer (timed behind a barrier and a GPU spin; call by "
                                           "call the last rank to arrive, the median over the calls of every round, "
                                           "as scripts/validate_model.py measures it) minus that model, the median "
                                           "over the kernels and lengths the layer ran"
                                           + ("" if not meas.get("link_wake") else
                                              f"; wake_us and idle_ms: a reduce-scatter of {WAKE_BYTES // MiB} MiB "
                                              f"after {', '.join(f'{i:g}' for i, _, _ in meas['link_wake'])} ms with "
                                              "nothing on the link (tpattn.plan.link_wake: a barrier, the same GPU "
                                              f"spin on every rank, {WAKE_CALLS} calls, the last rank to arrive, "
                                              "medians; measured.after_idle: idle ms, ms, ranks apart us); idle_ms "
                                              f"is the first idle it took {cm.WAKE_MIN_US:.0f} us or more longer "
                                              "than after the shortest, wake_us the median excess from there on"
                                              + ("" if woke else " (none did: no wake-up modeled)")))
    # the layer's per-call overhead and host time: end to end minus what the model says the passes and
    # the untimed steps cost, with the efficiencies just measured
    tmp = cm.Machine(name=name, data=data, path="(calibration)")
    tmp.curves = cm._curves(tmp, passes)
    over: dict[str, list] = {}
    host: dict[str, list] = {}
    stall: dict[str, list] = {}
    for run in meas["layer"]:
        if run["causal"] or "total" not in run["passes"]:
            continue
        p = run["passes"]
        shape = cm.Shape(seq_len=run["N"], heads=run["h"], head_dim=run["d"], kernel=run["kernel"])
        try:
            steps, _ = cm.layer_steps(shape, 1)
            untimed = sum(cm.step_ms(tmp, s)["ms"] for s in steps if s.name == "other")
        except cm.ModelError:
            continue
        timed = sum(v for k, v in p.items() if k in cm.COMPUTE_ORDER)
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
    cm.validate_machine(data, "the calibrated machine")
    return data


def calibrate(a, argv: list[str]) -> int:
    if not a.out:
        raise PlanError("--calibrate needs --out FILE: where to write the machine file")
    from .config import check_writable, ConfigError
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

    from . import report
    from .layer import _add_bias
    from .weights import layer_input
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
    try:
        from .layer import _mm
    except ImportError:  # the layer's GEMM helper renamed: torch's own fp32-result GEMM
        def _mm(a_, b_, out_dtype, out=None):
            return torch.mm(a_, b_, out_dtype=out_dtype, out=out)
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

        from .sharding import head_range
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
                    every = gather((mine, {k: v for k, v in raw.items() if k in cm.COLLECTIVE_NAMES}, one.get("host")))
                    # the slowest rank, but a collective: the last rank to arrive (from the samples, below)
                    p = {k: max(r[0][k] for r in every if k in r[0]) for k in every[0][0] if k not in cm.COLLECTIVE_NAMES}
                    rounds.setdefault((kernel, n), []).append(
                        {"passes": p, "samples_by_rank": [r[1] for r in every],
                         "host_alone": max(r[2] or 0.0 for r in every)})
        for (kernel, n), got in rounds.items():
            comb = combine_layer_rounds(got)  # as scripts/validate_model.py combines its rounds
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
