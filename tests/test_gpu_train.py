"""Training through the tensor-parallel layer on the GPU (`pytest -m gpu`): tests/mpi_train_check.py under
a real mpirun with the GPU backends, x.grad and full_grads() against float64 autograd from the same
rounded weights, head-parallel and sequence-parallel, causal, GQA with split and replicated K/V heads,
uneven heads, overlap on and off, two backward calls accumulating. Over gloo the ranks share one GPU
(the collectives' logic); over NCCL each rank has its own GPU (2 GPUs or more)."""

import sys

import pytest
import torch

from conftest import ROOT, mpirun_cmd, run
from tpattn.attention.triton_fused import triton_available

pytestmark = pytest.mark.gpu
CHECK = str(ROOT / "tests" / "mpi_train_check.py")


def backend_ready(backend: str) -> None:
    if backend == "triton" and not triton_available():
        pytest.skip("--kernel triton needs the triton package")


@pytest.mark.parametrize("world,ran", [(1, 26), (2, 26), (3, 2), (4, 25)])
@pytest.mark.parametrize("backend,dtype", [("fused", "fp16"), ("fused", "bf16"), ("naive", "fp16"), ("triton", "fp16")])
def test_layer_gradients_over_gloo_sharing_one_gpu(world, ran, backend, dtype):
    backend_ready(backend)
    r = run(mpirun_cmd(world) + [sys.executable, CHECK, backend, dtype, "gloo"], timeout=600, CUDA_VISIBLE_DEVICES="0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("TRAIN PASS") == world, r.stdout + r.stderr
    assert f"ran {ran} of 26 ({backend}, {dtype}, cuda)" in r.stdout


@pytest.mark.parametrize("backend", ["fused", "naive"])
def test_layer_gradients_over_nccl_on_two_gpus(backend):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for NCCL between ranks (this machine has {torch.cuda.device_count()})")
    r = run(mpirun_cmd(2) + [sys.executable, CHECK, backend, "fp16", "nccl"], timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("TRAIN PASS") == 2, r.stdout + r.stderr
    assert f"ran 26 of 26 ({backend}, fp16, cuda)" in r.stdout
