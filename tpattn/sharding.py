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


# ---- grouped-query attention: fewer K/V heads than query heads --------------------------------
# Query head q uses K/V head q // (H / G). Over W ranks (W divides H) the K/V heads are either split
# (W divides G: rank r owns K/V heads [r*G/W, (r+1)*G/W), exactly those its H/W query heads use) or
# replicated (W a multiple of G: the H/W query heads of a rank all use one K/V head, of which
# W/G ranks each hold a copy). Any other W would need a rank to hold part of a K/V head's query
# heads and part of another's: refused.

def kv_world_sizes(heads: int, kv_heads: int) -> list[int]:
    """The world sizes over which H query heads and G K/V heads can be laid out."""
    return [w for w in divisors(heads) if kv_heads % w == 0 or w % kv_heads == 0]


def check_kv_heads(heads: int, kv_heads: int, world: int) -> str | None:
    """None when G K/V heads serve H query heads and both lay out over `world` ranks, else a
    one-line fix (for G = H, multi-head attention, check_divisible's)."""
    if kv_heads < 1 or kv_heads > heads or heads % kv_heads:
        ok = ", ".join(str(k) for k in divisors(heads))
        return (f"--kv-heads {kv_heads} is not a divisor of --heads {heads} (every K/V head serves the same "
                f"number of query heads); use --kv-heads in {{{ok}}}")
    if kv_heads == heads:
        return check_divisible(heads, world)
    if world in kv_world_sizes(heads, kv_heads):
        return None
    ok = ", ".join(str(w) for w in kv_world_sizes(heads, kv_heads))
    if world > heads:
        why = f"world size {world} is larger than --heads {heads}: every rank needs at least one query head"
    elif heads % world:
        why = f"--heads {heads} is not divisible by world size {world}"
    else:
        why = (f"world size {world} neither divides --kv-heads {kv_heads} (each rank owning {kv_heads}/{world} "
               f"of them) nor is a multiple of it (each rank holding a copy of one)")
    return f"{why}; with --kv-heads {kv_heads} run with a world size in {{{ok}}} or change --kv-heads"


def kv_replicated(heads: int, kv_heads: int, world: int) -> bool:
    """True when each K/V head is held by several ranks (more ranks than K/V heads)."""
    return world > kv_heads


def kv_head_range(heads: int, kv_heads: int, world: int, rank: int) -> range:
    """The K/V heads rank r holds: its G/W own heads, or (replicated) the one its query heads use."""
    err = check_kv_heads(heads, kv_heads, world)
    if err:
        raise ValueError(err)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world size {world}")
    if kv_heads % world == 0:
        g = kv_heads // world
        return range(rank * g, (rank + 1) * g)
    first = head_range(heads, world, rank).start // (heads // kv_heads)
    return range(first, first + 1)


def row_chunks(n: int, chunks: int, align: int = 1) -> list[tuple[int, int]]:
    """`chunks` nearly equal ranges of the rows [0, n), cut at multiples of `align` (empty ones dropped)."""
    cuts = sorted({min(n, round(n * c / chunks / align) * align) for c in range(chunks + 1)} | {n})
    return [(r0, r1) for r0, r1 in zip(cuts, cuts[1:]) if r1 > r0]
