"""The packed training path's autograd (tpattn/attention/autograd.py: _AttentionPacked, _rows_major_out)
on the CPU, through a backend that declares packed_grads and does its math in torch: attention_packed
of qkv [B, N, h + 2g, d] gives the split call's output and gradients, writes o in the rows every head
shares, hands the backward dO in o's layout and out= views of one gradient in qkv's layout. The fused
kernels behind the same interface are checked on the GPU (tests/test_gpu_backward_fused.py)."""

from __future__ import annotations

import pytest
import torch

from tpattn.attention import attention
from tpattn.attention.autograd import split_packed
from tpattn.attention.reference import ReferenceBackend


class PackedTorch(ReferenceBackend):
    """The reference's math behind the packed_grads interface, recording what it was handed."""
    name = "packed-torch"
    strided = True
    packed_grads = True

    def __init__(self):
        self.seen = {}

    def forward_for_backward(self, q, k, v, causal: bool, out=None):
        self.seen["out"] = out
        o = self.forward(q, k, v, causal, out=out)
        return o, torch.empty(0)

    def backward(self, q, k, v, o, saved, do, causal: bool, deterministic: bool = False, out=None):
        self.seen["do_strides"], self.seen["grad_out"] = do.stride(), out
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        with torch.enable_grad():  # (autograd runs a backward with grad mode off)
            ReferenceBackend.attention(self, *leaves, causal).backward(do)
        grads = [t.grad for t in leaves]
        if out is None:
            return grads
        for dst, g in zip(out, grads):
            dst.copy_(g)
        return out


@pytest.mark.parametrize("h,g", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_attention_is_the_split_call(h, g, causal):
    B, N, d = 2, 7, 8
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, N, h + 2 * g, d, dtype=torch.float64, generator=gen)
    do_rows = torch.randn(B, N, h, d, dtype=torch.float64, generator=gen)  # as the output GEMM hands it back
    backend = PackedTorch()
    leaf = qkv.clone().requires_grad_(True)
    o = backend.attention_packed(leaf, h, g, causal)
    # o lives in rows of every head: the output GEMM reads o.permute(0, 2, 1, 3) without a copy
    assert backend.seen["out"] is not None and o.permute(0, 2, 1, 3).is_contiguous()
    o.permute(0, 2, 1, 3).backward(do_rows)
    assert backend.seen["do_strides"] == o.stride(), "dO arrives in o's own layout, uncopied"
    dq, dk, dv = backend.seen["grad_out"]  # views of one gradient in qkv's layout: no concatenation after
    assert dq._base is not None and dq._base is dk._base is dv._base and dq._base.shape == qkv.shape
    assert dq._base.is_contiguous() and leaf.grad.shape == qkv.shape

    q, k, v = (t.detach().clone().contiguous().requires_grad_(True) for t in split_packed(qkv, h, g))
    want = attention(q, k, v, causal, backend="reference")
    want.backward(do_rows.permute(0, 2, 1, 3))
    torch.testing.assert_close(o, want, rtol=0, atol=0)
    for got, ref in zip(split_packed(leaf.grad, h, g), (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_a_backend_without_packed_grads_takes_the_split_path():
    """The reference backend (no packed_grads): attention_packed splits and calls attention(), and autograd
    assembles qkv's gradient; the same values as the packed path."""
    h, g, B, N, d = 4, 2, 1, 5, 8
    qkv = torch.randn(B, N, h + 2 * g, d, dtype=torch.float64, requires_grad=True)
    o = ReferenceBackend().attention_packed(qkv, h, g, True)
    assert o.shape == (B, h, N, d)
    o.sum().backward()
    leaf = qkv.detach().clone().requires_grad_(True)
    PackedTorch().attention_packed(leaf, h, g, True).sum().backward()
    torch.testing.assert_close(qkv.grad, leaf.grad, rtol=1e-12, atol=1e-12)


def test_a_broadcast_tensor_is_not_read_in_place():
    """fused's kernels (and hbwd5w_kv's TMA maps, which step by 16 bytes or more) read a tensor in place
    only with rows contiguous, 16-byte aligned and nothing broadcast; an expanded dO (stride 0, as from
    (o * w).sum()) is copied first."""
    from tpattn.attention.fused import _rows_aligned
    t = torch.zeros(2, 4, 8, 64, dtype=torch.float16)
    assert _rows_aligned(t) and _rows_aligned(t.transpose(1, 2).contiguous().transpose(1, 2))
    assert not _rows_aligned(torch.zeros(64, dtype=torch.float16).expand(2, 4, 8, 64))
    assert _rows_aligned(torch.zeros(1, 4, 8, 64, dtype=torch.float16).expand(1, 4, 8, 64))  # extent 1: any stride
    assert not _rows_aligned(t[..., 1:33])  # rows that start 2 bytes in
