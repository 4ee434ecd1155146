"""The layer's plan (tpattn/commplan.py decides it; this is where the layer asks, keyed on
everything the answer depends on) and its bytes: what a call, and a training step, communicate."""

from __future__ import annotations

import torch

from .commplan import CommPlan, make_plan, oneshot_candidate


class LayerPlan:
    """Mixed into TensorParallelAttention: plan(), its byte accounting and the peers' question."""

    # ---- the plan: what a call communicates, decided before it does -------------------------

    def plan(self, batch: int, seq_len: int, decode: bool = False) -> CommPlan:
        """The communication plan for a call of `batch` x `seq_len` rows (seq_len: the whole sequence,
        also in sequence parallel; decode: rows appended to a KV cache, head-parallel and in one
        chunk). The same on every rank and for inference and training alike: it depends on the shape,
        the settings (fixed) and what the ranks agreed about mapping each other's memory
        (PeerLinks.ask, before the first call that could use it). Raises ConfigError for a shape it
        cannot run."""
        peers = self.peers.agreed(self.part_dtype, self.dtype)
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

    def _ask_peers(self, batch: int, seq_len: int, device: torch.device, decode: bool) -> None:
        kw = self._plan_kw(decode)
        del kw["elem"]
        self.peers.ask(oneshot_candidate(batch, seq_len, self.model_dim, self.world, **kw), device,
                       self.part_dtype, self.dtype)

    def partial_nbytes(self, batch: int, seq_len: int) -> int:
        """Bytes of the partial output that the all-reduce (or reduce-scatter) sums: [B, N, D]."""
        return self.plan(batch, seq_len).partial_bytes

    def collective_nbytes(self, batch: int, seq_len: int) -> dict[str, int]:
        """Bytes of each collective one call runs (the whole tensor, nccl-tests' "size"); one rank:
        the all-reduce a wider world would run (the report shows its bytes, with no bandwidth)."""
        if self.ring is not None:
            return self.ring_nbytes(batch, seq_len, train=False)
        p = self.plan(batch, seq_len)
        return p.nbytes if p.collective != "none" else {"allreduce": p.partial_bytes}

    def ring_nbytes(self, batch: int, seq_len: int, train: bool) -> dict[str, int]:
        """Context parallelism's bytes for a call over the whole sequence of seq_len rows: the heads'
        sum of this rank's seq_len / C rows (over the W / C ranks of its heads' group, as
        head-parallel), and the ring's passes: what one rank sends to the next in one call, all its
        passes together (forward: C - 1 passes of its K/V block; backward: C - 1 again, and C passes
        of the dK, dV sums in fp32), and the all-reduce over the ring of the replicated weights'
        gradients."""
        C, n = self.context_parallel, seq_len // self.context_parallel
        el, acc = self.dtype.itemsize, torch.promote_types(self.dtype, torch.float32).itemsize
        block = 2 * batch * self.local_kv_heads * n * self.head_dim  # K and V of this rank's rows
        p = self.plan(batch, n)
        out = dict(p.nbytes) if p.collective != "none" else {}
        out["ring"] = (C - 1) * block * el
        if train:
            out.update(bwd_ring=(C - 1) * block * el, bwd_ring_grads=C * block * acc)
            if p.collective != "none":
                out["bwd_allreduce"] = batch * n * self.model_dim * el
            hd, kv = self.local_heads * self.head_dim, self.local_kv_heads * self.head_dim
            biases = sum(t.numel() for t in self.parameters()) - self.wqkv.numel() - self.wo.numel()
            out["bwd_ring_weights"] = (self.model_dim * (hd + 2 * kv) + hd * self.model_dim + biases) * acc
        return out

    def copies_world(self) -> int:
        """How many ranks the K/V copies' gradient sum runs over: the ranks holding one K/V head
        where they have their own group (tpattn.comm.copy_groups), else the layer's whole group."""
        return self.comm.copies[1] if self.comm.copies is not None else self.world

    def train_nbytes(self, batch: int, seq_len: int) -> dict[str, int]:
        """Bytes of each collective a training step runs (forward and backward; the whole tensor):
        the forward's (the plan's), the duals in the backward (dX; sequence parallel: dy gathered,
        dX scattered) and, where several ranks hold a K/V head, the all-reduce of its copies'
        gradients (sum_of_copies: one for the K/V weight columns, one for their biases; over the
        copies_world() ranks that hold the head)."""
        if self.ring is not None:
            return self.ring_nbytes(batch, seq_len, train=True)
        p = self.plan(batch, seq_len)
        if p.collective == "none":
            return {}
        dx = p.batch * p.seq_len * p.model_dim * self.dtype.itemsize  # dX, in the input's dtype
        out = dict(p.nbytes)
        if p.collective == "sequence":
            out |= {"bwd_allgather": p.x_bytes, "bwd_reducescatter": dx}
        else:
            out["bwd_allreduce"] = dx
        if self.world > self.kv_heads:  # over the head's copies' own group (one slot), else G slots over all
            acc = torch.promote_types(self.dtype, torch.float32).itemsize
            kv = 2 * self.local_kv_heads * self.head_dim
            slots = 1 if self.comm.copies is not None else self.kv_heads
            out["bwd_copies"] = slots * self.model_dim * kv * acc
            if self.bqkv is not None or "bk" in self.biases or "bv" in self.biases:
                out["bwd_copies_bias"] = slots * kv * acc
        return out

