"""The torch reference: the seed's three passes with the same rounding points as the CUDA
kernels (S and P are stored in the storage dtype; products and sums in float32). Runs on CPU
and GPU; this is what a machine without a GPU runs. Grouped-query attention: a group's query
heads are multiplied with its one K/V head by broadcasting (K and V are never repeated)."""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from ..timing import section
from . import Backend, head_chunks, kv_group

# Heads are processed in chunks so the float32 scores of one chunk stay below this many bytes.
CHUNK_BYTES = {"cpu": 256 << 20, "cuda": 2 << 30}


def causal_mask(n: int, device) -> torch.Tensor:
    """True where the key index is greater than the query index (those scores do not count)."""
    idx = torch.arange(n, device=device)
    return idx[None, :] > idx[:, None]


class ReferenceBackend(Backend):
    name = "reference"

    def forward(self, q, k, v, causal: bool, out=None):
        """attention()'s math a chunk of heads at a time (the float32 scores of a chunk below
        CHUNK_BYTES), outside autograd: the same bits as the training forward."""
        b, h, n, d = q.shape
        group = kv_group(q, k, v)
        acc = torch.promote_types(q.dtype, torch.float32)
        o = out if out is not None else torch.empty_like(q)
        per_head = b * n * n * acc.itemsize
        chunk = max(1, min(h, CHUNK_BYTES[q.device.type] // max(per_head, 1)))
        for h0, h1 in head_chunks(h, group, chunk):
            kv = slice(h0 // group, (h1 - 1) // group + 1)
            o[:, h0:h1] = self._attention(q[:, h0:h1], k[:, kv], v[:, kv], causal, (h1 - h0) // (kv.stop - kv.start),
                                          acc, timed=True)
        return o

    def attention(self, q, k, v, causal: bool, deterministic: bool = False):
        """The same math as forward(), in torch ops that autograd differentiates (fp32 inside, or
        fp64 for fp64 inputs; the storage dtype at the same rounding points: S, P and O rounded)."""
        group = kv_group(q, k, v)
        acc = torch.promote_types(q.dtype, torch.float32)
        with section("attention"):
            return self._attention(q, k, v, causal, group, acc)

    @staticmethod
    def _attention(q, k, v, causal, group, acc, timed=False):
        """The three passes for q [B, h, N, d] and its K/V heads k, v [B, g, N, d] (g = h / group),
        a group's query heads against their K/V head by broadcasting; timed: each pass on the
        recording timer (qk, softmax, pv)."""
        b, h, n, d = q.shape
        dtype, g = q.dtype, k.shape[1]
        on = section if timed else (lambda name: nullcontext())
        with on("qk"):
            qf = q.to(acc).reshape(b, g, group, n, d)
            s = torch.matmul(qf, k.to(acc).unsqueeze(2).transpose(-1, -2)) * (1.0 / math.sqrt(d))
            if causal:
                s = s.masked_fill(causal_mask(n, q.device), float("-inf"))
            s = s.to(dtype)
        with on("softmax"):
            p = torch.softmax(s.to(acc), dim=-1).to(dtype)
        del s
        with on("pv"):
            return torch.matmul(p.to(acc), v.to(acc).unsqueeze(2)).to(dtype).reshape(b, h, n, d)
