"""Training through the tensor-parallel layer on CPU under a real mpirun (gloo), W = 1-4
(tests/mpi_train_check.py): x.grad and full_grads() against float64 autograd of the single-process
math, head-parallel and sequence-parallel, causal, GQA with split and replicated K/V heads, uneven
heads, overlap on and off, gradients accumulated over two backward calls."""

import sys

import pytest

from conftest import ROOT, mpirun_cmd, run

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("world,ran", [(1, 58), (2, 50), (3, 26), (4, 31)])
def test_layer_gradients_match_single_process(world, ran):
    r = run(mpirun_cmd(world) + [sys.executable, str(ROOT / "tests" / "mpi_train_check.py")], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("TRAIN PASS") == world, r.stdout + r.stderr
    assert f"ran {ran} of 58" in r.stdout  # the layouts this world size can take (the others refused alike)
