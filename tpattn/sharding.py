"""Pure functions: which heads, Q/K/V columns and output-projection rows a rank owns."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError, is_count


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def head_counts(n: int, parts: int) -> list[int]:
    """n split into `parts` contiguous blocks as evenly as it goes: the first n mod parts blocks get
    ceil(n/parts), the rest floor(n/parts)."""
    q, m = divmod(n, parts)
    return [q + (r < m) for r in range(parts)]


def block(n: int, parts: int, r: int) -> range:
    """Block r of head_counts(n, parts): [r*q + min(r, m), ... + q + (r < m))."""
    q, m = divmod(n, parts)
    start = r * q + min(r, m)
    return range(start, start + q + (r < m))


def _ranks(a: int, b: int) -> str:
    return f"rank {a}" if a == b else f"ranks {a}-{b}"


def describe_blocks(counts: list[int], what: str = "", notes: tuple[str, str] = ("", "")) -> str:
    """'ranks 0-3 own 4 heads, ranks 4-7 3': uneven blocks in head_counts' order (the larger first),
    with an optional note after each count."""
    k, last = counts.count(counts[0]), len(counts) - 1
    unit = f" {what}" if what else ""
    return (f"{_ranks(0, k - 1)} {'owns' if k == 1 else 'own'} {counts[0]}{unit}{notes[0]}, "
            f"{_ranks(k, last)} {counts[-1]}{notes[1]}")


def _uneven_hint(n: int, world: int, what: str = "heads") -> str:
    """What --uneven-heads would do, e.g. 'ranks 0-1 own 3 heads, ranks 2-3 2'."""
    return describe_blocks(head_counts(n, world), what)


def check_divisible(heads: int, world: int, uneven: bool = False) -> str | None:
    """None when `heads` splits over `world` ranks (evenly, or with `uneven` into blocks of
    ceil/floor(heads/world)), else a one-line fix."""
    if world > heads:
        return (f"world size {world} is larger than --heads {heads}: every rank needs at least one head; "
                f"use at most {heads} ranks or more heads")
    if heads % world and not uneven:
        ok = ", ".join(str(k) for k in divisors(heads))
        return (f"--heads {heads} is not divisible by world size {world}; "
                f"run with a world size in {{{ok}}}, change --heads, or pass --uneven-heads "
                f"({_uneven_hint(heads, world)})")
    return None


def head_range(heads: int, world: int, rank: int, uneven: bool = False, kv_heads: int | None = None) -> range:
    """The query heads of rank r: contiguous blocks of whole K/V groups (G = kv_heads, default
    heads: one head per group), ceil(G/W) groups on the first G mod W ranks and floor(G/W) on the
    rest (even: G/W each); with fewer ranks than K/V groups (replicated K/V heads) heads/W each."""
    G = heads if kv_heads is None else kv_heads
    err = check_kv_heads(heads, G, world, uneven)
    if err:
        raise ValueError(err)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world size {world}")
    if world <= G:
        groups, s = block(G, world, rank), heads // G
        return range(groups.start * s, groups.stop * s)
    h = heads // world
    return range(rank * h, (rank + 1) * h)


def heads_by_rank(heads: int, world: int, uneven: bool = False, kv_heads: int | None = None) -> list[int]:
    """How many query heads each rank owns (all equal unless uneven)."""
    return [len(head_range(heads, world, r, uneven, kv_heads)) for r in range(world)]


def head_columns(heads: range, head_dim: int) -> slice:
    """Columns of W_q/W_k/W_v (and rows of W_o) that belong to a block of heads."""
    return slice(heads.start * head_dim, heads.stop * head_dim)


# ---- grouped-query attention: fewer K/V heads than query heads --------------------------------
# Query head q uses K/V head q // (H / G). Over W ranks (W divides H) the K/V heads are either split
# (W divides G: rank r owns K/V heads [r*G/W, (r+1)*G/W), exactly those its H/W query heads use) or
# replicated (W a multiple of G: the H/W query heads of a rank all use one K/V head, of which
# W/G ranks each hold a copy). Any other W would need a rank to hold part of a K/V head's query
# heads and part of another's: refused, unless uneven (--uneven-heads) and W <= G: then the ranks
# own contiguous blocks of whole K/V groups (a K/V head and its H/G query heads), ceil(G/W) groups
# on the first G mod W ranks and floor(G/W) on the rest. With W > G and W not a multiple of G
# (or not dividing H) some rank would hold part of a group next to part of another, or the groups'
# shares would differ: still refused.

def kv_world_sizes(heads: int, kv_heads: int) -> list[int]:
    """The world sizes over which H query heads and G K/V heads can be laid out evenly."""
    return [w for w in divisors(heads) if kv_heads % w == 0 or w % kv_heads == 0]


def check_kv_heads(heads: int, kv_heads: int, world: int, uneven: bool = False) -> str | None:
    """None when G K/V heads serve H query heads and both lay out over `world` ranks (with
    `uneven`, also in blocks of whole K/V groups when world <= G), else a one-line fix (for G = H,
    multi-head attention, check_divisible's)."""
    if kv_heads < 1 or kv_heads > heads or heads % kv_heads:
        ok = ", ".join(str(k) for k in divisors(heads))
        return (f"--kv-heads {kv_heads} is not a divisor of --heads {heads} (every K/V head serves the same "
                f"number of query heads); use --kv-heads in {{{ok}}}")
    if kv_heads == heads:
        return check_divisible(heads, world, uneven)
    if world in kv_world_sizes(heads, kv_heads):
        return None
    if uneven and world <= kv_heads:
        return None
    ok = ", ".join(str(w) for w in kv_world_sizes(heads, kv_heads))
    if world > heads:
        why = f"world size {world} is larger than --heads {heads}: every rank needs at least one query head"
    elif uneven:  # world > kv_heads here
        why = (f"--uneven-heads splits whole K/V groups ({heads // kv_heads} query heads and their K/V head) over "
               f"the ranks, and world size {world} is more than the {kv_heads} groups of --kv-heads {kv_heads} "
               f"(a rank would hold part of a group)")
    elif heads % world:
        why = f"--heads {heads} is not divisible by world size {world}"
    else:
        why = (f"world size {world} neither divides --kv-heads {kv_heads} (each rank owning {kv_heads}/{world} "
               f"of them) nor is a multiple of it (each rank holding a copy of one)")
    hint = ""
    if not uneven and world <= kv_heads:
        hint = (f", or pass --uneven-heads (whole K/V groups per rank: "
                f"{_uneven_hint(kv_heads, world, 'groups')})")
    return f"{why}; with --kv-heads {kv_heads} run with a world size in {{{ok}}} or change --kv-heads{hint}"


def kv_replicated(heads: int, kv_heads: int, world: int) -> bool:
    """True when each K/V head is held by several ranks (more ranks than K/V heads)."""
    return world > kv_heads


def kv_head_range(heads: int, kv_heads: int, world: int, rank: int, uneven: bool = False) -> range:
    """The K/V heads rank r holds: its block of the G K/V heads (G/W of them, or with uneven
    ceil/floor(G/W)), or (replicated, W > G) the one its query heads use."""
    err = check_kv_heads(heads, kv_heads, world, uneven)
    if err:
        raise ValueError(err)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world size {world}")
    if world <= kv_heads:
        return block(kv_heads, world, rank)
    first = head_range(heads, world, rank, kv_heads=kv_heads).start // (heads // kv_heads)
    return range(first, first + 1)


def row_chunks(n: int, chunks: int, align: int = 1) -> list[tuple[int, int]]:
    """`chunks` nearly equal ranges of the rows [0, n), cut at multiples of `align` (empty ones dropped)."""
    cuts = sorted({min(n, round(n * c / chunks / align) * align) for c in range(chunks + 1)} | {n})
    return [(r0, r1) for r0, r1 in zip(cuts, cuts[1:]) if r1 > r0]


def rows_split(batch: int, chunks: list[tuple[int, int]], world: int) -> bool:
    """Whether every row chunk's batch x rows divide into `world` equal blocks (what a
    reduce-scatter of the partial outputs needs)."""
    return all(batch * (r1 - r0) % world == 0 for r0, r1 in chunks)


@dataclass(frozen=True)
class Shard:
    """One rank's part of the layer: its query heads and the K/V heads they use, out of H and G."""
    rank: int
    world: int
    heads: int          # H, all of them
    kv_heads: int       # G, all of them
    uneven: bool
    head_range: range   # this rank's query heads
    kv_head_range: range

    @classmethod
    def of(cls, heads: int, kv_heads: int, world: int, rank: int, uneven: bool = False) -> "Shard":
        """Raises ConfigError (a ValueError: one line that names the fix, in the Python API's names,
        and in the CLI's flags as its cli_message) when the heads cannot be laid out."""
        err = check_kv_heads(heads, kv_heads, world, uneven)
        if err:
            raise ConfigError(err)
        return cls(rank, world, heads, kv_heads, uneven, head_range(heads, world, rank, uneven, kv_heads),
                   kv_head_range(heads, kv_heads, world, rank, uneven))

    def describe(self) -> str:
        r, k = self.head_range, self.kv_head_range
        return (f"rank {self.rank} of {self.world}: heads {r.start}-{r.stop - 1} of {self.heads}, "
                f"K/V heads {k.start}-{k.stop - 1} of {self.kv_heads}")


def context_conflict(sequence_parallel: bool = False, decode: bool = False, cuda_graph: bool = False,
                     overlap: int = 1, output_collective: str = "auto", api: int = 0) -> str | None:
    """The first setting that context parallelism cannot go with, as its one-line refusal, or None: in
    the CLI's flags (the CLI's and the cost model's, tpattn.plan), or with api=C in the layer's
    keyword arguments (sharding.check_context; a cache and graphed() are refused where they are
    used)."""
    ctx = f"context_parallel={api}" if api else "--context-parallel"
    for flag, kw, on, why in (
            ("--sequence-parallel", "sequence_parallel=True", sequence_parallel,
             "both split the sequence: choose one"),
            ("--decode", "", decode, "decoding is not a ring workload (one new row a step, the cache read where it "
                                     "is): a KV cache decodes head-parallel; drop --context-parallel"),
            ("--cuda-graph", "", cuda_graph, "the ring's passes are not captured in a graph; drop one of them"),
            ("--overlap", f"overlap={overlap!r}", overlap != 1 if api else overlap > 1,
             "the ring overlaps its own passes with the blocks' attention; drop " + ("overlap (1)" if api else "--overlap")),
            ("--output-collective " + output_collective, f"output_collective={output_collective!r}",
             output_collective in ("p2p", "oneshot"),
             "the heads' partial outputs are summed by NCCL or gloo; use " +
             ("output_collective 'auto', 'allreduce' or 'split'" if api else "--output-collective auto, allreduce or split"))):
        if on:
            return f"{ctx} with {kw if api else flag}: {why}"
    return None


def check_context(context_parallel: int, world: int, sequence_parallel: bool, output_collective: str = "auto",
                  overlap: int = 1) -> int:
    """context_parallel (C ranks in the ring), or one line naming the fix."""
    if not is_count(context_parallel):
        raise ConfigError(f"context_parallel must be a positive int (got {context_parallel!r}); 1 turns it off")
    C = int(context_parallel)
    if world % C:
        ok = ", ".join(str(c) for c in range(1, world + 1) if world % c == 0)
        raise ConfigError(f"context_parallel={C} does not divide the group's {world} ranks (rings of C ranks, the heads "
                          f"split over the W/C rings); use context_parallel in {{{ok}}}")
    if C > 1:
        conflict = context_conflict(sequence_parallel=sequence_parallel, overlap=overlap,
                                    output_collective=output_collective, api=C)
        if conflict:
            raise ConfigError(conflict)
    return C
