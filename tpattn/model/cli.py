"""`python -m tpattn.plan` (or python -m tpattn.model): predict the layer before it runs, per pass and
per world size, from a machine description (tpattn/model/costmodel.py has the model); `--calibrate`
measures a machine file (tpattn/model/calibrate.py).

    python -m tpattn.plan --machine h200 --world-sizes 1 2 4 8 [shape options of python -m tpattn]
    python -m tpattn.plan --machine h100_cluster --nodes 1 2 4 --json plan.json --plot speedup.png
    python -m tpattn.plan --calibrate --out my_gpu.json                 # on one GPU
    mpirun -n 2 python -m tpattn.plan --calibrate --out my_node.json    # + NCCL collectives

Exit status: 0, or 2 for a bad input (an option, a machine file) with one line that names the fix;
1 when the calibration fails on a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from ..config import INT_MAX
from ..sharding import describe_blocks
from . import costmodel as cm
from .calibrate import calibrate
from .errors import EXIT_USAGE, MachineError, ModelError, PlanError
from .machine import Machine, load_machine, machine_names
from .steps import COLLECTIVE_NAMES, COMPUTE_ORDER, ELEM, KERNELS, Shape, _layout_error

# the shape and style options, taken from python -m tpattn's own parser (same names, choices, help)
SHAPE_OPTIONS = ("seq_len", "heads", "head_dim", "kv_heads", "batch", "causal", "dtype", "kernel", "reduce_dtype",
                 "sequence_parallel", "output_collective", "overlap", "cuda_graph", "uneven_heads", "context_parallel",
                 "deterministic")
EPILOG = """\
machine files: a path, or a shipped name: {names}
  (tpattn/model/machines/*.json; fields in docs/plan.md). --calibrate writes one for the machine it runs on.
examples:
  python -m tpattn.plan --machine h200 --world-sizes 1 2 4 8
  python -m tpattn.plan --machine h100_cluster --nodes 1 2 4 --seq-len 32768 --kernel fused
  python -m tpattn.plan --kernel fused --causal --context-parallel 8 --world-sizes 8 16 --crossover
  mpirun -n 2 python -m tpattn.plan --calibrate --out node.json
exit status: 0, 2 bad input (one line that names the fix), 1 a calibration that failed.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise PlanError(f"{message} (see python -m tpattn.plan --help)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m tpattn.plan", formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=EPILOG.format(names=", ".join(machine_names())),
                description="Predict the tensor-parallel attention layer before it runs: the time of every pass "
                            "(QKV projection, qk / softmax / pv or fused, output projection, each collective), end "
                            "to end, speedup and efficiency per world size, memory per rank and the largest "
                            "sequence that fits, from a machine description (roofline x calibrated efficiency "
                            "for compute, alpha-beta ring model for NCCL). --calibrate measures a machine file.")
    _shape_options(p.add_argument_group(
        "shape and style (as python -m tpattn)",
        "The defaults are python -m tpattn's on a GPU, whatever machine the plan runs on (a CPU too); "
        "--kernel reference has no cost model; --overlap is not modeled."))
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
    o.add_argument("--backward", action="store_true", help="a training step (the call and its backward, --kernel "
                   "fused): GPU time per pass, forward and backward (what a CUDA-graphed step takes)")
    o.add_argument("--crossover", action="store_true", help="with --context-parallel C: the ring against head "
                   "parallelism alone at each world size, N from 1024 to 2M, and from which N the ring is faster")
    o.add_argument("--plot", metavar="FILE", help="plot predicted speedup against ideal and the time per pass "
                   "(PNG; needs matplotlib)")
    c = p.add_argument_group("calibration (on a GPU machine)")
    c.add_argument("--calibrate", action="store_true", help="measure this machine (GEMM and copy peaks, every "
                   "kernel pass inside the layer at several sizes, the layer's overhead and host time, NCCL "
                   "all-reduce / all-gather / reduce-scatter at 8-256 MiB when launched with several ranks) and "
                   "write a machine file to --out")
    c.add_argument("--out", metavar="FILE", help="where --calibrate writes the machine file")
    c.add_argument("--name", help="the calibrated machine's name (default: GPU name and count)")
    c.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS),
                   help="kernels to calibrate (default all)")
    c.add_argument("--quick", action="store_true", help="fewer sizes and iterations (a smoke test)")
    return p


def _plan_defaults() -> dict:
    """The defaults the plan takes (shape_from) where python -m tpattn's depend on the device: the GPU's."""
    from ..config import GPU_DEFAULTS
    return {**GPU_DEFAULTS, "kernel": "naive"}


def _one_default(text: str | None, value) -> str | None:
    """python -m tpattn's help of an option whose default depends on the device ("(default 4096 on GPU,
    1024 on CPU)", "; default naive on a GPU with CuPy, else reference"), with the plan's one default
    instead; None when the help says its default some other way (then the plan's own help is used)."""
    text = re.sub(r"\s*\(default [^()]*\)$", "", text or "")
    text = re.sub(r";\s*default [^;()]*$", "", text)
    return None if re.search(r"\bdefault\b", text) else f"{text} (default {value})"


def _shape_options(group) -> None:
    """The shape options of python -m tpattn's parser, as they are there (names, choices, help), but
    for the defaults that depend on the device there: the plan's, the GPU's on any machine."""
    defaults = _plan_defaults()
    taken = set()
    try:
        from ..cli import parser as tpattn_parser
        for action in tpattn_parser()._actions:
            if action.dest in SHAPE_OPTIONS:
                if action.dest in defaults:
                    action.help = _one_default(action.help, defaults[action.dest])
                    if action.help is None:
                        continue
                group._add_action(action)
                taken.add(action.dest)
    except Exception:  # noqa: BLE001 - the CLI cannot be imported: own definitions below
        pass
    own = {
        "seq_len": (("--seq-len",), dict(type=int, metavar="N",
                                         help=f"sequence length (default {defaults['seq_len']})")),
        "heads": (("--heads",), dict(type=int, metavar="H", help=f"attention heads (default {defaults['heads']})")),
        "head_dim": (("--head-dim",), dict(type=int, metavar="d", help=f"head dim (default {defaults['head_dim']})")),
        "kv_heads": (("--kv-heads",), dict(type=int, metavar="G", help="K/V heads, GQA (default: --heads)")),
        "batch": (("--batch",), dict(type=int, default=1, metavar="B", help="batch size (default 1)")),
        "causal": (("--causal",), dict(action="store_true", help="causal mask")),
        "dtype": (("--dtype",), dict(default="fp16", choices=list(ELEM), help="storage dtype (default fp16)")),
        "kernel": (("--kernel",), dict(choices=list(KERNELS), help=f"attention kernel (default {defaults['kernel']})")),
        "reduce_dtype": (("--reduce-dtype",), dict(default="fp32", choices=["fp32", "model"],
                                                   help="dtype of the partial outputs (default fp32)")),
        "sequence_parallel": (("--sequence-parallel",), dict(action="store_true", help="sequence parallelism")),
        "output_collective": (("--output-collective",), dict(default="auto", choices=["auto", "allreduce", "split"],
                                                             help="head-parallel: all-reduce or reduce-scatter + all-gather")),
        "overlap": (("--overlap",), dict(type=int, default=1, metavar="K", help="row chunks (not modeled)")),
        "cuda_graph": (("--cuda-graph",), dict(action="store_true", help="no host time (a CUDA graph)")),
        "uneven_heads": (("--uneven-heads",), dict(action="store_true", help="world sizes that do not divide the "
                                                   "heads: ceil/floor(H/W) per rank, rank 0's predicted")),
        "context_parallel": (("--context-parallel",), dict(type=int, default=1, metavar="C",
                                                           help="ring attention over rings of C ranks (default 1)")),
        "deterministic": (("--deterministic",), dict(action="store_true", help="with --backward: the seven-product "
                                                     "backward (the same bits every run)")),
    }
    for dest, (flags, kw) in own.items():
        if dest not in taken:
            group.add_argument(*flags, dest=dest, **kw)


def shape_from(a) -> Shape:
    defaults = _plan_defaults()
    kernel = a.kernel or defaults["kernel"]
    if kernel not in KERNELS:
        raise PlanError(f"--kernel {kernel} has no cost model; use one of {', '.join(KERNELS)} (reference is "
                        "the torch check, not a kernel to plan for)")
    pick = lambda v, k: defaults[k] if v is None else v  # noqa: E731
    s = Shape(seq_len=pick(a.seq_len, "seq_len"), heads=pick(a.heads, "heads"),
              head_dim=pick(a.head_dim, "head_dim"), batch=a.batch, dtype=a.dtype, kernel=kernel,
              causal=a.causal, reduce_dtype=a.reduce_dtype, sequence_parallel=a.sequence_parallel,
              overlap=a.overlap, cuda_graph=a.cuda_graph, output_collective=getattr(a, "output_collective", "auto"),
              kv_heads=getattr(a, "kv_heads", None), uneven_heads=bool(getattr(a, "uneven_heads", False)),
              context_parallel=getattr(a, "context_parallel", 1),
              deterministic=bool(getattr(a, "deterministic", False)))
    if s.context_parallel < 1:
        raise PlanError(f"--context-parallel must be at least 1 (got {s.context_parallel}); 1 turns it off")
    if s.context_parallel > 1:
        from ..sharding import context_conflict
        conflict = context_conflict(sequence_parallel=s.sequence_parallel, cuda_graph=s.cuda_graph, overlap=s.overlap,
                                    output_collective=s.output_collective)
        if conflict:
            raise PlanError(conflict)
    if s.context_parallel > 1 and kernel != "fused":
        raise PlanError(f"--context-parallel: the cost model prices the ring's pieces as the fused kernel; add --kernel "
                        f"fused (with --kernel {kernel} the ring runs them as torch math)")
    if getattr(a, "backward", False) and kernel != "fused":
        raise PlanError("--backward: the cost model prices the backward of --kernel fused only; add --kernel fused")
    if s.deterministic and not getattr(a, "backward", False):
        raise PlanError("--deterministic changes the backward only: add --backward (or drop --deterministic)")
    if getattr(a, "crossover", False) and s.context_parallel == 1:
        raise PlanError("--crossover compares the ring with head parallelism alone: add --context-parallel C (C > 1)")
    for flag, v in (("--seq-len", s.seq_len), ("--heads", s.heads), ("--head-dim", s.head_dim),
                    ("--batch", s.batch), ("--overlap", s.overlap)):
        if v < 1:
            raise PlanError(f"{flag} must be at least 1 (got {v})")
        if v > INT_MAX:  # as python -m tpattn: the kernels index rows, heads and batches with 32-bit ints
            raise PlanError(f"{flag} {v} is past {INT_MAX}, the most any kernel here indexes")
    if s.kv_heads is not None and (s.kv_heads < 1 or s.heads % s.kv_heads):
        raise PlanError(f"--kv-heads {s.kv_heads} must divide --heads {s.heads}")
    from ..attention import get_backend
    backend = get_backend(kernel)
    err = backend.head_dim_error(s.head_dim) if hasattr(backend, "head_dim_error") else None
    if err:
        raise PlanError(err)
    if s.dtype not in backend.dtypes:
        raise PlanError(f"--kernel {kernel} does not support --dtype {s.dtype}; use one of {', '.join(backend.dtypes)}")
    return s


def world_sizes(a, shape: Shape, g: int) -> list[int]:
    if a.nodes:
        if any(n < 1 for n in a.nodes):
            raise PlanError(f"--nodes must be at least 1 (got {min(a.nodes)})")
        return [n * g for n in a.nodes]
    if a.world_sizes:
        if any(w < 1 for w in a.world_sizes):
            raise PlanError(f"--world-sizes must be at least 1 (got {min(a.world_sizes)})")
        return list(a.world_sizes)
    if shape.uneven_heads or shape.context_parallel > 1:  # any W the layout takes (W <= H; with K/V groups, W <= G
        sizes = (1, 2, 4, 8, 16) if shape.context_parallel > 1 else (1, 2, 4, 8)  # or an even layout; C divides W)
    else:
        sizes = (1, 2, 4, 8)
    worlds = [w for w in sizes if _layout_error(shape, w) is None]
    if not worlds:
        raise PlanError(f"none of the default world sizes ({', '.join(map(str, sizes))}) suits this layout (W={sizes[-1]}: "
                        f"{_layout_error(shape, sizes[-1])}); give --world-sizes")
    return worlds


# ---- the table ---------------------------------------------------------------------------------------


def _gib(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


COLL_LABEL = {"ring": "ring (exposed)", "allreduce": "all-reduce", "allgather": "all-gather",
              "reducescatter": "reduce-scatter"}


def columns(rows: list[dict]) -> tuple[list[str], list[str]]:
    ok = [r for r in rows if "error" not in r]
    comp = [p for p in COMPUTE_ORDER if any(p in r["passes"] for r in ok)]
    coll = [c for c in ("ring", *COLLECTIVE_NAMES) if any(c in r["collectives"] for r in ok)]
    coll.sort(key=lambda c: min((list(r["collectives"]).index(c) for r in ok if c in r["collectives"]), default=9))
    return comp, coll


def header(m: Machine, shape: Shape, g: int) -> list[str]:
    C = shape.context_parallel
    style = ("sequence-parallel" if shape.sequence_parallel else
             f"context-parallel (rings of {C} ranks, heads over W / {C})" if C > 1 else "head-parallel")
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


def table(m: Machine, shape: Shape, rows: list[dict], g: int, markdown: bool = False) -> str:
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
            if c == "ring":
                out.append(f"W={r['world']}: ring: {info['algorithm']}: {_gib(info['pass_bytes'])} a pass, "
                           f"{info['transfer_ms'] * 1e3:.0f} us of transfers, {info['ms'] * 1e3:.0f} us of it exposed "
                           f"(a pass outlasting its step's compute; {info['bound']}-bound)")
                continue
            woke = (f", of which {info['wake_us']:.0f} us the NVLink link's wake-up after {info['idle_before_ms']:.0f} ms "
                    f"of compute (the ranks arriving together; none when one arrives {2 * info['wake_us']:.0f} us or more "
                    "before the last)" if info.get("wake_us") else "")
            out.append(f"W={r['world']}: {COLL_LABEL[c]} of {_gib(info['bytes'])}: {info['algorithm']}, "
                       f"{info['ms'] * 1e3:.0f} us ({info['bound']}-bound){woke}")
    out.append("other = the bias + cast of the partials, the o relayout (naive, tiled; the ring's fp32 output) and the "
               "per-call overhead; "
               "end to end = max(GPU, host) + stall; (host): the Python call takes longer than the GPU work; memory/rank "
               "by tpattn.memory (the CLI's pre-flight, without --check's baseline)")
    return "\n".join(out)


def as_json(m: Machine, shape: Shape, rows: list[dict], g: int, argv: list[str]) -> dict:
    from .. import __version__
    return {
        "tpattn": __version__, "command": ["python", "-m", "tpattn.plan", *argv],
        "machine": {"name": m.name, "path": m.path, "gpu": m.data["gpu"], "gpus_per_node": g,
                    "memory_GiB": m.data["memory_GiB"], "peaks": m.data["peaks"], "links": m.data.get("links", {})},
        "config": {**{k: getattr(shape, k) for k in Shape.__dataclass_fields__}, "model_dim": shape.model_dim},
        "rows": rows,
    }


def plot(path: str, m: Machine, shape: Shape, rows: list[dict]) -> None:
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
        m = load_machine(a.machine)
    except MachineError as exc:
        raise PlanError(str(exc)) from None
    g = m.gpus_per_node if a.gpus_per_node is None else a.gpus_per_node
    if g < 1 or g > m.gpus_per_node:
        raise PlanError(f"--gpus-per-node {g}: machine {m.name} has {m.gpus_per_node} GPU(s) per node; use 1 to "
                        f"{m.gpus_per_node}")
    worlds = world_sizes(a, shape, g)
    if a.crossover:
        return run_crossover(a, argv, m, shape, worlds, g)
    if a.backward:
        return run_backward(a, argv, m, shape, worlds, g)
    rows = cm.plan(m, shape, worlds, g)
    if all("error" in r for r in rows):
        first = rows[0]
        raise PlanError(f"no world size could be predicted (W={first['world']}: {first['error']})")
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


def crossover_table(m: Machine, shape: Shape, results: list[dict], g: int, markdown: bool = False) -> str:
    """Head parallelism alone against the ring at each world size, over N: the two calls' predicted
    ms, their ratio, and from which N the ring is faster (the cost model's answer)."""
    out = header(m, shape, g)
    C = shape.context_parallel
    for res in results:
        W = res["world"]
        out.append("")
        out.append(f"W={W}: head parallelism alone (heads over {W}) against the ring (rings of {C}, heads over {W // C}); "
                   "predicted ms per call on one rank")
        heads = ["N", "heads ms", "ring ms", "ring exposed ms", "heads / ring"]
        body = []
        for row in res["rows"]:
            hm = row["heads_ms"]
            mark = lambda fits: "" if fits else " (does not fit)"  # noqa: E731
            body.append([str(row["seq_len"]), "-" if hm is None else f"{hm:.3f}{mark(row['heads_fits'])}",
                         f"{row['ring_ms']:.3f}{mark(row['ring_fits'])}", f"{row['ring_exposed_ms']:.3f}",
                         "-" if hm is None else f"{hm / row['ring_ms']:.2f}"])
        if markdown:
            out += ["", "| " + " | ".join(heads) + " |", "|" + "|".join("---:" for _ in heads) + "|"]
            out += ["| " + " | ".join(c) + " |" for c in body]
            out.append("")
        else:
            widths = [max(len(h), *(len(c[i]) for c in body)) for i, h in enumerate(heads)]
            out.append("  " + "  ".join(h.rjust(w) for h, w in zip(heads, widths)))
            out += ["  " + "  ".join(x.rjust(w) for x, w in zip(c, widths)) for c in body]
        big = res["largest_n"]
        if res["heads_error"]:
            out.append(f"W={W}: head parallelism alone cannot run: {res['heads_error']}; the ring can (largest N per "
                       f"rank's memory {big['ring']})")
            continue
        verdict = _ranges(res["rows"])
        out.append(f"W={W}: {verdict}; largest N in one GPU's memory: head parallelism {big['heads']}, the ring "
                   f"{big['ring']} ({big['ring'] / max(big['heads'], 1):.1f}x)")
    return "\n".join(out)


def _ranges(rows: list[dict]) -> str:
    """Where the ring is faster and where slower, as runs of N: "the ring is faster at N = 1024-4096,
    slower at N = 8192-2097152"."""
    runs: list[list] = []
    for row in rows:
        faster = row["ring_ms"] < row["heads_ms"]
        if runs and runs[-1][0] == faster:
            runs[-1][2] = row["seq_len"]
        else:
            runs.append([faster, row["seq_len"], row["seq_len"]])
    parts = [f"{'faster' if f else 'slower'} at N = {a}" + (f"-{b}" if b != a else "") for f, a, b in runs]
    return "the ring is " + ", ".join(parts)


def backward_table(m: Machine, shape: Shape, results: list[dict], g: int, markdown: bool = False) -> str:
    """The training step per world size: predicted GPU ms of the forward, each backward pass, the
    backward's all-reduce of dX, and the whole step."""
    out = header(m, shape, g)
    names = list(dict.fromkeys(k for r in results for k in (*r["backward_passes"], *r["backward_collectives"])))
    heads = ["W", "forward", *names, "backward", "step (GPU)"]
    body = [[str(r["world"]), f"{r['forward_ms']:.3f}",
             *(f"{({**r['backward_passes'], **r['backward_collectives']}).get(n, 0.0):.3f}" for n in names),
             f"{r['backward_ms']:.3f}", f"{r['gpu_ms']:.3f}"] for r in results]
    out.append("")
    out.append("a training step, predicted GPU ms on one rank (a CUDA-graphed step; the host is not modeled)")
    if markdown:
        out += ["", "| " + " | ".join(heads) + " |", "|" + "|".join("---:" for _ in heads) + "|"]
        out += ["| " + " | ".join(c) + " |" for c in body]
    else:
        widths = [max(len(h), *(len(c[i]) for c in body)) for i, h in enumerate(heads)]
        out.append("  " + "  ".join(h.rjust(w) for h, w in zip(heads, widths)))
        out += ["  " + "  ".join(x.rjust(w) for x, w in zip(c, widths)) for c in body]
    return "\n".join(out)


def run_backward(a, argv: list[str], m: Machine, shape: Shape, worlds: list[int], g: int) -> int:
    results, skipped = [], []
    for w in worlds:
        try:
            results.append(cm.predict_training(m, shape, w, g))
        except ModelError as exc:
            skipped.append(f"W={w}: not predicted: {exc}")
    if not results:
        raise PlanError("--backward: no world size could be predicted" + (f" ({skipped[0]})" if skipped else ""))
    doc = {**as_json(m, shape, [], g, argv), "training": results, "not_predicted": skipped}
    if a.json == "-":
        print(json.dumps(doc, indent=1))
        return 0
    if a.json:
        _write(a.json, json.dumps(doc, indent=1), "--json")
    print("\n".join([backward_table(m, shape, results, g, a.markdown), *skipped]))
    return 0


def run_crossover(a, argv: list[str], m: Machine, shape: Shape, worlds: list[int], g: int) -> int:
    results, skipped = [], []
    for w in worlds:
        if w == 1:
            continue
        try:
            err = _layout_error(shape, w)
            if err:
                raise ModelError(err)
            results.append(cm.crossover(m, shape, w, g))
        except ModelError as exc:  # this world size only (the machine's nodes, the layout): said, and the rest run
            skipped.append(f"W={w}: not predicted: {exc}")
    if not results:
        raise PlanError("--crossover: no world size could be predicted" + (f" ({skipped[0]})" if skipped else
                        "; it needs one above 1 that --context-parallel divides (--world-sizes)"))
    doc = {**as_json(m, shape, [], g, argv), "crossover": results, "not_predicted": skipped}
    if a.json == "-":
        print(json.dumps(doc, indent=1))
        return 0
    if a.json:
        _write(a.json, json.dumps(doc, indent=1), "--json")
    print("\n".join([crossover_table(m, shape, results, g, a.markdown), *skipped]))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        a = parser().parse_args(argv)
        if a.calibrate:
            return calibrate(a, argv)
        if a.out:
            raise PlanError("--out is where --calibrate writes; add --calibrate (or use --json for a prediction)")
        only = [f for f, on in (("--name", a.name), ("--quick", a.quick),
                                ("--kernels", a.kernels != list(KERNELS))) if on]
        if only:
            raise PlanError(f"{only[0]} is an option of --calibrate; add --calibrate (or drop {only[0]})")
        if a.markdown and a.json == "-":
            raise PlanError("--markdown formats the table, and --json without a path prints JSON instead of it: "
                            "give --json a path, or drop one of them")
        return run_plan(a, argv)
    except (PlanError, MachineError) as exc:
        print(f"tpattn.plan: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except ModelError as exc:
        print(f"tpattn.plan: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
