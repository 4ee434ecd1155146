"""Three passes with S and P in device memory, built for the memory system and the tensor cores
(kernels/tiled_attention.cu): mma.sync tiles for QK^T and PV, a warp per softmax row with 16-byte
loads. Launched via CuPy."""

from __future__ import annotations

import math

import numpy as np
import torch

from ..cuda import GRID_X_MAX, GRID_YZ_MAX, launch, ptr
from ..timing import section
from . import CudaBackend

SOURCE = "tiled_attention.cu"
TILE = 128            # query rows (and key columns) per tile; must match the .cu file
SOFTMAX_WARPS = 8     # rows per softmax block
QK_SHARED = 2 * 2 * TILE * 64 * 2  # two stages of 64-wide Q and K slices


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def row_stride(n: int) -> int:
    """Elements per row of S and P: N rounded up to 8, so that every row starts on 16 bytes."""
    return _cdiv(n, 8) * 8


def scratch_shape(b: int, h: int, n: int) -> tuple[int, int, int, int]:
    return (b, h, n, row_stride(n))


def unsupported_head_dim(d: int) -> str:
    return f"--kernel tiled supports head dims that are multiples of 8 up to 256 (got {d}); use --kernel naive"


class TiledBackend(CudaBackend):
    name = "tiled"
    dtypes = ("fp16", "bf16")

    def head_dim_error(self, d: int) -> str | None:
        return None if d % 8 == 0 and 8 <= d <= self.max_head_dim else unsupported_head_dim(d)

    def forward(self, q, k, v, causal: bool, timer=None, out=None, scratch=None):
        b, h, n, d = q.shape
        suf = self.kernel_suffix(q)
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
        with section(timer, "qk"):
            launch(SOURCE, f"tiled_qk_{suf}", dev, (tiles, tiles, min(bh, GRID_YZ_MAX)), (128, 1, 1),
                   (ptr(q), ptr(k), ptr(s), np.int32(bh), np.int32(n), np.int32(d), np.int32(ld),
                    np.float32(1.0 / math.sqrt(d)), np.int32(causal)), shared_mem=QK_SHARED)
        with section(timer, "softmax"):
            rows = bh * n
            launch(SOURCE, f"tiled_softmax_{suf}", dev, (min(_cdiv(rows, SOFTMAX_WARPS), GRID_X_MAX), 1, 1),
                   (32 * SOFTMAX_WARPS, 1, 1),
                   (ptr(s), ptr(p), np.int64(rows), np.int32(n), np.int32(ld), np.int32(causal)))
        with section(timer, "pv"):
            dn = 64 if d <= 64 else 128
            launch(SOURCE, f"tiled_pv_{suf}_n{dn}", dev, (_cdiv(d, dn), tiles, min(bh, GRID_YZ_MAX)), (128, 1, 1),
                   (ptr(p), ptr(v), ptr(o), np.int32(bh), np.int32(n), np.int32(d), np.int32(ld), np.int32(causal)),
                   shared_mem=2 * (128 * 64 + 64 * dn) * 2)
        return o
