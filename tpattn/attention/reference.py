"""The torch reference: the seed's three passes with the same rounding points as the CUDA
kernels (S and P are stored in the storage dtype; products and sums in float32). Runs on CPU
and GPU; this is what a machine without a GPU runs."""

from __future__ import annotations

import math

import torch

from ..timing import section
from . import Backend

# Heads are processed in chunks so the float32 scores of one chunk stay below this many bytes.
CHUNK_BYTES = {"cpu": 256 << 20, "cuda": 2 << 30}


def causal_mask(n: int, device) -> torch.Tensor:
    """True where the key index is greater than the query index (those scores do not count)."""
    idx = torch.arange(n, device=device)
    return idx[None, :] > idx[:, None]


class ReferenceBackend(Backend):
    name = "reference"

    def forward(self, q, k, v, causal: bool, timer=None, out=None):
        b, h, n, d = q.shape
        dtype = q.dtype
        scale = 1.0 / math.sqrt(d)
        o = out if out is not None else torch.empty_like(q)
        per_head = b * n * n * 4
        chunk = max(1, min(h, CHUNK_BYTES[q.device.type] // max(per_head, 1)))
        mask = causal_mask(n, q.device) if causal else None
        for h0 in range(0, h, chunk):
            sl = slice(h0, min(h, h0 + chunk))
            with section(timer, "qk"):
                s = torch.matmul(q[:, sl].float(), k[:, sl].float().transpose(-1, -2)).mul_(scale)
                if mask is not None:
                    s.masked_fill_(mask, float("-inf"))
                s = s.to(dtype)
            with section(timer, "softmax"):
                p = torch.softmax(s.float(), dim=-1).to(dtype)
            del s
            with section(timer, "pv"):
                o[:, sl] = torch.matmul(p.float(), v[:, sl].float()).to(dtype)
            del p
        return o
