"""Where a planned parameter lies: its global shape, the box of it this rank holds, and how the
optimizer computes on it, decided in the plan (`unit_plan.PlannedParam.placement`).

A parameter is whole on every rank of the plan (``replicated``: everything today), or cut
along a dim over an axis of the mesh (expert parallelism's experts, tensor parallelism's
linears: `ShardedOn`), so this rank holds a *box* of the global tensor (offsets and sizes per
dim, torchtitan's and DCP's chunk). ZeRO's flat sharding then cuts what the rank holds (the
box, flattened) into ranges as it cuts any parameter; a checkpoint saves each range in the
global parameter's coordinates (`global_start`), so one saved at one layout loads at another.

`flat_boxes` turns a flat range of a row-major tensor into the boxes it covers (at most
``2 * dims - 1``; a matrix's range is at most three: a row's tail, whole rows, a row's head),
as a format of rectangular chunks (DCP) needs it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ...comm import Comm
from ...optimizer_kinds import ComputeLayout


class Box(NamedTuple):
    """A rectangular part of a tensor: where it starts and how long it is along each dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def shifted(self, by: Sequence[int]) -> Box:
        return Box(tuple(o + b for o, b in zip(self.offsets, by)), self.sizes)


def flat_boxes(shape: Sequence[int], start: int, numel: int) -> list[Box]:
    """The boxes of a tensor of ``shape`` (row-major) that elements ``[start, start + numel)`` of
    its flattening cover, in flat order: whole rows of the first dim where they can be, the
    partial rows at either end cut further along the next dims."""
    shape = tuple(shape)
    total = math.prod(shape)
    if not (0 <= start and 0 <= numel and start + numel <= total):
        raise ValueError(f"elements [{start}, {start + numel}) are not in a tensor of shape {shape}")
    if numel == 0:
        return []
    if not shape:
        return [Box((), ())]
    row = math.prod(shape[1:])  # elements per index of the first dim
    end = start + numel
    first, last = start // row, (end - 1) // row
    inner = shape[1:]

    def within(index: int, lo: int, hi: int) -> list[Box]:  # part of one row, cut along the next dims
        return [Box((index, *box.offsets), (1, *box.sizes)) for box in flat_boxes(inner, lo, hi - lo)]

    if first == last:
        return within(first, start - first * row, end - first * row)
    boxes, whole_from, whole_to = [], first, last + 1
    if start % row:
        boxes += within(first, start - first * row, row)
        whole_from = first + 1
    if end % row:
        whole_to = last
    if whole_from < whole_to:
        boxes.append(Box((whole_from, *(0,) * len(inner)), (whole_to - whole_from, *inner)))
    if end % row:
        boxes += within(last, 0, end - last * row)
    return boxes


@dataclass(frozen=True)
class ShardedOn:
    """A parameter cut into equal parts along ``dim`` over the mesh axis ``axis``."""

    axis: str
    dim: int


@dataclass(frozen=True)
class Placement:
    """A planned parameter's global shape, the box of it this rank holds, what it is cut along
    (nothing: whole on every rank), and its compute layout."""

    global_shape: tuple[int, ...]
    box: Box
    sharded: tuple[ShardedOn, ...] = ()
    compute: ComputeLayout = ComputeLayout.ELEMENTWISE

    def __post_init__(self) -> None:
        if len(self.box.offsets) != len(self.global_shape) or any(
            o < 0 or o + s > g for o, s, g in zip(self.box.offsets, self.box.sizes, self.global_shape)
        ):
            raise ValueError(f"box {self.box} is not inside a tensor of shape {self.global_shape}")
        if self.sharded and self.compute is ComputeLayout.WHOLE_MATRIX:
            raise NotImplementedError("a whole-matrix optimizer on a parameter cut over an axis is not built")

    @classmethod
    def whole(cls, shape: Sequence[int], compute: ComputeLayout = ComputeLayout.ELEMENTWISE) -> Placement:
        """Whole on every rank of the plan."""
        shape = tuple(shape)
        return cls(shape, Box((0,) * len(shape), shape), (), compute)

    @classmethod
    def cut(
        cls, global_shape: Sequence[int], sharded: Sequence[ShardedOn], coordinates: Mapping[str, int],
        degrees: Mapping[str, int], name: str = "a parameter",
    ) -> Placement:
        """This rank's part (its place on each axis: ``coordinates``, the axes' ``degrees``) of a
        parameter of ``global_shape`` cut as ``sharded`` says, each cut dim divided equally."""
        offsets, sizes = [0] * len(global_shape), list(global_shape)
        for cut in sharded:
            degree = degrees[cut.axis]
            if not 0 <= cut.dim < len(global_shape) or global_shape[cut.dim] % degree:
                raise ValueError(f"{name} of shape {tuple(global_shape)} does not split along dim {cut.dim} into "
                                 f"{degree} equal parts (axis {cut.axis!r})")
            sizes[cut.dim] //= degree
            offsets[cut.dim] += coordinates[cut.axis] * sizes[cut.dim]
        return cls(tuple(global_shape), Box(tuple(offsets), tuple(sizes)), tuple(sharded))

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of what this rank holds."""
        return self.box.sizes

    @property
    def replicated(self) -> bool:
        return not self.sharded

    def global_start(self, local_start: int) -> int:
        """Where element ``local_start`` of this rank's box, flattened, lies in the flattened
        global parameter, the next elements following it: for a box contiguous in the global
        order (whole, or cut along its first dim of more than one index). A box cut along a
        later dim is several global ranges (`global_boxes`): refused by name here."""
        shape, box = self.global_shape, self.box
        partial = next((d for d, (s, g) in enumerate(zip(box.sizes, shape)) if s != g), None)
        if partial is None:
            return local_start
        # one flat range: one index along every dim before the cut one, whole along every dim after
        before, after = box.sizes[:partial], zip(box.sizes[partial + 1:], shape[partial + 1:])
        if math.prod(before) != 1 or any(s != g for s, g in after):
            raise NotImplementedError(
                f"a box {box} of a tensor of shape {shape} is not one flat range of it: save it as boxes (global_boxes)"
            )
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        return sum(o * s for o, s in zip(box.offsets, strides)) + local_start

    def global_boxes(self, local_start: int, numel: int) -> list[Box]:
        """Elements ``[local_start, local_start + numel)`` of this rank's box, flattened, as boxes
        of the global tensor."""
        return [box.shifted(self.box.offsets) for box in flat_boxes(self.box.sizes, local_start, numel)]


class PlacedParams:
    """What a unit answers of its parameters' placements (`placements`, one per parameter),
    and which ranks it is sharded over."""

    placements: list[Placement]
    # The ranks the unit is sharded, reduced and gathered over when not the engine's (the
    # owners of parameters cut along an axis: `Comm.owners_of`); set by the build.
    comm: Comm | None = None

    def sharded_over(self, engine_comm: Comm) -> Comm:
        """The `Comm` this unit's collectives run on: its own (`comm`), else the engine's."""
        return self.comm if self.comm is not None else engine_comm

    @property
    def is_cut(self) -> bool:
        """Whether its parameters are cut along an axis (each rank holds a part: `global_value`)."""
        return any(not placement.replicated for placement in self.placements)

    def global_shape(self, index: int) -> tuple[int, ...]:
        """Parameter ``index``'s shape across every rank (the manifest's, the consolidated one)."""
        return self.placements[index].global_shape

    def global_start(self, index: int, local_start: int) -> int:
        """Where element ``local_start`` of what this rank holds of parameter ``index`` lies in
        the flattened global parameter (`Placement.global_start`)."""
        return self.placements[index].global_start(local_start)
