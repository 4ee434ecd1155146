"""The CUDA kernels as torch custom ops, for a graph that torch.compile or torch.export traces:

    tpattn::attention            a backend's forward (naive, tiled, fused, triton): o and what the
                                 backward needs (the fused kernels' logsumexp), differentiable
    tpattn::attention_backward   its backward: dq, dk, dv
    tpattn::decode_append        a decode step's rows: q out, K and V written into the cache at its
                                 device position, rotary positions applied (mutates the cache)
    tpattn::decode_attention     a decode step's split-K attention over the cache (its counters
                                 are left zero: declared mutated)
    tpattn::prefix_attention     a prefill over rows already in the cache (the fused kernel with
                                 the causal diagonal shifted)
    tpattn::peer_sum             the output GEMM into a peer buffer and the peer kernel that sums
                                 the ranks' partials (p2p or oneshot, tpattn/peer.py): the mapped
                                 memory is written and read inside the op only (writes out)

Each has a fake implementation that gives the outputs' shapes without a GPU; the attention op has
the autograd formula that joins it to its backward. The traced graph holds one op per call instead
of breaking at each CuPy launch. Eager calls do not go through them (the callers check
torch.compiler.is_compiling()): the dispatcher's cost per call stays out of the eager layer and its
CUDA graphs. The reference backend and the CPU paths are torch ops, which the compiler traces as
they are."""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch
from torch import Tensor


# the backends by name, as Backend.attention hands them over (this module imports nothing of tpattn)
BACKENDS: dict = {}
# the kernels' launchers by op name, put here by the modules that own them (tpattn/decode.py,
# tpattn/peer.py) when they are imported
IMPLS: dict = {}


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


# ---- decoding (tpattn/decode.py's kernels) ---------------------------------------------------------

@torch.library.custom_op("tpattn::decode_append", mutates_args=("k", "v"))
def decode_append_op(qkv: Tensor, k: Tensor, v: Tensor, pos: Tensor, cos: Optional[Tensor], sin: Optional[Tensor],
                     heads: int, interleaved: bool) -> Tensor:
    """q [B, heads, 1, d] of a step's rows qkv [B, heads + 2g, d]; k and v of the rows written into
    the cache k, v [B, g, max_len, d] at row pos[0] (rotated by cos, sin when given)."""
    return IMPLS["decode_append"](qkv, k, v, pos, cos, sin, heads, interleaved)


@decode_append_op.register_fake
def _decode_append_fake(qkv, k, v, pos, cos, sin, heads, interleaved):
    return qkv.new_empty(qkv.shape[0], heads, 1, qkv.shape[2])


@torch.library.custom_op("tpattn::decode_attention", mutates_args=("tickets",))
def decode_attention_op(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, tickets: Tensor) -> Tensor:
    """o [B, h, 1, d]: the query row q [B, h, 1, d] at position pos[0] over the cache's first
    pos[0] + 1 rows of k, v [B, g, max_len, d]."""
    return IMPLS["decode_attention"](q, k, v, k.shape[2], pos=pos, tickets=tickets)


@decode_attention_op.register_fake
def _decode_attention_fake(q, k, v, pos, tickets):
    return q.new_empty(q.shape)


@torch.library.custom_op("tpattn::prefix_attention", mutates_args=())
def prefix_attention_op(q: Tensor, k: Tensor, v: Tensor, start: int, backend: str) -> Tensor:
    """o [B, T, h, d] of the T queries q [B, h, T, d] at positions start.. over k, v [B, g, start + T, d]
    (causal)."""
    return IMPLS["prefix_attention"](_backend(backend), q, k, v, start).contiguous()


@prefix_attention_op.register_fake
def _prefix_attention_fake(q, k, v, start, backend):
    b, h, t, d = q.shape
    return q.new_empty(b, t, h, d)


# ---- the peer output sums (tpattn/peer.py's buffers, by the key they were registered under) --------

PEERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> PeerBuffers / OneShotBuffers
_keys = itertools.count(1)


def register_peer(buffers) -> int:
    """A key for a peer buffers object, by which the traced op finds it (the graph holds the key;
    keys are never reused)."""
    key = next(_keys)
    PEERS[key] = buffers
    return key


@torch.library.custom_op("tpattn::peer_sum", mutates_args=("out",))
def peer_sum_op(o_rows: Tensor, wo: Tensor, out: Tensor, bias: Optional[Tensor], key: int, kind: str) -> None:
    """out [rows, D] = the sum over ranks of o_rows @ wo (each rank's partial, written into its
    mapped buffer here) + bias, by the peer kernel of `kind` ("p2p": reduce-gather, "oneshot")."""
    IMPLS["peer_sum"](PEERS[key], o_rows, wo, out, bias, kind)


@peer_sum_op.register_fake
def _peer_sum_fake(o_rows, wo, out, bias, key, kind):
    return None

