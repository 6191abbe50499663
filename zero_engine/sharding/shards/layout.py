"""Partition arithmetic: where each parameter lives in a flat buffer and which rank owns what.

Pure integers, no tensors and no processes, so it is tested exhaustively in one process.

A *unit* is a list of parameters flattened one after another into one buffer. The buffer is
padded at its end to a multiple of the number of shards (the shard group's ranks) and cut into equal, contiguous shards:
rank ``r`` owns ``[r * shard_numel, (r + 1) * shard_numel)``. A parameter may straddle a shard
boundary; its intersection with a rank's shard is a `Segment`, the piece of the parameter that
rank's optimizer updates. Padding belongs to no parameter and is never updated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Segment(NamedTuple):
    """The part of one parameter inside one rank's shard of a unit."""

    param_index: int  # index of the parameter within its unit
    param_offset: int  # first element of the piece, in the flattened parameter
    shard_offset: int  # where the piece starts within the rank's shard
    numel: int


class UnitLayout:
    """Offsets, padding and shards of one flat buffer holding ``param_numels`` in order."""

    def __init__(self, param_numels: Sequence[int], num_shards: int) -> None:
        if num_shards < 1:
            raise ValueError(f"num_shards must be at least 1, got {num_shards}")
        if any(n < 0 for n in param_numels):
            raise ValueError(f"parameter sizes must be non-negative, got {list(param_numels)}")
        self.param_numels = tuple(param_numels)
        self.num_shards = num_shards
        self.param_offsets = tuple(_prefix_sums(self.param_numels))
        self.unpadded_numel = sum(self.param_numels)
        self.shard_numel = -(-self.unpadded_numel // num_shards)
        self.padded_numel = self.shard_numel * num_shards

    @property
    def padding_numel(self) -> int:
        return self.padded_numel - self.unpadded_numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in the padded flat buffer."""
        if not 0 <= rank < self.num_shards:
            raise ValueError(f"rank {rank} is outside {self.num_shards} shards")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def segments(self, rank: int) -> list[Segment]:
        """Each parameter's non-empty intersection with ``rank``'s shard, in buffer order."""
        start, end = self.shard_range(rank)
        pieces = []
        for index, (offset, numel) in enumerate(zip(self.param_offsets, self.param_numels)):
            lo, hi = max(offset, start), min(offset + numel, end)
            if lo < hi:
                pieces.append(Segment(index, lo - offset, lo - start, hi - lo))
        return pieces


def plan_units(param_numels: Sequence[int], max_unit_numel: int) -> list[list[int]]:
    """Group consecutive parameters into units of at most ``max_unit_numel`` elements.

    A parameter larger than the limit gets a unit of its own rather than being split, so every
    parameter is a view into exactly one buffer.
    """
    if max_unit_numel < 1:
        raise ValueError(f"max_unit_numel must be positive, got {max_unit_numel}")
    units: list[list[int]] = []
    current: list[int] = []
    current_numel = 0
    for index, numel in enumerate(param_numels):
        if current and current_numel + numel > max_unit_numel:
            units.append(current)
            current, current_numel = [], 0
        current.append(index)
        current_numel += numel
    if current:
        units.append(current)
    return units


def _prefix_sums(values: Sequence[int]) -> list[int]:
    sums, total = [], 0
    for value in values:
        sums.append(total)
        total += value
    return sums
