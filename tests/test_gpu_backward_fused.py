"""The fused backward on the GPU, both of its kernel sets (kernels/fused_hopper_backward.cu, wgmma, on
compute capability 9.0; kernels/fused_attention_backward.cu, mma.sync, everywhere): dQ, dK, dV against
float64 autograd of the reference with FlashAttention's rule (the kernel's error at most 3x torch's own in
the same dtype, plus a small absolute term), the forward's L, determinism, and the forward's output
unchanged when it also writes L."""

from __future__ import annotations

import pytest
import torch

from backward_check import check_output_and_grads, dq_from_sum, grads, inputs
from tpattn.attention import attention, get_backend

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, params=["wgmma", "wgmma-red", "wgmma-deterministic", "mma"],
                ids=["bulk", "red", "seven", "mma"])
def bwd_kernels(request, monkeypatch):
    """Every test runs with each backward kernel set this GPU has: on compute capability 9.0 the
    five-product wgmma kernels (dQ by fp32 adds: the warp-specialized one by bulk reduce-adds, the
    default, and "red", every thread's red.global.add), the seven-product ones (deterministic=True),
    and everywhere the mma.sync ones. Returns whether `check` asks for deterministic gradients."""
    kernels = request.param.split("-")[0]
    if kernels == "wgmma" and torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma backward needs compute capability 9.0")
    monkeypatch.setenv("TPATTN_FUSED_BWD", kernels)
    monkeypatch.setenv("TPATTN_FUSED_BWD5", "red" if request.param.endswith("red") else "ws")
    return request.param.endswith("deterministic")


def check(b, h, g, n, d, causal, deterministic, dtype=torch.float16):
    q, k, v, do = inputs(b, h, g, n, d, dtype)
    check_output_and_grads(q, k, v, do, causal, grads(q, k, v, do, causal, "fused", deterministic=deterministic))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 17, 127, 128, 129, 1000])
def test_fused_backward_shapes(n, causal, d, bwd_kernels):
    check(2, 4, 4, n, d, causal, bwd_kernels)


@pytest.mark.parametrize("h,g", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_backward_gqa(h, g, causal, bwd_kernels):
    check(1, h, g, 300, 128, causal, bwd_kernels)
    check(2, h, g, 200, 64, causal, bwd_kernels, torch.bfloat16)


@pytest.mark.parametrize("d", [64, 128])
def test_fused_backward_bf16(d, bwd_kernels):
    check(2, 4, 2, 257, d, True, bwd_kernels, torch.bfloat16)
    check(2, 4, 2, 257, d, False, bwd_kernels, torch.bfloat16)


def test_a_zero_do_gives_exactly_zero_gradients(bwd_kernels):
    """A batch entry whose dO is zero gets gradients that are exactly zero and finite: nothing of the
    other entry's dQ adds (or dK, dV sums) leaks into it."""
    q, k, v, do = inputs(2, 4, 2, 129, 128, torch.float16)
    do[1] = 0
    _, dq, dk, dv = grads(q, k, v, do, True, "fused", deterministic=bwd_kernels)
    for t in (dq, dk, dv):
        assert torch.isfinite(t).all()
        assert t[1].abs().max().item() == 0.0


def test_deterministic_gives_the_same_bits():
    q, k, v, do = inputs(1, 8, 2, 1000, 128, torch.float16)
    a = grads(q, k, v, do, True, "fused", deterministic=True)
    b = grads(q, k, v, do, True, "fused", deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("n", [100, 4096])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_writes_the_logsumexp_and_the_same_output(n, causal):
    q, k, v, _ = inputs(1, 32 if n == 4096 else 2, 32 if n == 4096 else 2, n, 128, torch.float16)
    fused = get_backend("fused")
    plain = fused.forward(q, k, v, causal)
    o, lse = fused.forward_for_backward(q, k, v, causal)
    assert torch.equal(o, plain)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) / 128 ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-3, rtol=1e-4)


def test_backward_memory_is_linear_in_n():
    """Beyond its inputs and outputs the backward allocates O(N) (L, Dl) and the fp32 dQ buffer:
    no N x N tensor (at N = 8192 with 8 heads an N x N fp16 tensor alone would be 1 GiB)."""
    q, k, v, do = inputs(1, 8, 8, 8192, 128, torch.float16)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    o = attention(q, k, v, True, backend="fused")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o.backward(do)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 4 * q.numel() * 4, extra  # dq fp32 + dq, dk, dv + L, Dl: a few times the inputs


@pytest.mark.parametrize("n,d,dtype", [(64, 128, torch.float16), (100, 64, torch.bfloat16), (1, 128, torch.bfloat16)])
def test_the_dq_sum_leaves_in_row_order(n, d, dtype, bwd_kernels):
    """hbwd_dq_out (the five-product backward's last pass) turns the fp32 sum, laid out as the kernel's
    accumulators are held, into dQ exactly as backward_check.dq_from_sum (the layout's description,
    checked on the CPU in tests/test_dq_layout.py) does."""
    if bwd_kernels or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the five-product kernels run on compute capability 9.0 without deterministic=True")
    import numpy as np
    from tpattn.attention import fused
    from tpattn.cuda import launch, ptr
    b, h = 2, 3
    tiles = b * h * -(-n // 64) * (d // 64)
    dqa = torch.randn(tiles * 4096, device="cuda")
    got = torch.full((b, h, n, d), float("nan"), device="cuda", dtype=dtype)
    suf = "bf16" if dtype == torch.bfloat16 else "f16"
    launch(fused.HOPPER_BWD_SOURCE, f"hbwd_dq_out_{suf}_d{d}", got.device, (tiles, 1, 1), (256, 1, 1),
           (ptr(dqa), ptr(got), np.int32(n), np.int64(tiles), np.int32(h), *(np.int64(s) for s in got.stride()[:3])))
    want = torch.empty_like(got)
    dq_from_sum(want, dqa)
    assert torch.equal(got, want)


def packed_inputs(b, h, g, n, d, dtype):
    """qkv [b, n, h + 2g, d] (what the layer's QKV GEMM writes, seen per head) and do [b, h, n, d] laid
    out as the layer's output GEMM hands it back (rows of every head: [b, n, h, d] seen per head)."""
    q, k, v, do = inputs(b, h, g, n, d, dtype)
    qkv = torch.cat([t.transpose(1, 2) for t in (q, k, v)], dim=2).contiguous()
    return qkv, do.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("n,d,h,g,causal,dtype", [(1000, 128, 8, 2, True, torch.float16),
                                                  (257, 64, 4, 4, False, torch.bfloat16),
                                                  (129, 128, 4, 1, False, torch.bfloat16)])
def test_packed_attention_matches_float64_and_writes_one_gradient(n, d, h, g, causal, dtype, bwd_kernels):
    """attention_packed (the layer's training path: q, k, v read in place from the QKV GEMM's output,
    o written in the rows the output GEMM reads, dq, dk and dv written into one gradient of qkv's
    layout) holds FlashAttention's rule against float64, and its gradient is qkv's own layout;
    deterministic=True gives the bits of the unpacked call."""
    from tpattn.attention.autograd import split_packed
    qkv, do = packed_inputs(2, h, g, n, d, dtype)
    fused = get_backend("fused")
    leaf = qkv.clone().requires_grad_(True)
    o = fused.attention_packed(leaf, h, g, causal, deterministic=bwd_kernels)
    assert o.shape == (2, h, n, d) and o.permute(0, 2, 1, 3).is_contiguous(), "o in the output GEMM's rows"
    o.backward(do)
    assert leaf.grad.shape == qkv.shape and leaf.grad.is_contiguous()
    q, k, v = (t.contiguous() for t in split_packed(qkv, h, g))
    check_output_and_grads(q, k, v, do.contiguous(), causal, (o.detach(), *split_packed(leaf.grad, h, g)))
    if bwd_kernels:  # deterministic: the same bits as the split call on contiguous copies
        _, *want = grads(q, k, v, do.contiguous(), causal, "fused", deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(split_packed(leaf.grad, h, g), want))
