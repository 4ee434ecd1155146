"""A cost model of the layer: predicted time of every pass, per world size, before it runs.

What one call of the layer does on one rank is written down as a list of steps (layer_steps), the
same passes that tpattn/layer.py runs and its timers name:

    qkv_proj    one GEMM [B*N, D] x [D, 3*h*d] (bias in its epilogue); kernels that need contiguous
                q, k, v (naive, tiled) also copy them out of the GEMM's output inside this pass
    qk, softmax, pv (naive, tiled) or fused      the local attention of h = H/W heads (--uneven-heads:
                rank 0's ceil(H/W), the most any rank holds, which the collective waits for)
    out_proj    one GEMM [B*N, h*d] x [h*d, D]: fp32 partials when W > 1 and --reduce-dtype fp32,
                the model dtype with the bias in its epilogue when W = 1
    the collectives, by the names and bytes of layer.collective_nbytes(B, N)
    other       untimed work in the call: the bias + cast of the summed partials, the copy of o
                into the output GEMM's rows (naive, tiled), and a per-call overhead

A compute step costs its roofline time, max(FLOPs / peak FLOP rate, bytes / memory bandwidth),
divided by an efficiency that calibration measured for that step (kernel pass) on the machine,
interpolated in log(roofline time) between the calibration points (clamped at both ends): naive's
qk runs at ~2 % of the fp32 roofline, tiled's softmax at ~90 % of the memory roofline. A
collective costs the alpha-beta time of NCCL's ring: base + steps x alpha + the bus bytes / bus
bandwidth, where an all-reduce moves 2(W-1)/W of the tensor and takes 2(W-1) steps, an all-gather
or a reduce-scatter (W-1)/W and W-1 steps. Over several nodes the collective is hierarchical:
inside each node over NVLink, across nodes over every GPU's own network link carrying 1/g of the
bytes (g GPUs per node); NCCL pipelines the chunks through both, so the slower phase's bandwidth
term sets the time and every step's latency adds.

The end to end time is max(GPU time, host time) + stall: the sum of the steps plus the per-call
overhead, unless the Python call itself takes longer: its host time, calibrated per kernel and world
size (layer.host_ms_by_world: the W-rank layer's host time as --calibrate measures it, its quietest
round: the host of a quiet machine, which another process only ever slows), or for a
world size not calibrated (and in files without it) the 1-rank host_ms + host_ms_per_collective
each. The stall is the time of an eager call that neither accounts for: the GPU idle until the
call's first launch, and at a collective until the last rank's launch reaches it (layer.stall_ms,
layer.stall_ms_by_world: the un-spun call's end to end minus max(its host time, its GPU time), as
--calibrate measures them; 0 in files without them and under a CUDA graph).

Machine descriptions are JSON files (tpattn/machines/*.json or any path); see load_machine and
docs/plan.md for the fields. Everything here is pure Python: no GPU needed.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

MACHINE_DIR = Path(__file__).resolve().parent / "machines"
COLLECTIVE_NAMES = ("allreduce", "allgather", "reducescatter")
COMPUTE_ORDER = ("qkv_proj", "qk", "softmax", "pv", "fused", "out_proj")
ELEM = {"fp16": 2, "bf16": 2, "fp32": 4}
KERNELS = ("naive", "tiled", "fused")
STRIDED = {"naive": False, "tiled": False, "fused": True}   # fused reads q, k, v in place
TILE = 128                     # tiled's and fused's query/key tile (kernels/*.cu)
TILED_SMEM_COLS = 16384        # tiled softmax: rows up to this are read once (tpattn/attention/tiled.py)


class MachineError(ValueError):
    """A machine description that cannot be used: the message is one line that names the fix."""


class ModelError(ValueError):
    """A prediction the machine description cannot make (a missing calibration, no network)."""


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

    @property
    def model_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    def heads_by_rank(self, world: int) -> list[int]:
        """Query heads each rank owns (tpattn.sharding's layout): H/W each, or with --uneven-heads
        ceil/floor blocks, rank 0 first with the most."""
        from . import sharding
        return [len(sharding.head_range(self.heads, world, r, self.uneven_heads, self.kv)) for r in range(world)]

    def heads_per_rank(self, world: int) -> int:
        """Query heads of rank 0, which holds the most: the rank the collective waits for."""
        from . import sharding
        return len(sharding.head_range(self.heads, world, 0, self.uneven_heads, self.kv))

    def kv_per_rank(self, world: int) -> int:
        """K/V heads rank 0 holds: G/W of them (with --uneven-heads ceil(G/W)), or (more ranks than
        K/V heads) a copy of one."""
        from . import sharding
        return len(sharding.kv_head_range(self.heads, self.kv, world, 0, self.uneven_heads))

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


def layer_collectives(shape: Shape, world: int) -> dict[str, int]:
    """{name: bytes} of the collectives one call runs, in order, as the layer itself says
    (TensorParallelAttention.collective_nbytes on a layer built on the meta device, so it follows
    whatever tpattn/layer.py runs); the model's own reading of the layer if that cannot be built."""
    if world == 1:
        return {}
    try:
        return _collectives_from_layer(shape, world)
    except Exception:  # noqa: BLE001 - an older or newer layer this cannot build: the fallback below
        pass
    x = shape.batch * shape.seq_len * shape.model_dim
    part = x * shape.part_elem(world)
    if shape.sequence_parallel:
        return {"allgather": x * shape.elem, "reducescatter": part}
    split = shape.output_collective == "split" or (
        shape.output_collective == "auto" and shape.part_elem(world) > shape.elem
        and (shape.batch * shape.seq_len) % world == 0)
    if split:
        return {"reducescatter": part, "allgather": x * shape.elem}
    return {"allreduce": part}


def _collectives_from_layer(shape: Shape, world: int) -> dict[str, int]:
    import torch

    from .layer import TensorParallelAttention
    D, hd = shape.model_dim, shape.heads * shape.head_dim
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[shape.dtype]
    meta = lambda *s: torch.empty(*s, dtype=dt, device="meta")  # noqa: E731 - no memory at all
    kw = dict(heads=shape.heads, head_dim=shape.head_dim, backend=shape.kernel, causal=shape.causal, group=None,
              reduce_dtype=shape.reduce_dtype, sequence_parallel=shape.sequence_parallel, overlap=shape.overlap,
              output_collective=shape.output_collective)
    accepted = inspect.signature(TensorParallelAttention.__init__).parameters
    layer = TensorParallelAttention(meta(D, hd), meta(D, hd), meta(D, hd), meta(hd, D),
                                    **{k: v for k, v in kw.items() if k in accepted})
    layer.world, layer.local_heads = world, shape.heads_per_rank(world)  # rank 0 of a W-way layer
    got = layer.collective_nbytes(shape.batch, shape.seq_len)
    unknown = [k for k in got if k not in COLLECTIVE_NAMES]
    if unknown:
        raise ModelError(f"the layer runs a collective the model does not know: {unknown[0]}")
    return dict(got)


def _layout_error(shape: Shape, world: int) -> str | None:
    """Why H query heads (and G K/V heads) cannot be laid out over `world` ranks, or None."""
    from . import sharding
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
    rows = B * N                                       # both styles: every rank projects all N rows
    steps = [gemm_step("qkv_proj", "qkv_proj", rows, D, (h + 2 * g) * d, dt, dt)]
    if not STRIDED.get(shape.kernel, False):
        steps.append(copy_step("qkv_proj", "relayout", 2 * (h + 2 * g) * B * N * d * e,
                               "q, k, v copied out of the QKV GEMM's rows"))
    steps += attention_steps(shape.kernel, B, h, N, d, dt, shape.causal, g)
    if not STRIDED.get(shape.kernel, False):
        steps.append(copy_step("other", "relayout", 2 * B * h * N * d * e, "o copied into the output GEMM's rows"))
    pe = shape.part_elem(world)
    out = {2: "fp16" if dt != "bf16" else "bf16", 4: "fp32"}[pe] if world > 1 else dt
    steps.append(gemm_step("out_proj", "out_proj", rows, h * d, D, dt, out))
    if world > 1:  # + b_o and the cast to the model dtype: on every row, or on this rank's 1/W after a reduce-scatter
        mine = rows if "allreduce" in colls else rows // world
        steps.append(copy_step("other", "epilogue", mine * D * (pe + e),
                               f"+ b_o and the cast of {mine} rows of partials"))
    return steps, colls


# ---- the machine ---------------------------------------------------------------------------------------


REQUIRED = {
    "name": str, "gpu": str, "gpus_per_node": int, "memory_GiB": (int, float),
    "peaks": dict, "sources": dict,
}
PEAKS = ("tensor_tflops", "fp32_tflops", "mem_GBps")
LINK_FIELDS = ("busbw_GBps", "step_us", "base_us")
WAKE_FIELDS = ("wake_us", "idle_ms")   # optional, both or neither: the link's wake-up after an idle time
PASS_KEYS = ("qkv_proj", "out_proj", "relayout", "epilogue", "naive.qk", "naive.softmax", "naive.pv",
             "tiled.qk", "tiled.softmax", "tiled.pv", "fused.fused")


@dataclass
class Machine:
    name: str
    data: dict                    # the merged JSON
    path: str
    curves: dict = field(default_factory=dict)  # key -> [(log roofline ms, efficiency)], computed at load

    @property
    def gpus_per_node(self) -> int:
        return int(self.data["gpus_per_node"])

    @property
    def max_nodes(self) -> int | None:
        v = self.data.get("max_nodes")
        return None if v is None else int(v)

    @property
    def memory_bytes(self) -> int:
        return int(self.data["memory_GiB"] * 2**30)

    def peak(self, name: str) -> float:
        return float(self.data["peaks"][name])

    def link(self, name: str) -> dict | None:
        return (self.data.get("links") or {}).get(name)

    def layer(self, field_name: str, kernel: str | None = None, default: float = 0.0) -> float:
        v = (self.data.get("layer") or {}).get(field_name, default)
        if isinstance(v, dict):
            return float(v.get(kernel, v.get("default", default)))
        return float(v)

    def host_ms(self, kernel: str, world: int, collectives: int) -> tuple[float, str]:
        """The host time of one call of `kernel`'s layer at `world` ranks, and where it comes from:
        the W-rank layer's as calibration measured it (layer.host_ms_by_world), else the 1-rank
        layer's (host_ms) + `collectives` x host_ms_per_collective (files without the former)."""
        by_w = self._by_world("host_ms_by_world", world)
        if kernel in by_w:
            return float(by_w[kernel]), f"calibrated at {world} rank(s)"
        return (self.layer("host_ms", kernel, 0.5) + collectives * self.layer("host_ms_per_collective", None, 0.1),
                "1-rank host_ms + host_ms_per_collective each")

    def stall_ms(self, kernel: str, world: int) -> float:
        """The stall of one eager call of `kernel`'s layer at `world` ranks: calibrated at that world
        size (layer.stall_ms_by_world), else at one rank (layer.stall_ms); 0 in files without them."""
        by_w = self._by_world("stall_ms_by_world", world)
        if kernel in by_w:
            return float(by_w[kernel])
        return self.layer("stall_ms", kernel, 0.0)

    def _by_world(self, field_name: str, world: int) -> dict:
        """layer.<field_name>[str(world)]: {kernel: ms} calibrated at that world size, or {}."""
        return ((self.data.get("layer") or {}).get(field_name) or {}).get(str(world)) or {}


def machine_names() -> list[str]:
    return sorted(p.stem for p in MACHINE_DIR.glob("*.json"))


def _resolve(name_or_path: str, relative_to: Path | None = None) -> Path:
    """A machine file: a path (absolute, or relative to the cwd or to the file that names it), or the
    name of a shipped one (tpattn/machines/NAME.json)."""
    p = Path(name_or_path)
    cands = []
    if p.suffix == ".json" or "/" in name_or_path:
        if relative_to is not None and not p.is_absolute():
            cands.append(relative_to / p)
        cands.append(p)
    cands.append(MACHINE_DIR / f"{name_or_path}.json")
    for c in cands:
        if c.is_file():
            return c
    shipped = machine_names()
    if not shipped:
        raise MachineError(f"--machine {name_or_path}: no such file, and no machine files were installed with tpattn "
                           f"({MACHINE_DIR}/*.json is missing); give the path of a machine file")
    raise MachineError(f"--machine {name_or_path}: no such file and no shipped machine of that name; "
                       f"give a JSON file or one of {', '.join(shipped)}")


def _read(path: Path, what: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise MachineError(f"{what}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                           "fix the file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MachineError(f"{what}: cannot read it ({getattr(exc, 'strerror', None) or exc}); check the path") from None
    if not isinstance(data, dict):
        raise MachineError(f"{what}: the file must hold one JSON object (got {type(data).__name__})")
    return data


def _merge(base: dict, over: dict) -> dict:
    """base's fields overridden by over's: objects merged key by key, except "passes" and
    "sources" entries, which are replaced whole."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "passes":
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _read_merged(path: Path, seen: tuple) -> dict:
    """The file's fields over those of its "base" (recursively)."""
    what = f"machine file {path}"
    if str(path) in seen:
        raise MachineError(f"{what}: \"base\" or \"passes_from\" loops back to it; break the cycle")
    data = _read(path, what)
    if "base" in data:
        if not isinstance(data["base"], str):
            raise MachineError(f"{what}: \"base\" must be the name or path of another machine file")
        base = _read_merged(_resolve(data["base"], path.parent), (*seen, str(path)))
        data = _merge(base, {k: v for k, v in data.items() if k != "base"})
    return data


def load_machine(name_or_path: str, _seen: tuple = ()) -> Machine:
    """Read, merge and validate a machine description; MachineError (one line naming the fix) when it
    cannot be used. "base": another machine whose fields this one overrides. "passes_from": another
    machine whose calibrated passes and layer overheads this one uses; their efficiencies are
    computed against that machine's own peaks, then applied to this one's."""
    path = _resolve(name_or_path)
    what = f"machine file {path}"
    data = _read_merged(path, _seen)
    validate_machine(data, what)
    m = Machine(name=data["name"], data=data, path=str(path))
    src = data.get("passes_from")
    if src:
        other = load_machine(str(_resolve(src, path.parent)), (*_seen, str(path)))
        m.curves = dict(other.curves)
        if "layer" not in data and "layer" in other.data:
            data["layer"] = copy.deepcopy(other.data["layer"])
    m.curves.update(_curves(m, data.get("passes") or {}))
    return m


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def validate_machine(data: dict, what: str = "machine file") -> None:
    """Raise MachineError for the first problem, with the fix in the message."""
    for k, t in REQUIRED.items():
        if k not in data:
            raise MachineError(f"{what}: missing field \"{k}\"; add it (see docs/plan.md, machine files)")
        if not isinstance(data[k], t) or isinstance(data[k], bool):
            tn = t.__name__ if isinstance(t, type) else "number"
            raise MachineError(f"{what}: \"{k}\" must be a {tn} (got {json.dumps(data[k])[:40]})")
    if data["gpus_per_node"] < 1:
        raise MachineError(f"{what}: \"gpus_per_node\" must be at least 1 (got {data['gpus_per_node']})")
    if not _num(data["memory_GiB"]) or data["memory_GiB"] <= 0:
        raise MachineError(f"{what}: \"memory_GiB\" must be a positive number of GiB (got {data['memory_GiB']})")
    mn = data.get("max_nodes")
    if mn is not None and (not isinstance(mn, int) or isinstance(mn, bool) or mn < 1):
        raise MachineError(f"{what}: \"max_nodes\" must be a positive integer or null (got {json.dumps(mn)})")
    for p in PEAKS:
        v = data["peaks"].get(p)
        if not _num(v) or v <= 0:
            raise MachineError(f"{what}: \"peaks.{p}\" must be a positive number (got {json.dumps(v)}); "
                               "measure it with --calibrate or take it from the datasheet")
    links = data.get("links") or {}
    if not isinstance(links, dict):
        raise MachineError(f"{what}: \"links\" must be an object with \"nvlink\" and optionally \"network\"")
    for lname, link in links.items():
        if lname not in ("nvlink", "network"):
            raise MachineError(f"{what}: unknown link \"links.{lname}\"; use \"nvlink\" (inside a node) or "
                               "\"network\" (between nodes)")
        if not isinstance(link, dict):
            raise MachineError(f"{what}: \"links.{lname}\" must be an object with {', '.join(LINK_FIELDS)}")
        for f in LINK_FIELDS:
            v = link.get(f)
            if not _num(v) or v < 0 or (f == "busbw_GBps" and v <= 0):
                kind = "positive" if f == "busbw_GBps" else "non-negative"
                raise MachineError(f"{what}: \"links.{lname}.{f}\" must be a {kind} number (got {json.dumps(v)})")
        wake = [f for f in WAKE_FIELDS if link.get(f) is not None]
        if wake and len(wake) < len(WAKE_FIELDS):
            raise MachineError(f"{what}: \"links.{lname}\" has {wake[0]} without "
                               f"{next(f for f in WAKE_FIELDS if f not in wake)}; give both (the link's wake-up and "
                               "the idle time after which it is paid) or neither")
        for f in wake:
            v = link[f]
            if not _num(v) or v < 0 or (f == "idle_ms" and v <= 0):
                kind = "positive" if f == "idle_ms" else "non-negative"
                raise MachineError(f"{what}: \"links.{lname}.{f}\" must be a {kind} number (got {json.dumps(v)})")
        per = link.get("per_collective") or {}
        if not isinstance(per, dict):
            raise MachineError(f"{what}: \"links.{lname}.per_collective\" must map a collective to its numbers")
        for cname, c in per.items():
            if cname not in COLLECTIVE_NAMES:
                raise MachineError(f"{what}: \"links.{lname}.per_collective.{cname}\" is not a collective; use "
                                   f"{', '.join(COLLECTIVE_NAMES)}")
            if not isinstance(c, dict):
                raise MachineError(f"{what}: \"links.{lname}.per_collective.{cname}\" must be an object")
            for f in ("busbw_GBps", "base_us"):
                if f in c and (not _num(c[f]) or c[f] < 0 or (f == "busbw_GBps" and c[f] <= 0)):
                    raise MachineError(f"{what}: \"links.{lname}.per_collective.{cname}.{f}\" must be a positive "
                                       f"number (got {json.dumps(c[f])})")
            if "layer_extra_us" in c and not _num(c["layer_extra_us"]):
                raise MachineError(f"{what}: \"links.{lname}.per_collective.{cname}.layer_extra_us\" must be a "
                                   f"number of us (got {json.dumps(c['layer_extra_us'])})")
    if links and "nvlink" not in links and data["gpus_per_node"] > 1:
        raise MachineError(f"{what}: \"links\" has no \"nvlink\" for the {data['gpus_per_node']} GPUs of a node; add it")
    passes = data.get("passes") or {}
    if not isinstance(passes, dict):
        raise MachineError(f"{what}: \"passes\" must map a pass ({', '.join(PASS_KEYS)}) to a list of points")
    for key, pts in passes.items():
        if key.split(":")[0] not in PASS_KEYS or key.count(":") > 1 or (":" in key and not key.endswith(":causal")):
            raise MachineError(f"{what}: unknown pass \"passes.{key}\"; use one of {', '.join(PASS_KEYS)} "
                               "(an attention pass may end in :causal)")
        if not isinstance(pts, list) or not pts:
            raise MachineError(f"{what}: \"passes.{key}\" must be a non-empty list of measured points")
        for i, pt in enumerate(pts):
            if not isinstance(pt, dict) or not _num(pt.get("ms")) or pt["ms"] <= 0:
                raise MachineError(f"{what}: \"passes.{key}[{i}]\" needs a positive \"ms\" (the measured time)")
            try:
                _point_step(key, pt)
            except (KeyError, TypeError, ValueError, StopIteration) as exc:
                raise MachineError(f"{what}: \"passes.{key}[{i}]\" lacks a field or has a bad value ({exc}); "
                                   f"{_POINT_FIELDS[_family(key)]}") from None
    if data.get("passes_from") is not None and not isinstance(data["passes_from"], str):
        raise MachineError(f"{what}: \"passes_from\" must be the name or path of a calibrated machine file")
    if not passes and not data.get("passes_from"):
        raise MachineError(f"{what}: no \"passes\" (calibration points) and no \"passes_from\"; run --calibrate on "
                           "the machine or name a calibrated machine in \"passes_from\"")
    layer = data.get("layer", {})
    if not isinstance(layer, dict):
        raise MachineError(f"{what}: \"layer\" must be an object (overhead_ms, host_ms, host_ms_per_collective)")
    for k, v in layer.items():
        if k in ("host_ms_by_world", "stall_ms_by_world"):  # {"W": {kernel: ms}}
            ok = isinstance(v, dict) and all(
                str(w).isdigit() and int(w) >= 1 and isinstance(per, dict) and per
                and all(_num(x) and x >= 0 for x in per.values()) for w, per in v.items())
            if not ok:
                raise MachineError(f"{what}: \"layer.{k}\" must map a world size (\"2\") to "
                                   "{kernel: non-negative ms}")
            continue
        vals = v.values() if isinstance(v, dict) else [v]
        if not all(_num(x) and x >= 0 for x in vals):
            raise MachineError(f"{what}: \"layer.{k}\" must be a non-negative number (or one per kernel)")
    # every number that is not a calibration point must say where it comes from
    srcs = data["sources"]
    needed = [f"peaks.{p}" for p in PEAKS] + ["memory_GiB"] + [f"links.{n}" for n in links]
    for k in needed:
        if not isinstance(srcs.get(k), str) or not srcs[k].strip():
            raise MachineError(f"{what}: \"sources\" has no entry for \"{k}\"; say where the number comes from "
                               "(a measurement with its command, or a datasheet with its address)")


# calibration points: the fields each family needs to rebuild the step whose efficiency they measure
_POINT_FIELDS = {
    "gemm": "a GEMM point needs M, K, N, dtype, out and ms",
    "copy": "a copy point needs bytes (read + written) and ms",
    "attn": "an attention point needs B, h, N, d, dtype, causal and ms",
}


def _family(key: str) -> str:
    k = key.split(":")[0]
    return "gemm" if k in ("qkv_proj", "out_proj") else "copy" if k in ("relayout", "epilogue") else "attn"


def _point_step(key: str, pt: dict) -> Step:
    """The step a calibration point timed, rebuilt from its fields (so its FLOPs and bytes are
    counted exactly as a prediction counts them)."""
    fam, k = _family(key), key.split(":")[0]
    if fam == "gemm":
        for f in ("M", "K", "N"):
            if int(pt[f]) < 1:
                raise ValueError(f"{f} must be at least 1")
        if pt["dtype"] not in ELEM or pt["out"] not in ELEM:
            raise ValueError(f"dtype and out must be one of {', '.join(ELEM)}")
        return gemm_step(k, k, int(pt["M"]), int(pt["K"]), int(pt["N"]), pt["dtype"], pt["out"])
    if fam == "copy":
        if not _num(pt["bytes"]) or pt["bytes"] <= 0:
            raise ValueError("bytes must be positive")
        return copy_step(k, k, float(pt["bytes"]), "")
    kernel, _ = k.split(".")
    if pt["dtype"] not in ELEM:
        raise ValueError(f"dtype must be one of {', '.join(ELEM)}")
    for f in ("B", "h", "N", "d"):
        if int(pt[f]) < 1:
            raise ValueError(f"{f} must be at least 1")
    if key.endswith(":causal") != bool(pt["causal"]):
        raise ValueError("causal must be true exactly in the :causal passes")
    steps = attention_steps(kernel, int(pt["B"]), int(pt["h"]), int(pt["N"]), int(pt["d"]), pt["dtype"],
                            bool(pt["causal"]))
    return next(s for s in steps if s.key == k)


def roofline_ms(m: Machine, step: Step) -> tuple[float, str]:
    """(roofline time in ms, what bounds it: compute or memory)."""
    t_mem = step.bytes / (m.peak("mem_GBps") * 1e6)
    t_fl = 0.0
    if step.flops and step.unit:
        peak = m.peak("tensor_tflops" if step.unit == "tensor" else "fp32_tflops")
        t_fl = step.flops / (peak * 1e9)
    return (t_fl, "compute") if t_fl >= t_mem else (t_mem, "memory")


def _curves(m: Machine, passes: dict) -> dict:
    """The calibration points as efficiencies on machine m (roofline / measured). An attention
    pass: {batch x heads: [(log N, efficiency)]}, a grid over the parallelism and the row length
    (the two things its efficiency depends on); a GEMM or a copy: [(log roofline ms, efficiency)]."""
    curves = {}
    for key, pts in passes.items():
        if _family(key) == "attn":
            grid: dict[int, list] = {}
            for pt in pts:
                st = _point_step(key, pt)
                roof, _ = roofline_ms(m, st)
                grid.setdefault(st.bh, []).append((math.log(st.n), roof / pt["ms"]))
            curves[key] = {hb: sorted(v) for hb, v in grid.items()}
        else:
            xs = []
            for pt in pts:
                roof, _ = roofline_ms(m, _point_step(key, pt))
                xs.append((math.log(roof), roof / pt["ms"]))
            curves[key] = sorted(xs)
    return curves


def _interp(pts: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through sorted (x, y) points (equal x averaged), clamped at both ends."""
    merged: list[list] = []
    for px, py in pts:
        if merged and abs(merged[-1][0] - px) < 1e-9:
            merged[-1][1].append(py)
        else:
            merged.append([px, [py]])
    xy = [(px, sum(ys) / len(ys)) for px, ys in merged]
    if x <= xy[0][0]:
        return xy[0][1]
    for (x0, y0), (x1, y1) in zip(xy, xy[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return xy[-1][1]


def efficiency(m: Machine, step: Step, roof_ms: float) -> float:
    """The calibrated efficiency of a step. An attention pass: interpolated in log N along each
    calibrated batch x heads, then in log(batch x heads) between them; a GEMM or a copy:
    interpolated in log(roofline time). Piecewise linear, clamped at the ends of the calibrated
    range. Causal points where the machine has them, else the non-causal ones."""
    key = step.key
    curve = (m.curves.get(key + ":causal") if step.causal else None) or m.curves.get(key)
    if not curve:
        raise ModelError(f"machine {m.name} has no calibration for the pass {key}; run python -m tpattn.plan "
                         "--calibrate on that machine, or use a machine file that has it")
    if isinstance(curve, dict):
        x = math.log(max(step.n, 1))
        along = sorted((math.log(hb), _interp(pts, x)) for hb, pts in curve.items())
        return _interp(along, math.log(max(step.bh, 1)))
    return _interp(curve, math.log(max(roof_ms, 1e-12)))


def step_ms(m: Machine, step: Step) -> dict:
    roof, bound = roofline_ms(m, step)
    eff = efficiency(m, step, roof)
    floor = m.layer("launch_us", default=3.0) / 1e3
    return {"pass": step.name, "key": step.key, "what": step.what, "flops": step.flops, "bytes": step.bytes,
            "roofline_ms": roof, "bound": bound, "efficiency": eff, "ms": max(roof / eff, floor)}


# ---- the collectives: alpha-beta ---------------------------------------------------------------------


def _link_params(link: dict, kind: str) -> tuple[float, float, float]:
    """(bus bandwidth GB/s, alpha us per step, base us) of a link for one collective."""
    c = (link.get("per_collective") or {}).get(kind, {})
    return (float(c.get("busbw_GBps", link["busbw_GBps"])), float(link["step_us"]),
            float(c.get("base_us", link["base_us"])))


def ring_steps_and_share(kind: str, p: int) -> tuple[int, float]:
    """(ring steps, share of the whole tensor each rank sends) for p ranks in NCCL's ring: an
    all-reduce 2(p-1) steps and 2(p-1)/p, an all-gather or a reduce-scatter p-1 and (p-1)/p."""
    if p <= 1:
        return 0, 0.0
    if kind == "allreduce":
        return 2 * (p - 1), 2 * (p - 1) / p
    return p - 1, (p - 1) / p


def wake_share(apart_us: float, wake_us: float) -> float:
    """The share of the link's wake-up that the last rank to arrive at a collective still waits for,
    when the first rank arrived apart_us before it: the first rank's traffic starts waking the link.
    On the lent H200s (scripts/collective_probe.py --skew and --idle, benchmarks/link_wake_h200x2.log)
    all of it up to a lead of half the wake-up, none from twice the wake-up on, linear between."""
    if wake_us <= 0:
        return 0.0
    return min(1.0, max(0.0, (2.0 * wake_us - apart_us) / (1.5 * wake_us)))


def link_wake_us(m: Machine, idle_before_ms: float, apart_us: float = 0.0) -> float:
    """What the NVLink link's wake-up adds to a collective that follows idle_before_ms without traffic
    on it (links.nvlink wake_us after idle_ms; 0 for a file without them), the ranks arriving apart_us
    apart (0: together, the whole wake-up)."""
    nvl = m.link("nvlink") or {}
    if nvl.get("wake_us") is None or idle_before_ms < float(nvl["idle_ms"]):
        return 0.0
    return float(nvl["wake_us"]) * wake_share(apart_us, float(nvl["wake_us"]))


def collective_ms(m: Machine, kind: str, nbytes: int, world: int, gpus_per_node: int | None = None,
                  in_layer: bool = False, idle_before_ms: float = 0.0) -> dict:
    """Predicted time of one collective of nbytes (the whole tensor, nccl-tests' size) over `world`
    ranks, g per node.

    One node: NCCL's ring over NVLink, base + steps * alpha + share * bytes / busbw.
    Several nodes (hierarchical): inside each node over NVLink (the share of g ranks, of the whole
    tensor), across the n nodes over the network, each GPU's own link carrying 1/g of the tensor (the
    share of n ranks); the chunks are pipelined through both, so the slower of the two bandwidth
    terms counts, and the latency of every step adds (NVLink steps at its alpha, network steps at the
    network's).

    in_layer: the collective as the layer runs it, after its compute: + the NVLink link's
    per_collective layer_extra_us, which calibration measures as the layer's collective (on the last
    rank to arrive) minus the bare one's model (ranks arriving apart, the collective's kernel next to
    the layer's, the partial's allocation).

    idle_before_ms: how long the NVLink link carried nothing before this collective. From the link's
    idle_ms on (where the file has it) the link sleeps and the collective pays its wake_us, the ranks
    arriving together (link_wake_us): the naive layer's reduce-scatter after 89 ms of attention."""
    if kind not in COLLECTIVE_NAMES:
        raise ModelError(f"unknown collective {kind}")
    g = gpus_per_node or m.gpus_per_node
    if world <= 1:
        return {"ms": 0.0, "algorithm": "none (one rank)", "bytes": nbytes, "bound": "-"}
    nodes = 1 if world <= g else world // g
    local = world if nodes == 1 else g
    nvl = m.link("nvlink")
    if nvl is None and local > 1:
        raise ModelError(f"machine {m.name} has no NVLink numbers (\"links.nvlink\"): calibrate it with "
                         "mpirun -n 2 python -m tpattn.plan --calibrate, or add them")
    steps_l, share_l = ring_steps_and_share(kind, local)
    lat, bw_l_us, bw_n_us, base = 0.0, 0.0, 0.0, 0.0
    if local > 1:
        bw, alpha, base = _link_params(nvl, kind)
        lat += steps_l * alpha
        bw_l_us = share_l * nbytes / (bw * 1e3)
    if nodes > 1:
        net = m.link("network")
        if net is None:
            raise ModelError(f"machine {m.name} has no network numbers (\"links.network\"): it describes one node "
                             f"of {m.gpus_per_node} GPUs; use a cluster machine file (e.g. h200 or h100_cluster)")
        bw_n, alpha_n, base_n = _link_params(net, kind)
        steps_n, share_n = ring_steps_and_share(kind, nodes)
        lat += steps_n * alpha_n
        bw_n_us = share_n * (nbytes / local) / (bw_n * 1e3)
        base = max(base, base_n)
    extra = 0.0
    if in_layer and nvl is not None:
        extra = float(((nvl.get("per_collective") or {}).get(kind) or {}).get("layer_extra_us", 0.0))
    wake = link_wake_us(m, idle_before_ms) if local > 1 else 0.0
    us = max(0.0, base + lat + max(bw_l_us, bw_n_us) + extra + wake)
    algo = (f"ring over {world} GPUs (NVLink)" if nodes == 1 else
            f"hierarchical: {local} GPUs/node (NVLink) x {nodes} nodes (network)")
    bound = "latency" if base + lat > max(bw_l_us, bw_n_us) else ("network" if bw_n_us > bw_l_us else "NVLink")
    return {"ms": us / 1e3, "algorithm": algo, "bytes": nbytes, "latency_us": base + lat,
            "nvlink_us": bw_l_us, "network_us": bw_n_us, "layer_extra_us": extra, "wake_us": wake,
            "idle_before_ms": idle_before_ms, "bound": bound}


def fit_alpha_beta(points: list[tuple[int, float]], kind: str, world: int, step_us: float) -> dict:
    """{base_us, busbw_GBps} of  t = base + steps*alpha + share*bytes/busbw  from measured
    (bytes, ms) points at one world size, alpha (step_us) given: least squares on the relative
    error (residuals weighted 1/t), so the small sizes count as much as the large ones."""
    steps, share = ring_steps_and_share(kind, world)
    if not points or share == 0:
        raise ValueError("fit_alpha_beta needs measured points at a world size of 2 or more")
    sw = sx = sy = sxx = sxy = 0.0
    for nbytes, ms in points:
        t, x = ms * 1e3, share * nbytes
        w = 1.0 / (t * t)
        sw, sx, sy, sxx, sxy = sw + w, sx + w * x, sy + w * t, sxx + w * x * x, sxy + w * x * t
    den = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / den if len(points) > 1 and den > 0 else 0.0
    a = (sy - b * sx) / sw if b > 0 else 0.0
    if b <= 0:  # one point, or times that do not grow with the bytes: the largest point's bandwidth
        nbytes, ms = max(points)
        b, a = ms * 1e3 / (share * nbytes), 0.0
    return {"base_us": round(max(0.0, a - steps * step_us), 2), "busbw_GBps": sig(1.0 / b / 1e3)}


WAKE_MIN_US = 20.0   # a collective this much slower after an idle than after a short one: the link slept


def fit_link_wake(points: list[tuple[float, float, float]]) -> dict | None:
    """{wake_us, idle_ms} from (idle ms, collective ms, ranks apart us) points (tpattn.plan.link_wake):
    the awake collective is the quickest point (noise only adds time); idle_ms = the shortest idle
    from which on every point took WAKE_MIN_US or more longer (the link sleeps from there on: one
    slow point before it does not count); wake_us = the median of that excess over those points.
    None when no idle shows it (the link does not sleep, or not within the idles tried)."""
    pts = sorted(points)
    if len(pts) < 2:
        return None
    awake = min(ms for _, ms, _ in pts)
    excess = [(idle, (ms - awake) * 1e3) for idle, ms, _ in pts]
    first = len(excess)
    while first > 0 and excess[first - 1][1] >= WAKE_MIN_US:
        first -= 1
    if first == len(excess) or first == 0:   # the last idle shows none, or even the shortest one did
        return None
    return {"wake_us": round(statistics.median(us for _, us in excess[first:]), 1), "idle_ms": excess[first][0]}


def sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits (a rate of 0.004 GB/s stays 0.004, not 0.0)."""
    return float(f"{x:.{digits}g}")


# ---- the prediction ------------------------------------------------------------------------------------


def _config(shape: Shape):
    from .config import Config
    names = {f.name for f in dataclasses.fields(Config)}
    kw = dict(seq_len=shape.seq_len, heads=shape.heads, head_dim=shape.head_dim, batch=shape.batch,
              dtype=shape.dtype, kernel=shape.kernel, causal=shape.causal, device="cuda", check=False,
              reduce_dtype=shape.reduce_dtype, sequence_parallel=shape.sequence_parallel, overlap=shape.overlap,
              output_collective=shape.output_collective, kv_heads=shape.kv, uneven_heads=shape.uneven_heads)
    return Config(**{k: v for k, v in kw.items() if k in names})


def memory_per_rank(shape: Shape, world: int, free_bytes: int) -> tuple[int, int, bool]:
    """(bytes one rank allocates, the largest --seq-len that fits in free_bytes, whether this one
    fits) by tpattn.memory, the CLI's own pre-flight estimate, without the checks' baseline. Rank 0's:
    it holds the most heads (--uneven-heads), and without --check every rank allocates the same
    for the same heads."""
    from . import memory
    cfg = _config(shape)
    need = memory.estimate(cfg, world, 0)
    return need, memory.largest_n(cfg, world, 0, free_bytes), need <= free_bytes * memory.HEADROOM


def output_collective(colls) -> str | None:
    """The collective that sums the partial outputs (the one after the compute): the reduce-scatter
    where there is one, else the all-reduce."""
    return next((k for k in ("reducescatter", "allreduce") if k in colls), None)


def predict(m: Machine, shape: Shape, world: int, gpus_per_node: int | None = None) -> dict:
    """The predicted call at world size W: per pass, collectives, other, GPU, host, end to end, memory."""
    g = gpus_per_node or m.gpus_per_node
    if world > g and world % g:
        raise ModelError(f"{world} ranks do not fill nodes of {g} GPUs; use a multiple of {g}")
    nodes = 1 if world <= g else world // g
    if m.max_nodes is not None and nodes > m.max_nodes:
        raise ModelError(f"machine {m.name} is {m.max_nodes} node(s) of {m.gpus_per_node} GPUs "
                         f"({m.max_nodes * m.gpus_per_node} at most); {world} ranks need {nodes} nodes: "
                         "use a cluster machine file (h200, h100_cluster)")
    steps, colls = layer_steps(shape, world)
    detail = [step_ms(m, s) for s in steps]
    passes: dict[str, float] = {}
    for s in detail:
        passes[s["pass"]] = passes.get(s["pass"], 0.0) + s["ms"]
    overhead = 0.0 if shape.cuda_graph else m.layer("overhead_ms", shape.kernel, 0.1)
    other = passes.pop("other", 0.0) + overhead
    compute = sum(passes.values())
    # the collective that sums the partials comes after the call's compute, with nothing on the link
    # since the previous call's last collective (the all-gather of x, in sequence parallel, comes right
    # after the previous call's reduce-scatter); "other" (the bias pass after it, overheads) left out
    after = output_collective(colls)
    coll = {k: collective_ms(m, k, n, world, g, in_layer=True, idle_before_ms=compute if k == after else 0.0)
            for k, n in colls.items()}
    comm = sum(c["ms"] for c in coll.values())
    gpu = compute + comm + other
    host, host_src = (0.0, "none (a CUDA graph)") if shape.cuda_graph else m.host_ms(shape.kernel, world, len(coll))
    stall = 0.0 if shape.cuda_graph else m.stall_ms(shape.kernel, world)
    total = max(gpu, host) + stall
    mem, fit_n, fits = memory_per_rank(shape, world, m.memory_bytes)
    by_rank = shape.heads_by_rank(world)
    parts = {**{k: v for k, v in passes.items()}, **{k: c["ms"] for k, c in coll.items()}, "other": other}
    if host > gpu:
        dominant = "host (the Python call)"
    else:
        dominant = max(parts, key=parts.get)
    return {
        "world": world, "nodes": nodes, "gpus_per_node": min(world, g), "heads_per_rank": by_rank[0],
        "heads_by_rank": by_rank, "imbalance": max(by_rank) / (sum(by_rank) / len(by_rank)),
        "passes": passes, "collectives": coll, "other_ms": other, "overhead_ms": overhead,
        "compute_ms": compute, "communication_ms": comm, "gpu_ms": gpu, "host_ms": host, "host_source": host_src,
        "stall_ms": stall,
        "end_to_end_ms": total,
        "host_bound": host > gpu, "dominant": dominant, "steps": detail,
        "memory_bytes": mem, "fits": fits, "largest_seq_len": fit_n,
    }


def plan(m: Machine, shape: Shape, worlds: list[int], gpus_per_node: int | None = None) -> list[dict]:
    """predict() for each world size; a size the model cannot predict gets {"world", "error"}.
    Speedup and efficiency against the 1-rank prediction (made even when 1 is not asked for)."""
    rows = []
    try:
        base = predict(m, shape, 1, gpus_per_node)["end_to_end_ms"]
    except ModelError:
        base = None
    for w in worlds:
        try:
            r = predict(m, shape, w, gpus_per_node)
        except ModelError as exc:
            rows.append({"world": w, "error": str(exc)})
            continue
        if base:
            r["ideal_ms"] = base / w
            r["speedup"] = base / r["end_to_end_ms"]
            r["efficiency"] = r["speedup"] / w
        rows.append(r)
    return rows
