"""Where one head-parallel call of the layer (tpattn/layer.py) sends its partial outputs: the output
projection of each chunk of query rows and the plan's collective (tpattn/commplan.py) over
tpattn/comm.py, then b_o and the storage dtype."""

from __future__ import annotations

import torch

from . import faults
from .commplan import CommPlan
from .ops import add_bias, mm
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
        self.peer = (layer._peer_buffers(plan, device) if plan.collective == "p2p" else
                     layer._oneshot_buffers(plan, device) if plan.collective == "oneshot" else None)
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
        part = self.peer.partial(rows, D) if self.peer else torch.empty(rows, D, dtype=L.part_dtype,
                                                                         device=self.device)
        with section("out_proj"):
            mm(o_rows, L.wo, L.part_dtype, out=part)
        how = self.plan.collective
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
