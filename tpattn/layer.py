"""The tensor-parallel attention layer: the only module that calls a collective.

Two parallel styles, each one method read top to bottom (diagrams in README.md):

head-parallel (default), _forward_heads: one collective, or two
    x [B, N, D]            replicated on every rank
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

import re
from contextlib import nullcontext

import torch
import torch.distributed as dist

from . import faults, watch
from .attention import Backend, get_backend, head_chunks
from .config import OUTPUT_COLLECTIVES
from .sharding import check_kv_heads, head_range, kv_head_range, row_chunks, rows_split
from .timing import section
from .weights import slice_heads

WORLD = "world"  # group=WORLD: the default process group if one is initialized, else none
# The single-tensor all-gather and reduce-scatter (concatenated along dim 0): torch >= 2.13 names
# them *_single and deprecates the older names, which torch 2.11 (the GPU machines) still has only.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b (+ bias), accumulated in fp32 and rounded once to out_dtype. On a GPU an fp16/bf16
    product runs on tensor cores, also for an fp32 result (torch.mm's out_dtype); the bias rides in
    the GEMM's epilogue when the result has the inputs' dtype. On CPU through fp32."""
    if a.is_cuda and a.dtype == b.dtype:
        if out_dtype == a.dtype:
            if bias is not None:
                return torch.addmm(bias, a, b, out=out) if out is not None else torch.addmm(bias, a, b)
            return torch.mm(a, b, out=out) if out is not None else torch.mm(a, b)
        if out_dtype == torch.float32 and a.dtype in (torch.float16, torch.bfloat16) and bias is None:
            if out is None:
                return torch.mm(a, b, out_dtype=torch.float32)
            try:
                return torch.mm(a, b, out_dtype=torch.float32, out=out)
            except (TypeError, RuntimeError):  # a torch without the out= form of it
                return out.copy_(torch.mm(a, b, out_dtype=torch.float32))
    y = torch.mm(a.float(), b.float())
    if bias is not None:
        y += bias.float()
    y = y.to(out_dtype)
    return out.copy_(y) if out is not None else y


def _add_bias(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out = part (+ bias), cast to out's dtype, in one elementwise pass. An fp32 partial takes the
    model-dtype bias as it is (the add widens it inside the pass: the same sum as casting it first,
    without a cast kernel and its launch on every call)."""
    if bias is None:
        return out.copy_(part)
    widens = part.dtype == torch.float32 and bias.dtype in (torch.float16, torch.bfloat16)
    return torch.add(part, bias if widens or bias.dtype == part.dtype else bias.to(part.dtype), out=out)


class TensorParallelAttention(torch.nn.Module):
    """Multi-head attention whose heads are split over the ranks of `group`.

    Weights are this rank's slices in "x @ W" layout: wq/wk/wv [D, h*d], wo [h*d, D], biases
    bq/bk/bv [h*d] and bo [D] (b_o is added once, after the collective). Build it from full
    matrices with from_full(), from_multihead_attention() or from_linears().

    sequence_parallel: inputs and outputs are this rank's block of N/W rows (see the module doc).
    overlap: K > 1 pipelines the output projection (and in sequence parallel the all-gather) over K
    row chunks with the collectives on a side stream; 1 (default) runs each collective once.
    output_collective (head-parallel): "allreduce" sums the partials with one all-reduce; "split"
    with a reduce-scatter of the partials and an all-gather of the rounded output (the same y,
    fewer bytes when the partials are fp32); "auto" (default) splits when the partials are wider
    than the model dtype and every row chunk divides by the world size.
    kv_heads: G K/V heads in all (default heads: multi-head attention; fewer: grouped-query, 1:
    multi-query); wk and wv are then [D, g*d] for this rank's g K/V heads (kv_head_range: G/W of
    them when the world size W divides G, else the one its query heads use).
    uneven_heads: the world size need not divide the heads (nor, with K/V groups, the groups):
    rank r owns a contiguous block of ceil or floor of H/W heads (of G/W whole K/V groups), the
    first ranks the larger blocks (tpattn.sharding.head_range). Only the ranks' load differs: the
    partial outputs are [B, N, D] on every rank, so the collectives are unchanged.
    """

    def __init__(self, wq, wk, wv, wo, bq=None, bk=None, bv=None, bo=None, *, heads: int, head_dim: int,
                 backend: str | Backend = "reference", causal: bool = False, group=WORLD,
                 reduce_dtype: str = "fp32", head_chunk: int | None = None, sequence_parallel: bool = False,
                 overlap: int = 1, output_collective: str = "auto", kv_heads: int | None = None,
                 uneven_heads: bool = False):
        super().__init__()
        self.group, self.rank, self.world = _resolve_group(group)
        self.kv_heads = heads if kv_heads is None else kv_heads
        self.uneven_heads = uneven_heads
        err = check_kv_heads(heads, self.kv_heads, self.world, uneven_heads)
        if err:
            raise ValueError(err)
        self.heads, self.head_dim = heads, head_dim
        self.head_range = head_range(heads, self.world, self.rank, uneven_heads, self.kv_heads)
        self.local_heads = len(self.head_range)  # differs between ranks when uneven
        self.local_kv_heads = len(kv_head_range(heads, self.kv_heads, self.world, self.rank, uneven_heads))
        self.local_group = self.local_heads // self.local_kv_heads  # this rank's query heads per K/V head
        self.model_dim = wq.shape[0]
        hd, kvd = self.local_heads * head_dim, self.local_kv_heads * head_dim
        for name, t, shape in (("wq", wq, (self.model_dim, hd)), ("wk", wk, (self.model_dim, kvd)),
                               ("wv", wv, (self.model_dim, kvd)), ("wo", wo, (hd, self.model_dim))):
            if tuple(t.shape) != shape:
                kv = f" and {self.local_kv_heads} K/V heads" if self.kv_heads != heads else ""
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} for rank {self.rank} "
                                 f"of {self.world} ({self.local_heads} heads{kv} of dim {head_dim})")
        if reduce_dtype not in ("fp32", "model"):
            raise ValueError(f"reduce_dtype must be 'fp32' or 'model' (got {reduce_dtype!r})")
        if overlap < 1:
            raise ValueError(f"overlap must be at least 1 chunk (got {overlap})")
        if output_collective not in OUTPUT_COLLECTIVES:
            raise ValueError(f"output_collective must be one of {', '.join(OUTPUT_COLLECTIVES)} "
                             f"(got {output_collective!r})")
        if output_collective == "p2p" and (overlap > 1 or sequence_parallel):
            raise ValueError("output_collective='p2p' sums the head-parallel output in one pass: no overlap, "
                             "no sequence_parallel; use 'auto' with those")
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.causal = causal
        self.reduce_dtype = reduce_dtype
        self.head_chunk = head_chunk or self.local_heads
        self.sequence_parallel = sequence_parallel
        self.overlap = overlap
        self.dtype = wq.dtype
        self.part_dtype = torch.float32 if reduce_dtype == "fp32" else self.dtype
        self.output_collective = output_collective
        # Q, K and V columns packed once, so the projection is one GEMM (bias fused into it): its
        # output rows are [h query heads | g K heads | g V heads] x d.
        self.wqkv = torch.cat([wq, wk, wv], dim=1)
        biases = ((bq, hd), (bk, kvd), (bv, kvd))
        self.bqkv = None if all(b is None for b, _ in biases) else torch.cat(
            [torch.zeros(n, dtype=self.dtype, device=wq.device) if b is None else b for b, n in biases])
        self.wo, self.bo = wo, bo
        self._comm_stream = None  # made on the first overlapped forward on a GPU
        self._peer = None  # output_collective="p2p": tpattn.peer.PeerBuffers, made on the first forward
        self._nccl = self.group is not None and dist.get_backend(self.group) == "nccl"

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
        uneven = kw.get("uneven_heads", False)
        err = check_kv_heads(heads, kv_heads, world, uneven)
        if err:
            raise ValueError(err)
        full = {k: t for k, t in dict(wq=wq, wk=wk, wv=wv, wo=wo, bq=bq, bk=bk, bv=bv, bo=bo).items()
                if t is not None}
        mine = slice_heads(full, head_range(heads, world, rank, uneven, kv_heads), head_dim,
                           kv_head_range(heads, kv_heads, world, rank, uneven))
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

    # ---- what the collectives move ------------------------------------------------------------

    def partial_nbytes(self, batch: int, seq_len: int) -> int:
        """Bytes of the partial output that the all-reduce (or reduce-scatter) sums: [B, N, D]."""
        return batch * seq_len * self.model_dim * torch.empty((), dtype=self.part_dtype).element_size()

    def collective_nbytes(self, batch: int, seq_len: int) -> dict[str, int]:
        """Bytes of each collective one call runs (the whole tensor, nccl-tests' "size"):
        head-parallel the all-reduce of the partials; sequence-parallel the all-gather of x [B, N, D]
        and the reduce-scatter of the partials."""
        x_bytes = batch * seq_len * self.model_dim * torch.empty((), dtype=self.dtype).element_size()
        if self.sequence_parallel and self.world > 1:
            return {"allgather": x_bytes, "reducescatter": self.partial_nbytes(batch, seq_len)}
        if self.world > 1 and self.output_collective == "p2p":  # the partials in, the output out
            return {"peer": self.partial_nbytes(batch, seq_len) + x_bytes}
        if self.world > 1 and self.splits_output(batch, self._row_chunks(seq_len)):
            return {"reducescatter": self.partial_nbytes(batch, seq_len), "allgather": x_bytes}
        return {"allreduce": self.partial_nbytes(batch, seq_len)}

    def splits_output(self, batch: int, chunks: list[tuple[int, int]]) -> bool:
        """Head-parallel: whether the partials are summed by a reduce-scatter and an all-gather
        (see output_collective) rather than one all-reduce. The same answer on every rank: it
        depends on the shape and the settings only."""
        if self.world == 1 or self.output_collective in ("allreduce", "p2p"):
            return False
        divides = rows_split(batch, chunks, self.world)
        if self.output_collective == "split":
            if not divides:
                raise ValueError(f"output_collective='split' needs batch x rows of every chunk divisible by the "
                                 f"world size {self.world}; use 'allreduce' or 'auto'")
            return True
        return divides and self.part_dtype.itemsize > self.dtype.itemsize

    def shard_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's block of N/W rows of a full [B, N, D] tensor (sequence parallel's input)."""
        n = t.shape[1] // self.world
        return t[:, self.rank * n:(self.rank + 1) * n].contiguous()

    def gather_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """The full [B, N, D] from every rank's block (for checks: forward itself never needs it)."""
        if self.group is None or self.world == 1:
            return y
        B, n, D = y.shape
        parts = torch.empty((self.world * B, n, D), dtype=y.dtype, device=y.device)
        self._collective("allgather", None, _all_gather, parts, y.contiguous())
        self._join_comm()
        return parts.view(self.world, B, n, D).transpose(0, 1).reshape(B, self.world * n, D)

    # ---- forward -----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, timer=None) -> torch.Tensor:
        if x.shape[-1] != self.model_dim or x.dim() != 3:
            raise ValueError(f"input has shape {tuple(x.shape)}, the layer expects [B, N, {self.model_dim}]")
        faults.maybe_fail(self.rank, "forward")
        if self.sequence_parallel and self.world > 1:  # with one rank both styles are the same
            return self._forward_sequence(x, timer)
        return self._forward_heads(x, timer)

    def _forward_heads(self, x: torch.Tensor, timer) -> torch.Tensor:
        """Head-parallel: x [B, N, D] on every rank -> y [B, N, D] on every rank, one all-reduce
        (or a reduce-scatter and an all-gather, see splits_output). With overlap, query-row chunk
        c's collectives run while chunk c+1's attention (when the backend computes row chunks, as
        fused does) and output projection run."""
        B, N, D = x.shape
        h, d, W = self.local_heads, self.head_dim, self.world
        with section(timer, "qkv_proj"):
            qkv = _mm(x.reshape(B * N, D), self.wqkv, self.dtype, self.bqkv)   # [B*N, (h+2g)*d]
            q, k, v = self._split_heads(qkv.view(B, N, -1, d))                # [B, h|g|g, N, d]
        o_rows = torch.empty(B, N, h, d, dtype=self.dtype, device=x.device)   # the output GEMM's rows
        o = o_rows.permute(0, 2, 1, 3)                                      # seen as [B, h, N, d]
        chunks = self._row_chunks(N)
        by_rows = len(chunks) > 1 and self.backend.row_chunks is not None
        split = self.splits_output(B, chunks)  # decided before communicating, from the shape only
        y = torch.empty(B, N, D, dtype=self.dtype, device=x.device)
        if not by_rows:
            self._attention(q, k, v, o, timer)
        if W == 1 and not faults.planned(self.rank, "allreduce"):
            # one rank: nothing to sum, so the output GEMM rounds straight to the model dtype with
            # b_o in its epilogue (fp32 accumulation, one rounding, as the fp32 partial path)
            for r0, r1 in chunks:
                if by_rows:
                    self._attention(q, k, v, o, timer, rows=(r0, r1))
                dst = y[:, r0:r1]
                with section(timer, "out_proj"):
                    out = _mm(o_rows[:, r0:r1].reshape(B * (r1 - r0), h * d), self.wo, self.dtype, self.bo,
                              out=dst.view(-1, D) if dst.is_contiguous() else None)
                if not dst.is_contiguous():
                    dst.copy_(out.view(dst.shape))
            return y
        late = []  # (gathered rows, where they go in y) to copy once the collectives are joined
        parts = []
        # p2p: one chunk (no overlap), its partial in the symmetric buffers the peer kernel reads
        peer = self._peer_buffers(B * N * D, x.device) if self.output_collective == "p2p" and W > 1 else None
        for r0, r1 in chunks:
            if by_rows:
                self._attention(q, k, v, o, timer, rows=(r0, r1))
            rows = B * (r1 - r0)
            part = peer.partial(rows, D) if peer else torch.empty(rows, D, dtype=self.part_dtype, device=x.device)
            with section(timer, "out_proj"):
                _mm(o_rows[:, r0:r1].reshape(rows, h * d), self.wo, self.part_dtype, out=part)
            if peer:  # reduce-scatter + all-gather in one kernel over NVLink (one chunk: no overlap)
                self._output_collective("peer", timer, peer.reduce_gather, y.view(rows, D), self.bo)
                continue
            if not split:
                self._output_collective("allreduce", timer, dist.all_reduce, part)
                parts.append(part)
                continue
            mine = torch.empty(rows // W, D, dtype=self.part_dtype, device=x.device)
            if not self._output_collective("reducescatter", timer, _reduce_scatter, mine, part):
                continue  # a fault left this rank's collectives out (both of them)
            dst = y[:, r0:r1]
            whole = dst.is_contiguous()
            gathered = dst.view(rows, D) if whole else torch.empty(rows, D, dtype=self.dtype, device=x.device)
            m = rows // W
            mine_out = gathered[self.rank * m:(self.rank + 1) * m]  # this rank's rows of y: the all-gather is in place
            with self._comm_context():  # where the reduce-scatter ran: + b_o, rounded once
                _add_bias(mine, self.bo, out=mine_out)
            self._collective("allgather", timer, _all_gather, gathered, mine_out)
            parts += [part, mine]  # referenced until the join below
            if not whole:
                late.append((gathered, dst))
        self._join_comm()
        if not split:  # + b_o and the cast to the model dtype in one pass
            for (r0, r1), part in zip(chunks, parts):
                _add_bias(part.view(B, r1 - r0, D), self.bo, out=y[:, r0:r1])
        for gathered, dst in late:
            dst.copy_(gathered.view(dst.shape))
        return y

    def _forward_sequence(self, x: torch.Tensor, timer) -> torch.Tensor:
        """Sequence-parallel: x [B, N/W, D] per rank -> all-gather -> y [B, N/W, D], reduce-scatter.

        Rows travel as [K chunks, W ranks, B, m rows]: chunk c of every rank's block goes in one
        all-gather and comes back in one reduce-scatter; the relayout before attention puts row
        (w, c, i) at sequence position w*N/W + c*m + i."""
        B, n, D = x.shape
        W, K, h, g, d = self.world, self.overlap, self.local_heads, self.local_kv_heads, self.head_dim
        m = n // K
        xs = x.view(B, K, m, D)
        gathered = torch.empty(K, W, B, m, D, dtype=self.dtype, device=x.device)
        # (B > 1: each chunk's rows are copied first; the copies live until _join_comm below, so the
        # allocator cannot hand their memory to the compute stream while a gather still reads it)
        sources = [xs[:, c].contiguous() for c in range(K)]
        arrived = [self._collective("allgather", timer, _all_gather, gathered[c].view(W * B, m, D), sources[c])
                   for c in range(K)]  # all queued at once; chunk c's QKV GEMM waits for gather c only
        qkv = torch.empty(K, W, B, m, (h + 2 * g) * d, dtype=self.dtype, device=x.device)
        for c in range(K):
            self._wait(arrived[c])
            with section(timer, "qkv_proj"):
                _mm(gathered[c].view(W * B * m, D), self.wqkv, self.dtype, self.bqkv, out=qkv[c].view(W * B * m, -1))
        with section(timer, "qkv_proj"):  # rows (c, w, b, i) -> sequence position w*n + c*m + i (a view if K=B=1)
            q, k, v = self._split_heads(qkv.view(K, W, B, m, h + 2 * g, d).permute(2, 1, 0, 3, 4, 5)
                                        .reshape(B, W * n, h + 2 * g, d))
        o_rows = torch.empty(B, W, K, m, h * d, dtype=self.dtype, device=x.device)
        self._attention(q, k, v, o_rows.view(B, W * n, h, d).permute(0, 2, 1, 3), timer)
        partial = torch.empty(K, W * B * m, D, dtype=self.part_dtype, device=x.device)
        y = torch.empty(K, B * m, D, dtype=self.part_dtype, device=x.device)
        for c in range(K):
            with section(timer, "out_proj"):  # rows (c, w, b, i): [W, B, m, h*d]
                _mm(o_rows[:, :, c].transpose(0, 1).reshape(W * B * m, h * d), self.wo, self.part_dtype,
                    out=partial[c])
            self._output_collective("reducescatter", timer, _reduce_scatter, y[c], partial[c])
        self._join_comm()
        return _add_bias(y.view(K, B, m, D).transpose(0, 1), self.bo,
                         out=torch.empty(B, K, m, D, dtype=self.dtype, device=x.device)).view(B, n, D)

    # ---- the local pieces, shared by both styles -----------------------------------------------

    def _split_heads(self, qkv: torch.Tensor):
        """q [B, h, N, d] and k, v [B, g, N, d] from the QKV GEMM's output [B, N, h + 2g, d]:
        strided views for a backend that reads them in place (fused), else contiguous copies."""
        h, g = self.local_heads, self.local_kv_heads
        q, k, v = (t.permute(0, 2, 1, 3) for t in qkv.split([h, g, g], dim=2))
        if self.backend.strided:
            return q, k, v
        return q.contiguous(), k.contiguous(), v.contiguous()

    def _attention(self, q, k, v, o, timer, rows=None) -> None:
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
                self.backend.forward(qs, ks, vs, self.causal, timer, out=os_, **kw)
            else:
                os_.copy_(self.backend.forward(qs.contiguous(), ks.contiguous(), vs.contiguous(), self.causal,
                                               timer, **kw))

    def _row_chunks(self, n: int) -> list[tuple[int, int]]:
        """overlap chunks of the query rows [0, n), at multiples of the backend's row_chunks."""
        return row_chunks(n, self.overlap, self.backend.row_chunks or 1)

    # ---- the collectives ---------------------------------------------------------------------

    def _output_collective(self, name: str, timer, op, *tensors) -> bool:
        """The collective that sums the partial outputs (fault injection step "allreduce"); False
        when an injected fault left it out."""
        if faults.maybe_fail(self.rank, "allreduce") == "skip":
            return False
        self._collective(name, timer, op, *tensors)
        return True

    def _collective(self, name: str, timer, op, *tensors):
        """op(*tensors, group) after the work queued so far: on the communication stream when
        overlapping on a GPU (returns an event that marks its end), else in line (returns None).
        Without a process group, or in a group of one, the local equivalent: an all-reduce or a
        reduce-scatter leaves its input as it is, an all-gather copies it."""
        if self.group is None or self.world == 1:
            if op is _all_gather or op is _reduce_scatter:
                tensors[0].copy_(tensors[1].view(tensors[0].shape))
            return None
        # Ordering: the side stream first waits for everything queued on the compute stream (the
        # inputs exist), and the compute stream reads an output only after _wait(its event) or
        # _join_comm(). Every tensor a collective touches stays referenced by forward() until then.
        stream = self._side_stream()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with (torch.cuda.stream(stream) if stream is not None else nullcontext()), section(timer, name), \
                watch.collective(name, self.world, self._nccl):
            try:
                op(*tensors, group=self.group)
            except RuntimeError as exc:
                raise CollectiveError(watch.explain(name, self.world, _first_line(exc))) from None
        return stream.record_event() if stream is not None else None

    def _comm_context(self):
        """Run the enclosed work where the collectives run (the side stream when overlapping)."""
        stream = self._side_stream()
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def _side_stream(self):
        if self.overlap == 1 or not self.wqkv.is_cuda:
            return None
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream(device=self.wqkv.device)
        return self._comm_stream

    @staticmethod
    def _wait(event) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def _join_comm(self) -> None:
        """The compute stream waits for every collective issued so far."""
        if self._comm_stream is not None and self.overlap > 1:
            torch.cuda.current_stream().wait_stream(self._comm_stream)

    def _peer_buffers(self, elements: int, device: torch.device):
        """output_collective="p2p": the symmetric buffers, made (collectively) on the first call and
        again when a call needs more. Before the first, every rank says whether it can take part
        and on which host: all of them go on, or all of them raise the same one-line error. Both
        block the host until every rank has come, so the watch times them by the clock."""
        if self._peer is not None and self._peer.capacity >= elements:
            return self._peer
        from . import peer
        with watch.collective("peersetup", self.world, False):
            if self._peer is None:
                import socket
                why = peer.unavailable(device, self.part_dtype, self.dtype)
                said = [None] * self.world
                dist.all_gather_object(said, (socket.gethostname(), why), group=self.group)
                hosts = {host for host, _ in said}
                if len(hosts) > 1:
                    raise ValueError(f"output_collective='p2p' needs every rank on one node (these span "
                                     f"{len(hosts)} hosts); use 'auto'")
                bad = [(r, w) for r, (_, w) in enumerate(said) if w]
                if bad:
                    raise ValueError(f"output_collective='p2p': rank {bad[0][0]}: {bad[0][1]}; use 'auto'")
            self._peer = None  # this rank's old buffers go (every rank drops its own here)
            self._peer = peer.PeerBuffers(elements, self.part_dtype, self.dtype, device, self.group.group_name,
                                          self.rank, self.world)
        return self._peer

    # ---- a CUDA graph of the whole layer -----------------------------------------------------

    def graphed(self, x: torch.Tensor):
        """Capture forward(x) (kernels, GEMMs and the collective) in one CUDA graph; returns a
        function that replays it on the same input buffer and returns the same output tensor.
        Copy new inputs into `x` in place before calling it."""
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):  # compile and load every kernel, create NCCL's communicator
                self(x)
        current.wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the collective watchdog's thread polls CUDA events of earlier collectives; in
        # the default (global) mode such a query from any thread during the capture invalidates it
        # (seen once over NCCL: "operation failed due to a previous error during capture")
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            y = self(x)

        def replay() -> torch.Tensor:
            graph.replay()
            return y
        replay.graph = graph
        return replay


class CollectiveError(RuntimeError):
    pass


def _first_line(exc: BaseException) -> str:
    """The useful part of a backend's error: no source paths, one line, bounded."""
    msg = re.sub(r"\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", str(exc)).strip().splitlines()
    first = msg[0].split(". ")[0] if msg else type(exc).__name__
    return first[:160]


def _resolve_group(group):
    """(group, rank, world): WORLD means the default group if torch.distributed is initialized."""
    if group == WORLD:
        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if group is None:
        return None, 0, 1
    return group, dist.get_rank(group), dist.get_world_size(group)
