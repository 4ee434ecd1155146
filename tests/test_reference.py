"""The torch reference backend and the whole layer against float64 (CPU)."""

import math

import pytest
import torch

from tpattn.attention import get_backend
from tpattn.check import TOL_FLOAT64, compare, layer_float64, sample_rows
from tpattn.layer import TensorParallelAttention
from tpattn.ops import add_bias as _add_bias
from tpattn.weights import head_weights, layer_input


def attention64(q, k, v, causal):
    q, k, v = (t.double() for t in (q, k, v))
    n = q.shape[-2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def max_rel(a, ref):
    ref = ref.double()
    return ((a.double() - ref).abs() / (ref.abs() + ref.pow(2).mean().sqrt())).max().item()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("n", [1, 17, 128, 333])
def test_reference_matches_float64(n, d, causal):
    g = torch.Generator().manual_seed(n * 7 + d)
    q, k, v = (torch.randn(2, 3, n, d, generator=g).half() for _ in range(3))
    o = get_backend("reference").forward(q, k, v, causal)
    assert o.dtype == torch.float16 and o.shape == q.shape
    assert max_rel(o, attention64(q, k, v, causal)) <= 1e-2


def test_reference_rounds_where_the_kernels_do():
    """S and P are stored in the storage dtype: bf16 must differ from fp32 storage by bf16-sized errors."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(3))
    ref = attention64(q, k, v, False)
    e32 = max_rel(get_backend("reference").forward(q, k, v, False), ref)
    e16 = max_rel(get_backend("reference").forward(*(t.bfloat16() for t in (q, k, v)), False), ref)
    assert e32 < 1e-5 < 1e-3 < e16 < 5e-2


def test_causal_first_row_is_first_value():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 9, 16, generator=g) for _ in range(3))
    o = get_backend("reference").forward(q, k, v, True)
    assert torch.allclose(o[0, 0, 0], v[0, 0, 0])


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True])
def test_layer_matches_float64(dtype, causal):
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    H, d, N = 4, 32, 100
    w = head_weights(range(H), H, d, seed=3, dtype=dt, device="cpu")
    x = layer_input(2, N, H * d, seed=3, dtype=dt, device="cpu")
    y = TensorParallelAttention(**w, heads=H, head_dim=d, causal=causal, group=None)(x)
    rows = sample_rows(N, limit=N)
    assert compare(y, layer_float64(x, w, H, causal, rows), TOL_FLOAT64[dtype])["pass"]


def test_weights_are_per_head_and_world_independent():
    full = head_weights(range(6), 6, 8, seed=5, dtype=torch.float32, device="cpu")
    part = head_weights(range(2, 4), 6, 8, seed=5, dtype=torch.float32, device="cpu")
    assert torch.equal(full["wq"][:, 16:32], part["wq"])
    assert torch.equal(full["wo"][16:32], part["wo"])
    assert torch.equal(full["bo"], part["bo"])
    other = head_weights(range(2, 4), 6, 8, seed=6, dtype=torch.float32, device="cpu")
    assert not torch.equal(other["wq"], part["wq"])


def test_sample_rows():
    assert sample_rows(10).tolist() == list(range(10))
    r = sample_rows(50_000)
    assert len(r) == 64 and r[0] == 0 and r[-1] == 49_999


def test_baseline_check_allows_an_epsilon_per_element_and_nothing_more():
    """compare(ulp_of=): the vs-single-process check lets each element differ by the dtype's epsilon
    relative to its size (neighbouring fp16 values at the largest outputs) on top of tol * rms, and
    still fails an error of a few such steps at a large output, or a wrong value at rms scale."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4096, generator=g, dtype=torch.float64)
    ref[7] = 12.0                                   # one large output, 12 x rms
    rms = ref.pow(2).mean().sqrt().item()
    eps = torch.finfo(torch.float16).eps            # 2^-10: one fp16 step at [1, 2), 8 steps at 12
    y = ref.clone()
    y[7] += 1e-2 * rms + 0.5 * eps * 12             # beyond tol * rms, within tol * rms + eps * |y|
    assert not compare(y, ref, 1e-2)["pass"]
    assert compare(y, ref, 1e-2, ulp_of=torch.float16)["pass"]
    y[7] = ref[7] + 1e-2 * rms + 3 * eps * 12       # three times the allowance: a real error
    assert not compare(y, ref, 1e-2, ulp_of=torch.float16)["pass"]
    y = ref.clone()
    y[100] += 0.05 * rms                            # a small value wrong by 5 % of rms
    assert not compare(y, ref, 1e-2, ulp_of=torch.float16)["pass"]


@pytest.mark.parametrize("kw,says", [
    ({"overlap": 2}, "output_collective='p2p' sums all rows in one pass and does not overlap"),
    ({"sequence_parallel": True}, "output_collective='p2p' is for the head-parallel style")])
def test_peer_output_collective_refuses_what_it_cannot_do(kw, says):
    """output_collective='p2p' through the API: overlap and sequence parallelism refused at
    construction, with the CLI's rule in the API's names (the CLI refuses the same before any rank
    starts, in its flags)."""
    w = head_weights(range(2), 2, 8, seed=1, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=says):
        TensorParallelAttention(**w, heads=2, head_dim=8, group=None, output_collective="p2p", **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bias_pass_on_an_fp32_partial_is_the_cast_first_sum(dtype):
    """b_o goes into the add with an fp32 partial as it is (no cast kernel first): the same bits as
    casting it to fp32 first, rounded once to the model dtype (the GPU twin, test_gpu_layer.py, also
    counts the kernels). A bias of another dtype (fp64) is still cast to the partial's first: added
    in fp64 it would round differently."""
    g = torch.Generator().manual_seed(3)
    part = torch.randn(256, 96, generator=g) * 50
    bias = torch.randn(96, generator=g).to(dtype)
    out = torch.empty(256, 96, dtype=dtype)
    assert torch.equal(_add_bias(part, bias, out), torch.add(part, bias.float(), out=torch.empty_like(out)))
    wide = torch.randn(96, generator=g, dtype=torch.float64) * 1e-3 + 0.1234567
    got = _add_bias(part, wide, torch.empty(256, 96))
    assert torch.equal(got, part + wide.float()) and not torch.equal(got, torch.add(part, wide, out=torch.empty(256, 96)))
