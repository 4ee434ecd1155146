"""Three passes with S and P in device memory, built for the memory system and the tensor cores
(kernels/tiled_attention.cu): mma.sync tiles for QK^T and PV, a warp per softmax row with 16-byte
loads. On compute capability 9.0 with head dim 64 or 128 the QK and PV passes run on wgmma instead
(kernels/tiled_hopper_attention.cu); TPATTN_TILED_IMPL=mma keeps the mma.sync ones. Launched via CuPy.

The backward (attention(..., backend="tiled") then o.backward(do)) is the naive backward, reused: the
tiled forward gives O, then NaiveBackend.backward recomputes P with the seed's kernels and runs one
materialized kernel per line of the math (kernels/naive_attention_backward.cu)."""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from ..errors import ConfigError
from ..cuda import GRID_X_MAX, GRID_YZ_MAX, launch, ptr
from ..timing import section
from . import CudaBackend, kv_group
from .naive import NaiveBackend

SOURCE = "tiled_attention.cu"
HOPPER_SOURCE = "tiled_hopper_attention.cu"  # wgmma (sm_90a) QK and PV passes
HOPPER_HEAD_DIMS = (64, 128)
TILE = 128            # query rows (and key columns) per tile; must match the .cu file
SOFTMAX_WARPS = 4     # rows per softmax block; must match the .cu file's launch bounds
SOFTMAX_CACHE_COLS = 4096   # rows up to this are held in registers (TPT_CACHE in the .cu file)
SOFTMAX_SMEM_COLS = 16384   # longer rows up to this go through shared memory (TPT_SMEM_COLS)
QK_SHARED = 2 * 2 * TILE * 64 * 2  # two stages of 64-wide Q and K slices
HOPPER_KG = 8         # key tiles per block in the wgmma QK pass; must match the .cu file


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def row_stride(n: int) -> int:
    """Elements per row of S and P: N rounded up to 8, so that every row starts on 16 bytes."""
    return _cdiv(n, 8) * 8


def scratch_shape(b: int, h: int, n: int) -> tuple[int, int, int, int]:
    return (b, h, n, row_stride(n))


def hopper_passes(d: int, device) -> bool:
    """Whether the QK and PV passes run on wgmma (compute capability 9.0, head dim 64 or 128)."""
    impl = os.environ.get("TPATTN_TILED_IMPL", "auto")
    if impl not in ("auto", "mma"):
        raise ConfigError(f"TPATTN_TILED_IMPL={impl!r}: use auto (wgmma where it runs) or mma")
    return impl == "auto" and d in HOPPER_HEAD_DIMS and torch.cuda.get_device_capability(device) == (9, 0)


def softmax_shared(ld: int) -> int:
    """Rows longer than the register cache, up to SOFTMAX_SMEM_COLS, are staged in shared memory."""
    return SOFTMAX_WARPS * ld * 2 if SOFTMAX_CACHE_COLS < ld <= SOFTMAX_SMEM_COLS else 0


def hopper_qk_shared(d: int) -> int:
    """Q tile, two K tiles and (d < 128: the K tile is too small to stage S in) an S tile; +1 KiB alignment."""
    return (3 * TILE * d + (TILE * TILE if d < TILE else 0)) * 2 + 1024


def hopper_pv_shared(d: int) -> int:
    """Three stages of a 128 x 64 P tile and a 64 x d V tile; +1 KiB alignment."""
    return 3 * (TILE * 64 + 64 * d) * 2 + 1024


def unsupported_head_dim(d: int) -> str:
    return f"--kernel tiled supports head dims that are multiples of 8 up to 256 (got {d}); use --kernel naive"


class TiledBackend(CudaBackend):
    """The tiled forward; its backward is the naive one (NaiveBackend.backward), reused as is."""
    name = "tiled"
    dtypes = ("fp16", "bf16")

    def head_dim_error(self, d: int) -> str | None:
        return None if d % 8 == 0 and 8 <= d <= self.max_head_dim else unsupported_head_dim(d)

    def forward(self, q, k, v, causal: bool, out=None, scratch=None):
        b, h, n, d = q.shape
        suf = self.kernel_suffix(q)
        group = kv_group(q, k, v)  # query heads per K/V head: query head i reads K/V head i // group
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        ld = row_stride(n)
        if scratch is None:
            s = torch.empty(scratch_shape(b, h, n), dtype=q.dtype, device=q.device)
            p = torch.empty_like(s)
        else:
            s, p = scratch
        o = out if out is not None else torch.empty_like(q)
        for t in (s, p):
            assert t.is_contiguous() and t.dtype == q.dtype and t.device == q.device
            assert tuple(t.shape) == scratch_shape(b, h, n), f"S/P must be {scratch_shape(b, h, n)}"
        assert o.is_contiguous() and o.dtype == q.dtype and o.device == q.device
        bh, dev = b * h, q.device
        tiles = _cdiv(n, TILE)
        assert tiles <= GRID_YZ_MAX, f"--seq-len {n} beyond {GRID_YZ_MAX * TILE} for --kernel tiled"
        hopper = hopper_passes(d, dev)
        with section("qk"):
            if hopper:
                launch(HOPPER_SOURCE, f"tiledh_qk_{suf}_d{d}", dev, (_cdiv(tiles, HOPPER_KG), tiles, min(bh, GRID_YZ_MAX)),
                       (256, 1, 1), (ptr(q), ptr(k), ptr(s), np.int32(bh), np.int32(n), np.int32(ld),
                                     np.float32(1.0 / math.sqrt(d)), np.int32(causal), np.int32(group)),
                       shared_mem=hopper_qk_shared(d))
            else:
                launch(SOURCE, f"tiled_qk_{suf}", dev, (tiles, tiles, min(bh, GRID_YZ_MAX)), (128, 1, 1),
                       (ptr(q), ptr(k), ptr(s), np.int32(bh), np.int32(n), np.int32(d), np.int32(ld),
                        np.float32(1.0 / math.sqrt(d)), np.int32(causal), np.int32(group)), shared_mem=QK_SHARED)
        with section("softmax"):
            rows = bh * n
            launch(SOURCE, f"tiled_softmax_{suf}", dev, (min(_cdiv(rows, SOFTMAX_WARPS), GRID_X_MAX), 1, 1),
                   (32 * SOFTMAX_WARPS, 1, 1),
                   (ptr(s), ptr(p), np.int64(rows), np.int32(n), np.int32(ld), np.int32(causal)),
                   shared_mem=softmax_shared(ld))
        with section("pv"):
            if hopper:
                launch(HOPPER_SOURCE, f"tiledh_pv_{suf}_d{d}", dev, (tiles, min(bh, GRID_YZ_MAX), 1), (256, 1, 1),
                       (ptr(p), ptr(v), ptr(o), np.int32(bh), np.int32(n), np.int32(ld), np.int32(causal),
                        np.int32(group)),
                       shared_mem=hopper_pv_shared(d))
            else:
                dn = 64 if d <= 64 else 128
                launch(SOURCE, f"tiled_pv_{suf}_n{dn}", dev, (_cdiv(d, dn), tiles, min(bh, GRID_YZ_MAX)), (128, 1, 1),
                       (ptr(p), ptr(v), ptr(o), np.int32(bh), np.int32(n), np.int32(d), np.int32(ld),
                        np.int32(causal), np.int32(group)), shared_mem=2 * (128 * 64 + 64 * dn) * 2)
        return o

    # ---- the backward: the naive one (tpattn/attention/naive.py, kernels/naive_attention_backward.cu) ----

    def forward_for_backward(self, q, k, v, causal: bool):
        """(o, None): the tiled forward; the backward recomputes P itself, so nothing is saved."""
        return self.forward(q, k, v, causal), None

    def backward(self, q, k, v, o, saved, do, causal: bool, deterministic: bool = False):
        """(dq, dk, dv): the naive backward (NaiveBackend.backward: P recomputed with the seed's qkKernel
        and softmaxKernel, then dV, dP, D, dS, dQ, dK one materialized kernel each), reused as is: this
        rung has no tiled backward of its own yet. D = rowsum(dO ∘ O) reads this backend's own O. Refuses
        with tiled's own lines first (dtype, head dim), then runs wherever the naive kernels do."""
        self.kernel_suffix(q)
        return NaiveBackend().backward(q, k, v, o, saved, do, causal, deterministic)
