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
