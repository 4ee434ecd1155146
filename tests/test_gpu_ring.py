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


class _PerPiece:
    """The fused backend without its dQ sum (RowsDq then adds each piece's dQ in fp32)."""

    def __init__(self, be):
        self.be = be
        self.saves_lse = True

    def forward_for_backward(self, *a, **k):
        return self.be.forward_for_backward(*a, **k)

    def backward(self, *a, **k):
        return self.be.backward(*a, **k)


@pytest.mark.parametrize("kernel", ["", "red"])
@pytest.mark.parametrize("C,causal,n_rank,d,dtype", [(2, True, 256, 64, torch.float16), (4, True, 256, 128, torch.bfloat16),
                                                     (4, True, 384, 64, torch.bfloat16), (3, True, 128, 64, torch.float16),
                                                     (3, False, 200, 128, torch.float16), (2, True, 192, 64, torch.float16)])
def test_ring_dq_summed_in_the_kernels_matches_each_pieces_dq_added(C, causal, n_rank, d, dtype, kernel, monkeypatch):
    """Every rank's backward over the ring's blocks (one process, the fused kernels, fp16): with the
    kernels' dQ sum (Dl once, each piece's kernel adding into the sum at its rows, dQ out once) and with
    each piece's own backward added in fp32, against float64. The sum is taken where its rows sit on the
    kernels' tiles (causal: n a multiple of 128; n = 128: folded pieces of 64 keys, under one key block);
    n = 192 causal checks the fallback is taken. kernel "red": hbwd5_kv for every piece (by default the
    pieces' strided operands take hbwd5w_kv)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("TPATTN_FUSED_BWD5", kernel)
    from tpattn.attention import get_backend
    from tpattn.attention.ring import RowsDq, block_sums, context_rows, merge, piece_forward, pieces, step_backward
    torch.manual_seed(C * d + n_rank)
    B, h, g, N = 1, 4, 2, n_rank * C
    dev = "cuda"
    q = torch.randn(B, h, N, d, device=dev, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, g, N, d, device=dev, dtype=torch.float64, requires_grad=True) for _ in range(2))
    do = torch.randn(B, h, N, d, device=dev, dtype=torch.float64)
    s = q @ k.repeat_interleave(h // g, 1).transpose(-1, -2) / d ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool, device=dev).triu(1), float("-inf"))
    (torch.softmax(s, -1) @ v.repeat_interleave(h // g, 1)).backward(do)
    be = get_backend("fused")
    q16, k16, v16, do16 = (t.detach().to(dtype) for t in (q, k, v, do))
    rows = [context_rows(N, C, r).to(dev) for r in range(C)]
    grads = {}
    for way, backend in (("sum", be), ("per piece", _PerPiece(be))):
        dq_all, dk_all, dv_all = torch.empty_like(q16), torch.empty_like(k16), torch.empty_like(v16)
        sums = [None] * C
        used = []
        for c in range(C):
            qc, doc = q16[:, :, rows[c]].contiguous(), do16[:, :, rows[c]].contiguous()
            o = torch.zeros(B, h, n_rank, d, device=dev)
            lse = torch.full((B, h, n_rank), float("-inf"), device=dev)
            for j in range(C):
                kj, vj = k16[:, :, rows[j]].contiguous(), v16[:, :, rows[j]].contiguous()
                for q0, q1, k0, k1, diag in pieces(c, j, n_rank, causal):
                    merge(o[:, :, q0:q1], lse[:, :, q0:q1], *piece_forward(be, qc[:, :, q0:q1], kj[:, :, k0:k1],
                                                                         vj[:, :, k0:k1], diag))
            out = o.to(dtype)
            acc = RowsDq(backend, qc, out, lse, doc, causal, False)
            used.append(acc.sums is not None)
            for j in range(C):
                kj, vj = k16[:, :, rows[j]].contiguous(), v16[:, :, rows[j]].contiguous()
                sums[j] = block_sums(step_backward(backend, qc, kj, vj, out, lse, doc, c, j, causal, False, acc), kj,
                                     sums[j])
            dq_all[:, :, rows[c]] = acc.result().to(q16.dtype)
        for j in range(C):
            dk_all[:, :, rows[j]], dv_all[:, :, rows[j]] = (t.to(dtype) for t in sums[j])
        assert all(used) == (way == "sum" and (not causal or n_rank % 128 == 0)) and (any(used) == all(used))
        grads[way] = (dq_all, dk_all, dv_all)
    for name, i, ref in (("dq", 0, q.grad), ("dk", 1, k.grad), ("dv", 2, v.grad)):
        rms = ref.pow(2).mean().sqrt()
        err = {w: ((grads[w][i].double() - ref).abs().max() / rms).item() for w in grads}
        assert err["sum"] <= 2 * err["per piece"] + 2e-3, (name, err)  # FlashAttention's rule
        # against float64 of the unrounded inputs: bf16's rounding of q, k, v and do alone gives ~8x fp16's
        # (measured on the H200: dq 0.167, dk 0.089 at C = 4, both ways alike)
        assert err["sum"] < (2e-2 if dtype == torch.float16 else 0.25), (name, err)
