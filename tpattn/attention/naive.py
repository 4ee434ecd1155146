"""The seed's naive three-kernel CUDA attention (kernels/naive_attention.cu), launched via CuPy.
Grouped-query attention: each query head's qkKernel and pvKernel threads read its group's K/V head."""

from __future__ import annotations

import math

import numpy as np
import torch

from ..cuda import GRID_X_MAX, GRID_YZ_MAX, launch, ptr
from ..timing import section
from . import CudaBackend, kv_group

SOURCE = "naive_attention.cu"
SOFTMAX_THREADS = 256  # must match the .cu file


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


class NaiveBackend(CudaBackend):
    name = "naive"

    def forward(self, q, k, v, causal: bool, out=None, scratch=None):
        b, h, n, d = q.shape
        suf = self.kernel_suffix(q)
        group = kv_group(q, k, v)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if scratch is None:
            s = torch.empty((b, h, n, n), dtype=q.dtype, device=q.device)
            p = torch.empty_like(s)
        else:
            s, p = scratch
        o = out if out is not None else torch.empty_like(q)
        for t in (s, p, o):
            assert t.is_contiguous() and t.dtype == q.dtype and t.device == q.device
        bh = b * h
        dev = q.device
        scale = np.float32(1.0 / math.sqrt(d))
        with section("qk"):
            grid = (_cdiv(n, 16), min(_cdiv(n, 16), GRID_YZ_MAX), min(bh, GRID_YZ_MAX))
            launch(SOURCE, f"qkKernel_{suf}", dev, grid, (16, 16, 1),
                   (ptr(q), ptr(k), ptr(s), np.int32(bh), np.int32(n), np.int32(d), scale, np.int32(causal),
                    np.int32(group)))
        with section("softmax"):
            rows = bh * n
            launch(SOURCE, f"softmaxKernel_{suf}", dev, (min(rows, GRID_X_MAX), 1, 1), (SOFTMAX_THREADS, 1, 1),
                   (ptr(s), ptr(p), np.int64(rows), np.int32(n), np.int32(causal)))
        with section("pv"):
            bx = 32 * min(_cdiv(d, 32), 4)  # the head dim (up to 128) along x
            by = max(1, 256 // bx)
            grid = (_cdiv(d, bx), min(_cdiv(n, by), GRID_YZ_MAX), min(bh, GRID_YZ_MAX))
            launch(SOURCE, f"pvKernel_{suf}", dev, grid, (bx, by, 1),
                   (ptr(p), ptr(v), ptr(o), np.int32(bh), np.int32(n), np.int32(d), np.int32(causal),
                    np.int32(group)))
        return o
