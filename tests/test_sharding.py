import pytest

from tpattn.sharding import check_divisible, divisors, head_columns, head_range


def test_head_ranges_tile_the_heads():
    for world in divisors(12):
        got = [h for r in range(world) for h in head_range(12, world, r)]
        assert got == list(range(12))


def test_columns_follow_heads():
    assert head_columns(head_range(32, 8, 3), 128) == slice(12 * 128, 16 * 128)


def test_divisibility_messages():
    assert check_divisible(32, 8) is None
    msg = check_divisible(30, 4)
    assert "not divisible" in msg and "{1, 2, 3, 5, 6, 10, 15, 30}" in msg
    assert "larger than --heads" in check_divisible(4, 8)
    with pytest.raises(ValueError):
        head_range(30, 4, 0)


# ---- uneven heads (--uneven-heads, issue #17) -------------------------------------------------

from tpattn.sharding import (block, check_kv_heads, head_counts, heads_by_rank, kv_head_range,  # noqa: E402
                             kv_world_sizes)


def test_uneven_blocks_are_contiguous_ceil_then_floor():
    for heads, world, want in ((28, 8, [4, 4, 4, 4, 3, 3, 3, 3]), (6, 4, [2, 2, 1, 1]), (5, 2, [3, 2]),
                               (3, 2, [2, 1]), (7, 7, [1] * 7), (32, 8, [4] * 8)):
        assert head_counts(heads, world) == want == heads_by_rank(heads, world, uneven=True)
        got = [h for r in range(world) for h in head_range(heads, world, r, uneven=True)]
        assert got == list(range(heads))
        assert [len(block(heads, world, r)) for r in range(world)] == want
    assert [head_range(28, 8, r, uneven=True) for r in (3, 4, 7)] == [range(12, 16), range(16, 19), range(25, 28)]
    # the flag changes nothing where the world size divides the heads
    assert [head_range(12, 4, r, uneven=True) for r in range(4)] == [head_range(12, 4, r) for r in range(4)]


def test_uneven_refusals():
    msg = check_divisible(28, 8)
    assert msg.startswith("--heads 28 is not divisible by world size 8")
    assert "or pass --uneven-heads (ranks 0-3 own 4 heads, ranks 4-7 3)" in msg
    assert "rank 0 owns 3 heads, rank 1 2" in check_divisible(5, 2)
    assert check_divisible(28, 8, uneven=True) is None
    for uneven in (False, True):  # more ranks than heads stays refused
        assert "larger than --heads 4" in check_divisible(4, 8, uneven)
        assert "--uneven-heads" not in check_divisible(4, 8, uneven)
        with pytest.raises(ValueError, match="larger than --heads 3"):
            head_range(3, 4, 0, uneven=uneven)


def test_uneven_gqa_splits_whole_groups():
    """With G K/V groups of H/G query heads: ranks own ceil/floor(G/W) whole groups, never half a
    group; every rank's K/V heads are exactly those its query heads use."""
    for H, G, W in ((12, 4, 3), (18, 9, 8), (10, 5, 4), (6, 3, 2), (28, 4, 3), (32, 8, 3), (28, 28, 8)):
        assert check_kv_heads(H, G, W, uneven=True) is None
        s = H // G
        counts = head_counts(G, W)
        q = [head_range(H, W, r, uneven=True, kv_heads=G) for r in range(W)]
        kv = [kv_head_range(H, G, W, r, uneven=True) for r in range(W)]
        assert [h for rg in q for h in rg] == list(range(H))
        assert [len(rg) for rg in q] == [c * s for c in counts] and [len(k) for k in kv] == counts
        for rg, k in zip(q, kv):
            assert {h // s for h in rg} == set(k) and rg.start % s == 0 and rg.stop % s == 0
    # where the even rules already lay it out, the flag changes nothing (split or replicated)
    for H, G, W in ((32, 8, 4), (8, 2, 4), (8, 1, 8)):
        assert W in kv_world_sizes(H, G)
        assert [kv_head_range(H, G, W, r, True) for r in range(W)] == [kv_head_range(H, G, W, r) for r in range(W)]
        assert [head_range(H, W, r, True, G) for r in range(W)] == [head_range(H, W, r) for r in range(W)]


def test_uneven_gqa_refusals():
    # without the flag: refused as before, and the flag is named where it would help (W <= G)
    msg = check_kv_heads(12, 4, 3)
    assert "neither divides --kv-heads 4" in msg and "{1, 2, 4, 12}" in msg
    assert msg.endswith("or pass --uneven-heads (whole K/V groups per rank: rank 0 owns 2 groups, ranks 1-2 1)")
    assert "--uneven-heads" not in check_kv_heads(8, 2, 3)  # W > G: the flag would not help
    # with the flag, more ranks than K/V groups (and not the replicated layout): one line, the fix
    msg = check_kv_heads(8, 2, 3, uneven=True)
    assert msg.startswith("--uneven-heads splits whole K/V groups (4 query heads and their K/V head)")
    assert "world size 3 is more than the 2 groups of --kv-heads 2" in msg and "{1, 2, 4, 8}" in msg
    assert "larger than --heads 8" in check_kv_heads(8, 1, 16, uneven=True)
    with pytest.raises(ValueError, match="more than the 2 groups"):
        kv_head_range(8, 2, 3, 0, uneven=True)
