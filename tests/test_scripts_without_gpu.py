"""Every script of scripts/ and scripts/model/ that measures a GPU, run on a machine where torch sees none (here
CUDA_VISIBLE_DEVICES is empty, so the test means the same on a GPU machine): one line on stderr that
says it needs a GPU, exit 2, no traceback. The scripts that run on a CPU too (training, serving, the
FP8 accuracy table, the scaling and peer runs, the Triton register count, the cost model's tables)
and those that read files are left out. And the scripts launched under mpirun, where mpi4py finds no MPI library: one line
on every rank."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import ROOT, mpirun_cmd, rank_lines, run

ON_CPU_TOO = {"train.py", "serve_llama.py", "fp8_accuracy.py", "scaling.py", "peer_tp.py",  # they run here
              "triton_regs.py",  # compiles the Triton kernels for a GPU it does not need
              "layer_table.py", "plots.py", "ring_trace.py"}  # they read reports or traces
ON_CPU_TOO |= {"model/refresh_predictions.py"}  # rewrites the predictions' tables from the machine files
ARGS = {"ab_fused.py": ["--against", "HEAD"],  # (without what to compare it says so first)
        "model/validate_model.py": ["--machine", "h200x2"]}  # (without a machine file it says so first)
GPU_SCRIPTS = sorted(str(p.relative_to(ROOT / "scripts")) for p in [*(ROOT / "scripts").glob("*.py"),
                                                                      *(ROOT / "scripts" / "model").glob("*.py")]
                     if str(p.relative_to(ROOT / "scripts")) not in ON_CPU_TOO)


def test_the_list_is_not_empty():
    assert len(GPU_SCRIPTS) >= 25 and "model/bench_comm.py" in GPU_SCRIPTS, GPU_SCRIPTS


@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_a_gpu_script_without_a_gpu_says_so_in_one_line(script):
    r = run([sys.executable, str(ROOT / "scripts" / script), *ARGS.get(script, [])], timeout=120,
            CUDA_VISIBLE_DEVICES="")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert "GPU" in lines[0], lines[0]


@pytest.mark.mpi
@pytest.mark.parametrize("script", ["peer_tp.py", "train.py", "serve_llama.py"])
def test_a_launched_script_without_an_mpi_library_says_so_on_every_rank(script):
    """The scripts that run under mpirun, where mpi4py finds no MPI library to load (MPI4PY_LIBMPI
    names a missing file): one line on each rank naming the fix, exit 2, no traceback."""
    r = run(mpirun_cmd(2) + [sys.executable, str(ROOT / "scripts" / script)], timeout=120,
            MPI4PY_LIBMPI="/nonexistent/libmpi.so.40")
    lines = rank_lines(r.stderr, re.compile(r"\w+(\.py)?: error: "))
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert len(lines) == 2 and all("mpi4py finds no MPI library to load" in ln for ln in lines), r.stderr


ALL_SCRIPTS = sorted(str(p.relative_to(ROOT / "scripts")) for p in [*(ROOT / "scripts").glob("*.py"),
                                                                      *(ROOT / "scripts" / "model").glob("*.py")])


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_help_answers_without_a_gpu(script):
    """--help before anything else: a script's help needs no GPU, no MPI and no input files."""
    r = run([sys.executable, str(ROOT / "scripts" / script), "--help"], timeout=120, CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0 and r.stdout.strip() and "Traceback" not in r.stderr, (r.returncode, r.stderr[-500:])
