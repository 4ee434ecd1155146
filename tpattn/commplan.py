"""The communication plan: what one call of the layer communicates, decided before it does.

`make_plan` decides, from the shape, the world size, the style, the dtypes' sizes and the overlap
(never from the attention backend), which collective sums the outputs, the row chunks, the bytes
each collective moves and the peer buffers' size. The layer (through tpattn/comm.py), the config
checks (tpattn/config.py), the report and the cost model (tpattn/model) all read it: the rule
lives here once. Pure: no process group, no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError, is_count
from .sharding import row_chunks, rows_split

OUTPUT_COLLECTIVES = ("auto", "allreduce", "split", "p2p", "oneshot")  # head-parallel: how the partials are summed
# auto sums partial outputs of at most this many bytes with the one-shot peer all-reduce when every rank
# can map every other's memory (one node): a decode step's B x D values, up to B x T x D = 128 Ki fp32
# values (32 rows of D = 4096). NCCL's all-reduce costs 10-20 us at these sizes however few bytes move;
# the one-shot kernel reads (W - 1) x this over NVLink, about 1.3 us at W = 2. Larger sums go to NCCL.
ONESHOT_MAX_BYTES = 512 * 1024
ROW_ALIGN = 128  # overlap chunks start at multiples of this (the fused kernel's row tile) when N allows
# the collectives by label, as the report and the watch name them
COLLECTIVES = {"allreduce": "all-reduce", "allgather": "all-gather", "reducescatter": "reduce-scatter",
               "peer": "peer reduce-gather",  # peer: --output-collective p2p, both collectives in one kernel
               "oneshot": "one-shot peer all-reduce",  # small partials, one kernel reads every rank's
               # the backward's (a training step): the duals of the forward's
               "bwd_allreduce": "all-reduce (backward: dX)",
               "bwd_copies": "all-reduce (backward: K/V copies' weights)",
               "bwd_copies_bias": "all-reduce (backward: K/V copies' biases)", "bwd_allgather": "all-gather (backward: dy)",
               "bwd_reducescatter": "reduce-scatter (backward: dX)",
               # context parallelism: what each rank sends to the next one of its ring (peer to peer)
               "ring": "ring pass (K/V blocks)", "bwd_ring": "ring pass (backward: K/V blocks)",
               "bwd_ring_grads": "ring pass (backward: dK, dV home)",
               "bwd_ring_weights": "all-reduce over the ring (backward: replicated weights)"}
RING_PASSES = ("ring", "bwd_ring", "bwd_ring_grads")  # bytes: what one rank sends in one call, all its passes


# ---- the plan ------------------------------------------------------------------------------------

def check_style(seq_len: int | None, world: int, sequence_parallel: bool, output_collective: str,
                overlap: int) -> None:
    """The style and collective rules that need only the shape: raise ConfigError (one line that
    names the fix) for the first broken one. Every rank gets the same answer. seq_len None: only
    the rules that hold for every length (the layer's constructor)."""
    if not is_count(overlap):
        raise ConfigError(f"--overlap must be at least 1 chunk (got {overlap!r}), a whole number; 1 turns it off")
    if output_collective not in OUTPUT_COLLECTIVES:
        raise ConfigError(f"unknown --output-collective {output_collective!r}; choose one of "
                          f"{', '.join(OUTPUT_COLLECTIVES)}")
    if sequence_parallel and output_collective != "auto":
        raise ConfigError(f"--output-collective {output_collective} is for the head-parallel style; "
                          "--sequence-parallel always reduce-scatters: drop one of them")
    if output_collective in ("p2p", "oneshot") and overlap > 1:
        raise ConfigError(f"--output-collective {output_collective} sums all rows in one pass and does not overlap; "
                          f"drop --overlap {overlap} or use --output-collective auto")
    if seq_len is None:
        return
    if sequence_parallel:
        if seq_len % world:
            lo = seq_len - seq_len % world
            raise ConfigError(f"--sequence-parallel needs --seq-len divisible by the world size {world} (got "
                              f"{seq_len}); use --seq-len {lo or world} or {lo + world}, or drop --sequence-parallel")
        n = seq_len // world
        if n % overlap:
            ok = [k for k in range(1, min(n, 64) + 1) if n % k == 0]
            raise ConfigError(f"--overlap {overlap} with --sequence-parallel needs the {n} rows of each rank "
                              f"divisible by it; use --overlap in {{{', '.join(map(str, ok))}}}")
    elif overlap > seq_len:
        raise ConfigError(f"--overlap {overlap} is more chunks than the {seq_len} rows of --seq-len; use fewer")


def query_chunks(seq_len: int, overlap: int) -> list[tuple[int, int]]:
    """The head-parallel layer's overlap chunks of the query rows: at multiples of ROW_ALIGN when
    every chunk can have that many rows, else of one row. The same for every backend."""
    align = ROW_ALIGN if seq_len >= ROW_ALIGN * overlap else 1
    return row_chunks(seq_len, overlap, align)


@dataclass(frozen=True)
class CommPlan:
    """What one call of the layer communicates, decided before it does.

    collective: "none" (one rank), "allreduce", "split" (reduce-scatter + all-gather), "p2p" (the
    peer reduce-gather kernel), "oneshot" (the one-shot peer all-reduce) or "sequence" (sequence
    parallel: all-gather of x, reduce-scatter of the partials).
    chunks: the overlap chunks of the rows, [r0, r1): head-parallel of the N query rows, sequence
    parallel of the N/W rows of each rank's block."""
    world: int
    batch: int
    seq_len: int          # N, the whole sequence (sequence parallel: every rank's block is N / W)
    model_dim: int
    elem: int             # bytes of the model dtype
    part_elem: int        # bytes of the partial outputs (fp32, or the model dtype)
    overlap: int
    collective: str
    chunks: tuple[tuple[int, int], ...]

    @property
    def x_bytes(self) -> int:
        return self.batch * self.seq_len * self.model_dim * self.elem

    @property
    def partial_bytes(self) -> int:
        return self.batch * self.seq_len * self.model_dim * self.part_elem

    @property
    def nbytes(self) -> dict[str, int]:
        """{collective label: bytes of the whole tensor it moves per call} (nccl-tests' "size"), in order."""
        return {"none": {}, "allreduce": {"allreduce": self.partial_bytes},
                "split": {"reducescatter": self.partial_bytes, "allgather": self.x_bytes},
                "p2p": {"peer": self.partial_bytes + self.x_bytes}, "oneshot": {"oneshot": self.partial_bytes},
                "sequence": {"allgather": self.x_bytes, "reducescatter": self.partial_bytes}}[self.collective]

    @property
    def peer_elements(self) -> int:
        """Elements of each peer buffer a call needs (the whole partial [B, N, D]); 0 off the peer paths."""
        return self.batch * self.seq_len * self.model_dim if self.collective in ("p2p", "oneshot") else 0


def make_plan(batch: int, seq_len: int, model_dim: int, world: int, *, elem: int, part_elem: int,
              sequence_parallel: bool = False, output_collective: str = "auto", overlap: int = 1,
              peers: bool = False) -> CommPlan:
    """The plan for one call of B x N rows (N the whole sequence). Raises ConfigError for what the
    layer cannot run (check_style's rules, and a split whose rows do not divide by the world).
    peers: every rank can map every other's memory (the layer asks them once, on the GPU, before
    the first call that could use it: oneshot_candidate); auto then sums partials of at most
    ONESHOT_MAX_BYTES with the one-shot peer all-reduce."""
    check_style(seq_len, world, sequence_parallel, output_collective, overlap)
    common = dict(world=world, batch=batch, seq_len=seq_len, model_dim=model_dim, elem=elem,
                  part_elem=part_elem, overlap=overlap)
    if sequence_parallel and world > 1:
        n = seq_len // world
        return CommPlan(**common, collective="sequence", chunks=tuple(row_chunks(n, overlap)))
    chunks = tuple(query_chunks(seq_len, overlap))
    if world == 1:
        return CommPlan(**common, collective="none", chunks=chunks)
    divides = rows_split(batch, chunks, world)
    if output_collective == "split" and not divides:
        rows = next(r1 - r0 for r0, r1 in chunks if not rows_split(batch, [(r0, r1)], world))
        fix = (f"a --seq-len divisible by {world}" if overlap == 1 or seq_len % world else
               f"an --overlap whose chunks of --seq-len {seq_len} each divide by {world} (--overlap {overlap} cuts it "
               f"into chunks of {rows} rows and others)")
        raise ConfigError(f"--output-collective split needs --batch x the rows of each chunk divisible by the "
                          f"world size {world} (a chunk has {rows} rows); use --output-collective allreduce "
                          f"or auto, or {fix}")
    if output_collective in ("allreduce", "p2p", "oneshot"):
        how = output_collective
    elif peers and oneshot_candidate(batch, seq_len, model_dim, world, part_elem=part_elem,
                                     sequence_parallel=sequence_parallel, output_collective=output_collective,
                                     overlap=overlap):
        how = "oneshot"
    elif output_collective == "split" or (divides and part_elem > elem):
        how = "split"
    else:
        how = "allreduce"
    return CommPlan(**common, collective=how, chunks=chunks)


def oneshot_candidate(batch: int, seq_len: int, model_dim: int, world: int, *, part_elem: int,
                      sequence_parallel: bool = False, output_collective: str = "auto", overlap: int = 1) -> bool:
    """Whether auto would sum this call's partials with the one-shot peer all-reduce if the ranks can
    map each other's memory: head-parallel, several ranks, one chunk, at most ONESHOT_MAX_BYTES."""
    return (output_collective == "auto" and world > 1 and not sequence_parallel and overlap == 1
            and batch * seq_len * model_dim * part_elem <= ONESHOT_MAX_BYTES)
