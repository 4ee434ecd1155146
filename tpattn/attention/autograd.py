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


class _Attention(torch.autograd.Function):
    """o = backend's attention(q, k, v); saves q, k, v, o and the backend's `saved` (never N x N)."""

    @staticmethod
    def forward(ctx, q, k, v, backend, causal: bool, deterministic: bool):
        o, saved = backend.forward_for_backward(q, k, v, causal)
        ctx.backend, ctx.causal, ctx.deterministic = backend, causal, deterministic
        ctx.has_saved = saved is not None
        ctx.save_for_backward(q, k, v, o, *((saved,) if saved is not None else ()))
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, *rest = ctx.saved_tensors
        # (its passes time on the recording timer through tpattn.timing's fallback for autograd's threads)
        dq, dk, dv = ctx.backend.backward(q, k, v, o, rest[0] if ctx.has_saved else None, do.contiguous(),
                                          ctx.causal, ctx.deterministic)
        return dq, dk, dv, None, None, None
