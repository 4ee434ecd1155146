"""The Triton rung's kernels: FlashAttention-style forward and backward in OpenAI Triton, imported
only by tpattn/attention/triton_fused.py when --kernel triton runs (this module imports triton, which
CPU builds of torch lack). The backend (shapes, strides, grids, the autotune bypass) is there.

Layouts: q, o, do [B, h, N, d] and k, v [B, g, N, d], any batch, head and row strides, rows
contiguous; query head i reads K/V head i // GROUP (GROUP = h / g), in place. L (the logsumexp of a
query row, natural log, fp32 [B, h, N], contiguous) and D = rowsum(dO * O) (same layout) are the
only per-row state the backward keeps. Scores are exponentiated with exp2: qk_scale =
log2(e) / sqrt(d) is folded into the scale of S, so a row's base-2 logsumexp is L * log2(e).

Any head dim d that is a multiple of 8, up to 256: tiles are BLOCK_D = the next power of two (at
least 16) columns wide, and where BLOCK_D > d (PAD_D) the columns past d load as zeros and are never
stored, so every product and row sum is the d columns' own.

Any N: the last query and key tiles load with row masks (other=0) and mask their scores; causal:
key tiles wholly above the diagonal are never visited, tiles wholly below it run without a mask,
only the tiles that cross it (and the last, partial tile) pay for one. Base offsets (batch, head,
tile start) are 64-bit; per-tile offsets are small 32-bit ones; pointers advance tile by tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): natural-log L to base 2
LN2 = tl.constexpr(0.6931471805599453)    # ln(2): base 2 to natural log


def _n_bucket(n: int) -> int:
    """The autotune key for a sequence length: the next power of two (at least 64), so that N = 1000
    and N = 1024 share one tuning and each new N does not re-run the autotune."""
    return max(64, 1 << max(0, n - 1).bit_length())


def block_d(d: int) -> int:
    """The tiles' width for head dim d: the next power of two, at least 16 (tl.dot's least K)."""
    return max(16, 1 << max(0, d - 1).bit_length())


# The autotune sets, (BLOCK_M, BLOCK_N, num_warps, num_stages) per tile width BLOCK_D (head dims up
# to 32 take the 64 set). Forward: BLOCK_M query rows per program, BLOCK_N keys per tile. dK/dV:
# BLOCK_N keys per program (dK, dV in registers), BLOCK_M query rows per step. dQ: BLOCK_M query
# rows per program (dQ in registers), BLOCK_N keys per step. `python scripts/triton_regs.py` compiles
# every one for sm_90 and prints ptxas's registers and spills: the d = 64 and 128 sets are the ones
# measured before (several dK/dV configs spill a few hundred bytes there, with Triton 3.6's ptxas),
# each dK/dV set with two more that do not spill (the autotuner times them all); the 256 sets hold
# only configs that do not spill (the accumulators alone are 64 fp32 registers a thread per 64 x 256
# tile at 8 warps).
TUNE = {
    "fwd": {256: [(64, 32, 8, 2), (64, 32, 8, 3), (32, 64, 8, 2), (64, 16, 8, 3)],
            128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (64, 64, 4, 3)],
            64: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3)]},
    "kv": {256: [(32, 32, 8, 2), (16, 32, 8, 2), (32, 16, 8, 2), (16, 16, 8, 2)],
           128: [(32, 128, 8, 3), (16, 128, 8, 3), (32, 128, 8, 2), (32, 64, 8, 3), (16, 128, 8, 2), (16, 64, 8, 2)],
           64: [(64, 128, 8, 3), (32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (16, 128, 8, 2), (32, 64, 8, 2)]},
    "q": {256: [(64, 32, 8, 2), (32, 32, 4, 2), (64, 16, 8, 2), (32, 64, 8, 2)],
          128: [(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2)],
          64: [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2)]},
}


def tune_set(which: str, width: int) -> list:
    """The autotune set of a kernel for tiles `width` (BLOCK_D) wide."""
    return TUNE[which][max(64, width)]


def _key(c) -> tuple:
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages


def configs(which: str) -> list:
    """Every config of a kernel's sets (every width), the first of the d = 128 set first."""
    out = []
    for width in (128, 64, 256):
        for t in TUNE[which][width]:
            if t not in out:
                out.append(t)
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st) for bm, bn, w, st in out]


def _prune(which: str):
    """Keep the tile width's set, less tiles wider than the (bucketed) sequence: they only add autotune time."""
    def prune(configs, nargs, **kwargs):
        width = nargs.get("BLOCK_D", kwargs.get("BLOCK_D"))
        bucket = nargs.get("N_KEY", kwargs.get("N_KEY"))
        mine = [c for c in configs if _key(c) in tune_set(which, width)] or configs[:1]
        return [c for c in mine if c.kwargs["BLOCK_M"] <= bucket and c.kwargs["BLOCK_N"] <= bucket] or mine[-1:]
    return prune


KEY = ["N_KEY", "HEAD_DIM", "CAUSAL"]  # (+ the tensors' dtypes, which the autotuner adds itself)


# ---------------------------------------------------------------- forward ----

@triton.jit
def _tile(ptrs, ok, dim_ok, ROWS: tl.constexpr, PAD_D: tl.constexpr):
    """A tile's load, zeros where masked: by ok (rows or keys past N) when ROWS, by dim_ok (the
    columns past the head dim) when PAD_D; no mask at all when neither (the common, whole tile)."""
    if ROWS:
        if PAD_D:
            x = tl.load(ptrs, mask=ok & dim_ok, other=0.0)
        else:
            x = tl.load(ptrs, mask=ok, other=0.0)
    else:
        if PAD_D:
            x = tl.load(ptrs, mask=dim_ok, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, kT_ptrs, v_ptrs, step_k, step_v, start, stop, offs_m, N_CTX, qk_scale, dims,
               HEAD_DIM: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
               PAD_D: tl.constexpr):
    """Key tiles [start, stop) into the running (acc, l, m) of one query tile, online softmax in
    base 2. MASK: the tiles cross the diagonal (causal) or the end of the sequence."""
    cols = tl.arange(0, BLOCK_N)
    dim_ok = dims < HEAD_DIM
    for s in range(start, stop, BLOCK_N):
        key_ok = (s + cols) < N_CTX
        kT = _tile(kT_ptrs, key_ok[None, :], dim_ok[:, None], MASK, PAD_D)
        v = _tile(v_ptrs, key_ok[:, None], dim_ok[None, :], MASK, PAD_D)
        qk = tl.dot(q, kT)
        if MASK:
            keep = key_ok[None, :]
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= (s + cols)[None, :])
            qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_ref = m_new
        if MASK:  # a row with every key masked so far: keep exp2 away from (-inf) - (-inf)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk * qk_scale - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        kT_ptrs += step_k
        v_ptrs += step_v
    return acc, l_i, m_i


@triton.autotune(configs=configs("fwd"), key=KEY, prune_configs_by={"early_config_prune": _prune("fwd")})
@triton.jit(do_not_specialize=["N_CTX"])
def attn_fwd(Q, K, V, O, L, qk_scale, N_CTX, H, GROUP,
             sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
             N_KEY, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, STORE_LSE: tl.constexpr,
             BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (query tiles, B * h). One program: BLOCK_M query rows of one head against its K/V head."""
    pid_m = tl.program_id(0)
    if CAUSAL:  # the longest rows first: the last query tiles visit the most key tiles
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    hq = (bh % H).to(tl.int64)
    hk = hq // GROUP
    m0 = pid_m * BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    offs_m = m0 + rows
    row_ok = offs_m < N_CTX
    io_ok = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(Q + b * sqb + hq * sqh + m0.to(tl.int64) * sqn + (rows[:, None] * sqn + dims[None, :]),
                mask=io_ok, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    kT_local = cols[None, :] * skn + dims[:, None]  # a Kᵀ tile [d, BLOCK_N]
    v_local = cols[:, None] * svn + dims[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CAUSAL:
        full = (m0 // BLOCK_N) * BLOCK_N         # key tiles every row of this tile sees whole
        stop = tl.minimum(m0 + BLOCK_M, N_CTX)   # past the last row's diagonal: never visited
    else:
        full = (N_CTX // BLOCK_N) * BLOCK_N      # whole key tiles
        stop = N_CTX
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base + kT_local, v_base + v_local, BLOCK_N * skn, BLOCK_N * svn,
                               0, full, offs_m, N_CTX, qk_scale, dims, HEAD_DIM, False, CAUSAL, BLOCK_N, PAD_D)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base + full.to(tl.int64) * skn + kT_local,
                               v_base + full.to(tl.int64) * svn + v_local, BLOCK_N * skn, BLOCK_N * svn,
                               full, stop, offs_m, N_CTX, qk_scale, dims, HEAD_DIM, True, CAUSAL, BLOCK_N, PAD_D)
    o = acc / l_i[:, None]
    tl.store(O + b * sob + hq * soh + m0.to(tl.int64) * son + (rows[:, None] * son + dims[None, :]),
             o.to(O.dtype.element_ty), mask=io_ok)
    if STORE_LSE:  # natural log: (m + log2 l) is the base-2 logsumexp of the scaled scores
        lse = (m_i + tl.math.log2(l_i)) * LN2
        tl.store(L + bh.to(tl.int64) * N_CTX + offs_m, lse, mask=row_ok)


# --------------------------------------------------------------- backward ----

@triton.jit
def _kv_tiles(dk, dv, k, v, q_ptrs, do_ptrs, l_row, d_row, step_q, step_do, start, stop, offs_n, N_CTX, qk_scale,
              dims, HEAD_DIM: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
              PAD_D: tl.constexpr):
    """Query tiles [start, stop) of one query head into dK, dV of one key tile (transposed: Sᵀ, Pᵀ
    are [BLOCK_N, BLOCK_M]). P is recomputed from L; dK is scaled by 1/sqrt(d) by the caller.
    l_row, d_row: scalar pointers to the first tile's L and D (a scalar carried, not a tensor of
    pointers in the products' layout)."""
    rows = tl.arange(0, BLOCK_M)
    dim_ok = (dims < HEAD_DIM)[None, :]
    for s in range(start, stop, BLOCK_M):
        offs_m = s + rows
        ok = offs_m < N_CTX
        q = _tile(q_ptrs, ok[:, None], dim_ok, MASK, PAD_D)
        do = _tile(do_ptrs, ok[:, None], dim_ok, MASK, PAD_D)
        if MASK:
            lse = tl.load(l_row + rows, mask=ok, other=0.0)
            delta = tl.load(d_row + rows, mask=ok, other=0.0)
        else:
            lse = tl.load(l_row + rows)
            delta = tl.load(d_row + rows)
        sT = tl.dot(k, tl.trans(q))
        pT = tl.math.exp2(sT * qk_scale - (lse * LOG2E)[None, :])
        if MASK:
            keep = ok[None, :]
            if CAUSAL:
                keep = keep & (offs_m[None, :] >= offs_n[:, None])
            pT = tl.where(keep, pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(q.dtype), q)
        q_ptrs += step_q
        do_ptrs += step_do
        l_row += BLOCK_M
        d_row += BLOCK_M
    return dk, dv


@triton.autotune(configs=configs("kv"), key=KEY, prune_configs_by={"early_config_prune": _prune("kv")})
@triton.jit(do_not_specialize=["N_CTX"])
def attn_bwd_kv(Q, K, V, DO, L, DELTA, DK, DV, sm_scale, qk_scale, N_CTX, H, G, GROUP,
                sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon,
                sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
                N_KEY, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (key tiles, B * g). One program: dK and dV of BLOCK_N keys of one K/V head, summed over
    the GROUP query heads that read it (each query head's tiles in turn: no atomics, no repeated K/V)."""
    n0 = tl.program_id(0) * BLOCK_N
    bg = tl.program_id(1)
    b = (bg // G).to(tl.int64)
    hk = (bg % G).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    offs_n = n0 + cols
    key_ok = offs_n < N_CTX
    io_ok = key_ok[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(K + b * skb + hk * skh + n0.to(tl.int64) * skn + (cols[:, None] * skn + dims[None, :]),
                mask=io_ok, other=0.0)
    v = tl.load(V + b * svb + hk * svh + n0.to(tl.int64) * svn + (cols[:, None] * svn + dims[None, :]),
                mask=io_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if CAUSAL:
        lo = (n0 // BLOCK_M) * BLOCK_M                       # the first query tile that sees a key here
        mid = tl.cdiv(n0 + BLOCK_N, BLOCK_M) * BLOCK_M       # from here on rows see every key of the tile
    else:
        lo = n0 * 0
        mid = n0 * 0
    diag_stop = tl.minimum(mid, N_CTX)
    full = (N_CTX // BLOCK_M) * BLOCK_M                      # whole query tiles
    tail = tl.maximum(mid, full)
    q_local = rows[:, None] * sqn + dims[None, :]
    do_local = rows[:, None] * sdon + dims[None, :]
    for j in range(0, GROUP):
        hq = hk * GROUP + j
        bh = b * H + hq
        q_base = Q + b * sqb + hq * sqh
        do_base = DO + b * sdob + hq * sdoh
        l_base = L + bh * N_CTX
        d_base = DELTA + bh * N_CTX
        if CAUSAL:  # the query tiles crossing this key tile's diagonal
            dk, dv = _kv_tiles(dk, dv, k, v, q_base + lo.to(tl.int64) * sqn + q_local,
                               do_base + lo.to(tl.int64) * sdon + do_local, l_base + lo, d_base + lo,
                               BLOCK_M * sqn, BLOCK_M * sdon, lo, diag_stop, offs_n, N_CTX, qk_scale, dims, HEAD_DIM,
                               True, CAUSAL, BLOCK_M, PAD_D)
        dk, dv = _kv_tiles(dk, dv, k, v, q_base + mid.to(tl.int64) * sqn + q_local,
                           do_base + mid.to(tl.int64) * sdon + do_local, l_base + mid, d_base + mid,
                           BLOCK_M * sqn, BLOCK_M * sdon, mid, full, offs_n, N_CTX, qk_scale, dims, HEAD_DIM, False,
                           CAUSAL, BLOCK_M, PAD_D)
        dk, dv = _kv_tiles(dk, dv, k, v, q_base + tail.to(tl.int64) * sqn + q_local,
                           do_base + tail.to(tl.int64) * sdon + do_local, l_base + tail, d_base + tail,
                           BLOCK_M * sqn, BLOCK_M * sdon, tail, N_CTX, offs_n, N_CTX, qk_scale, dims, HEAD_DIM, True,
                           CAUSAL, BLOCK_M, PAD_D)
    dk = dk * sm_scale
    tl.store(DK + b * sdkb + hk * sdkh + n0.to(tl.int64) * sdkn + (cols[:, None] * sdkn + dims[None, :]),
             dk.to(DK.dtype.element_ty), mask=io_ok)
    tl.store(DV + b * sdvb + hk * sdvh + n0.to(tl.int64) * sdvn + (cols[:, None] * sdvn + dims[None, :]),
             dv.to(DV.dtype.element_ty), mask=io_ok)


@triton.jit
def _q_tiles(dq, q, do, lse2, delta, kT_ptrs, vT_ptrs, step_k, step_v, start, stop, offs_m, N_CTX, qk_scale, dims,
             HEAD_DIM: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
             PAD_D: tl.constexpr):
    """Key tiles [start, stop) into dQ of one query tile (unscaled; the caller applies 1/sqrt(d))."""
    cols = tl.arange(0, BLOCK_N)
    dim_ok = (dims < HEAD_DIM)[:, None]
    for s in range(start, stop, BLOCK_N):
        key_ok = (s + cols) < N_CTX
        kT = _tile(kT_ptrs, key_ok[None, :], dim_ok, MASK, PAD_D)
        vT = _tile(vT_ptrs, key_ok[None, :], dim_ok, MASK, PAD_D)
        p = tl.math.exp2(tl.dot(q, kT) * qk_scale - lse2[:, None])
        if MASK:
            keep = key_ok[None, :]
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= (s + cols)[None, :])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, vT)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT))
        kT_ptrs += step_k
        vT_ptrs += step_v
    return dq


@triton.autotune(configs=configs("q"), key=KEY, prune_configs_by={"early_config_prune": _prune("q")})
@triton.jit(do_not_specialize=["N_CTX"])
def attn_bwd_q(Q, K, V, O, DO, L, DELTA, DQ, sm_scale, qk_scale, N_CTX, H, GROUP,
               sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sdob, sdoh, sdon, sdqb, sdqh, sdqn,
               N_KEY, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
               BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (query tiles, B * h). One program: D = rowsum(dO * O) of BLOCK_M query rows (fp32, written
    to DELTA [B, h, N] for attn_bwd_kv, launched after it), then their dQ over the K/V head's tiles."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    hq = (bh % H).to(tl.int64)
    hk = hq // GROUP
    m0 = pid_m * BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    offs_m = m0 + rows
    row_ok = offs_m < N_CTX
    io_ok = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(Q + b * sqb + hq * sqh + m0.to(tl.int64) * sqn + (rows[:, None] * sqn + dims[None, :]),
                mask=io_ok, other=0.0)
    do = tl.load(DO + b * sdob + hq * sdoh + m0.to(tl.int64) * sdon + (rows[:, None] * sdon + dims[None, :]),
                 mask=io_ok, other=0.0)
    lse2 = tl.load(L + bh.to(tl.int64) * N_CTX + offs_m, mask=row_ok, other=0.0) * LOG2E
    o = tl.load(O + b * sob + hq * soh + m0.to(tl.int64) * son + (rows[:, None] * son + dims[None, :]),
                mask=io_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * N_CTX + offs_m, delta, mask=row_ok)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    kT_local = cols[None, :] * skn + dims[:, None]  # Kᵀ and Vᵀ tiles [d, BLOCK_N]
    vT_local = cols[None, :] * svn + dims[:, None]
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CAUSAL:
        full = (m0 // BLOCK_N) * BLOCK_N
        stop = tl.minimum(m0 + BLOCK_M, N_CTX)
    else:
        full = (N_CTX // BLOCK_N) * BLOCK_N
        stop = N_CTX
    dq = _q_tiles(dq, q, do, lse2, delta, k_base + kT_local, v_base + vT_local, BLOCK_N * skn, BLOCK_N * svn,
                  0, full, offs_m, N_CTX, qk_scale, dims, HEAD_DIM, False, CAUSAL, BLOCK_N, PAD_D)
    dq = _q_tiles(dq, q, do, lse2, delta, k_base + full.to(tl.int64) * skn + kT_local,
                  v_base + full.to(tl.int64) * svn + vT_local, BLOCK_N * skn, BLOCK_N * svn,
                  full, stop, offs_m, N_CTX, qk_scale, dims, HEAD_DIM, True, CAUSAL, BLOCK_N, PAD_D)
    dq = dq * sm_scale
    tl.store(DQ + b * sdqb + hq * sdqh + m0.to(tl.int64) * sdqn + (rows[:, None] * sdqn + dims[None, :]),
             dq.to(DQ.dtype.element_ty), mask=io_ok)
