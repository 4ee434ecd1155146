"""The FP8 (e4m3) attention forward in Triton, on Hopper's FP8 tensor cores (imported only where it
runs: it imports triton).

The arithmetic of tpattn/attention/fp8.py (FlashAttention-3's rounding points), tile by tile:

    Q, K, V   e4m3 with scales per (batch, head) or per 128-row block (fp8.quantize; Q and K rotated
              by the Hadamard matrix first when asked), made before the launch by fp8_quant (per
              block one pass over each input: rotation, amax, scale and e4m3 bytes; per head or
              tensor two: the amax, then the bytes); V stored transposed, [B, g, d, N], so that the PV product's
              second operand is K-major as Hopper's FP8 tensor cores need it
    S         tl.dot(Q8 tile, K8 tile^T) in fp32, times the tile's query and key scales and 1/sqrt(d)
              (tiles of 64 or 128 rows lie in one 128-row scale block: two numbers a tile)
    P         exp2 of S (base-2 units) less the running row max, in fp32; l sums these fp32 P
    P8        P rounded to e4m3 (in [0, 1]: no scale)
    O         acc = acc * alpha + s_v(key block) * tl.dot(P8, V8 tile), fp32; o = acc / l, rounded
              once to fp16 or bf16

One program per (query tile, batch x head); grouped-query heads read their K/V head in place. The
online softmax makes P relative to the running max, not the final one (the emulation's), so P8
rounds at other points: the outputs agree to FP8's error, not bit for bit.
Forward only: FlashAttention-3 ships no FP8 backward either.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..timing import section
from . import fp8

BLOCK = fp8.BLOCK_ROWS  # rows of a scale block; the tiles divide it
# autotune configs per head dim, (BLOCK_M, BLOCK_N, warps, stages): those that ptxas compiles for sm_90a
# without spills (python scripts/triton_regs.py; 128 x 128 tiles spill at d = 128, every 4-warp or
# 128-row tile at d = 256)
TUNE = {64: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 4), (64, 128, 4, 3)],
        128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 2), (64, 64, 4, 3)],
        256: [(64, 64, 8, 2), (64, 32, 8, 2)]}
CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "D_TUNED": d}, num_warps=w, num_stages=st)
           for d, cfgs in TUNE.items() for bm, bn, w, st in cfgs]


def _head_dims_own(configs, named_args, **kwargs):
    """The autotuner's candidates: the configs of this launch's head dim."""
    return [c for c in configs if c.kwargs["D_TUNED"] == kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))]


@triton.jit
def _fp8_tiles(acc, l_i, m_i, sv_run, q, qs, kT_ptrs, v_ptrs, SK, SV, sk_base, start, stop, offs_m, cols, N, skn,
               SBLK, MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles [start, stop) into one query tile's (acc, l, m); kT_ptrs, v_ptrs at key `start`. A
    tile lies in one scale block (BLOCK_N divides it), so its K and V scales are two numbers; qs: the
    query tile's scale times 1/sqrt(d) in base 2. MASK: the keys' end (or, CAUSAL, the diagonal) is
    inside these tiles; elsewhere every load and every score is whole. The scores' scale c (> 0) is
    applied inside the exponent's multiply-add, exp2(raw c - m), not to the tile first (m: the running
    max of raw c, from the tile's max of raw: c > 0 keeps the order). acc is held in units of the V
    scale sv_run of the last tile's block: a tile of another block rescales it by sv_run / sv inside the
    row factor alpha (a number a row), so each element takes one multiply-add a tile, not two; the
    output is acc sv_run / l."""
    for n0 in range(start, stop, BLOCK_N):
        keys = n0 + cols
        if MASK:
            key_ok = keys < N
            kT = tl.load(kT_ptrs, mask=key_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        else:
            kT = tl.load(kT_ptrs)
            v = tl.load(v_ptrs)
        blk = n0 // SBLK
        c = tl.maximum(qs * tl.load(SK + sk_base + blk), 1.1754943508222875e-38)  # (>= 2^-126: an fp32 constant)
        raw = tl.dot(q, kT)
        if MASK:
            keep = key_ok[None, :]
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= keys[None, :])
            raw = tl.where(keep, raw, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(raw, 1) * c)  # (c > 0: every scale is, a block of zeros' too)
        m_ref = m_new
        if MASK:  # a row with every key masked so far: keep exp2 away from (-inf) - (-inf)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(raw * c - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = tl.dot(p.to(tl.float8e4nv, fp_downcast_rounding="rtne"), v)
        sv = tl.load(SV + sk_base + blk)  # (> 0: a block of zeros has scale 1)
        acc = acc * (alpha * tl.math.div_rn(sv_run, sv))[:, None] + pv  # (rounded division: x / x is 1 exactly)
        sv_run = sv
        m_i = m_new
        kT_ptrs += BLOCK_N * skn
        v_ptrs += BLOCK_N
    return acc, l_i, m_i, sv_run


@triton.autotune(configs=CONFIGS, key=["N_BUCKET", "HEAD_DIM", "CAUSAL"],
                 prune_configs_by={"early_config_prune": _head_dims_own})
@triton.jit
def fp8_fwd(Q, K, VT, O, SQ, SK, SV, qk_scale, N, N_BUCKET, H, GROUP, SBLK, nblk,
            sqb, sqh, sqn, skb, skh, skn, svd, sob, soh, son,
            HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            D_TUNED: tl.constexpr):
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    hq = (bh % H).to(tl.int64)
    hk = hq // GROUP
    m0 = t * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N
    q = tl.load(Q + b * sqb + hq * sqh + offs_m[:, None].to(tl.int64) * sqn + dims[None, :], mask=row_ok[:, None],
                other=0.0)
    qs = tl.load(SQ + (b * H + hq) * nblk + m0 // SBLK) * qk_scale  # (the tile lies in one scale block)
    kv_base = b * skb + hk * skh  # K [B, g, N, d] and VT [B, g, d, N] share their batch and head strides
    sk_base = (b * (H // GROUP) + hk) * nblk
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    sv_run = tl.load(SV + sk_base)  # the units acc is held in (_fp8_tiles)
    kT_ptrs = K + kv_base + cols[None, :].to(tl.int64) * skn + dims[:, None]  # [d, keys]: K-major for Q K^T
    v_ptrs = VT + kv_base + dims[None, :].to(tl.int64) * svd + cols[:, None]  # [keys, d] read from V^T: K-major
    if CAUSAL:
        whole = m0 // BLOCK_N * BLOCK_N  # key tiles wholly below the tile's first row
        stop = tl.minimum(m0 + BLOCK_M, N)
    else:
        whole = N // BLOCK_N * BLOCK_N
        stop = N
    acc, l_i, m_i, sv_run = _fp8_tiles(acc, l_i, m_i, sv_run, q, qs, kT_ptrs, v_ptrs, SK, SV, sk_base, 0, whole,
                                       offs_m, cols, N, skn, SBLK, False, CAUSAL, BLOCK_N)
    acc, l_i, m_i, sv_run = _fp8_tiles(acc, l_i, m_i, sv_run, q, qs, kT_ptrs + whole * skn, v_ptrs + whole, SK, SV,
                                       sk_base, whole, stop, offs_m, cols, N, skn, SBLK, True, CAUSAL, BLOCK_N)
    o = acc * (sv_run / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
    tl.store(O + b * sob + hq * soh + offs_m[:, None].to(tl.int64) * son + dims[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None])


def _compact(s: torch.Tensor, B: int, heads: int, N: int, scaling: str) -> torch.Tensor:
    """fp8.quantize's scale (broadcastable against [B, heads, N, 1]) as [B, heads, blocks] (fp32,
    contiguous): one block for "tensor" and "head", a block per BLOCK rows for "block"."""
    if scaling == "block":
        return s[:, :, ::BLOCK, 0].float().contiguous()
    return s.reshape(s.shape[0], s.shape[1], 1).expand(B, heads, 1).float().contiguous()


@triton.jit
def _quant_slice(x, R, cols, j0, rscale, BJ: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Columns j0 .. j0 + BJ of x @ (R / sqrt(d)) in fp32: x [SUB, d] 16-bit, R the +-1 Hadamard matrix
    [d, d] in x's dtype (exact), the products summed in fp32 on the tensor cores, then times
    rscale = 1/sqrt(d)."""
    jc = j0 + tl.arange(0, BJ)
    return tl.dot(x, tl.load(R + cols[:, None] * HEAD_DIM + jc[None, :])) * rscale


@triton.jit
def fp8_quant(X, X8, S, R, N, NPAD, H, nblk, sxb, sxh, sxn, s8b, s8h, s8n, s8d, ssh, rscale,
              HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, BJ: tl.constexpr,
              ROTATE: tl.constexpr, MODE: tl.constexpr, KEY_ORDER: tl.constexpr):
    """Block `program_id(0)` (BLOCK rows) of head `program_id(1)` (batch x head) of X [B, H, N, d]
    (16-bit, or fp32 without the rotation), rotated when ROTATE (x @ R * rscale, R the +-1 Hadamard
    matrix in X's dtype). MODE 0 (block scales): s = amax * (1/448) of the block (1 for zeros) into
    S [B, H, nblk], then e4m3(x / s) (IEEE division, nearest even, saturating) into X8 through its
    strides (s8n, s8d): [.., N, d] for Q and K, [.., d, NPAD] for V^T. MODE 1: amax * (1/448) of the
    block only, into S (zeros kept: the caller takes the head's or the tensor's largest). MODE 2: the
    bytes only, by the scale S[bh * ssh] (a head's: ssh 1; the tensor's: 0). Rows N .. NPAD - 1 of X8
    get zeros. KEY_ORDER (V^T for the CUDA kernel, fp8_ws.KEY_ORDER): each 16 keys' columns permuted,
    key 8 e1 + 2 t + e0 at position 4 t + 2 e1 + e0. The bits of fp8.quantize up to the rotation's fp32
    rounding (torch's matmul sums in another order). The passes go over the block's SUB-row slices
    (amax, then the bytes), the rotation recomputed BJ columns at a time, not held."""
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    hh = bh - b * H
    cols = tl.arange(0, HEAD_DIM)
    x_base = X + b.to(tl.int64) * sxb + hh.to(tl.int64) * sxh
    o_base = X8 + b.to(tl.int64) * s8b + hh.to(tl.int64) * s8h
    if MODE == 2:
        sc = tl.load(S + bh.to(tl.int64) * ssh)
    else:
        amax = tl.zeros([SUB], dtype=tl.float32)
        for r0 in range(0, BLOCK, SUB):
            rows = blk * BLOCK + r0 + tl.arange(0, SUB)
            x = tl.load(x_base + rows[:, None].to(tl.int64) * sxn + cols[None, :], mask=(rows < N)[:, None],
                        other=0.0)
            if ROTATE:
                for j0 in range(0, HEAD_DIM, BJ):
                    amax = tl.maximum(amax, tl.max(tl.abs(_quant_slice(x, R, cols, j0, rscale, BJ, HEAD_DIM)), axis=1))
            else:
                amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        sc = tl.max(amax, axis=0) * (1.0 / 448.0)
        if MODE == 0:
            sc = tl.where(sc > 0.0, sc, 1.0)
        tl.store(S + bh.to(tl.int64) * nblk + blk, sc)
    if MODE != 1:
        for r0 in range(0, BLOCK, SUB):
            rows = blk * BLOCK + r0 + tl.arange(0, SUB)
            x = tl.load(x_base + rows[:, None].to(tl.int64) * sxn + cols[None, :], mask=(rows < N)[:, None],
                        other=0.0)
            ok = (rows < NPAD)[:, None]
            if KEY_ORDER:
                at = (rows & ~15) + 4 * ((rows >> 1) & 3) + 2 * ((rows >> 3) & 1) + (rows & 1)
            else:
                at = rows
            if ROTATE:
                for j0 in range(0, HEAD_DIM, BJ):
                    y = tl.minimum(tl.maximum(tl.math.div_rn(_quant_slice(x, R, cols, j0, rscale, BJ, HEAD_DIM), sc),
                                              -448.0), 448.0)
                    jc = j0 + tl.arange(0, BJ)
                    tl.store(o_base + at[:, None].to(tl.int64) * s8n + jc[None, :].to(tl.int64) * s8d,
                             y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=ok)
            else:
                y = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), sc), -448.0), 448.0)
                tl.store(o_base + at[:, None].to(tl.int64) * s8n + cols[None, :].to(tl.int64) * s8d,
                         y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=ok)


QUANT_SUB, QUANT_BJ = 32, 32  # fp8_quant's slices: rows of a block, columns of the rotation at a time


def quantize(x: torch.Tensor, scaling: str, rotate: bool, transpose: bool = False,
             key_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, s) of x [B, h, N, d] (rows contiguous) by fp8_quant: x8 in torch.float8_e4m3fn, [B, h, N, d]
    (or, transpose, [B, h, d, N]; with key_order, [B, h, d, N rounded up to 16] in fp8_ws.KEY_ORDER,
    the CUDA kernel's V^T), and the scales [B, h, blocks] (fp32), after the Hadamard rotation when
    rotate: prepare's operands. Block scales: one launch; a head's or the tensor's: the blocks' amax
    (one launch), its largest (torch), then the bytes (a second launch)."""
    B, h, N, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    nblk = triton.cdiv(N, BLOCK)
    npad = -(-N // 16) * 16 if key_order else N
    x8 = torch.empty((B, h, d, npad) if transpose or key_order else (B, h, N, d), dtype=torch.float8_e4m3fn,
                     device=x.device)
    s = torch.empty(B, h, nblk, dtype=torch.float32, device=x.device)
    if B * h * N == 0:
        return x8, s if scaling == "block" else torch.ones(B, h, 1, dtype=torch.float32, device=x.device)
    signs = (fp8.hadamard(d) * math.sqrt(d)).round().to(device=x.device, dtype=x.dtype).contiguous() if rotate else s
    s8n, s8d = (x8.stride(3), x8.stride(2)) if transpose or key_order else (x8.stride(2), x8.stride(3))

    def launch(scales, mode, ssh=0):
        fp8_quant[(nblk, B * h)](x, x8, scales, signs, N, npad, h, nblk, *x.stride()[:3], x8.stride(0), x8.stride(1),
                                 s8n, s8d, ssh, 1.0 / math.sqrt(d), HEAD_DIM=d, BLOCK=BLOCK, SUB=QUANT_SUB,
                                 BJ=QUANT_BJ, ROTATE=rotate, MODE=mode, KEY_ORDER=key_order, num_warps=4)

    if scaling == "block":
        launch(s, 0)
        return x8, s
    if scaling not in ("head", "tensor"):
        raise ValueError(f"scaling {scaling!r}: use one of {', '.join(fp8.SCALINGS)}")
    launch(s, 1)  # each block's amax / 448: the largest is the head's (the tensor's) amax / 448
    s = s.amax(-1, keepdim=True) if scaling == "head" else s.amax().reshape(1, 1, 1).expand(B, h, 1)
    s = torch.where(s > 0, s, torch.ones_like(s)).contiguous()
    launch(s, 2, 1)
    return x8, s


def quantize_blocks(x: torch.Tensor, rotate: bool, transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize(x, "block", rotate, transpose): one launch of fp8_quant."""
    return quantize(x, "block", rotate, transpose)


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: str = "head", rotate: bool = False,
            key_order: bool = False):
    """The kernel's operands from 16-bit (or fp32) q [B, h, N, d], k, v [B, g, N, d]: q8, k8 [.., N, d]
    and vt8 [B, g, d, N] in torch.float8_e4m3fn (key_order: the CUDA kernel's V^T, quantize's), and
    their scales [B, heads, blocks] (fp32), as fp8.attention_fp8 quantizes them (its rotation of q and
    k first when rotate): fp8_quant's launches (quantize), or torch (prepare_torch) for fp32 inputs
    with the rotation."""
    if rotate and q.dtype not in (torch.float16, torch.bfloat16):
        if key_order:
            raise ValueError("key_order is fp8_quant's: 16-bit inputs where rotated (fp8_ws.prepare orders torch's V^T)")
        return prepare_torch(q, k, v, scaling, rotate)
    (q8, sq), (k8, sk) = (quantize(t, scaling, rotate) for t in (q, k))
    vt8, sv = quantize(v, scaling, False, transpose=True, key_order=key_order)
    return q8, k8, vt8, sq, sk, sv


def prepare_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: str = "head", rotate: bool = False):
    """prepare's operands through torch ops (fp8.quantize): every scaling."""
    B, h, N, d = q.shape
    g = k.shape[1]
    if rotate:
        rot = fp8.hadamard(d).to(device=q.device, dtype=torch.float32)
        q, k = q.float() @ rot, k.float() @ rot
    (q8, sq), (k8, sk), (v8, sv) = (fp8.quantize(t, scaling) for t in (q, k, v))
    vt8 = v8.transpose(-1, -2).to(torch.float8_e4m3fn).contiguous()
    return (q8.to(torch.float8_e4m3fn).contiguous(), k8.to(torch.float8_e4m3fn).contiguous(), vt8,
            _compact(sq, B, h, N, scaling), _compact(sk, B, g, N, scaling), _compact(sv, B, g, N, scaling))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scaling: str = "head",
              rotate: bool = False, out_dtype: torch.dtype | None = None, tiles: tuple | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """o [B, h, N, d] of q [B, h, N, d] over k, v [B, g, N, d] through the FP8 kernel (prepare, then
    fp8_fwd), in out_dtype (default q's, fp16 for fp32 inputs). d: 64, 128 or 256 (Triton's tile:
    a power of two, at least 16 for the FP8 products). tiles: (BLOCK_M, BLOCK_N, warps, stages)
    instead of the autotuned choice among CONFIGS. out: o's memory ([B, h, N, d], rows contiguous)."""
    B, h, N, d = q.shape
    g = k.shape[1]
    if h % g:
        raise ValueError(f"{h} query heads do not divide into {g} K/V heads")
    if d not in fp8.KERNEL_HEAD_DIMS:
        raise ValueError(f"the FP8 kernel takes head dims 64, 128 and 256 (got {d})")
    out_dtype = out_dtype or (q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.float16)
    q8, k8, vt8, sq, sk, sv = prepare(q, k, v, scaling, rotate)
    o = out if out is not None else torch.empty(B, h, N, d, dtype=out_dtype, device=q.device)
    assert o.shape == q.shape and o.stride(-1) == 1, "out: [B, h, N, d] with contiguous rows"
    return launch(q8, k8, vt8, sq, sk, sv, causal, o, BLOCK if scaling == "block" else max(N, 1), tiles)


def launch(q8, k8, vt8, sq, sk, sv, causal: bool, o: torch.Tensor, sblk: int, tiles: tuple | None = None) -> torch.Tensor:
    """fp8_fwd over prepared operands (prepare's), writing o [B, h, N, d]; sblk: rows per scale block;
    tiles: a fixed (BLOCK_M, BLOCK_N, warps, stages) instead of the autotuned one (in Triton's
    interpreter, on CPU tensors: the head dim's first)."""
    B, h, N, d = q8.shape
    g = k8.shape[1]
    if B * h * N == 0:
        return o
    assert k8.stride()[:2] == vt8.stride()[:2], "K and V^T share their batch and head strides"
    args = (q8, k8, vt8, o, sq, sk, sv, math.log2(math.e) / math.sqrt(d), N, triton.next_power_of_2(N), h, h // g,
            sblk, sq.shape[2], *q8.stride()[:3], *k8.stride()[:3], vt8.stride(2), *o.stride()[:3])
    if tiles is None and q8.device.type == "cpu":  # Triton's interpreter cannot time configs: the first
        tiles = TUNE[d][0]
    if tiles is not None:
        bm, bn, warps, stages = tiles
        assert BLOCK % bn == 0 and BLOCK % bm == 0, "the tiles divide a scale block"
        fp8_fwd.fn[(triton.cdiv(N, bm), B * h)](*args, HEAD_DIM=d, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn,
                                                 D_TUNED=d, num_warps=warps, num_stages=stages)
        return o
    fp8_fwd[lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B * h)](*args, HEAD_DIM=d, CAUSAL=causal)
    return o


class Fp8TritonBackend(fp8.Fp8Backend):
    """The layer's FP8 attention (fp8.Fp8Backend's scaling and rotation) through this module's kernel,
    all heads in one launch: python -m tpattn --dtype fp8 --kernel triton (compute capability 8.9+)."""
    name = "fp8_triton"

    def head_dim_error(self, d: int) -> str | None:
        return fp8.kernel_head_dim_error(d)

    def forward(self, q, k, v, causal: bool, out=None):
        o = out if out is not None else torch.empty_like(q)
        with section("fp8"):
            return attention(q, k, v, causal, fp8.SCALING, fp8.ROTATE, out=o)
