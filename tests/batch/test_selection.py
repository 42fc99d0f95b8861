"""Shards: a stable hash of the id splits a dataset into N disjoint parts that cover it."""

import pytest

from vlm_catalog.batch.selection import Shard, count_selected, pending_indices, selected_indices


def test_shards_partition_the_dataset():
    for count in (1, 2, 3, 7):
        parts = [list(selected_indices(1000, Shard(index, count))) for index in range(count)]
        union = sorted(index for part in parts for index in part)
        assert union == list(range(1000))  # every id exactly once
        assert all(abs(len(part) - 1000 / count) < 0.2 * 1000 / count for part in parts)  # balanced


def test_shard_membership_depends_on_the_id_only():
    shard = Shard(1, 4)
    assert [shard.contains(str(i)) for i in range(50)] == [Shard(1, 4).contains(str(i)) for i in range(50)]
    # a shard of a longer dataset starts with the same records (stable as data is appended)
    assert list(selected_indices(500, shard))[:20] == list(selected_indices(100, shard))[:20]


def test_limit_and_done_apply_within_the_shard():
    shard = Shard(0, 3)
    first = list(selected_indices(100, shard, limit=5))
    assert len(first) == 5 and count_selected(100, shard, limit=5) == 5
    assert list(pending_indices(100, {first[0], first[2]}, shard, limit=5)) == [first[1], first[3], first[4]]


@pytest.mark.parametrize("text", ["", "1", "3/3", "-1/2", "a/b", "1/0"])
def test_bad_shards_are_named(text):
    with pytest.raises(ValueError, match="--shard"):
        Shard.parse(text)
