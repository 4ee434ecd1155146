"""scripts/gpu_runs.sh fp8tune on the CPU with stand-ins for nvidia-smi, ncu and python3 that record what
they were asked to run: every script it runs gets options that script takes, and Nsight Compute profiles
both forwards, exports the details and the SASS source page, and hands them to scripts/ncu_fp8.py.
(The runs themselves need a GPU of compute capability 9.0.)"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

from conftest import ROOT, run_gpu_runs

STAND_IN = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$LOG"
exit 0
"""


def test_fp8tune_runs_each_tool_with_options_it_takes(tmp_path):
    r, logged = run_gpu_runs(tmp_path, "fp8tune", STAND_IN, ("nvidia-smi", "python3", "ncu"), timeout=300)
    assert r.returncode == 0 and "where the FP8 kernels' time goes" in r.stdout, r.stdout + r.stderr
    calls = [shlex.split(c) for c in logged]
    scripts = {}
    for argv in calls:
        at = next((i for i, a in enumerate(argv) if a.startswith("scripts/")), None)
        if at is not None:
            scripts.setdefault(argv[at], []).append(argv[at + 1:])
    assert set(scripts) == {"scripts/sweep_decode_splits.py", "scripts/bench_paged.py", "scripts/ab_fp8.py",
                            "scripts/trace_fused.py", "scripts/ncu_fp8.py"}
    for script, runs in scripts.items():
        helped = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True,
                                timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""})
        takes = set(re.findall(r"--[a-z][a-z0-9-]*", helped.stdout))
        for opts in runs:
            assert {o for o in opts if o.startswith("--")} <= takes, (script, opts)
    profiled = [a for a in calls if a[0] == "ncu" and "--profile-from-start" in a]
    assert sorted(a[a.index("--contender") + 1] for a in profiled) == ["fp16", "fp8"]
    assert all("--import-source" in a and "--set" in a and a[a.index("--set") + 1] == "full" for a in profiled)
    pages = [a[a.index("--page") + 1] for a in calls if a[0] == "ncu" and "--page" in a]
    assert sorted(pages) == ["details", "details", "source", "source"]
    opcodes = [o for o in scripts["scripts/ncu_fp8.py"] if "--opcodes" in o]
    assert len(opcodes) == 1 and opcodes[0][1].endswith("fwd_fp8_sass.csv")


def test_fp8tune_traces_the_default_build_and_the_exponentials_turn(tmp_path):
    r, logged = run_gpu_runs(tmp_path, "fp8tune", STAND_IN, ("nvidia-smi", "python3", "ncu"), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    traces = [shlex.split(c) for c in logged if "scripts/trace_fused.py" in c]
    builds = sorted(a[a.index("--fp8-build") + 1] if "--fp8-build" in a else "default" for a in traces)
    assert builds == ["0:0:1:2", "default"] and all("--fp8" in a for a in traces)
    assert len({a[a.index("--name") + 1] for a in traces}) == 2  # each its own JSON
