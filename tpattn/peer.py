"""The head-parallel layer's output collective peer to peer over NVLink (comm="p2p").

NCCL's reduce-scatter + all-gather of the fp32 partials moves the bytes through NCCL's own staging
buffers in two kernels. Here every rank's partial and an output inbox live in torch symmetric
memory (torch.distributed._symmetric_memory: each rank maps the others' buffers), and one kernel
(kernels/peer_reduce.cu) does both collectives in one pass: rank r reads its block of rows from
every rank's partial, sums them in fp32, rounds once and writes the rows into its own output and
into every other rank's inbox. A GPU barrier before it (every partial is written) and one after it
(every inbox is full, nobody reads this rank's partial any more) order it with the GEMMs around it;
then the other ranks' rows are copied out of the inbox into the output. Everything runs on torch's
current stream, so a CUDA graph captures it like the NCCL path.

This module only holds buffers and launches; tpattn/layer.py decides when it runs (it is the one
module that communicates) and agrees with the other ranks that it can, before the first use.
"""

from __future__ import annotations

import numpy as np
import torch

from .cuda import launch

SOURCE = "peer_reduce.cu"
THREADS = 512
DTYPE_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# the partial / output dtype pairs the kernel has (partials at least as wide as the output)
PAIRS = {(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
         (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)}
BARRIER_TIMEOUT_MS = 600_000  # a rank that never arrives: the barrier traps (an error, not a hang)


def unavailable(device: torch.device, part_dtype: torch.dtype, out_dtype: torch.dtype) -> str | None:
    """Why this rank cannot take part in comm="p2p" (None: it can)."""
    if device.type != "cuda":
        return f"it needs CUDA tensors (this rank's are on {device.type})"
    if (part_dtype, out_dtype) not in PAIRS:
        return f"no kernel for {part_dtype} partials and {out_dtype} output"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as exc:
        return f"torch {torch.__version__} has no symmetric memory ({exc})"
    if not hasattr(symm_mem, "empty") or not hasattr(symm_mem, "rendezvous"):
        return f"torch {torch.__version__}'s symmetric memory lacks empty()/rendezvous()"
    return None


def row_block(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s block of `rows` rows: [rows*r/W, rows*(r+1)/W), so any row count splits."""
    return rows * rank // world, rows * (rank + 1) // world


class PeerBuffers:
    """Symmetric buffers for partials and outputs of up to `capacity` elements, mapped on every rank
    of the group (making them is collective: every rank makes the same ones in the same order)."""

    def __init__(self, capacity: int, part_dtype: torch.dtype, out_dtype: torch.dtype, device: torch.device,
                 group_name: str, rank: int, world: int):
        import torch.distributed._symmetric_memory as symm_mem
        self.capacity, self.part_dtype, self.out_dtype = capacity, part_dtype, out_dtype
        self.rank, self.world, self.device = rank, world, device
        self.part = symm_mem.empty(capacity, dtype=part_dtype, device=device)
        self.inbox = symm_mem.empty(capacity, dtype=out_dtype, device=device)
        self._handles = [symm_mem.rendezvous(t, group_name) for t in (self.part, self.inbox)]
        # peer addresses: the same offset from every rank's base (the allocations are symmetric)
        self.peer_part, self.peer_inbox = ([h.buffer_ptrs[w] + (t.data_ptr() - h.buffer_ptrs[rank]) for w in range(world)]
                                           for h, t in zip(self._handles, (self.part, self.inbox)))
        # the kernel's pointer table: every rank's partial, then every rank's inbox (made here, outside
        # any CUDA graph capture: a graph replays the same table)
        self.table = torch.tensor(self.peer_part + self.peer_inbox, dtype=torch.int64).to(device)
        self.max_blocks = 4 * torch.cuda.get_device_properties(device).multi_processor_count

    def partial(self, rows: int, dim: int) -> torch.Tensor:
        """This rank's partial [rows, dim], in symmetric memory (the output GEMM writes it)."""
        return self.part[:rows * dim].view(rows, dim)

    def reduce_gather(self, out: torch.Tensor, bias: torch.Tensor | None = None, group=None) -> torch.Tensor:
        """out [rows, dim] = the sum over ranks of partial(rows, dim) (+ bias), rounded once to
        out's dtype, on every rank. Queued on torch's current stream. (group: the buffers' own,
        accepted so that the layer calls it like a torch.distributed collective.)"""
        rows, dim = out.shape
        if not out.is_contiguous() or out.dtype != self.out_dtype or rows * dim > self.capacity:
            raise ValueError(f"reduce_gather: out must be a contiguous {self.out_dtype} tensor of at most "
                             f"{self.capacity} elements (got {tuple(out.shape)} {out.dtype})")
        if bias is not None:
            bias = bias.to(self.out_dtype).contiguous()
        r0, r1 = row_block(rows, self.world, self.rank)
        ptrs = (*self.peer_part, *self.peer_inbox, out.data_ptr(), 0 if bias is None else bias.data_ptr())
        vec = dim % 4 == 0 and all(p % 16 == 0 for p in ptrs)
        hp, hi = self._handles
        hp.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)  # every rank's partial is written
        n = (r1 - r0) * dim // (4 if vec else 1)
        if n:
            grid = max(1, min(-(-n // THREADS), self.max_blocks))
            name = f"peer_sum_{DTYPE_SUFFIX[self.part_dtype]}_{DTYPE_SUFFIX[self.out_dtype]}"
            launch(SOURCE, name, out.device, (grid, 1, 1), (THREADS, 1, 1),
                   (np.uint64(self.table.data_ptr()), np.uint64(out.data_ptr()),
                    np.uint64(0 if bias is None else bias.data_ptr()), np.int32(self.world), np.int32(self.rank),
                    np.int64(r0), np.int64(r1 - r0), np.int64(dim), np.int32(vec)))
        hi.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)  # every inbox is full; partials read
        inbox = self.inbox[:rows * dim].view(rows, dim)
        for w in range(self.world):
            if w != self.rank:
                a, b = row_block(rows, self.world, w)
                if b > a:
                    out[a:b].copy_(inbox[a:b])
        return out
