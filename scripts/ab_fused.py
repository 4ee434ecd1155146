#!/usr/bin/env python3
"""Builds of the warp-specialized fused kernel (kernels/fused_ws_attention.cu, fusedw) side by side in
one process: the working tree's against the same file, with its headers, at other git revisions, and
the working tree's kernels of that file by name (--configs, as TPATTN_FUSED_CFG names them: fusedw
against fusedw3 at d = 64; a kernel a shape has no such name for is left out of that row).

Differences of a few percent between kernel builds drown in the drift between two benchmark runs (the
same kernel and cuDNN each move by up to 5 %), so every build is compiled under its own name and timed
in the same rounds: each call captured `--reps` times in a CUDA graph, two replays of every graph to
warm up, then `--rounds` rounds that replay every build's graph and SDPA cuDNN's once each. Reported
per shape: the median and the best ms per call over the rounds, cuDNN's median over each build's,
whether each build's output is bit-identical to the working tree's, and each build's largest error
against fp32 SDPA on two heads. Writes OUT/NAME.json and .md (GPU, versions, command, commit).

    PYTHONPATH=. python scripts/ab_fused.py --against e31c956 [--only "ViT-B/16" "d64 long"]
        [--rounds 11] [--reps 20] [--out benchmarks/fused_shapes_h200] [--name ab_e31c956]
    PYTHONPATH=. python scripts/ab_fused.py --configs "fusedw_{suf}_d{d}" "fusedw3_{suf}_d{d}" --name ab_fusedw3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_kernels import SHAPE_SETS, git_commit, sh  # noqa: E402
from tpattn.cuda import kernel_source  # noqa: E402
from tpattn.report import versions  # noqa: E402

KERNEL = "fused_ws_attention.cu"
_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.M)


class RevisionError(ValueError):
    pass


def source_at(rev: str, filename: str = KERNEL, _seen: set | None = None) -> str:
    """kernels/`filename` at git revision `rev` with its local headers inlined from the same revision
    (as tpattn.cuda.kernel_source does for the working tree), or the text of the file `rev` where that
    is a file (a copy of the tree whose .git lacks the revision: `--save-source`). A revision git does
    not know: RevisionError."""
    seen = set() if _seen is None else _seen
    if _seen is None and rev.endswith(".cu"):  # a file: the kernel with its headers already inlined
        if not Path(rev).is_file():
            raise RevisionError(f"ab_fused: no file {rev!r}; write one with --save-source REV {rev}")
        return Path(rev).read_text()
    text = sh(["git", "show", f"{rev}:kernels/{filename}"])
    if text is None:
        raise RevisionError(f"ab_fused: git has no kernels/{filename} at {rev!r}; give a commit of this repository")

    def inline(m: re.Match) -> str:
        if m.group(1) in seen:
            return ""
        seen.add(m.group(1))
        return re.sub(r"^#pragma once[ \t]*\n", "", source_at(rev, m.group(1), seen), flags=re.M)
    return _INCLUDE.sub(inline, text + "\n")


def label_of(rev: str) -> str:
    """The column label and file-name part of a build: a revision as given, a .cu file by its stem."""
    return Path(rev).stem if rev.endswith(".cu") else rev


def build(name: str, src: str, kernel: str = KERNEL) -> None:
    """Compile `src` (a build of kernels/`kernel`) as the module of a file called `name` on the current
    device, where tpattn's launcher looks for it (tpattn.cuda keeps one module per device and file name)."""
    import cupy
    import tpattn.cuda as tc
    tc.ARCH_SPECIFIC[name] = tc.ARCH_SPECIFIC[kernel]
    dev = torch.cuda.current_device()
    with cupy.cuda.Device(dev):
        tc._modules[(dev, name)] = tc._compile(cupy, kernel, src)


def use(name: str) -> None:
    """The fused backend's next calls launch fusedw from the module built as `name` (the 64/128 module's
    place: head dims 64 and 128; the others come from fused_ws_dims.cu whatever `name` is)."""
    import tpattn.attention.fused as fused
    fused.WS_SOURCE = name
    fused._kernels.clear()
    fused._prepared.clear()


def graph(fn, reps: int):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return g


def replay_ms(g, reps: int) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def run(args) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from tpattn.attention import get_backend
    from tpattn.config import ConfigError
    revs = {"tree": None, **{label_of(rev): rev for rev in args.against}}
    for label, rev in revs.items():
        build(f"ab_{label}.cu", kernel_source(KERNEL) if rev is None else source_at(rev))
    # label -> (module, TPATTN_FUSED_CFG or None: the kernel the backend picks), the order of the columns
    variants = {label: (f"ab_{label}.cu", None) for label in revs}
    variants.update({cfg.split("_{suf}")[0]: ("ab_tree.cu", cfg) for cfg in args.configs})
    fused = get_backend("fused")
    shapes = [s for s in SHAPE_SETS["users"] if not args.only or s["name"] in args.only]
    rows = []
    for s in shapes:
        b, h, g, n, d = s["batch"], s["heads"], s["kv_heads"], s["seq_len"], s["head_dim"]
        dtype = torch.bfloat16 if s["dtype"] == "bf16" else torch.float16
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(b, g, n, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
        # bufs: each graph writes into its build's output; held here while the graph lives (a freed one
        # could be handed back to the driver by the next capture, and the replays would write there)
        outs, graphs, bufs = {}, {}, {}
        for label, (module, cfg) in variants.items():
            use(module)
            os.environ.pop("TPATTN_FUSED_CFG", None)
            if cfg:
                os.environ["TPATTN_FUSED_CFG"] = cfg
            o = bufs[label] = torch.empty_like(q)
            try:
                fused.forward(q, k, v, s["causal"], out=o)
            except ConfigError:  # no kernel of that name for this shape's head dim
                continue
            torch.cuda.synchronize()
            outs[label] = o.clone()
            graphs[label] = graph(lambda o=o: fused.forward(q, k, v, s["causal"], out=o), args.reps)
        os.environ.pop("TPATTN_FUSED_CFG", None)
        ran = [label for label in variants if label in outs]
        kk, vv = (k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1)) if g != h else (k, v)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            graphs["cudnn"] = graph(lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=s["causal"]), args.reps)
        ref = F.scaled_dot_product_attention(q[:1, :2].float(), kk[:1, :2].float(), vv[:1, :2].float(),
                                             is_causal=s["causal"])
        for _ in range(2):
            for gr in graphs.values():
                replay_ms(gr, args.reps)
        times = {label: [] for label in graphs}
        for _ in range(args.rounds):
            for label, gr in graphs.items():
                times[label].append(replay_ms(gr, args.reps))
        med = {label: statistics.median(t) for label, t in times.items()}
        row = {**s, "median_ms": med, "best_ms": {label: min(t) for label, t in times.items()},
               "cudnn_over": {label: med["cudnn"] / med[label] for label in ran},
               "same_bits_as_tree": {label: torch.equal(outs[label], outs["tree"]) for label in ran},
               "max_err_vs_fp32": {label: (outs[label][:1, :2].float() - ref).abs().max().item() for label in ran}}
        rows.append(row)
        print(f"  {s['name']:20s} " + "  ".join(f"{label} {med[label]:.4f}" for label in graphs)
              + "  cuDNN/build " + " ".join(f"{row['cudnn_over'][label]:.3f}" for label in ran), flush=True)
    return {"gpu": torch.cuda.get_device_name(), "versions": versions(), "command": "python " + shlex.join(sys.argv),
            "commit": git_commit(args.commit), "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "builds": {label: revs.get(label) or ("the working tree" + (f", TPATTN_FUSED_CFG={cfg}" if cfg else ""))
                       for label, (_, cfg) in variants.items()},
            "rounds": args.rounds, "reps": args.reps, "rows": rows}


def markdown(res: dict) -> str:
    builds = list(res["builds"])
    lines = [f"# fusedw builds side by side on {res['gpu']}", "",
             f"Command: `{res['command']}`  ", f"Date: {res['date_utc']}; commit: {res['commit']}  ",
             f"Versions: {res['versions']}", "",
             "Builds: " + "; ".join(f"`{label}` = {what}" for label, what in res["builds"].items()) + ". "
             f"Median (best) ms per call over {res['rounds']} interleaved rounds of CUDA-graph replays "
             f"({res['reps']} calls a graph); cuDNN / build from the medians; `same bits`: the output equals "
             "the working tree's.", "",
             "| shape | " + " | ".join(f"{b} ms" for b in builds) + " | cuDNN ms | "
             + " | ".join(f"cuDNN / {b}" for b in builds) + " | same bits |",
             "|" + "---|" * (2 + 2 * len(builds) + 1)]
    for r in res["rows"]:
        lines.append(f"| {r['name']} | " + " | ".join(f"{r['median_ms'][b]:.4f} ({r['best_ms'][b]:.4f})"
                                                      if b in r["cudnn_over"] else "-" for b in builds)
                     + f" | {r['median_ms']['cudnn']:.4f} | "
                     + " | ".join(f"{r['cudnn_over'][b]:.3f}" if b in r["cudnn_over"] else "-" for b in builds)
                     + " | " + ("yes" if all(r["same_bits_as_tree"].values()) else
                                ", ".join(b for b, same in r["same_bits_as_tree"].items() if not same) + " differ")
                     + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", nargs="+", default=[], metavar="REV",
                   help="git revisions whose kernels/fused_ws_attention.cu (with its headers) run beside the "
                        "working tree's, or .cu files written by --save-source (labelled by their stem)")
    p.add_argument("--save-source", nargs=2, default=None, metavar=("REV", "FILE.cu"),
                   help="write the kernel at REV with its headers inlined to FILE.cu and stop (for a copy of the "
                        "tree without that revision: --against FILE.cu there)")
    p.add_argument("--configs", nargs="+", default=[], metavar="CFG",
                   help="kernels of the working tree's file by TPATTN_FUSED_CFG name, each timed beside it "
                        "(e.g. \"fusedw_{suf}_d{d}\" \"fusedw3_{suf}_d{d}\")")
    p.add_argument("--only", nargs="+", default=None, metavar="SHAPE",
                   help="shapes of the users set by name (default all: " + ", ".join(
                       s["name"] for s in SHAPE_SETS["users"]) + ")")
    p.add_argument("--rounds", type=int, default=11, help="interleaved rounds of replays (default 11)")
    p.add_argument("--reps", type=int, default=20, help="calls captured in each graph (default 20)")
    p.add_argument("--out", default="benchmarks/fused_shapes_h200", help="folder for NAME.json and NAME.md")
    p.add_argument("--name", default=None, help="file stem (default ab_ and the revisions)")
    p.add_argument("--commit", default=None,
                   help="the commit to record, for a tree copied to another machine whose .git differs")
    args = p.parse_args()
    if args.save_source:
        if not args.save_source[1].endswith(".cu"):
            print(f"ab_fused: --save-source writes a .cu file (got {args.save_source[1]!r})", file=sys.stderr)
            return 2
        try:
            Path(args.save_source[1]).write_text(source_at(args.save_source[0]))
        except RevisionError as exc:
            print(exc, file=sys.stderr)
            return 2
        return 0
    if not args.against and not args.configs:
        print("ab_fused: nothing to compare: give --against REV... or --configs CFG...; see --help", file=sys.stderr)
        return 2
    bad = [c for c in args.configs if not re.fullmatch(r"fusedw3?_\{suf\}_d\{d\}", c)]
    if bad:
        print(f"ab_fused: --configs {bad[0]!r} is not a fusedw kernel name such as fusedw3_{{suf}}_d{{d}}",
              file=sys.stderr)
        return 2
    unknown = sorted(set(args.only or []) - {s["name"] for s in SHAPE_SETS["users"]})
    if unknown:
        print(f"ab_fused: no shape {unknown[0]!r} in the users set; see --help", file=sys.stderr)
        return 2
    try:
        for rev in args.against:
            source_at(rev)  # a revision git does not know: one line, before any GPU work
    except RevisionError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("ab_fused: needs a GPU of compute capability 9.0 (fusedw is sm_90a) and CuPy; nothing to measure here",
              file=sys.stderr)
        return 2
    res = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or "ab_" + "_".join([label_of(r) for r in args.against] + [c.split("_{suf}")[0] for c in args.configs])
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    (out / f"{stem}.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
