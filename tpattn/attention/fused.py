"""One fused CUDA kernel (kernels/fused_attention.cu): Q tiles against streamed K and V tiles,
online softmax, tensor cores; S and P never reach device memory. Launched via CuPy."""

from __future__ import annotations

import math
import os
import re

import numpy as np
import torch

from ..config import ConfigError
from ..cuda import GRID_X_MAX, GRID_YZ_MAX, launch, ptr
from ..timing import section
from . import CudaBackend

SOURCE = "fused_attention.cu"
HEAD_DIMS = (64, 128)
# The kernel per head dim, "{suf}" standing for f16 or bf16: fused2 is the software-pipelined
# version, fused the straight one (kept for the ladder's record); _wW: W warps, _mM: M tiles of 16
# query rows per warp (fused2 only; fused has 1), _cC: C keys per tile.
# Chosen on the H200 (benchmarks/ladder.md); TPATTN_FUSED_CFG=NAME overrides it (the bench's sweep).
CONFIG = {64: "fused2_{suf}_d64_w4_m1_c64", 128: "fused2_{suf}_d128_w4_m1_c64"}


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def unsupported_head_dim(d: int) -> str:
    return (f"--kernel fused supports head dims {' and '.join(map(str, HEAD_DIMS))} (got {d}); "
            "use --kernel tiled or naive for other head dims")


def kernel_for(d: int, suf: str) -> tuple[str, int, int, int]:
    """(kernel name, warps, m16 tiles per warp, keys per tile)."""
    key = (d, suf, os.environ.get("TPATTN_FUSED_CFG"))
    if key not in _kernels:
        name = (key[2] or CONFIG[d]).format(suf=suf, d=d)
        m = re.fullmatch(rf"fused_{suf}_d{d}_w(\d+)_c(\d+)|fused2_{suf}_d{d}_w(\d+)_m(\d+)_c(\d+)", name)
        if not m:
            raise ConfigError(f"TPATTN_FUSED_CFG={name!r} is not a fused kernel for {suf}, d={d}")
        w, mt, c = (int(m.group(1)), 1, int(m.group(2))) if m.group(1) else (int(m.group(3)), int(m.group(4)),
                                                                            int(m.group(5)))
        _kernels[key] = (name, w, mt, c)
    return _kernels[key]


_kernels: dict[tuple, tuple[str, int, int, int]] = {}


def shared_bytes(d: int, rows: int, keys: int) -> int:
    return (rows + 4 * keys) * d * 2  # Q tile + double-buffered K and V tiles


class FusedBackend(CudaBackend):
    name = "fused"
    dtypes = ("fp16", "bf16")
    materializes_scores = False  # S and P live in registers only

    def head_dim_error(self, d: int) -> str | None:
        return None if d in HEAD_DIMS else unsupported_head_dim(d)

    def forward(self, q, k, v, causal: bool, timer=None, out=None, scratch=None):
        b, h, n, d = q.shape
        suf = self.kernel_suffix(q)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o = out if out is not None else torch.empty_like(q)
        assert o.is_contiguous() and o.dtype == q.dtype and o.device == q.device and o.shape == q.shape
        name, warps, mt, keys = kernel_for(d, suf)
        rows = 16 * mt * warps
        bh = b * h
        scale_log2 = np.float32(math.log2(math.e) / math.sqrt(d))
        with section(timer, "fused"):
            grid = (min(_cdiv(n, rows), GRID_X_MAX), min(bh, GRID_YZ_MAX), 1)
            launch(SOURCE, name, q.device, grid, (32 * warps, 1, 1),
                   (ptr(q), ptr(k), ptr(v), ptr(o), np.int32(bh), np.int32(n), scale_log2, np.int32(causal)),
                   shared_mem=shared_bytes(d, rows, keys))
        return o
