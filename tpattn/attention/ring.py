"""The math of ring attention (context parallelism, tpattn/comm.py's ring pair runs it): which
rows of this rank's queries attend to which rows of a block of K/V (pieces); a piece's partial
output and its rows' logsumexp; their merge; and a piece's backward given the rows' global
logsumexp. Through the backend's kernels where its forward saves the logsumexp (fused, triton:
nothing N x N in memory), else torch math in fp32 (fp64 for fp64); grouped-query heads read in place.

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


def pieces(c: int, j: int, n: int, causal: bool) -> list[tuple[int, int, int, int, bool]]:
    """What rank c's n rows (two chunks of m = n / 2) attend to in ring rank j's block of n rows, as
    pieces (q0, q1, k0, k1, diagonal): its query rows [q0, q1) against the block's rows [k0, k1),
    all of them, or (diagonal) causally, key i of the piece seen by its query rows from i on. With
    the zigzag layout a causal ring has three kinds of block: its own (one diagonal piece: local
    order is position order), an earlier rank's (every row sees that block's first chunk) and a
    later rank's (only the second chunk's rows see it, all of it)."""
    m = n // 2
    if not causal:
        return [(0, n, 0, n, False)]
    if j == c:
        return [(0, n, 0, n, True)]
    if j < c:
        return [(0, n, 0, m, False)]
    return [(m, n, 0, m, False), (m, n, m, n, False)]


def _scores(q, k, diagonal: bool, acc):
    """S [B, g, h/g, n, nk] (scaled) of q [B, h, n, d] against k [B, g, nk, d]; diagonal (n = nk):
    key i masked for the rows before i."""
    B, h, n, d = q.shape
    g = k.shape[1]
    s = torch.matmul(q.to(acc).view(B, g, h // g, n, d), k.to(acc).unsqueeze(2).transpose(-1, -2)) / math.sqrt(d)
    if diagonal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s


def _by_rows(t: torch.Tensor, nk: int) -> torch.Tensor:
    """[B, h, r nk, ...] seen as [B, r h, nk, ...] (each query head's rows as r heads of nk rows: a
    piece of more query rows than keys, as the kernels' equal lengths take it; the heads of a K/V
    group stay together, so query head i still reads K/V head i // group)."""
    B, h, n = t.shape[:3]
    return t.reshape(B, h * (n // nk), nk, *t.shape[3:])


def piece_forward(backend, q, k, v, diagonal: bool):
    """(o, lse) of one piece: q [B, h, nq, d] over k, v [B, g, nk, d] (nq = nk, or a multiple of it
    when not diagonal). backend: one whose forward saves the rows' logsumexp (the fused kernels), o
    in q's dtype; None: torch math in fp32 (fp64 for fp64)."""
    B, h, nq, d = q.shape
    nk = k.shape[2]
    if backend is None:
        acc = torch.promote_types(q.dtype, torch.float32)
        s = _scores(q, k, diagonal, acc)
        lse = torch.logsumexp(s, dim=-1)
        o = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(acc).unsqueeze(2))
        return o.reshape(B, h, nq, d), lse.reshape(B, h, nq)
    o, lse = backend.forward_for_backward(_by_rows(q, nk), k, v, diagonal)
    return o.view(B, h, nq, d), lse.view(B, h, nq)


MERGE_SOURCE = "ring_merge.cu"


def _merge_kernel_takes(o, lse, o_b, lse_b) -> bool:
    """Whether kernels/ring_merge.cu merges these: on a GPU, o and lse fp32 row slices (rows
    contiguous), o_b fp16 or bf16 and lse_b fp32 contiguous, head dim 64 or 128; CuPy to launch it
    (the Triton backend's pieces may come without it)."""
    from ..errors import cupy_available
    return (o.is_cuda and cupy_available() and o.dtype == torch.float32 and lse.dtype == torch.float32 and lse_b.dtype == torch.float32
            and o_b.dtype in (torch.float16, torch.bfloat16) and o.shape[-1] in (64, 128)
            and o.stride(-1) == 1 and o.stride(-2) == o.shape[-1] and lse.stride(-1) == 1
            and o_b.is_contiguous() and lse_b.is_contiguous() and o_b.shape == o.shape)


def merge(o, lse, o_b, lse_b):
    """The partial output of two disjoint sets of keys, from each one's (o, lse), in place in o, lse
    (o and lse accumulate in fp32; o_b may be rounded to the inputs' dtype). On a GPU with the fused
    kernels' output, one pass of kernels/ring_merge.cu; else torch's elementwise ops."""
    if _merge_kernel_takes(o, lse, o_b, lse_b):
        import numpy as np

        from ..cuda import launch, ptr
        B, H, n, d = o.shape
        rows = B * H * n
        per_block = 8 * (32 // (d // 4))  # 8 warps, a row per d / 4 lanes
        blocks = max(1, min(-(-rows // per_block), 65535))
        launch(MERGE_SOURCE, f"ring_merge_{'f16' if o_b.dtype == torch.float16 else 'bf16'}_d{d}", o.device,
               (blocks, 1, 1), (256, 1, 1),
               (ptr(o), ptr(lse), ptr(o_b), ptr(lse_b), np.int64(rows), np.int32(H), np.int32(n),
                np.int64(o.stride(0)), np.int64(o.stride(1)), np.int64(lse.stride(0)), np.int64(lse.stride(1))))
        return
    new = torch.logaddexp(lse, lse_b)
    safe = new.masked_fill(torch.isinf(new), 0.0)
    # in place, o_b read as it is (no fp32 copy of it): two passes over o
    o.mul_(torch.exp(lse - safe).unsqueeze(-1)).addcmul_(o_b, torch.exp(lse_b - safe).unsqueeze(-1))
    lse.copy_(new)


def piece_backward(backend, q, k, v, o, lse, do, diagonal: bool, deterministic: bool = False):
    """(dq, dk, dv) of one piece's share, P recomputed from the rows' global logsumexp lse [B, h, nq]
    and D = rowsum(dO o) of the rows' whole output o; dk, dv summed over each K/V head's query
    heads. backend as piece_forward's (its backward, in q's dtype), None: torch math, fp32."""
    B, h, nq, d = q.shape
    nk = k.shape[2]
    if backend is not None:
        dq, dk, dv = backend.backward(_by_rows(q, nk), k, v, _by_rows(o, nk), _by_rows(lse, nk).contiguous(),
                                      _by_rows(do, nk), diagonal, deterministic)
        return dq.view(B, h, nq, d), dk, dv
    g = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    delta = (do.to(acc) * o.to(acc)).sum(-1)
    s = _scores(q, k, diagonal, acc)
    p = torch.exp(s - lse.to(acc).view(B, g, h // g, nq, 1))
    dof = do.to(acc).view(B, g, h // g, nq, d)
    dv = torch.matmul(p.transpose(-1, -2), dof).sum(2)
    dp = torch.matmul(dof, v.to(acc).unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.view(B, g, h // g, nq, 1)) / math.sqrt(d)
    dq = torch.matmul(ds, k.to(acc).unsqueeze(2)).reshape(B, h, nq, d)
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc).view(B, g, h // g, nq, d)).sum(2)
    return dq, dk, dv


class RowsDq:
    """dQ of this rank's query rows over the ring's steps. With a backend that sums it in its kernels
    (the fused backend's five products: backend.dq_sum), each piece's kernel adds its dS K into one
    fp32 sum laid out as the kernels hold it, Dl = rowsum(dO o O) is computed once for all the rows
    instead of once a piece, and the sum becomes dQ once (backend.dq_of_sum), in q's dtype. That
    needs the pieces' rows on the kernels' 64-row tiles: causal, n a multiple of 128. Else (and for
    any other backend) each piece's dQ is added into an fp32 tensor (fp64 for fp64)."""

    def __init__(self, backend, q, o, lse, do, causal: bool, deterministic: bool):
        make = getattr(backend, "dq_sum", None)
        self.backend = backend
        self.sums = None
        if make is not None and (not causal or q.shape[2] % 128 == 0):
            self.sums = make(q, o, lse, do, deterministic)
        self.dq = None if self.sums is not None else torch.zeros(q.shape, dtype=lse.dtype, device=q.device)

    def result(self) -> torch.Tensor:
        return self.dq if self.sums is None else self.backend.dq_of_sum(self.sums)


def step_backward(backend, q, k, v, o, lse, do, c: int, j: int, causal: bool, deterministic: bool, dq: RowsDq):
    """One step of the ring's backward on rank c with ring rank j's block k, v in hand: each piece's
    backward, its dQ added into dq (RowsDq: in the kernels' sum, or piece_backward's dQ added into
    fp32); returns the pieces' (k0, k1, dk, dv), this rank's share of the block's gradients, for
    block_sums."""
    parts = []
    n = q.shape[2]
    for q0, q1, k0, k1, diag in pieces(c, j, n, causal):
        ks, vs = k[:, :, k0:k1], v[:, :, k0:k1]
        if dq.sums is not None:
            # the piece's rows in the sum: a range of each head's rows (as many as keys), or all of them
            # seen as more heads (_by_rows)
            nk = k1 - k0
            if q1 - q0 == nk:
                ldn, qoff = n, q0
            else:
                assert q0 == 0 and q1 == n, (q0, q1, n)
                ldn, qoff = nk, 0
            dk_b, dv_b = backend.backward_summing(_by_rows(q[:, :, q0:q1], nk), ks, vs, _by_rows(do[:, :, q0:q1], nk),
                                                  diag, dq.sums, ldn, qoff)
        else:
            dq_b, dk_b, dv_b = piece_backward(backend, q[:, :, q0:q1], ks, vs, o[:, :, q0:q1], lse[:, :, q0:q1],
                                              do[:, :, q0:q1], diag, deterministic)
            dq.dq[:, :, q0:q1] += dq_b
        parts.append((k0, k1, dk_b, dv_b))
    return parts


def block_sums(parts, like: torch.Tensor, sums=None):
    """A block's dK and dV sums (fp32, fp64 for fp64; like's shape) with this rank's parts added: into
    `sums` in place (the earlier ranks' sums, arrived with the block), else new ones, zero where no
    part reaches. One pass over each part's rows (the pieces of a step reach disjoint key rows); no
    zeroed buffer summed into and then added to the arrivals."""
    if sums is not None:
        for k0, k1, dk, dv in parts:
            sums[0][:, :, k0:k1] += dk
            sums[1][:, :, k0:k1] += dv
        return sums
    acc = torch.promote_types(like.dtype, torch.float32)
    sums = (torch.empty(like.shape, dtype=acc, device=like.device), torch.empty(like.shape, dtype=acc, device=like.device))
    at = 0
    for k0, k1, dk, dv in sorted(parts, key=lambda p: p[0]):
        if k0 > at:
            sums[0][:, :, at:k0].zero_()
            sums[1][:, :, at:k0].zero_()
        sums[0][:, :, k0:k1].copy_(dk)
        sums[1][:, :, k0:k1].copy_(dv)
        at = k1
    if at < like.shape[2]:
        sums[0][:, :, at:].zero_()
        sums[1][:, :, at:].zero_()
    return sums
