#!/usr/bin/env python3
"""PNG plots of the benchmarks (matplotlib, Agg backend: no display needed).

    python scripts/plots.py kernels benchmarks/kernels.json [--out benchmarks/kernels.png]
    python scripts/plots.py scaling benchmarks/scaling_h200.json [--out-dir benchmarks]

kernels: time against N for each kernel and peer of scripts/bench_kernels.py, log-log, one panel
per head count, with the three-pass memory floor (S and P written and read once at the measured
copy bandwidth). scaling: re-draws the two plots of scripts/scaling.py from its JSON: per-pass
stacked bars for each world size (beside the PyTorch peer's time) and speedup against ideal.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COMPUTE_PASSES = ("qkv_proj", "qk", "softmax", "pv", "out_proj")
PASS_LABELS = {"qkv_proj": "Q/K/V projection", "qk": "QK^T (S)", "softmax": "softmax (P)", "pv": "PV (O)",
               "out_proj": "output projection", "allreduce": "all-reduce"}
PASS_COLORS = {"qkv_proj": "#8da0cb", "qk": "#e78ac3", "softmax": "#a6d854", "pv": "#ffd92f",
               "out_proj": "#66c2a5", "allreduce": "#fc8d62"}
KERNEL_LABELS = {"naive": "naive (tpattn, 3 CUDA kernels)", "torch_materialized": "torch matmul/softmax/matmul",
                 "sdpa_flash": "torch SDPA: flash", "sdpa_cudnn": "torch SDPA: cuDNN",
                 "sdpa_efficient": "torch SDPA: mem-efficient", "tiled": "tiled (tpattn, 3 passes, tensor cores)",
                 "fused": "fused (tpattn, online softmax)", "tiled[mma]": "tiled, mma.sync QK/PV (any GPU)",
                 "fused[2:w4_m1_c64]": "fused2, mma.sync (any GPU)"}
KERNEL_STYLE = {"naive": ("#d62728", "o", "-"), "torch_materialized": ("#1f77b4", "s", "-"),
                "sdpa_flash": ("#2ca02c", "^", "--"), "sdpa_cudnn": ("#9467bd", "v", "--"),
                "sdpa_efficient": ("#8c564b", "D", "--"), "tiled": ("#ff7f0e", "P", "-"),
                "fused": ("#17becf", "X", "-")}


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return path


# ---- kernel benchmark ---------------------------------------------------------------------------

def kernels(res: dict, path) -> Path:
    """Time against N per kernel (one panel per head count), with the memory floor."""
    rows = res["rows"]
    if not rows:
        raise ValueError("the kernel benchmark has no rows")
    heads = sorted({r["heads"] for r in rows})
    names = [k for k in KERNEL_LABELS if any(r["kernel"] == k for r in rows)]
    names += sorted({r["kernel"] for r in rows} - set(names))
    fig, axes = plt.subplots(1, len(heads), figsize=(6.2 * len(heads), 5.0), squeeze=False)
    r0 = rows[0]
    for ax, h in zip(axes[0], heads):
        mine = [r for r in rows if r["heads"] == h]
        for name in names:
            pts = sorted((r["seq_len"], r["ms"]) for r in mine if r["kernel"] == name)
            if not pts:
                continue
            color, marker, ls = KERNEL_STYLE.get(name, (None, "x", ":"))
            ax.plot(*zip(*pts), marker=marker, ls=ls, color=color, label=KERNEL_LABELS.get(name, name))
        floor = sorted({(r["seq_len"], r["floor_ms"]) for r in mine})
        ax.plot(*zip(*floor), ls=":", lw=2, color="black",
                label=f"memory floor of the 3-pass algorithm: S and P\nwritten + read once at {res.get('copy_GBps', 0):.0f} GB/s "
                      "copy bw (fused kernels never write S or P, so they can go below)")
        ns = sorted({r["seq_len"] for r in mine})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns])
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("time per attention call (ms, median)")
        ax.set_title(f"{h} head{'s' if h > 1 else ''}, d={r0['head_dim']}, B={r0['batch']}, {r0['dtype']}"
                     f"{', causal' if r0.get('causal') else ''}")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="upper center", ncol=3, bbox_to_anchor=(0.5, 0.0))
    fig.suptitle(f"Attention kernels on {res.get('gpu', '?')}: time against N "
                 f"(torch {res.get('versions', {}).get('torch', '?')})")
    return _save(fig, path)


# ---- scaling sweep --------------------------------------------------------------------------------

def _ran(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("e2e_ms") is not None]


def _world_label(r: dict) -> str:
    return f"{r['world']} rank{'s' if r['world'] > 1 else ''}\n{r['setup_short']}"


def scaling_passes(sweep: dict, path) -> Path:
    """Per world size: a stacked bar of the passes (each pass at its slowest rank) and, beside
    it, the PyTorch peer's end-to-end time; the measured end to end is written on top."""
    rows = _ran(sweep["rows"])
    if not rows:
        raise ValueError("no world size produced timings")
    fig, ax = plt.subplots(figsize=(max(6.5, 2.2 * len(rows) + 2.5), 5.2))
    xs = list(range(len(rows)))
    has_peer = any((r.get("peer") or {}).get("peer_ms") for r in rows)
    has_plain = any((r.get("peer") or {}).get("plain_ms") for r in rows)
    nbar = 1 + has_peer + has_plain
    w = {1: 0.6, 2: 0.38, 3: 0.27}[nbar]
    off = -w * (nbar - 1) / 2
    stacked = (*COMPUTE_PASSES, "allreduce")
    bottoms = [0.0] * len(rows)
    for p in stacked:
        vals = [r["passes_ms"].get(p, 0.0) for r in rows]
        ax.bar([x + off for x in xs], vals, w, bottom=bottoms, color=PASS_COLORS[p],
               label=f"tpattn: {PASS_LABELS[p]}", edgecolor="white", linewidth=0.5)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for i, (x, r, b) in enumerate(zip(xs, rows, bottoms)):
        ax.hlines(r["e2e_ms"], x + off - w / 2, x + off + w / 2, colors="black", lw=2.2,
                  label="tpattn: end to end (slowest rank)" if i == 0 else None)
        ax.text(x + off, max(b, r["e2e_ms"]), f"{r['e2e_ms']:.3g} ms\nend to end", ha="center", va="bottom",
                fontsize=8)
    top = max(max(bottoms), max(r["e2e_ms"] for r in rows))
    shift = off + w
    for key, show, color, hatch, label in (
            ("peer_ms", has_peer, "#bbbbbb", "//", "peer: PyTorch TP (DTensor) + SDPA (end to end)"),
            ("plain_ms", has_plain, "#9ecae1", "\\\\", "peer: plain TP + SDPA, gpt-fast style (end to end)")):
        if not show:
            continue
        pv = [(r.get("peer") or {}).get(key) or 0.0 for r in rows]
        ax.bar([x + shift for x in xs], pv, w, color=color, hatch=hatch, edgecolor="#555555", label=label)
        for x, v in zip(xs, pv):
            if v:
                ax.text(x + shift, v, f"{v:.3g} ms", ha="center", va="bottom", fontsize=7)
        top = max(top, max(pv))
        shift += w
    ax.set_ylim(0, top * 1.25)
    ax.set_xticks(xs)
    ax.set_xticklabels([_world_label(r) for r in rows], fontsize=8)
    ax.set_xlabel("world size (ranks) and how they run")
    ax.set_ylabel("time per layer call (ms; each pass at its slowest rank)")
    ax.set_title(f"tpattn per pass by world size: {sweep['shape_label']}\n{sweep['machine_label']}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def scaling_speedup(sweep: dict, path) -> Path:
    """Measured speedup (tpattn, and the peer) against the ideal speedup = world size."""
    rows = [r for r in _ran(sweep["rows"]) if r.get("speedup") is not None]
    if not rows:
        raise ValueError("no speedup to plot (the 1-rank run is needed as the base)")
    fig, ax = plt.subplots(figsize=(6.8, 5.0))
    ws = [r["world"] for r in rows]
    ax.plot(ws, ws, ls="--", color="black", label="ideal (speedup = ranks)")
    ax.plot(ws, [r["speedup"] for r in rows], marker="o", color="#d62728", label="tpattn (end to end)")
    for r in rows:
        ax.annotate(f"{r['speedup']:.2f}x\n({100 * r['efficiency']:.0f}%)", (r["world"], r["speedup"]),
                    textcoords="offset points", xytext=(6, -18), fontsize=8)
    peer = [(r["world"], r["peer_speedup"]) for r in rows if r.get("peer_speedup") is not None]
    if peer:
        ax.plot(*zip(*peer), marker="s", ls="-", color="#7f7f7f", label="peer: PyTorch TP (DTensor) + SDPA")
    plain = [(r["world"], r["plain_speedup"]) for r in rows if r.get("plain_speedup") is not None]
    if plain:
        ax.plot(*zip(*plain), marker="^", ls="-", color="#3182bd", label="peer: plain TP + SDPA (gpt-fast style)")
    peer = peer + plain
    shared = [r["world"] for r in rows if r.get("shares_gpu")]
    if shared:
        ax.axvspan(min(shared) - 0.3, max(shared) + 0.3, color="#fdd49e", alpha=0.35,
                   label="ranks share one GPU (gloo):\nno speedup expected")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(ws)
    ax.set_xticklabels([str(w) for w in ws])
    lo = min([r["speedup"] for r in rows] + [p for _, p in peer] + [1.0])
    hi = max([r["speedup"] for r in rows] + [p for _, p in peer] + ws)
    ticks = [2.0 ** e for e in range(math.floor(math.log2(lo)), math.ceil(math.log2(hi)) + 1)]
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"{t:g}" for t in ticks])
    ax.set_ylim(lo * 0.7, hi * 1.4)
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("speedup over 1 rank (end to end)")
    ax.set_title(f"Speedup against ideal: {sweep['shape_label']}\n{sweep['machine_label']}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernels", help="plot scripts/bench_kernels.py's JSON")
    k.add_argument("json", help="e.g. benchmarks/kernels.json")
    k.add_argument("--out", help="PNG path (default: the JSON's path with .png)")
    s = sub.add_parser("scaling", help="re-plot scripts/scaling.py's JSON")
    s.add_argument("json", help="e.g. benchmarks/scaling_h200.json")
    s.add_argument("--out-dir", help="folder for the PNGs (default: the JSON's folder)")
    a = p.parse_args(argv)
    src = Path(a.json)
    try:
        data = json.loads(src.read_text())
    except (OSError, ValueError) as exc:
        print(f"plots: cannot read {src}: {exc}", file=sys.stderr)
        return 2
    want = {"kernels": ("rows", "scripts/bench_kernels.py's"), "scaling": ("rows", "scripts/scaling.py's")}[a.what]
    if not isinstance(data, dict) or want[0] not in data or "config" in data and "passes" in data:
        print(f"plots: {src} is not {want[1]} JSON (a python -m tpattn --json report is one run, not a table); "
              f"give e.g. {'benchmarks/kernels.json' if a.what == 'kernels' else 'benchmarks/scaling_h200.json'}",
              file=sys.stderr)
        return 2
    if a.what == "kernels":
        print(kernels(data, a.out or src.with_suffix(".png")))
    else:
        out = Path(a.out_dir) if a.out_dir else src.parent
        stem = src.stem
        print(scaling_passes(data, out / f"{stem}_passes.png"))
        print(scaling_speedup(data, out / f"{stem}_speedup.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
