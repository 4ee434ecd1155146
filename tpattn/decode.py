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

from .errors import ConfigError, cupy_available

DEC_SOURCE = "decode_attention.cu"
DEC_HEAD_DIMS = (64, 128)


@dataclass
class KVCache:
    """K and V of one layer's K/V heads on this rank, and how many positions are filled."""
    k: torch.Tensor          # [B, g, max_len, d]
    v: torch.Tensor
    owner: tuple             # the layer's shard record and head dim: a cache fits only its own layer
    length: int = 0          # what the host knows; `pos` holds the same on the cache's device
    layer_id: int = field(default=0, repr=False)
    pos: torch.Tensor | None = field(default=None, repr=False)  # int64 [1]: where the next row goes
    cos: torch.Tensor | None = field(default=None, repr=False)  # rotary tables [max_len, d/2], fp32 (or None)
    sin: torch.Tensor | None = field(default=None, repr=False)
    tickets: torch.Tensor | None = field(default=None, repr=False)  # the decode kernel's counters, [B x g]

    def __post_init__(self):
        if self.pos is None:
            self.pos = torch.full((1,), self.length, dtype=torch.int64, device=self.k.device)
        if self.tickets is None:
            self.tickets = torch.zeros(self.k.shape[0] * self.k.shape[1], dtype=torch.int32, device=self.k.device)

    def reset(self) -> None:
        """Empty the cache (its memory is kept: a CUDA graph of a step on it stays valid)."""
        self.length = 0
        self.pos.zero_()

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


def decode_splits(bg: int, length: int, sms: int, per_sm: int = 4) -> int:
    """How many chunks the cache length is split into: about `per_sm` blocks per SM, chunks of at
    least 64 keys, at most 1024 chunks (the combine's weights). Measured on an H200
    (scripts/bench_decode.py's shapes, 1 to 8 blocks an SM): 4 for the CUDA-core split, 2 for the
    tensor-core one (docs/decode.md)."""
    return max(1, min(-(-per_sm * sms // bg), -(-length // 64), 1024))


def kernel_takes(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether kernels/decode_attention.cu runs for tensors of this device, dtype and head dim."""
    return (device.type == "cuda" and head_dim in DEC_HEAD_DIMS and dtype in (torch.float16, torch.bfloat16)
            and cupy_available())


def decode_kernel_fits(q: torch.Tensor) -> bool:
    """Whether kernels/decode_attention.cu takes q (else attend's torch math runs)."""
    return kernel_takes(q.device, q.dtype, q.shape[-1])


# which split of kernels/decode_attention.cu runs: "auto" (CUDA cores for multi-head attention,
# tensor cores for grouped heads: the faster one of each, measured), or "cores" / "mma" everywhere
SPLIT_KERNEL = "auto"
_tickets: dict = {}


def ticket_counters(device: torch.device, n: int) -> torch.Tensor:
    """Counters for a split kernel launch that was given none (a cache brings its own, made with
    it): zeros, and every launch leaves them zero (the last block of each (b, g) resets its own).
    Eager: one set per stream, kept, so that launches on two streams never share a count. While a
    CUDA graph is being captured: a new set, which that graph owns and zeroes on each replay (a set
    kept from another graph may never have been zeroed when this one first replays)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    t = _tickets.get(key)
    if t is None or t.numel() < n:
        t = _tickets[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return t


def graph_refusal(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why a decode step on this device, dtype and head dim cannot be captured in a CUDA graph (the
    torch fallback slices the cache at the length the host knows: a graph would keep that length),
    or None."""
    if kernel_takes(device, dtype, head_dim):
        return None
    return (f"a graphed decode step needs the decode kernel (a CUDA device, fp16 or bf16, head dim 64 or 128, "
            f"CuPy; here {device.type}, {str(dtype).replace('torch.', '')}, head dim {head_dim}); call the layer "
            "eagerly instead")


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int,
                     pos: torch.Tensor | None = None, tickets: torch.Tensor | None = None) -> torch.Tensor:
    """The attention of one query row per sequence, q [B, h, 1, d] at position length - 1, over the
    first `length` positions of the cache k, v [B, g, max_len, d] (contiguous): the split-K kernel
    (kernels/decode_attention.cu) on a GPU, else attend(). pos (a cache's device position, int64
    [1]): the kernel reads the length there instead (pos + 1: one CUDA graph serves every step) and
    splits by the cache's capacity; `length` is then what the host knows it to be. tickets: the
    kernel's counters (int32, B x g of them, zeros; a cache's own), else ticket_counters()."""
    B, h, T, d = q.shape
    if T != 1 or not decode_kernel_fits(q) or not (k.is_contiguous() and v.is_contiguous()):
        return attend(q, k[:, :, :length], v[:, :, :length], length - T)
    import numpy as np

    from .cuda import GRID_YZ_MAX, launch, ptr
    g, lmax = k.shape[1], k.shape[2]
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    mma = SPLIT_KERNEL == "mma" or (SPLIT_KERNEL == "auto" and h > g)
    suf = "f16" if q.dtype == torch.float16 else "bf16"
    S = decode_splits(B * g, lmax if pos is not None else length, sms, 2 if mma else 4)
    if mma:  # tensor cores: the group's heads as the rows of an m16 tile, 8 or 16 at a time; with 3
        # or more chunks, the next tile's loads in flight while one is computed (_p: faster there,
        # slower at large batch, where fewer blocks fit: measured)
        name = f"dec_mma_{suf}_d{d}_r{16 if h // g > 8 else 8}{'_p' if S >= 3 else ''}"
    else:  # CUDA cores: 1, 2, 4 or 8 query heads at a time
        name = f"dec_split_{suf}_d{d}_g{next(n for n in (1, 2, 4, 8) if n >= min(h // g, 8))}"
    q = q.contiguous()
    op = torch.empty(B, h, S, d, dtype=torch.float32, device=q.device)
    lp = torch.empty(B, h, S, dtype=torch.float32, device=q.device)
    o = torch.empty_like(q)
    launch(DEC_SOURCE, name, q.device, (S, min(B * g, GRID_YZ_MAX), 1), (128, 1, 1),
           (ptr(q), ptr(k), ptr(v), ptr(op), ptr(lp), ptr(o), ptr(tickets if tickets is not None else ticket_counters(q.device, B * g)), np.int32(B * g),
            np.int32(g), np.int32(h // g), np.int32(1 if pos is not None else length),
            np.uint64(0) if pos is None else ptr(pos), np.int32(lmax), np.int32(S),
            np.float32(math.log2(math.e) / math.sqrt(d))))
    return o


def append_row(qkv: torch.Tensor, cache: KVCache, heads: int, interleaved: bool) -> torch.Tensor:
    """A decode step's rows qkv [B, heads + 2g, d] (the QKV GEMM's output): q and k rotated at the
    cache's device position (when the cache has rotary tables), k and v written into the cache
    there; returns q [B, heads, 1, d]. One kernel (dec_append) on a GPU, torch ops elsewhere. The
    cache's position is not advanced (the caller does it once the step's attention is queued)."""
    B, rows, d = qkv.shape
    g = (rows - heads) // 2
    if not (decode_kernel_fits(qkv) and qkv.is_contiguous()):
        q, k, v = (t.unsqueeze(2) for t in qkv.split([heads, g, g], dim=1))
        if cache.cos is not None:
            cos, sin = cache.cos.index_select(0, cache.pos), cache.sin.index_select(0, cache.pos)
            q, k = apply_rope(q, cos, sin, interleaved), apply_rope(k, cos, sin, interleaved)
        cache.k.index_copy_(2, cache.pos, k)
        cache.v.index_copy_(2, cache.pos, v)
        return q
    import numpy as np

    from .cuda import launch, ptr
    q = torch.empty(B, heads, 1, d, dtype=qkv.dtype, device=qkv.device)
    suf = "f16" if qkv.dtype == torch.float16 else "bf16"
    rope = cache.cos is not None
    n = B * rows * d // 2
    launch(DEC_SOURCE, f"dec_append_{suf}", qkv.device, (min(-(-n // 256), 65535), 1, 1), (256, 1, 1),
           (ptr(qkv), ptr(q), ptr(cache.k), ptr(cache.v), ptr(cache.cos) if rope else np.uint64(0),
            ptr(cache.sin) if rope else np.uint64(0), ptr(cache.pos), np.int32(B), np.int32(heads), np.int32(g),
            np.int32(d), np.int32(cache.max_len), np.int32(1 if interleaved else 0)))
    return q
