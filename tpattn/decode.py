"""Decoding through the tensor-parallel layer: a KV cache sharded by heads and rotary positions.

    cache = layer.new_cache(batch, max_len)       # this rank's K/V heads only: [B, g, max_len, d]
    y = layer(x_prompt, cache=cache)              # prefill: N rows appended, attended causally
    y = layer(x_next, cache=cache)                # a decode step: one row per sequence

Each rank keeps the K and V of its own K/V heads (grouped-query attention: its split of them, or
its copy of the one its query heads use: the forward's rule), so the cache divides over the ranks
as the heads do and a step's only communication is the output projection's sum of B x T x D values.
Rotary position embeddings (rope_theta, off by default) rotate q and k before the append, at the
positions the cache's length gives: the Hugging Face convention (the two halves of each head's
columns) by default, the interleaved one (pairs of neighbouring columns, Meta's) as an option.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import ConfigError


@dataclass
class KVCache:
    """K and V of one layer's K/V heads on this rank, and how many positions are filled."""
    k: torch.Tensor          # [B, g, max_len, d]
    v: torch.Tensor
    owner: tuple             # the layer's shard record and head dim: a cache fits only its own layer
    length: int = 0
    layer_id: int = field(default=0, repr=False)

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def check(self, layer_id: int, owner: tuple, batch: int, rows: int) -> None:
        """One line naming the fix, the same on every rank (every rank's cache has the same length)."""
        if self.layer_id != layer_id or self.owner != owner:
            raise ConfigError("this cache belongs to another layer (or another world size or shard); make one with "
                              "this layer's new_cache(batch, max_len)")
        if batch != self.batch:
            raise ConfigError(f"the cache holds {self.batch} sequences but the input has {batch}; make a cache with "
                              f"new_cache({batch}, max_len)")
        if self.length + rows > self.max_len:
            raise ConfigError(f"the cache holds max_len={self.max_len} positions, {self.length} filled: this call "
                              f"appends {rows} more; make the cache larger (new_cache(batch, max_len="
                              f"{self.length + rows} or more))")


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype=torch.float32):
    """(cos, sin) [len(positions), head_dim / 2] of the angles position x theta^(-2i/d), in fp32."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """t [B, heads, T, d] rotated by the angles of its T positions, in fp32, back in t's dtype.
    Halves (Hugging Face): column i pairs with column i + d/2; interleaved: 2i with 2i + 1."""
    x = t.float()
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    else:
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return out.to(t.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """softmax(q kᵀ/√d) v for q [B, h, T, d] at positions offset..offset+T-1 over the cache's first
    offset + T positions k, v [B, g, L, d] (g divides h: grouped-query attention read in place),
    causal: query i sees keys up to offset + i. fp32 inside, S and P rounded to the storage dtype as
    the reference backend rounds them."""
    B, h, T, d = q.shape
    g, L = k.shape[1], k.shape[2]
    dtype = q.dtype
    qf = q.float().view(B, g, h // g, T, d)
    s = torch.matmul(qf, k.float().unsqueeze(2).transpose(-1, -2)) * (1.0 / math.sqrt(d))  # [B, g, h/g, T, L]
    if T > 1:
        s = s.masked_fill(torch.arange(L, device=q.device)[None, :] > offset + torch.arange(T, device=q.device)[:, None],
                          float("-inf"))
    p = torch.softmax(s.to(dtype).float(), dim=-1).to(dtype)
    return torch.matmul(p.float(), v.float().unsqueeze(2)).to(dtype).view(B, h, T, d)
