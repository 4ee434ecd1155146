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

from .attention import custom_ops, fp8
from .errors import ConfigError, cupy_available, is_count

DEC_SOURCE = "decode_attention.cu"
DEC_HEAD_DIMS = (64, 128)                        # every split: CUDA cores and tensor cores
DEC_DIMS_SOURCE = "decode_attention_dims.cu"     # the CUDA-core split alone at the other head dims users run
DEC_SPLIT_HEAD_DIMS = (32, 80, 96, 160, 192, 256)


def dec_source(head_dim: int) -> str:
    """The module whose kernels serve this head dim (both hold the append and preparation kernels, so
    that a head dim compiles one module)."""
    return DEC_SOURCE if head_dim in DEC_HEAD_DIMS else DEC_DIMS_SOURCE
CHUNK_BYTES = {"cpu": 256 << 20, "cuda": 1 << 30}  # attend(): the most bytes of scores a block of query rows holds


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

    def check(self, layer_id: int, owner: tuple, batch: int, rows: int, dtype=None, device=None) -> None:
        """One line naming the fix, the same on every rank (every rank's cache has the same length)."""
        if self.layer_id != layer_id or self.owner != owner:
            raise ConfigError("this cache belongs to another layer (or another world size or shard); make one with "
                              "this layer's new_cache(batch, max_len)")
        if dtype is not None and self.k.dtype != dtype:
            raise ConfigError(f"this cache holds {str(self.k.dtype).replace('torch.', '')} K/V but the layer is now "
                              f"{str(dtype).replace('torch.', '')} (.half() or .to() after new_cache); make a new cache "
                              "with new_cache(batch, max_len)")
        if device is not None and self.k.device != device:
            raise ConfigError(f"this cache is on {self.k.device} but the layer is now on {device} (.to() after "
                              "new_cache); make a new cache with new_cache(batch, max_len)")
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


_rope_rows: dict = {}   # (device, head_dim, theta, dtype[, interleaved]) -> tables of positions 0, 1, ...
_rope_kept: list = []   # tables outgrown, kept: a captured CUDA graph may read them


def rope_rows(device, upto: int, head_dim: int, theta: float, dtype=torch.float32,
              interleaved: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [>= upto, head_dim / 2] of positions 0, 1, ... (rope_tables' values, bit for bit) on
    `device`; with interleaved given, rope_signed's (C, S) [>= upto, head_dim] of them for that layout.
    Made once per device, head dim, theta, dtype (and layout), grown by doubling, so a call slices them
    instead of issuing the tables' dozen small operations again. An outgrown table stays allocated."""
    key = (torch.device(device), head_dim, theta, dtype, interleaved)
    have = _rope_rows.get(key)
    if have is None or have[0].shape[0] < upto:
        n = max(int(upto), 2 * have[0].shape[0] if have is not None else 1024)
        if have is not None:
            _rope_kept.append(have)
        have = rope_tables(torch.arange(n, device=device), head_dim, theta, dtype)
        have = _rope_rows[key] = have if interleaved is None else rope_signed(*have, interleaved)
    return have


def rope_signed(cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables [T, d/2] laid over a head's d columns, (C, S) [T, d]: each pair's cos at both of its
    columns, its sin negated at the pair's first column (apply_rope's products)."""
    if interleaved:
        return torch.stack([cos, cos], -1).flatten(-2), torch.stack([-sin, sin], -1).flatten(-2)
    return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """t [B, heads, T, d] rotated by the angles of its T positions, in fp32, back in t's dtype.
    Halves (Hugging Face): column i pairs with column i + d/2; interleaved: 2i with 2i + 1. cos, sin:
    [T, d/2] (rope_tables), or rope_signed's (C, S) [T, d]. Each column is x C + partner S, the pair's
    other column as its partner: a cos - b sin and b cos + a sin, each product and the sum rounded in
    fp32 as written that way (the same bits), in four kernels."""
    d, acc = t.shape[-1], torch.promote_types(t.dtype, torch.float32)
    C, S = (cos, sin) if cos.shape[-1] == d else rope_signed(cos, sin, interleaved)
    if C.dtype != acc:  # (tables of another precision: the products in fp32, or fp64 for fp64, all the same)
        C, S = C.to(acc), S.to(acc)
    partner = (t.unflatten(-1, (d // 2, 2)).flip(-1) if interleaved else t.unflatten(-1, (2, d // 2)).flip(-2)).flatten(-2)
    a, b = t * C, partner * S  # (a 16-bit t widens exactly in the product)
    if torch.is_grad_enabled() and t.requires_grad:
        return (a + b).to(t.dtype)
    return torch.add(a, b, out=torch.empty(t.shape, dtype=t.dtype, device=t.device))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """softmax(q kᵀ/√d) v for q [B, h, T, d] at positions offset..offset+T-1 over the cache's first
    offset + T positions k, v [B, g, L, d] (g divides h: grouped-query attention read in place),
    causal: query i sees keys up to offset + i. fp32 inside (fp64 for fp64), S and P rounded to the
    storage dtype as the reference backend rounds them. The scores are materialized a block of query
    rows at a time, each block's at most CHUNK_BYTES (memory O(rows x L) per block, never T x L)."""
    B, h, T, d = q.shape
    g, L = k.shape[1], k.shape[2]
    dtype, acc = q.dtype, torch.promote_types(q.dtype, torch.float32)
    step = max(1, CHUNK_BYTES.get(q.device.type, CHUNK_BYTES["cpu"]) // max(1, 3 * B * h * L * acc.itemsize))
    if T > step:
        return torch.cat([attend(q[:, :, t0:t0 + step], k, v, offset + t0) for t0 in range(0, T, step)], dim=2)
    qf = q.to(acc).view(B, g, h // g, T, d)
    s = torch.matmul(qf, k.to(acc).unsqueeze(2).transpose(-1, -2)) * (1.0 / math.sqrt(d))  # [B, g, h/g, T, L]
    if T > 1 or offset + T < L:
        s = s.masked_fill(torch.arange(L, device=q.device)[None, :] > offset + torch.arange(T, device=q.device)[:, None],
                          float("-inf"))
    p = torch.softmax(s.to(dtype).to(acc), dim=-1).to(dtype)
    return torch.matmul(p.to(acc), v.to(acc).unsqueeze(2)).to(dtype).view(B, h, T, d)


DEC_COMBINE_W = 1024  # the most partials a head the kernels' combine takes (kernels/decode_attention.cu)
DEC_THREADS = 128     # a split block's threads
WAVES_MEASURED = 4    # decode_splits follows the occupancy up to launches of this many waves
DEC_STAGES = 3        # the staged split's stages a warp (kernels/decode_attention.cu's DEC_STAGES)
DEC_STAGED = True     # the staged tensor-core split (_b) over the contiguous cache (compute capability 9.0+)
DEC_STAGED_PAGED = False  # ... and over a pool of whole-tile pages, in chunks of equal work (_pgb): off, slower
                          # than _p_pg on one H100 with its first grid (docs/decode.md); for A/B runs
DEC_F8_TILE_PAGES = True   # an FP8 pool of whole-tile pages through the tensor-core split's _pgt8 build (PG 2: no
                           # run-time choice of addressing, a tile's scales in paired loads) instead of _pg8 (any
                           # page size): the same bits, in 0.69-0.86x its time on an H100 (docs/serving.md)
DEC_F8_KT = True      # ... and, 8 query heads a pass or fewer, through _pgt8s instead (the keys as the rows of both
                      # products: half the tensor-core products, no register copies into A; 147 registers at
                      # d = 128 _p against 174): 0.80-0.98x _pgt8's time on an H100 (docs/serving.md); off for A/B runs
DEC_KT16 = False      # 16-bit pages of whole tiles, 8 query heads a pass or fewer, through the tensor-core split's
                      # _pgs (the keys as the rows of both products, as an FP8 pool's _pgt8s: half the products,
                      # 307 SASS instructions a tile at d = 128 _p against _pg's 356): for A/B runs, not measured yet
DEC_F8_PIPE = True    # an FP8 pool's tensor-core split pipelines its loads (_p) from 3 chunks on, as 16-bit pages
                      # do; off: never (at d = 128 _pgt8s holds 4 blocks an SM without, 3 with): 0.95-0.98x the
                      # time without on an H100 where it applies (scripts/sweep_decode_splits.py --fp8); off for A/B runs
EQ_SPREAD = 4         # _pgb: the grid's chunks a pair, over one_block_an_sm's: room for a sequence this many
                      # times the batch's mean length to take its share of chunks


def decode_splits(bg: int, length: int, sms: int, per_sm: int = 4, resident: int = 0, uniform: bool = True) -> int:
    """How many chunks the cache length is split into for bg (sequence, K/V head) pairs: about `per_sm`
    blocks per SM, chunks of at least 64 keys, at most 1024 chunks (the combine's weights). Measured
    on an H200 (scripts/bench_decode.py's shapes, 1 to 8 blocks an SM): 4 for the CUDA-core split, 2
    for the tensor-core one (docs/decode.md).

    resident: how many blocks of the kernel an SM holds at once (0: not known). Where that split's
    blocks do not all fit on the GPU at once, a last wave of a few blocks would leave most SMs idle
    (the split is memory-bound): then, for sequences of one length (uniform: a contiguous cache, or
    one sequence), the most chunks that fit in one wave if that is at least half the split; else the
    count from the split to twice it whose last wave is fullest (never fewer chunks for ragged
    lengths: a long sequence's chunks would be its blocks' critical path). Measured on an H100:
    scripts/sweep_decode_splits.py, docs/decode.md; launches of more than WAVES_MEASURED waves (a
    larger batch than measured, where a last wave costs less) keep the split."""
    most = max(1, min(-(-length // 64), DEC_COMBINE_W))
    S = max(1, min(-(-per_sm * sms // bg), most))
    slots = resident * sms
    if not slots or bg * S <= slots or bg * S > WAVES_MEASURED * slots:
        return S
    one = slots // bg
    if uniform and 2 * one >= S:
        return one

    def fill(n: int) -> float:  # the blocks' share of the waves' slots
        return bg * n / (-(-bg * n // slots) * slots)
    near = range(max(1, S // 2) if uniform else S, min(2 * S + 2, most) + 1)
    top = max(fill(n) for n in near)
    return min((n for n in near if fill(n) >= top - 0.03), key=lambda n: (abs(n - S), n))


def one_block_an_sm(bg: int, length: int, sms: int) -> int:
    """The staged split's chunks (_b, the contiguous cache) where its bg (sequence, K/V head) pairs are
    no more than the SMs: as many chunks as give every pair's chunks one SM each (bg x S <= sms), no
    more than the cache's 64-key pieces, at most DEC_COMBINE_W. Measured on one H100
    (scripts/sweep_decode_splits.py, 8 K/V heads of 4 query heads each, docs/decode.md): faster than the
    two blocks an SM its shared memory allows, at B = 1, L = 32768 (16 chunks: 53.7 us against 56.4 at
    33), B = 4, L = 8192 (4: 53.7 against 54.6 at 8) and B = 16, L = 4096 (1: 92.9 against 98.3 at 2).
    _split_kernel takes it for groups of up to 8 query heads a K/V head (the r8 build); larger groups
    run the r16 build (16 heads a pass, two passes over a chunk for 32) and were not measured."""
    return max(1, min(sms // bg, -(-length // 64), DEC_COMBINE_W))


def equal_work_chunks(bg: int, longest: int, sms: int) -> int:
    """The grid's chunks a (sequence, K/V head) pair for the staged split over pages (_pgb), bg pairs
    no more than the SMs. The kernel cuts the batch's keys into chunks of equal work, about one an SM
    (eq_blocks), from the lengths on the device, so one CUDA graph serves every mix of lengths; a
    sequence then takes chunks in proportion to its length, up to the grid's: EQ_SPREAD times
    one_block_an_sm's count, no more than the longest's 64-key pieces or DEC_COMBINE_W. A sequence
    longer than EQ_SPREAD times the mean makes the chunks longer (the longest over this count)."""
    return max(1, min(EQ_SPREAD * max(1, sms // bg), -(-longest // 64), DEC_COMBINE_W))


def eq_blocks(sms: int) -> int:
    """The non-empty blocks the staged split over pages (_pgb) aims at: one an SM (see one_block_an_sm)."""
    return sms


def kernel_takes(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether kernels/decode_attention.cu runs for tensors of this device, dtype and head dim."""
    return (device.type == "cuda" and head_dim in DEC_HEAD_DIMS + DEC_SPLIT_HEAD_DIMS
            and dtype in (torch.float16, torch.bfloat16)
            and cupy_available())


def decode_kernel_fits(q: torch.Tensor) -> bool:
    """Whether kernels/decode_attention.cu takes q (else attend's torch math runs)."""
    return kernel_takes(q.device, q.dtype, q.shape[-1])


FP8_PAGE_HEAD_DIMS = tuple(sorted(DEC_HEAD_DIMS + DEC_SPLIT_HEAD_DIMS))  # an FP8 pool's kernels (dec_append_pg8, _pg8)
FP8_CC = fp8.CC                     # e4m3 conversions in hardware (cvt ... e4m3x2)


def fp8_pages_fit(q: torch.Tensor) -> bool:
    """Whether an FP8 pool's steps (PagedKV(kv_dtype="fp8")) run the kernels for q (rows [..., d]):
    the decode kernels take q (every head dim the split takes), on compute capability 8.9 or later.
    Else torch math over the dequantized pages."""
    return (decode_kernel_fits(q) and q.shape[-1] in FP8_PAGE_HEAD_DIMS
            and torch.cuda.get_device_capability(q.device) >= FP8_CC)


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
    dims = ", ".join(map(str, sorted(DEC_HEAD_DIMS + DEC_SPLIT_HEAD_DIMS)))
    return (f"a graphed decode step needs the decode kernel (a CUDA device, fp16 or bf16, head dim {dims}, "
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
    if torch.compiler.is_compiling() and pos is not None and tickets is not None:  # one op in a traced graph
        return custom_ops.decode_attention_op(q, k, v, pos, tickets)
    import numpy as np

    from .cuda import GRID_YZ_MAX, launch, ptr
    g, lmax = k.shape[1], k.shape[2]
    source, name, S, smem = _split_kernel(q, B, h, g, d, lmax if pos is not None else length)
    q = q.contiguous()
    op = torch.empty(B, h, S, d, dtype=torch.float32, device=q.device)
    lp = torch.empty(B, h, S, dtype=torch.float32, device=q.device)
    o = torch.empty_like(q)
    launch(source, name, q.device, (S, min(B * g, GRID_YZ_MAX), 1), (DEC_THREADS, 1, 1),
           (ptr(q), ptr(k), ptr(v), ptr(op), ptr(lp), ptr(o), ptr(tickets if tickets is not None else ticket_counters(q.device, B * g)), np.int32(B * g),
            np.int32(g), np.int32(h // g), np.int32(1 if pos is not None else length),
            np.uint64(0) if pos is None else ptr(pos), np.int32(lmax), np.int32(S),
            np.float32(math.log2(math.e) / math.sqrt(d)), np.uint64(0), np.uint64(0), np.int32(0), np.int32(0)),
           shared_mem=smem)
    return o


def tile_pages(page: int) -> bool:
    """Whether pages of `page` tokens hold whole 16-key tiles of the tensor-core split: a power of two
    of 16 or more."""
    return page >= 16 and page & (page - 1) == 0


def dec_ring_bytes(d: int) -> int:
    """The staged tensor-core split's (_b) dynamic shared memory: its 4 warps' rings of DEC_STAGES stages
    of a 16-key K and V tile (kernels/decode_attention.cu)."""
    return DEC_THREADS // 32 * DEC_STAGES * 2 * 16 * d * 2


def _split_kernel(q: torch.Tensor, B: int, h: int, g: int, d: int, length: int,
                  page: int = 0, fp8: bool = False) -> tuple[str, str, int, int]:
    """(source, kernel name, chunks S, dynamic shared memory bytes) of kernels/decode_attention.cu
    (decode_attention_dims.cu for a head dim other than 64 and 128: the CUDA-core split there, grouped
    heads too) for B sequences of h query heads over g K/V heads, the cache split by `length` (the
    longest it can be). page: a pool's page size (0: the contiguous cache); the tensor-core split has
    a build for pages of a power of two of 16 tokens or more (_pg: a block-table lookup a 16-key tile)
    and one for the others (_pgk: a lookup a key). fp8: an FP8 pool's pages (the same choice of split,
    each kernel's _pg8; the tensor-core split's _pgt8 over whole-tile pages where DEC_F8_TILE_PAGES, _pgt8s
    where DEC_F8_KT too and a pass takes the group); 16-bit whole-tile pages take _pgs instead of _pg where
    DEC_KT16 and a pass takes the group (the keys as the products' rows). On
    compute capability 9.0 and up (DEC_STAGED) the tensor-core split over the
    contiguous cache is the staged one (_b: bulk copies through shared memory), split one block an SM
    where its pairs fit (one_block_an_sm); over whole-tile pages of the storage dtype where the pairs
    fit (DEC_STAGED_PAGED), the staged build _pgb, whose chunks the kernel sizes for equal work across
    the sequences (equal_work_chunks: here S is the grid's chunks a pair, the most a sequence takes)."""
    from .cuda import resident_blocks
    props = torch.cuda.get_device_properties(q.device)
    sms = props.multi_processor_count
    mma = d in DEC_HEAD_DIMS and (SPLIT_KERNEL == "mma" or (SPLIT_KERNEL == "auto" and h > g))
    staged = DEC_STAGED and mma and not page and props.major >= 9
    eq = (DEC_STAGED_PAGED and mma and page and tile_pages(page) and not fp8 and props.major >= 9
          and B * g <= sms and h // g <= 8)
    smem = dec_ring_bytes(d) if staged or eq else 0
    source = dec_source(d)
    suf = "f16" if q.dtype == torch.float16 else "bf16"
    pg = "_pg8" if fp8 else "" if not page else "_pg" if not mma or tile_pages(page) else "_pgk"
    mma_pg = pg
    if fp8 and DEC_F8_TILE_PAGES and tile_pages(page):
        mma_pg = "_pgt8s" if DEC_F8_KT and h // g <= 8 else "_pgt8"
    elif not fp8 and page and DEC_KT16 and tile_pages(page) and h // g <= 8:
        mma_pg = "_pgs"

    if eq:
        return source, f"dec_mma_{suf}_d{d}_r8_pgb", equal_work_chunks(B * g, length, sms), smem

    def name(S: int) -> str:
        if staged:  # tensor cores, K/V tiles staged in shared memory by bulk copies
            return f"dec_mma_{suf}_d{d}_r{16 if h // g > 8 else 8}_b"
        if mma:  # tensor cores: the group's heads as the rows of an m16 tile, 8 or 16 at a time; with 3
            # or more chunks, the next tile's loads in flight while one is computed (_p: faster there,
            # slower at large batch, where fewer blocks fit: measured)
            pipe = S >= 3 and (DEC_F8_PIPE or not fp8)
            return f"dec_mma_{suf}_d{d}_r{16 if h // g > 8 else 8}{'_p' if pipe else ''}{mma_pg}"
        # CUDA cores: 1, 2, 4 or 8 query heads at a time
        return f"dec_split_{suf}_d{d}_g{next(n for n in (1, 2, 4, 8) if n >= min(h // g, 8))}{pg}"

    def split(kernel: str) -> int:  # the count for that kernel's occupancy
        if staged and B * g <= sms and h // g <= 8:  # one block an SM: see one_block_an_sm
            return one_block_an_sm(B * g, length, sms)
        return decode_splits(B * g, length, sms, 2 if mma else 4, resident_blocks(source, kernel, q.device, DEC_THREADS,
                                                                                  shared_mem=smem),
                             uniform=not page or B == 1)
    S0 = decode_splits(B * g, length, sms, 2 if mma else 4)
    S = split(name(S0))
    if name(S) != name(S0):  # the count crossed _p's threshold: the count for that kernel's own occupancy,
        again = split(name(S))  # if it keeps that kernel; else the split as it was
        S = again if name(again) == name(S) else S0
    return source, name(S), S, smem


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                           lens: torch.Tensor, longest: int, tickets: torch.Tensor | None = None,
                           scales=None) -> torch.Tensor:
    """One query row per sequence, q [B, h, d] (sequence b's row at position lens[b] - 1), over the
    first lens[b] positions of its K/V in the pool k_pool, v_pool [pages, g, page, d] (contiguous),
    read through its row of the block table, table [B, max_pages] (int32 page ids, in order): the
    split kernel's paged layout (kernels/decode_attention.cu, _pg), on the GPU. lens: int32 [B] on the
    device (a sequence of length 0 gives a zero row); longest: the most any lens[b] can be, which
    sets the split (under a CUDA graph: the table's capacity, so that one graph serves every step).
    tickets: the kernel's counters (int32, at least B x g, zeros; each launch leaves them zero: a
    pool's own, so that a graph replays no fill of them), else ticket_counters(). scales: an FP8
    pool's (k_scale, v_scale) [pages, g, page] (fp32), its pages float8_e4m3fn: the split's _pg8
    (fp8_pages_fit)."""
    import numpy as np

    from .cuda import GRID_YZ_MAX, launch, ptr
    B, h, d = q.shape
    g, page = k_pool.shape[1], k_pool.shape[2]
    source, name, S, smem = _split_kernel(q, B, h, g, d, max(1, longest), page=page, fp8=scales is not None)
    q = q.contiguous()
    op = torch.empty(B, h, S, d, dtype=torch.float32, device=q.device)
    lp = torch.empty(B, h, S, dtype=torch.float32, device=q.device)
    o = torch.empty_like(q)
    if tickets is None or tickets.numel() < B * g:
        tickets = ticket_counters(q.device, B * g)
    head = (ptr(q), ptr(k_pool), ptr(v_pool), ptr(op), ptr(lp), ptr(o), ptr(tickets), np.int32(B * g), np.int32(g),
            np.int32(h // g))
    tail = (np.float32(math.log2(math.e) / math.sqrt(d)), ptr(table), ptr(lens), np.int32(table.shape[1]),
            np.int32(page))
    if scales is not None:  # (no contiguous-cache arguments: Ladd, Lpos, LMAX)
        args = (*head, np.int32(S), *tail, ptr(scales[0]), ptr(scales[1]))
    else:  # (_pgb: LMAX carries the blocks its equal-work chunks aim at)
        want = eq_blocks(torch.cuda.get_device_properties(q.device).multi_processor_count) if name.endswith("_pgb") \
            else 0  # (asked only for that build: this runs every decode step)
        args = (*head, np.int32(0), np.uint64(0), np.int32(want), np.int32(S), *tail)
    grid = (B * g, S, 1) if name.endswith("_pgb") else (S, min(B * g, GRID_YZ_MAX), 1)  # _pgb: pairs first
    launch(source, name, q.device, grid, (DEC_THREADS, 1, 1), args, shared_mem=smem)
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
    if torch.compiler.is_compiling():  # one op in a traced graph (tpattn::decode_append), not a CuPy launch
        return custom_ops.decode_append_op(qkv, cache.k, cache.v, cache.pos, cache.cos, cache.sin, heads, interleaved)
    return append_kernel(qkv, cache.k, cache.v, cache.pos, cache.cos, cache.sin, heads, interleaved)


def append_kernel(qkv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, cos, sin, heads: int,
                  interleaved: bool) -> torch.Tensor:
    """append_row's kernel (dec_append) on a cache's tensors: k, v [B, g, max_len, d] written at
    row pos[0], rotary tables cos, sin (or None); returns q [B, heads, 1, d]."""
    import numpy as np

    from .cuda import launch, ptr
    B, rows, d = qkv.shape
    g = (rows - heads) // 2
    q = torch.empty(B, heads, 1, d, dtype=qkv.dtype, device=qkv.device)
    suf = "f16" if qkv.dtype == torch.float16 else "bf16"
    rope = cos is not None
    n = B * rows * d // 2
    launch(dec_source(d), f"dec_append_{suf}", qkv.device, (min(-(-n // 256), 65535), 1, 1), (256, 1, 1),
           (ptr(qkv), ptr(q), ptr(k), ptr(v), ptr(cos) if rope else np.uint64(0),
            ptr(sin) if rope else np.uint64(0), ptr(pos), np.int32(B), np.int32(heads), np.int32(g),
            np.int32(d), np.int32(k.shape[2]), np.int32(1 if interleaved else 0)))
    return q


def append_paged_kernel(qkv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pos: torch.Tensor,
                        page_index: torch.Tensor, cos, sin, heads: int, interleaved: bool, scales=None) -> torch.Tensor:
    """A paged step's rows in one launch (dec_append_pg): qkv [R, heads + 2g, d] (contiguous), row r
    at position pos[r] (int64, on the device), rotated by the tables cos, sin [positions, d/2] (fp32,
    or None), its k and v written into the pools [pages, g, page, d] at page page_index[r] (int64),
    offset pos[r] % page; returns q [R, heads, d]. scales: an FP8 pool's (k_scale, v_scale) [pages, g,
    page]: dec_append_pg8, a warp per row and head, each K and V row in e4m3 with its own scale (the
    bits of fp8.quantize_rows)."""
    import numpy as np

    from .cuda import launch, ptr
    R, rows, d = qkv.shape
    g = (rows - heads) // 2
    q = torch.empty(R, heads, d, dtype=qkv.dtype, device=qkv.device)
    suf = "f16" if qkv.dtype == torch.float16 else "bf16"
    rope = cos is not None
    tables = (ptr(cos) if rope else np.uint64(0), ptr(sin) if rope else np.uint64(0), ptr(pos), ptr(page_index),
              np.int32(R), np.int32(heads), np.int32(g), np.int32(d), np.int32(k_pool.shape[2]),
              np.int32(1 if interleaved else 0))
    if scales is not None:
        warps = R * rows  # 8 warps a block
        launch(dec_source(d), f"dec_append_pg8_{suf}", qkv.device, (min(-(-warps // 8), 65535), 1, 1), (256, 1, 1),
               (ptr(qkv), ptr(q), ptr(k_pool), ptr(v_pool), ptr(scales[0]), ptr(scales[1]), *tables))
        return q
    n = R * rows * d // 2
    launch(dec_source(d), f"dec_append_pg_{suf}", qkv.device, (min(-(-n // 256), 65535), 1, 1), (256, 1, 1),
           (ptr(qkv), ptr(q), ptr(k_pool), ptr(v_pool), *tables))
    return q


# ---- the layer's cached forward and its graphed decode step (tpattn/layer.py calls these) -------

def new_cache(layer, batch: int, max_len: int) -> KVCache:
    """A KV cache for `batch` sequences of up to `max_len` positions: K and V of the layer's K/V heads
    on this rank, [B, g, max_len, d] each, on the layer's device and dtype."""
    if not is_count(batch) or not is_count(max_len):
        raise ConfigError(f"new_cache needs batch and max_len positive ints (got {batch!r}, {max_len!r})")
    shape = (batch, layer.local_kv_heads, max_len, layer.head_dim)
    dev, dt = layer.wqkv.device, layer.dtype
    cos = sin = None
    if layer.rope_theta is not None:  # the rotary angles of every position the cache can hold
        cos, sin = rope_tables(torch.arange(max_len, device=dev), layer.head_dim, layer.rope_theta,
                               torch.promote_types(dt, torch.float32))
    return KVCache(torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev),
                   owner=cache_owner(layer), layer_id=id(layer), cos=cos, sin=sin)


def cache_owner(layer) -> tuple:
    return (layer.shard.rank, layer.shard.world, layer.head_range, layer.shard.kv_head_range, layer.head_dim)


def check_cache(layer, cache: KVCache, batch: int, rows: int) -> None:
    cache.check(id(layer), cache_owner(layer), batch, rows, layer.dtype, layer.wqkv.device)


def forward_cached(layer, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """x [B, T, D] on every rank: QKV of its T rows, rotary positions from the cache's length, K and
    V appended, attention of the T queries over the whole cache (causal), the output projection and
    the plan's collective of B x T x D values. A prefill over rows already in the cache runs the
    fused kernel with the causal diagonal shifted by their number where it can
    (fused_prefix_buffers), else attend's blocks of query rows: never T x L scores at once."""
    from .outputsum import OutputSum
    from .timing import section
    if layer.sequence_parallel and layer.world > 1:
        raise ConfigError("a KV cache decodes head-parallel: build the layer without sequence_parallel to decode "
                          "(layer.replace(sequence_parallel=False) shares its weights)")
    if not layer.causal:
        raise ConfigError("a KV cache decodes causally: build the layer with causal=True to decode "
                          "(layer.replace(causal=True))")
    B, T, D = x.shape
    check_cache(layer, cache, B, T)
    h, g, d = layer.local_heads, layer.local_kv_heads, layer.head_dim
    L0 = cache.length
    layer._ask_peers(B, T, x.device, decode=True)
    plan = layer.plan(B, T, decode=True)
    with section("qkv_proj"):
        from .ops import mm
        qkv = mm(x.reshape(B * T, D), layer.wqkv, layer.dtype, layer._qkv_bias())
    if T == 1:  # a step: positions read from the cache's device copy (a CUDA graph of it serves every step)
        with section("cache_append"):  # rotary positions, q out, k and v in: one kernel on a GPU
            q = append_row(qkv.view(B, h + 2 * g, d), cache, h, layer.rope_interleaved)
        with section("attention"):  # the split-K decode kernel on a GPU; else attend's math
            o = decode_attention(q, cache.k, cache.v, L0 + 1, pos=cache.pos, tickets=cache.tickets).permute(0, 2, 1, 3)
    else:
        q, k, v = (t.permute(0, 2, 1, 3) for t in qkv.view(B, T, h + 2 * g, d).split([h, g, g], dim=2))
        q, k = layer._rope(q, k, L0, cache)
        with section("cache_append"):
            cache.k[:, :, L0:L0 + T] = k
            cache.v[:, :, L0:L0 + T] = v
        if L0 == 0:  # a prefill into an empty cache: the backend's causal attention over its rows
            o = torch.empty(B, T, h, d, dtype=layer.dtype, device=x.device)
            layer._attention(*((t if layer.backend.strided else t.contiguous()) for t in (q, k, v)),
                             o.permute(0, 2, 1, 3))
        elif layer.backend.name == "fused" and fused_prefix_fits(q):  # over the rows already in the cache
            with section("attention"):
                if torch.compiler.is_compiling():  # one op in a traced graph (tpattn::prefix_attention)
                    o = custom_ops.prefix_attention_op(q, cache.k[:, :, :L0 + T], cache.v[:, :, :L0 + T], L0,
                                                       layer.backend.name)
                else:
                    qv, ov, o, r0 = fused_prefix_buffers(q, L0, layer.backend.row_chunks)
                    del qkv, q, k, v  # K and V are in the cache, q in qv: the projection's rows can go
                    layer.backend.forward(qv, cache.k[:, :, :L0 + T], cache.v[:, :, :L0 + T], True, out=ov,
                                          rows=(r0, L0 + T), row_base=r0)
        elif _triton_prefix_fits(layer, q, B):  # the paged prefill's kernel, the cache one page per sequence
            with section("attention"):
                o = triton_prefix_attention(q, cache.k, cache.v, L0)
        else:
            with section("attention"):
                o = attend(q, cache.k[:, :, :L0 + T], cache.v[:, :, :L0 + T], L0).permute(0, 2, 1, 3)
    cache.pos.add_(T)
    cache.length = L0 + T
    total = OutputSum(layer, plan, x.device)
    total.add_rows(0, T, o.reshape(B * T, h * d))  # o [B, T, h, d]: the output GEMM's rows
    return total.result()


def prefix_attention(backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, L0: int) -> torch.Tensor:
    """o [B, T, h, d] of the T queries q [B, h, T, d] at positions L0.. over keys k, v [B, g, L0 + T, d]
    (a cache's first L0 + T rows), causal: the fused kernel's rows [r0, L0 + T) through
    fused_prefix_buffers, no scores in memory (tpattn::prefix_attention; forward_cached does the
    same eagerly, dropping the projection's rows before the kernel runs)."""
    qv, ov, o, r0 = fused_prefix_buffers(q, L0, backend.row_chunks)
    backend.forward(qv, k, v, True, out=ov, rows=(r0, L0 + q.shape[2]), row_base=r0)
    return o


def paged_prefix_attention(backend, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           table: torch.Tensor, start: torch.Tensor, L0: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """o [T, h, d] of one sequence's T query rows q [T, h, d] (rows of a projection, contiguous) at
    positions L0.., causal over its first L0 + T positions in a paged pool k_pool, v_pool [pages, g,
    page, d], its pages `table` (int32 on the device, in order); L0 is read on the device from `start`
    (int32; L0: the host's copy, if any, for the checks): the fused kernel reads q in place and K/V
    through the table (FusedBackend.forward_paged): nothing gathered, no buffer of the rows before L0,
    no scores. out: where o goes ([T, h, d], e.g. a step's rows of a larger output). Where
    fused.paged_fits(q, k_pool)."""
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out  # (rows contiguous, as q's may not be)
    backend.forward_paged(q.transpose(0, 1).unsqueeze(0), k_pool, v_pool, table, start,
                          o.transpose(0, 1).unsqueeze(0), L0)
    return o


def _triton_prefix_fits(layer, q: torch.Tensor, B: int) -> bool:
    from .attention.triton_fused import paged_prefill_fits
    return not torch.compiler.is_compiling() and paged_prefill_fits(layer, q[:, :, 0], B)


def triton_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, L0: int) -> torch.Tensor:
    """o [B, T, h, d] of the T queries q [B, h, T, d] at positions L0.. over a contiguous cache's K, V
    [B, g, max_len, d] (its first L0 + T rows valid), causal, through the Triton paged prefill
    (tpattn/attention/triton_paged.py): the cache seen as a pool of B pages of max_len tokens,
    sequence b's one page b. One launch, K/V read in place, no scores, no pad rows."""
    from .attention.triton_paged import paged_prefill
    B, h, T, d = q.shape
    dev = q.device
    rows = q.permute(0, 2, 1, 3).reshape(B * T, h, d)  # (a copy where q is not laid out by rows)
    table = torch.arange(B, dtype=torch.int32, device=dev)[:, None]
    cu = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=dev)
    starts = torch.full((B,), L0, dtype=torch.int32, device=dev)
    return paged_prefill(rows, k, v, table, cu, starts, T).view(B, T, h, d)


def fused_prefix_buffers(q: torch.Tensor, L0: int, align: int):
    """For the fused kernel's prefill over the L0 rows already in a cache: it computes query rows
    [r0, N) of a sequence of N = L0 + T keys (r0: L0 rounded down to its row tile, `align`), causal
    by position, reading q and writing o in buffers of those rows only, [B, h, N - r0, d] views laid
    out [rows, h, d] per batch row (the kernel is told their first row is r0: forward(row_base=r0)).
    Memory O(T h d), no scores. Returns (q's buffer with q in its rows [L0 - r0, N - r0) and zeros
    before, o's buffer, the rows [L0, N) of o as [B, T, h, d], r0)."""
    B, h, T, d = q.shape
    N = L0 + T
    r0 = L0 // align * align
    rows = N - r0
    strides = (rows * h * d, d, h * d, 1)  # (batch, head, row, column)
    qbuf = (torch.zeros if r0 < L0 else torch.empty)(B * rows * h * d, dtype=q.dtype, device=q.device)
    obuf = torch.empty_like(qbuf)
    qv, ov = (t.as_strided((B, h, rows, d), strides) for t in (qbuf, obuf))
    qv[:, :, L0 - r0:].copy_(q)
    return qv, ov, obuf.as_strided((B, T, h, d), (rows * h * d, h * d, d, 1), (L0 - r0) * h * d), r0


def fused_prefix_fits(q: torch.Tensor) -> bool:
    """Whether the fused kernel runs this prefill (a CUDA device, fp16/bf16, a head dim it takes there:
    64 or 128, and on compute capability 9.0 the others of HEAD_DIMS)."""
    from .attention.fused import HEAD_DIMS, _device_info, hopper_only
    return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in HEAD_DIMS \
        and not hopper_only(q.shape[-1], _device_info(q.device)[1]) and cupy_available()


def graphed(layer, x: torch.Tensor, cache: KVCache):
    """One decode step in a CUDA graph (tpattn/graphs.py has the capture): x [B, 1, D]; each replay
    appends x's row at the cache's length (read on the device) and returns that step's output, until
    the cache is full (then the cache's one-line refusal). The cache is left as it was (capture runs
    no step). Copy each step's row into x in place before the replay."""
    from .graphs import capture, refusal, replayer
    if x.dim() != 3 or x.shape[1] != 1:
        raise ValueError(f"graphed(x, cache) captures a decode step: x must be [B, 1, D] (got {tuple(x.shape)})")
    why = graph_refusal(x.device, layer.dtype, layer.head_dim) or refusal(layer, x)
    if why:
        raise ConfigError(why)
    check_cache(layer, cache, x.shape[0], 1)
    length = cache.length

    def rewind():  # the warm-up steps wrote past the cache's length only, the capture none: forget them
        cache.length = length
        cache.pos.fill_(length)
    try:
        graph, y = capture(lambda: layer(x, cache=cache), x, min(2, cache.max_len - length), before_capture=rewind)
    finally:
        rewind()
    layer.peers.pin()

    def advance():
        cache.length += 1
    return replayer(layer.world, graph, y, before=lambda: check_cache(layer, cache, x.shape[0], 1), after=advance)


custom_ops.IMPLS.update(decode_append=append_kernel, decode_attention=decode_attention,
                        prefix_attention=prefix_attention)  # what the traced graph's ops launch
