"""Context parallelism (the ring) on the GPU (`pytest -m gpu`): tests/mpi_ring_check.py with its tensors on
the GPU, the ranks sharing it over gloo (the ring's peer-to-peer passes with CUDA tensors), against the
single-process layer in float64, forward and gradients, C = 2 and 4 and T x C = 2 x 2."""

import sys

import pytest
import torch

from conftest import ROOT, mpirun_cmd, run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n", [2, 4])
def test_ring_on_the_gpu_matches_the_single_process_layer(n):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    r = run(mpirun_cmd(n) + [sys.executable, str(ROOT / "tests" / "mpi_ring_check.py"), "cuda"], timeout=600,
            CUDA_VISIBLE_DEVICES="0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("RING PASS") == n and "(cuda)" in r.stdout, r.stdout + r.stderr
