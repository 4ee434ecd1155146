"""Where the layer's (tpattn/layer.py) activations meet the collectives, in both directions: the
output projection of each chunk of query rows and the plan's collective (tpattn/commplan.py) over
tpattn/comm.py, then b_o and the storage dtype (OutputSum, head-parallel); sequence parallel's
chunked all-gather + QKV GEMM and output GEMM + reduce-scatter. Each is one function that the
inference call runs as it is and a training call through a torch.autograd.Function whose backward
is its dual (the sum's: the identity, every rank holds the whole dy; the all-gather's: a
reduce-scatter of dX; the reduce-scatter's: an all-gather of dy), so both run the same forward."""

from __future__ import annotations

import torch

from . import faults
from .commplan import CommPlan
from .ops import add_bias, bias_grad, mm
from .timing import section


class OutputSum:
    """Where one head-parallel call's partial outputs go, by the plan's collective: one rank (the
    output GEMM rounds straight into y with b_o in its epilogue), the all-reduce (comm.sum_from_ranks,
    then + b_o), the split (reduce-scatter, + b_o, all-gather) or a peer kernel (one pass: the
    reduce-gather, or the one-shot all-reduce of small partials)."""

    def __init__(self, layer, plan: CommPlan, device):
        self.layer, self.plan, self.device = layer, plan, device
        self.y = torch.empty(plan.batch, plan.seq_len, layer.model_dim, dtype=layer.dtype, device=device)
        # one rank: nothing to sum, unless a fault test injects one into the (local) collective
        self.local = plan.collective == "none" and not faults.planned(layer.rank, "allreduce")
        self.peer = layer.peers.buffers(plan, device, layer.part_dtype, layer.dtype)
        self.parts = []  # what the collectives read or write, referenced until they are joined
        self.late = []   # (gathered rows, where they go in y) to copy once the collectives are joined

    def add_rows(self, r0: int, r1: int, o_rows: torch.Tensor) -> None:
        """The output projection of query rows [r0, r1) (o_rows [B*(r1-r0), h*d]) and its collective."""
        L, comm, K, D = self.layer, self.layer.comm, self.layer.overlap, self.layer.model_dim
        rows, dst = o_rows.shape[0], self.y[:, r0:r1]
        if self.local:  # fp32 accumulation, one rounding, as the fp32 partial path
            with section("out_proj"):
                out = mm(o_rows, L.wo, L.dtype, L.bo, out=dst.view(-1, D) if dst.is_contiguous() else None)
            if not dst.is_contiguous():
                dst.copy_(out.view(dst.shape))
            return
        how = self.plan.collective
        if self.peer is not None and how in ("p2p", "oneshot") and torch.compiler.is_compiling():
            comm.peer_sum_traced(self.peer, how, o_rows, L.wo, self.y.view(rows, D), L.bo)  # GEMM + kernel: one op
            return
        part = self.peer.partial(rows, D) if self.peer else torch.empty(rows, D, dtype=L.part_dtype,
                                                                         device=self.device)
        with section("out_proj"):
            mm(o_rows, L.wo, L.part_dtype, out=part)
        if how == "p2p":  # reduce-scatter + all-gather in one kernel over NVLink, + b_o inside
            comm.peer_reduce_gather(self.peer, self.y.view(rows, D), L.bo)
        elif how == "oneshot":  # every rank reads every rank's partial, + b_o inside: one kernel
            comm.peer_all_reduce(self.peer, self.y.view(rows, D), L.bo)
        elif how in ("allreduce", "none"):
            comm.sum_from_ranks(part, K)
            self.parts.append((r0, r1, part))
        else:  # the split: each rank sums 1/W of the rows, adds b_o, rounds, and all-gathers them
            W = L.world
            mine = torch.empty(rows // W, D, dtype=L.part_dtype, device=self.device)
            self.parts.append((r0, r1, mine))
            if comm.reduce_scatter(mine, part, K) is False:
                return  # a fault left this rank's collectives out (both of them)
            whole = dst.is_contiguous()
            gathered = dst.view(rows, D) if whole else torch.empty(rows, D, dtype=L.dtype, device=self.device)
            m = rows // W
            mine_out = gathered[L.rank * m:(L.rank + 1) * m]  # this rank's rows of y: the all-gather is in place
            with comm.on_side(K, self.device):  # where the reduce-scatter ran: + b_o, rounded once
                add_bias(mine, L.bo, out=mine_out)
            comm.all_gather(gathered, mine_out, K)
            if not whole:
                self.late.append((gathered, dst))

    def result(self) -> torch.Tensor:
        L = self.layer
        L.comm.join(L.overlap)
        if self.plan.collective in ("allreduce", "none") and not self.local:  # + b_o and the cast in one pass
            B, D = self.plan.batch, L.model_dim
            for r0, r1, part in self.parts:
                add_bias(part.view(B, r1 - r0, D), L.bo, out=self.y[:, r0:r1])
        for gathered, dst in self.late:
            dst.copy_(gathered.view(dst.shape))
        return self.y


# ---- the three meeting points as functions of the forward, and their duals ----------------------

def head_parallel_out(layer, plan: CommPlan, o_rows: torch.Tensor, before=None, wo=None, bo=None) -> torch.Tensor:
    """y [B, N, D] = sum over ranks of o_rows [B, N, h*d] @ W_o (+ b_o), chunk by chunk of the plan
    (before(r0, r1): what must run before chunk [r0, r1)'s projection: its attention, when the
    backend computes row chunks). Differentiable under autograd: the sum's dual is the identity.
    wo, bo: what W_o's and b_o's gradients flow into (the layer's own by default; context
    parallelism's sum over the ring of them: the same values)."""
    wo, bo = layer.wo if wo is None else wo, layer.bo if bo is None else bo
    if torch.is_grad_enabled() and (o_rows.requires_grad or wo.requires_grad or (bo is not None and bo.requires_grad)):
        return _HeadParallelOut.apply(o_rows, wo, bo, layer, plan)
    return _sum_rows(layer, plan, o_rows, before)


def _sum_rows(layer, plan, o_rows, before=None):
    B = plan.batch
    total = OutputSum(layer, plan, o_rows.device)
    for r0, r1 in plan.chunks:
        if before is not None:
            before(r0, r1)
        total.add_rows(r0, r1, o_rows[:, r0:r1].reshape(B * (r1 - r0), o_rows.shape[-1]))
    return total.result()


class _HeadParallelOut(torch.autograd.Function):
    """Forward: the output projection and the plan's sum (OutputSum). Backward: every rank holds the
    whole dy (the sum's dual, the identity): dO = dy W_oᵀ, dW_o = Oᵀ dy, db_o = the rows' sum of dy."""

    @staticmethod
    def forward(ctx, o_rows, wo, bo, layer, plan):
        ctx.save_for_backward(o_rows, wo)
        ctx.bias_dtype = None if bo is None else bo.dtype
        return _sum_rows(layer, plan, o_rows)

    @staticmethod
    def backward(ctx, dy):
        o_rows, wo = ctx.saved_tensors
        rows, D = o_rows.shape[0] * o_rows.shape[1], wo.shape[1]
        do, dwo, dbo = _out_proj_backward(ctx, o_rows.reshape(rows, -1), wo, dy.reshape(rows, D))
        return (None if do is None else do.view(o_rows.shape)), dwo, dbo, None, None


def _out_proj_backward(ctx, o2d, wo, g):
    """(dO, dW_o, db_o) of y = O W_o + b_o, given dy g [rows, D] (what the ctx's inputs need)."""
    gm = g.to(wo.dtype)
    with section("bwd_out_proj"):
        do = mm(gm, wo.t(), o2d.dtype) if ctx.needs_input_grad[0] else None
        dwo = mm(o2d.t(), gm, wo.dtype) if ctx.needs_input_grad[1] else None
        dbo = bias_grad(g, ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
    return do, dwo, dbo


def sequence_parallel_qkv(layer, plan: CommPlan, x: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    """Sequence parallel's input: every rank's block x [B, n, D] all-gathered chunk by chunk (the
    plan's K chunks, queued at once) and each chunk's QKV GEMM as soon as it is in: qkv
    [K, W, B, m, cols], row (c, w, b, i) from rank w's row c*m + i. Differentiable under autograd:
    the all-gather's dual reduce-scatters dX to each rank's block."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
        return _SequenceQKV.apply(x, w, b, layer, plan)
    return _gather_qkv(layer, plan, x, w, b)[0]


def _gather_qkv(layer, plan, x, w, b):
    B, n, D = x.shape
    W, K, comm = layer.world, plan.overlap, layer.comm
    m = n // K
    xs = x.view(B, K, m, D)
    gathered = torch.empty(K, W, B, m, D, dtype=x.dtype, device=x.device)
    sources = [xs[:, c].contiguous() for c in range(K)]  # (B > 1: each chunk's rows copied first)
    arrived = [comm.all_gather(gathered[c].view(W * B, m, D), sources[c], K)
               for c in range(K)]  # all queued at once; chunk c's QKV GEMM waits for gather c only
    qkv = torch.empty(K, W, B, m, w.shape[1], dtype=w.dtype, device=x.device)
    for c in range(K):
        comm.wait(arrived[c])
        with section("qkv_proj"):
            mm(gathered[c].view(W * B * m, D), w, w.dtype, b, out=qkv[c].view(W * B * m, -1))
    return qkv, gathered


class _SequenceQKV(torch.autograd.Function):
    """Forward: _gather_qkv. Backward: dX of the whole sequence from this rank's columns, summed over
    the ranks into each rank's block (reduce-scatter); dW = Xᵀ dQKV over the gathered rows."""

    @staticmethod
    def forward(ctx, x, w, b, layer, plan):
        qkv, gathered = _gather_qkv(layer, plan, x, w, b)
        ctx.save_for_backward(gathered, w)
        ctx.comm, ctx.xshape, ctx.bias_dtype = layer.comm, x.shape, None if b is None else b.dtype
        return qkv

    @staticmethod
    def backward(ctx, g):
        gathered, w = ctx.saved_tensors
        K, W, B, m, D = gathered.shape
        gm = g.reshape(-1, w.shape[1]).to(w.dtype)
        with section("bwd_dx_proj"):  # rows (c, w, b, i) -> [W, K, B, m]: rank w's block, for the reduce-scatter
            whole = mm(gm, w.t(), gathered.dtype).view(K, W, B, m, D).transpose(0, 1).contiguous()
        mine = torch.empty(K, B, m, D, dtype=whole.dtype, device=whole.device)
        if ctx.comm.scatter_backward(mine.view(K * B * m, D), whole.view(W * K * B * m, D)) is False:
            mine.zero_()  # a fault test left the collective out
        with section("bwd_dw_proj"):
            dw = mm(gathered.view(-1, D).t(), gm, w.dtype) if ctx.needs_input_grad[1] else None
            db = bias_grad(g.reshape(-1, w.shape[1]), ctx.bias_dtype) \
                if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return mine.transpose(0, 1).reshape(ctx.xshape), dw, db, None, None


def sequence_parallel_out(layer, plan: CommPlan, o_rows: torch.Tensor) -> torch.Tensor:
    """Sequence parallel's output: o_rows [B, W, K, m, h*d] (row (b, w, c, i) at sequence position
    w*n + c*m + i) projected by this rank's rows of W_o chunk by chunk, each chunk's partials
    reduce-scattered as soon as they are out (+ b_o on each rank's rows): y [B, n, D]. Differentiable
    under autograd: the reduce-scatter's dual all-gathers dy."""
    if torch.is_grad_enabled() and (o_rows.requires_grad or layer.wo.requires_grad or
                                    (layer.bo is not None and layer.bo.requires_grad)):
        return _SequenceOut.apply(o_rows, layer.wo, layer.bo, layer, plan)
    return _scatter_out(layer, plan, o_rows)


def _scatter_out(layer, plan, o_rows):
    B, W, K, m, hd = o_rows.shape
    D, comm, dev = layer.model_dim, layer.comm, o_rows.device
    partial = torch.empty(K, W * B * m, D, dtype=layer.part_dtype, device=dev)
    y = torch.empty(K, B * m, D, dtype=layer.part_dtype, device=dev)
    for c in range(K):
        with section("out_proj"):  # rows (c, w, b, i): [W, B, m, h*d]
            mm(o_rows[:, :, c].transpose(0, 1).reshape(W * B * m, hd), layer.wo, layer.part_dtype, out=partial[c])
        comm.reduce_scatter(y[c], partial[c], K)
    comm.join(K)
    return add_bias(y.view(K, B, m, D).transpose(0, 1), layer.bo,
                    out=torch.empty(B, K, m, D, dtype=layer.dtype, device=dev)).view(B, K * m, D)


class _SequenceOut(torch.autograd.Function):
    """Forward: _scatter_out. Backward: every rank's block of dy all-gathered (the reduce-scatter's
    dual), then dO = dy W_oᵀ, dW_o = Oᵀ dy and db_o = the sum of dy over the whole sequence (each rank
    added b_o to its rows: its gradient is every rank's, which the gathered dy already holds)."""

    @staticmethod
    def forward(ctx, o_rows, wo, bo, layer, plan):
        ctx.save_for_backward(o_rows, wo)
        ctx.comm, ctx.bias_dtype = layer.comm, None if bo is None else bo.dtype
        return _scatter_out(layer, plan, o_rows)

    @staticmethod
    def backward(ctx, dy):
        o_rows, wo = ctx.saved_tensors
        B, W, K, m, hd = o_rows.shape
        D = wo.shape[1]
        whole = torch.empty(W * B, K * m, D, dtype=dy.dtype, device=dy.device)
        if ctx.comm.gather_backward(whole, dy.contiguous()) is False:
            whole.zero_()  # a fault test left the collective out
        g = whole.view(W, B, K * m, D).transpose(0, 1).reshape(B * W * K * m, D)  # o_rows' row order
        do, dwo, dbo = _out_proj_backward(ctx, o_rows.reshape(-1, hd), wo, g)
        return (None if do is None else do.view(o_rows.shape)), dwo, dbo, None, None
