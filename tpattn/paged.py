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
sequence at once, its own length, K/V read in place through the block table); a prefill, and any
step on CPU, runs torch math (decode.attend per sequence over the K/V gathered through the table).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ConfigError

PAGE_SIZE = 16  # tokens per page (FlashInfer reads pages of 1-16 tokens as fast as contiguous K/V)


class PagedKV:
    """The pages of K and V of each of `layers` (one layer or a model's list, on one group and one
    device, with the same K/V head shard), a block table per sequence slot, and the host allocator."""

    def __init__(self, layers, pages: int, page_size: int = PAGE_SIZE, max_seqs: int = 64):
        layers = [layers] if isinstance(layers, torch.nn.Module) else list(layers)
        if not layers:
            raise ConfigError("PagedKV needs at least one layer")
        if pages < 1 or page_size < 1 or max_seqs < 1:
            raise ConfigError(f"PagedKV needs pages, page_size and max_seqs >= 1 (got {pages}, {page_size}, {max_seqs})")
        first = layers[0]
        for i, L in enumerate(layers):
            if (L.local_kv_heads, L.head_dim, L.dtype, L.wqkv.device, L.rank, L.world) != \
                    (first.local_kv_heads, first.head_dim, first.dtype, first.wqkv.device, first.rank, first.world):
                raise ConfigError(f"PagedKV's layers must share K/V heads per rank, head dim, dtype, device and group "
                                  f"(layer {i} differs from layer 0); make one pool per kind of layer")
        self.layers, self.pages, self.page_size, self.max_seqs = layers, pages, page_size, max_seqs
        g, d, dev, dt = first.local_kv_heads, first.head_dim, first.wqkv.device, first.dtype
        self.k = [torch.zeros(pages, g, page_size, d, dtype=dt, device=dev) for _ in layers]
        self.v = [torch.zeros(pages, g, page_size, d, dtype=dt, device=dev) for _ in layers]
        self.device = dev
        self.free_pages = list(range(pages - 1, -1, -1))  # a stack: the lowest page is taken first
        self.slots: dict[int, int] = {}        # sequence id -> slot
        self.free_slots = list(range(max_seqs - 1, -1, -1))
        self.tables: list[list[int]] = [[] for _ in range(max_seqs)]  # slot -> its pages, in order
        self.lengths = [0] * max_seqs          # slot -> positions filled
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
        return sid

    def remove(self, sid: int) -> None:
        """Sequence sid is finished: its pages and slot go back to the pool."""
        self._agree("remove", (sid,))
        slot = self._slot(sid)
        self.free_pages.extend(reversed(self.tables[slot]))
        self.tables[slot], self.lengths[slot] = [], 0
        del self.slots[sid]
        self.free_slots.append(slot)

    def length(self, sid: int) -> int:
        return self.lengths[self._slot(sid)]

    @property
    def live(self) -> list[int]:
        return sorted(self.slots)

    def free_page_count(self) -> int:
        return len(self.free_pages)

    def nbytes(self) -> int:
        return sum(2 * t.numel() * t.element_size() for t in self.k)

    def _slot(self, sid: int) -> int:
        if sid not in self.slots:
            raise ConfigError(f"no sequence {sid} in this pool (live: {self.live or 'none'}); add it with pool.add()")
        return self.slots[sid]

    def _agree(self, what: str, args: tuple) -> None:
        """Every rank makes the same call (block tables and lengths must be the same on every rank);
        one line on every rank if not."""
        comm = self.layers[0].comm
        if comm.world == 1 or comm.group is None:
            return
        said = comm.all_gather_object((what, args), "pagedagree")
        if len(set(map(repr, said))) > 1:
            shown = "; ".join(f"rank {r}: {w}{a}" for r, (w, a) in enumerate(said[:4]))
            raise ConfigError(f"the ranks' paged-cache calls differ ({shown}); every rank must add, step and "
                              "remove the same sequences with the same row counts")

    # ---- steps ---------------------------------------------------------------------------------

    def step(self, seq_ids, rows) -> "PagedStep":
        """A step that appends rows[i] rows to sequence seq_ids[i] (a prefill: the prompt's length;
        a decode step: 1), packed in that order; its pages are taken now. Use as a context
        manager: the lengths advance when the block ends without an error."""
        seq_ids, rows = [int(s) for s in seq_ids], [int(r) for r in rows]
        self._agree("step", (tuple(seq_ids), tuple(rows)))
        if self._open is not None:
            raise ConfigError("a step of this pool is still open: end it (leave its with block) before the next")
        if len(seq_ids) != len(rows) or not seq_ids:
            raise ConfigError(f"step needs one row count per sequence (got {len(seq_ids)} ids, {len(rows)} counts)")
        if len(set(seq_ids)) != len(seq_ids):
            raise ConfigError(f"step lists a sequence twice ({seq_ids}); give each sequence's rows once")
        if any(r < 1 for r in rows):
            raise ConfigError(f"step appends at least one row to each sequence (got {rows})")
        slots = [self._slot(s) for s in seq_ids]
        P = self.page_size
        need = [max(0, -(-(self.lengths[s] + r) // P) - len(self.tables[s])) for s, r in zip(slots, rows)]
        if sum(need) > len(self.free_pages):
            raise ConfigError(f"the pool has {len(self.free_pages)} free pages of {P} tokens and this step needs "
                              f"{sum(need)} more; remove finished sequences (pool.remove(id)) or make the pool "
                              f"larger (PagedKV(..., pages={self.pages + sum(need) - len(self.free_pages)} or more))")
        for s, n in zip(slots, need):
            self.tables[s] += [self.free_pages.pop() for _ in range(n)]
        self._open = PagedStep(self, seq_ids, slots, rows, [self.lengths[s] for s in slots])
        return self._open

    def _close(self, step: "PagedStep", ok: bool) -> None:
        self._open = None
        if ok:
            for s, r in zip(step.slots, step.rows):
                self.lengths[s] += r


@dataclass
class PagedView:
    """One layer's view of a step: what layer(x, cache=view) reads and writes."""
    step: "PagedStep"
    index: int  # the layer's place in the pool's layers


class PagedStep:
    """The rows one step appends: per sequence its slot, start position and row count, and for
    every packed row its position and where its K and V go (page, offset), on the pool's device."""

    def __init__(self, pool: PagedKV, seq_ids, slots, rows, starts):
        self.pool, self.seq_ids, self.slots, self.rows, self.starts = pool, seq_ids, slots, rows, starts
        self.cu = [0]
        for r in rows:
            self.cu.append(self.cu[-1] + r)
        P = pool.page_size
        pos, page, off = [], [], []
        for s, r, L0 in zip(slots, rows, starts):
            for p in range(L0, L0 + r):
                pos.append(p)
                page.append(pool.tables[s][p // P])
                off.append(p % P)
        dev = pool.device
        self.positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        self.page_index = torch.tensor(page, dtype=torch.int64, device=dev)
        self.page_offset = torch.tensor(off, dtype=torch.int64, device=dev)

    @property
    def total_rows(self) -> int:
        return self.cu[-1]

    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(block table int32 [n, most pages], lengths int32 [n] after the step, the longest) of the
        step's n sequences, on the pool's device: what the paged decode kernel reads. Made once."""
        if getattr(self, "_tables", None) is None:
            P = self.pool.page_size
            lens = [L0 + r for L0, r in zip(self.starts, self.rows)]
            most = max(-(-n // P) for n in lens)
            rows = [self.pool.tables[s][:-(-n // P)] for s, n in zip(self.slots, lens)]
            table = torch.tensor([r + [0] * (most - len(r)) for r in rows], dtype=torch.int32)
            self._tables = (table.to(self.pool.device), torch.tensor(lens, dtype=torch.int32).to(self.pool.device),
                            max(lens))
        return self._tables

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
    from .decode import apply_rope, attend, decode_kernel_fits, paged_decode_attention, rope_tables
    from .ops import mm
    from .outputsum import OutputSum
    from .timing import section
    step, pool = view.step, view.step.pool
    if pool._open is not step:
        raise ConfigError("this step has ended (its with block is left); make a new one with pool.step(ids, rows)")
    if pool.layers[view.index] is not layer:
        raise ConfigError(f"this view is of the pool's layer {view.index}, not this layer: use step.view(i) with this "
                          "layer's index in the pool's layers")
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
    q, k, v = qkv.split([h, g, g], dim=1)  # [R, heads, d]
    if layer.rope_theta is not None:
        cos, sin = rope_tables(step.positions, d, layer.rope_theta, torch.promote_types(layer.dtype, torch.float32))
        q = apply_rope(q.transpose(0, 1).unsqueeze(0), cos, sin, layer.rope_interleaved)[0].transpose(0, 1)
        k = apply_rope(k.transpose(0, 1).unsqueeze(0), cos, sin, layer.rope_interleaved)[0].transpose(0, 1)
    kp, vp = pool.k[view.index], pool.v[view.index]
    with section("cache_append"):  # row r's K and V at (its page, its offset) of every K/V head
        kp[step.page_index, :, step.page_offset] = k
        vp[step.page_index, :, step.page_offset] = v
    P = pool.page_size
    if max(step.rows) == 1 and decode_kernel_fits(q):  # a decode step: the paged split kernel, every sequence at once
        table, lens, longest = step.decode_tables()
        with section("attention"):
            o = paged_decode_attention(q, kp, vp, table, lens, longest)
        total = OutputSum(layer, plan, x.device)
        total.add_rows(0, R, o.view(R, h * d))
        return total.result().view(B, N, D)
    o = torch.empty(R, h, d, dtype=layer.dtype, device=x.device)
    with section("attention"):
        for i, (s, T, L0) in enumerate(zip(step.slots, step.rows, step.starts)):
            n = L0 + T
            pages = torch.tensor(pool.tables[s][:-(-n // P)], dtype=torch.int64, device=x.device)
            ks = kp.index_select(0, pages).transpose(0, 1).reshape(g, -1, d)[:, :n].unsqueeze(0)  # [1, g, n, d]
            vs = vp.index_select(0, pages).transpose(0, 1).reshape(g, -1, d)[:, :n].unsqueeze(0)
            r0 = step.cu[i]
            qs = q[r0:r0 + T].transpose(0, 1).unsqueeze(0)  # [1, h, T, d]
            o[r0:r0 + T] = attend(qs, ks, vs, L0)[0].transpose(0, 1)
    total = OutputSum(layer, plan, x.device)
    total.add_rows(0, R, o.view(R, h * d))
    return total.result().view(B, N, D)
