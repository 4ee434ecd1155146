"""The FP8 (e4m3) attention forward on the warp-specialized CUDA kernel (kernels/fused_ws_fp8.cu:
fusedw's TMA producer, ping-pong wgmma consumers and persistent grid, on e4m3 operands), head dim 128,
compute capability 9.0.

The arithmetic is tpattn/attention/fp8.py's (FlashAttention-3's rounding points), as the Triton kernel
(triton_fp8.py) runs it: S = Q8 K8^T in fp32 times the scales, the online softmax in fp32, P rounded
to e4m3 for O += P8 V8 in fp32, O = acc s_v / l rounded once to fp16 or bf16. The operands are
triton_fp8.prepare's (scales per tensor, head or 128-row block; the Hadamard rotation of Q and K when
asked), with V^T laid out for the kernel (vt_for_kernel): its keys padded to a multiple of 16 and
each 16 stored in KEY_ORDER, the order in which a thread's fp32 scores sit in its registers. So P
goes from the QK product's accumulators to the PV product's e4m3 A fragments with no exchange between
lanes: the PV product sums over the keys in that order, which is the same sum.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..cuda import Prepared, TensorMap, ptr
from ..timing import section
from . import fp8

SOURCE = "fused_ws_fp8.cu"
HEAD_DIMS = (128,)
BLOCK = fp8.BLOCK_ROWS  # the kernel's query and key tiles: one scale block each
# position p of each 16 keys of V^T holds key KEY_ORDER[p]: an m64k32 e4m3 fragment's byte e of lane t's
# register (positions 4 t + e) is the score of key 2 t + (e & 1) + 8 (e >> 1) of the QK accumulators
KEY_ORDER = tuple(2 * (p >> 2) + (p & 1) + 8 * ((p >> 1) & 1) for p in range(16))
THREADS = 384  # a producer warpgroup and two consumers of 64 query rows
# the .cu file's stages at F8: two Q stages of a 16-bit 128 x 128 tile (O is staged there), four K and
# four V stages of 128 x 128 bytes, 1024 bytes of alignment, 256 of mbarriers
SHARED = 2 * BLOCK * 128 * 2 + 2 * 4 * BLOCK * 128 + 1024 + 256
_prepared: dict[tuple, Prepared] = {}


def supported(q: torch.Tensor) -> str | None:
    """None where the CUDA FP8 kernel runs q's call, else why not (one line)."""
    if not q.is_cuda:
        return "the CUDA FP8 kernel runs on a GPU (these tensors are on the CPU)"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return "the CUDA FP8 kernel is written for compute capability 9.0 (H100, H200); use the Triton one"
    if q.shape[-1] not in HEAD_DIMS:
        return f"the CUDA FP8 kernel takes head dim 128 (got {q.shape[-1]}); use the Triton one"
    return None


def vt_for_kernel(vt8: torch.Tensor) -> torch.Tensor:
    """V^T [B, g, d, N] (e4m3) as the kernel reads it: N padded with zeros to a multiple of 16, each 16
    keys in KEY_ORDER, contiguous."""
    B, g, d, N = vt8.shape
    n16 = -(-N // 16) * 16
    raw = vt8.view(torch.uint8)
    if n16 != N:
        raw = torch.nn.functional.pad(raw, (0, n16 - N))
    # key 8 e1 + 2 t + e0 goes to position 4 t + 2 e1 + e0: the pairs (e0) stay together, so as 16-bit
    # values each 16 keys are a 2 x 4 matrix (e1, t) stored transposed, (t, e1): one strided copy
    pairs = raw.contiguous().view(torch.int16).view(B, g, d, n16 // 16, 2, 4)
    return pairs.transpose(-1, -2).contiguous().view(torch.uint8).view(B, g, d, n16).view(torch.float8_e4m3fn)


def prepare(q, k, v, scaling: str = "head", rotate: bool = False):
    """(q8, k8, vtk8, sq, sk, sv): triton_fp8.prepare's operands, V^T as vt_for_kernel lays it out
    (written in that order by the quantizing kernel itself)."""
    from . import triton_fp8
    if rotate and q.dtype not in (torch.float16, torch.bfloat16):  # fp32 rotated: torch's quantization
        q8, k8, vt8, sq, sk, sv = triton_fp8.prepare_torch(q, k, v, scaling, rotate)
        return q8, k8, vt_for_kernel(vt8), sq, sk, sv
    return triton_fp8.prepare(q, k, v, scaling, rotate, key_order=True)


def launch(q8, k8, vtk8, sq, sk, sv, causal: bool, o: torch.Tensor, block_scales: bool) -> torch.Tensor:
    """The kernel over prepared operands (prepare's), writing o [B, h, N, 128] (fp16 or bf16, rows
    contiguous). block_scales: the scales are per 128-row block (sq [B, h, ceil(N / 128)]), else one a
    (batch, head) (their last dimension 1)."""
    from .fused import _cdiv, _device_info, grid_mode, ws_schedule
    B, h, N, d = q8.shape
    g = k8.shape[1]
    if B * h * N == 0:
        return o
    assert d == 128 and h % g == 0 and vtk8.shape[-1] % 16 == 0 and vtk8.shape[-1] >= N
    assert o.dtype in (torch.float16, torch.bfloat16) and o.shape == q8.shape and o.stride(-1) == 1
    nblk = sq.shape[2]
    assert nblk == (_cdiv(N, BLOCK) if block_scales else 1) and sk.shape[2] == sv.shape[2] == nblk
    sq, sk, sv = (t.float().contiguous() for t in (sq, sk, sv))
    mode = grid_mode()
    key = (causal, block_scales, mode, q8.device.index, tuple(q8.shape), tuple(k8.shape), o.dtype,
           *((t.data_ptr(), t.stride()) for t in (q8, k8, vtk8, o, sq, sk, sv)))
    prep = _prepared.get(key)
    if prep is None:
        bh = B * h
        # fusedw's schedule: persistent, causal tiles handed out by a counter
        grid, counter, hg = ws_schedule(q8.device, _device_info(q8.device)[0], _cdiv(N, BLOCK), bh, causal, causal, mode)
        suf = "bf16" if o.dtype == torch.bfloat16 else "f16"
        args = (TensorMap(q8, box=(128, BLOCK)), TensorMap(k8, box=(128, BLOCK)), TensorMap(vtk8, box=(128, 128)),
                ptr(o), np.int32(bh), np.int32(N), np.float32(math.log2(math.e) / math.sqrt(d)), np.int32(causal),
                np.int32(h), np.int32(h // g), np.int64(o.stride(0)), np.int64(o.stride(1)), np.int32(o.stride(2)),
                np.int32(hg), np.uint64(counter), ptr(sq), ptr(sk), ptr(sv), np.int32(nblk), np.int32(block_scales))
        prep = Prepared(SOURCE, f"fusedw8_{suf}_d128", q8.device, grid, (THREADS, 1, 1), args, shared_mem=SHARED)
        if len(_prepared) >= 64:
            _prepared.clear()
        _prepared[key] = prep
    prep()
    return o


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scaling: str = "head",
              rotate: bool = False, out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """o [B, h, N, 128] of q [B, h, N, 128] over k, v [B, g, N, 128] through the CUDA FP8 kernel
    (prepare, then launch), in out_dtype (default q's, fp16 for fp32 inputs)."""
    why = supported(q)
    if why:
        raise ValueError(why)
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not divide into {k.shape[1]} K/V heads")
    out_dtype = out_dtype or (q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.float16)
    ops = prepare(q, k, v, scaling, rotate)
    o = out if out is not None else torch.empty(q.shape, dtype=out_dtype, device=q.device)
    return launch(*ops, causal, o, scaling == "block")


class Fp8FusedBackend(fp8.Fp8Backend):
    """The layer's FP8 attention (fp8.Fp8Backend's scaling and rotation) through this module's kernel,
    all heads in one launch: python -m tpattn --dtype fp8 --kernel fused (head dim 128, compute
    capability 9.0)."""
    name = "fp8_fused"

    def head_dim_error(self, d: int) -> str | None:
        if d in HEAD_DIMS:
            return None
        return (f"--dtype fp8 --kernel fused takes --head-dim 128 (got {d}); use --kernel triton (64, 128, 256) or "
                "reference")

    def forward(self, q, k, v, causal: bool, out=None):
        o = out if out is not None else torch.empty_like(q)
        with section("fp8"):
            return attention(q, k, v, causal, fp8.SCALING, fp8.ROTATE, out=o)
