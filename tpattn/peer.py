"""The head-parallel layer's output collectives peer to peer: the reduce-gather over NVLink
(output_collective="p2p", PeerBuffers) and the one-shot all-reduce for small partials
(output_collective="oneshot", and "auto"'s choice for them where the ranks can map each other's
memory: OneShotBuffers, at the end of this file).

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

import ctypes

import numpy as np
import torch

from .attention.custom_ops import IMPLS, register_peer
from .commplan import ONESHOT_MAX_BYTES
from .cuda import launch
from .ops import mm

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
        self.key = register_peer(self)  # how a traced graph's tpattn::peer_sum finds these buffers
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


# ---- the one-shot all-reduce (small partials: decode steps) --------------------------------------
#
# NCCL's all-reduce of a few KiB costs 10-20 us of latency, more than a decode step's attention. Here
# every rank's partial lives in a buffer that every other rank has mapped (CUDA IPC: the memory is
# torch's, exported with cudaIpcGetMemHandle, opened by the others with peer access enabled; ranks on
# one GPU share it the same way), and one kernel (kernels/peer_reduce.cu, peer_allreduce_*) waits
# for every rank, reads all W partials, sums them in rank order, adds b_o, rounds once and writes this
# rank's output, then waits for every rank again before the next call may overwrite its partial.
# The waits are flags in the same buffers, counted on the device, so a CUDA graph replays them.
#
# Setting up is the layer's (it is collective, through tpattn/comm.py): OneShotBuffers(...) on every
# rank, comm.all_gather_object(buf.exported), buf.open(every rank's), comm.all_gather_object of what
# open returned, and every rank goes on only if every rank opened every other's (else all fall back
# to NCCL, or all raise the same line when the user asked for it by name).

ONESHOT_BLOCKS, ONESHOT_WORLD = 64, 16  # as kernels/peer_reduce.cu's: the most blocks and ranks it takes
SIGNAL_BYTES = 4 * (2 * ONESHOT_BLOCKS * ONESHOT_WORLD + ONESHOT_BLOCKS)  # the flags, then the partial
DATA_OFFSET = -(-SIGNAL_BYTES // 256) * 256
ONESHOT_TIMEOUT_S = 600  # a rank that never arrives: the waiting kernel traps (an error, not a hang)
# ... rank r after ONESHOT_TIMEOUT_S + r * ONESHOT_STAGGER_S: ranks sharing one GPU (over gloo) must not trap
# at the same moment; when two contexts' kernels trapped together on the H200, one process's
# torch.cuda.synchronize() never returned (3 of 6 runs of tests/mpi_oneshot_check.py late; none staggered)
ONESHOT_STAGGER_S = 3


def oneshot_unavailable(device: torch.device, world: int, part_dtype: torch.dtype, out_dtype: torch.dtype) -> str | None:
    """Why this rank cannot take part in the one-shot all-reduce (None: it can, as far as it alone
    can tell; mapping the others' buffers is tried in open())."""
    if device.type != "cuda":
        return f"it needs CUDA tensors (this rank's are on {device.type})"
    if world > ONESHOT_WORLD:
        return f"the kernel takes up to {ONESHOT_WORLD} ranks (the world has {world})"
    if (part_dtype, out_dtype) not in PAIRS:
        return f"no kernel for {part_dtype} partials and {out_dtype} output"
    return None


def _allocation_base(cupy, address: int) -> int:
    """The start of the cudaMalloc allocation holding `address` (torch's caching allocator hands out
    pieces of larger segments; an IPC handle names a whole segment)."""
    lib = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address))
    if rc:
        raise RuntimeError(f"cuMemGetAddressRange failed (CUresult {rc})")
    return base.value


class OneShotBuffers:
    """This rank's partial buffer of up to `capacity` elements (and its flags), and once open(), the
    addresses of every rank's. Made on every rank with the same capacity."""

    def __init__(self, capacity: int, part_dtype: torch.dtype, out_dtype: torch.dtype, device: torch.device,
                 rank: int, world: int):
        import socket
        self.capacity, self.part_dtype, self.out_dtype = capacity, part_dtype, out_dtype
        self.rank, self.world, self.device = rank, world, device
        self.key = register_peer(self)  # how a traced graph's tpattn::peer_sum finds these buffers
        self._opened: list[int] = []
        self.table = None
        why = oneshot_unavailable(device, world, part_dtype, out_dtype)
        handle = offset = None
        if why is None:
            try:  # any failure here is reported to every rank in the gathers that follow, never raised alone
                self.mem = torch.zeros(DATA_OFFSET + capacity * part_dtype.itemsize, dtype=torch.uint8, device=device)
                torch.cuda.synchronize(device)  # the flags are zero before any rank can see them
                from .cuda import _cupy
                cupy = _cupy()
                with cupy.cuda.Device(device.index):
                    base = _allocation_base(cupy, self.mem.data_ptr())
                    handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(base))
                offset = self.mem.data_ptr() - base
            except Exception as exc:  # noqa: BLE001 - any failure means: not this way, on every rank
                why = f"cannot make or export its buffer ({(str(exc).splitlines() or [type(exc).__name__])[0][:120]})"
        # what every other rank needs to map this buffer (or why it cannot)
        self.exported = (socket.gethostname(), why, handle, offset)

    def open(self, exported: list) -> str | None:
        """Map every other rank's buffer from their `exported`; None when all are mapped, else why
        not (nothing stays mapped then)."""
        hosts = {host for host, *_ in exported}
        if len(hosts) > 1:
            return f"the ranks span {len(hosts)} hosts"
        bad = next(((r, why) for r, (_, why, _, _) in enumerate(exported) if why), None)
        if bad:
            return f"rank {bad[0]}: {bad[1]}"
        from .cuda import _cupy
        cupy = _cupy()
        data, sig = [], []
        try:
            with cupy.cuda.Device(self.device.index):
                for r, (_, _, handle, offset) in enumerate(exported):
                    if r == self.rank:
                        base = self.mem.data_ptr()
                    else:
                        mapped = cupy.cuda.runtime.ipcOpenMemHandle(handle)
                        self._opened.append(mapped)
                        base = mapped + offset
                    sig.append(base)
                    data.append(base + DATA_OFFSET)
        except Exception as exc:  # noqa: BLE001
            self.close()
            return f"rank {self.rank} cannot map rank {len(sig)}'s buffer ({str(exc).splitlines()[0][:120]})"
        self.table = torch.tensor(data + sig, dtype=torch.int64).to(self.device)
        return None

    def close(self) -> None:
        """Unmap the other ranks' buffers (this rank's own is torch's, freed with the object)."""
        if self._opened:
            from .cuda import _cupy
            cupy = _cupy()
            with cupy.cuda.Device(self.device.index):
                try:
                    torch.cuda.synchronize(self.device)  # no queued kernel still reads through the mappings
                    for p in self._opened:
                        cupy.cuda.runtime.ipcCloseMemHandle(p)
                except Exception:  # noqa: BLE001 - at exit the context may be gone
                    pass
        self._opened, self.table = [], None

    def __del__(self):
        self.close()

    def partial(self, rows: int, dim: int) -> torch.Tensor:
        """This rank's partial [rows, dim] in the mapped buffer (the output GEMM writes it)."""
        n = rows * dim
        return self.mem[DATA_OFFSET:DATA_OFFSET + n * self.part_dtype.itemsize].view(self.part_dtype).view(rows, dim)

    def all_reduce(self, out: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """out [rows, dim] = the sum over ranks of partial(rows, dim) (+ bias), rounded once to out's
        dtype; the same bits on every rank. Queued on torch's current stream, barriers inside."""
        rows, dim = out.shape
        n = rows * dim
        if self.table is None or not out.is_contiguous() or out.dtype != self.out_dtype or n > self.capacity:
            raise ValueError(f"one-shot all-reduce: out must be a contiguous {self.out_dtype} tensor of at most "
                             f"{self.capacity} elements on mapped buffers (got {tuple(out.shape)} {out.dtype})")
        if bias is not None:
            bias = bias.to(self.out_dtype).contiguous()
        vec = dim % 4 == 0 and out.data_ptr() % 16 == 0 and (bias is None or bias.data_ptr() % 16 == 0)
        grid = max(1, min(-(-n // (4 * THREADS)), ONESHOT_BLOCKS))  # n alone: the same grid on every rank
        name = f"peer_allreduce_{DTYPE_SUFFIX[self.part_dtype]}_{DTYPE_SUFFIX[self.out_dtype]}"
        launch(SOURCE, name, out.device, (grid, 1, 1), (THREADS, 1, 1),
               (np.uint64(self.table.data_ptr()), np.uint64(out.data_ptr()),
                np.uint64(0 if bias is None else bias.data_ptr()), np.int32(self.world), np.int32(self.rank),
                np.int64(n), np.int64(dim), np.int32(vec), np.int64((ONESHOT_TIMEOUT_S + self.rank * ONESHOT_STAGGER_S) * 10**9)))
        return out


# ---- one layer's peer paths: their buffers' lifecycle and what the ranks agreed ------------------

class PeerLinks:
    """The peer paths' state of one layer: the p2p reduce-gather's buffers, the one-shot
    all-reduce's, what every rank said about mapping each other's memory (asked once, collectively,
    before the first call that could use it), and whether a CUDA graph captured the buffers (then
    they never move). The output sum (tpattn/outputsum.py) asks it for a call's buffers; the layer
    asks it whether auto may take the one-shot path (agreed()). Every decision here comes from the
    plan or from what every rank said in a gather, so every rank decides alike."""

    def __init__(self, comm, output_collective: str):
        self.comm, self.output_collective = comm, output_collective
        self.p2p = None         # PeerBuffers (output_collective="p2p"), made on the first call
        self.p2p_checked = False
        self.oneshot = None     # OneShotBuffers, made when a call first needs them
        self.said = None        # ((device, partial dtype, dtype), whether every rank mapped every other's buffer)
        self.pinned = False     # a CUDA graph captured the buffers: they must not move

    def agreed(self, part_dtype: torch.dtype, dtype: torch.dtype) -> bool:
        """Whether every rank mapped every other's one-shot buffer for these dtypes."""
        return self.said is not None and self.said[1] and self.said[0][1:] == (part_dtype, dtype)

    def ask(self, candidate: bool, device: torch.device, part_dtype: torch.dtype, dtype: torch.dtype) -> None:
        """output_collective="auto", on the GPU: before the first call whose partials auto would sum
        with the one-shot peer all-reduce (candidate: commplan.oneshot_candidate, from the shape, the
        same on every rank), every rank makes its buffer and tries to map every other's (collective);
        if all of them can, auto uses it for every such call from then on, else NCCL's all-reduce, on
        every rank. Asked again after the layer moved to another device or dtype. Inside a CUDA
        graph capture that the layer did not warm up (graphed() does) nothing is asked."""
        key = (device, part_dtype, dtype)
        if (self.said is not None and self.said[0] == key) or device.type != "cuda" or not candidate \
                or torch.cuda.is_current_stream_capturing():
            return
        self.said = (key, self._map_oneshot(ONESHOT_MAX_BYTES // part_dtype.itemsize, device, part_dtype,
                                            dtype, required=False) is not None)

    def buffers(self, plan, device: torch.device, part_dtype: torch.dtype, dtype: torch.dtype):
        """The peer buffers for a call whose plan takes a peer path (None for the others)."""
        if plan.collective == "p2p":
            return self._p2p_buffers(plan.peer_elements, device, part_dtype, dtype)
        if plan.collective == "oneshot":
            need, p = plan.peer_elements, self.oneshot
            if p is not None and p.capacity >= need and (p.part_dtype, p.out_dtype, p.device) == \
                    (part_dtype, dtype, device):
                return p
            return self._map_oneshot(max(need, ONESHOT_MAX_BYTES // part_dtype.itemsize), device,
                                     part_dtype, dtype, required=True)
        return None

    def pin(self) -> None:
        """A CUDA graph captured the current buffers: from here on they never move."""
        self.pinned = self.p2p is not None or self.oneshot is not None

    def _map_oneshot(self, capacity: int, device, part_dtype, dtype, required: bool):
        """Make this rank's one-shot buffer, map every other rank's (two gathers over the group):
        the buffers when every rank mapped every other's; else None on every rank, or (required)
        the same one-line error on every rank."""
        old = self.oneshot
        if old is not None and self.pinned:
            raise ValueError(f"output_collective='{self.output_collective}': this call needs new one-shot buffers "
                             f"({capacity} elements of {part_dtype}) but a CUDA graph captured by graphed() "
                             "replays the current ones; capture the graph at the largest shape first, or build "
                             "another layer for this shape")
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(f"output_collective='{self.output_collective}': the first call maps the other ranks' "
                             "buffers and cannot run inside a CUDA graph capture; call the layer once before "
                             "capturing (layer.graphed() does)")
        if old is not None:
            old.close()  # this rank's mappings of the others' old buffers; its own stays allocated until every
            # rank has closed its mappings of it (they all have by the first gather below)
        self.oneshot = None
        comm = self.comm
        buf = OneShotBuffers(capacity, part_dtype, dtype, device, comm.rank, comm.world)
        why = buf.open(comm.all_gather_object(buf.exported))
        del old
        bad = next((w for w in comm.all_gather_object(why) if w), None)
        if bad:
            buf.close()
            if required:
                raise ValueError(f"output_collective='oneshot': {bad}; use 'auto' (NCCL where the ranks cannot map "
                                 "each other's memory)")
            return None
        self.oneshot = buf
        return buf

    def _p2p_buffers(self, need: int, device, part_dtype, dtype):
        """output_collective="p2p": the symmetric buffers, made (collectively) on the first call and
        again when a call needs more, unless a CUDA graph captured the current ones (then the call
        is refused: the graph would read and write freed memory). Before the first, every rank says
        whether it can take part and on which host: all of them go on, or all of them raise the
        same one-line error."""
        p = self.p2p
        if p is not None and p.capacity >= need and (p.part_dtype, p.out_dtype, p.device) == \
                (part_dtype, dtype, device):
            return p
        if self.pinned:
            raise ValueError(f"output_collective='p2p': this call needs peer buffers of {need} elements but a CUDA "
                             f"graph captured by graphed() replays the current ones ({getattr(p, 'capacity', 0)}); "
                             "capture the graph at the largest shape first, or build another layer for this shape")
        comm = self.comm
        if not self.p2p_checked:
            import socket
            said = comm.all_gather_object((socket.gethostname(), unavailable(device, part_dtype, dtype)))
            hosts = {host for host, _ in said}
            if len(hosts) > 1:
                raise ValueError(f"output_collective='p2p' needs every rank on one node (these span "
                                 f"{len(hosts)} hosts); use 'auto'")
            bad = [(r, w) for r, (_, w) in enumerate(said) if w]
            if bad:
                raise ValueError(f"output_collective='p2p': rank {bad[0][0]}: {bad[0][1]}; use 'auto'")
            self.p2p_checked = True
        self.p2p = None  # this rank's old buffers go (every rank drops its own here)
        from . import watch
        with watch.collective("peersetup", comm.world, False):  # collective: blocks until every rank came
            self.p2p = PeerBuffers(need, part_dtype, dtype, device, comm.group.group_name, comm.rank, comm.world)
        return self.p2p


def _peer_sum(buf, o_rows: torch.Tensor, wo: torch.Tensor, out: torch.Tensor, bias, kind: str) -> None:
    """tpattn::peer_sum's body: the output GEMM into this rank's mapped partial, then the kernel."""
    mm(o_rows, wo, buf.part_dtype, out=buf.partial(out.shape[0], out.shape[1]))
    (buf.reduce_gather if kind == "p2p" else buf.all_reduce)(out, bias)


IMPLS["peer_sum"] = _peer_sum
