#!/usr/bin/env python3
"""Regenerate the tables of benchmarks/model_predictions.md from the shipped machine files, after a
recalibration changed them: each table is rerun with the command written above it (its --markdown
rows), and its last row, the 8 nodes of 4 GPUs, with the same command at --nodes 8 --gpus-per-node 4
in place of --world-sizes. The prose around the tables is left as it is (its numbers are yours to check).

    python scripts/model/refresh_predictions.py            # rewrite the file in place
    python scripts/model/refresh_predictions.py --check    # exit 1 if a table differs from the machine files
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tpattn.model import cli  # noqa: E402

HEADER = re.compile(r"^\*\*.*\*\* — `python -m tpattn\.plan (?P<args>[^`]+)`$")
EIGHT_NODES = ["--nodes", "8", "--gpus-per-node", "4"]


def rows(args: list[str]) -> list[str]:
    """The markdown table rows (header and rule included) that `python -m tpattn.plan ARGS --markdown` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main([*args, "--markdown"])
    if code:
        raise SystemExit(f"refresh_predictions: python -m tpattn.plan {' '.join(args)} exited {code}")
    return [ln for ln in out.getvalue().splitlines() if ln.startswith("|")]


def table_for(args: list[str]) -> list[str]:
    """A table as the file has it: the command's rows, then the 8-node row (same shape, 32 ranks)."""
    got = rows(args)
    i = args.index("--world-sizes")
    sizes = []
    for v in args[i + 1:]:
        if v.startswith("--"):
            break
        sizes.append(v)
    rest = args[:i] + args[i + 1 + len(sizes):]
    if "32" in sizes:
        got += rows([*rest, *EIGHT_NODES])[2:]   # --nodes sets the world size (8 x 4)
    return got


def refresh(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        m = HEADER.match(lines[i])
        i += 1
        if not m:
            continue
        while i < len(lines) and not lines[i].startswith("|"):   # the blank line(s) before the table
            out.append(lines[i])
            i += 1
        while i < len(lines) and lines[i].startswith("|"):       # the old table
            i += 1
        out += table_for(shlex.split(m["args"]))
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/model/refresh_predictions.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--file", default=str(ROOT / "benchmarks" / "model_predictions.md"))
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is out of date")
    a = p.parse_args(argv)
    path = Path(a.file)
    try:
        old = path.read_text()
    except OSError as exc:
        print(f"refresh_predictions: error: --file {path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    new = refresh(old)
    if a.check:
        stale = [ln for ln in new.splitlines() if ln.startswith("|") and ln not in old.splitlines()]
        print(f"{len(stale)} table row(s) out of date" + (f", e.g. {stale[0]}" if stale else ""))
        return 1 if stale else 0
    path.write_text(new)
    print(f"rewrote the tables of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
