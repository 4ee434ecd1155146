"""Pre-flight memory estimate: what one rank allocates, before it allocates anything.

With --uneven-heads the ranks hold different numbers of heads: each rank counts its own (rank 0,
which also runs the checks, holds the most), and the per-rank figures of the report are rank 0's."""

from __future__ import annotations

import dataclasses
import math

from .check import MAX_ROWS
from .config import Config, ConfigError
from .sharding import head_range, kv_head_range

HEADROOM = 0.92  # leave room for the CUDA context, cuBLAS workspaces and fragmentation
STEP_OBJECT_BYTES = 1024  # a --decode step's own host objects (its output tensor kept until the concatenation, its
                          # timings): what a CPU run of tens of millions of steps runs out of first


def heads_world(cfg: Config, world: int, rank: int = 0) -> tuple[int, int]:
    """(ranks the heads split over, this rank's place among them): the world, or with
    --context-parallel C its W / C heads' ranks (rank r is heads rank r // C)."""
    C = cfg.context_parallel
    return world // C, rank // C


def heads_per_rank(cfg: Config, world: int, rank: int = 0) -> int:
    """Query heads rank `rank` owns: H/W, or with --uneven-heads its block's (rank 0: the most)."""
    return len(head_range(cfg.heads, *heads_world(cfg, world, rank), cfg.uneven_heads, cfg.kv_heads or cfg.heads))


def kv_heads_per_rank(cfg: Config, world: int, rank: int = 0) -> int:
    """K/V heads one rank holds: G/W when the world size divides G (with --uneven-heads its block of
    ceil or floor of G/W), else (replicated) one."""
    G = cfg.kv_heads or cfg.heads
    return len(kv_head_range(cfg.heads, G, *heads_world(cfg, world, rank), cfg.uneven_heads))


def kv_bytes(cfg: Config, world: int, rank: int = 0) -> int:
    """Bytes of one rank's K and V activations, [B, g, N, d] each (with --context-parallel C its
    N / C rows)."""
    rows = cfg.seq_len // cfg.context_parallel
    return 2 * cfg.batch * kv_heads_per_rank(cfg, world, rank) * rows * cfg.head_dim * cfg.elem_size


def kv_token_bytes(kv_heads: int, head_dim: int, elem_size: int, fp8: bool = False) -> int:
    """A cached token's K and V over `kv_heads` heads: d values each in the model's dtype, or (an FP8
    cache, tpattn.paged) d bytes and an fp32 scale."""
    return 2 * kv_heads * (head_dim + 4 if fp8 else head_dim * elem_size)


def weight_bytes(cfg: Config, world: int, rank: int) -> int:
    """This rank's weights: W_q, W_o of its h heads and W_k, W_v of its g K/V heads, in the model's dtype."""
    return 2 * cfg.model_dim * (heads_per_rank(cfg, world, rank) + kv_heads_per_rank(cfg, world, rank)) \
        * cfg.head_dim * cfg.elem_size


def coefficients(cfg: Config, world: int, rank: int) -> tuple[float, float, float]:
    """Bytes as a*N^2 + b*N + c for this rank."""
    el, B, H, d = cfg.elem_size, cfg.batch, cfg.heads, cfg.head_dim
    D, h = cfg.model_dim, heads_per_rank(cfg, world, rank)
    G, g = cfg.kv_heads or H, kv_heads_per_rank(cfg, world, rank)  # K/V heads in all and on this rank
    red = 4 if cfg.reduce_dtype == "fp32" else el
    score_el = el + (12 if cfg.kernel == "reference" else 0)  # the reference keeps float32 copies
    a = 2 * B * h * score_el                                   # S and P of the heads done at once
    if not scores_bytes(cfg, world, rank):
        a = 0                                                  # fused: S and P stay on chip, O(N) memory
    # x, y, the QKV GEMM's output and its q/k/v copies ((h + 2g) d each), o, partials
    b = B * (D * el * 2 + (3 * h + 4 * g) * d * el + D * red * 2)
    c = weight_bytes(cfg, world, rank)
    if cfg.decode:  # the KV cache of N + T rows: K and V of this rank's K/V heads (e4m3: a byte and an fp32 scale)
        per_token = kv_token_bytes(g, d, el, cfg.kv_dtype == "fp8")
        b += B * per_token
        c += B * cfg.decode * per_token
    C = cfg.context_parallel
    if C > 1:  # N / C rows each; the ring's two K/V blocks in flight and the fp32 output it merges into
        acc = max(4, el)
        a = 0 if not a else 3 * B * h * acc / C ** 2           # a piece's fp32 S, P (torch math), n x n
        b = (b + B * (2 * 2 * g * d * el + h * d * acc)) / C
    if cfg.check and rank == 0:
        # the single-process baseline (all heads, same chunk), and the float64 reference: x, k and v
        # (G heads; repeated to H heads when G < H), q, S and P of the sampled rows
        f64 = D + 2 * G * d + (2 * H * d if G < H else 0)
        b += B * ((3 * H + 4 * G) * d * el + D * red * 2) + B * (f64 * 8 + 3 * H * MAX_ROWS * 8)
        c += 2 * D * (H + G) * d * (el + 8)
    return a, b, c


def scores_bytes(cfg: Config, world: int, rank: int = 0) -> int:
    """Bytes of S (and as many of P) on one rank; 0 for a kernel that keeps them on chip."""
    from .attention import get_backend
    backend = get_backend(cfg.kernel)
    C = cfg.context_parallel
    if C > 1:  # the ring: the backend's kernels where they save the logsumexp, else torch math per piece in fp32
        return 0 if backend.saves_lse else cfg.batch * heads_per_rank(cfg, world, rank) * (cfg.seq_len // C) ** 2 * 4
    if not backend.materializes_scores:
        return 0
    return cfg.batch * heads_per_rank(cfg, world, rank) * cfg.seq_len ** 2 * cfg.elem_size


def estimate(cfg: Config, world: int, rank: int) -> int:
    a, b, c = coefficients(cfg, world, rank)
    n = cfg.seq_len
    return int(a * n * n + b * n + c)


def largest_n(cfg: Config, world: int, rank: int, free: int) -> int:
    a, b, c = coefficients(cfg, world, rank)
    budget = free * HEADROOM - c
    if budget <= 0:
        return 0
    if a == 0:
        return int(budget / b)
    return int((-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a))


def host_available() -> int | None:
    """Bytes of host memory available for new allocations (Linux's MemAvailable), or None where
    /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def held_for_certain(cfg: Config, world: int, rank: int, free: int, sharing: int = 1) -> None:
    """A CPU run's check of what it holds whatever the allocator does: this rank's weights (W_q, W_o of
    its heads, W_k, W_v of its K/V heads) and, with --decode T, its K/V cache of N + T rows, the N + T
    rows in and out, their rotary tables, and the check's forward over all of them (its S and P, where
    the kernel writes them); refused in one line naming the fix when they do not fit `free` bytes
    (HEADROOM of them)."""
    import dataclasses
    el, d, D, B, N = cfg.elem_size, cfg.head_dim, cfg.model_dim, cfg.batch, cfg.seq_len
    h, g = heads_per_rank(cfg, world, rank), kv_heads_per_rank(cfg, world, rank)
    weights = weight_bytes(cfg, world, rank)
    budget = free * HEADROOM
    where = (f"but {free / 2**30:.1f} GiB of memory is available"
             + (f" (its share of this node's, {sharing} ranks)" if sharing > 1 else " on this node"))
    if weights > budget:
        raise ConfigError(f"--heads {cfg.heads} --head-dim {d} need {weights / 2**30:.1f} GiB of weights on rank "
                          f"{rank} (model dim {D}) {where}; use fewer --heads or a smaller --head-dim"
                          + (", or more ranks" if h > 1 else ""))
    if not cfg.decode:
        return
    per_token = kv_token_bytes(g, d, el, cfg.kv_dtype == "fp8")

    def need(T: int) -> int:
        # the cache of N + T rows; x, the steps' y and their concatenation, and the rotary tables of as many
        # rows; the check's forward over them all (its S and P, where its kernel writes them)
        rows = N + T
        full = 2 * scores_bytes(dataclasses.replace(cfg, seq_len=rows, decode=0), world, rank) if cfg.check else 0
        return weights + B * rows * (per_token + 3 * D * el) + rows * 2 * d * 4 + T * STEP_OBJECT_BYTES + full
    if need(cfg.decode) <= budget:
        return
    lo, hi = 0, cfg.decode  # the largest T that fits: need() grows with T
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid - 1)
    fix = f"the largest --decode that fits is about {lo}" if lo >= 1 else "use a smaller --batch or --seq-len"
    if cfg.check and scores_bytes(cfg, world, rank):
        fix += " (the check's forward writes the scores of all N + T rows; --no-check drops it)"
    what = "its K/V cache, rows" + (" and check" if cfg.check else "")
    raise ConfigError(f"--decode {cfg.decode} needs about {need(cfg.decode) / 2**30:.1f} GiB on rank {rank} ({what} "
                      f"over --seq-len + --decode rows) {where}; {fix}")


def _largest_batch(cfg: Config, fits) -> int:
    """The largest batch up to cfg.batch for which fits(cfg at that batch) holds (0: not even one)."""
    lo, hi = 0, cfg.batch
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(dataclasses.replace(cfg, batch=mid)):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _at_batch(cfg: Config) -> str:
    return f" at --batch {cfg.batch}" if cfg.batch > 1 else ""


def _or_batch(cfg: Config, fit_b: int) -> str:
    """The batch that would fit at this --seq-len, where a smaller batch is the fix (the batch scales S, P
    and the activations)."""
    return f", or at this --seq-len the largest --batch that fits is about {fit_b}" if cfg.batch > 1 and fit_b else ""


def preflight(cfg: Config, world: int, rank: int, free: int, sharing: int = 1, host: bool = False) -> None:
    """Refuse, in one line, a run whose estimate does not fit `free` bytes (with `sharing` ranks on
    one GPU, this rank's share of its free memory; host: a CPU run, `free` its share of the host's
    available memory: the estimate, made for a GPU's allocator, runs 4-5x over a CPU run's peak, so
    there only S and P, which the run certainly holds, are checked)."""
    sp_bytes = 2 * scores_bytes(cfg, world, rank)
    if host:
        held_for_certain(cfg, world, rank, free, sharing)
        if sp_bytes > free * HEADROOM:
            fit = int(math.sqrt(free * HEADROOM / (sp_bytes / cfg.seq_len ** 2)))
            fit_b = _largest_batch(cfg, lambda c: 2 * scores_bytes(c, world, rank) <= free * HEADROOM)
            raise ConfigError(f"--seq-len {cfg.seq_len}{_at_batch(cfg)} needs more than {sp_bytes / 2**30:.1f} GiB on "
                              f"rank {rank} (S and P alone) but {free / 2**30:.1f} GiB of memory is available"
                              + (f" (its share of this node's, {sharing} ranks)" if sharing > 1 else " on this node")
                              + f"; the largest --seq-len that could fit is about {fit}" + _or_batch(cfg, fit_b)
                              + (" (or use more ranks)" if heads_per_rank(cfg, world, rank) > 1 else ""))
        return
    need = estimate(cfg, world, rank)
    if need > free * HEADROOM:
        fit = largest_n(cfg, world, rank, free)
        sp = f"(S and P alone {sp_bytes / 2**30:.1f} GiB) " if sp_bytes else ""
        share = f" (its share of a GPU that {sharing} ranks share)" if sharing > 1 else ""
        hints = []
        if heads_per_rank(cfg, world, rank) > 1:
            hints.append("use more ranks")
        if (cfg.context_parallel == 1 and world > 1 and cfg.kernel in ("fused", "triton") and not cfg.decode
                and not cfg.sequence_parallel):
            hints.append("--context-parallel, which divides the sequence")
        more = f" (or {', or '.join(hints)})" if hints else ""
        fit_b = _largest_batch(cfg, lambda c: estimate(c, world, rank) <= free * HEADROOM)
        raise ConfigError(f"--seq-len {cfg.seq_len}{_at_batch(cfg)} needs about {need / 2**30:.1f} GiB on rank {rank} "
                          f"{sp}but {free / 2**30:.1f} GiB is free{share}; the largest --seq-len that fits is about {fit}"
                          + _or_batch(cfg, fit_b) + more)
