"""A paged prefill in one Triton launch: every sequence of a step, each row attending causally to
its own sequence's positions, K and V read in place through the block table (imported only where
it runs: it imports triton).

A step's rows are packed as FlashAttention's varlen API packs them (tpattn/paged.py): sequence i's
T_i rows at [cu_i, cu_i + T_i), at positions L_i .. L_i + T_i - 1, its K and V (the step's rows
already written) at positions 0 .. L_i + T_i - 1 in the pool's pages [pages, g, page, d], page j of
the sequence at table[i, j]. Program (t, i * h + head) takes rows [t * BLOCK_M, (t + 1) * BLOCK_M)
of sequence i (none if T_i is shorter: it returns), streams the key tiles up to its last row's
position with an online softmax in base 2, as attn_fwd (triton_kernels.py) does, each key's page
and slot looked up in the table (a gather: the tile's keys need not share a page); the tiles every
row of the program sees whole (below its first row's position) run without a mask. So a step's
prefill is one launch whatever its sequences, with no gathered copy of K and V and no scores in
memory: O(rows x d) beyond the pool.

An FP8 pool (PagedKV(kv_dtype="fp8"): e4m3 pages, a scale a row [pages, g, page]): the tiles are read
as e4m3 and widened to the query's dtype (exact), each key's dot products times its K scale, each
p times its V scale before the PV product (l sums the p themselves): the same softmax over the
dequantized pages, with no dequantized copy.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .triton_kernels import block_d, tune_set


def config(d: int) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for head dim d: the forward's first config at its tile
    width (triton_kernels.TUNE), no autotune (a prefill's shapes change every step; one compile per head
    dim and dtype)."""
    return tune_set("fwd", block_d(d))[0]


@triton.jit
def _paged_tiles(acc, l_i, m_i, q, KP, VP, KS, VS, trow, start, stop, pos_m, cols, dims, dim_ok, qk_scale, hk,
                 skp, skh, sks, svp, svh, svs, ssp, ssh, PAGE, MASK: tl.constexpr, F8: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Key tiles [start, stop) of one sequence into one query tile's running (acc, l, m), online
    softmax in base 2, each key's page looked up in the table row trow. MASK: the tiles cross the
    diagonal or the keys' end (stop), or the head dim is padded; else every key is seen by every row.
    F8: e4m3 pages with row scales KS, VS (strides ssp, ssh per page and head; 1 per slot)."""
    for n0 in range(start, stop, BLOCK_N):
        kpos = n0 + cols
        key_ok = kpos < stop
        if MASK:
            page = tl.load(trow + kpos // PAGE, mask=key_ok, other=0).to(tl.int64)
        else:
            page = tl.load(trow + kpos // PAGE).to(tl.int64)
        slot = (kpos % PAGE).to(tl.int64)
        kT = tl.load(KP + page[None, :] * skp + hk * skh + slot[None, :] * sks + dims[:, None],
                     mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
        v = tl.load(VP + page[:, None] * svp + hk * svh + slot[:, None] * svs + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        if F8:  # widened exactly; the row scales applied to the products
            at = page * ssp + hk * ssh + slot
            ks = tl.load(KS + at, mask=key_ok, other=0.0)
            vs = tl.load(VS + at, mask=key_ok, other=0.0)
            kT = kT.to(q.dtype)
            v = v.to(q.dtype)
        qk = tl.dot(q, kT)
        if F8:
            qk = qk * ks[None, :]
        if MASK:
            qk = tl.where(key_ok[None, :] & (pos_m[:, None] >= kpos[None, :]), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.math.exp2(qk * qk_scale - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        if F8:  # p times its key's V scale over the tile's largest (p * s_v in [0, 1] stays clear of
            # fp16's subnormals, where small scales would lose its bits), the largest outside the product
            vmax = tl.max(vs, 0)
            vmax = tl.where(vmax > 0.0, vmax, 1.0)
            acc = acc * alpha[:, None] + tl.dot((p * (vs / vmax)[None, :]).to(v.dtype), v) * vmax
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def paged_prefill_fwd(Q, KP, VP, O, TABLE, CU, START, KS, VS, qk_scale,
                      sqr, sqh, sor, soh, skp, skh, sks, svp, svh, svs, ssp, ssh, stab, H, GROUP, PAGE,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, F8: tl.constexpr):
    t = tl.program_id(0)
    sh = tl.program_id(1)
    s = sh // H
    hq = (sh % H).to(tl.int64)
    hk = hq // GROUP
    r0 = tl.load(CU + s)
    n_rows = tl.load(CU + s + 1) - r0
    m0 = t * BLOCK_M
    if m0 < n_rows:
        L0 = tl.load(START + s)
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        offs_m = m0 + rows
        row_ok = offs_m < n_rows
        io_ok = row_ok[:, None] & dim_ok[None, :]
        grow = (r0 + offs_m).to(tl.int64)  # the rows' places in the packed step
        q = tl.load(Q + grow[:, None] * sqr + hq * sqh + dims[None, :], mask=io_ok, other=0.0)
        pos_m = L0 + offs_m                                   # the rows' positions
        stop = L0 + tl.minimum(m0 + BLOCK_M, n_rows)          # keys past the tile's last row: none
        full = (L0 + m0 + 1) // BLOCK_N * BLOCK_N             # whole key tiles every row of the tile sees
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        trow = TABLE + s.to(tl.int64) * stab
        acc, l_i, m_i = _paged_tiles(acc, l_i, m_i, q, KP, VP, KS, VS, trow, 0, full, pos_m, cols, dims, dim_ok,
                                     qk_scale, hk, skp, skh, sks, svp, svh, svs, ssp, ssh, PAGE, False, F8, BLOCK_N)
        acc, l_i, m_i = _paged_tiles(acc, l_i, m_i, q, KP, VP, KS, VS, trow, full, stop, pos_m, cols, dims, dim_ok,
                                     qk_scale, hk, skp, skh, sks, svp, svh, svs, ssp, ssh, PAGE, True, F8, BLOCK_N)
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(O + grow[:, None] * sor + hq * soh + dims[None, :], o.to(O.dtype.element_ty), mask=io_ok)


def paged_prefill(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                  cu: torch.Tensor, starts: torch.Tensor, most_rows: int, out: torch.Tensor | None = None,
                  tiles: tuple | None = None, scales=None) -> torch.Tensor:
    """o [R, h, d] of a step's packed rows q [R, h, d] (columns contiguous), sequence i's rows
    [cu[i], cu[i+1]) at positions starts[i].. over its first starts[i] + rows positions of K, V in
    the pools [pages, g, page, d] (contiguous), through table [n, pages] (int32); cu [n + 1] and
    starts [n] int32 on q's device; most_rows: the most rows any sequence has (sets the grid).
    scales: an FP8 pool's (k_scale, v_scale) [pages, g, page] (fp32, contiguous), its pages e4m3."""
    R, h, d = q.shape
    g, page = k_pool.shape[1], k_pool.shape[2]
    n = table.shape[0]
    o = out if out is not None else torch.empty_like(q)
    assert q.stride(-1) == 1 and o.stride(-1) == 1 and k_pool.is_contiguous() and v_pool.is_contiguous()
    f8 = scales is not None
    if f8:
        assert k_pool.dtype == v_pool.dtype == torch.float8_e4m3fn and all(
            t.is_contiguous() and t.shape == k_pool.shape[:3] for t in scales)
    ks, vs = scales if f8 else (k_pool, v_pool)  # (not read without F8)
    if R == 0:
        return o
    bm, bn, warps, stages = tiles or config(d)
    grid = (triton.cdiv(most_rows, bm), n * h)
    paged_prefill_fwd[grid](q, k_pool, v_pool, o, table, cu, starts, ks, vs, math.log2(math.e) / math.sqrt(d),
                            q.stride(0), q.stride(1), o.stride(0), o.stride(1), *k_pool.stride()[:3],
                            *v_pool.stride()[:3], ks.stride(0), ks.stride(1), table.stride(0), h, h // g, page,
                            HEAD_DIM=d, BLOCK_D=block_d(d), BLOCK_M=bm, BLOCK_N=bn, F8=f8, num_warps=warps,
                            num_stages=stages)
    return o
