"""The math of ring attention (context parallelism, tpattn/comm.py's ring pair runs it): the
attention of this rank's query rows against one block of K/V rows at given positions, as a partial
output and its rows' logsumexp; their merge; and the block's backward given the rows' global
logsumexp. torch math in fp32 (fp64 for fp64), any device; grouped-query heads read in place.

The layout (zigzag, as ring-flash-attention and Megatron's context parallelism lay it out): the
sequence of N rows in 2C chunks of m = N / (2C); rank c of the ring holds chunks c and 2C - 1 - c,
so that under a causal mask every rank has the same work.
"""

from __future__ import annotations

import math

import torch


def context_rows(seq_len: int, ranks: int, rank: int) -> torch.Tensor:
    """The positions (int64) of the rows rank `rank` of a ring of `ranks` holds, in the order it
    holds them: chunk rank, then chunk 2 ranks - 1 - rank."""
    m = seq_len // (2 * ranks)
    a, b = rank * m, (2 * ranks - 1 - rank) * m
    return torch.cat([torch.arange(a, a + m), torch.arange(b, b + m)])


def _scores(q, k, pos_q, pos_k, causal: bool, acc):
    """S [B, g, h/g, n, nk] (scaled) of q [B, h, n, d] against k [B, g, nk, d], masked where a key
    is after its query (causal)."""
    B, h, n, d = q.shape
    g = k.shape[1]
    s = torch.matmul(q.to(acc).view(B, g, h // g, n, d), k.to(acc).unsqueeze(2).transpose(-1, -2)) / math.sqrt(d)
    if causal:
        s = s.masked_fill(pos_k[None, :] > pos_q[:, None], float("-inf"))
    return s


def sees_any(pos_q, pos_k, causal: bool) -> bool:
    """Whether any query row sees any key of the block (else the block adds nothing)."""
    return not causal or bool(pos_k.min() <= pos_q.max())


def block_forward(q, k, v, pos_q, pos_k, causal: bool):
    """(o, lse): the block's attention of q [B, h, n, d] over k, v [B, g, nk, d], fp32 [B, h, n, d]
    and its rows' logsumexp [B, h, n] (-inf for a row that sees no key of the block)."""
    B, h, n, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    s = _scores(q, k, pos_q, pos_k, causal, acc)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1).masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0))
    o = torch.matmul(p, v.to(acc).unsqueeze(2))
    return o.reshape(B, h, n, d), lse.reshape(B, h, n)


def merge(o, lse, o_b, lse_b):
    """The partial output of two disjoint sets of keys, from each one's (o, lse), in place in o, lse."""
    new = torch.logaddexp(lse, lse_b)
    safe = new.masked_fill(torch.isinf(new), 0.0)
    o.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(o_b * torch.exp(lse_b - safe).unsqueeze(-1))
    lse.copy_(new)


def block_backward(q, k, v, do, lse, delta, pos_q, pos_k, causal: bool):
    """(dq, dk, dv) of the block's share, fp32: P recomputed from the rows' global logsumexp lse
    [B, h, n], delta = rowsum(dO o) [B, h, n]; dk, dv summed over each K/V head's query heads."""
    B, h, n, d = q.shape
    g = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    s = _scores(q, k, pos_q, pos_k, causal, acc)
    p = torch.exp(s - lse.view(B, g, h // g, n, 1))
    dof = do.to(acc).view(B, g, h // g, n, d)
    dv = torch.matmul(p.transpose(-1, -2), dof).sum(2)
    dp = torch.matmul(dof, v.to(acc).unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.view(B, g, h // g, n, 1)) / math.sqrt(d)
    dq = torch.matmul(ds, k.to(acc).unsqueeze(2)).reshape(B, h, n, d)
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc).view(B, g, h // g, n, d)).sum(2)
    return dq, dk, dv
