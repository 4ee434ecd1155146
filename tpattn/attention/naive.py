"""The seed's naive three-kernel CUDA attention (kernels/naive_attention.cu), launched via CuPy.
Grouped-query attention: each query head's qkKernel and pvKernel threads read its group's K/V head.

Its backward (kernels/naive_attention_backward.cu) is as naive: P recomputed with the forward's
qkKernel and softmaxKernel, then one materialized kernel per line of the math in
tpattn/attention/autograd.py (dV, dP, D, dS, dQ, dK)."""

from __future__ import annotations

import math

import numpy as np
import torch

from ..cuda import GRID_X_MAX, GRID_YZ_MAX, launch, ptr
from ..timing import section
from . import CudaBackend, kv_group

SOURCE = "naive_attention.cu"
BACKWARD_SOURCE = "naive_attention_backward.cu"
SOFTMAX_THREADS = 256  # must match the .cu file
ROWDOT_THREADS = 256
# the backward's kernels, in launch order after the forward's qkKernel and softmaxKernel
BACKWARD_KERNELS = ("dvKernel", "dpKernel", "rowDotKernel", "dsKernel", "dqKernel", "dkKernel")


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

    # ---- the backward (the math: tpattn/attention/autograd.py; the kernels: naive_attention_backward.cu) ----

    def forward_for_backward(self, q, k, v, causal: bool):
        """(o, None): the backward recomputes P with the forward's own kernels, so nothing is saved."""
        return self.forward(q, k, v, causal), None

    def backward(self, q, k, v, o, saved, do, causal: bool, deterministic: bool = False):
        """(dq, dk, dv) for the upstream gradient do, materialized like the forward: S and P (the
        storage dtype, recomputed with qkKernel and softmaxKernel; S freed after the softmax), dP and
        dS (float32, dS written over dP), D (float32, [B, h, N]). Deterministic by construction (no
        atomics: a K/V head's dK and dV are one thread's sum over its group), so `deterministic` is
        accepted and needs nothing more."""
        suf = self.kernel_suffix(q)  # CUDA, dtype and head dim: refused in one line before any launch
        group = kv_group(q, k, v)
        for name, t in (("k", k), ("v", v), ("o", o), ("do", do)):
            if t.dtype != q.dtype or t.device != q.device or (name in ("o", "do") and t.shape != q.shape):
                raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} on {t.device} does not fit q "
                                 f"{tuple(q.shape)} {q.dtype} on {q.device}")
        b, h, n, d = q.shape
        q, k, v, o, do = (t.contiguous() for t in (q, k, v, o, do))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if q.numel() == 0:
            return dq.zero_(), dk.zero_(), dv.zero_()
        bh, bkv, dev = b * h, b * k.shape[1], q.device
        scale = np.float32(1.0 / math.sqrt(d))
        score_grid = (_cdiv(n, 16), min(_cdiv(n, 16), GRID_YZ_MAX), min(bh, GRID_YZ_MAX))  # one thread per score
        bx = 32 * min(_cdiv(d, 32), 4)  # one thread per output element: the head dim (up to 128) along x
        by = max(1, 256 // bx)

        def row_grid(heads: int):
            return (_cdiv(d, bx), min(_cdiv(n, by), GRID_YZ_MAX), min(heads, GRID_YZ_MAX))

        s = torch.empty((b, h, n, n), dtype=q.dtype, device=dev)
        with section("bwd_qk"):      # S = Q Kᵀ / √d (the forward's kernel)
            launch(SOURCE, f"qkKernel_{suf}", dev, score_grid, (16, 16, 1),
                   (ptr(q), ptr(k), ptr(s), np.int32(bh), np.int32(n), np.int32(d), scale, np.int32(causal),
                    np.int32(group)))
        p = torch.empty_like(s)
        with section("bwd_softmax"):  # P = softmax(S) (the forward's kernel)
            rows = bh * n
            launch(SOURCE, f"softmaxKernel_{suf}", dev, (min(rows, GRID_X_MAX), 1, 1), (SOFTMAX_THREADS, 1, 1),
                   (ptr(s), ptr(p), np.int64(rows), np.int32(n), np.int32(causal)))
        del s  # stream-ordered: the allocator hands this memory out again only after the softmax
        with section("bwd_dv"):      # dV = Pᵀ dO, summed over the group's query heads
            launch(BACKWARD_SOURCE, f"dvKernel_{suf}", dev, row_grid(bkv), (bx, by, 1),
                   (ptr(p), ptr(do), ptr(dv), np.int32(bkv), np.int32(n), np.int32(d), np.int32(causal),
                    np.int32(group)))
        dps = torch.empty((b, h, n, n), dtype=torch.float32, device=dev)  # dP, then dS over it
        with section("bwd_dp"):      # dP = dO Vᵀ
            launch(BACKWARD_SOURCE, f"dpKernel_{suf}", dev, score_grid, (16, 16, 1),
                   (ptr(do), ptr(v), ptr(dps), np.int32(bh), np.int32(n), np.int32(d), np.int32(causal),
                    np.int32(group)))
        dsum = torch.empty((b, h, n), dtype=torch.float32, device=dev)
        with section("bwd_rowdot"):  # D = rowsum(dO ∘ O)
            rows = bh * n
            launch(BACKWARD_SOURCE, f"rowDotKernel_{suf}", dev, (min(_cdiv(rows, ROWDOT_THREADS), GRID_X_MAX), 1, 1),
                   (ROWDOT_THREADS, 1, 1), (ptr(do), ptr(o), ptr(dsum), np.int64(rows), np.int32(d)))
        with section("bwd_ds"):      # dS = P ∘ (dP − D), in place over dP
            launch(BACKWARD_SOURCE, f"dsKernel_{suf}", dev, score_grid, (16, 16, 1),
                   (ptr(p), ptr(dps), ptr(dsum), ptr(dps), np.int32(bh), np.int32(n), np.int32(causal)))
        del p
        with section("bwd_dq"):      # dQ = dS K / √d
            launch(BACKWARD_SOURCE, f"dqKernel_{suf}", dev, row_grid(bh), (bx, by, 1),
                   (ptr(dps), ptr(k), ptr(dq), np.int32(bh), np.int32(n), np.int32(d), scale, np.int32(causal),
                    np.int32(group)))
        with section("bwd_dk"):      # dK = dSᵀ Q / √d, summed over the group's query heads
            launch(BACKWARD_SOURCE, f"dkKernel_{suf}", dev, row_grid(bkv), (bx, by, 1),
                   (ptr(dps), ptr(q), ptr(dk), np.int32(bkv), np.int32(n), np.int32(d), scale, np.int32(causal),
                    np.int32(group)))
        return dq, dk, dv
