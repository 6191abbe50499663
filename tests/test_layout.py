"""Partition arithmetic, exhaustively over small sizes: one process, no tensors."""

from __future__ import annotations

import itertools

import pytest

from zero_engine.sharding.shards.layout import UnitLayout, plan_units

SIZE_LISTS = [[1], [5], [7, 3], [1, 1, 1, 1, 1], [91, 88, 84, 14, 5], [0, 4, 0], [13, 1, 2, 30]]


@pytest.mark.parametrize("sizes, world_size", list(itertools.product(SIZE_LISTS, range(1, 9))))
def test_shards_cover_every_element_once(sizes: list[int], world_size: int) -> None:
    layout = UnitLayout(sizes, world_size)
    assert layout.padded_numel % world_size == 0
    assert 0 <= layout.padding_numel < world_size
    assert layout.padded_numel >= sum(sizes)
    owner: dict[tuple[int, int], int] = {}
    for rank in range(world_size):
        start, end = layout.shard_range(rank)
        assert end - start == layout.shard_numel
        previous_end = 0
        for piece in layout.segments(rank):
            assert piece.numel > 0
            assert previous_end <= piece.shard_offset, "pieces overlap or are out of order"
            previous_end = piece.shard_offset + piece.numel
            assert previous_end <= layout.shard_numel
            flat_start = start + piece.shard_offset
            assert flat_start == layout.param_offsets[piece.param_index] + piece.param_offset
            for element in range(piece.param_offset, piece.param_offset + piece.numel):
                key = (piece.param_index, element)
                assert key not in owner, f"element {key} owned by ranks {owner[key]} and {rank}"
                owner[key] = rank
    expected = {(index, element) for index, numel in enumerate(sizes) for element in range(numel)}
    assert set(owner) == expected


def test_world_size_larger_than_the_unit() -> None:
    layout = UnitLayout([2, 1], 8)
    assert layout.shard_numel == 1 and layout.padded_numel == 8
    assert [len(layout.segments(rank)) for rank in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="num_shards"):
        UnitLayout([3], 0)
    with pytest.raises(ValueError, match="rank 2 is outside 2 shards"):
        UnitLayout([3], 2).shard_range(2)
    with pytest.raises(ValueError, match="max_unit_numel"):
        plan_units([3], 0)


@pytest.mark.parametrize("limit", [1, 3, 10, 100, 1000])
def test_units_keep_order_and_respect_the_limit(limit: int) -> None:
    sizes = [91, 88, 84, 14, 5, 3, 3, 120]
    units = plan_units(sizes, limit)
    assert [i for unit in units for i in unit] == list(range(len(sizes)))
    for unit in units:
        total = sum(sizes[i] for i in unit)
        assert total <= limit or len(unit) == 1
    for left, right in zip(units, units[1:]):
        assert sum(sizes[i] for i in left) + sizes[right[0]] > limit, "a unit was closed early"
