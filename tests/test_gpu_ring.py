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


def _tpattn(n, *args, timeout=600):
    return run(mpirun_cmd(n) + [sys.executable, "-m", "tpattn", *args], timeout=timeout, CUDA_VISIBLE_DEVICES="0")


def test_cli_ring_training_step_on_the_gpu_passes():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    r = _tpattn(2, "--context-parallel", "2", "--kernel", "fused", "--causal", "--seq-len", "4096", "--heads", "8",
                "--head-dim", "128", "--backward", "--iters", "2")
    assert r.returncode == 0 and "RESULT: PASS" in r.stdout, r.stdout + r.stderr
    assert "context-parallel (rings of 2 ranks" in r.stdout and "device memory: peak allocated" in r.stdout


def test_trace_of_the_ring_on_the_gpu_shows_each_pass_posted_first(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    trace = tmp_path / "ring.json"
    r = _tpattn(4, "--context-parallel", "4", "--kernel", "fused", "--causal", "--seq-len", "8192", "--heads", "8",
                "--head-dim", "128", "--iters", "1", "--no-check", "--profile", str(trace))
    assert r.returncode == 0, r.stdout + r.stderr
    out = run([sys.executable, str(ROOT / "scripts" / "ring_trace.py"), str(trace),
               *(f"{trace}.rank{i}" for i in range(1, 4))])
    assert out.returncode == 0 and out.stdout.count("(ok)") == 4 * 3, out.stdout + out.stderr
    assert "on the GPU" in out.stdout


def test_ranks_sharing_the_gpu_are_refused_past_their_share():
    """Two ranks on one GPU: each plans for half its free memory, and a head-parallel sequence past
    that is refused in one line on every rank that names the ring."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    free, _ = torch.cuda.mem_get_info()
    from tpattn import memory
    from tpattn.config import Config
    cfg = Config(seq_len=1024, heads=32, head_dim=128, kernel="fused", device="cuda", check=False)
    n = memory.largest_n(cfg, 2, 0, free // 2) // 1024 * 1024 + 4096  # just past a half's fit, within the whole's
    r = _tpattn(2, "--kernel", "fused", "--seq-len", str(n), "--no-check", timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "needs about" in ln]
    assert len(lines) == 2 and all("its share of a GPU that 2 ranks share" in ln and "--context-parallel" in ln
                                   for ln in lines), r.stdout + r.stderr
