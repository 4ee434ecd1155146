"""One fused CUDA kernel: Q tiles against streamed K and V tiles, online softmax, tensor cores; S and
P never reach device memory. On compute capability 9.0 kernels/fused_ws_attention.cu (fusedw:
warp-specialized, TMA loads, wgmma; launched through the driver with tensor maps, its arguments
packed once per set of tensors) and, by name, kernels/fused_hopper_attention.cu (fusedh: wgmma, no
TMA); kernels/fused_attention.cu (mma.sync) elsewhere and for small calls. Grouped-query attention:
each query head's blocks stream its group's K/V head, in place; the blocks of a group's query heads
run close together, so that head's K and V tiles are mostly read from L2."""

from __future__ import annotations

import math
import os
import re
from typing import NamedTuple

import numpy as np
import torch

from ..errors import ConfigError, FlagError
from ..cuda import GRID_X_MAX, GRID_YZ_MAX, Prepared, TensorMap, launch, ptr
from ..timing import section
from . import CudaBackend, kv_group
from .autograd import write_into

SOURCE = "fused_attention.cu"
HOPPER_SOURCE = "fused_hopper_attention.cu"  # wgmma (sm_90a): runs on compute capability 9.0 only
WS_SOURCE = "fused_ws_attention.cu"          # warp-specialized: TMA, mbarriers, wgmma (sm_90a) too
WS_DIMS_SOURCE = "fused_ws_dims.cu"          # the same kernel at the other head dims (sm_90a)
WS_PAGED_SOURCE = "fused_ws_paged.cu"        # the same kernel reading K/V through a block table (sm_90a)
PAGED_HEAD_DIMS = (64, 128)                  # its head dims (fusedw_{suf}_d{d}_pg)
BWD_SOURCE = "fused_attention_backward.cu"   # the backward (mma.sync): any compute capability >= 8.0
HOPPER_BWD_SOURCE = "fused_hopper_backward.cu"  # the backward on wgmma (sm_90a): compute capability 9.0
BWD_ROWS = {64: 64, 128: 32}  # query rows per step of its dK/dV kernel (the .cu file's TPB_DEFINE)
HOPPER_CC = (9, 0)
BWD_HEAD_DIMS = (64, 128)  # every kernel of this backend: fused2, fusedh, fusedw and the CUDA backward
# fusedw only (compute capability 9.0, fused_ws_dims.cu); their backward is the Triton rung's
OTHER_HEAD_DIMS = (32, 80, 96, 160, 192, 256)
HEAD_DIMS = tuple(sorted(BWD_HEAD_DIMS + OTHER_HEAD_DIMS))
# the head dim fusedw computes with (its tiles' columns): d itself, or the next of 64, 128, 192 above it,
# the tensor maps reading zeros past d
WS_TILE_DIM = {32: 64, 80: 128, 96: 128, 160: 192}
# The kernel per head dim, "{suf}" standing for f16 or bf16. On compute capability 9.0 (H100, H200)
# fusedw (a TMA producer warpgroup and two wgmma consumer warpgroups, 128 query rows, 128 keys per
# tile and two Q stages at d = 64 and 128, persistent grid; the other head dims: WS_TILE_DIM and the
# stage tables below) unless the call is too small to fill half the GPU (see
# kernel_for); at d = 64 fusedw3 (three consumer warpgroups, 192 query rows a tile) where 192-row
# tiles pad the query rows little more than 128-row ones (W3_PAD);
# fusedh (two wgmma warpgroups that load their own tiles) by name; elsewhere fused2, the mma.sync
# version, software pipelined; _wW: W warps, _mM: M tiles of 16 query rows per warp, _cC: C keys per tile.
# Chosen on the H200 (benchmarks/ladder.md); TPATTN_FUSED_CFG=NAME overrides it (the bench's sweep).
CONFIG = {64: "fused2_{suf}_d64_w4_m1_c64", 128: "fused2_{suf}_d128_w4_m1_c64"}
HOPPER_CONFIG = "fusedw_{suf}_d{d}"
W3_CONFIG = "fusedw3_{suf}_d{d}"  # d = 64 only
# fusedw3 when its rows (a multiple of 192) are at most this many times fusedw's (of 128): measured on
# the H200 it is 7-14 % faster per row at d = 64 (docs/kernels.md), so N = 257, 1024, 4096 take it and
# N = 197 (384 rows against 256) does not
W3_PAD = 1.15
# fusedw per head dim (the .cu file's QS, KVS and BC): Q stages, K/V stages, keys per K/V tile. Above
# d = 128 tiles of 64 keys (S and P of 64 keys beside the 64 x d accumulator: no spills, wgmma not
# serialized; ptxas -v, sm_90a) and, at d = 256, one Q stage (192 KB of shared memory each)
WS_Q_STAGES = {64: 2, 128: 2, 192: 2, 256: 1}  # (by tile dim)
WS_KV_STAGES = {64: 4, 128: 2, 192: 2, 256: 2}
WS_KEY_TILE = {64: 128, 128: 128, 192: 64, 256: 64}


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def unsupported_head_dim(d: int) -> str:
    if d > HEAD_DIMS[-1]:
        return (f"--kernel fused supports head dims up to {HEAD_DIMS[-1]} (got {d}), as every kernel here does; use "
                f"--head-dim {HEAD_DIMS[-1]} or less")
    others = ("--kernel triton (every multiple of 8 up to 256), tiled or naive" if d % 8 == 0 else "--kernel naive")
    near = [x for x in (max((h for h in HEAD_DIMS if h < d), default=None), min((h for h in HEAD_DIMS if h > d),
                                                                                default=None)) if x is not None]
    return (f"--kernel fused supports head dims {', '.join(map(str, HEAD_DIMS[:-1]))} and {HEAD_DIMS[-1]} (got {d}; "
            f"all but 64 and 128 need compute capability 9.0); use --head-dim {' or '.join(map(str, near))}, or "
            f"{others} for other head dims")


def hopper_only(d: int, cc: tuple[int, int]) -> str | None:
    """Why head dim d does not run on a GPU of compute capability cc (fusedw alone takes it), or None."""
    if d in OTHER_HEAD_DIMS and cc != HOPPER_CC:
        return (f"--kernel fused at head dim {d} runs on compute capability 9.0 only (this GPU has {cc[0]}.{cc[1]}); "
                "use --kernel triton")
    return None


class Choice(NamedTuple):
    source: str
    name: str
    threads: int
    rows: int        # query rows per block
    shared: int      # dynamic shared memory, bytes
    keys: int = 128  # fusedw: keys per K/V tile (its tensor maps' box)


def kernel_for(d: int, suf: str, cc: tuple[int, int], wide: bool = True, rows: int = 0) -> Choice:
    """The kernel for head dim d, dtype suffix suf, on a GPU of compute capability cc. wide: the call
    has enough 128-row query tiles for the wgmma kernel to fill at least half the GPU's SMs; with
    fewer (one head at N = 4096: 32 tiles on 132 SMs) fused2's 64-row blocks spread wider and win.
    rows: the query rows of each head the call computes (0: unknown), which picks fusedw3 at d = 64."""
    w3 = d == 64 and rows > 0 and _cdiv(rows, 192) * 192 <= W3_PAD * _cdiv(rows, 128) * 128
    key = (d, suf, cc, wide, w3, os.environ.get("TPATTN_FUSED_CFG"))
    if key not in _kernels:
        why = hopper_only(d, cc)
        if why:
            raise ConfigError(why)
        hopper = W3_CONFIG if w3 else HOPPER_CONFIG
        # (at the other head dims there is no fused2: fusedw however few tiles the call has)
        name = (key[5] or (hopper if cc == HOPPER_CC and (wide or d in OTHER_HEAD_DIMS) else CONFIG[d])).format(
            suf=suf, d=d)
        if d in OTHER_HEAD_DIMS and name != f"fusedw_{suf}_d{d}":
            raise ConfigError(f"TPATTN_FUSED_CFG={name!r}: at head dim {d} only fusedw_{suf}_d{d} is built; "
                              "unset it (or use --kernel triton)")
        m = re.fullmatch(rf"fused2_{suf}_d{d}_w(\d+)_m(\d+)_c(\d+)|fused[hw]_{suf}_d{d}|fusedw3_{suf}_d64", name)
        if not m and name.startswith("fusedw3_"):
            raise ConfigError(f"TPATTN_FUSED_CFG={name!r}: fusedw3 is for head dim 64 only (this call has d={d}); "
                              "use fusedw_{suf}_d{d} or unset it")
        if not m:
            raise ConfigError(f"TPATTN_FUSED_CFG={name!r} is not a fused kernel for {suf}, d={d}")
        if name.startswith(("fusedh_", "fusedw")) and cc != HOPPER_CC:
            raise ConfigError(f"TPATTN_FUSED_CFG={name!r} needs compute capability 9.0 (this GPU has "
                              f"{cc[0]}.{cc[1]}); unset it")
        if name.startswith("fusedh_"):
            _kernels[key] = Choice(HOPPER_SOURCE, name, 256, 128, (128 + 4 * 128) * d * 2 + 1024)
        elif name.startswith("fusedw"):  # a producer warpgroup and 2 (fusedw) or 3 (fusedw3) consumers of 64
            br = 64 * (3 if name.startswith("fusedw3") else 2)  # rows each: br a tile
            _kernels[key] = _fusedw_choice(WS_DIMS_SOURCE if d in OTHER_HEAD_DIMS else WS_SOURCE, name, d, br)
        else:
            w, mt, c = (int(g) for g in m.groups())
            rows = 16 * mt * w
            _kernels[key] = Choice(SOURCE, name, 32 * w, rows, (rows + 4 * c) * d * 2)
    return _kernels[key]


def _fusedw_choice(source: str, name: str, d: int, br: int) -> Choice:
    """fusedw's launch shape at head dim d with tiles of br query rows: a producer warpgroup and br / 64
    consumers; shared memory for the .cu file's Q and K/V stages of its tile dim, + 256 bytes for the
    mbarriers."""
    t = WS_TILE_DIM.get(d, d)
    return Choice(source, name, 128 + 2 * br, br,
                  (WS_Q_STAGES[t] * br + 2 * WS_KV_STAGES[t] * WS_KEY_TILE[t]) * t * 2 + 1024 + 256, WS_KEY_TILE[t])


def grid_mode() -> str:
    """fusedw's grid: one block per SM walking the tiles (persistent, the default: faster on the H200,
    causal or not, benchmarks/ladder.md), with tiles of uneven work (causal; fusedw3's partly empty
    last tile of a head) handed out by a counter ("sms", benchmarks/fused_shapes_h200.md) or every
    grid-th one ("static"); or one block per tile, the hardware handing out the next tile as a block
    ends ("tiles"). TPATTN_FUSED_GRID=sms, static or tiles."""
    env = os.environ.get("TPATTN_FUSED_GRID") or "sms"
    if env not in ("sms", "static", "tiles"):
        raise ConfigError(f"TPATTN_FUSED_GRID={env!r}: use sms, static or tiles")
    return env


_kernels: dict[tuple, Choice] = {}
_prepared: dict[tuple, Prepared] = {}  # fusedw launches, packed once per (tensors, shape, options)
_devices: dict[int, tuple[int, tuple[int, int]]] = {}
# per device: COUNTER_SLOTS counters (and tile numbers) for fusedw launches with uneven tiles
_counters: dict[str, torch.Tensor] = {}
_slots = [0]  # the next slot to hand out (round robin)
COUNTER_SLOTS = 1024
GROUP_TILES = 2  # causal fusedw: heads in groups of about this many query tiles per SM (0: a head at a time)


def _counter(device, sms: int) -> int:
    """The address of a pair of int32 zeros in device memory for one fusedw launch of uneven tiles to
    hand out its tiles with (the kernel leaves them at zero), followed, from byte 16, by two 16-byte slots for
    the tile numbers of each of its `sms` blocks (its producers write them, its consumers read them);
    0 (the static order) while a CUDA graph is being captured before any eager call
    made the pool, whose zeros would be written only at replay. The pool is never freed (a captured
    graph keeps pointing into it); a slot is shared by launches COUNTER_SLOTS apart in creation,
    which would clash only if both ran at the same time."""
    key = str(device)
    slot_bytes = 256 * _cdiv(16 + 32 * sms, 256)
    if key not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return 0
        _counters[key] = torch.zeros(COUNTER_SLOTS * slot_bytes // 4, dtype=torch.int32, device=device)
    slot = _slots[0] % COUNTER_SLOTS
    _slots[0] += 1
    return _counters[key].data_ptr() + slot_bytes * slot


def _device_info(device) -> tuple[int, tuple[int, int]]:
    """(SM count, compute capability), asked of the driver once per device."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _devices:
        _devices[idx] = (torch.cuda.get_device_properties(idx).multi_processor_count,
                         torch.cuda.get_device_capability(idx))
    return _devices[idx]


def paged_fits(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Whether FusedBackend.forward_paged takes q's rows over the pool k_pool [pages, g, page, d]: a GPU
    of compute capability 9.0, fp16 or bf16, head dim 64 or 128, pages of a power of two of 16 tokens or
    more, the pool contiguous and of q's dtype and device."""
    page = k_pool.shape[2]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and k_pool.dtype == q.dtype
            and k_pool.device == q.device and q.shape[-1] in PAGED_HEAD_DIMS and k_pool.shape[-1] == q.shape[-1]
            and page >= 16 and page & (page - 1) == 0 and k_pool.is_contiguous()
            and _device_info(q.device)[1] == HOPPER_CC)


def ws_schedule(device, sms: int, nq: int, bh: int, causal: bool, uneven: bool, mode: str = "sms") -> tuple:
    """(grid, counter, hg) of a fusedw-design launch (fusedw, and fp8_ws's fusedw8) over nq query tiles
    of each of bh heads on a GPU of `sms` SMs, in grid_mode `mode`: persistent ("sms", "static": a
    block per SM walking the tiles) or a block per tile ("tiles"). Where the tiles differ in work
    (uneven) a persistent block asks a counter for its next tile (_counter's address) instead of taking
    every grid-th one; otherwise the static order is even (the counter measured 1 % slower), counter 0.
    hg: causal, heads in groups of about GROUP_TILES tiles per SM, each group's longest tiles first."""
    tiles = nq * bh
    grid = (min(tiles, GRID_X_MAX if mode == "tiles" else sms), 1, 1)
    counter = _counter(device, sms) if uneven and mode == "sms" and tiles > grid[0] else 0
    hg = min(bh, _cdiv(GROUP_TILES * sms, nq)) if causal and GROUP_TILES else 1
    return grid, counter, hg


def _ws_launch(ch: Choice, q, k, v, o, lse_ptr, n: int, causal: bool, r0: int, r1: int, h: int, group: int,
               row_base: int, sms: int, kv_maps, paged: tuple | None = None) -> None:
    """Launch fusedw kernel ch over q's rows [r0, r1) of n (q and o from row row_base on): one grid
    dimension over (query tile, head) pairs, TMA maps of Q and (kv_maps(): made on a new set of tensors
    only) of K and V, the kernel's arguments packed once per set of tensors and options. Persistent by
    default (grid_mode). paged: (table, start, pshift) of the _pg kernels, whose rows [r0, r1) are
    positions L0 .. L0 + r1 - r0 - 1 with L0 read from `start` on the device (r0 = row_base = 0 here)."""
    mode = grid_mode()
    bh = q.shape[0] * h
    key = (ch.name, causal, r0, r1, row_base, mode, q.device.index, tuple(q.shape), tuple(k.shape), int(lse_ptr),
           *((t.data_ptr(), t.stride()) for t in (q, k, v, o)), paged and (paged[0].data_ptr(), paged[1].data_ptr()))
    prep = _prepared.get(key)
    if prep is None:
        # causal tiles differ in work (1 to N / 128 key tiles), and so do fusedw3's without
        # causal where a head's last 192-row tile leaves a warpgroup without rows (N = 257:
        # 65 rows; with two tiles a head and an even grid every other block drew only those)
        uneven = causal or (ch.rows == 192 and 0 < (r1 - r0) % 192 <= 128)
        grid, counter, hg = ws_schedule(q.device, sms, _cdiv(r1 - r0, ch.rows), bh, causal, uneven, mode)
        scale_log2 = np.float32(math.log2(math.e) / math.sqrt(q.shape[-1]))
        o_strides = (np.int64(o.stride(0)), np.int64(o.stride(1)), np.int32(o.stride(2)))
        if paged is None:
            args = (TensorMap(q, box=(64, ch.rows), rows_before=row_base), *kv_maps(), ptr(o, row_base), lse_ptr,
                    np.int32(bh), np.int32(n), scale_log2, np.int32(causal), np.int32(r0), np.int32(r1), np.int32(h),
                    np.int32(group), *o_strides, np.int32(hg), np.uint64(counter))
        else:
            table, start, pshift = paged
            args = (TensorMap(q, box=(64, ch.rows)), *kv_maps(), ptr(o), np.int32(bh), np.int32(r1 - r0), scale_log2,
                    np.int32(h), np.int32(group), *o_strides, np.int32(hg), np.uint64(counter), ptr(table), ptr(start),
                    np.int32(pshift))
        prep = Prepared(ch.source, ch.name, q.device, grid, (ch.threads, 1, 1), args, shared_mem=ch.shared)
        if len(_prepared) >= 64:
            _prepared.clear()
        _prepared[key] = prep
    prep()


def _rows_aligned(*ts) -> bool:
    """Each head's rows are contiguous and every row starts on 16 bytes (the kernels' cp.async), and no
    dimension of more than one element is broadcast (a stride of 0: a TMA map steps by 16 bytes or more)."""
    for t in ts:  # (a plain loop: this runs on every call, and generators cost the host microseconds)
        (s0, s1, s2, s3), (n0, n1, n2, _) = t.stride(), t.shape
        if s3 != 1 or t.data_ptr() % 16 or s0 % 8 or s1 % 8 or s2 % 8 or (s0 <= 0 and n0 != 1) or \
                (s1 <= 0 and n1 != 1) or (s2 <= 0 and n2 != 1):
            return False
    return True


class FusedBackend(CudaBackend):
    name = "fused"
    dtypes = ("fp16", "bf16")
    materializes_scores = False  # S and P live in registers only
    row_chunks = 128             # forward(rows=(r0, r1)) computes only those query rows: r0 a multiple of this
    saves_lse = True             # forward_for_backward saves the logsumexp
    strided = True               # q, k and v (k and v sharing strides) and o may be strided views:
                                 # batch, head and row strides, rows contiguous
    packed_grads = True          # forward_for_backward(out=), backward(do of any layout, out=)

    def head_dim_error(self, d: int) -> str | None:
        return None if d in HEAD_DIMS else unsupported_head_dim(d)

    def check_supported(self, cfg) -> None:
        super().check_supported(cfg)
        if cfg.device == "cuda" and torch.cuda.is_available():  # (before any GPU work, on every rank alike)
            why = hopper_only(cfg.head_dim, torch.cuda.get_device_capability())
            if why:
                raise FlagError(why)

    def forward(self, q, k, v, causal: bool, out=None, scratch=None, rows=None, lse=None, row_base: int = 0):
        """rows=(r0, r1): only query rows [r0, r1) of o are computed (against all keys, causal by
        their position in the sequence); r0 a multiple of row_chunks, r1 too or N. lse: a contiguous
        fp32 [B, h, N] tensor that receives each row's logsumexp (the backward's L). row_base (at most
        r0): q and out hold only rows [row_base, N) of the N = k's rows, [B, h, N - row_base, d] (a
        prefill's rows after a cache: no buffer for the rows before)."""
        b, h, n, d = q.shape
        if row_base:  # (kv_group checks that k has the n rows)
            n += row_base
            if lse is not None or rows is None or rows[0] < row_base:
                raise ValueError(f"row_base={row_base}: q holds rows [{row_base}, {n}) of k's {k.shape[2]}, rows= "
                                 f"starts at row_base or after (got {rows}), and no lse")
        if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
            raise ValueError(f"q, k and v must share a dtype and a device (got {q.dtype}, {k.dtype}, {v.dtype} on "
                             f"{q.device}, {k.device}, {v.device})")
        suf = self.kernel_suffix(q)
        group = kv_group(q, k, v, row_base)  # query heads per K/V head: query head i reads K/V head i // group
        if not _rows_aligned(q):
            q = q.contiguous()
        if not (k.stride() == v.stride() and _rows_aligned(k, v)):
            k, v = k.contiguous(), v.contiguous()
        o = out if out is not None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
        assert o.dtype == q.dtype and o.device == q.device and o.shape == q.shape and _rows_aligned(o)
        bh = b * h
        r0, r1 = rows or (0, n)
        if r0 % self.row_chunks or not 0 <= r0 < r1 <= n or (r1 % self.row_chunks and r1 != n):
            raise ValueError(f"rows {rows}: a chunk starts at a multiple of {self.row_chunks} and ends at one or at N={n}")
        if bh == 0:  # nothing to compute (and no grid to launch)
            return o
        sms, cc = _device_info(q.device)
        ch = kernel_for(d, suf, cc, wide=2 * _cdiv(r1 - r0, 128) * bh >= sms, rows=r1 - r0)
        if lse is not None:
            assert lse.dtype == torch.float32 and lse.is_contiguous() and lse.shape == (b, h, n)
        lse_ptr = np.uint64(0 if lse is None else lse.data_ptr())
        scale_log2 = np.float32(math.log2(math.e) / math.sqrt(d))
        t0, t1 = r0 // ch.rows, _cdiv(r1, ch.rows)
        with section("fused"):
            if ch.source in (WS_SOURCE, WS_DIMS_SOURCE):  # one grid dimension over (query tile, head) pairs; TMA maps of Q, K, V
                _ws_launch(ch, q, k, v, o, lse_ptr, n, causal, r0, r1, h, group, row_base, sms,
                           lambda: (TensorMap(k, box=(64, ch.keys)), TensorMap(v, box=(64, ch.keys))))
                return o
            grid = (min(t1 - t0, GRID_X_MAX), min(bh, GRID_YZ_MAX), 1)
            launch(ch.source, ch.name, q.device, grid, (ch.threads, 1, 1),
                   (ptr(q, row_base), ptr(k), ptr(v), ptr(o, row_base), lse_ptr, np.int32(bh), np.int32(n), scale_log2,
                    np.int32(causal),
                    np.int32(t0), np.int32(t1), np.int32(h), np.int32(group),
                    np.int64(q.stride(0)), np.int64(q.stride(1)), np.int32(q.stride(2)),
                    np.int64(k.stride(0)), np.int64(k.stride(1)), np.int32(k.stride(2)),
                    np.int64(o.stride(0)), np.int64(o.stride(1)), np.int32(o.stride(2))),
                   shared_mem=ch.shared)
        return o

    def forward_paged(self, q, k_pool, v_pool, table: torch.Tensor, start: torch.Tensor, out, L0: int | None = None) -> None:
        """A prefill's T query rows of one sequence, at positions L0 .. L0 + T - 1 where L0 (its length
        before the step) is read from `start` on the device (an int32 element: one CUDA graph serves
        every chunk of T rows), causal over its first L0 + T keys, into out: q and out [1, h, T, d] (any
        layout with contiguous, 16-byte aligned rows: the [T, h, d] rows of a projection seen heads
        first), K and V read in place from the pool k_pool, v_pool [pages, g, page, d] through the
        sequence's block-table row `table` (int32 page ids on the device, enough for L0 + T keys; L0:
        the host's copy, where it has one, checked against the table's width): fusedw's paged kernels
        (fused_ws_paged.cu), nothing gathered, no buffer of the rows before L0, row tiles from L0 (any
        L0). paged_fits() says where they run."""
        _, h, T, d = q.shape
        g, page = k_pool.shape[1], k_pool.shape[2]
        if not (paged_fits(q, k_pool) and v_pool.shape == k_pool.shape and v_pool.stride() == k_pool.stride()
                and table.dtype == start.dtype == torch.int32 and table.is_contiguous() and start.numel() >= 1
                and (L0 is None or (L0 >= 0 and table.numel() * page >= L0 + T))
                and out.shape == q.shape and out.dtype == q.dtype and _rows_aligned(q, out) and h % g == 0 and T > 0):
            raise ValueError(f"forward_paged: q {tuple(q.shape)} at rows {L0}.., pools {tuple(k_pool.shape)}, "
                             f"{tuple(v_pool.shape)}, table {tuple(table.shape)} {table.dtype}: not a call its "
                             "kernels take (paged_fits)")
        sms, _ = _device_info(q.device)
        suf = self.kernel_suffix(q)
        ch = _fusedw_choice(WS_PAGED_SOURCE, f"fusedw_{suf}_d{d}_pg", d, 128)  # (whatever TPATTN_FUSED_CFG says)
        box = (64, min(page, ch.keys))
        with section("fused"):
            _ws_launch(ch, q, k_pool, v_pool, out, np.uint64(0), T, True, 0, T, h, h // g, 0, sms,
                       lambda: (TensorMap(k_pool, box=box), TensorMap(v_pool, box=box)),
                       paged=(table, start, page.bit_length() - 1))

    # ---- the backward (kernels/fused_attention_backward.cu; the math: tpattn/attention/autograd.py) ----

    def forward_for_backward(self, q, k, v, causal: bool, out=None):
        """(o, L): the forward, also writing each row's logsumexp L (fp32 [B, h, N]), all the
        backward needs beyond q, k, v and o (no N x N tensor). out: o's memory (a strided view, as
        forward's out=)."""
        b, h, n, _ = q.shape
        lse = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
        return self.forward(q, k, v, causal, out=out, lse=lse), lse

    def backward(self, q, k, v, o, lse, do, causal: bool, deterministic: bool = False, out=None):
        """(dq, dk, dv). On compute capability 9.0 (kernels/fused_hopper_backward.cu, wgmma) by default
        five products: hbwd_pre (Dl = rowsum(dO o O), the fp32 dQ sum zeroed), hbwd5w_kv or hbwd5_kv (a
        block per 128 keys of a K/V head: dK and dV in registers, summed over the query heads of its
        group, and each step's dS K added to the dQ sum, in whatever order the blocks run; bwd5_kernel),
        hbwd_dq_out (the sum to dQ). deterministic=True, and elsewhere: seven products, no atomics, the
        same bits every run: one block per key tile for dK and dV, one per query tile for dQ (the wgmma
        hbwd_dq, which also writes Dl, then hbwd_kv; or mma.sync's fbwd_dot, fbwd_kv, fbwd_dq); see
        bwd_kernels. q, k, v, o and do may be strided views with contiguous rows: hbwd5w_kv reads them
        in place (TMA), the other kernels from contiguous copies. out: (dq, dk, dv) to write, strided
        views alike (hbwd5w_kv's path writes them in place; the others copy into them). The other head
        dims (OTHER_HEAD_DIMS): the Triton rung's backward, which reads the same L (natural log), no
        atomics (the same bits every run, so deterministic needs nothing more)."""
        b, h, n, d = q.shape
        suf = self.kernel_suffix(q)
        group = kv_group(q, k, v)
        if not (q.dtype == k.dtype == v.dtype == o.dtype == do.dtype):
            raise ValueError(f"q, k, v, o and do must share a dtype (got {q.dtype}, {k.dtype}, {v.dtype}, {o.dtype}, "
                             f"{do.dtype})")
        if out is not None:
            for name, t, like in zip(("dq", "dk", "dv"), out, (q, k, v)):
                if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
                    raise ValueError(f"out's {name} must match its input ({tuple(like.shape)}, {like.dtype}, "
                                     f"{like.device}); got {tuple(t.shape)}, {t.dtype}, {t.device}")
        if d not in BWD_HEAD_DIMS:
            from .triton_fused import TritonBackend
            return write_into(out, TritonBackend().backward(q, k, v, o, lse, do, causal, deterministic))
        g = k.shape[1]
        dev = q.device
        kernels = bwd_kernels(_device_info(dev)[1]) if b * h * n else "mma"
        five = kernels == "wgmma" and not deterministic
        ws = five and bwd5_kernel(d, out is not None or not all(t.is_contiguous() for t in (q, k, v, o, do))) == "ws"
        # the kernels' operands: rows contiguous and starting on 16 bytes, and (except for hbwd5w_kv's
        # tensor maps and hbwd_pre's strides) contiguous; anything else is copied
        if ws:
            q, k, v, o, do = (t if _rows_aligned(t) else t.clone(memory_format=torch.contiguous_format)
                              for t in (q, k, v, o, do))
        else:
            q, k, v, o, do = (t if _rows_aligned(t) else t.clone() for t in (t.contiguous() for t in (q, k, v, o, do)))
        if out is not None and ws and _rows_aligned(*out) and out[1].stride() == out[2].stride():
            dq, dk, dv = out
        else:
            dq, dk, dv = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
                k, memory_format=torch.contiguous_format), torch.empty_like(v, memory_format=torch.contiguous_format)
        if b * h * n == 0:
            return write_into(out, (dq, dk, dv))
        dl = torch.empty(b, h, n, dtype=torch.float32, device=dev)
        scale = np.float32(1.0 / math.sqrt(d))
        kv_args = (ptr(q), ptr(k), ptr(v), ptr(do), ptr(lse), ptr(dl), ptr(dk), ptr(dv), np.int32(b * g), np.int32(g),
                   np.int32(group), np.int32(n), scale, np.int32(causal))
        tail = (np.int32(b * h), np.int32(h), np.int32(group), np.int32(n), scale, np.int32(causal))
        if five:
            # five products: hbwd_pre writes Dl and zeros the fp32 dQ sum, hbwd5w_kv / hbwd5_kv add each
            # block's dS K into it (in whatever order the blocks run) beside dK and dV; hbwd_dq_out turns
            # the sum (laid out as the accumulators are held) into dq
            rows = b * h * n
            dqa = torch.empty(b * h * _cdiv(n, 64) * 64 * d, dtype=torch.float32, device=dev)
            with section("bwd_pre"):
                launch(HOPPER_BWD_SOURCE, f"hbwd_pre_{suf}_d{d}", dev, (min(_cdiv(rows, 8), GRID_X_MAX), 1, 1),
                       (256, 1, 1), (ptr(o), ptr(do), ptr(dl), ptr(dqa), np.int64(rows), np.int64(dqa.numel() // 4),
                                     np.int32(h), np.int32(n), *_strides3(o), *_strides3(do)))
            with section("bwd_kv"):
                _bwd5_kv(ws, q, k, v, do, lse, dl, dk, dv, dqa, kv_args, suf, (n, 0))
            with section("bwd_dq"):
                tiles = b * h * _cdiv(n, 64) * (d // 64)
                launch(HOPPER_BWD_SOURCE, f"hbwd_dq_out_{suf}_d{d}", dev, (min(tiles, GRID_X_MAX), 1, 1), (256, 1, 1),
                       (ptr(dqa), ptr(dq), np.int32(n), np.int64(tiles), np.int32(h), *_strides3(dq)))
            return write_into(out, (dq, dk, dv))
        if kernels == "wgmma":
            # hbwd_dq also writes Dl (of its own rows, from O and dO), which hbwd_kv, launched after it, reads
            with section("bwd_dq"):
                launch(HOPPER_BWD_SOURCE, f"hbwd_dq_{suf}_d{d}", dev, (_cdiv(n, 128), min(b * h, GRID_YZ_MAX), 1),
                       (256, 1, 1), (ptr(q), ptr(k), ptr(v), ptr(o), ptr(do), ptr(lse), ptr(dl), ptr(dq), *tail),
                       shared_mem=(2 * 128 + 6 * 64) * d * 2 + 1024)
            with section("bwd_kv"):
                launch(HOPPER_BWD_SOURCE, f"hbwd_kv_{suf}_d{d}", dev, (_cdiv(n, 128), min(b * g, GRID_YZ_MAX), 1),
                       (256, 1, 1), kv_args, shared_mem=(2 * 128 + 4 * 64) * d * 2 + 1024 + 1024)
            return write_into(out, (dq, dk, dv))
        br = BWD_ROWS[d]
        with section("bwd_dot"):
            rows = b * h * n
            launch(BWD_SOURCE, f"fbwd_dot_{suf}_d{d}", dev, (min(_cdiv(rows, 8), GRID_X_MAX), 1, 1), (256, 1, 1),
                   (ptr(o), ptr(do), ptr(dl), np.int64(rows)))
        with section("bwd_kv"):
            launch(BWD_SOURCE, f"fbwd_kv_{suf}_d{d}", dev, (_cdiv(n, 64), min(b * g, GRID_YZ_MAX), 1), (128, 1, 1),
                   kv_args, shared_mem=(2 * 64 * d + 4 * br * d) * 2 + 4 * br * 4)
        with section("bwd_dq"):
            launch(BWD_SOURCE, f"fbwd_dq_{suf}_d{d}", dev, (_cdiv(n, 64), min(b * h, GRID_YZ_MAX), 1), (128, 1, 1),
                   (ptr(q), ptr(k), ptr(v), ptr(do), ptr(lse), ptr(dl), ptr(dq), *tail), shared_mem=6 * 64 * d * 2)
        return write_into(out, (dq, dk, dv))


    # ---- one dQ summed over several calls (the ring's pieces of one rank's query rows) ----------------

    def dq_sum(self, q, o, lse, do, deterministic: bool = False) -> "DqSum | None":
        """The five-product backward's state for several calls that add into the dQ of one set of query
        rows (q, o, do [B, h, n, d], lse fp32 [B, h, n]): Dl = rowsum(dO o O) of every row and the fp32
        dQ sum zeroed, in one hbwd_pre; each backward_summing call's kernel then adds its dS K into the
        sum, and dq_of_sum turns it into dQ once. None where the five products do not run
        (deterministic, another compute capability or head dim, no rows): the caller adds each call's dQ."""
        b, h, n, d = q.shape
        if (deterministic or d not in BWD_HEAD_DIMS or q.dtype not in (torch.float16, torch.bfloat16)
                or b * h * n == 0 or bwd_kernels(_device_info(q.device)[1]) != "wgmma"):
            return None
        suf = self.kernel_suffix(q)
        o, do = (t if _rows_aligned(t) else t.clone(memory_format=torch.contiguous_format) for t in (o, do))
        dl = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
        dqa = torch.empty(b * h * _cdiv(n, 64) * 64 * d, dtype=torch.float32, device=q.device)
        rows = b * h * n
        with section("bwd_pre"):
            launch(HOPPER_BWD_SOURCE, f"hbwd_pre_{suf}_d{d}", q.device, (min(_cdiv(rows, 8), GRID_X_MAX), 1, 1),
                   (256, 1, 1), (ptr(o), ptr(do), ptr(dl), ptr(dqa), np.int64(rows), np.int64(dqa.numel() // 4),
                                 np.int32(h), np.int32(n), *_strides3(o), *_strides3(do)))
        return DqSum(lse.to(torch.float32).contiguous(), dl, dqa, tuple(q.shape), q.dtype)

    def backward_summing(self, q, k, v, do, causal: bool, sums: "DqSum", ldn: int, qoff: int):
        """(dk, dv) of one call over some of dq_sum's rows, its dQ added into sums (the five-product
        kernel without hbwd_pre and hbwd_dq_out). q, do [B, h', N, d] are rows of the sum's: call head i's
        row r is the sum's row (i ldn + qoff + r) of its flat [B h n] rows, which is where its L and Dl
        are read: ldn = N with h' = h n / N (the sum's rows seen as more heads; N and n multiples of 64
        when h' > h), or ldn = n and qoff a multiple of 64 (a range of each head's rows, ending on a tile or at
        n). Anything else is refused (its dQ tiles would land on other rows'). causal masks by the call's
        own rows and keys (row r sees keys 0..r), whatever qoff: the ring's causal pieces are the diagonal
        block (qoff 0) and whole blocks below it (causal False)."""
        b, h, n, d = q.shape
        bad = summing_refusal(sums.shape, q.shape, ldn, qoff)
        if bad:
            raise ValueError(bad)
        if not (q.dtype == k.dtype == v.dtype == do.dtype == sums.dtype) or d != sums.shape[3]:
            raise ValueError(f"backward_summing: q, k, v and do must have the sum's dtype {sums.dtype} and head dim "
                             f"{sums.shape[3]} (got {q.dtype}, {k.dtype}, {v.dtype}, {do.dtype}, d={d})")
        suf = self.kernel_suffix(q)
        group = kv_group(q, k, v)
        g = k.shape[1]
        strided = not all(t.is_contiguous() for t in (q, k, v, do))
        ws = bwd5_kernel(d, strided) == "ws"
        if ws:
            q, k, v, do = (t if _rows_aligned(t) else t.clone(memory_format=torch.contiguous_format)
                           for t in (q, k, v, do))
        else:
            q, k, v, do = (t if _rows_aligned(t) else t.clone() for t in (t.contiguous() for t in (q, k, v, do)))
        dk, dv = torch.empty_like(k, memory_format=torch.contiguous_format), torch.empty_like(
            v, memory_format=torch.contiguous_format)
        kv_args = (ptr(q), ptr(k), ptr(v), ptr(do), ptr(sums.lse), ptr(sums.dl), ptr(dk), ptr(dv), np.int32(b * g),
                   np.int32(g), np.int32(group), np.int32(n), np.float32(1.0 / math.sqrt(d)), np.int32(causal))
        with section("bwd_kv"):
            _bwd5_kv(ws, q, k, v, do, sums.lse, sums.dl, dk, dv, sums.dqa, kv_args, suf, (ldn, qoff))
        return dk, dv

    def dq_of_sum(self, sums: "DqSum") -> torch.Tensor:
        """dQ [B, h, n, d] (the rows' dtype) from dq_sum's fp32 sum, rounded once (hbwd_dq_out)."""
        b, h, n, d = sums.shape
        dq = torch.empty(sums.shape, dtype=sums.dtype, device=sums.dqa.device)
        suf = "bf16" if sums.dtype == torch.bfloat16 else "f16"
        tiles = b * h * _cdiv(n, 64) * (d // 64)
        with section("bwd_dq"):
            launch(HOPPER_BWD_SOURCE, f"hbwd_dq_out_{suf}_d{d}", dq.device, (min(tiles, GRID_X_MAX), 1, 1), (256, 1, 1),
                   (ptr(sums.dqa), ptr(dq), np.int32(n), np.int64(tiles), np.int32(h), *_strides3(dq)))
        return dq


class DqSum(NamedTuple):
    """FusedBackend.dq_sum's state: the rows' L and Dl (fp32 [B, h, n]) and the fp32 dQ sum in the
    kernels' layout (tests/backward_check.py: dq_from_sum), for rows of shape (B, h, n, d) and dtype."""
    lse: torch.Tensor
    dl: torch.Tensor
    dqa: torch.Tensor
    shape: tuple
    dtype: torch.dtype


def summing_refusal(rows_shape, q_shape, ldn: int, qoff: int) -> str | None:
    """Why a backward_summing call of q_shape [B, h', N, d] at (ldn, qoff) cannot add into a sum of
    rows_shape [B, h, n, d] (its rows or dQ tiles would not be its own), or None."""
    b, h, n = q_shape[:3]
    B, H, rows_n = rows_shape[:3]
    if (qoff % 64 or (ldn != rows_n and (ldn % 64 or rows_n % 64)) or (n % 64 and qoff + n != ldn) or qoff + n > ldn
            or b * h * ldn != B * H * rows_n):
        return (f"backward_summing: rows [{qoff}, {qoff + n}) of {ldn} a head (q {tuple(q_shape)}) are not "
                f"tile-aligned rows of the sum's {tuple(rows_shape)}")
    return None


def _bwd5_kv(ws: bool, q, k, v, do, lse, dl, dk, dv, dqa, kv_args, suf: str, rows: tuple[int, int]) -> None:
    """The five-product dK/dV kernel (hbwd5w_kv when ws, else hbwd5_kv) adding dS K into dqa; rows:
    (ldn, qoff), where L, Dl and dqa hold each head's rows (kernels/fused_hopper_backward.cu's hb_kv)."""
    b, g, n, d = k.shape
    extra = (np.int32(rows[0]), np.int32(rows[1]))
    if ws:
        _bwd5_ws(q, k, v, do, lse, dl, dk, dv, dqa, kv_args[8:], suf, extra)
    else:
        launch(HOPPER_BWD_SOURCE, f"hbwd5_kv_{suf}_d{d}", q.device, (_cdiv(n, 128), min(b * g, GRID_YZ_MAX), 1),
               (256, 1, 1), (*kv_args[:8], ptr(dqa), *kv_args[8:], *extra), shared_mem=bwd5_shared_mem(d))


def _strides3(t: torch.Tensor) -> tuple:
    """The batch, head and row strides of a [B, H, N, D] tensor (elements), as the kernels' long longs."""
    return tuple(np.int64(x) for x in t.stride()[:3])


_prepared_bwd: dict[tuple, Prepared] = {}  # hbwd5w launches, packed once per (tensors, shape)


def _bwd5_ws(q, k, v, do, lse, dl, dk, dv, dqa, tail, suf: str, rows: tuple) -> None:
    """hbwd5w_kv: the five-product kernel split by role (a loader warp bringing K, V, Q and dO in by TMA,
    an adder warp sending each step's dQ tile to the fp32 sum in one bulk reduce-add, two consumer
    warpgroups computing), a block per 128 keys of a K/V head; launched through tensor maps. rows: the
    kernel's (ldn, qoff) (see _bwd5_kv)."""
    b, g, n, d = k.shape
    key = (suf, d, q.device.index, tuple(q.shape), tuple(k.shape), *((t.data_ptr(), t.stride()) for t in (q, k, v, do)),
           *(t.data_ptr() for t in (lse, dl, dk, dv, dqa)), dk.stride(), *(float(x) for x in tail), *map(int, rows))
    prep = _prepared_bwd.get(key)
    if prep is None:
        grid = (_cdiv(n, 128), min(b * g, GRID_YZ_MAX), 1)
        prep = Prepared(HOPPER_BWD_SOURCE, f"hbwd5w_kv_{suf}_d{d}", q.device, grid, (384, 1, 1),
                        (TensorMap(q, box=(64, 64)), TensorMap(k), TensorMap(v), TensorMap(do, box=(64, 64)),
                         ptr(lse), ptr(dl), ptr(dk), ptr(dv), ptr(dqa), *tail, *_strides3(dk), *rows),
                        shared_mem=bwd5w_shared_mem(d))
        if len(_prepared_bwd) >= 64:
            _prepared_bwd.clear()
        _prepared_bwd[key] = prep
    prep()


def bwd5w_shared_mem(d: int) -> int:
    """Dynamic shared memory of hbwd5w_kv: K and V (128 keys), two stages of Q and dO (64 rows), two
    dS^T buffers (128 x 64), two fp32 dQ staging buffers (64 x d), L and Dl, the mbarriers and the
    1024-byte alignment."""
    return (2 * 128 + 4 * 64) * d * 2 + 2 * 128 * 64 * 2 + 2 * 64 * d * 4 + 1024 + 64 + 1024


def bwd5_kernel(d: int, strided: bool = False) -> str:
    """Which five-product kernel runs on compute capability 9.0: "ws" (hbwd5w_kv, warp-specialized, dQ by
    bulk reduce-adds from shared memory; reads q, k, v, do and writes dk, dv in place, strided) or "red"
    (hbwd5_kv, every thread adding its dQ accumulators with red.global.add; contiguous operands only).
    By measurement on the H200 (docs/backward.md): ws at d = 128 (3-5 % faster); at d = 64 red's kernel
    is 10 % faster, so red takes contiguous operands and ws strided ones (`strided`: what the layer's
    training step hands over, where red would first copy q, k, v, o, do and then dq, dk, dv: more than
    the kernels' difference). TPATTN_FUSED_BWD5 picks one (the benchmark's comparison)."""
    env = os.environ.get("TPATTN_FUSED_BWD5") or ""
    if env not in ("", "ws", "red"):
        raise ConfigError(f"TPATTN_FUSED_BWD5={env!r}: use ws or red (or leave it unset)")
    return env or ("ws" if d == 128 or strided else "red")


def bwd5_shared_mem(d: int) -> int:
    """Dynamic shared memory of hbwd5_kv: K and V (128 keys), two buffers of Q and dO (64 rows), L and Dl,
    the 1024-byte alignment and two buffers of dS^T (128 x 64)."""
    return (2 * 128 + 4 * 64) * d * 2 + 1024 + 1024 + 2 * 128 * 64 * 2


def bwd_kernels(cc: tuple[int, int]) -> str:
    """Which fused backward runs on a GPU of compute capability cc: "wgmma" on 9.0
    (kernels/fused_hopper_backward.cu), "mma" (kernels/fused_attention_backward.cu, mma.sync) elsewhere.
    TPATTN_FUSED_BWD=mma picks the portable one on 9.0 too (the benchmark's comparison)."""
    env = os.environ.get("TPATTN_FUSED_BWD") or ""
    if env not in ("", "mma", "wgmma"):
        raise ConfigError(f"TPATTN_FUSED_BWD={env!r}: use mma or wgmma (or leave it unset)")
    if env == "wgmma" and cc != HOPPER_CC:
        raise ConfigError(f"TPATTN_FUSED_BWD=wgmma needs compute capability 9.0 (this GPU has {cc[0]}.{cc[1]}); unset it")
    return env or ("wgmma" if cc == HOPPER_CC else "mma")
