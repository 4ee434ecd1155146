"""One fused CUDA kernel (kernels/fused_attention.cu): Q tiles against streamed K and V tiles,
online softmax, tensor cores; S and P never reach device memory. Launched via CuPy."""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from ..config import ConfigError, cupy_available, cupy_missing_message
from ..cuda import GRID_X_MAX, GRID_YZ_MAX, launch, ptr
from ..timing import section
from . import Backend

SOURCE = "fused_attention.cu"
SUFFIX = {torch.float16: "f16", torch.bfloat16: "bf16"}
HEAD_DIMS = (64, 128)
# (warps per block, keys per tile) by head dim; each warp owns 16 query rows. Chosen on the H200
# (benchmarks/ladder.md); TPATTN_FUSED_CFG=W,C overrides it, for the benchmark's sweep.
CONFIG = {64: (4, 64), 128: (4, 64)}
BUILT = {64: {(4, 64), (8, 64)}, 128: {(4, 64), (8, 64)}}  # must match the .cu file


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def unsupported_head_dim(d: int) -> str:
    return (f"--kernel fused supports head dims {' and '.join(map(str, HEAD_DIMS))} (got {d}); "
            "use --kernel tiled or naive for other head dims")


def config_for(d: int) -> tuple[int, int]:
    env = os.environ.get("TPATTN_FUSED_CFG")
    if env:
        w, c = (int(x) for x in env.split(","))
        if (w, c) not in BUILT[d]:
            raise ConfigError(f"TPATTN_FUSED_CFG={env}: built for d={d}: {sorted(BUILT[d])}")
        return w, c
    return CONFIG[d]


def shared_bytes(d: int, warps: int, keys: int) -> int:
    return (16 * warps + 4 * keys) * d * 2  # Q tile + double-buffered K and V tiles


class FusedBackend(Backend):
    name = "fused"
    devices = ("cuda",)
    dtypes = ("fp16", "bf16")
    passes = ("fused",)
    materializes_scores = False  # S and P live in registers only

    def check_supported(self, cfg) -> None:
        super().check_supported(cfg)
        if cfg.head_dim not in HEAD_DIMS:
            raise ConfigError(unsupported_head_dim(cfg.head_dim))
        if not cupy_available():
            raise ConfigError(cupy_missing_message())

    def forward(self, q, k, v, causal: bool, timer=None, out=None, scratch=None):
        b, h, n, d = q.shape
        if q.device.type != "cuda":
            raise ConfigError("--kernel fused needs CUDA tensors; use --kernel reference on CPU")
        if d not in HEAD_DIMS:
            raise ConfigError(unsupported_head_dim(d))
        if q.dtype not in SUFFIX:
            raise ConfigError(f"--kernel fused supports fp16 and bf16 (got {q.dtype})")
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o = out if out is not None else torch.empty_like(q)
        assert o.is_contiguous() and o.dtype == q.dtype and o.device == q.device and o.shape == q.shape
        warps, keys = config_for(d)
        rows = 16 * warps
        bh = b * h
        scale_log2 = np.float32(math.log2(math.e) / math.sqrt(d))
        with section(timer, "fused"):
            grid = (min(_cdiv(n, rows), GRID_X_MAX), min(bh, GRID_YZ_MAX), 1)
            launch(SOURCE, f"fused_{SUFFIX[q.dtype]}_d{d}_w{warps}_c{keys}", q.device, grid, (32 * warps, 1, 1),
                   (ptr(q), ptr(k), ptr(v), ptr(o), np.int32(bh), np.int32(n), scale_log2, np.int32(causal)),
                   shared_mem=shared_bytes(d, warps, keys))
        return o
