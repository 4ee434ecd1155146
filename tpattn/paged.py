"""A paged KV cache for serving: sequences of their own lengths in one batch, added and removed
between steps (continuous batching), their K and V in fixed-size pages of a pool.

    pool = PagedKV(layers, pages=4096, page_size=16, max_seqs=64)  # one pool for a model's layers
    a, b = pool.add(), pool.add()                 # two sequences, empty
    with pool.step([a, b], [5, 3]) as step:       # a ragged prefill: 5 rows of a, 3 of b, packed
        y = layer(x_packed, cache=step.view(0))   # x_packed [1, 8, D]; layer 0 of the pool's layers
    with pool.step([a, b], [1, 1]) as step:       # a decode step: one row each
        y = layer(x_rows, cache=step.view(0))     # x_rows [2, 1, D] or [1, 2, D]
    pool.remove(a)                                # its pages go back to the pool

Who holds what. Every rank holds, for each layer, the K and V of its own K/V heads (the forward's
rule: its split of them, or its copy of the one its query heads use) in a pool of pages
[pages, g, page_size, d]. The block table (which pages hold sequence s's positions, in order)
and the lengths are the same on every rank: they follow from the same add / step / remove calls,
which the ranks check they agree on (one gather of the call's arguments, host side). A step's
communication is the layer's usual output sum of its rows.

Rows of a step are packed as FlashAttention's varlen API packs them: sequence i's T_i new rows at
[cu_i, cu_i + T_i), its positions L_i .. L_i + T_i - 1 (L_i: its length before the step), each
row attending causally to its own sequence's positions only. A decode step (one row per sequence)
on a GPU runs the split decode kernel's paged layout (kernels/decode_attention.cu, _pg: every
sequence at once, its own length, K/V read in place through the block table); a prefill (or a
chunk of one) runs, per sequence, the fused forward kernel, its rows causal from their positions on
(no scores in memory) on a GPU with the fused backend: on compute capability 9.0 at head dims 64
and 128 with pages of 16 tokens or more, fusedw's paged build reading q, K and V in place (K/V
through the block table, L0 on the device: decode.paged_prefix_attention), else over its K/V
gathered through the table (decode.prefix_attention); with the triton backend, every sequence of
the step in one launch that reads K/V in place through the block table
(tpattn/attention/triton_paged.py: nothing gathered, no pad); elsewhere torch math
(decode.attend, the scores a block of rows at a time). ChunkGraphs replays one CUDA graph for every
chunk of T rows of a long prompt; DecodeGraphs one per batch-size bucket for decode steps.

kv_dtype="fp8" keeps each token's K and V of each K/V head in e4m3 with an fp32 scale of its own
(tpattn.attention.fp8.quantize_rows): d + 4 bytes where fp16 takes 2d. On a GPU of compute
capability 8.9 or later at the decode split's head dims (decode.fp8_pages_fit) the append and the decode
step run kernels (dec_append_pg8 quantizes each row; the split's _pg8 reads e4m3 pages and their
scales); a prefill with the triton backend reads the e4m3 pages in place too (triton_paged.py); the
rest, torch math over the dequantized pages.
"""

from __future__ import annotations

import itertools
import math
import numbers
import operator
from dataclasses import dataclass

import numpy as np
import torch

from .attention import fp8
from .attention.triton_fused import paged_prefill_fits as triton_prefill_fits  # (tests swap it here)
from .errors import ConfigError, check_counts
from .memory import kv_token_bytes

PAGE_SIZE = 16  # tokens per page: as fast as 64 and 256 on an H200 (docs/serving.md), and the least waste
KV_DTYPES = (None, "fp8")  # the pages' dtype: the layers' own, or e4m3 with a scale per token and K/V head


class PagedKV:
    """The pages of K and V of each of `layers` (one layer or a model's list, on one group and one
    device, with the same K/V head shard), a block table per sequence slot, and the host allocator."""

    def __init__(self, layers, pages: int, page_size: int = PAGE_SIZE, max_seqs: int = 64, kv_dtype: str | None = None):
        if isinstance(layers, torch.nn.Module) and not isinstance(layers, torch.nn.ModuleList):
            layers = [layers]
        else:
            try:
                layers = list(layers)
            except TypeError:
                layers = None
        if layers is None or not all(hasattr(L, "local_kv_heads") and hasattr(L, "wqkv") for L in layers):
            raise ConfigError("PagedKV takes a tpattn TensorParallelAttention layer or a list of them (the layers whose "
                              "K and V it holds)")
        error = None
        try:  # this rank's checks: a refusal here is said on every rank (else the others would wait)
            for name, v in (("pages", pages), ("page_size", page_size), ("max_seqs", max_seqs)):
                if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                    raise ConfigError(f"PagedKV {name} must be an int (got {v!r})")
            if kv_dtype not in KV_DTYPES:
                raise ConfigError(f"PagedKV kv_dtype={kv_dtype!r}: use 'fp8' (e4m3 pages, a scale per token and "
                                  "K/V head) or None (the layers' dtype)")
            if not layers:
                raise ConfigError("PagedKV needs at least one layer")
            if pages < 1 or page_size < 1 or max_seqs < 1:
                raise ConfigError(f"PagedKV needs pages, page_size and max_seqs >= 1 (got {pages}, {page_size}, "
                                  f"{max_seqs})")
            first = layers[0]
            for i, L in enumerate(layers):
                if (L.local_kv_heads, L.head_dim, L.dtype, L.wqkv.device, L.rank, L.world) != \
                        (first.local_kv_heads, first.head_dim, first.dtype, first.wqkv.device, first.rank, first.world):
                    raise ConfigError(f"PagedKV's layers must share K/V heads per rank, head dim, dtype, device and "
                                      f"group (layer {i} differs from layer 0); make one pool per kind of layer")
        except ConfigError as exc:
            error = exc
        if error is not None and not layers:  # (no layer, no group to tell)
            raise error
        self.layers, self.pages, self.page_size, self.max_seqs = layers, pages, page_size, max_seqs
        # the same pool on every rank (a step that runs out of pages on one rank only would leave the
        # others waiting in the layer's collective), or this rank's refusal said on every rank
        self._agree("PagedKV", (pages, page_size, max_seqs, kv_dtype), error)
        self.kv_dtype = kv_dtype
        g, d, dev, dt = first.local_kv_heads, first.head_dim, first.wqkv.device, first.dtype
        # one page more than asked for: page `pages`, never handed out, where a graphed step's padding
        # rows write their K and V (DecodeGraphs)
        st = torch.float8_e4m3fn if self.fp8 else dt
        self.k = [torch.zeros(pages + 1, g, page_size, d, dtype=st, device=dev) for _ in layers]
        self.v = [torch.zeros(pages + 1, g, page_size, d, dtype=st, device=dev) for _ in layers]
        # FP8 pages: each position's scale per K/V head (fp8.quantize_rows)
        self.k_scale, self.v_scale = ([torch.zeros(pages + 1, g, page_size, device=dev) for _ in layers]
                                      if self.fp8 else None for _ in range(2))
        self.scratch_page = pages
        self.device = dev
        # the decode kernel's counters for every step of this pool, eager or graphed (a row a sequence
        # of a step, a graph's bucket at most max_seqs): zeros, and each launch leaves them zero (the
        # last block of each sequence and K/V head resets its own), so a graph needs no fill of its own
        self.tickets = torch.zeros((max_seqs + 1) * g, dtype=torch.int32, device=dev)
        self.free_pages = list(range(pages - 1, -1, -1))  # a stack: the lowest page is taken first
        self.slots: dict[int, int] = {}        # sequence id -> slot
        self.free_slots = list(range(max_seqs - 1, -1, -1))
        self.tables: list[list[int]] = [[] for _ in range(max_seqs)]  # slot -> its pages, in order
        self.generation = [0] * max_seqs       # slot -> how many sequences it has held (device mirrors' check)
        self.lengths = [0] * max_seqs          # slot -> positions filled
        self.version = 0                       # one more at every add, remove and page taken (device mirrors' check)
        self._next_id = 0
        self._open = None                      # the step in progress, if any

    # ---- sequences ---------------------------------------------------------------------------

    def add(self) -> int:
        """A new, empty sequence; returns its id (the same on every rank)."""
        self._agree("add", ())
        if not self.free_slots:
            raise ConfigError(f"the pool holds at most max_seqs={self.max_seqs} sequences, all in use: remove a "
                              f"finished one (pool.remove(id)) or make a pool with a larger max_seqs")
        sid, self._next_id = self._next_id, self._next_id + 1
        self.slots[sid] = self.free_slots.pop()
        self.version += 1
        return sid

    def remove(self, sid: int) -> None:
        """Sequence sid is finished: its pages and slot go back to the pool."""
        self._agree("remove", (sid,))
        slot = self._slot(sid)
        self.free_pages.extend(reversed(self.tables[slot]))
        self.tables[slot], self.lengths[slot] = [], 0
        self.generation[slot] += 1
        self.version += 1
        del self.slots[sid]
        self.free_slots.append(slot)

    def length(self, sid: int) -> int:
        return self.lengths[self._slot(sid)]

    @property
    def live(self) -> list[int]:
        return sorted(self.slots)

    def free_page_count(self) -> int:
        return len(self.free_pages)

    @property
    def fp8(self) -> bool:
        return self.kv_dtype == "fp8"

    def nbytes(self) -> int:
        """Bytes of the pages (and, FP8, their scales), every layer's K and V."""
        return sum(2 * t.numel() * t.element_size() for t in self.k + (self.k_scale or []))

    @staticmethod
    def bytes_per_token(layers, kv_dtype: str | None = None) -> int:
        """The pool's bytes per token of a sequence on this rank, over `layers` (a layer or a list): K
        and V of the local K/V heads, and with kv_dtype="fp8" one byte a value plus the row's fp32 scale."""
        layers = [layers] if isinstance(layers, torch.nn.Module) else list(layers)
        return sum(kv_token_bytes(L.local_kv_heads, L.head_dim, L.dtype.itemsize, kv_dtype == "fp8") for L in layers)

    def rope(self, layer, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [>= upto, d/2] of layer's rotary angles at positions 0, 1, ... (decode.rope_rows: the
        values a contiguous cache's tables hold), on the pool's device."""
        from .decode import rope_rows
        return rope_rows(self.device, upto, layer.head_dim, layer.rope_theta, torch.promote_types(layer.dtype, torch.float32))

    def _slot(self, sid: int) -> int:
        if sid not in self.slots:
            raise ConfigError(f"no sequence {sid} in this pool (live: {self.live or 'none'}); add it with pool.add()")
        return self.slots[sid]

    def _agree(self, what: str, args: tuple, error: Exception | None = None) -> None:
        """Every rank makes the same call (block tables and lengths must be the same on every rank);
        one line on every rank if not. error: this rank's own refusal of the call, raised here on this
        rank and said on the others (which would otherwise wait for it in the next collective)."""
        comm = self.layers[0].comm
        mine = ("error", str(error)) if error is not None else (what, args)
        if comm.world == 1 or comm.group is None or comm.same_everywhere(mine, "pagedagree"):
            if error is not None:
                raise error
            return
        said = comm.all_gather_object(mine, "pagedagree")  # (only to say what differs)
        if error is not None:
            raise error
        failed = [(r, a) for r, (w, a) in enumerate(said) if w == "error"]
        if failed:
            raise ConfigError(f"rank {failed[0][0]} refused this paged cache: {failed[0][1]} (a pool is built on "
                              "every rank of its layers' group together)")
        if len(set(map(repr, said))) > 1:
            shown = "; ".join(f"rank {r}: {w}{a}" for r, (w, a) in enumerate(said[:4]))
            raise ConfigError(f"the ranks' paged-cache calls differ ({shown}); every rank must add, step and "
                              "remove the same sequences with the same row counts, in a pool built alike (pages, "
                              "page_size, max_seqs, kv_dtype)")

    # ---- steps ---------------------------------------------------------------------------------

    def step(self, seq_ids, rows) -> "PagedStep":
        """A step that appends rows[i] rows to sequence seq_ids[i] (a prefill: the prompt's length;
        a decode step: 1), packed in that order; its pages are taken now. Use as a context
        manager: the lengths advance when the block ends without an error."""
        try:
            seq_ids, rows = list(seq_ids), list(rows)
        except TypeError:
            raise ConfigError(f"step takes a list of sequence ids and a list of row counts, one per sequence (got "
                              f"{type(seq_ids).__name__}, {type(rows).__name__})") from None
        try:  # ints (Python, numpy or integer tensors); a float such as 2.7 is not truncated
            if any(isinstance(v, bool) for v in seq_ids + rows):
                raise TypeError
            seq_ids, rows = [operator.index(v) for v in seq_ids], [operator.index(v) for v in rows]
        except TypeError:
            raise ConfigError(f"step takes int sequence ids and row counts (got {seq_ids}, {rows})") from None
        self._agree("step", (tuple(seq_ids), tuple(rows)))
        if self._open is not None:
            raise ConfigError("a step of this pool is still open: end it (leave its with block) before the next")
        if len(seq_ids) != len(rows) or not seq_ids:
            raise ConfigError(f"step needs one row count per sequence (got {len(seq_ids)} ids, {len(rows)} counts)")
        if len(set(seq_ids)) != len(seq_ids):
            raise ConfigError(f"step lists a sequence twice ({seq_ids}); give each sequence's rows once")
        if min(rows) < 1:
            raise ConfigError(f"step appends at least one row to each sequence (got {rows})")
        slots = [self._slot(s) for s in seq_ids]
        P, tables = self.page_size, self.tables
        starts = list(map(self.lengths.__getitem__, slots))
        need = [max(0, -(-(L + r) // P) - len(tables[s])) for s, L, r in zip(slots, starts, rows)]
        more = sum(need)
        if more > len(self.free_pages):
            raise ConfigError(f"the pool has {len(self.free_pages)} free pages of {P} tokens and this step needs "
                              f"{more} more; remove finished sequences (pool.remove(id)) or make the pool "
                              f"larger (PagedKV(..., pages={self.pages + more - len(self.free_pages)} or more))")
        grew = []
        if more:
            for s, n in zip(slots, need):
                if n:
                    tables[s] += [self.free_pages.pop() for _ in range(n)]
                    grew.append(s)
        self.version += bool(grew)
        self._open = PagedStep(self, seq_ids, slots, rows, starts, grew)
        return self._open

    def _close(self, step: "PagedStep", ok: bool) -> None:
        self._open = None
        if ok:
            for s, r in zip(step.slots, step.rows):
                self.lengths[s] += r


def _pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t in page-locked memory when it goes to a GPU (else t): from pageable memory, even a
    non-blocking copy may wait for the stream to drain (CUDA stages it through a pinned buffer
    and "may synchronize with the stream"), so the host would stop issuing a step's kernels behind
    every table it sends. torch's pinned allocator keeps the buffer until the copy has run."""
    return t.pin_memory() if device.type == "cuda" else t


def _on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new host tensor's copy on `device`, queued without waiting (from pinned memory, _pinned)."""
    return _pinned(t, device).to(device, non_blocking=True)


@dataclass
class PagedView:
    """One layer's view of a step: what layer(x, cache=view) reads and writes."""
    step: "PagedStep"
    index: int  # the layer's place in the pool's layers


class PagedStep:
    """The rows one step appends: per sequence its slot, start position and row count, and for
    every packed row its position and where its K and V go (page, offset), on the pool's device."""

    def __init__(self, pool: PagedKV, seq_ids, slots, rows, starts, grew=()):
        self.pool, self.seq_ids, self.slots, self.rows, self.starts = pool, seq_ids, slots, rows, starts
        self.grew = list(grew)  # the slots whose tables this step lengthened
        self.cu = [0, *itertools.accumulate(rows)]
        self._meta = None

    def _device_meta(self) -> dict:
        """What the step's layers read about its rows and sequences, on the pool's device, made on first
        use in one copy: per packed row its position, page and offset in the page (int64); per sequence
        its block table row up to its length after the step, zero-padded (int32 [n, most pages]), the
        row offsets cu [n + 1], the lengths before and after the step [n] (int32). Built with numpy in
        one pinned host buffer (a chunk of a long prompt issues its step in tens of microseconds, not
        the hundreds that torch ops on small host tensors took)."""
        if self._meta is None:
            P, n = self.pool.page_size, len(self.slots)
            rows, starts, cu = (np.asarray(a, dtype=np.int64) for a in (self.rows, self.starts, self.cu))
            R, ends = int(cu[-1]), starts + rows
            npages = -(-ends // P)
            most = int(npages.max())
            host = torch.empty(6 * R + n * most + 3 * n + 1, dtype=torch.int32,
                               pin_memory=self.pool.device.type == "cuda")  # (pinned: see _pinned)
            h = host.numpy()
            by_row = h[:6 * R].view(np.int64).reshape(3, R)
            table = h[6 * R:6 * R + n * most].reshape(n, most)
            table[:] = 0
            for i, (s, k) in enumerate(zip(self.slots, npages.tolist())):
                table[i, :k] = self.pool.tables[s][:k]
            pos = np.arange(R, dtype=np.int64) + np.repeat(starts - cu[:-1], rows)
            by_row[0] = pos
            by_row[1] = table[np.repeat(np.arange(n), rows), pos // P]
            by_row[2] = pos % P
            rest = h[6 * R + n * most:]
            rest[:n + 1], rest[n + 1:2 * n + 1], rest[2 * n + 1:] = cu, starts, ends
            dev = host.to(self.pool.device, non_blocking=True)
            by_row, rest = dev[:6 * R].view(torch.int64).view(3, R), dev[6 * R + n * most:]
            self._meta = {"positions": by_row[0], "page_index": by_row[1], "page_offset": by_row[2],
                          "table": dev[6 * R:6 * R + n * most].view(n, most), "cu": rest[:n + 1],
                          "starts": rest[n + 1:2 * n + 1], "lens": rest[2 * n + 1:], "longest": int(ends.max())}
        return self._meta

    @property
    def positions(self) -> torch.Tensor:
        return self._device_meta()["positions"]

    @property
    def page_index(self) -> torch.Tensor:
        return self._device_meta()["page_index"]

    @property
    def page_offset(self) -> torch.Tensor:
        return self._device_meta()["page_offset"]

    @property
    def total_rows(self) -> int:
        return self.cu[-1]

    @property
    def upto(self) -> int:
        """Positions the step's rows reach (their rotary tables' length)."""
        return max(L0 + r for L0, r in zip(self.starts, self.rows))

    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(block table int32 [n, most pages], lengths int32 [n] after the step, the longest) of the
        step's n sequences, on the pool's device: what the paged decode kernel reads."""
        m = self._device_meta()
        return m["table"], m["lens"], m["longest"]

    def prefill_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block table int32 [n, most pages], row offsets cu int32 [n + 1], lengths before the step
        int32 [n]) of the step's n sequences on the pool's device: what the Triton paged prefill reads
        (the other prefills gather each sequence's pages through the table)."""
        m = self._device_meta()
        return m["table"], m["cu"], m["starts"]

    def view(self, index: int = 0) -> PagedView:
        """Layer `index`'s view (the pool's layers[index])."""
        if not 0 <= index < len(self.pool.layers):
            raise ConfigError(f"the pool has {len(self.pool.layers)} layer(s); view(index) takes 0..{len(self.pool.layers) - 1}")
        return PagedView(self, index)

    def __enter__(self) -> "PagedStep":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.pool._close(self, kind is None)


# ---- the layer's forward over a paged step (tpattn/layer.py calls it) -----------------------------

def forward_paged(layer, x: torch.Tensor, view: PagedView) -> torch.Tensor:
    """x [1, R, D] (R packed rows) or [n, 1, D] (one row per sequence of the step) on every rank:
    QKV of the R rows, rotary positions from each row's position, K and V written into the pool's
    pages, each sequence's rows attending causally over its own positions, the output projection
    and the plan's collective of R x D values. Returns y of x's shape."""
    from .attention.fused import paged_fits
    from .decode import (append_paged_kernel, apply_rope, attend, decode_kernel_fits, fp8_pages_fit, fused_prefix_fits,
                         paged_decode_attention, paged_prefix_attention, prefix_attention, rope_tables)
    from .ops import mm
    from .outputsum import OutputSum
    from .timing import section
    step, pool = view.step, view.step.pool
    if pool._open is not step:
        raise ConfigError("this step has ended (its with block is left); make a new one with pool.step(ids, rows)")
    if pool.layers[view.index] is not layer:
        raise ConfigError(f"this view is of the pool's layer {view.index}, not this layer: use step.view(i) with this "
                          "layer's index in the pool's layers")
    kp = pool.k[view.index]
    if kp.dtype != (torch.float8_e4m3fn if pool.fp8 else layer.dtype) or kp.device != layer.wqkv.device:
        raise ConfigError(f"this pool holds {str(kp.dtype).replace('torch.', '')} pages on {kp.device}, made before the "
                          f"layer became {str(layer.dtype).replace('torch.', '')} on {layer.wqkv.device} (.half() or "
                          ".to()): make a new PagedKV for the layer as it is now")
    if layer.sequence_parallel and layer.world > 1:
        raise ConfigError("a paged cache decodes head-parallel: build the layer without sequence_parallel "
                          "(layer.replace(sequence_parallel=False) shares its weights)")
    if not layer.causal:
        raise ConfigError("a paged cache decodes causally: build the layer with causal=True (layer.replace(causal=True))")
    B, N, D = x.shape
    R = step.total_rows
    if B * N != R or (B != 1 and N != 1):
        raise ConfigError(f"this step appends {R} rows ({step.rows} to sequences {step.seq_ids}): x must be "
                          f"[1, {R}, {D}] (packed) or, one row each, [{R}, 1, {D}] (got {tuple(x.shape)})")
    h, g, d = layer.local_heads, layer.local_kv_heads, layer.head_dim
    layer._ask_peers(1, R, x.device, decode=True)
    plan = layer.plan(1, R, decode=True)
    with section("qkv_proj"):
        qkv = mm(x.reshape(R, D), layer.wqkv, layer.dtype, layer._qkv_bias()).view(R, h + 2 * g, d)
    i = view.index
    kp, vp = pool.k[i], pool.v[i]
    scales = (pool.k_scale[i], pool.v_scale[i]) if pool.fp8 else None
    kernels = fp8_pages_fit(qkv) if scales else decode_kernel_fits(qkv)
    if kernels:  # rotation at each row's position and the K/V writes (FP8: quantized): one kernel
        cos, sin = pool.rope(layer, step.upto) if layer.rope_theta is not None else (None, None)
        with section("cache_append"):
            q = append_paged_kernel(qkv, kp, vp, step.positions, step.page_index, cos, sin, h, layer.rope_interleaved,
                                    scales)
    else:
        q, k, v = qkv.split([h, g, g], dim=1)  # [R, heads, d]
        if layer.rope_theta is not None:
            cos, sin = rope_tables(step.positions, d, layer.rope_theta, torch.promote_types(layer.dtype, torch.float32))
            q = apply_rope(q.transpose(0, 1).unsqueeze(0), cos, sin, layer.rope_interleaved)[0].transpose(0, 1)
            k = apply_rope(k.transpose(0, 1).unsqueeze(0), cos, sin, layer.rope_interleaved)[0].transpose(0, 1)
        with section("cache_append"):  # row r's K and V at (its page, its offset) of every K/V head
            if scales:  # each row in e4m3 with its own scale
                for pool8, sc, t in ((kp, scales[0], k), (vp, scales[1], v)):
                    t8, s = fp8.quantize_rows(t)
                    pool8[step.page_index, :, step.page_offset] = t8.to(pool8.dtype)  # (exact: e4m3 values)
                    sc[step.page_index, :, step.page_offset] = s.squeeze(-1)
            else:
                kp[step.page_index, :, step.page_offset] = k
                vp[step.page_index, :, step.page_offset] = v
    P = pool.page_size
    if max(step.rows) == 1:  # a decode step: every sequence at once through its block table and length
        table, lens, longest = step.decode_tables()
        with section("attention"):
            if kernels:  # the paged split kernel
                o = paged_decode_attention(q, kp, vp, table, lens, longest, tickets=pool.tickets, scales=scales)
            else:
                o = paged_decode_torch(q, kp, vp, table, lens, scales)
        total = OutputSum(layer, plan, x.device)
        total.add_rows(0, R, o.view(R, h * d))
        return total.result().view(B, N, D)
    if triton_prefill_fits(layer, q, len(step.slots), scales is not None):  # every sequence in one launch, K/V in place
        from .attention.triton_paged import paged_prefill
        table, cu, starts = step.prefill_tables()
        o = torch.empty(R, h, d, dtype=layer.dtype, device=x.device)
        with section("attention"):
            paged_prefill(q, kp, vp, table, cu, starts, max(step.rows), out=o, scales=scales)
        total = OutputSum(layer, plan, x.device)
        total.add_rows(0, R, o.view(R, h * d))
        return total.result().view(B, N, D)
    fused = layer.backend.name == "fused" and fused_prefix_fits(q) and not scales
    in_place = fused and paged_fits(q, kp)  # the kernel reads the pages through the table: no gather
    table, _, starts = step.prefill_tables()  # (one copy a step, for every layer and sequence)
    one = fused and len(step.slots) == 1  # (one sequence, a chunk of a prompt: its rows are the kernel's output)
    o = None if one else torch.empty(R, h, d, dtype=layer.dtype, device=x.device)
    with section("attention"):
        for i, (T, L0) in enumerate(zip(step.rows, step.starts)):
            n = L0 + T
            r0 = step.cu[i]
            if in_place:  # the fused kernel reads q's rows and K/V (through the table) in place, writes o's
                oi = paged_prefix_attention(layer.backend, q[r0:r0 + T], kp, vp, table[i], starts[i:i + 1], L0,
                                            out=None if one else o[r0:r0 + T])
                o = oi if one else o
                continue
            qs = q[r0:r0 + T].transpose(0, 1).unsqueeze(0)  # [1, h, T, d]
            pages = table[i, :-(-n // P)]
            # its pages gathered per K/V head in one pass each: [g, pages, P, d] seen as [1, g, n, d]
            ks, vs = (_gather(t, pages, sc, n) for t, sc in zip((kp, vp), scales or (None, None)))
            if fused:  # the fused kernel's rows from position L0 on, causal: no scores in memory
                oi = prefix_attention(layer.backend, qs, ks, vs, L0)[0]  # [T, h, d], rows contiguous
            else:
                oi = attend(qs, ks, vs, L0)[0].transpose(0, 1)
            if one:
                o = oi
            else:
                o[r0:r0 + T] = oi
    total = OutputSum(layer, plan, x.device)
    total.add_rows(0, R, o.view(R, h * d))
    return total.result().view(B, N, D)


def _gather(pool: torch.Tensor, pages: torch.Tensor, scale: torch.Tensor | None, n: int) -> torch.Tensor:
    """A sequence's first n positions of one layer's K or V pages [pages, g, P, d], gathered per K/V
    head in one pass along its pages: [1, g, n, d] (FP8 pages dequantized with their scales, fp32)."""
    g, d = pool.shape[1], pool.shape[3]
    if pool.is_cuda:  # straight into [g, pages, P, d], which is [g, pages x P, d]: one copy, no relayout
        t = pool.transpose(0, 1).index_select(1, pages)
        if scale is not None:
            t = fp8.dequantize(t, scale.transpose(0, 1).index_select(1, pages))
        return t.reshape(g, -1, d)[:, :n].unsqueeze(0)
    # (on the CPU, index_select over the pool seen heads-first, a strided source, took time in the
    # pool's size, 0.1 s a call at 512 pages: whole pages along the pool's first dim, then heads first)
    t = pool.index_select(0, pages)  # [pages, g, P, d]
    if scale is not None:
        t = fp8.dequantize(t, scale.index_select(0, pages))
    return t.transpose(0, 1).reshape(g, -1, d)[:, :n].unsqueeze(0)


def paged_decode_torch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                       lens: torch.Tensor, scales=None) -> torch.Tensor:
    """What the paged decode kernel computes, in torch math (fp32, fp64 for fp64): q [n, h, d] (row
    b at position lens[b] - 1) over the first lens[b] positions read through table [n, pages]; a
    row of length 0 is zero. Reads only what the tables say, as the kernel does. scales: FP8 pages'
    (k_scale, v_scale) [pages, g, P], the pages dequantized as they are read."""
    n, h, d = q.shape
    g = k_pool.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    idx = table.long()
    k, v = k_pool[idx], v_pool[idx]  # [n, pages, g, P, d]
    if scales is not None:
        k, v = fp8.dequantize(k, scales[0][idx]), fp8.dequantize(v, scales[1][idx])
    k = k.permute(0, 2, 1, 3, 4).reshape(n, g, -1, d).to(acc)  # [n, g, pages * P, d]
    v = v.permute(0, 2, 1, 3, 4).reshape(n, g, -1, d).to(acc)
    qf = q.to(acc).view(n, g, h // g, d)
    s = torch.einsum("bgrd,bgkd->bgrk", qf, k) / math.sqrt(d)
    valid = torch.arange(k.shape[2], device=q.device)[None, :] < lens.long()[:, None]  # [n, keys]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row of no keys: zeros, not NaN
    return torch.einsum("bgrk,bgkd->bgrd", p, v).reshape(n, h, d).to(q.dtype)


# ---- decode steps under CUDA graphs, one per batch-size bucket ------------------------------------

def chunk_graph_refusal(layer, pool: "PagedKV") -> str | None:
    """Why a chunk of a prompt cannot be one CUDA graph replayed for every chunk (ChunkGraphs), or None:
    it needs the fused backend's kernel that reads K/V in place through the block table with L0 on the
    device (FusedBackend.forward_paged: compute capability 9.0, fp16/bf16, head dim 64 or 128, pages of a
    power of two of at least 16 tokens, a 16-bit pool)."""
    from .attention.fused import PAGED_HEAD_DIMS, paged_fits
    from .decode import decode_kernel_fits
    k = pool.k[pool.layers.index(layer)]
    q = torch.empty(1, layer.local_heads, layer.head_dim, dtype=layer.dtype, device=k.device)
    if layer.backend.name == "fused" and not pool.fp8 and decode_kernel_fits(q) and paged_fits(q, k):
        return None
    return (f"graphed chunks (ChunkGraphs) need the fused backend's paged prefill kernel: a GPU of compute capability "
            f"9.0, fp16 or bf16, head dim {' or '.join(map(str, PAGED_HEAD_DIMS))}, a 16-bit pool with pages of a "
            f"power of two of 16 tokens or more (here backend {layer.backend.name}, {str(layer.dtype).replace('torch.', '')}, "
            f"head dim {layer.head_dim}, pages of {pool.page_size} {'e4m3' if pool.fp8 else 'tokens'} on {k.device}); "
            "run the chunks eagerly (pool.step([sid], [T]) and the layers)")


class _StaticChunk:
    """The fixed tensors a captured chunk step reads (ChunkGraphs): one sequence, T rows at positions
    L0 .. L0 + T - 1 with L0 on the device (the fused kernel reads it there), its rows' positions, pages
    and offsets in them, its block-table row [1, max_pages]; fill() sends a chunk's values in one copy. `starts` holds
    the host's L0 of the chunk being run (checks only: the graph does not keep it)."""

    def __init__(self, pool: PagedKV, T: int, max_pages: int):
        self.pool, self.T, self.max_pages = pool, T, max_pages
        self.rows, self.cu, self.slots, self.starts = [T], [0, T], [None], [0]
        self.seq_ids = ["the graphed chunk's sequence"]
        self.dev = torch.zeros(self._words(), dtype=torch.int32, device=pool.device)
        by_row = self.dev[:6 * T].view(torch.int64).view(3, T)
        self.positions, self.page_index, self.page_offset = by_row[0], by_row[1], by_row[2]
        self.table = self.dev[6 * T:6 * T + max_pages].view(1, max_pages)
        self.start = self.dev[6 * T + max_pages:6 * T + max_pages + 1]
        self.upto = max_pages * pool.page_size  # (the rotary tables' length the step reads)

    def _words(self) -> int:
        return 6 * self.T + self.max_pages + 2  # (even: the int64 views stay 8-byte aligned)

    @property
    def total_rows(self) -> int:
        return self.T

    def prefill_tables(self):
        return self.table, None, self.start

    def view(self, index: int = 0) -> PagedView:
        return PagedView(self, index)

    def fill(self, step: "PagedStep") -> None:
        """The chunk's positions, pages, table row and L0 into the fixed tensors: built with numpy in a new
        pinned buffer (torch's allocator keeps it until the copy has read it), one copy."""
        P, T, W = self.pool.page_size, self.T, self.max_pages
        L0 = step.starts[0]
        pages = self.pool.tables[step.slots[0]]
        host = torch.empty(self._words(), dtype=torch.int32, pin_memory=self.pool.device.type == "cuda")
        h = host.numpy()
        table = h[6 * T:6 * T + W]
        table[:] = self.pool.scratch_page
        table[:len(pages)] = pages
        by_row = h[:6 * T].view(np.int64).reshape(3, T)
        by_row[0] = np.arange(L0, L0 + T, dtype=np.int64)
        by_row[1] = table[by_row[0] // P]
        by_row[2] = by_row[0] % P
        h[6 * T + W:] = (L0, 0)
        self.dev.copy_(host, non_blocking=True)
        self.starts = [L0]


class ChunkGraphs:
    """A long prompt's chunks of T rows, each step one CUDA graph replay: fn(x, view) (for example the
    model's layers, layer i given cache=view.step.view(i)... as DecodeGraphs' fn) captured once for one
    sequence's chunk of T rows and replayed for every later chunk of T rows of any sequence: the chunk's
    position L0, its rows' pages and its block-table row reach fixed tensors on the device in one copy,
    and the fused kernel reads L0 there (FusedBackend.forward_paged), so that nothing the host knows of
    the chunk is kept in the graph. A chunk step's host work is then the pool's step, that copy, x's copy
    and the replay, where an eager chunk issues every kernel and its arguments (a 1024-row chunk issued
    for longer than its GPU work took, measured: benchmarks/). A prompt's last chunk, shorter than T, runs
    eagerly (pool.step and the layers). max_len: the longest a sequence may grow (the table row's width).
    capture=False runs the same fixed-tensor steps eagerly (a check of the graphs)."""

    def __init__(self, pool: PagedKV, fn, x_like: torch.Tensor, max_len: int, capture: bool = True):
        T = x_like.shape[1] if x_like.dim() == 3 else 0
        if x_like.dim() != 3 or x_like.shape[0] != 1 or T < 2:
            raise ConfigError(f"ChunkGraphs takes x_like [1, T, D] with T >= 2 rows a chunk (got {tuple(x_like.shape)}); "
                              "one row a sequence is a decode step: DecodeGraphs")
        if capture:
            if pool.device.type != "cuda":
                raise ConfigError("ChunkGraphs(capture=True) captures CUDA graphs: the pool must be on a GPU (or pass "
                                  "capture=False to run the same steps eagerly)")
            why = next(filter(None, (chunk_graph_refusal(layer, pool) for layer in pool.layers)), None)
            # (every rank alike: a rank that could not capture would leave the others in a captured collective)
            pool._agree("ChunkGraphs", (T, int(max_len), why is None))
            if why:
                raise ConfigError(why)
        self.pool, self.fn, self.capture, self.T = pool, fn, capture, T
        self.max_pages = -(-int(max_len) // pool.page_size)
        self.static = _StaticChunk(pool, T, self.max_pages)
        self.x = torch.zeros_like(x_like, device=pool.device)
        self.run = None
        for layer in pool.layers:  # the rotary tables a captured step reads, made before any capture
            if layer.rope_theta is not None:
                pool.rope(layer, self.max_pages * pool.page_size)

    def step(self, sid: int, x: torch.Tensor) -> torch.Tensor:
        """Sequence sid's next T rows x [1, T, D]: the pool's step (its pages taken, the ranks' agreement),
        the chunk's values and x into the fixed tensors, the graph replayed (captured on the first call);
        returns fn's output (a copy)."""
        if tuple(x.shape) != tuple(self.x.shape):
            raise ConfigError(f"ChunkGraphs.step takes a chunk of {self.T} rows, x {tuple(self.x.shape)} (got "
                              f"{tuple(x.shape)}); run a shorter last chunk eagerly")
        end = self.pool.length(sid) + self.T
        if end > self.max_pages * self.pool.page_size:
            raise ConfigError(f"sequence {sid} would reach {end} positions, past max_len="
                              f"{self.max_pages * self.pool.page_size} of these graphs; make ChunkGraphs with a "
                              "larger max_len")
        st = self.static
        with self.pool.step([sid], [self.T]) as step:
            st.fill(step)
            self.x.copy_(x)
            self.pool._open = st  # what the layers check their view against
            try:
                if not self.capture:
                    out = self.fn(self.x, st)
                else:
                    if self.run is None:  # warm-up (this chunk itself, on a side stream), then the capture
                        from .graphs import capture, replayer
                        graph, res = capture(lambda: self.fn(self.x, st), self.x, warmups=1)
                        for layer in self.pool.layers:  # peer buffers a captured peer sum reads stay put
                            layer.peers.pin()
                        self.run = replayer(self.pool.layers[0].world, graph, res)
                    out = self.run()
            finally:
                self.pool._open = step
            return out.clone()


BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class _StaticStep:
    """A decode step of up to `bucket` sequences whose every tensor is fixed (a graph reads it).
    Made per step from small inputs on the device, the rows' slots, their lengths before the step and
    the page each row's step takes if any (its column in the block table and its id), and the pool's
    block tables as the device holds them (DecodeGraphs' mirror): prepare() writes the pages taken
    into the mirror and makes, on the device, each row's position, where its K and V go, its block
    table row and its length after the step, then advances the inputs' lengths by one. So a step that
    continues the bucket's last one (the same slots, every length one more, no page taken) needs no
    copy from the host; fill() sends the inputs when the live set changes or a row takes a page.
    Padding rows (past the live sequences) take the mirror's extra slot: length 0 (their attention is
    zero), K and V written into the scratch page."""

    def __init__(self, pool: PagedKV, bucket: int, table: torch.Tensor):
        dev = pool.device
        self.pool, self.bucket, self.dev_table = pool, bucket, table
        self.rows, self.cu = [1] * bucket, list(range(bucket + 1))
        self.seq_ids = [f"row {i} of the bucket" for i in range(bucket)]  # (what a refusal names)
        # slots, lengths before the step, the column and id of a page the row takes (column -1: none)
        self.inputs = torch.zeros(4, bucket, dtype=torch.int64, device=dev)
        # what prepare() makes: positions, page_index, page_offset, table, lens (read through the
        # properties below, which first join prepare()'s side stream when it ran on one)
        self._out = {"positions": torch.zeros(bucket, dtype=torch.int64, device=dev),
                     "page_index": torch.zeros(bucket, dtype=torch.int64, device=dev),
                     "page_offset": torch.zeros(bucket, dtype=torch.int64, device=dev),
                     "table": torch.zeros(bucket, table.shape[1], dtype=torch.int32, device=dev),
                     "lens": torch.zeros(bucket, dtype=torch.int32, device=dev)}
        self._ready = None  # the event of prepare() on a side stream, until a reader's stream waits for it
        self.longest = self.upto = table.shape[1] * pool.page_size

    def _get(self, name: str) -> torch.Tensor:
        self.join()
        return self._out[name]

    positions = property(lambda self: self._get("positions"))
    page_index = property(lambda self: self._get("page_index"))
    page_offset = property(lambda self: self._get("page_offset"))
    table = property(lambda self: self._get("table"))
    lens = property(lambda self: self._get("lens"))

    def join(self) -> None:
        """The current stream waits for prepare() if it ran on a side stream (once)."""
        if self._ready is not None:
            torch.cuda.current_stream(self.inputs.device).wait_event(self._ready)
            self._ready = None

    @property
    def total_rows(self) -> int:
        return self.bucket

    def decode_tables(self):
        return self.table, self.lens, self.longest

    def view(self, index: int = 0) -> PagedView:
        return PagedView(self, index)

    def fill(self, step: "PagedStep", carry: dict | None = None) -> None:
        """The step's slots and lengths into the fixed inputs (padding: the extra slot, length 0), and
        carry's pages ({slot: (column, page)}: pages the step took, which prepare() puts in the mirror)."""
        pad = [self.pool.max_seqs] * (self.bucket - len(step.slots))
        carry = carry or {}
        col, page = ([carry[s][i] if s in carry else -1 for s in step.slots] + [-1] * len(pad) for i in (0, 1))
        # a new host tensor each step (pinned: torch's allocator keeps it until the copy has read it)
        rows = torch.tensor([step.slots + pad, step.starts + [0] * len(pad), col, page], dtype=torch.int64)
        self.inputs.copy_(_pinned(rows, self.inputs.device), non_blocking=True)

    def prepare(self, side=None) -> None:
        """On the device (inside the graph): the pages the rows take into the mirror; positions, K/V
        destinations, table rows, lengths; then the inputs' lengths of live rows one more (the next
        step's). One kernel on a GPU with CuPy (pg_prepare), else the same in torch ops. side (a CUDA
        stream): the kernel runs there, beside the step's first work (the QKV GEMM), and the first
        read of what it makes waits for it (join)."""
        from .errors import cupy_available
        P, S = self.pool.page_size, self.pool.max_seqs
        if self.inputs.is_cuda and cupy_available():
            if side is None:
                return self.prepare_kernel()
            side.wait_stream(torch.cuda.current_stream(self.inputs.device))
            with torch.cuda.stream(side):
                self.prepare_kernel()
                self._ready = torch.cuda.Event()
                self._ready.record(side)
            return
        slots, pos, col, page = self.inputs
        live, took = slots < S, col >= 0
        at = torch.where(took, col, 0)  # (rows without a page write back what the mirror holds)
        self.dev_table[slots, at] = torch.where(took, page.to(torch.int32), self.dev_table[slots, at])
        out = self._out
        out["positions"].copy_(pos)
        out["page_index"].copy_(self.dev_table[slots, torch.div(pos, P, rounding_mode="floor")].long())
        out["page_offset"].copy_(torch.remainder(pos, P))
        out["table"].copy_(self.dev_table.index_select(0, slots))
        out["lens"].copy_(((pos + 1) * live).to(torch.int32))
        pos += live


    def prepare_kernel(self) -> None:
        """prepare()'s launch (kernels/decode_attention.cu, pg_prepare)."""
        import numpy as np

        from .cuda import launch, ptr
        from .decode import dec_source
        b, W = self.bucket, self._out["table"].shape[1]
        launch(dec_source(self.pool.layers[0].head_dim), "pg_prepare", self.inputs.device, (-(-b * W // 256), 1, 1), (256, 1, 1),
               (ptr(self.inputs), ptr(self.dev_table), *(ptr(self._out[k]) for k in
                                                          ("positions", "page_index", "page_offset", "table", "lens")),
                np.int32(b), np.int32(W),
                np.int32(self.pool.page_size), np.int32(self.pool.max_seqs)))


class DecodeGraphs:
    """Decode steps of every live sequence at once, each under a CUDA graph of the smallest bucket
    of sequences that holds them (captured on first use, then replayed): a change of the live set
    replays another bucket's graph instead of capturing again. fn(x, view) is the step (for example
    the model's layers), x the fixed input [bucket, ...] (x_like's trailing shape and dtype) and
    view what the layers take as cache=; it returns a tensor whose first dimension is the bucket's,
    each row a function of its own input row only (padding rows hold stale inputs). max_len: the
    longest any sequence may grow (sets the block tables' width, and the kernel's split).
    capture=False runs the same fixed-tensor steps eagerly (CPU; a check of the graphs)."""

    def __init__(self, pool: PagedKV, fn, x_like: torch.Tensor, max_len: int, buckets=BUCKETS,
                 capture: bool = True):
        if capture and pool.device.type != "cuda":
            raise ConfigError("DecodeGraphs(capture=True) captures CUDA graphs: the pool must be on a GPU (or pass "
                              "capture=False to run the same steps eagerly)")
        if not isinstance(x_like, torch.Tensor) or x_like.dim() < 1:
            raise ConfigError(f"DecodeGraphs takes x_like a tensor of one row per sequence, [n, ...] (got "
                              f"{type(x_like).__name__})")
        check_counts(max_len=max_len)
        buckets = sorted(set(int(b) for b in buckets))
        if not buckets or buckets[0] < 1 or buckets[-1] > pool.max_seqs:
            raise ConfigError(f"DecodeGraphs buckets must be 1..max_seqs={pool.max_seqs} sequences (got {buckets})")
        if capture:
            from .graphs import refusal
            for layer in pool.layers:
                why = refusal(layer, x_like.to(pool.device))
                if why:
                    raise ConfigError(why)
        self.pool, self.fn, self.buckets, self.capture = pool, fn, buckets, capture
        self._side = torch.cuda.Stream(pool.device) if capture else None  # prepare()'s stream
        self.max_pages = -(-int(max_len) // pool.page_size)
        self.x_like = x_like
        self._made: dict[int, dict] = {}  # bucket -> its fixed step, input and replay
        # the block tables on the device: a row per slot, and one more (padding rows) of scratch pages
        self.table = torch.full((pool.max_seqs + 1, self.max_pages), pool.scratch_page, dtype=torch.int32,
                                device=pool.device)
        self._mirrored = [(0, 0)] * pool.max_seqs  # slot -> (generation, pages already on the device)
        self._seen = -1  # the pool's version the mirror was last brought up to
        for layer in pool.layers:  # the rotary tables a captured step reads, made before any capture
            if layer.rope_theta is not None:
                pool.rope(layer, self.max_pages * pool.page_size)

    def _sync(self, step) -> dict | None:
        """The mirror brought up to the pool's tables for the step's sequences. When nothing but this
        step's own pages changed the tables since the last sync (a steady decode step), only the slots
        it lengthened are looked at: a slot whose mirror lacked only the page it just took gets it
        through the step's inputs (returned, {slot: (column, page)}: the graph's pg_prepare writes it
        into the mirror, so no copy or kernel of its own); the others are sent now. Else (a sequence
        added, removed or stepped elsewhere, or a step that failed) what every live sequence's
        table lacks is sent now, not only this step's (a later steady step may take in a sequence
        this one left out), every bucket's inputs are marked to be sent again (a page an earlier
        step's inputs carry may be another sequence's now), and None is returned."""
        steady = self.pool.version == self._seen + bool(step.grew)
        self._seen = -1  # (until the step has run: a step that fails before sends every slot next time)
        if not steady:
            self._sync_tables(sorted(self.pool.slots.values()))
            for made in self._made.values():
                made["next"] = None
            return None
        carry, rest = {}, []
        for s in step.grew:
            gen, have = self._mirrored[s]
            pages = self.pool.tables[s]
            if gen == self.pool.generation[s] and have == len(pages) - 1:
                carry[s] = (have, pages[-1])
            else:
                rest.append(s)
        if rest:
            self._sync_tables(rest)
        return carry

    def _sync_tables(self, slots) -> None:
        """The pages taken since the last step (and a reused slot's) onto the device: one copy."""
        updates, mirrored = [], {}
        for s in slots:
            gen, have = self._mirrored[s]
            if gen != self.pool.generation[s]:
                gen, have = self.pool.generation[s], 0
            pages = self.pool.tables[s]
            updates += [(s, j, pages[j]) for j in range(have, len(pages))]
            mirrored[s] = (gen, len(pages))
        if updates:
            u = _on_device(torch.tensor(updates, dtype=torch.int64), self.pool.device)
            self.table[u[:, 0], u[:, 1]] = u[:, 2].to(torch.int32)
        for s, m in mirrored.items():  # recorded once the copy is queued (a failure above leaves them to resend)
            self._mirrored[s] = m

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ConfigError(f"{n} live sequences: the largest bucket is {self.buckets[-1]}; pass larger buckets= "
                          f"(at most max_seqs={self.pool.max_seqs})")

    def _bucket(self, b: int) -> dict:
        """Bucket b's fixed step and input (made on first use) and its replay (captured by its first step)."""
        made = self._made.get(b)
        if made is None:
            xs = torch.zeros((b, *self.x_like.shape[1:]), dtype=self.x_like.dtype, device=self.pool.device)
            made = self._made[b] = {"step": _StaticStep(self.pool, b, self.table), "x": xs, "run": None, "next": None}
        return made

    def input(self, n: int) -> torch.Tensor:
        """The fixed input rows of a step of n sequences ([n, ...], its bucket's): write a step's rows
        into it in place and pass it to step() as x, and step() copies nothing in (as layer.graphed's
        x)."""
        return self._bucket(self.bucket_for(n))["x"][:n]

    def step(self, seq_ids, x: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """One decode step of seq_ids (x: one row each, [n, ...]); returns fn's output for them [n, ...]:
        a copy, or (copy=False) the graph's own output rows, which the bucket's next step overwrites
        (as layer.graphed's output). The pool's calls are the usual ones (its pages taken, the ranks'
        agreement), the step's slots and lengths sent to the bucket's fixed inputs unless they
        continue its last step (the graph advanced them) and take no page (a page taken goes with the
        inputs), x copied in (unless x is input(n) itself), then the bucket's graph replayed."""
        seq_ids = list(seq_ids)
        n = len(seq_ids)
        if not n:
            raise ConfigError("DecodeGraphs.step needs at least one sequence id")
        want = (n, *self.x_like.shape[1:])
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != want or x.dtype != self.x_like.dtype:
            got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ConfigError(f"DecodeGraphs.step takes x of one row per sequence, {want} {self.x_like.dtype} like "
                              f"x_like (got {got}); nothing was stepped")
        b = self.bucket_for(n)
        longest = max(map(self.pool.length, seq_ids)) + 1
        if longest > self.max_pages * self.pool.page_size:
            raise ConfigError(f"a sequence would reach {longest} positions, past max_len="
                              f"{self.max_pages * self.pool.page_size} of these graphs; make DecodeGraphs with a "
                              "larger max_len")
        with self.pool.step(seq_ids, [1] * n) as step:
            carry = self._sync(step)
            version = self.pool.version
            made = self._bucket(b)
            st, xs = made["step"], made["x"]
            now = (tuple(step.slots), tuple(step.starts))
            if carry is None or carry or made["next"] != now:  # not the continuation of this bucket's last
                st.fill(step, carry)                              # step: send the inputs
            made["next"] = None      # (unknown until this step has run)
            rows = xs[:n]
            if not (x.data_ptr() == rows.data_ptr() and (x.dtype, x.device, x.shape, x.stride())
                    == (rows.dtype, rows.device, rows.shape, rows.stride())):  # (x is not input(n) itself)
                rows.copy_(x)        # (padding rows keep earlier rows: fn must treat rows independently, as
                                     # the layers do; their outputs are discarded)

            def body():
                st.prepare(self._side)  # (on a GPU: beside fn's first work, which does not read it)
                try:
                    return self.fn(xs, st)
                finally:
                    st.join()  # (an fn that read none of it, or raised: the step ends joined)
            self.pool._open = st  # what the layers check their view against
            try:
                if not self.capture:
                    out = body()
                else:
                    if made["run"] is None:  # warm-up (the step itself, on a side stream), then the capture
                        from .graphs import capture, replayer
                        graph, res = capture(body, xs, warmups=1)
                        for layer in self.pool.layers:  # peer buffers a captured peer sum reads stay put
                            layer.peers.pin()
                        made["run"] = replayer(self.pool.layers[0].world, graph, res)
                        st.fill(step, carry)  # the warm-up advanced the inputs' lengths: this step's again
                    out = made["run"]()
                made["next"] = (now[0], tuple(L + 1 for L in now[1]))
            finally:
                self.pool._open = step
            for s, (col, _) in (carry or {}).items():  # the step ran: the pages it carried are in the mirror
                self._mirrored[s] = (self.pool.generation[s], col + 1)
            self._seen = version
            return out[:n].clone() if copy else out[:n]
