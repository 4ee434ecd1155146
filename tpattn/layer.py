"""The tensor-parallel attention layer. It communicates only through tpattn/comm.py (the collectives
as forward/backward pairs, and the plan that decides which of them a call runs).

Two parallel styles, each one method read top to bottom (diagrams in docs/parallel.md):

head-parallel (default), _forward_heads: one collective, or two
    x [B, N, D]            replicated on every rank (copy_to_ranks: the identity; its dual sums dX)
    QKV GEMM               one GEMM with this rank's packed q, k, v columns (query heads [r*h, (r+1)*h)
                           and the K/V heads they use, see "K/V heads" below; with uneven_heads a
                           block of ceil or floor of H/W heads, see tpattn.sharding.head_range)
    local attention        a backend from tpattn.attention (naive CUDA, fused, reference, ...)
    output GEMM            this rank's rows of W_o, fp32 result for --reduce-dtype fp32
    all_reduce(SUM)        partial [B, N, D] summed over ranks; b_o added once, after it
      or, "split" (the default when the partials are wider than the model dtype):
    reduce_scatter(SUM)    each rank sums 1/W of the partial's rows in fp32, adds b_o, rounds
    all_gather             the rounded rows to every rank: the same y, 3/4 of the all-reduce's bytes
      or, "p2p" (opt-in; one GPU per rank on one node; tpattn/peer.py):
    peer reduce-gather     one kernel reads its 1/W of the rows of every rank's partial over NVLink,
                           sums them in fp32, adds b_o, rounds once and writes them into every rank's y
    y [B, N, D]            identical on every rank

sequence-parallel, _forward_sequence: two collectives
    x [B, N/W, D]          this rank's block of the sequence
    all_gather             x [B, N, D] for the QKV GEMM
    QKV GEMM, attention, output GEMM as above
    reduce_scatter(SUM)    each rank keeps the sum of its own block of rows
    y [B, N/W, D]          this rank's block of the output

Overlap (overlap=K > 1): the output GEMM runs in K row chunks and chunk c's collective runs on a
communication stream while chunk c+1 is projected; in sequence parallel the all-gather is chunked
the same way and the QKV GEMM of chunk c runs while chunk c+1 is gathered. On CPU the chunks run
in order (same math, nothing to overlap with).

K/V heads (grouped-query attention, kv_heads G < H): query head q uses K/V head q // (H/G). Over W
ranks the K/V columns are split when W divides G (rank r owns K/V heads [r*G/W, (r+1)*G/W), the
ones its query heads use) and replicated when W is a multiple of G (each rank holds the one K/V
head its query heads use); with uneven_heads and W <= G each rank owns a block of whole K/V groups
(a K/V head and its H/G query heads), ceil or floor of G/W of them; tpattn.sharding.check_kv_heads
refuses the rest. Either way a rank's attention needs no other rank's K or V: the collectives are
the same as with G = H.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import faults, watch
from .attention import Backend, get_backend, head_chunks
from .comm import Comm
from .comm import copy_to_ranks, gather_sequence, scatter_sequence, sum_from_ranks, sum_of_copies
from .commplan import ONESHOT_MAX_BYTES, CommPlan, check_style, make_plan, oneshot_candidate
from .decode import KVCache, append_row, apply_rope, decode_attention, graph_refusal, rope_tables
from .errors import ConfigError
from .ops import ColumnParallelQKV, add_bias, linear, mm
from .outputsum import OutputSum
from .sharding import Shard
from .timing import section
from .weights import slice_heads

WORLD = "world"  # group=WORLD: the default process group if one is initialized, else none
REDUCE_DTYPES = ("fp32", "model")


class TensorParallelAttention(torch.nn.Module):
    """Multi-head attention whose heads are split over the ranks of `group`.

    Parameters (torch.nn.Parameter, this rank's slices, "x @ W" layout): wqkv [D, (h + 2g)*d], the
    Q, K and V columns of this rank's h query heads and g K/V heads packed for one GEMM (views:
    .wq, .wk, .wv), bqkv [(h + 2g)*d] or None, wo [h*d, D] (this rank's rows of W_o) and bo [D] or
    None (b_o is added once, after the collective). state_dict() also records the shard (rank,
    world, heads): loading a checkpoint of another shard is refused. Build it from full matrices
    with from_full(), from_multihead_attention() or from_linears().

    sequence_parallel: inputs and outputs are this rank's block of N/W rows (see the module doc).
    overlap: K > 1 pipelines the output projection (and in sequence parallel the all-gather) over K
    row chunks with the collectives on a side stream; 1 (default) runs each collective once.
    output_collective (head-parallel): "allreduce" sums the partials with one all-reduce; "split"
    with a reduce-scatter of the partials and an all-gather of the rounded output (the same y,
    fewer bytes when the partials are fp32); "p2p" with one kernel over NVLink (one GPU per rank on
    one node); "auto" (default) splits when the partials are wider than the model dtype and every
    row chunk divides by the world size. tpattn.commplan.make_plan holds the rule (plan()).
    kv_heads: G K/V heads in all (default heads: multi-head attention; fewer: grouped-query, 1:
    multi-query); wk and wv are then [D, g*d] for this rank's g K/V heads (kv_head_range: G/W of
    them when the world size W divides G, else the one its query heads use).
    uneven_heads: the world size need not divide the heads (nor, with K/V groups, the groups):
    rank r owns a contiguous block of ceil or floor of H/W heads (of G/W whole K/V groups), the
    first ranks the larger blocks (tpattn.sharding.head_range). Only the ranks' load differs: the
    partial outputs are [B, N, D] on every rank, so the collectives are unchanged.

    Training: under autograd the forward is differentiable (_forward_train): y.backward(dy) fills
    x.grad (head-parallel: the whole dX on every rank; sequence parallel: this rank's block) and
    each parameter's .grad with this rank's slice of the single-process gradient; full_grads()
    assembles the whole gradients on every rank.
    """

    def __init__(self, wq, wk, wv, wo, bq=None, bk=None, bv=None, bo=None, *, heads: int, head_dim: int,
                 backend: str | Backend = "reference", causal: bool = False, group=WORLD,
                 reduce_dtype: str = "fp32", head_chunk: int | None = None, sequence_parallel: bool = False,
                 overlap: int = 1, output_collective: str = "auto", kv_heads: int | None = None,
                 uneven_heads: bool = False, rope_theta: float | None = None, rope_interleaved: bool = False):
        super().__init__()
        self.group, rank, world = _resolve_group(group)
        self.shard = Shard.of(heads, heads if kv_heads is None else kv_heads, world, rank, uneven_heads)
        self.heads, self.head_dim = heads, head_dim
        model_dim = wq.shape[0]
        hd, kvd = self.local_heads * head_dim, self.local_kv_heads * head_dim
        for name, t, shape in (("wq", wq, (model_dim, hd)), ("wk", wk, (model_dim, kvd)),
                               ("wv", wv, (model_dim, kvd)), ("wo", wo, (hd, model_dim))):
            if tuple(t.shape) != shape:
                kv = f" and {self.local_kv_heads} K/V heads" if self.kv_heads != heads else ""
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} for rank {self.rank} "
                                 f"of {self.world} ({self.local_heads} heads{kv} of dim {head_dim})")
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be 'fp32' or 'model' (got {reduce_dtype!r})")
        check_style(None, world, sequence_parallel, output_collective, overlap)  # what the CLI refuses, as it says it
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.causal = causal
        self.reduce_dtype = reduce_dtype
        self.head_chunk = head_chunk or self.local_heads
        self.sequence_parallel = sequence_parallel
        self.overlap = overlap
        self.output_collective = output_collective
        if rope_theta is not None and (rope_theta <= 0 or head_dim % 2):
            raise ValueError(f"rope_theta={rope_theta} with head_dim={head_dim}: rotary positions need a positive "
                             "theta and an even head dim")
        self.rope_theta, self.rope_interleaved = rope_theta, rope_interleaved
        # Q, K and V columns packed once, so the projection is one GEMM (bias fused into it): its
        # output rows are [h query heads | g K heads | g V heads] x d. Copies: training this layer
        # never writes into the caller's tensors.
        param = (lambda t: None if t is None else torch.nn.Parameter(t.detach().clone()))
        self.wqkv = torch.nn.Parameter(torch.cat([wq, wk, wv], dim=1).detach())
        biases = ((bq, hd), (bk, kvd), (bv, kvd))
        self.bqkv = None if all(b is None for b, _ in biases) else torch.nn.Parameter(torch.cat(
            [torch.zeros(n, dtype=wq.dtype, device=wq.device) if b is None else b.detach() for b, n in biases]))
        self.wo, self.bo = param(wo), param(bo)
        self.comm = Comm(self.group, rank, world)
        self._plans: dict[tuple, CommPlan] = {}
        self._peer = None  # output_collective="p2p": tpattn.peer.PeerBuffers, made on the first forward
        self._peer_checked = False
        self._peer_pinned = False  # a CUDA graph captured with the peer buffers: they must not move
        self._oneshot = None  # tpattn.peer.OneShotBuffers: the one-shot all-reduce's, made when a call first needs them
        self._peers = None    # auto: ((device, partial dtype, dtype), whether every rank mapped every other's buffer)

    # ---- the shard: what this rank holds ---------------------------------------------------------

    rank = property(lambda self: self.shard.rank)
    world = property(lambda self: self.shard.world)
    kv_heads = property(lambda self: self.shard.kv_heads)
    uneven_heads = property(lambda self: self.shard.uneven)
    head_range = property(lambda self: self.shard.head_range)
    local_heads = property(lambda self: len(self.shard.head_range))       # differs between ranks when uneven
    local_kv_heads = property(lambda self: len(self.shard.kv_head_range))
    local_group = property(lambda self: self.local_heads // self.local_kv_heads)  # query heads per K/V head
    model_dim = property(lambda self: self.wqkv.shape[0])
    dtype = property(lambda self: self.wqkv.dtype)  # follows .to() / .half()
    part_dtype = property(lambda self: torch.promote_types(self.dtype, torch.float32) if self.reduce_dtype == "fp32"
                          else self.dtype)  # fp32 partials (fp64 for an fp64 layer), or the model dtype

    def _cols(self, i: int) -> torch.Tensor:
        h, g, d = self.local_heads, self.local_kv_heads, self.head_dim
        bounds = (0, h * d, (h + g) * d, (h + 2 * g) * d)
        return self.wqkv[:, bounds[i]:bounds[i + 1]]

    wq = property(lambda self: self._cols(0))
    wk = property(lambda self: self._cols(1))
    wv = property(lambda self: self._cols(2))

    def get_extra_state(self) -> dict:
        s = self.shard
        return {"rank": s.rank, "world": s.world, "heads": s.heads, "kv_heads": s.kv_heads, "uneven": s.uneven,
                "head_dim": self.head_dim}

    def set_extra_state(self, state: dict) -> None:
        mine = self.get_extra_state()
        if state != mine:
            raise ValueError(f"this checkpoint holds {_describe(state)} but this layer is {_describe(mine)}: load "
                             "each rank's own checkpoint into a layer built with the same world size and heads")

    # ---- construction from full weights -------------------------------------------------------

    # ---- construction from full weights -------------------------------------------------------

    @classmethod
    def from_full(cls, wq, wk, wv, wo, bq=None, bk=None, bv=None, bo=None, *, heads: int, group=WORLD,
                  **kw) -> "TensorParallelAttention":
        """Keep this rank's slice of full weights in "x @ W" layout (wq: [D, H*d], wk and wv: [D, G*d]
        for G K/V heads (G = H unless grouped-query), wo: [H*d, D]). Keyword arguments go to the
        constructor (uneven_heads=True: a world size that does not divide the heads)."""
        _, rank, world = _resolve_group(group)
        head_dim = wq.shape[1] // heads
        if wq.shape[1] != heads * head_dim or wk.shape != wv.shape or wk.shape[1] % head_dim or not wk.shape[1]:
            raise ValueError(f"wq {tuple(wq.shape)}, wk {tuple(wk.shape)}, wv {tuple(wv.shape)}: wq needs {heads} "
                             "heads of d columns and wk, wv one shape of a whole number of heads of d columns")
        kv_heads = wk.shape[1] // head_dim
        if kw.get("kv_heads") not in (None, kv_heads):
            raise ValueError(f"kv_heads={kw['kv_heads']} but wk and wv have {kv_heads} heads of dim {head_dim}")
        kw["kv_heads"] = kv_heads
        shard = Shard.of(heads, kv_heads, world, rank, kw.get("uneven_heads", False))
        full = {k: t for k, t in dict(wq=wq, wk=wk, wv=wv, wo=wo, bq=bq, bk=bk, bv=bv, bo=bo).items()
                if t is not None}
        mine = slice_heads(full, shard.head_range, head_dim, shard.kv_head_range)
        return cls(**mine, heads=heads, head_dim=head_dim, group=group, **kw)

    @classmethod
    def from_linears(cls, q_proj, k_proj, v_proj, o_proj, *, heads: int, **kw) -> "TensorParallelAttention":
        """From four torch.nn.Linear layers (weights [out, in], y = x W^T + b); k_proj and v_proj
        may have fewer output features (G*d for G K/V heads: grouped-query attention)."""
        b = (lambda lin: None if lin.bias is None else lin.bias.detach())
        return cls.from_full(q_proj.weight.detach().T, k_proj.weight.detach().T, v_proj.weight.detach().T,
                             o_proj.weight.detach().T, b(q_proj), b(k_proj), b(v_proj), b(o_proj),
                             heads=heads, **kw)

    @classmethod
    def from_multihead_attention(cls, mha: torch.nn.MultiheadAttention, **kw) -> "TensorParallelAttention":
        """From a torch.nn.MultiheadAttention (same embed dim for q, k and v; inputs batch-first)."""
        if not mha._qkv_same_embed_dim:
            raise ValueError("from_multihead_attention needs kdim == vdim == embed_dim")
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn are not supported")
        w = mha.in_proj_weight.detach()
        e = mha.embed_dim
        bias = mha.in_proj_bias.detach() if mha.in_proj_bias is not None else None
        bq, bk, bv = (None, None, None) if bias is None else (bias[:e], bias[e:2 * e], bias[2 * e:])
        ob = mha.out_proj.bias.detach() if mha.out_proj.bias is not None else None
        return cls.from_full(w[:e].T, w[e:2 * e].T, w[2 * e:].T, mha.out_proj.weight.detach().T,
                             bq, bk, bv, ob, heads=mha.num_heads, **kw)

    @classmethod
    def from_hf_llama(cls, attn, **kw) -> "TensorParallelAttention":
        """From a transformers LlamaAttention: its q/k/v/o projections, heads, K/V heads, head dim
        and rope theta (from its config), causal. Keyword arguments go to the constructor."""
        cfg = attn.config
        rp = getattr(cfg, "rope_parameters", None) or {}
        kind = rp.get("rope_type", getattr(cfg, "rope_scaling", None) and cfg.rope_scaling.get("rope_type"))
        if kind not in (None, "default"):
            raise ValueError(f"rope_type {kind!r} (scaled rotary positions) is not supported; only the default one")
        theta = rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        return cls.from_linears(attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, heads=cfg.num_attention_heads,
                                kv_heads=cfg.num_key_value_heads, causal=True, rope_theta=theta, **kw)

    # ---- the plan: what a call communicates, decided before it does -------------------------

    def plan(self, batch: int, seq_len: int, decode: bool = False, training: bool = False) -> CommPlan:
        """The communication plan for a call of `batch` x `seq_len` rows (seq_len: the whole
        sequence, also in sequence parallel; decode: rows appended to a KV cache, head-parallel and
        in one chunk; training: a call under autograd, which never takes the peer paths by itself).
        The same on every rank: it depends on the shape, the settings and what the ranks agreed about
        mapping each other's memory (_ask_peers, before the first call that could use it), and is
        made once per shape. Raises ConfigError (one line, as the CLI's) for a shape it cannot run."""
        peers = self._peers is not None and self._peers[1] and self._peers[0][1:] == (self.part_dtype, self.dtype) \
            and not training
        key = (batch, seq_len, self.dtype, decode, peers)
        p = self._plans.get(key)
        if p is None:
            p = make_plan(batch, seq_len, self.model_dim, self.world, peers=peers, **self._plan_kw(decode))
            self._plans[key] = p
        return p

    def _plan_kw(self, decode: bool) -> dict:
        return dict(elem=self.dtype.itemsize, part_elem=self.part_dtype.itemsize,
                    output_collective=self.output_collective, sequence_parallel=self.sequence_parallel and not decode,
                    overlap=1 if decode else self.overlap)

    def partial_nbytes(self, batch: int, seq_len: int) -> int:
        """Bytes of the partial output that the all-reduce (or reduce-scatter) sums: [B, N, D]."""
        return self.plan(batch, seq_len).partial_bytes

    def collective_nbytes(self, batch: int, seq_len: int) -> dict[str, int]:
        """Bytes of each collective one call runs (the whole tensor, nccl-tests' "size"); one rank:
        the all-reduce a wider world would run (the report shows its bytes, with no bandwidth)."""
        p = self.plan(batch, seq_len)
        return p.nbytes if p.collective != "none" else {"allreduce": p.partial_bytes}

    def shard_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's block of N/W rows of a full [B, N, D] tensor (sequence parallel's input).
        N must divide by the world size (the same refusal as the CLI's)."""
        check_style(t.shape[1], self.world, True, "auto", 1)
        n = t.shape[1] // self.world
        return t[:, self.rank * n:(self.rank + 1) * n].contiguous()

    def gather_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """The full [B, N, D] from every rank's block (for checks: forward itself never needs it)."""
        if self.group is None or self.world == 1:
            return y
        B, n, D = y.shape
        parts = torch.empty((self.world * B, n, D), dtype=y.dtype, device=y.device)
        self.comm.all_gather(parts, y.contiguous())
        return parts.view(self.world, B, n, D).transpose(0, 1).reshape(B, self.world * n, D)

    # ---- forward -----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """y = attention(x) over the ranks. Under autograd (grad enabled, and x or a parameter
        requiring it) the differentiable path of a training step (_forward_train); else the
        inference path (in place, overlapped, CUDA-graph capturable). With a cache (new_cache): x's
        rows are appended to it and attend causally over everything in it (a prefill, or a decode
        step of one row; tpattn/decode.py). Time its passes with `with tpattn.timing.recording(timer):`."""
        if x.dim() != 3 or x.shape[-1] != self.model_dim:
            raise ValueError(f"input has shape {tuple(x.shape)}, the layer expects [B, N, {self.model_dim}]")
        faults.maybe_fail(self.rank, "forward")
        if cache is not None:
            with torch.no_grad():
                return self._forward_cached(x, cache)
        seq = self.sequence_parallel and self.world > 1  # with one rank both styles are the same
        B, n, _ = x.shape
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            return self._forward_train(x, self.plan(B, n * self.world if seq else n, training=True))
        self._ask_peers(B, n, x.device, decode=False)
        plan = self.plan(B, n * self.world if seq else n)
        with torch.no_grad():
            return self._forward_sequence(x, plan) if seq else self._forward_heads(x, plan)

    def _forward_heads(self, x: torch.Tensor, plan: CommPlan) -> torch.Tensor:
        """Head-parallel: x [B, N, D] on every rank -> y [B, N, D] on every rank: copy -> QKV ->
        attention -> output projection -> sum (+ b_o). With overlap, query-row chunk c's collectives
        run while chunk c+1's attention (when the backend computes row chunks, as fused does) and
        output projection run."""
        B, N, D = x.shape
        h, d = self.local_heads, self.head_dim
        with section("qkv_proj"):
            qkv = mm(x.reshape(B * N, D), self.wqkv, self.dtype, self.bqkv)   # [B*N, (h+2g)*d]
            q, k, v = self._split_heads(qkv.view(B, N, -1, d))                # [B, h|g|g, N, d]
            q, k = self._rope(q, k, 0)
        o_rows = torch.empty(B, N, h, d, dtype=self.dtype, device=x.device)   # the output GEMM's rows
        o = o_rows.permute(0, 2, 1, 3)                                      # seen as [B, h, N, d]
        align = self.backend.row_chunks
        by_rows = len(plan.chunks) > 1 and align is not None and all(r0 % align == 0 for r0, _ in plan.chunks)
        if not by_rows:
            self._attention(q, k, v, o)
        total = OutputSum(self, plan, x.device)
        for r0, r1 in plan.chunks:
            if by_rows:
                self._attention(q, k, v, o, rows=(r0, r1))
            total.add_rows(r0, r1, o_rows[:, r0:r1].reshape(B * (r1 - r0), h * d))
        return total.result()

    def _forward_sequence(self, x: torch.Tensor, plan: CommPlan) -> torch.Tensor:
        """Sequence-parallel: x [B, N/W, D] per rank -> all-gather -> y [B, N/W, D], reduce-scatter.

        Rows travel as [K chunks, W ranks, B, m rows]: chunk c of every rank's block goes in one
        all-gather and comes back in one reduce-scatter; the relayout before attention puts row
        (w, c, i) at sequence position w*N/W + c*m + i."""
        B, n, D = x.shape
        W, K, h, g, d = self.world, self.overlap, self.local_heads, self.local_kv_heads, self.head_dim
        m = n // K
        comm = self.comm
        xs = x.view(B, K, m, D)
        gathered = torch.empty(K, W, B, m, D, dtype=self.dtype, device=x.device)
        sources = [xs[:, c].contiguous() for c in range(K)]  # (B > 1: each chunk's rows copied first)
        arrived = [comm.all_gather(gathered[c].view(W * B, m, D), sources[c], K)
                   for c in range(K)]  # all queued at once; chunk c's QKV GEMM waits for gather c only
        qkv = torch.empty(K, W, B, m, (h + 2 * g) * d, dtype=self.dtype, device=x.device)
        for c in range(K):
            comm.wait(arrived[c])
            with section("qkv_proj"):
                mm(gathered[c].view(W * B * m, D), self.wqkv, self.dtype, self.bqkv, out=qkv[c].view(W * B * m, -1))
        with section("qkv_proj"):  # rows (c, w, b, i) -> sequence position w*n + c*m + i (a view if K=B=1)
            q, k, v = self._split_heads(qkv.view(K, W, B, m, h + 2 * g, d).permute(2, 1, 0, 3, 4, 5)
                                        .reshape(B, W * n, h + 2 * g, d))
            q, k = self._rope(q, k, 0)
        o_rows = torch.empty(B, W, K, m, h * d, dtype=self.dtype, device=x.device)
        self._attention(q, k, v, o_rows.view(B, W * n, h, d).permute(0, 2, 1, 3))
        partial = torch.empty(K, W * B * m, D, dtype=self.part_dtype, device=x.device)
        y = torch.empty(K, B * m, D, dtype=self.part_dtype, device=x.device)
        for c in range(K):
            with section("out_proj"):  # rows (c, w, b, i): [W, B, m, h*d]
                mm(o_rows[:, :, c].transpose(0, 1).reshape(W * B * m, h * d), self.wo, self.part_dtype,
                   out=partial[c])
            comm.reduce_scatter(y[c], partial[c], K)
        comm.join(K)
        return add_bias(y.view(K, B, m, D).transpose(0, 1), self.bo,
                        out=torch.empty(B, K, m, D, dtype=self.dtype, device=x.device)).view(B, n, D)

    # ---- decoding: a KV cache of this rank's K/V heads (tpattn/decode.py) ----------------------------

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A KV cache for `batch` sequences of up to `max_len` positions: K and V of this rank's
        K/V heads, [B, g, max_len, d] each, on the layer's device and dtype."""
        if batch < 1 or max_len < 1:
            raise ConfigError(f"new_cache needs batch >= 1 and max_len >= 1 (got {batch}, {max_len})")
        shape = (batch, self.local_kv_heads, max_len, self.head_dim)
        dev = self.wqkv.device
        cos = sin = None
        if self.rope_theta is not None:  # the rotary angles of every position the cache can hold
            cos, sin = rope_tables(torch.arange(max_len, device=dev), self.head_dim, self.rope_theta)
        return KVCache(torch.zeros(shape, dtype=self.dtype, device=dev), torch.zeros(shape, dtype=self.dtype, device=dev),
                       owner=self._cache_owner(), layer_id=id(self), cos=cos, sin=sin)

    def _cache_owner(self) -> tuple:
        return (self.shard, self.head_dim, self.dtype)

    def _rope(self, q: torch.Tensor, k: torch.Tensor, start: int, cache: KVCache | None = None):
        """q and k rotated by their positions start, start + 1, ... (rope_theta; else as they are)."""
        if self.rope_theta is None:
            return q, k
        if cache is not None:
            cos, sin = cache.cos[start:start + q.shape[2]], cache.sin[start:start + q.shape[2]]
        else:
            cos, sin = rope_tables(torch.arange(start, start + q.shape[2], device=q.device), self.head_dim,
                                   self.rope_theta)
        return (apply_rope(q, cos, sin, self.rope_interleaved), apply_rope(k, cos, sin, self.rope_interleaved))

    def _forward_cached(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x [B, T, D] on every rank: QKV of its T rows, rotary positions from the cache's length,
        K and V appended, attention of the T queries over the whole cache (causal), the output
        projection and the plan's collective of B x T x D values."""
        if self.sequence_parallel and self.world > 1:
            raise ConfigError("a KV cache decodes head-parallel: build the layer without sequence_parallel to decode")
        if not self.causal:
            raise ConfigError("a KV cache decodes causally: build the layer with causal=True to decode")
        B, T, D = x.shape
        cache.check(id(self), self._cache_owner(), B, T)
        h, g, d = self.local_heads, self.local_kv_heads, self.head_dim
        L0 = cache.length
        self._ask_peers(B, T, x.device, decode=True)
        plan = self.plan(B, T, decode=True)
        with section("qkv_proj"):
            qkv = mm(x.reshape(B * T, D), self.wqkv, self.dtype, self.bqkv)
        if T == 1:  # a step: positions read from the cache's device copy (a CUDA graph of it serves every step)
            with section("cache_append"):  # rotary positions, q out, k and v in: one kernel on a GPU
                q = append_row(qkv.view(B, h + 2 * g, d), cache, h, self.rope_interleaved)
            with section("attention"):  # the split-K decode kernel on a GPU; else attend's math
                o = decode_attention(q, cache.k, cache.v, L0 + 1, pos=cache.pos, tickets=cache.tickets)
        else:
            q, k, v = (t.permute(0, 2, 1, 3) for t in qkv.view(B, T, h + 2 * g, d).split([h, g, g], dim=2))
            q, k = self._rope(q, k, L0, cache)
            with section("cache_append"):
                cache.k[:, :, L0:L0 + T] = k
                cache.v[:, :, L0:L0 + T] = v
            if L0 == 0:  # a prefill into an empty cache: the backend's causal attention over its rows
                o = torch.empty(B, T, h, d, dtype=self.dtype, device=x.device).permute(0, 2, 1, 3)
                self._attention(*((t if self.backend.strided else t.contiguous()) for t in (q, k, v)), o)
            else:
                with section("attention"):
                    o = decode_attention(q, cache.k, cache.v, L0 + T)
        cache.pos.add_(T)
        cache.length = L0 + T
        total = OutputSum(self, plan, x.device)
        total.add_rows(0, T, o.permute(0, 2, 1, 3).reshape(B * T, h * d))
        return total.result()

    # ---- the training step: the same math, differentiable ------------------------------------------

    def _forward_train(self, x: torch.Tensor, plan: CommPlan) -> torch.Tensor:
        """The forward under autograd: each collective is a pair of tpattn/comm.py whose backward is
        its dual, the GEMMs and the attention backend's own backward fill the parameters' gradients.

            head-parallel:   x ─ copy_to_ranks ─ QKV ─ attention ─ out proj ─ sum_from_ranks ─ + b_o
                             dX ◀ all-reduce        (backward)                  identity ◀ dy
            sequence:        x ─ gather_sequence ─ QKV ─ ... ─ out proj ─ scatter_sequence ─ + b_o
                             dX ◀ reduce-scatter    (backward)              all-gather ◀ dy

        The partials are summed as the plan's collective sums them in value (fp32 unless
        reduce_dtype='model', b_o added once, rounded once); the row chunks of overlap are not used
        here (overlap > 1 instead overlaps the all-reduce of dX with the weight-gradient GEMM)."""
        comm, seq = self.comm, plan.collective == "sequence"
        h, g, d = self.local_heads, self.local_kv_heads, self.head_dim
        xf = gather_sequence(x, comm) if seq else x
        B, N, D = xf.shape
        w, b = self._train_qkv()
        qkv = ColumnParallelQKV.apply(xf.reshape(B * N, D), w, b, comm, not seq, self.overlap > 1)
        q, k, v = (t.permute(0, 2, 1, 3) for t in qkv.view(B, N, h + 2 * g, d).split([h, g, g], dim=2))
        q, k = self._rope(q, k, 0)
        o = self.backend.attention(q, k, v, self.causal)
        part = linear(o.permute(0, 2, 1, 3).reshape(B * N, h * d), self.wo, None, self.part_dtype, "out_proj").view(B, N, D)
        y = scatter_sequence(part, comm) if seq else sum_from_ranks(part, comm)
        if self.bo is not None:  # sequence parallel: each rank adds b_o to its rows; its gradient sums them over the ranks
            y = y + (copy_to_ranks(self.bo, comm) if seq else self.bo).to(y.dtype)
        return y.to(self.dtype)

    def _train_qkv(self):
        """wqkv and bqkv as the training step uses them: where several ranks hold a K/V head as
        copies (GQA with more ranks than K/V heads), its K/V columns through sum_of_copies, so that
        each copy's gradient is the sum over every copy (the single-process gradient)."""
        w, b = self.wqkv, self.bqkv
        if self.world <= self.kv_heads:
            return w, b
        hd, slot, G = self.local_heads * self.head_dim, self.shard.kv_head_range.start, self.kv_heads
        w = torch.cat([w[:, :hd], sum_of_copies(w[:, hd:], self.comm, slot, G)], dim=1)
        if b is not None:
            b = torch.cat([b[:hd], sum_of_copies(b[hd:], self.comm, slot, G)])
        return w, b

    def train_nbytes(self, batch: int, seq_len: int) -> dict[str, int]:
        """Bytes of each collective a training step runs (forward and backward; the whole tensor)."""
        p = self.plan(batch, seq_len)
        if p.collective == "none":
            return {}
        dx = p.batch * p.seq_len * p.model_dim * self.dtype.itemsize  # dX, in the input's dtype
        if p.collective == "sequence":
            return {"allgather": p.x_bytes, "reducescatter": p.partial_bytes, "bwd_allgather": p.partial_bytes,
                    "bwd_reducescatter": dx}
        return {"allreduce": p.partial_bytes, "bwd_allreduce": dx}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """The whole gradients in from_full()'s layout (wq, wk, wv, wo, bq, bk, bv, bo; wk and wv with
        G K/V heads), assembled on every rank from every rank's slices (a collective: call it on
        every rank). K/V heads held by several ranks carry the sum of their copies' gradients."""
        d = self.head_dim
        dt = torch.promote_types(self.dtype, torch.float32)  # fp32 (fp64 for an fp64 layer)
        mine = {n: (p.grad.detach().to(dt).cpu() if p.grad is not None else None) for n, p in self.named_parameters()}
        everyone = self.comm.all_gather_object((self.shard, mine), label="gradgather")
        D, H, G = self.model_dim, self.heads, self.kv_heads
        z = (lambda *shape: torch.zeros(*shape, dtype=dt))  # noqa: E731
        out = {"wq": z(D, H * d), "wk": z(D, G * d), "wv": z(D, G * d), "wo": z(H * d, D), "bq": z(H * d),
               "bk": z(G * d), "bv": z(G * d), "bo": None}
        for shard, grads in everyone:
            hr, kr = shard.head_range, shard.kv_head_range
            cols = slice(hr.start * d, hr.stop * d)
            kcols = slice(kr.start * d, kr.stop * d)
            hl, gl = len(hr) * d, len(kr) * d
            if grads["wqkv"] is not None:
                out["wq"][:, cols] = grads["wqkv"][:, :hl]
                out["wk"][:, kcols] = grads["wqkv"][:, hl:hl + gl]
                out["wv"][:, kcols] = grads["wqkv"][:, hl + gl:]
            if grads.get("bqkv") is not None:
                out["bq"][cols] = grads["bqkv"][:hl]
                out["bk"][kcols] = grads["bqkv"][hl:hl + gl]
                out["bv"][kcols] = grads["bqkv"][hl + gl:]
            if grads["wo"] is not None:
                out["wo"][cols] = grads["wo"]
            if grads.get("bo") is not None:
                out["bo"] = grads["bo"]
        if self.bqkv is None:
            out["bq"] = out["bk"] = out["bv"] = None
        dev = self.wqkv.device
        return {k: None if t is None else t.to(dev) for k, t in out.items()}

    # ---- the local pieces, shared by both styles -----------------------------------------------

    def _split_heads(self, qkv: torch.Tensor):
        """q [B, h, N, d] and k, v [B, g, N, d] from the QKV GEMM's output [B, N, h + 2g, d]:
        strided views for a backend that reads them in place (fused), else contiguous copies."""
        h, g = self.local_heads, self.local_kv_heads
        q, k, v = (t.permute(0, 2, 1, 3) for t in qkv.split([h, g, g], dim=2))
        if self.backend.strided:
            return q, k, v
        return q.contiguous(), k.contiguous(), v.contiguous()

    def _attention(self, q, k, v, o, rows=None) -> None:
        """o = attention(q, k, v) for this rank's heads (a head_chunk at a time, with the K/V heads
        those query heads use), all query rows or rows (r0, r1) only. o may be a strided view; a
        backend that needs contiguous memory writes a contiguous copy that is then relaid into it."""
        h, gs = self.local_heads, self.local_group
        kw = {} if rows is None else {"rows": rows}
        strided = self.backend.strided
        for h0, h1 in head_chunks(h, gs, self.head_chunk):  # whole groups, or heads of one group
            sl, kv = slice(h0, h1), slice(h0 // gs, (h1 - 1) // gs + 1)
            whole = (h0, h1) == (0, h)
            qs, os_ = (t if whole else t[:, sl] for t in (q, o))
            ks, vs = (t if whole else t[:, kv] for t in (k, v))
            if strided:
                self.backend.forward(qs, ks, vs, self.causal, out=os_, **kw)
            else:
                os_.copy_(self.backend.forward(qs.contiguous(), ks.contiguous(), vs.contiguous(), self.causal, **kw))

    # ---- the peer paths' buffers -----------------------------------------------------------------

    def _ask_peers(self, batch: int, seq_len: int, device: torch.device, decode: bool) -> None:
        """output_collective="auto", on the GPU: before the first call whose partials auto would sum
        with the one-shot peer all-reduce (oneshot_candidate: the shape decides, the same on every
        rank), every rank makes its buffer and tries to map every other's (collective); if all of
        them can, auto uses it for every such call from then on, else NCCL's all-reduce, on every rank.
        Asked again after the layer moved to another device or dtype. Inside a CUDA graph capture
        that the layer did not warm up (graphed() does) nothing is asked: that call keeps NCCL."""
        kw = self._plan_kw(decode)
        del kw["elem"]
        key = (device, self.part_dtype, self.dtype)
        if (self._peers is not None and self._peers[0] == key) or device.type != "cuda" or not oneshot_candidate(
                batch, seq_len, self.model_dim, self.world, **kw) or torch.cuda.is_current_stream_capturing():
            return
        self._peers = (key, self._map_oneshot(ONESHOT_MAX_BYTES // self.part_dtype.itemsize, device,
                                              required=False) is not None)

    def _oneshot_buffers(self, plan: CommPlan, device: torch.device):
        """The one-shot all-reduce's buffers for this call: auto made them in _ask_peers; with
        output_collective="oneshot" they are made on the first call and again when a call needs more
        (refused once a CUDA graph captured them, as the p2p buffers are)."""
        need, p = plan.peer_elements, self._oneshot
        if p is not None and p.capacity >= need and (p.part_dtype, p.out_dtype, p.device) == \
                (self.part_dtype, self.dtype, device):
            return p
        return self._map_oneshot(max(need, ONESHOT_MAX_BYTES // self.part_dtype.itemsize), device, required=True)

    def _map_oneshot(self, capacity: int, device: torch.device, required: bool):
        """Make this rank's one-shot buffer, map every other rank's (two gathers over the group):
        the buffers when every rank mapped every other's; else None on every rank, or (required)
        the same one-line error on every rank."""
        from . import peer
        old = self._oneshot
        if old is not None and self._peer_pinned:
            raise ValueError(f"output_collective='{self.output_collective}': this call needs new one-shot buffers "
                             f"({capacity} elements of {self.part_dtype}) but a CUDA graph captured by graphed() "
                             "replays the current ones; capture the graph at the largest shape first, or build "
                             "another layer for this shape")
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(f"output_collective='{self.output_collective}': the first call maps the other ranks' "
                             "buffers and cannot run inside a CUDA graph capture; call the layer once before "
                             "capturing (layer.graphed() does)")
        if old is not None:
            old.close()  # this rank's mappings of the others' old buffers; its own stays allocated until every
            # rank has closed its mappings of it (they all have by the first gather below)
        self._oneshot = None
        buf = peer.OneShotBuffers(capacity, self.part_dtype, self.dtype, device, self.rank, self.world)
        why = buf.open(self.comm.all_gather_object(buf.exported))
        del old
        bad = next((w for w in self.comm.all_gather_object(why) if w), None)
        if bad:
            buf.close()
            if required:
                raise ValueError(f"output_collective='oneshot': {bad}; use 'auto' (NCCL where the ranks cannot map "
                                 "each other's memory)")
            return None
        self._oneshot = buf
        return buf

    def _peer_buffers(self, plan: CommPlan, device: torch.device):
        """output_collective="p2p": the symmetric buffers, made (collectively) on the first call and
        again when a call needs more, unless a CUDA graph captured the current ones (then the call
        is refused: the graph would read and write freed memory). Before the first, every rank says
        whether it can take part and on which host: all of them go on, or all of them raise the
        same one-line error. Every rank decides from the plan alone, so all decide alike."""
        need = plan.peer_elements
        p = self._peer
        if p is not None and p.capacity >= need and (p.part_dtype, p.out_dtype, p.device) == \
                (self.part_dtype, self.dtype, device):
            return p
        if self._peer_pinned:
            raise ValueError(f"output_collective='p2p': this call needs peer buffers of {need} elements but a CUDA "
                             f"graph captured by graphed() replays the current ones ({getattr(p, 'capacity', 0)}); capture the "
                             "graph at the largest shape first, or build another layer for this shape")
        from . import peer
        if not self._peer_checked:
            import socket
            said = self.comm.all_gather_object((socket.gethostname(), peer.unavailable(device, self.part_dtype,
                                                                                           self.dtype)))
            hosts = {host for host, _ in said}
            if len(hosts) > 1:
                raise ValueError(f"output_collective='p2p' needs every rank on one node (these span "
                                 f"{len(hosts)} hosts); use 'auto'")
            bad = [(r, w) for r, (_, w) in enumerate(said) if w]
            if bad:
                raise ValueError(f"output_collective='p2p': rank {bad[0][0]}: {bad[0][1]}; use 'auto'")
            self._peer_checked = True
        self._peer = None  # this rank's old buffers go (every rank drops its own here)
        with watch.collective("peersetup", self.world, False):  # collective: blocks until every rank came
            self._peer = peer.PeerBuffers(need, self.part_dtype, self.dtype, device, self.group.group_name,
                                          self.rank, self.world)
        return self._peer

    # ---- a CUDA graph of the whole layer -----------------------------------------------------

    def graphed(self, x: torch.Tensor, cache: KVCache | None = None):
        """Capture forward(x) (kernels, GEMMs and the collective) in one CUDA graph; returns a
        function that replays it on the same input buffer and returns the same output tensor.
        Copy new inputs into `x` in place before calling it. Each replay is one entry in the
        collective watch (tpattn/watch.py): a rank that stalls during a replay ends the job after
        --timeout like a stalled eager collective. With output_collective="p2p" the peer buffers
        are fixed from here on: a later call that needs larger ones is refused.
        With a cache: one decode step, x [B, 1, D]; each replay appends x's row at the cache's
        length (read on the device) and returns that step's output, until the cache is full (then
        the cache's one-line refusal). The cache is left as it was (capture runs no step)."""
        if cache is not None:
            if x.dim() != 3 or x.shape[1] != 1:
                raise ValueError(f"graphed(x, cache) captures a decode step: x must be [B, 1, D] (got {tuple(x.shape)})")
            why = graph_refusal(x.device, self.dtype, self.head_dim)
            if why:
                raise ConfigError(why)
            cache.check(id(self), self._cache_owner(), x.shape[0], 1)
            length = cache.length
        call = (lambda: self(x, cache=cache)) if cache is not None else (lambda: self(x))
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(current)
        try:
            with torch.no_grad():
                with torch.cuda.stream(side):
                    for _ in range(2 if cache is None else min(2, cache.max_len - length)):
                        call()  # compile and load every kernel, create NCCL's communicator
                current.wait_stream(side)
                torch.cuda.synchronize()
                if cache is not None:  # the warm-up steps wrote past the cache's length only: forget them
                    cache.length = length
                    cache.pos.fill_(length)
                graph = torch.cuda.CUDAGraph()
                # thread_local: the collective watchdog's thread polls CUDA events of earlier collectives; in
                # the default (global) mode such a query from any thread during the capture invalidates it
                # (seen once over NCCL: "operation failed due to a previous error during capture")
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    y = call()
        finally:
            if cache is not None:  # as it was: the capture ran the host side once, no kernel
                cache.length = length
                cache.pos.fill_(length)
        self._peer_pinned = self._peer is not None or self._oneshot is not None

        def replay() -> torch.Tensor:
            if cache is not None:
                cache.check(id(self), self._cache_owner(), x.shape[0], 1)
            with watch.collective("graph", self.world, True):  # a no-op unless the watch runs (the CLI's)
                graph.replay()
            if cache is not None:
                cache.length += 1
            return y
        replay.graph = graph
        return replay


def _describe(state: dict) -> str:
    return (f"rank {state.get('rank')} of {state.get('world')} ({state.get('heads')} heads, "
            f"{state.get('kv_heads')} K/V heads, head dim {state.get('head_dim')}, uneven {state.get('uneven')})")


def _resolve_group(group):
    """(group, rank, world): WORLD means the default group if torch.distributed is initialized."""
    if group == WORLD:
        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if group is None:
        return None, 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the group the layer was given; build the layer on "
                         "the ranks of that group only (or pass group=None for one process)")
    return group, rank, dist.get_world_size(group)
