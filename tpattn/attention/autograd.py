"""Attention with a backward pass: `o = tpattn.attention.attention(q, k, v, causal, backend=...)`, then
`o.backward(do)` fills q.grad, k.grad and v.grad, for every backend.

The math (S = QKᵀ/√d, P = softmax(S), causal: masked before the softmax, O = PV; per row the
logsumexp L = m + log Σ exp(S − m)). Given dO:
    dV = Pᵀ dO          dP = dO Vᵀ          D = rowsum(dO ∘ O)  (= rowsum(P ∘ dP))
    dS = P ∘ (dP − D)   dQ = dS K / √d       dK = dSᵀ Q / √d
With grouped-query attention (g K/V heads for h query heads) dK and dV of a K/V head are the sums
over the query heads of its group.

A backend with a backward implements forward_for_backward(q, k, v, causal) -> (o, saved), where
saved is what its backward needs beyond q, k, v and o (the fused kernel: L, fp32 [B, h, N]; the
naive one: nothing, it recomputes P with the seed's kernels), and backward(q, k, v, o, saved, do,
causal, deterministic) -> (dq, dk, dv). The reference backend is torch's own autograd over its math.
"""

from __future__ import annotations

import torch


def _rows_major_out(q: torch.Tensor, backend):
    """o's memory for a backend that writes o where it is told (packed_grads): [B, N, h, d] seen as
    [B, h, N, d] when q is itself a view of rows that hold every head (the QKV GEMM's output), so that
    the output GEMM reads o without a copy and o's gradient arrives in o's own layout; else None."""
    if not getattr(backend, "packed_grads", False) or q.stride(1) >= q.stride(2):
        return None
    b, h, n, d = q.shape
    return torch.empty(b, n, h, d, dtype=q.dtype, device=q.device).permute(0, 2, 1, 3)


def _forward(backend, q, k, v, causal: bool):
    out = _rows_major_out(q, backend)
    return backend.forward_for_backward(q, k, v, causal, **({} if out is None else {"out": out}))


class _Attention(torch.autograd.Function):
    """o = backend's attention(q, k, v); saves q, k, v, o and the backend's `saved` (never N x N)."""

    @staticmethod
    def forward(ctx, q, k, v, backend, causal: bool, deterministic: bool):
        o, saved = _forward(backend, q, k, v, causal)
        ctx.backend, ctx.causal, ctx.deterministic = backend, causal, deterministic
        ctx.has_saved = saved is not None
        ctx.save_for_backward(q, k, v, o, *((saved,) if saved is not None else ()))
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, *rest = ctx.saved_tensors
        # a packed_grads backend takes do in whatever layout it comes (rows contiguous or not: it copies
        # what its kernels cannot read in place); (its passes time on the recording timer through
        # tpattn.timing's fallback for autograd's threads)
        do = do if getattr(ctx.backend, "packed_grads", False) else do.contiguous()
        dq, dk, dv = ctx.backend.backward(q, k, v, o, rest[0] if ctx.has_saved else None, do, ctx.causal,
                                          ctx.deterministic)
        return dq, dk, dv, None, None, None


def write_into(out, grads):
    """grads, or, given out (tensors to write), out holding grads (each copied unless it is out's already)."""
    if out is None:
        return grads
    for o, g in zip(out, grads):
        if o.data_ptr() != g.data_ptr() or o.stride() != g.stride():
            o.copy_(g)
    return out


def split_packed(qkv: torch.Tensor, h: int, g: int):
    """q [B, h, N, d], k and v [B, g, N, d]: views of the heads of qkv [B, N, h + 2g, d]."""
    return tuple(t.permute(0, 2, 1, 3) for t in qkv.split([h, g, g], dim=2))


class _AttentionPacked(torch.autograd.Function):
    """o = attention of q, k and v held as the heads of one tensor qkv [B, N, h + 2g, d] (the QKV
    GEMM's output seen per head), for a packed_grads backend: its backward writes dq, dk and dv into
    one gradient of qkv's layout, where autograd's split would concatenate three (a pass over all
    of them)."""

    @staticmethod
    def forward(ctx, qkv, h: int, g: int, backend, causal: bool, deterministic: bool):
        q, k, v = split_packed(qkv, h, g)
        o, saved = _forward(backend, q, k, v, causal)
        ctx.backend, ctx.causal, ctx.deterministic, ctx.heads = backend, causal, deterministic, (h, g)
        ctx.save_for_backward(qkv, o, saved)
        return o

    @staticmethod
    def backward(ctx, do):
        qkv, o, saved = ctx.saved_tensors
        h, g = ctx.heads
        dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
        views = split_packed(dqkv, h, g)
        # (a backend may return other tensors than out's: they are copied in)
        write_into(views, ctx.backend.backward(*split_packed(qkv, h, g), o, saved, do, ctx.causal, ctx.deterministic,
                                               out=views))
        return dqkv, None, None, None, None, None
