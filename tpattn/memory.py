"""Pre-flight memory estimate: what one rank allocates, before it allocates anything."""

from __future__ import annotations

import math

from .check import MAX_ROWS
from .config import Config, ConfigError

HEADROOM = 0.92  # leave room for the CUDA context, cuBLAS workspaces and fragmentation


def coefficients(cfg: Config, world: int, rank: int) -> tuple[float, float, float]:
    """Bytes as a*N^2 + b*N + c for this rank."""
    el, B, H, d = cfg.elem_size, cfg.batch, cfg.heads, cfg.head_dim
    D, h = cfg.model_dim, cfg.heads // world
    red = 4 if cfg.reduce_dtype == "fp32" else el
    score_el = el + (12 if cfg.kernel == "reference" else 0)  # the reference keeps float32 copies
    a = 2 * B * h * score_el                                   # S and P of the heads done at once
    if not scores_bytes(cfg, world):
        a = 0                                                  # fused: S and P stay on chip, O(N) memory
    b = B * (D * el * 2 + 7 * h * d * el + D * red * 2)       # x, y, q/k/v (+ transposes), o, partials
    c = 4 * D * h * d * el                                     # weights (W_o stays in el: tensor cores)
    if cfg.check and rank == 0:
        # the single-process baseline (all heads, same chunk), and the float64 reference
        b += B * (7 * H * d * el + D * red * 2) + B * (3 * D * 8 + 3 * H * MAX_ROWS * 8)
        c += 4 * D * H * d * (el + 8)
    return a, b, c


def scores_bytes(cfg: Config, world: int) -> int:
    """Bytes of S (and as many of P) on one rank; 0 for a kernel that keeps them on chip."""
    from .attention import get_backend
    if not get_backend(cfg.kernel).materializes_scores:
        return 0
    return cfg.batch * (cfg.heads // world) * cfg.seq_len ** 2 * cfg.elem_size


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


def preflight(cfg: Config, world: int, rank: int, free: int) -> None:
    need = estimate(cfg, world, rank)
    if need > free * HEADROOM:
        fit = largest_n(cfg, world, rank, free)
        sp_bytes = 2 * scores_bytes(cfg, world)
        sp = f"(S and P alone {sp_bytes / 2**30:.1f} GiB) " if sp_bytes else ""
        raise ConfigError(f"--seq-len {cfg.seq_len} needs about {need / 2**30:.1f} GiB on rank {rank} {sp}"
                          f"but {free / 2**30:.1f} GiB is free; the largest --seq-len that fits is about {fit}"
                          + (" (or use more ranks)" if cfg.heads // world > 1 else ""))
