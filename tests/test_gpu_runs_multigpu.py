"""scripts/gpu_runs.sh multigpu on the CPU with stand-ins for nvidia-smi (8 GPUs), mpirun and python3 that
record what they were asked to run: every part of the section runs for W = 1, 2, 4, 8, and every option
it hands to python -m tpattn, scripts/peer_tp.py (tpattn's parser) and the other scripts is one they take.
(The runs themselves need a node of several GPUs.)"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

from conftest import ROOT, run_gpu_runs
from tpattn.cli import parser

STAND_IN = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$LOG"
case "$(basename "$0") $1" in
  "nvidia-smi -L") for i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H200 (UUID: GPU-$i)"; done ;;
  "nvidia-smi "*) echo "NVIDIA H200, 580.159.04, 143771 MiB" ;;
esac
exit 0
"""


def recorded(tmp_path) -> list[str]:
    # nccl_faults.sh's pauses and its watchdog (sleep, then pkill of the run's command line): nothing runs here.
    # With sleep returning at once a real pkill could kill a stand-in mpirun before it had logged its call
    r, calls = run_gpu_runs(tmp_path, "multigpu", STAND_IN, ("nvidia-smi", "mpirun", "python3"), ("sleep", "pkill"))
    assert "multigpu: world sizes 1 2 4 8 on 8 GPU(s)" in r.stdout, r.stdout + r.stderr
    return calls


def script_options(cmd: list[str]) -> set[str]:
    out = subprocess.run([sys.executable, *cmd, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return set(re.findall(r"--[a-z][a-z0-9-]*", out.stdout))


def test_every_part_runs_at_every_world_size_with_options_the_tools_take(tmp_path):
    calls = recorded(tmp_path)
    runs = [shlex.split(c) for c in calls if c.startswith("mpirun ")]
    worlds = {}
    for argv in runs:
        w = int(argv[argv.index("-n") + 1])
        what = argv[argv.index("python3") + 1:]
        key = "tpattn" if what[:2] == ["-m", "tpattn"] else what[0] if not what[0].startswith("-") else " ".join(what[:2])
        worlds.setdefault(key, set()).add(w)
        if key in ("tpattn", "scripts/peer_tp.py"):
            opts = what[2:] if key == "tpattn" else what[1:]
            parser().parse_args(opts)  # every option and value python -m tpattn takes (exits 2 otherwise)
            if "--context-parallel" in opts:
                assert w % int(opts[opts.index("--context-parallel") + 1]) == 0
    assert worlds["tpattn"] == {1, 2, 4, 8}  # the training and decode steps, the graphed layer, the ring
    assert worlds["scripts/peer_tp.py"] == {1, 2, 4, 8}
    assert worlds["scripts/bench_allreduce.py"] == {2, 4, 8}
    assert worlds["scripts/model/validate_model.py"] == {1, 2, 4, 8}
    assert worlds["-m tpattn.plan"] == {8}
    ring = {(int(a[a.index("-n") + 1]), a[a.index("--context-parallel") + 1]) for a in runs if "--context-parallel" in a}
    assert ring == {(2, "2"), (4, "4"), (8, "8"), (4, "2"), (8, "4")}
    assert any("--backward" in a and "--cuda-graph" in a for a in runs)
    # the other tools, run here by python3 itself: their options are theirs
    direct = [shlex.split(c)[1:] for c in calls if c.startswith("python3 ") and not c.startswith("python3 -m pytest")]
    seen = set()
    for argv in direct:
        tool = argv[0]
        seen.add(tool)
        have = script_options([tool])
        assert {o for o in argv if o.startswith("--")} <= have, (tool, argv)
    sweeps = [a for a in direct if a[0] == "scripts/scaling.py"]
    assert {a[a.index("--output-collective") + 1] for a in sweeps if "--output-collective" in a} == \
        {"auto", "allreduce", "split", "p2p", "oneshot"}
    assert "scripts/ring_trace.py" in seen
    faults = [c for c in calls if c.startswith("mpirun ") and "tpattn" in c and "--seed 77" in c]
    assert {int(shlex.split(c)[2]) for c in faults} == {2, 8}  # the fault table at the smallest and largest W
    assert any("--backward" in c for c in faults)
