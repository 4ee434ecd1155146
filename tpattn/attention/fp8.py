"""FP8 (e4m3) attention: the numerics an FP8 kernel is to follow, computed in torch, and its accuracy.

No FP8 kernel exists yet; this module is what one is checked against, and what says, before it is
written, which scaling it needs. The forward (FlashAttention-3's FP8 arrangement):

    Q, K, V   each quantized to e4m3: x8 = rn_satfinite(x / s), s = amax(|x|) / 448 over the scale's
              group: the whole tensor ("tensor"), a (batch, head) ("head"), or a block of rows of a
              head ("block": the kernel's tiles, 128 query rows for Q, 128 keys for K and V)
    S         Q8 K8^T accumulated in fp32, times s_q s_k / sqrt(d) (per pair of blocks)
    P         exp(S - rowmax) in fp32; the row sum l from this fp32 P
    P8        rn_satfinite(P) in e4m3 (P is in [0, 1]: no scale; below 2^-10 it rounds to zero)
    O         sum over key blocks of s_v (P8 V8) accumulated in fp32, divided by l, rounded once to the
              output dtype (fp16 or bf16)

rn_satfinite: round to nearest even, saturating at +-448 (PTX cvt.rn.satfinite.e4m3x2.f32). Fully masked
rows (causal rows past none) give zeros. rotate=True multiplies Q and K by the same orthonormal Hadamard
matrix (H / sqrt(d), d a power of two) before quantizing: (Q H)(K H)^T = Q K^T, while an outlier in one
column is spread over all d columns, so one large value no longer sets the scale of its whole group.

The FP8 KV cache (tpattn.paged.PagedKV(..., kv_dtype="fp8")): each token's K and V of each K/V head
in e4m3 with a scale of its own, s = amax / 448 over its d values (quantize_rows), dequantized as they
are read (a decode step's query and softmax in fp32; a prefill's as the layer's 16-bit attention
rounds them). A row's scale depends on that row alone, so a step
writes its rows without touching earlier ones, and a page's bits are the same whatever the steps were.
Scales per page and K/V head were measured and not kept (scripts/fp8_accuracy.py's decode table):
rows arrive one at a time, so a page's scale would rise as they come and its earlier rows be rounded
again (1.5x the per-token error on N(0, 1) K/V), or, kept to powers of two so that rising is exact,
lose the exact largest value that an amax scale gives (2.4x the per-token error with outliers).

rmse(): the root mean square error of an output against float64, what the accuracy tables report
(scripts/fp8_accuracy.py).

Fp8Backend: the layer's attention in this arithmetic (python -m tpattn --dtype fp8: e4m3 attention,
fp16 weights and projections), forward only, scales per 128-row block with the rotation of Q and K
(SCALING, ROTATE: the accuracy table's most accurate row with outliers).
"""

from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from ..timing import section
from . import Backend, head_chunks, kv_group
from .reference import CHUNK_BYTES, causal_mask
from .ring import _scores

E4M3_MAX = 448.0
SCALINGS = ("tensor", "head", "block")
BLOCK_ROWS = 128  # the rows of a scale block: the FP8 kernel's query and key tiles
CC = (8, 9)  # FP8 in hardware (e4m3 conversions, FP8 tensor cores): compute capability 8.9 or later
KERNEL_HEAD_DIMS = (64, 128, 256)  # the Triton FP8 forward's (triton_fp8.py: a power-of-two tile, >= 16)
# the layer's FP8 attention (Fp8Backend): the accuracy table's most accurate row with outliers (8.9e-3 where
# per-tensor scales give 1.5e-2), within 1 % of the best on N(0, 1)
SCALING, ROTATE = "block", True


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest e4m3 value (ties to even), saturating at +-448, as torch.float8_e4m3fn."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest e4m3 value (ties to even), saturating at +-448, returned in fp32."""
    return to_e4m3(x).float()


def _group_amax(x: torch.Tensor, scaling: str, block: int) -> torch.Tensor:
    """amax(|x|) of each scale group of x [B, h, N, d], broadcastable against x."""
    a = x.abs().float()
    if scaling == "tensor":
        return a.amax().reshape(1, 1, 1, 1)
    if scaling == "head":
        return a.amax(dim=(2, 3), keepdim=True)
    if scaling == "block":
        B, h, N, d = x.shape
        nb = -(-N // block)
        padded = torch.nn.functional.pad(a, (0, 0, 0, nb * block - N))
        per = padded.view(B, h, nb, block, d).amax(dim=(3, 4))  # [B, h, blocks]
        return per.repeat_interleave(block, dim=2)[:, :, :N, None]
    raise ValueError(f"scaling {scaling!r}: use one of {', '.join(SCALINGS)}")


def _scaled(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, s) with s = amax / 448 of each group (1 for a group of zeros) and x8 = e4m3(x / s). s is
    amax times the fp32 reciprocal of 448, as torch divides by a number on a GPU and the kernels
    compute it: the same bits on CPU, GPU and in the kernels."""
    s = amax.float() * (1.0 / E4M3_MAX)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return e4m3(x.float() / s), s


def quantize(x: torch.Tensor, scaling: str = "head", block: int = BLOCK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, s): x [B, h, N, d] in e4m3 values (held in fp32) and the scale of each element's group
    (broadcastable against x), x ~ x8 * s. A group of zeros gets the scale 1."""
    return _scaled(x, _group_amax(x, scaling, block))


def hadamard(d: int, dtype=torch.float64) -> torch.Tensor:
    """The orthonormal Hadamard matrix of order d (Sylvester's construction, divided by sqrt(d))."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head dim (got {d})")
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  scaling: str = "head", rotate: bool = False, out_dtype: torch.dtype = torch.float16,
                  block: int = BLOCK_ROWS) -> torch.Tensor:
    """o [B, h, N, d] of q [B, h, N, d] over k, v [B, g, N, d] (g divides h: grouped-query attention)
    with the FP8 forward's rounding points (the module's docstring), in out_dtype."""
    B, h, N, d = q.shape
    g = k.shape[1]
    if h % g:
        raise ValueError(f"{h} query heads do not divide into {g} K/V heads")
    if rotate:
        rot = hadamard(d).to(device=q.device, dtype=torch.float32)
        q, k = q.float() @ rot, k.float() @ rot
    q8, sq = quantize(q, scaling, block)
    k8, sk = quantize(k, scaling, block)
    v8, sv = quantize(v, scaling, block)
    r = h // g
    # S: the e4m3 values multiplied exactly and summed in fp32 (products of two e4m3 values are exact
    # in fp32), then the two groups' scales and 1/sqrt(d)
    s = torch.matmul(q8.view(B, g, r, N, d), k8.unsqueeze(2).transpose(-1, -2))
    s = s * sq.expand(B, h, N, 1).reshape(B, g, r, N, 1) * sk.expand(B, g, N, 1).transpose(-1, -2).unsqueeze(2)
    s = s / math.sqrt(d)
    if causal:
        s = s.masked_fill(causal_mask(N, q.device), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    p = torch.where(torch.isfinite(m), p, torch.zeros_like(p))
    l = p.sum(-1, keepdim=True)
    p8 = e4m3(p)
    # O: P8 V8 with each key's V scale (its group's) folded into its values, in fp32: the kernel's
    # per-key-block product scaled by its block's s_v, the same up to fp32 rounding
    vs = (v8 * sv.expand(B, g, N, 1)).unsqueeze(2)
    o = torch.matmul(p8, vs) / torch.where(l > 0, l, torch.ones_like(l))
    return o.view(B, h, N, d).to(out_dtype)


def attention_16bit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The same forward with 16-bit storage, as the fused fp16/bf16 kernels round: q, k, v in dtype, S and
    the softmax in fp32, P rounded to dtype for the PV product, O accumulated in fp32 and rounded once."""
    s = _scores(q.to(dtype), k.to(dtype), causal, torch.float32)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    o = torch.matmul(p.to(dtype).float(), v.to(dtype).float().unsqueeze(2)) / p.sum(-1, keepdim=True)
    return o.view(q.shape).to(dtype)


def attention_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """The exact forward in float64 (grouped K/V heads broadcast); q may have fewer rows than k when not
    causal (a decode step's row against the whole cache)."""
    return torch.matmul(torch.softmax(_scores(q, k, causal, torch.float64), -1), v.double().unsqueeze(2)).view(
        *q.shape[:3], v.shape[-1])


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, s): each row of x [..., d] (a token's K or V of one head) in e4m3 values (held in fp32)
    with its own scale s [..., 1] = amax(|row|) / 448, x ~ x8 * s. A row of zeros keeps the scale 0
    (its bytes are zeros, divided by 1): a kernel that normalizes a tile's V scales by their largest
    must not see a 1 there beside rows of scale 1e-6."""
    amax = x.abs().float().amax(-1, keepdim=True)
    x8, _ = _scaled(x, amax)
    return x8, amax * (1.0 / E4M3_MAX)


def dequantize(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 rows x8 [..., d] (e4m3, any storage) times their scales [...], in fp32."""
    return x8.float() * scale.unsqueeze(-1)


def rmse(o: torch.Tensor, ref: torch.Tensor) -> float:
    """sqrt(mean((o - ref)^2)) in float64."""
    return (o.double() - ref.double()).pow(2).mean().sqrt().item()


def inputs(B: int, h: int, g: int, N: int, d: int, outliers: float = 0.0, outlier_std: float = 10.0,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, h, N, d], k, v [B, g, N, d] in float64: N(0, 1) entries, and a fraction `outliers` of them
    with N(0, outlier_std^2) added (FlashAttention-3's accuracy test uses 0.1 % of entries, std 10)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for heads in (h, g, g):
        x = torch.randn(B, heads, N, d, dtype=torch.float64, generator=gen)
        if outliers > 0:
            mask = torch.rand(x.shape, generator=gen) < outliers
            x = x + mask * torch.randn(x.shape, dtype=torch.float64, generator=gen) * outlier_std
        out.append(x)
    return tuple(out)


def head_dim_error(d: int) -> str | None:
    """None for a head dim the FP8 path takes, else the one-line refusal: its Hadamard rotation needs
    a power of two, at least 8."""
    if d >= 8 and not d & (d - 1):
        return None
    p = 1 << max(3, d.bit_length() - 1)
    return (f"--dtype fp8 rotates Q and K by a Hadamard matrix: --head-dim must be a power of two, at least 8 (got "
            f"{d}); use {p}" + (f" or {2 * p}" if p < d else ""))


def kernel_head_dim_error(d: int) -> str | None:
    """The same for the Triton FP8 kernel (triton_fp8.Fp8TritonBackend): KERNEL_HEAD_DIMS only."""
    if d in KERNEL_HEAD_DIMS:
        return None
    return (f"--dtype fp8 --kernel triton takes --head-dim 64, 128 or 256 (got {d}); use one of those, or FP8 in "
            "torch math (Fp8Backend(); with the CLI, --kernel reference)")


class Fp8Backend(Backend):
    """The layer's attention in e4m3 (attention_fp8, SCALING and ROTATE): q, k, v arrive in the layer's
    fp16 or bf16 and o leaves in it; a chunk of whole head groups at a time (each chunk's fp32 scores
    below CHUNK_BYTES; the scales are per head and block, so chunking changes nothing). Torch math on
    CPU or GPU (triton_fp8.Fp8TritonBackend: the same through the Triton kernel). Forward only, as
    FlashAttention-3's FP8."""
    name = "fp8"
    dtypes = ("fp16", "bf16")

    def head_dim_error(self, d: int) -> str | None:
        return head_dim_error(d)

    def forward(self, q, k, v, causal: bool, out=None):
        b, h, n, d = q.shape
        group = kv_group(q, k, v)
        o = out if out is not None else torch.empty_like(q)
        per_head = 4 * b * n * n * 4  # S, P, P8 and a temporary, fp32
        chunk = max(1, min(h, CHUNK_BYTES.get(q.device.type, CHUNK_BYTES["cpu"]) // max(per_head, 1)))
        with section("fp8"):
            for h0, h1 in head_chunks(h, group, chunk):
                kv = slice(h0 // group, (h1 - 1) // group + 1)
                o[:, h0:h1] = attention_fp8(q[:, h0:h1], k[:, kv], v[:, kv], causal, SCALING, ROTATE, out_dtype=q.dtype)
        return o

    def attention(self, q, k, v, causal: bool, deterministic: bool = False):
        """The forward alone where no gradient is asked for (torch.no_grad(), or no input that requires
        one); else the one-line refusal, which says how to run it for inference."""
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise ConfigError(FORWARD_ONLY_API)
        return self.forward(q, k, v, causal)

    def forward_for_backward(self, q, k, v, causal: bool):
        raise ConfigError(FORWARD_ONLY_API)

    def backward(self, q, k, v, o, saved, do, causal: bool, deterministic: bool = False):
        raise ConfigError(FORWARD_ONLY_API)


FORWARD_ONLY_API = ("FP8 attention is forward only (as FlashAttention-3's): for inference call it under torch.no_grad() "
                    "(or layer.requires_grad_(False)); to train, use a 16-bit backend ('fused', 'triton' or 'reference')")
