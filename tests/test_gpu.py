"""GPU tests (`pytest -m gpu`): the naive CUDA kernels against float64 and against the torch
reference with the same rounding points, on odd shapes, with poisoned outputs; N^2 > 2^31;
stream ordering with torch; several ranks on one GPU; grouped-query attention (`-k gqa`: fewer K/V
heads than query heads), with helpers the ladder's GQA tests share."""

import json
import math

import pytest
import torch

from conftest import tpattn
from tpattn.attention import get_backend

pytestmark = pytest.mark.gpu
DT = {"fp16": torch.float16, "bf16": torch.bfloat16}
TOL_REF = {"fp16": 1e-2, "bf16": 6e-2}   # vs the reference: only the order of fp32 sums differs
TOL_F64 = {"fp16": 2e-2, "bf16": 1e-1}   # vs float64: the storage dtype's rounding of S, P and O


def qkv(b, h, n, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, h, n, d, device="cuda", generator=g).to(dtype) for _ in range(3)]


def attention64(q, k, v, causal, rows=None):
    q64, k64, v64 = (t.double() for t in (q, k, v))
    n = q.shape[-2]
    rows = torch.arange(n, device=q.device) if rows is None else rows
    s = q64[..., rows, :] @ k64.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s.masked_fill_(torch.arange(n, device=q.device)[None, :] > rows[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v64


def rel_err(a, ref):
    """max |a - ref| / (|ref| + rms(ref)): relative where outputs are large, absolute (at the
    scale of the output) where they are small, as causal rows averaging many values are."""
    ref = ref.double()
    return ((a.double() - ref).abs() / (ref.abs() + ref.pow(2).mean().sqrt())).max().item()


def poisoned(b, h, n, d, dtype):
    s = torch.full((b, h, n, n), float("nan"), dtype=dtype, device="cuda")
    return (s, s.clone()), torch.full((b, h, n, d), float("nan"), dtype=dtype, device="cuda")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [32, 64, 80, 128])
@pytest.mark.parametrize("n", [1, 17, 1000, 4097])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_naive_matches_reference_and_float64(dtype, n, d, causal):
    if dtype == "bf16" and n == 4097 and d != 128:
        pytest.skip("bf16 covered at N=4097 by d=128")  # keeps the GPU run short; fp16 covers all
    b, h = 2, 3
    q, k, v = qkv(b, h, n, d, DT[dtype], seed=n * 1000 + d)
    scratch, out = poisoned(b, h, n, d, DT[dtype])
    o = get_backend("naive").forward(q, k, v, causal, out=out, scratch=scratch)
    torch.cuda.synchronize()
    assert o.data_ptr() == out.data_ptr()
    assert torch.isfinite(o).all(), "the kernel left poisoned outputs"
    assert not torch.isnan(scratch[1]).any(), "softmax left poisoned entries in P"
    ref = get_backend("reference").forward(q, k, v, causal)
    assert rel_err(o, ref) <= TOL_REF[dtype]
    assert rel_err(o, attention64(q, k, v, causal)) <= TOL_F64[dtype]
    rows = scratch[1][0, 0].float().sum(-1)
    assert torch.allclose(rows, torch.ones_like(rows), atol=1e-2)


def test_naive_fp32_and_head_dims_1_and_256():
    for d in (1, 256):
        q, k, v = qkv(1, 2, 33, d, torch.float32)
        o = get_backend("naive").forward(q, k, v, True)
        assert rel_err(o, attention64(q, k, v, True)) <= 1e-4


def test_scores_beyond_2_pow_31():
    """One head at N = 50 000: N^2 = 2.5e9 > 2^31, so 32-bit offsets would wrap."""
    n, d = 50_000, 64
    assert n * n > 2**31
    q, k, v = qkv(1, 1, n, d, torch.float16, seed=7)
    scratch, out = poisoned(1, 1, n, d, torch.float16)
    o = get_backend("naive").forward(q, k, v, False, out=out, scratch=scratch)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all()
    rows = torch.tensor([0, 1, 12_345, 42_950, n - 2, n - 1], device="cuda")  # last rows: offsets > 2^31
    ref = attention64(q, k, v, False, rows)
    assert rel_err(o[..., rows, :], ref) <= TOL_F64["fp16"]
    p_last = scratch[1][0, 0, n - 1].float()
    assert abs(p_last.sum().item() - 1.0) < 0.05
    s_last = (q[0, 0, n - 1].float() @ k[0, 0, n - 1].float()) / math.sqrt(d)
    assert abs(scratch[0][0, 0, n - 1, n - 1].float().item() - s_last.item()) < 1e-2 * (1 + abs(s_last.item()))


def test_result_consumed_on_another_stream():
    """Kernels go on torch's current stream, so a consumer ordered after it sees finished results."""
    b, h, n, d = 1, 8, 2048, 128
    q, k, v = qkv(b, h, n, d, torch.float16, seed=3)
    expect = get_backend("reference").forward(q, k, v, False).float().sum()
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    for _ in range(3):
        scratch, out = poisoned(b, h, n, d, torch.float16)
        producer.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(producer):
            o = get_backend("naive").forward(q, k, v, False, out=out, scratch=scratch)
        consumer.wait_stream(producer)
        with torch.cuda.stream(consumer):
            got = o.float().sum()
        consumer.synchronize()
        assert torch.isfinite(got) and abs(got.item() - expect.item()) <= 1e-2 * (1 + abs(expect.item()))


def test_cli_single_gpu_naive(tmp_path):
    r = tpattn(["--seq-len", "1024", "--heads", "8", "--json", str(tmp_path / "r.json")])
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["config"]["kernel"] == "naive" and rep["verdict"] == "PASS"


@pytest.mark.parametrize("ranks,extra", [(1, []), (4, ["--dist-backend", "gloo"])])
def test_tensor_parallel_on_one_gpu(tmp_path, ranks, extra):
    r = tpattn(["--seq-len", "1024", "--heads", "8", "--causal", "--json", str(tmp_path / "r.json"), *extra],
               ranks=ranks, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["verdict"] == "PASS" and rep["world"]["size"] == ranks
    assert rep["world"]["backend"] == ("gloo" if extra else "nccl")


def test_two_nccl_ranks_on_one_gpu_is_a_clear_error():
    if torch.cuda.device_count() != 1:
        pytest.skip("needs exactly one GPU")
    r = tpattn(["--seq-len", "256", "--heads", "8"], ranks=2, timeout=120)
    assert r.returncode == 2
    assert "NCCL needs one GPU per rank" in r.stderr


def test_memory_preflight_names_largest_n():
    r = tpattn(["--seq-len", "1000000", "--heads", "8"], timeout=120)
    assert r.returncode == 2
    assert "the largest --seq-len that fits is about" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# ---- grouped-query attention: g K/V heads shared by groups of query heads ----------------------

def gqa_qkv(b, h, g, n, d, dtype, seed=0):
    """q [b, h, n, d] and k, v [b, g, n, d]."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, n, d, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(b, g, n, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def expand_kv(q, k, v):
    """k and v repeated for their query heads (the oracle's layout; the kernels never build it)."""
    r = q.shape[1] // k.shape[1]
    return k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)


def sdpa_oracle(q, k, v, causal):
    """torch's SDPA in float64 on K/V expanded to every query head (the math backend)."""
    import torch.nn.functional as F
    ke, ve = expand_kv(q, k, v)
    return F.scaled_dot_product_attention(q.double(), ke.double(), ve.double(), is_causal=causal)


def check_gqa(backend, q, k, v, causal, dtype, **kw):
    """The backend on grouped K/V: every output written, bit-identical to the same backend on K/V
    expanded to every query head (same arithmetic per head: only the K/V head index differs),
    and against the reference and the SDPA oracle."""
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    o = get_backend(backend).forward(q, k, v, causal, out=out, **kw)
    torch.cuda.synchronize()
    assert o.data_ptr() == out.data_ptr()
    assert torch.isfinite(o).all(), "query heads left unwritten"
    ke, ve = expand_kv(q, k, v)
    assert torch.equal(o, get_backend(backend).forward(q, ke, ve, causal)), "not the K/V head of its group"
    assert rel_err(o, get_backend("reference").forward(q, k, v, causal)) <= TOL_REF[dtype]
    assert rel_err(o, sdpa_oracle(q, k, v, causal)) <= TOL_F64[dtype]
    return o


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,g", [(6, 3), (6, 2), (6, 1)])
@pytest.mark.parametrize("n,d", [(17, 64), (1000, 80), (1000, 128)])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_naive_gqa(dtype, n, d, h, g, causal):
    q, k, v = gqa_qkv(2, h, g, n, d, DT[dtype], seed=n + d + g)
    check_gqa("naive", q, k, v, causal, dtype)


def test_naive_gqa_scores_beyond_2_pow_31():
    """Two query heads on one K/V head at N = 50 000: head 1's scores start at 2.5e9 > 2^31."""
    n, d = 50_000, 64
    q, k, v = gqa_qkv(1, 2, 1, n, d, torch.float16, seed=9)
    o = get_backend("naive").forward(q, k, v, False)
    torch.cuda.synchronize()
    rows = torch.tensor([0, 12_345, n - 1], device="cuda")
    ref = attention64(q, k.expand(1, 2, n, d), v.expand(1, 2, n, d), False, rows)
    assert rel_err(o[..., rows, :], ref) <= TOL_F64["fp16"]


def test_reference_gqa_against_sdpa_on_gpu():
    for causal in (False, True):
        q, k, v = gqa_qkv(2, 8, 2, 300, 64, torch.float16, seed=4)
        o = get_backend("reference").forward(q, k, v, causal)
        assert rel_err(o, sdpa_oracle(q, k, v, causal)) <= TOL_F64["fp16"]
