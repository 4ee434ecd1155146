#!/usr/bin/env python3
"""A table of layer runs from their --json reports: end to end, per pass, the collectives' busbw and
how much of the communication was hidden.

    python scripts/layer_table.py results/speed/*.json [--md OUT.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tpattn.commplan import RING_PASSES  # noqa: E402

PASSES = ("qkv_proj", "fused", "qk", "softmax", "pv", "out_proj", "allreduce", "allgather", "reducescatter")


def row(rep: dict) -> dict:
    c, p = rep["config"], rep["passes"]
    cmd = " ".join([f"{k}={v}" for k, v in rep.get("env", {}).items() if k not in ("NCCL_NVLS_ENABLE", "NCCL_VERSION")]
                   + rep["command"][3:]) or "(defaults)"
    colls = rep.get("collectives") or {}
    e = rep.get("exposure") or {}
    return {"world": rep["world"]["size"], "args": cmd, "verdict": rep["verdict"],
            "total": p["total"]["max"], "host": p.get("host", {}).get("median"),
            **{k: p[k]["median"] for k in PASSES if k in p},
            # (the ring's passes travel behind the compute: their time is no transfer's, so no bandwidth)
            "busbw": ", ".join(f"{k} {v['busbw_last_rank_GBps']:.0f}" for k, v in colls.items() if k not in RING_PASSES),
            "exposed": e.get("exposed_ms"), "hidden": e.get("hidden_share"), "kernel": c["kernel"]}


def fmt(v, spec="{:.3f}"):
    return "" if v is None else spec.format(v)


def fail(msg: str):
    print(msg, file=sys.stderr)
    raise SystemExit(2)


def read(path: str) -> dict:
    """A report's row, or SystemExit with one line that says what is wrong with the file."""
    try:
        rep = json.loads(Path(path).read_text())
    except OSError as exc:
        fail(f"layer_table: error: {path}: {exc.strerror or exc}")
    except ValueError:
        fail(f"layer_table: error: {path} is not JSON; give the --json report of python -m tpattn")
    try:
        return row(rep)
    except (KeyError, TypeError, IndexError) as exc:
        fail(f"layer_table: error: {path} is not a --json report of python -m tpattn (no {exc})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--md", help="also write the table as markdown here")
    a = ap.parse_args()
    if a.md and not Path(a.md).resolve().parent.is_dir():
        fail(f"layer_table: error: --md {a.md}: its folder does not exist; create it or choose another path")
    rows = [read(f) for f in a.reports]
    head = ["W", "python -m tpattn ...", "total ms (max over ranks)", "host ms", *PASSES,
            "busbw GB/s (last rank)", "exposed ms", "hidden", "check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([str(r["world"]), r["args"], fmt(r["total"]), fmt(r["host"]),
                                         *(fmt(r.get(k)) for k in PASSES), r["busbw"], fmt(r["exposed"]),
                                         fmt(r["hidden"], "{:.0%}"), r["verdict"]]) + " |")
    text = "\n".join(lines)
    print(text)
    if a.md:
        Path(a.md).write_text(text + "\n")


if __name__ == "__main__":
    main()
