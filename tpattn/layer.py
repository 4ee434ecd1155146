"""The tensor-parallel attention layer. It communicates only through tpattn/comm.py (the collectives
as forward/backward pairs), in the order the plan (tpattn/commplan.py, decided from the shape and
the settings before any rank communicates) says. One forward serves inference and training: the
same GEMMs, partial precision and collective, each step an autograd pair whose backward is its
dual (docs/parallel.md has the diagrams).

head-parallel, _forward_heads: one collective, or two
    x [B, N, D]            replicated on every rank (copy_to_ranks: the identity; its dual sums dX)
    QKV GEMM               one GEMM with this rank's packed q, k, v columns (query heads [r*h, (r+1)*h)
                           and the K/V heads they use; with uneven_heads a block of ceil or floor of
                           H/W heads, see tpattn.sharding.head_range)
    local attention        a backend from tpattn.attention (naive CUDA, fused, reference, ...)
    output GEMM + sum      this rank's rows of W_o, fp32 partials for reduce_dtype="fp32", summed by the
                           plan's collective (all-reduce; the split: reduce-scatter, + b_o, round,
                           all-gather; the peer kernels), b_o added once: tpattn/outputsum.py
    y [B, N, D]            identical on every rank

sequence-parallel, _forward_sequence: two collectives
    x [B, N/W, D]          this rank's block of the sequence
    all_gather + QKV GEMM  chunk by chunk (overlap); its dual reduce-scatters dX
    attention, output GEMM as above
    reduce_scatter(SUM)    each rank keeps the sum of its own block of rows; its dual all-gathers dy
    y [B, N/W, D]          this rank's block of the output

K/V heads (grouped-query attention, kv_heads G < H): query head q uses K/V head q // (H/G). Over W
ranks the K/V columns are split when W divides G and replicated when W is a multiple of G (a K/V
head's copies then sum their gradients: sum_of_copies); tpattn.sharding.check_kv_heads refuses the
rest. A rank's attention needs no other rank's K or V either way.

What the layer is (heads, shard, backend, style, collectives, dtype rules) is fixed when it is
built: assigning a setting raises, replace(**changes) builds another layer with the same weights.
"""

from __future__ import annotations

import math
import numbers

import torch

from . import convert, decode, faults, paged
from .attention import Backend, get_backend, head_chunks, register
from .comm import copy_to_ranks, sum_of_copies
from .commplan import CommPlan, check_style
from .errors import ConfigError, check_counts, check_flags
from .module import WORLD, LayerModule, make_comms, resolve_group
from .ops import mm
from .outputsum import head_parallel_out, sequence_parallel_out, sequence_parallel_qkv
from .peer import PeerLinks
from .planning import LayerPlan
from .sharding import Shard, check_context
from .timing import section

REDUCE_DTYPES = ("fp32", "model")


class TensorParallelAttention(LayerPlan, LayerModule):
    """Multi-head attention whose heads are split over the ranks of `group`.

    Parameters (this rank's slices, "x @ W" layout): wqkv [D, (h + 2g)*d], the Q, K and V columns of
    this rank's h query heads and g K/V heads packed for one GEMM (views: .wq, .wk, .wv), wo [h*d, D]
    (this rank's rows of W_o), bo [D] (added once, after the sum) and the Q/K/V biases: bqkv
    [(h + 2g)*d] when all three exist, else those that exist as bq, bk, bv (a bias the source did not
    have is not a parameter). state_dict() also records the shard: loading another shard is refused.
    Build it from full matrices with from_full(), from_linears(), from_multihead_attention() or
    from_hf_llama(); full_weights() gives them back.

    sequence_parallel: inputs and outputs are this rank's block of N/W rows. overlap: K > 1 pipelines
    the output projection (and in sequence parallel the all-gather) over K row chunks with the
    collectives on a side stream. output_collective (head-parallel): "allreduce", "split" (reduce-
    scatter + all-gather of the rounded rows), "p2p" (one kernel over NVLink), "oneshot" (one kernel
    for small sums) or "auto" (tpattn.commplan.make_plan holds the rule: plan()). kv_heads: G K/V
    heads (grouped-query). uneven_heads: the world size need not divide the heads. rope_theta:
    rotary positions (rope_interleaved: Meta's pair layout). head_chunk: query heads per attention
    call (memory of the materializing backends). deterministic: the attention backward gives the same
    bits every run (the fused backend's seven-product kernels instead of its faster five-product one,
    whose dQ sums arrive in any order; docs/backward.md).

    Training: under autograd (grad enabled, and x or a parameter requiring it) the same forward is
    differentiable: y.backward(dy) fills x.grad (head-parallel: the whole dX on every rank; sequence
    parallel: this rank's block) and each parameter's .grad with this rank's slice of the
    single-process gradient; full_grads() assembles the whole gradients on every rank.
    """

    def __init__(self, wq, wk, wv, wo, bq=None, bk=None, bv=None, bo=None, *, heads: int, head_dim: int,
                 backend: str | Backend = "reference", causal: bool = False, group=WORLD,
                 reduce_dtype: str = "fp32", head_chunk: int | None = None, sequence_parallel: bool = False,
                 overlap: int = 1, output_collective: str = "auto", kv_heads: int | None = None,
                 uneven_heads: bool = False, rope_theta: float | None = None, rope_interleaved: bool = False,
                 deterministic: bool = False, context_parallel: int = 1):
        super().__init__()
        self.group, rank, world = resolve_group(group)
        try:  # this rank's checks and slices; what fails here fails on every rank (_agree_build)
            self._build(wq, wk, wv, wo, bq, bk, bv, bo, heads, head_dim, backend, causal, reduce_dtype, head_chunk,
                        sequence_parallel, overlap, output_collective, kv_heads, uneven_heads, rope_theta,
                        rope_interleaved, deterministic, context_parallel, rank, world)
            error = None
        except Exception as exc:  # noqa: BLE001 - re-raised here, and said on the other ranks
            error = exc
        self._agree_build(error)
        self.comm, self.ring = make_comms(self.group, self.shard, self.context_parallel)
        self.peers = PeerLinks(self.comm, output_collective)
        self._plans: dict[tuple, CommPlan] = {}
        self._built = True

    def _build(self, wq, wk, wv, wo, bq, bk, bv, bo, heads, head_dim, backend, causal, reduce_dtype, head_chunk,
               sequence_parallel, overlap, output_collective, kv_heads, uneven_heads, rope_theta, rope_interleaved,
               deterministic, context_parallel, rank: int, world: int) -> None:
        """The constructor's checks and this rank's state, before the ranks agree (rank and world: this
        process in the layer's group)."""
        check_counts(heads=heads, head_dim=head_dim, kv_heads=kv_heads, head_chunk=head_chunk)
        check_flags(causal=causal, sequence_parallel=sequence_parallel, uneven_heads=uneven_heads,
                    rope_interleaved=rope_interleaved, deterministic=deterministic)
        if rope_theta is not None and (not isinstance(rope_theta, numbers.Real) or isinstance(rope_theta, bool)):
            raise TypeError(f"rope_theta must be a number or None (got {rope_theta!r})")
        if not isinstance(backend, (str, Backend)) and not callable(getattr(backend, "forward", None)):
            raise TypeError(f"backend must be a name ('reference', 'naive', 'tiled', 'fused', 'triton'; FP8 forwards "
                            f"'fp8', 'fp8_triton', 'fp8_fused') or a Backend "
                            f"instance (got {type(backend).__name__})")
        self.context_parallel = check_context(context_parallel, world, sequence_parallel, output_collective, overlap)
        rank, world = rank // self.context_parallel, world // self.context_parallel  # the heads' ranks
        self.shard = Shard.of(heads, heads if kv_heads is None else kv_heads, world, rank, uneven_heads)
        self.heads, self.head_dim = heads, head_dim
        given = {n: t for n, t in dict(wq=wq, wk=wk, wv=wv, wo=wo, bq=bq, bk=bk, bv=bv, bo=bo).items()
                 if t is not None}
        kinds = {(t.dtype, t.device) for t in given.values()}
        if len(kinds) > 1:
            say = ", ".join(f"{n} {str(t.dtype).replace('torch.', '')} on {t.device}" for n, t in given.items())
            raise ValueError(f"the weights differ in dtype or device ({say}); give them one dtype and device "
                             "(.to(dtype, device) each)")
        model_dim = wq.shape[0]
        hd, kvd = self.local_heads * head_dim, self.local_kv_heads * head_dim
        for name, t, shape in (("wq", wq, (model_dim, hd)), ("wk", wk, (model_dim, kvd)), ("wv", wv, (model_dim, kvd)),
                               ("wo", wo, (hd, model_dim)), ("bq", bq, (hd,)), ("bk", bk, (kvd,)), ("bv", bv, (kvd,)),
                               ("bo", bo, (model_dim,))):
            if t is not None and tuple(t.shape) != shape:
                kv = f" and {self.local_kv_heads} K/V heads" if self.kv_heads != heads else ""
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} for rank {self.rank} "
                                 f"of {self.world} ({self.local_heads} heads{kv} of dim {head_dim})")
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be 'fp32' or 'model' (got {reduce_dtype!r})")
        check_style(None, world, sequence_parallel, output_collective, overlap)  # what the CLI refuses, in the API's words
        if rope_theta is not None and (not math.isfinite(rope_theta) or rope_theta <= 0 or head_dim % 2):
            raise ValueError(f"rope_theta={rope_theta} with head_dim={head_dim}: rotary positions need a positive, "
                             "finite theta and an even head dim")
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        why = self.backend.head_dim_error(head_dim) if callable(getattr(self.backend, "head_dim_error", None)) else None
        if why:  # at construction, not at the first call (the CLI's line, in the API's names)
            raise ConfigError(why)
        if self.context_parallel > 1 and str(getattr(self.backend, "name", "")).startswith("fp8"):
            raise ConfigError(f"context_parallel={self.context_parallel} with an FP8 backend: the ring merges 16-bit "
                              "pieces with their logsumexp (FP8 attention would run as 16-bit torch math); use a "
                              "16-bit backend ('fused', 'triton' or 'reference')")
        register(self.backend)  # a backend given as an instance: where the custom ops find it by its name
        self.causal, self.reduce_dtype = bool(causal), reduce_dtype
        self.head_chunk = head_chunk or self.local_heads
        self.sequence_parallel, self.overlap, self.output_collective = bool(sequence_parallel), overlap, output_collective
        self.rope_theta, self.rope_interleaved, self.deterministic = rope_theta, bool(rope_interleaved), bool(deterministic)
        # Q, K and V columns packed once, so the projection is one GEMM (bias fused into it). Copies:
        # training this layer never writes into the caller's tensors.
        param = (lambda t: None if t is None else torch.nn.Parameter(t.detach().clone()))  # noqa: E731
        self.wqkv = torch.nn.Parameter(torch.cat([wq, wk, wv], dim=1).detach())
        present = [b is not None for b in (bq, bk, bv)]
        self.bqkv = torch.nn.Parameter(torch.cat([bq, bk, bv]).detach()) if all(present) else None
        self.biases = torch.nn.ParameterDict({n: param(b) for n, b in (("bq", bq), ("bk", bk), ("bv", bv))
                                              if b is not None and not all(present)})
        self.wo, self.bo = param(wo), param(bo)

    def _agree_build(self, error: Exception | None) -> None:
        """Every rank of the group built the same layer (its heads, shape, dtype, styles and biases), or
        the same refusal on every rank (comm.agree_build): a layer built differently on one rank would
        run other collectives than the rest (a hang) or sum mismatched partials (a wrong output,
        silently), and a rank whose own checks failed would leave the others waiting. Raises this rank's
        error, or the first failing rank's."""
        from .comm import agree_build
        mine = None if error is not None else {
            "heads": self.heads, "head_dim": self.head_dim, "kv_heads": self.kv_heads, "model_dim": self.model_dim,
            "dtype": str(self.dtype).replace("torch.", ""), "device": self.wqkv.device.type,
            "backend": self.backend.name, "causal": self.causal, "reduce_dtype": self.reduce_dtype,
            "sequence_parallel": self.sequence_parallel, "overlap": self.overlap,
            "output_collective": self.output_collective, "uneven_heads": self.uneven_heads,
            "rope_theta": self.rope_theta, "rope_interleaved": self.rope_interleaved,
            "deterministic": self.deterministic, "context_parallel": self.context_parallel,
            "biases": tuple(n for n in ("bq", "bk", "bv", "bo") if convert.local_slices(self)[n] is not None)}
        agree_build(self.group, mine, error)

    # ---- the shard: what this rank holds ---------------------------------------------------------

    rank = property(lambda self: self.shard.rank)
    world = property(lambda self: self.shard.world)
    kv_heads = property(lambda self: self.shard.kv_heads)
    uneven_heads = property(lambda self: self.shard.uneven)
    head_range = property(lambda self: self.shard.head_range)
    local_heads = property(lambda self: len(self.shard.head_range))       # differs between ranks when uneven
    local_kv_heads = property(lambda self: len(self.shard.kv_head_range))
    local_group = property(lambda self: self.local_heads // self.local_kv_heads)  # query heads per K/V head
    kv_copies = property(lambda self: max(1, self.world // self.kv_heads))  # ranks holding each K/V head
    model_dim = property(lambda self: self.wqkv.shape[0])
    dtype = property(lambda self: self.wqkv.dtype)  # follows .to() / .half()
    part_dtype = property(lambda self: torch.promote_types(self.dtype, torch.float32) if self.reduce_dtype == "fp32"
                          else self.dtype)  # fp32 partials (fp64 for an fp64 layer), or the model dtype
    wq = property(lambda self: convert.local_slices(self)["wq"])
    wk = property(lambda self: convert.local_slices(self)["wk"])
    wv = property(lambda self: convert.local_slices(self)["wv"])

    def shard_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's block of N/W rows of a full [B, N, D] tensor (sequence parallel's input).
        N must divide by the world size (the same refusal as the CLI's)."""
        check_style(t.shape[1], self.world, True, "auto", 1)
        n = t.shape[1] // self.world
        return t[:, self.rank * n:(self.rank + 1) * n].contiguous()

    def gather_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """The full [B, N, D] from every rank's block (a collective), differentiable: its backward
        hands each rank its block of the gradient (the dual of the all-gather: a reduce-scatter)."""
        from .comm import gather_sequence
        if self.group is None or self.world == 1:
            return y
        return gather_sequence(y, self.comm)

    # ---- forward -----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, cache: decode.KVCache | paged.PagedView | None = None) -> torch.Tensor:
        """y = attention(x) over the ranks, differentiable under autograd. With a cache (new_cache):
        x's rows are appended to it and attend causally over everything in it (a prefill, or a
        decode step of one row; inference only: tpattn/decode.py). With a paged cache's step view
        (tpattn.paged.PagedKV): packed rows of sequences of their own lengths. Time its passes with
        `with tpattn.timing.recording(timer):`."""
        self._check_input(x)
        faults.maybe_fail(self.rank, "forward")
        grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))
        if cache is not None:
            if self.ring is not None:
                raise ConfigError("a KV cache decodes head-parallel; context parallelism is for training and prefill: "
                                  "decode with a head-parallel layer built from this one's weights "
                                  "(TensorParallelAttention.from_full(**layer.full_weights(), heads=..., causal=True))")
            if isinstance(cache, paged.PagedStep):
                raise ConfigError("cache= takes one layer's view of a paged step: pass step.view(i) (i: this layer's "
                                  "index in the pool's layers), not the step")
            if not isinstance(cache, (decode.KVCache, paged.PagedView)):
                raise TypeError(f"cache must be a KVCache (layer.new_cache(batch, max_len)) or a paged step's view "
                                f"(pool.step(ids, rows).view(i)); got {type(cache).__name__}")
            if grad:
                raise ConfigError("a KV cache call records no gradients: run it under torch.no_grad() (or "
                                  "torch.inference_mode()), or call the layer without cache= to train")
            with torch.no_grad():
                if isinstance(cache, paged.PagedView):  # a step of a paged cache (tpattn/paged.py)
                    return paged.forward_paged(self, x, cache)
                return decode.forward_cached(self, x, cache)
        if self.ring is not None:
            return self._forward_context(x, grad)
        seq = self.sequence_parallel and self.world > 1  # with one rank both styles are the same
        B, n, _ = x.shape
        N = n * self.world if seq else n
        self._ask_peers(B, N, x.device, decode=False)
        plan = self.plan(B, N)
        return self._forward_sequence(x, plan, grad) if seq else self._forward_heads(x, plan, grad)

    def _check_input(self, x) -> None:
        """One line naming the argument and the fix, for an input the layer would otherwise cast,
        misread or fail on deep inside."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor [B, N, {self.model_dim}] (got {type(x).__name__})")
        if x.dim() != 3 or x.shape[-1] != self.model_dim:
            raise ValueError(f"input has shape {tuple(x.shape)}, the layer expects [B, N, {self.model_dim}]")
        if x.shape[1] == 0 or x.shape[0] == 0:
            raise ValueError(f"x has no rows (shape {tuple(x.shape)}): pass at least one sequence of one position")
        dev = self.wqkv.device
        if x.device.type == "meta":
            raise ValueError(f"x is on the meta device, which holds no values: pass a tensor on {dev}, where the "
                             "layer's weights are")
        if x.device != dev:
            raise ValueError(f"x is on {x.device} but the layer's weights are on {dev}: move one of them "
                             f"(x.to('{dev}') or layer.to('{x.device}'))")
        if x.dtype != self.dtype:
            dt = str(self.dtype).replace("torch.", "")
            raise ValueError(f"x is {str(x.dtype).replace('torch.', '')} but the layer is {dt}: cast x "
                             f"(x.to(torch.{dt})) or the layer (layer.to(x.dtype))")

    def _forward_heads(self, x: torch.Tensor, plan: CommPlan, grad: bool) -> torch.Tensor:
        """Head-parallel: x [B, N, D] on every rank -> y [B, N, D] on every rank: copy -> QKV ->
        attention -> output projection and sum (+ b_o). Without autograd and with overlap, query-row
        chunk c's collectives run while chunk c+1's attention (a backend that computes row chunks,
        as fused does) and output projection run."""
        B, N, D = x.shape
        h, d = self.local_heads, self.head_dim
        x2d = x.reshape(B * N, D)
        if grad:  # copy_to_ranks's dual (the dX all-reduce) is in the QKV GEMM's backward
            w, b = self._qkv_weights()
            qkv = copy_to_ranks(x2d, w, b, self.comm, self.overlap > 1)
        else:
            with section("qkv_proj"):
                qkv = mm(x2d, self.wqkv, self.dtype, self._qkv_bias())
        # training without rotary positions, all heads at once: attention of the QKV GEMM's output as it
        # is, its gradient written whole in the same layout (attention_packed: no concatenation of dq,
        # dk and dv), o in the rows the output GEMM reads (no copy either way)
        packed = grad and self.rope_theta is None and len(head_chunks(h, self.local_group, self.head_chunk)) == 1
        if packed:
            o = self.backend.attention_packed(qkv.view(B, N, -1, d), h, self.local_kv_heads, self.causal,
                                              self.deterministic)
            return head_parallel_out(self, plan, o.permute(0, 2, 1, 3).reshape(B, N, h * d))
        with section("qkv_proj"):
            q, k, v = self._split_heads(qkv.view(B, N, -1, d))           # [B, h|g|g, N, d]
            q, k = self._rope(q, k, 0)
        if grad:
            o = self._attention_grad(q, k, v)
            return head_parallel_out(self, plan, o.permute(0, 2, 1, 3).reshape(B, N, h * d))
        o_rows = torch.empty(B, N, h, d, dtype=self.dtype, device=x.device)   # the output GEMM's rows
        o = o_rows.permute(0, 2, 1, 3)                                      # seen as [B, h, N, d]
        align = self.backend.row_chunks
        by_rows = len(plan.chunks) > 1 and align is not None and all(r0 % align == 0 for r0, _ in plan.chunks) \
            and not torch.compiler.is_compiling()
        if not by_rows:
            self._attention(q, k, v, o)
        return head_parallel_out(self, plan, o_rows.view(B, N, h * d),
                                 before=(lambda r0, r1: self._attention(q, k, v, o, rows=(r0, r1))) if by_rows else None)

    def _forward_sequence(self, x: torch.Tensor, plan: CommPlan, grad: bool) -> torch.Tensor:
        """Sequence-parallel: x [B, N/W, D] per rank -> all-gather (chunk c's QKV GEMM while chunk c+1
        is gathered) -> attention -> output GEMM and reduce-scatter per chunk -> y [B, N/W, D].
        Rows travel as [K chunks, W ranks, B, m rows]: the relayout before attention puts row
        (w, c, i) at sequence position w*N/W + c*m + i."""
        B, n, D = x.shape
        W, K, h, g, d = self.world, self.overlap, self.local_heads, self.local_kv_heads, self.head_dim
        m = n // K
        w, b = self._qkv_weights() if grad else (self.wqkv, self._qkv_bias())
        qkv = sequence_parallel_qkv(self, plan, x, w, b)  # [K, W, B, m, (h+2g)*d]
        with section("qkv_proj"):  # rows (c, w, b, i) -> sequence position w*n + c*m + i (a view if K=B=1)
            q, k, v = self._split_heads(qkv.view(K, W, B, m, h + 2 * g, d).permute(2, 1, 0, 3, 4, 5)
                                        .reshape(B, W * n, h + 2 * g, d))
            q, k = self._rope(q, k, 0)
        if grad:
            o_rows = self._attention_grad(q, k, v).permute(0, 2, 1, 3).reshape(B, W, K, m, h * d)
        else:
            o_rows = torch.empty(B, W, K, m, h * d, dtype=self.dtype, device=x.device)
            self._attention(q, k, v, o_rows.view(B, W * n, h, d).permute(0, 2, 1, 3))
        return sequence_parallel_out(self, plan, o_rows)

    def _forward_context(self, x: torch.Tensor, grad: bool) -> torch.Tensor:
        """Context-parallel (the ring): x [B, n, D] is this rank's rows of the sequence (context_rows:
        two chunks, n = N / C), the same on the ranks that split the heads beside the ring -> QKV of
        its rows and heads -> ring attention over the whole sequence (tpattn/comm.py's ring pair) ->
        the output projection of its rows, summed over the heads' ranks -> y [B, n, D]. The ranks of
        a ring hold the same weights; under autograd their gradients are summed over the ring."""
        from .attention.ring import context_rows
        from .comm import ring_attention
        B, n, D = x.shape
        C, h, d = self.context_parallel, self.local_heads, self.head_dim
        if n % 2:
            raise ConfigError(f"context_parallel={C} holds two chunks of the sequence on each rank: x must have an "
                              f"even number of rows (got {n}); pad the sequence to a multiple of 2 x {C} rows")
        w, b = self._qkv_weights() if grad else (self.wqkv, self._qkv_bias())
        wo, bo = self.wo, self.bo
        if grad:  # replicated over the ring: each rank's gradient is its rows' share, summed in the backward
            w, wo = (sum_of_copies(t, self.ring, 0, 1, "bwd_ring_weights") for t in (w, wo))
            b, bo = (None if t is None else sum_of_copies(t, self.ring, 0, 1, "bwd_ring_weights") for t in (b, bo))
            qkv = copy_to_ranks(x.reshape(B * n, D), w, b, self.comm)  # heads beside the ring: dX summed over them
        else:
            with section("qkv_proj"):
                qkv = mm(x.reshape(B * n, D), w, self.dtype, b)
        with section("qkv_proj"):
            q, k, v = self._split_heads(qkv.view(B, n, -1, d))
            if self.rope_theta is not None:
                pos = context_rows(C * n, C, self.ring.rank).to(x.device)
                cos, sin = decode.rope_tables(pos, d, self.rope_theta, torch.promote_types(self.dtype, torch.float32))
                q, k = (decode.apply_rope(t, cos, sin, self.rope_interleaved) for t in (q, k))
        o = ring_attention(q, k, v, self.ring, self.causal, self.backend, self.deterministic)
        o = o.permute(0, 2, 1, 3).reshape(B, n, h * d)
        return head_parallel_out(self, self.plan(B, n), o, wo=wo, bo=bo)  # summed over the heads' ranks

    def shard_context(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full [B, N, D] tensor under context parallelism (two chunks of
        N / (2C) rows: tpattn.attention.ring.context_rows); N must divide by 2C."""
        from .attention.ring import context_rows
        C = self.context_parallel
        if t.shape[1] % (2 * C):
            raise ConfigError(f"context_parallel={C} splits the sequence into 2 x {C} chunks: N={t.shape[1]} must divide "
                              f"by {2 * C}; pad it to {-(-t.shape[1] // (2 * C)) * 2 * C} rows")
        return t[:, context_rows(t.shape[1], C, self.ring.rank).to(t.device)].contiguous()

    def gather_context(self, y: torch.Tensor) -> torch.Tensor:
        """The whole [B, N, D] from every ring rank's rows (a collective), differentiable (its
        backward hands each rank its rows' gradient)."""
        from .comm import gather_context
        return gather_context(y, self.ring)

    # ---- the local pieces, shared by both styles -----------------------------------------------

    def _qkv_bias(self):
        """The packed Q/K/V bias [(h + 2g)*d]: bqkv, or the biases the layer has with zeros for the
        others (those zeros are no parameter: nothing trains them), or None."""
        if self.bqkv is not None or not len(self.biases):
            return self.bqkv
        h, g, d = self.local_heads, self.local_kv_heads, self.head_dim
        return torch.cat([self.biases[n] if n in self.biases else self.wqkv.new_zeros(c * d)
                          for n, c in (("bq", h), ("bk", g), ("bv", g))])

    def _qkv_weights(self):
        """wqkv and the packed bias as a training step uses them: where several ranks hold a K/V head
        as copies (GQA with more ranks than K/V heads), its K/V columns through sum_of_copies, so that
        each copy's gradient is the sum over every copy (the single-process gradient)."""
        w, b = self.wqkv, self._qkv_bias()
        if self.world <= self.kv_heads:
            return w, b
        hd, slot, G = self.local_heads * self.head_dim, self.shard.kv_head_range.start, self.kv_heads
        w = torch.cat([w[:, :hd], sum_of_copies(w[:, hd:], self.comm, slot, G)], dim=1)
        if b is not None:
            b = torch.cat([b[:hd], sum_of_copies(b[hd:], self.comm, slot, G, "bwd_copies_bias")])
        return w, b

    def _split_heads(self, qkv: torch.Tensor):
        """q [B, h, N, d] and k, v [B, g, N, d] from the QKV GEMM's output [B, N, h + 2g, d]: strided
        views for a backend that reads them in place (fused), else contiguous copies (under autograd
        too: the same inputs, the same bits)."""
        h, g = self.local_heads, self.local_kv_heads
        q, k, v = (t.permute(0, 2, 1, 3) for t in qkv.split([h, g, g], dim=2))
        if self.backend.strided:
            return q, k, v
        return q.contiguous(), k.contiguous(), v.contiguous()

    def _attention(self, q, k, v, o, rows=None) -> None:
        """o = attention(q, k, v) for this rank's heads (a head_chunk at a time, with the K/V heads
        those query heads use), all query rows or rows (r0, r1) only. o may be a strided view; a
        backend that needs contiguous memory writes a contiguous copy that is then relaid into it."""
        kw = {} if rows is None else {"rows": rows}
        for qs, ks, vs, os_ in self._head_chunks(q, k, v, o):
            if torch.compiler.is_compiling() and self.backend.name != "reference":  # one op in the traced graph
                os_.copy_(self.backend.attention(qs, ks, vs, self.causal, self.deterministic))
            elif self.backend.strided:
                self.backend.forward(qs, ks, vs, self.causal, out=os_, **kw)
            else:
                os_.copy_(self.backend.forward(qs.contiguous(), ks.contiguous(), vs.contiguous(), self.causal, **kw))

    def _attention_grad(self, q, k, v) -> torch.Tensor:
        """o [B, h, N, d] = attention(q, k, v), differentiable (the backend's backward), a head_chunk
        at a time as _attention."""
        parts = [self.backend.attention(qs, ks, vs, self.causal, self.deterministic)
                 for qs, ks, vs, _ in self._head_chunks(q, k, v)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _head_chunks(self, q, k, v, o=None):
        """(q, k, v, o) of each head_chunk: whole groups, or heads of one group (tpattn.attention.head_chunks)."""
        h, gs = self.local_heads, self.local_group
        for h0, h1 in head_chunks(h, gs, self.head_chunk):
            if (h0, h1) == (0, h):
                yield q, k, v, o
                continue
            kv = slice(h0 // gs, (h1 - 1) // gs + 1)
            yield q[:, h0:h1], k[:, kv], v[:, kv], None if o is None else o[:, h0:h1]

    def _rope(self, q: torch.Tensor, k: torch.Tensor, start: int, cache: decode.KVCache | None = None):
        """q and k rotated by their positions start, start + 1, ... (rope_theta; else as they are)."""
        if self.rope_theta is None:
            return q, k
        if cache is not None:
            cos, sin = cache.cos[start:start + q.shape[2]], cache.sin[start:start + q.shape[2]]
        elif torch.compiler.is_compiling():  # (a traced graph computes them: no tensors held across calls)
            cos, sin = decode.rope_tables(torch.arange(start, start + q.shape[2], device=q.device), self.head_dim,
                                          self.rope_theta, torch.promote_types(q.dtype, torch.float32))
        else:  # (rope_signed's tables for this layout, made once)
            cos, sin = (t[start:start + q.shape[2]] for t in decode.rope_rows(
                q.device, start + q.shape[2], self.head_dim, self.rope_theta, torch.promote_types(q.dtype, torch.float32),
                self.rope_interleaved))
        return (decode.apply_rope(q, cos, sin, self.rope_interleaved),
                decode.apply_rope(k, cos, sin, self.rope_interleaved))

    # ---- decoding (tpattn/decode.py: the cache, the cached forward, the graphed step) ------------

    def new_cache(self, batch: int, max_len: int) -> decode.KVCache:
        """A KV cache for `batch` sequences of up to `max_len` positions: K and V of this rank's
        K/V heads, [B, g, max_len, d] each, on the layer's device and dtype."""
        return decode.new_cache(self, batch, max_len)

    def graphed(self, x: torch.Tensor, cache: decode.KVCache | None = None, dy: torch.Tensor | None = None):
        """Capture forward(x) (kernels, GEMMs and the collective) in one CUDA graph; returns a function
        that replays it on the same input buffer (copy new inputs into x in place). With a cache: one
        decode step per replay (tpattn.decode.graphed). With dy: a whole training step, forward and
        backward, each replay filling the gradients (tpattn.graphs.graphed_train)."""
        from . import graphs
        if cache is not None and dy is not None:
            raise ValueError("graphed(x, cache, dy): a decode step has no backward; pass a cache or dy, not both")
        if cache is not None:
            return decode.graphed(self, x, cache)
        return graphs.graphed_train(self, x, dy) if dy is not None else graphs.graphed_forward(self, x)
