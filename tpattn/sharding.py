"""Pure functions: which heads, Q/K/V columns and output-projection rows a rank owns."""

from __future__ import annotations


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def check_divisible(heads: int, world: int) -> str | None:
    """None when `heads` splits evenly over `world` ranks, else a one-line fix."""
    if world > heads:
        return (f"world size {world} is larger than --heads {heads}: every rank needs at least one head; "
                f"use at most {heads} ranks or more heads")
    if heads % world:
        ok = ", ".join(str(k) for k in divisors(heads))
        return (f"--heads {heads} is not divisible by world size {world}; "
                f"run with a world size in {{{ok}}} or change --heads")
    return None


def head_range(heads: int, world: int, rank: int) -> range:
    """Heads [r*h, (r+1)*h) of rank r, h = heads / world."""
    err = check_divisible(heads, world)
    if err:
        raise ValueError(err)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world size {world}")
    h = heads // world
    return range(rank * h, (rank + 1) * h)


def head_columns(heads: range, head_dim: int) -> slice:
    """Columns of W_q/W_k/W_v (and rows of W_o) that belong to a block of heads."""
    return slice(heads.start * head_dim, heads.stop * head_dim)
