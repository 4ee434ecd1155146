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
    """python -m tpattn under mpirun, the n ranks sharing GPU 0 over gloo."""
    return run(mpirun_cmd(n) + [sys.executable, "-m", "tpattn", "--dist-backend", "gloo", *args], timeout=timeout,
               CUDA_VISIBLE_DEVICES="0")


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_merge_kernel_is_the_torch_merge(dtype, d):
    """kernels/ring_merge.cu against the elementwise torch merge, on row slices of a larger output,
    rows with no keys yet (-inf) on either side included."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tpattn.attention import ring
    gen = torch.Generator(device="cuda").manual_seed(d)
    B, H, n, q0, q1 = 2, 3, 300, 40, 290
    o = torch.randn(B, H, n, d, device="cuda", generator=gen)
    lse = torch.randn(B, H, n, device="cuda", generator=gen) * 3
    lse[:, :, 50:60] = float("-inf")
    o[:, :, 50:60] = 0.0
    o_b = torch.randn(B, H, q1 - q0, d, device="cuda", generator=gen).to(dtype)
    lse_b = torch.randn(B, H, q1 - q0, device="cuda", generator=gen) * 3
    lse_b[:, :, 5:12] = float("-inf")  # rows 45-51: none on the piece's side; 50, 51: none on either
    o_b[:, :, 5:12] = 0
    ref_o, ref_l = o.clone(), lse.clone()
    torch_o, torch_l = ref_o[:, :, q0:q1], ref_l[:, :, q0:q1]
    assert ring._merge_kernel_takes(o[:, :, q0:q1], lse[:, :, q0:q1], o_b, lse_b)
    ring.merge(o[:, :, q0:q1], lse[:, :, q0:q1], o_b, lse_b)
    monkey = ring._merge_kernel_takes
    try:
        ring._merge_kernel_takes = lambda *a: False
        ring.merge(torch_o, torch_l, o_b, lse_b)
    finally:
        ring._merge_kernel_takes = monkey
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_l))
    assert torch.allclose(o, ref_o, atol=1e-5, rtol=1e-5) and torch.allclose(lse, ref_l, atol=1e-5, rtol=1e-5)
