"""The layer as steps: what one call of the layer does on one rank (layer_steps), each step's FLOPs
and bytes, and the collectives it runs; the model (tpattn.model.costmodel) prices them on a machine.
Pure Python: no GPU needed."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from .errors import ModelError

COLLECTIVE_NAMES = ("allreduce", "allgather", "reducescatter")
COMPUTE_ORDER = ("qkv_proj", "qk", "softmax", "pv", "fused", "out_proj")
ELEM = {"fp16": 2, "bf16": 2, "fp32": 4}
KERNELS = ("naive", "tiled", "fused")
STRIDED = {"naive": False, "tiled": False, "fused": True}   # fused reads q, k, v in place
TILE = 128                     # tiled's and fused's query/key tile (kernels/*.cu)
TILED_SMEM_COLS = 16384        # tiled softmax: rows up to this are read once (tpattn/attention/tiled.py)


# ---- the layer, as steps -----------------------------------------------------------------------------


@dataclass
class Shape:
    """The layer's configuration, as python -m tpattn takes it."""
    seq_len: int = 4096
    heads: int = 32
    head_dim: int = 128
    batch: int = 1
    dtype: str = "fp16"
    kernel: str = "naive"
    causal: bool = False
    reduce_dtype: str = "fp32"
    sequence_parallel: bool = False
    overlap: int = 1
    cuda_graph: bool = False
    output_collective: str = "auto"
    kv_heads: int | None = None       # GQA: K/V heads (None: as many as query heads)
    uneven_heads: bool = False        # --uneven-heads: W need not divide H (nor G): ceil/floor blocks per rank
    context_parallel: int = 1         # --context-parallel C: rings of C ranks over the sequence, heads over W / C
    deterministic: bool = False       # --deterministic: the seven-product backward (no atomics), "fused.bwd_det"

    @property
    def model_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    def heads_world(self, world: int) -> int:
        """The ranks the heads split over: W, or with --context-parallel C the W / C of a heads' group."""
        return world // self.context_parallel

    def heads_by_rank(self, world: int) -> list[int]:
        """Query heads each rank of a heads' group owns (tpattn.sharding's layout): H/W each, or with
        --uneven-heads ceil/floor blocks, rank 0 first with the most."""
        from .. import sharding
        t = self.heads_world(world)
        return [len(sharding.head_range(self.heads, t, r, self.uneven_heads, self.kv)) for r in range(t)]

    def heads_per_rank(self, world: int) -> int:
        """Query heads of rank 0, which holds the most: the rank the collective waits for."""
        from .. import sharding
        return len(sharding.head_range(self.heads, self.heads_world(world), 0, self.uneven_heads, self.kv))

    def kv_per_rank(self, world: int) -> int:
        """K/V heads rank 0 holds: G/W of them (with --uneven-heads ceil(G/W)), or (more ranks than
        K/V heads) a copy of one."""
        from .. import sharding
        return len(sharding.kv_head_range(self.heads, self.kv, self.heads_world(world), 0, self.uneven_heads))

    @property
    def elem(self) -> int:
        return ELEM[self.dtype]

    def part_elem(self, world: int) -> int:
        """Bytes per element of the output GEMM's result (the partials when W > 1)."""
        if world == 1:
            return self.elem
        return 4 if self.reduce_dtype == "fp32" else self.elem


@dataclass
class Step:
    """One piece of work of one rank. unit: the peak its FLOPs run against ("tensor": fp16/bf16
    tensor cores, "fp32": CUDA-core FMA, "": none); key: the efficiency curve it uses."""
    name: str          # the pass it is timed under (qkv_proj, qk, ..., other)
    key: str           # efficiency curve: qkv_proj, out_proj, naive.qk, fused.fused, relayout, epilogue
    flops: float = 0.0
    bytes: float = 0.0
    unit: str = ""
    causal: bool = False
    what: str = ""
    bh: int = 0        # attention passes: batch x heads and the sequence length (their calibration grid)
    n: int = 0


def gemm_step(name: str, key: str, m: int, k: int, n: int, dtype: str, out: str, what: str = "") -> Step:
    """C[m, n] = A[m, k] @ B[k, n]: 2mkn FLOPs; A and B read once, C written once."""
    e, eo = ELEM[dtype], ELEM[out]
    return Step(name, key, flops=2.0 * m * k * n, bytes=float(e * (m * k + k * n) + eo * m * n),
                unit="fp32" if dtype == "fp32" else "tensor", what=what or f"GEMM [{m} x {k}] x [{k} x {n}] -> {out}")


def copy_step(name: str, key: str, nbytes: float, what: str) -> Step:
    """A memory-bound pass: nbytes read + written in all."""
    return Step(name, key, bytes=float(nbytes), what=what)


def attention_steps(kernel: str, b: int, h: int, n: int, d: int, dtype: str, causal: bool,
                    kv_h: int | None = None) -> list[Step]:
    """The local attention passes of h query heads (kv_h K/V heads, GQA), with the bytes each
    kernel really moves to and from device memory (not the re-reads that the caches absorb)."""
    e = ELEM[dtype]
    bh = b * h
    flops_mm = 2.0 * bh * n * n * d                      # one of the two products, all of it
    tri = (n + 1) / (2 * n) if causal else 1.0            # causal: keys j <= i of each row
    tiles = -(-n // TILE)
    tri_t = (tiles + 1) / (2 * tiles) if causal else 1.0  # causal: tiles on or below the diagonal
    qkv_io = bh * n * d * e                               # Q or O
    kv_io = b * (kv_h or h) * n * d * e                   # K or V
    steps = _attention_steps(kernel, bh, n, d, e, causal, flops_mm, tri, tri_t, qkv_io, kv_io)
    for s in steps:
        s.bh, s.n = bh, n
    return steps


def _attention_steps(kernel, bh, n, d, e, causal, flops_mm, tri, tri_t, qkv_io, kv_io) -> list[Step]:
    if kernel == "naive":
        s = bh * n * n * e                                 # S (and as many for P), written in full
        unit = "fp32"                                      # one thread per score: CUDA-core FMA
        return [
            Step("qk", "naive.qk", flops=flops_mm * tri, bytes=qkv_io + kv_io + s, unit=unit, causal=causal,
                 what="one thread per score: reads Q, K, writes S (N x N)"),
            Step("softmax", "naive.softmax", flops=5.0 * bh * n * n * tri, bytes=s * tri + s, unit="fp32",
                 causal=causal, what="one block per row: reads S, writes P"),
            Step("pv", "naive.pv", flops=flops_mm * tri, bytes=s * tri + kv_io + qkv_io, unit=unit, causal=causal,
                 what="one thread per output: reads P, V, writes O"),
        ]
    if kernel == "tiled":
        ld = -(-n // 8) * 8                                # S/P rows padded to 16 bytes
        s = bh * n * ld * e
        reads = 2 if n > TILED_SMEM_COLS else 1            # longer rows are read twice by the softmax
        return [
            Step("qk", "tiled.qk", flops=flops_mm * tri_t, bytes=qkv_io + kv_io + s * tri_t, unit="tensor",
                 causal=causal, what="tensor-core tiles: reads Q, K, writes S"),
            Step("softmax", "tiled.softmax", flops=5.0 * bh * n * n * tri, bytes=s * tri * reads + s * tri_t,
                 unit="fp32", causal=causal, what=f"a warp per row: reads S{' twice' if reads == 2 else ''}, writes P"),
            Step("pv", "tiled.pv", flops=flops_mm * tri_t, bytes=s * tri_t + kv_io + qkv_io, unit="tensor",
                 causal=causal, what="tensor-core tiles: reads P, V, writes O"),
        ]
    if kernel == "fused":
        return [Step("fused", "fused.fused", flops=2 * flops_mm * tri_t, bytes=2 * qkv_io + 2 * kv_io, unit="tensor",
                     causal=causal, what="one kernel, online softmax: reads Q, K, V, writes O (S, P on chip)")]
    raise ModelError(f"no cost model for --kernel {kernel}; the model covers {', '.join(KERNELS)}")


def attention_backward_step(kernel: str, b: int, h: int, n: int, d: int, dtype: str, causal: bool,
                            kv_h: int | None = None, deterministic: bool = False) -> Step:
    """The fused attention backward of h query heads as one pass. The default, five products (hbwd_pre,
    hbwd5_kv, hbwd_dq_out): S, dP, dV, dK and dQ += dS K, 2.5x the forward's FLOPs; reads Q, K, V, O,
    dO, writes dQ, dK, dV, and the fp32 dQ sum zeroed, then read back ("fused.bwd"). deterministic:
    seven products and no atomics (hbwd_pre, the dK/dV kernel's S^T, dP^T, dV, dK, the dQ kernel's S,
    dP, dQ), 3.5x the forward's FLOPs; O and dO read by the pre-pass, Q and dO by both kernels, K and V
    by both, dK, dV and dQ written ("fused.bwd_det", calibrated apart)."""
    if kernel != "fused":
        raise ModelError(f"the cost model prices the backward of --kernel fused only (not {kernel})")
    e = ELEM[dtype]
    bh = b * h
    tiles = -(-n // TILE)
    tri_t = (tiles + 1) / (2 * tiles) if causal else 1.0
    q_io, kv_io = bh * n * d * e, b * (kv_h or h) * n * d * e
    if deterministic:
        return Step("attn_bwd", "fused.bwd_det", flops=7 * 2.0 * bh * n * n * d * tri_t,
                    bytes=7 * q_io + 6 * kv_io, unit="tensor", causal=causal, bh=bh, n=n,
                    what="seven products, no atomics: a key block's S^T, dP^T, dV, dK, then a query block's S, dP, dQ")
    return Step("attn_bwd", "fused.bwd", flops=5 * 2.0 * bh * n * n * d * tri_t,
                bytes=5 * q_io + 4 * kv_io + 2 * bh * n * d * 4, unit="tensor", causal=causal, bh=bh, n=n,
                what="five products a key block (S, dP, dV, dK, dQ += dS K into an fp32 sum)")


def backward_steps(shape: Shape, world: int) -> tuple[list[Step], dict[str, int]]:
    """(compute steps, {collective: bytes}) of the backward of one call on one rank: the output
    GEMM's two (dA = dY W_o^T, dW_o = A^T dY), the attention backward (which writes dq, dk and dv
    into the QKV gradient's rows itself: the layer's packed path, attention_packed), the QKV GEMM's
    two (dX = dQKV W^T, dW = X^T dQKV) and copy_to_ranks's dual, the all-reduce of dX
    (tpattn/comm.py) over the heads' ranks. --context-parallel C: this rank's N / C rows, and the
    attention backward is the ring's (ring_backward_plan: its steps' compute here, its passes priced
    by the cost model's ring_backward_ms). --kernel fused; not --sequence-parallel."""
    err = _layout_error(shape, world)
    if err:
        raise ModelError(err)
    if shape.sequence_parallel:
        raise ModelError("the cost model prices the backward of head parallelism and of the ring (not "
                         "--sequence-parallel)")
    B, N, D, d, dt = shape.batch, shape.seq_len, shape.model_dim, shape.head_dim, shape.dtype
    h, g = shape.heads_per_rank(world), shape.kv_per_rank(world)
    rows, cols, e = B * N // shape.context_parallel, (h + 2 * g) * d, shape.elem
    if shape.context_parallel > 1:
        attn = [x for step in ring_backward_plan(shape, world) for x in step["compute"]]
    else:
        attn = [attention_backward_step(shape.kernel, B, h, N, d, dt, shape.causal, g, shape.deterministic)]
    steps = [gemm_step("bwd_out_proj", "out_proj", rows, D, h * d, dt, dt, "dA = dY W_o^T"),
             gemm_step("bwd_out_proj", "out_proj", h * d, rows, D, dt, dt, "dW_o = A^T dY"),
             *attn,
             gemm_step("bwd_qkv_proj", "qkv_proj", rows, cols, D, dt, dt, "dX = dQKV W^T"),
             gemm_step("bwd_qkv_proj", "qkv_proj", D, rows, cols, dt, dt, "dW = X^T dQKV")]
    colls = {"allreduce": rows * D * e} if shape.heads_world(world) > 1 else {}
    return steps, colls


def layer_collectives(shape: Shape, world: int) -> dict[str, int]:
    """{name: bytes} of the collectives one call runs, in order: the layer's own communication plan
    (tpattn.commplan.make_plan, the rule the layer runs by, for ranks that do not map each other's
    memory: the model prices NCCL's collectives, not auto's one-shot peer sum of small partials on
    one node). A configuration the layer refuses, or one the model has no price for (the peer
    kernels), raises ModelError with one line."""
    from ..commplan import make_plan
    from ..errors import ConfigError
    world, rows = shape.heads_world(world), shape.seq_len // shape.context_parallel  # a heads' group's ranks, rows
    if world == 1:
        return {}
    try:
        plan = make_plan(shape.batch, rows, shape.model_dim, world, elem=shape.elem,
                         part_elem=shape.part_elem(world), sequence_parallel=shape.sequence_parallel,
                         output_collective=shape.output_collective, overlap=shape.overlap)
    except ConfigError as exc:
        raise ModelError(str(exc)) from None
    got = plan.nbytes
    unknown = [k for k in got if k not in COLLECTIVE_NAMES]
    if unknown == ["peer"]:
        raise ModelError("the cost model has no price for --output-collective p2p (the peer kernel over NVLink, not "
                         "an NCCL collective); plan with --output-collective auto, allreduce or split, or time p2p "
                         "with python -m tpattn")
    if unknown:
        raise ModelError(f"the layer runs a collective the model does not know: {unknown[0]}")
    return dict(got)


def _layout_error(shape: Shape, world: int) -> str | None:
    """Why H query heads (and G K/V heads) cannot be laid out over `world` ranks, or None."""
    from .. import sharding
    C = shape.context_parallel
    if C > 1:
        if world % C:
            return f"--context-parallel {C} does not divide {world} ranks (rings of C ranks, the heads over W / C)"
        if shape.seq_len % (2 * C):
            return f"--context-parallel {C} splits the sequence into 2 x {C} chunks: --seq-len {shape.seq_len} must divide by {2 * C}"
        if shape.sequence_parallel:
            return "--context-parallel and --sequence-parallel both split the sequence: choose one"
        if shape.kernel != "fused":
            return (f"the ring's pieces run torch math with --kernel {shape.kernel} (no logsumexp from its kernels); the cost "
                    "model prices the ring with --kernel fused")
    world = shape.heads_world(world)
    if shape.kv != shape.heads:
        return sharding.check_kv_heads(shape.heads, shape.kv, world, shape.uneven_heads)
    return sharding.check_divisible(shape.heads, world, shape.uneven_heads)


def layer_steps(shape: Shape, world: int) -> tuple[list[Step], dict[str, int]]:
    """(compute steps of one rank, {collective: bytes}) for one call of the layer at world size W.
    With --uneven-heads the rank is rank 0, which holds the most heads (ceil(H/W), or ceil(G/W) K/V
    groups): the largest rank's compute, which is what the collective waits for."""
    err = _layout_error(shape, world)
    if err:
        raise ModelError(err)
    B, N, D, d, dt = shape.batch, shape.seq_len, shape.model_dim, shape.head_dim, shape.dtype
    h, g = shape.heads_per_rank(world), shape.kv_per_rank(world)
    e = shape.elem
    colls = layer_collectives(shape, world)
    C = shape.context_parallel
    n = N // C                                         # head- and sequence-parallel: every rank projects all N rows
    rows = B * n
    steps = [gemm_step("qkv_proj", "qkv_proj", rows, D, (h + 2 * g) * d, dt, dt)]
    if not STRIDED.get(shape.kernel, False):
        steps.append(copy_step("qkv_proj", "relayout", 2 * (h + 2 * g) * B * N * d * e,
                               "q, k, v copied out of the QKV GEMM's rows"))
    if C > 1:
        steps.append(copy_step("qkv_proj", "relayout", 2 * 2 * g * rows * d * e, "k, v made contiguous (the ring's blocks)"))
        steps += [s for step in ring_plan(shape, world) for s in step["compute"]]
        steps.append(copy_step("other", "relayout", rows * h * d * (4 + e + 2 * e),
                               "the fp32 output cast, o copied into the output GEMM's rows"))
    else:
        steps += attention_steps(shape.kernel, B, h, N, d, dt, shape.causal, g)
    if not STRIDED.get(shape.kernel, False):
        steps.append(copy_step("other", "relayout", 2 * B * h * N * d * e, "o copied into the output GEMM's rows"))
    t = shape.heads_world(world)
    pe = shape.part_elem(t)
    out = {2: "fp16" if dt != "bf16" else "bf16", 4: "fp32"}[pe] if t > 1 else dt
    steps.append(gemm_step("out_proj", "out_proj", rows, h * d, D, dt, out))
    if t > 1:  # + b_o and the cast to the model dtype: on every row, or on this rank's 1/W after a reduce-scatter
        mine = rows if "allreduce" in colls else rows // t
        steps.append(copy_step("other", "epilogue", mine * D * (pe + e),
                               f"+ b_o and the cast of {mine} rows of partials"))
    return steps, colls


MERGE_PASSES = 2.5  # fp32 passes over a piece's output in kernels/ring_merge.cu: o read and written, o_b (16-bit) read
SUM_PASSES = 2.5    # fp32 passes over a block's dK and dV sums a ring step (ring.block_sums): sums read and
                    # written, the pieces' parts (16-bit) read


def ring_plan(shape: Shape, world: int) -> list[dict]:
    """The ring's C steps on one rank (--context-parallel C; rank 0 of its ring: the zigzag layout
    gives every rank the same work): {"compute": the step's fused pieces and their merges into the
    fp32 output, "send_bytes": the K/V block posted to the next rank before that compute (0 on the
    last step)}. A piece of nq query rows against nk keys runs as the fused kernel over nq / nk
    times the heads of nk rows (tpattn.attention.ring._by_rows); GQA: only this rank's K/V heads
    travel."""
    from ..attention.ring import pieces
    B, d, dt, C = shape.batch, shape.head_dim, shape.dtype, shape.context_parallel
    h, g = shape.heads_per_rank(world), shape.kv_per_rank(world)
    n = shape.seq_len // C
    block = 2 * B * g * n * d * shape.elem
    out = []
    for s in range(C):
        compute = []
        for q0, q1, k0, k1, diag in pieces(0, (0 - s) % C, n, shape.causal):
            nq, nk = q1 - q0, k1 - k0
            for st in attention_steps("fused", B, h * (nq // nk), nk, d, dt, diag, g):
                st.what = f"ring step {s}: {nq} query rows x {nk} keys" + (" (diagonal)" if diag else "")
                compute.append(st)
            compute.append(copy_step("fused", "epilogue", MERGE_PASSES * 4 * B * h * nq * d,
                                     f"ring step {s}: merge {nq} rows into the fp32 output by their logsumexp"))
        out.append({"compute": compute, "send_bytes": block if s < C - 1 else 0})
    return out


def ring_backward_plan(shape: Shape, world: int) -> list[dict]:
    """The ring's backward on one rank (tpattn/comm.py's ring pair; rank 0 of its ring, as ring_plan):
    C steps of {"compute": the pieces' five-product backward (each piece's dQ added into the rank's
    fp32 sum; --deterministic: seven products, then a pass that adds the piece's dQ into that sum) and
    the block's dK, dV sums (block_sums), "send_bytes": the next K/V block, posted
    before that compute (0 on the last step), "sums_bytes": the block's fp32 dK, dV sums, posted
    after it to travel under the next step's compute (the last step's: the hop home, under none)}."""
    from ..attention.ring import pieces
    B, d, dt, C = shape.batch, shape.head_dim, shape.dtype, shape.context_parallel
    h, g = shape.heads_per_rank(world), shape.kv_per_rank(world)
    n = shape.seq_len // C
    block = 2 * B * g * n * d * shape.elem
    sums = 2 * B * g * n * d * 4
    out = []
    for s in range(C):
        compute = []
        for q0, q1, k0, k1, diag in pieces(0, (0 - s) % C, n, shape.causal):
            nq, nk = q1 - q0, k1 - k0
            st = attention_backward_step("fused", B, h * (nq // nk), nk, d, dt, diag, g, shape.deterministic)
            st.what = f"ring step {s} backward: {nq} query rows x {nk} keys" + (" (diagonal)" if diag else "")
            compute.append(st)
            if shape.deterministic:  # the piece's dQ (16-bit) added into the rank's fp32 sum (ring.RowsDq)
                compute.append(copy_step("attn_bwd", "epilogue", B * h * nq * d * (shape.elem + 8),
                                         f"ring step {s}: the piece's dQ added into the rank's fp32 dQ sum"))
        compute.append(copy_step("attn_bwd", "epilogue", SUM_PASSES * sums,
                                 f"ring step {s}: this rank's dK, dV added into the block's fp32 sums"))
        out.append({"compute": compute, "send_bytes": block if s < C - 1 else 0, "sums_bytes": sums})
    return out
