"""Where this engine's pieces and DCP's chunks meet: a flat range of a parameter as N-D
rectangles (what DCP records), an N-D chunk as flat runs (what this engine's pieces are), and the
keys of torchtitan's layout (``model.<fqn>``, ``optimizer.state.<fqn>.<key>``,
``optimizer.param_groups.<fqn>.<option>``).

A flat range of a tensor of shape ``(d0, d1, ...)`` is a partial row, full rows and a partial
row, each partial row the same again one dimension down: at most ``2 * ndim - 1`` rectangles
(three for a matrix), each contiguous in the flat order, so each is a slice of the piece. A
chunk DCP holds (FSDP2's rows, a tensor-parallel column block) is back-to-back runs of the
flat order: one run for FSDP2's row blocks, one per row for a column block.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..sharding.units.param_placement import flat_boxes

MODEL, STATE, GROUPS = "model.", "optimizer.state.", "optimizer.param_groups."


class Rectangle(NamedTuple):
    offsets: tuple[int, ...]  # where it starts in the whole tensor, per dimension
    sizes: tuple[int, ...]
    lo: int  # the elements it holds: [lo, hi) of the flat range it was cut from
    hi: int


class Run(NamedTuple):
    start: int  # first element in the whole flattened tensor
    within: int  # first element in the chunk's own flat order
    numel: int


def rectangles(shape: tuple[int, ...], start: int, numel: int) -> list[Rectangle]:
    """Elements ``[start, start + numel)`` of a tensor of ``shape``, flattened, as rectangles in
    order (`param_placement.flat_boxes`; their ``lo``/``hi`` relative to ``start``)."""
    out, lo = [], 0
    for box in flat_boxes(shape, start, numel):
        count = math.prod(box.sizes)
        out.append(Rectangle(tuple(box.offsets), tuple(box.sizes), lo, lo + count))
        lo += count
    return out


def runs(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[Run]:
    """The chunk at ``offsets`` of ``sizes`` in a tensor of ``shape`` as runs of the flat order."""
    if not shape:
        return [Run(0, 0, 1)]
    if any(size == 0 for size in sizes):
        return []
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    # the last dimension the chunk does not span whole: a run spans it and everything after
    split = max((d for d in range(len(shape)) if sizes[d] != shape[d]), default=0)
    length = sizes[split] * strides[split]
    out = []
    for index, outer in enumerate(_positions(sizes[:split])):
        start = sum((offsets[d] + outer[d]) * strides[d] for d in range(split)) + offsets[split] * strides[split]
        out.append(Run(start, index * length, length))
    return out


def _positions(sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every index of a block of ``sizes``, in row-major order (one empty index for none)."""
    positions: list[tuple[int, ...]] = [()]
    for size in sizes:
        positions = [(*p, i) for p in positions for i in range(size)]
    return positions


def state_key(fqn: str) -> tuple[str, str] | None:
    """``optimizer.state.<name>.<key>`` as (name, key); None for another key."""
    if not fqn.startswith(STATE):
        return None
    name, _, key = fqn[len(STATE):].rpartition(".")
    return (name, key) if name else None


def option_key(fqn: str) -> tuple[str, str] | None:
    """``optimizer.param_groups.<name>.<option>`` as (name, option); None for another key."""
    if not fqn.startswith(GROUPS):
        return None
    name, _, option = fqn[len(GROUPS):].rpartition(".")
    return (name, option) if name else None
