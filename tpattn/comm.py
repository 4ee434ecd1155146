"""Every collective tpattn runs, in one module: the collectives as forward/backward pairs.

The layer (tpattn/layer.py, with tpattn/outputsum.py where its activations meet the collectives)
calls only what is here, in the order its plan (tpattn/commplan.py, decided before any rank
communicates) says; calibration (tpattn/model) times bare collectives through `bare()`,
`barrier()` and `gather_objects()`. Nothing else in tpattn calls torch.distributed's collectives
(tests/test_layer_api.py greps for them).

The pairs. Each collective of the forward has a dual that its backward runs (the transpose of a
linear map: a sum over ranks transposes to a copy to every rank, a gather to a scatter):

    forward                                     backward (its dual)
    copy_to_ranks    x on every rank: identity  sum of dX over ranks: copy_to_ranks_backward (all-reduce)
    sum_from_ranks   all_reduce of partials     identity (every rank holds the full dy)
      or the split   reduce_scatter + all_gather of the rounded rows (the same sum)
      or the peer    one kernel over NVLink that reduces and gathers (tpattn/peer.py)
      or one-shot    small partials: one kernel reads every rank's (peer_all_reduce, tpattn/peer.py)
    all_gather       sequence blocks -> whole   scatter_backward: reduce_scatter of dX
    reduce_scatter   partials -> own block      gather_backward: all_gather of dy
    (copies)         K/V heads on several ranks sum_of_copies: all_reduce of their gradients
                                                (over the ranks holding the head: copy_groups)
    ring_attention   K/V blocks passed to the   the ring again: K/V blocks passed on, dK and dV
                     next rank C - 1 times      travelling with their block, one more hop home
                     (context parallelism)      (and the replicated weights' gradients summed)
    gather_context   the ring's rows -> whole   this rank's rows of dy (every rank holds all of
                     sequence, in order         dy: the backward of an all-gather whose output
                     (all_gather + reorder)     is used alike on every rank)

Each op owns its stream handling (a side stream with overlap, `record_stream` of what it reads
there), the collective watch (tpattn/watch.py), fault injection (tpattn/faults.py) and its timing
label (tpattn/timing.section). Under autograd the pairs are torch.autograd.Functions: here
copy_to_ranks (with the QKV GEMM that reads x), gather_sequence, sum_of_copies, ring_attention and
gather_context;
in tpattn/outputsum.py the output sum and sequence parallel's gather and scatter, whose Functions
call the methods here.
"""

from __future__ import annotations

import re
from contextlib import nullcontext

import torch
import torch.distributed as dist

from . import faults, watch
from .ops import bias_grad, mm
from .timing import section

# The single-tensor all-gather and reduce-scatter (concatenated along dim 0): torch >= 2.13 names
# them *_single and deprecates the older names, which torch 2.11 (the GPU machines) still has only.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    pass


WORLD = "world"  # group=WORLD: the default process group if one is initialized, else none


def resolve_group(group):
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


# ---- the collectives, as pairs -------------------------------------------------------------------

class Comm:
    """The collectives of one process group (None, or a group of one: their local equivalents).

    overlap > 1 on a GPU runs them on a side stream that first waits for the work queued so far;
    the compute stream reads a result only after wait(event) or join()."""

    def __init__(self, group, rank: int, world: int, copies: int = 1):
        """copies: how many ranks (consecutive) hold each K/V head (GQA with W > G), whose gradient
        sum sum_of_copies runs over those ranks only where they have a group (copy_groups)."""
        self.group, self.rank, self.world = group, rank, world
        self.nccl = group is not None and dist.get_backend(group) == "nccl"
        self._side = None
        self.copies = copy_groups(group, rank, world, copies)  # (group, size) of this rank's copies, or None

    # -- pair: copy to ranks (forward: the identity, every rank holds x) / sum from ranks --

    def sum_from_ranks(self, part: torch.Tensor, overlap: int = 1):
        """all_reduce(SUM) of the partial outputs, in place. Its backward is copy_to_ranks (every
        rank already holds the whole dy). Returns the end event with overlap on a GPU, else None;
        False when an injected fault left it out."""
        return self._output("allreduce", _all_reduce, overlap, part)

    def peer_all_reduce(self, peer, out: torch.Tensor, bias):
        """sum_from_ranks for small partials on one node (the plan's "oneshot"): one kernel reads
        every rank's partial through mapped memory and writes this rank's out (+ bias), rounded once
        (tpattn/peer.py). Inference only; its dual would be the same identity as sum_from_ranks's."""
        return self._output("oneshot", lambda o, b, group: peer.all_reduce(o, b), 1, out, bias)

    def copy_to_ranks_backward(self, dx: torch.Tensor, overlap: int = 1):
        """copy_to_ranks's backward: all_reduce(SUM) of dX, in place (the end event with overlap on
        a GPU, so that the weight-gradient GEMM runs meanwhile; else None)."""
        if backward_fault(self):
            return None
        return self._run("bwd_allreduce", _all_reduce, overlap, dx)

    # -- the split (reduce_scatter, + b_o, all_gather below) and the peer path: the same sum as
    #    sum_from_ranks, fewer bytes --

    def peer_reduce_gather(self, peer, out: torch.Tensor, bias):
        """The peer kernel: reduce-scatter and all-gather in one pass over NVLink (tpattn/peer.py)."""
        return self._output("peer", lambda o, b, group: peer.reduce_gather(o, b), 1, out, bias)

    def peer_sum_traced(self, peer, how: str, o_rows: torch.Tensor, wo: torch.Tensor, out: torch.Tensor, bias):
        """The two above inside a graph that torch.compile traces: the output GEMM into the peer
        buffer and the peer kernel (how: "p2p" or "oneshot") as the one op tpattn::peer_sum, so the
        mapped memory, which the graph does not see, is written and read inside it."""
        from .attention import custom_ops
        return self._output(how, lambda o, w, y, b, group: custom_ops.peer_sum_op(o, w, y, b, peer.key, how), 1,
                            o_rows, wo, out, bias)

    # -- pair: all-gather (sequence parallel's input) / reduce-scatter (its output) --

    def all_gather(self, whole: torch.Tensor, block: torch.Tensor, overlap: int = 1):
        """Every rank's block (of the sequence, or the split's rounded rows), concatenated along
        dim 0. Its backward is reduce_scatter of the gradient."""
        return self._run("allgather", _all_gather, overlap, whole, block)

    def reduce_scatter(self, block: torch.Tensor, whole: torch.Tensor, overlap: int = 1):
        """This rank's block of the sum over ranks (sequence parallel's output, or the split's first
        half); False when an injected fault left it out. Its backward is all_gather of the gradient."""
        return self._output("reducescatter", _reduce_scatter, overlap, block, whole)

    def scatter_backward(self, block: torch.Tensor, whole: torch.Tensor):
        """all_gather's backward: this rank's block of the sum of every rank's dX (reduce_scatter);
        False when an injected fault left it out."""
        if backward_fault(self):
            return False
        return self._run("bwd_reducescatter", _reduce_scatter, 1, block, whole)

    def gather_backward(self, whole: torch.Tensor, block: torch.Tensor):
        """reduce_scatter's backward: every rank's block of dy (all_gather); False when an injected
        fault left it out."""
        if backward_fault(self):
            return False
        return self._run("bwd_allgather", _all_gather, 1, whole, block)

    # -- the ring (context parallelism): blocks to the next rank, from the previous one --

    def ring_pass(self, sends, recvs, label: str = "ring"):
        """Post the sends of `sends` to the next rank of the ring and the receives into `recvs`
        from the previous one (batch_isend_irecv: all in flight at once, each tensor its own tag);
        returns wait(), which blocks until they are done. Compute queued between the two overlaps
        the transfer. gloo (ranks sharing a GPU, or CPU) sends and receives host memory: CUDA
        tensors go through host copies."""
        nxt = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        prv = dist.get_global_rank(self.group, (self.rank - 1) % self.world)
        staged = not self.nccl and any(t.is_cuda for t in (*sends, *recvs))
        with section(label), torch.no_grad():
            out, back = sends, recvs
            if staged:
                out = [t.cpu() for t in sends]
                back = [torch.empty(t.shape, dtype=t.dtype) for t in recvs]
            # tags by label: the backward has a block's K/V and the previous block's sums in flight at once
            base = RING_TAGS.get(label, 0)
            ops = [dist.P2POp(dist.isend, t, nxt, self.group, base + i) for i, t in enumerate(out)]
            ops += [dist.P2POp(dist.irecv, t, prv, self.group, base + i) for i, t in enumerate(back)]
            works = dist.batch_isend_irecv(ops)

        def wait() -> None:
            with section(label), watch.collective(label, self.world, self.nccl):
                try:
                    for w in works:
                        w.wait()
                except (dist.DistError, RuntimeError) as exc:
                    raise CollectiveError(watch.explain(label, self.world, first_line(exc))) from None
                if staged:
                    for t, host in zip(recvs, back):
                        t.copy_(host)
        return wait

    # -- objects on the host (set-up, not the data path) --

    def all_gather_object(self, obj, label: str = "peersetup") -> list:
        """Every rank's obj (pickled over the process group); [obj] without one."""
        if self.group is None or self.world == 1:
            return [obj]
        with watch.collective(label, self.world, False):
            return gather_objects(obj, self.group)

    def same_everywhere(self, obj, label: str = "agree") -> bool:
        """Whether obj is the same on every rank (one gather of its digest: same_everywhere)."""
        if self.group is None or self.world == 1:
            return True
        with watch.collective(label, self.world, False):
            return same_everywhere(obj, self.group)

    # -- the machinery: streams, the watch, faults, labels --

    def _output(self, name: str, op, overlap: int, *tensors):
        """A collective that sums the partial outputs: fault injection step "allreduce"."""
        if faults.maybe_fail(self.rank, "allreduce") == "skip":
            return False
        return self._run(name, op, overlap, *tensors)

    def sum_copies(self, t: torch.Tensor, label: str) -> None:
        """all_reduce(SUM) of t, in place, over the ranks that hold this rank's K/V head (self.copies)."""
        self._run(label, _all_reduce, 1, t, over=self.copies)

    def _run(self, name: str, op, overlap: int, *tensors, over: tuple | None = None):
        """op(*tensors, group=...) after the work queued so far; the end event on a side stream, else
        None. over: (group, size) of a subgroup to run it on instead of the layer's group."""
        group, world = over if over is not None else (self.group, self.world)
        if group is None or world == 1:
            if op is _all_gather or op is _reduce_scatter:
                tensors[0].copy_(tensors[1].view(tensors[0].shape))
            elif op is not _all_reduce:
                op(*tensors, group=None)
            return None
        stream = self.side_stream(overlap, tensors[0].device)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
            if not torch.cuda.is_current_stream_capturing():  # (a graph's pool keeps its memory anyway)
                for t in tensors:  # the caching allocator must not reuse them before the side stream is done
                    if isinstance(t, torch.Tensor):
                        t.record_stream(stream)
        with (torch.cuda.stream(stream) if stream is not None else nullcontext()), section(name), \
                watch.collective(name, world, self.nccl or name == "oneshot"):  # a kernel: watched on the GPU
            try:
                with torch.no_grad():  # the pairs' Functions carry the gradients; the op itself is not differentiable
                    op(*tensors, group=group)
            except dist.DistError as exc:  # the backend's: a peer that died, hangs or never came
                raise CollectiveError(watch.explain(name, world, first_line(exc))) from None
            except RuntimeError as exc:  # raised on this rank before or without a peer: say so, not "a rank died"
                if _from_peer(exc):
                    raise CollectiveError(watch.explain(name, world, first_line(exc))) from None
                raise CollectiveError(f"{COLLECTIVE_NAME.get(name, name)} on rank {self.rank} failed on this rank "
                                      f"(no other rank caused it): {first_line(exc)}") from None
        return stream.record_event() if stream is not None else None

    def side_stream(self, overlap: int, device: torch.device):
        if overlap == 1 or device.type != "cuda" or self.group is None or self.world == 1:
            return None
        if self._side is None or self._side.device != device:
            self._side = torch.cuda.Stream(device=device)
        return self._side

    def on_side(self, overlap: int, device: torch.device):
        """Run the enclosed work where the collectives run (the side stream when overlapping)."""
        stream = self.side_stream(overlap, device)
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    @staticmethod
    def wait(event) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def join(self, overlap: int) -> None:
        """The compute stream waits for every collective issued so far."""
        if self._side is not None and overlap > 1:
            torch.cuda.current_stream().wait_stream(self._side)


# ---- the pairs under autograd: what a training step runs ----------------------------------------
# Each Function's forward is one collective of the pairs above (or none) and its backward is the
# dual: a linear map's transpose. Fault injection step "backward" fires before a backward collective.

def backward_fault(comm: Comm) -> bool:
    """The fault tests' hook before a backward collective; True: leave it out (mode skip)."""
    return faults.maybe_fail(comm.rank, "backward") == "skip"


class _CopyToRanks(torch.autograd.Function):
    """The head-parallel input, x on every rank, and the QKV GEMM that reads it: qkv = x @ W_qkv
    (+ b_qkv) with this rank's columns. Forward: copy_to_ranks is the identity (every rank holds x).
    Backward: dX = dQKV W_qkvᵀ is this rank's share, all-reduced over the ranks (its dual); with
    overlap (a GPU) that all-reduce runs on the communication stream while dW = Xᵀ dQKV runs, as
    Megatron does. The all-reduce runs whenever this backward does, whatever this rank's x needs:
    a choice from x.requires_grad could differ between ranks and leave one waiting."""

    @staticmethod
    def forward(ctx, x2d, w, b, comm, overlap: bool):
        ctx.save_for_backward(x2d, w)
        ctx.comm, ctx.overlap, ctx.bias_dtype = comm, overlap, None if b is None else b.dtype
        with section("qkv_proj"):
            return mm(x2d, w, w.dtype, b)

    @staticmethod
    def backward(ctx, g):
        x2d, w = ctx.saved_tensors
        comm = ctx.comm
        gm = g.to(w.dtype)
        with section("bwd_dx_proj"):
            dx = mm(gm, w.t(), x2d.dtype)
        done = comm.copy_to_ranks_backward(dx, 2 if ctx.overlap else 1)
        with section("bwd_dw_proj"):
            dw = mm(x2d.t(), gm, w.dtype) if ctx.needs_input_grad[1] else None
            db = bias_grad(g, ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        comm.wait(done)
        return dx if ctx.needs_input_grad[0] else None, dw, db, None, None


class _GatherSequence(torch.autograd.Function):
    """Forward: every rank's block of rows [B, n, D] -> the whole sequence [B, W n, D], the same on
    every rank. Backward: this rank's block of dy. Whatever follows the gather runs alike on every
    rank (the whole sequence is replicated), so every rank's dy is the whole gradient and no sum is
    needed (a reduce-scatter would count it W times; the layer's own gather, followed by this
    rank's heads only, is sequence_parallel_qkv's, whose dual is the reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        B, n, D = x.shape
        whole = torch.empty(comm.world * B, n, D, dtype=x.dtype, device=x.device)
        comm.all_gather(whole, x.contiguous())
        return whole.view(comm.world, B, n, D).transpose(0, 1).reshape(B, comm.world * n, D)

    @staticmethod
    def backward(ctx, dy):
        comm = ctx.comm
        n = dy.shape[1] // comm.world
        return dy[:, comm.rank * n:(comm.rank + 1) * n], None


class _SumOfCopies(torch.autograd.Function):
    """Forward: this rank's slice t of a tensor that several ranks hold as copies (K/V heads with
    more ranks than K/V heads), as it is. Backward: the sum of every copy's gradient, on each
    copy's rank, in fp32: one all_reduce(SUM) over the ranks holding the same K/V head (their own
    group, comm.copies). Where the layer's group has no such subgroups (copy_groups), each rank
    places its gradient at its slot (`slot` of `slots`) of a zero buffer, one all_reduce(SUM) over
    the whole group, and each takes its slot back: slots times the bytes."""

    @staticmethod
    def forward(ctx, t, comm, slot: int, slots: int, label: str):
        ctx.comm, ctx.slot, ctx.slots, ctx.label = comm, slot, slots, label
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        comm = ctx.comm
        acc = torch.promote_types(g.dtype, torch.float32)
        if comm.copies is not None:
            buf = g.to(acc, copy=True).contiguous()
            if not backward_fault(comm):
                comm.sum_copies(buf, ctx.label)
            return buf.to(g.dtype), None, None, None, None
        buf = torch.zeros((ctx.slots, *g.shape), dtype=acc, device=g.device)
        buf[ctx.slot] = g
        if not backward_fault(comm):
            comm._run(ctx.label, _all_reduce, 1, buf)
        return buf[ctx.slot].to(g.dtype), None, None, None, None


RING_TAGS = {"ring": 0, "bwd_ring": 0, "bwd_ring_grads": 8}  # ring_pass's first tag per label


class _RingAttention(torch.autograd.Function):
    """Context parallelism's attention (tpattn/attention/ring.py has the math and the layout).
    Forward: this rank's query rows attend to its own K/V block, then to each other rank's as the
    blocks travel around the ring (C - 1 passes to the next rank, each posted before the block in
    hand is computed); the partial outputs merged with their logsumexp in fp32. Backward (its
    dual): the blocks travel again; each rank adds its query rows' share of dK and dV to the block
    in hand, and the sums travel with their block, one more pass bringing each block's home; dQ
    stays."""

    @staticmethod
    def forward(ctx, q, k, v, comm, causal: bool, backend, deterministic: bool):
        from .attention.ring import merge, piece_forward, pieces
        C, c = comm.world, comm.rank
        B, h, n, d = q.shape
        acc = torch.promote_types(q.dtype, torch.float32)
        o = torch.zeros(B, h, n, d, dtype=acc, device=q.device)
        lse = torch.full((B, h, n), float("-inf"), dtype=acc, device=q.device)
        cur = (k.contiguous(), v.contiguous())
        for s in range(C):
            wait = None
            if s < C - 1:
                nxt = (torch.empty_like(cur[0]), torch.empty_like(cur[1]))
                wait = comm.ring_pass(cur, nxt, "ring")
            with section("attention"):
                for q0, q1, k0, k1, diag in pieces(c, (c - s) % C, n, causal):
                    merge(o[:, :, q0:q1], lse[:, :, q0:q1],
                          *piece_forward(backend, q[:, :, q0:q1], cur[0][:, :, k0:k1], cur[1][:, :, k0:k1], diag))
            if wait is not None:
                wait()
                cur = nxt
        out = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.causal, ctx.backend, ctx.deterministic = comm, causal, backend, deterministic
        return out

    @staticmethod
    def backward(ctx, do):
        from .attention.ring import RowsDq, block_sums, step_backward
        q, k, v, o, lse = ctx.saved_tensors
        comm, causal, backend = ctx.comm, ctx.causal, ctx.backend
        C, c = comm.world, comm.rank
        do = do.contiguous()
        with section("attention_bwd"):
            dq = RowsDq(backend, q, o, lse, do, causal, ctx.deterministic)
        kv = (k.contiguous(), v.contiguous())
        pending = None  # the block's dK, dV sums on their way from the previous rank: (wait, where they land)
        for s in range(C):
            wait = None
            if s < C - 1:  # the next block's K and V travel while this one's share is computed
                nxt = (torch.empty_like(kv[0]), torch.empty_like(kv[1]))
                wait = comm.ring_pass(kv, nxt, "bwd_ring")
            with section("attention_bwd"):
                parts = step_backward(backend, q, kv[0], kv[1], o, lse, do, c, (c - s) % C, causal, ctx.deterministic,
                                      dq)
            if pending is not None:  # the earlier ranks' sums for this block, which travelled during the compute
                pending[0]()
            mine = block_sums(parts, kv[0], None if pending is None else pending[1])  # (added to the arrivals)
            onward = (torch.empty_like(mine[0]), torch.empty_like(mine[1]))
            pending = (comm.ring_pass(mine, onward, "bwd_ring_grads"), onward)  # the sums go on with their block
            if wait is not None:
                wait()
                kv = nxt
        pending[0]()  # the last pass brings each block's sums home
        grads = pending[1]
        with section("attention_bwd"):
            dq = dq.result()
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, causal: bool,
                   backend=None, deterministic: bool = False) -> torch.Tensor:
    """o [B, h, n, d] of this rank's rows (tpattn.attention.ring.context_rows) over the whole
    sequence held by the ring's ranks, differentiable (its backward is the ring again). backend:
    a local attention backend whose forward saves the logsumexp (fused, triton) runs each piece
    through its kernels; any other (or None) leaves the pieces to torch math."""
    return _RingAttention.apply(q, k, v, comm, causal, backend if getattr(backend, "saves_lse", False) else None,
                                deterministic)


class _GatherContext(torch.autograd.Function):
    """Forward: every ring rank's rows [B, n, D] (context_rows) -> the whole sequence [B, C n, D] in
    order, the same on every rank. Backward: this rank's rows of dy (what follows runs alike on
    every rank)."""

    @staticmethod
    def forward(ctx, x, comm):
        from .attention.ring import context_rows
        B, n, D = x.shape
        C = comm.world
        whole = torch.empty(C * B, n, D, dtype=x.dtype, device=x.device)
        comm.all_gather(whole, x.contiguous())
        order = torch.cat([context_rows(C * n, C, r) for r in range(C)]).to(x.device)
        out = torch.empty(B, C * n, D, dtype=x.dtype, device=x.device)
        out[:, order] = whole.view(C, B, n, D).transpose(0, 1).reshape(B, C * n, D)
        ctx.comm, ctx.rows = comm, context_rows(C * n, C, comm.rank).to(x.device)
        return out

    @staticmethod
    def backward(ctx, dy):
        return dy[:, ctx.rows], None


def gather_context(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _GatherContext.apply(x, comm)


def copy_to_ranks(x2d: torch.Tensor, w: torch.Tensor, b, comm: Comm, overlap: bool = False) -> torch.Tensor:
    """x2d @ w (+ b) of the x every rank holds, differentiable: its backward all-reduces dX."""
    return _CopyToRanks.apply(x2d, w, b, comm, overlap)


def gather_sequence(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _GatherSequence.apply(x, comm)


def sum_of_copies(t: torch.Tensor, comm: Comm, slot: int, slots: int, label: str = "bwd_copies") -> torch.Tensor:
    return _SumOfCopies.apply(t, comm, slot, slots, label)


# ---- the K/V copies' groups ----------------------------------------------------------------------
# One process group per K/V head held by several ranks, made once per set of ranks and shared by
# every layer over them. new_group is a collective of the whole world (and, with NCCL bound to a
# device, a split of the default communicator), so the groups are made only when the layer's group
# is the world, which every rank builds; for a layer on a smaller group every rank of the world
# would have to take part although only the group's ranks build the layer (that hung), so there
# sum_of_copies all-reduces its slotted buffer over the layer's group. The choice depends only on
# the group and the shard, the same on every rank of the layer.
_COPY_GROUPS: dict = {}


def copy_groups(group, rank: int, world: int, copies: int):
    """(group, size) of the `copies` consecutive ranks that hold this rank's K/V head, or None (no
    copies, one process, or a layer group that is not the world)."""
    if group is None or copies < 2 or world % copies:
        return None
    if copies == world:  # one K/V head on every rank: the layer's group is the copies' group
        return group, world
    if group is not dist.group.WORLD:
        return None
    key = (id(group), world, copies)
    made = _COPY_GROUPS.get(key)
    if made is not None:
        try:
            dist.get_process_group_ranks(made[rank // copies])
        except (ValueError, RuntimeError, KeyError):  # destroyed with an earlier default group
            made = None
    if made is None:  # every rank makes every block's group, in the same order (NON_GROUP_MEMBER for others)
        backend = dist.get_backend(group)
        made = [dist.new_group(list(range(b, b + copies)), backend=backend) for b in range(0, world, copies)]
        _COPY_GROUPS[key] = made
    return made[rank // copies], copies


def context_groups(group, C: int):
    """(heads, ring) process groups of context parallelism over `group` of W ranks: rank r is rank
    r % C of ring r // C (C consecutive ranks) and rank r // C of the heads' group r % C (every C-th
    rank); None for a group of one. With rings and heads both wider than one rank the groups are
    new_group's, made only for a layer on the world (see copy_groups), by every rank, once."""
    group, rank, world = resolve_group(group)
    T = world // C
    if T == 1:
        return None, group
    if C == 1:
        return group, None
    if group is not dist.group.WORLD:
        from .errors import ConfigError
        raise ConfigError(f"context_parallel={C} beside heads split over {T} ranks needs the layer on the world's "
                          "process group (its rings and head groups are made over the world); build it with "
                          f"group=WORLD, or on a group of {C} ranks for the ring alone")
    key = (id(group), world, C, "context")
    made = _COPY_GROUPS.get(key)
    if made is not None:
        try:
            dist.get_process_group_ranks(made[0][rank // C])
        except (ValueError, RuntimeError, KeyError):
            made = None
    if made is None:
        backend = dist.get_backend(group)
        rings = [dist.new_group(list(range(t * C, (t + 1) * C)), backend=backend) for t in range(T)]
        heads = [dist.new_group(list(range(c, world, C)), backend=backend) for c in range(C)]
        made = _COPY_GROUPS[key] = (rings, heads)
    return made[1][rank % C], made[0][rank // C]


def _all_reduce(t: torch.Tensor, group=None):
    return dist.all_reduce(t, group=group)


def barrier(group=None, device: torch.device | None = None) -> None:
    """Every rank of `group` (None: the default group) has come (NCCL: on `device`'s stream)."""
    if device is not None and torch.device(device).type == "cuda":
        dist.barrier(group=group, device_ids=[torch.device(device).index])
    else:
        dist.barrier(group=group)


def same_everywhere(obj, group=None) -> bool:
    """Whether obj (anything with a stable repr) is the same on every rank of `group`: one all-gather of
    a 32-byte digest (on the GPU for NCCL), rather than all_gather_object's two gathers of pickles."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return True
    import hashlib
    digest = torch.frombuffer(bytearray(hashlib.sha256(repr(obj).encode()).digest()), dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        digest = digest.to(torch.device("cuda", torch.cuda.current_device()))
    everyone = [torch.empty_like(digest) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, digest, group=group)
    return all(torch.equal(t, everyone[0]) for t in everyone)


def agree_build(group, mine: dict | None, error: Exception | None) -> None:
    """A layer's construction agreed by the ranks of `group` (TensorParallelAttention._agree_build):
    mine, this rank's settings, or its error. One gather of a digest; when the digests differ, every
    rank gathers the settings (or errors) to say what differs. Raises this rank's error, else the first
    failing rank's, else the settings that differ; returns when every rank built the same layer (at
    once for a layer of one process: group None or of one rank)."""
    from .errors import ConfigError
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    mine = {"error": f"{error}"} if error is not None else mine
    said = None if same_everywhere(mine, group) else gather_objects(mine, group)  # (both on every rank)
    if error is not None:
        raise error
    if said is None:
        return
    failed = [(r, theirs["error"]) for r, theirs in enumerate(said) if "error" in theirs]
    if failed:
        raise ConfigError(f"rank {failed[0][0]} refused this layer: {failed[0][1]} (a layer is built on every rank "
                          "of its group together)")
    for r, theirs in enumerate(said):
        diff = [k for k in mine if theirs[k] != said[0][k]]
        if diff:
            shown = "; ".join(f"{k}: rank 0 has {said[0][k]!r}, rank {r} has {theirs[k]!r}" for k in diff[:3])
            raise ConfigError(f"the ranks built this layer differently ({shown}); build it alike on every rank of "
                              "its group (each rank holds its own heads of the same layer)")


def gather_objects(obj, group=None) -> list:
    """Every rank's obj on every rank (pickled; no process group: [obj])."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def bare(kind: str, group=None):
    """A bare collective for calibration and probes: kind in allreduce, reducescatter, allgather;
    returns fn(out, inp) (all-reduce: in place on out) on `group` (None: the default group)."""
    if kind == "allreduce":
        return lambda out, inp=None: dist.all_reduce(out, group=group)
    if kind == "reducescatter":
        return lambda out, inp: _reduce_scatter(out, inp, group=group)
    if kind == "allgather":
        return lambda out, inp: _all_gather(out, inp, group=group)
    raise ValueError(f"unknown collective {kind!r}")


# what a backend says when the failure is another rank's (gloo and NCCL, seen in tests/test_faults.py)
_PEER_WORDS = re.compile(r"connection|closed|reset by peer|timed? ?out|timeout|abort|nccl|gloo|socket|remote",
                         re.IGNORECASE)
COLLECTIVE_NAME = {"allreduce": "the all-reduce", "allgather": "the all-gather", "reducescatter": "the reduce-scatter"}


def _from_peer(exc: BaseException) -> bool:
    """Whether a RuntimeError from a collective came from the other ranks (the link, a timeout, the
    backend), not from this rank's own tensors."""
    return bool(_PEER_WORDS.search(str(exc)))


def first_line(exc: BaseException) -> str:
    """The useful part of a backend's error: no source paths, one line, bounded."""
    msg = re.sub(r"\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", str(exc)).strip().splitlines()
    first = msg[0].split(". ")[0] if msg else type(exc).__name__
    return first[:160]
