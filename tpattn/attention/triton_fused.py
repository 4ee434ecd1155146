"""--kernel triton: the fused rung written in OpenAI Triton instead of CUDA C (the kernels:
tpattn/attention/triton_kernels.py). FlashAttention-style: Q tiles against streamed K/V tiles,
online softmax in base 2, S and P never in device memory; the backward recomputes P from the
saved logsumexp (FlashAttention-2's math: one kernel over query tiles for D = rowsum(dO * O) and dQ,
then one over key tiles for dK and dV; no atomics). Grouped-query attention is read in place; dK and dV
of a K/V head sum its group's query heads inside the dK/dV kernel. fp16 and bf16, head dims 64 and
128, any N.

triton is imported on first use only: CPU builds of torch ship without it, and this module must
import there (check_supported then refuses in one line). With TRITON_INTERPRET=1 the kernels run
in Triton's interpreter on CPU tensors (slow; for checking the kernels without a GPU), each with
the first config of its list unless forced_configs() says otherwise.

Tile sizes come from triton.autotune, once per process for each (N rounded up to a power of two,
head dim, causal, dtype); the compiled kernels are cached on disk by Triton (~/.triton/cache).
"""

from __future__ import annotations

import importlib
import math
import os
from contextlib import contextmanager

import torch

from ..errors import ConfigError, FlagError
from ..timing import section
from . import Backend, kv_group

MAX_HEAD_DIM = 256  # head dims: every multiple of 8 up to this (tiles padded to a power of two)
GRID_YZ_MAX = 65535
_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def interpreting() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET=1): the kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_missing_message() -> str:
    return ("--kernel triton needs the triton package (it ships with CUDA builds of torch; or pip install "
            "triton); use --kernel fused")


def triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except Exception:  # noqa: BLE001 - missing, or present but unusable here: either way not available
        return False
    return True


def unsupported_head_dim(d: int) -> str | None:
    """None for a head dim the kernels take (a multiple of 8, 8 to 256), else the one-line refusal,
    naming the nearest head dims they take (no kernel here takes more than 256; only naive takes a
    head dim that is not a multiple of 8)."""
    if d % 8 == 0 and 8 <= d <= MAX_HEAD_DIM:
        return None
    if d > MAX_HEAD_DIM:
        return (f"--kernel triton supports head dims up to {MAX_HEAD_DIM} (got {d}), as every kernel here does; "
                f"use --head-dim {MAX_HEAD_DIM} or less")
    near = sorted({max(8, d // 8 * 8), max(8, -(-d // 8) * 8)})
    return (f"--kernel triton supports head dims that are multiples of 8 up to {MAX_HEAD_DIM} (got {d}); use "
            f"--head-dim {' or '.join(map(str, near))}, or --kernel naive")


def paged_prefill_fits(layer, q: torch.Tensor, seqs: int, fp8_pages: bool = False) -> bool:
    """Whether a prefill over rows q [R, h, d] of `seqs` sequences runs the Triton paged prefill
    (triton_paged.py): the layer's backend is triton, on a GPU (or Triton's interpreter), fp16/bf16,
    a head dim the kernels take, at most 65535 (sequence, head) pairs (the grid's y); over an FP8
    pool's pages (fp8_pages), a GPU of compute capability 8.9 or later. Beside the backend, below
    tpattn/paged.py and tpattn/decode.py, which both ask."""
    from .fp8 import CC
    return (layer.backend.name == "triton" and q.dtype in _DTYPES and (q.is_cuda or interpreting())
            and unsupported_head_dim(q.shape[-1]) is None and seqs * q.shape[1] <= GRID_YZ_MAX
            and (not fp8_pages or not q.is_cuda or torch.cuda.get_device_capability(q.device) >= CC)
            and triton_available())


_kernels = None


def kernels():
    """The kernel module (imports triton): loaded on the first call that needs it."""
    global _kernels
    if _kernels is None:
        from . import triton_kernels
        _kernels = triton_kernels
    return _kernels


_forced: dict[str, object] = {}


@contextmanager
def forced_configs(fwd=None, kv=None, q=None):
    """Bypass the autotuner inside the block: each kernel runs with the given config, a
    (BLOCK_M, BLOCK_N, num_warps, num_stages) tuple (BLOCK_M: query rows, BLOCK_N: keys, per tile or
    step), so that tests can check every tile size the autotuner may choose."""
    K = kernels()
    old = dict(_forced)
    for name, cfg in (("fwd", fwd), ("kv", kv), ("q", q)):
        if cfg is not None:
            bm, bn, warps, stages = cfg
            _forced[name] = K.triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(old)


_tuned: dict[tuple, object] = {}  # the autotuner's pick per (kernel, autotune key), once it has made it


def _launch(kernel, which: str, grid, args, key: tuple) -> None:
    """kernel[grid](*args) through its autotuner the first time for `key` (the autotuner's own key: the
    bucketed N, head dim, causal and the tensors' dtype), then straight to the compiled kernel with the
    config it chose (the autotuner's per-call work is ~70 us of host time a launch); a forced config
    (always one under the interpreter, which cannot time configs) skips the autotuner altogether."""
    cfg = _forced.get(which)
    if cfg is None and interpreting():
        cfg = kernel.configs[0]
    if cfg is None:
        cfg = _tuned.get((which, *key))
        if cfg is None:
            kernel[grid](*args)
            _tuned[(which, *key)] = kernel.best_config
            return
    kernel.fn[grid](*args, **cfg.all_kwargs())


def _batches(b: int, heads: int):
    """[b0, b1) batch ranges whose b * heads programs fit the grid's y dimension (65 535)."""
    if heads > GRID_YZ_MAX:
        raise ValueError(f"--kernel triton handles at most {GRID_YZ_MAX} heads per call (got {heads})")
    step = max(1, GRID_YZ_MAX // heads)
    return [(b0, min(b, b0 + step)) for b0 in range(0, b, step)]


def _rows_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonBackend(Backend):
    name = "triton"
    dtypes = ("fp16", "bf16")
    devices = ("cuda",)
    materializes_scores = False  # S and P live in registers only
    saves_lse = True             # forward_for_backward saves the logsumexp
    strided = True               # q, k, v, o (and the backward's do) may be strided [B, h, N, d] views, rows
                                 # contiguous: their strides go to the kernels

    def head_dim_error(self, d: int) -> str | None:
        return unsupported_head_dim(d)

    def check_supported(self, cfg) -> None:
        if not (interpreting() and cfg.device == "cpu"):  # the interpreter runs on CPU tensors
            super().check_supported(cfg)
        elif cfg.dtype not in self.dtypes:
            raise FlagError(f"--kernel {self.name} does not support --dtype {cfg.dtype}; "
                              f"use one of {', '.join(self.dtypes)}")
        why = unsupported_head_dim(cfg.head_dim)
        if why:
            raise FlagError(why)
        if not triton_available():
            raise FlagError(triton_missing_message())

    def _check(self, *ts) -> int:
        """Check the tensors (one dtype and device, CUDA unless interpreting, fp16/bf16, a head dim
        the kernels take); their head dim."""
        q = ts[0]
        if any(t.dtype != q.dtype or t.device != q.device for t in ts):
            raise ValueError("q, k, v (and o, do) must share a dtype and a device (got "
                             f"{', '.join(str(t.dtype) for t in ts)} on {', '.join(str(t.device) for t in ts)})")
        if q.device.type != "cuda" and not interpreting():
            raise ConfigError(f"--kernel {self.name} needs CUDA tensors; use --kernel reference on CPU")
        if q.dtype not in _DTYPES:
            raise ConfigError(f"--kernel {self.name} supports {', '.join(self.dtypes)} (got {q.dtype})")
        d = q.shape[-1]
        why = unsupported_head_dim(d)
        if why:
            raise ConfigError(why)
        if not triton_available():
            raise ConfigError(triton_missing_message())
        return d

    def forward(self, q, k, v, causal: bool, out=None, lse=None):
        """o = softmax(q kᵀ/√d) v. out: where to write o (may be a strided view, rows contiguous).
        lse: a contiguous fp32 [B, h, N] tensor that receives each row's logsumexp (natural log)."""
        d = self._check(q, k, v)
        group = kv_group(q, k, v)
        b, h, n, _ = q.shape
        q, k, v = (_rows_contiguous(t) for t in (q, k, v))
        o = out if out is not None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
        assert o.dtype == q.dtype and o.device == q.device and o.shape == q.shape and o.stride(-1) == 1
        if lse is not None:
            assert lse.dtype == torch.float32 and lse.is_contiguous() and lse.shape == (b, h, n)
        if b * h * n == 0:
            return o
        K = kernels()
        qk_scale = math.log2(math.e) / math.sqrt(d)
        with section("fused"):
            for b0, b1 in _batches(b, h):
                qs, ks, vs, os_ = (t[b0:b1] for t in (q, k, v, o))
                # without lse: an empty fp32 tensor (never written), so that the autotuner's key (which
                # holds every tensor's dtype) and hence the tile sizes and o's bits match the call with lse
                ls = lse[b0:b1] if lse is not None else torch.empty(0, dtype=torch.float32, device=q.device)
                grid = lambda meta, bh=(b1 - b0) * h: (K.triton.cdiv(n, meta["BLOCK_M"]), bh)  # noqa: E731
                _launch(K.attn_fwd, "fwd", grid,
                        (qs, ks, vs, os_, ls, qk_scale, n, h, group, *qs.stride()[:3], *ks.stride()[:3],
                         *vs.stride()[:3], *os_.stride()[:3], K._n_bucket(n), d, bool(causal), lse is not None,
                         K.block_d(d), K.block_d(d) != d),
                        (K._n_bucket(n), d, bool(causal), q.dtype))
        return o

    # ---- the backward (the math: tpattn/attention/autograd.py) ----

    def forward_for_backward(self, q, k, v, causal: bool):
        """(o, L): the forward, also writing each row's logsumexp L (natural log, fp32 [B, h, N])."""
        b, h, n, _ = q.shape
        lse = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
        return self.forward(q, k, v, causal, lse=lse), lse

    def backward(self, q, k, v, o, lse, do, causal: bool, deterministic: bool = False):
        """(dq, dk, dv): one program per query tile computes D = rowsum(dO * O) of its rows and
        accumulates dQ; then one program per key tile of a K/V head recomputes P from L and
        accumulates dK and dV in registers, over every query head of its group in turn. No atomics anywhere, so the result is the same bits
        from run to run: `deterministic` is accepted for the interface and needs nothing more."""
        d = self._check(q, k, v, o, do)
        group = kv_group(q, k, v)
        b, h, n, _ = q.shape
        g = k.shape[1]
        q, k, v, o, do = (_rows_contiguous(t) for t in (q, k, v, o, do))
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        if b * h * n == 0:
            return dq, dk, dv
        assert lse.dtype == torch.float32 and lse.is_contiguous() and lse.shape == (b, h, n)
        K = kernels()
        delta = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
        sm_scale = 1.0 / math.sqrt(d)
        qk_scale = math.log2(math.e) * sm_scale
        bucket = K._n_bucket(n)
        key = (bucket, d, bool(causal), q.dtype)
        with section("bwd_dq"):  # first: it also writes D = rowsum(dO * O), which the dK/dV kernel reads
            for b0, b1 in _batches(b, h):
                qs, ks, vs, os_, dos, dqs = (t[b0:b1] for t in (q, k, v, o, do, dq))
                grid = lambda meta, bh=(b1 - b0) * h: (K.triton.cdiv(n, meta["BLOCK_M"]), bh)  # noqa: E731
                _launch(K.attn_bwd_q, "q", grid,
                        (qs, ks, vs, os_, dos, lse[b0:b1], delta[b0:b1], dqs, sm_scale, qk_scale, n, h, group,
                         *qs.stride()[:3], *ks.stride()[:3], *vs.stride()[:3], *os_.stride()[:3], *dos.stride()[:3],
                         *dqs.stride()[:3], bucket, d, bool(causal), K.block_d(d), K.block_d(d) != d), key)
        with section("bwd_kv"):
            for b0, b1 in _batches(b, max(h, g)):
                qs, ks, vs, dos, dks, dvs = (t[b0:b1] for t in (q, k, v, do, dk, dv))
                grid = lambda meta, bg=(b1 - b0) * g: (K.triton.cdiv(n, meta["BLOCK_N"]), bg)  # noqa: E731
                _launch(K.attn_bwd_kv, "kv", grid,
                        (qs, ks, vs, dos, lse[b0:b1], delta[b0:b1], dks, dvs, sm_scale, qk_scale, n, h, g, group,
                         *qs.stride()[:3], *ks.stride()[:3], *vs.stride()[:3], *dos.stride()[:3],
                         *dks.stride()[:3], *dvs.stride()[:3], bucket, d, bool(causal), K.block_d(d),
                         K.block_d(d) != d), key)
        return dq, dk, dv
