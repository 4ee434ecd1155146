"""The CUDA attention backends (naive, tiled, fused, triton) as torch custom ops, for a graph that
torch.compile or torch.export traces: tpattn::attention (o and what the backward needs, the
fused kernels' logsumexp) and tpattn::attention_backward (dq, dk, dv), with fake implementations
that give the outputs' shapes without a GPU and the autograd formula that joins them. The traced
graph holds one op per attention call instead of breaking at each CuPy launch. Eager calls do not
go through them (Backend.attention and the layer check torch.compiler.is_compiling()): the
dispatcher's cost per call stays out of the eager layer and its CUDA graphs. The reference backend
is torch ops, which the compiler traces as they are."""

from __future__ import annotations

import torch
from torch import Tensor


# the backends by name, as Backend.attention hands them over (this module imports nothing of tpattn)
BACKENDS: dict = {}


def _backend(name: str):
    return BACKENDS[name]


@torch.library.custom_op("tpattn::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str,
                 deterministic: bool) -> tuple[Tensor, Tensor]:
    """(o [B, h, N, d], saved): the backend's forward_for_backward; saved is its logsumexp (fp32
    [B, h, N]) or an empty tensor for a backend that saves nothing."""
    o, saved = _backend(backend).forward_for_backward(q, k, v, causal)
    return o.contiguous(), saved.contiguous() if saved is not None else q.new_empty(0, dtype=torch.float32)


@attention_op.register_fake
def _attention_fake(q, k, v, causal, backend, deterministic):
    b, h, n, _ = q.shape
    saved = (b, h, n) if _backend(backend).saves_lse else (0,)
    return q.new_empty(q.shape), q.new_empty(saved, dtype=torch.float32)


@torch.library.custom_op("tpattn::attention_backward", mutates_args=())
def attention_backward_op(q: Tensor, k: Tensor, v: Tensor, o: Tensor, saved: Tensor, do: Tensor, causal: bool,
                          backend: str, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv): the backend's backward for the upstream gradient do."""
    dq, dk, dv = _backend(backend).backward(q, k, v, o, saved if saved.numel() else None, do.contiguous(), causal,
                                           deterministic)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@attention_backward_op.register_fake
def _attention_backward_fake(q, k, v, o, saved, do, causal, backend, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, causal, backend, deterministic = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.causal, ctx.backend, ctx.deterministic = causal, backend, deterministic


def _backward(ctx, do, _dsaved):
    q, k, v, o, saved = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(q, k, v, o, saved, do, ctx.causal, ctx.backend, ctx.deterministic)
    return dq, dk, dv, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup)


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str, deterministic: bool = False) -> Tensor:
    """o = attention(q, k, v) through tpattn::attention (differentiable)."""
    return attention_op(q, k, v, causal, backend, deterministic)[0]
