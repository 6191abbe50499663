"""The mesh: how the ranks are laid out, as named axes, and how many ranks each use counts.

A mesh is an ordered list of named axes, outermost first, each with a degree; a rank's place on
each axis is its row-major coordinate (the last axis varies fastest, so its ranks are
neighbours). The engine lays out three (`AXES`):

- ``replicate``: groups holding the same shards (hybrid sharding,
  ``zero_optimization.shard_group_size``: one shard group per node, replicated across nodes,
  FSDP's HYBRID_SHARD);
- ``shard``: the data-parallel ranks a shard group adds besides its sequence ranks;
- ``expert``: ranks that own different experts of every mixture-of-experts block and send each
  other tokens (``expert_parallel_size``, only when above 1), consecutive as DeepSpeed-MoE lays
  them out; each still reads its own samples;
- ``sequence``: ranks that read the same samples and split each sequence between them (Ulysses,
  ``sequence_parallel_size``), consecutive as DeepSpeed lays them out: the all-to-all is the
  most bandwidth-hungry collective, neighbours share a node.

A *use* is a set of axes named by what the ranks along them share (`USES`, torchtitan's
``ParallelDims`` names its meshes the same way: "batch", "loss", "fsdp"); an axis is a use of
itself. Code outside `comm/` that needs a count of ranks asks the mesh by use, never the world
size:

- ``world``: every axis (agreements, control traffic, a checkpoint's rank files);
- ``batch``: every axis but those that split a sample: the ranks that read different samples
  (``train_batch_size = micro x accumulation x batch``, samplers, samples per second) and what
  summed gradients are divided by (``grad_divisor``: one micro-batch mean from each);
- ``zero``: the ranks a sharded state is split over (``shard`` x ``expert`` x ``sequence``: ZeRO
  shards over sequence ranks too, as DeepSpeed does; a sequence group's gradients are summed,
  each rank's loss being its slice's share);
- ``replicate``, ``sequence``: the axes themselves.

`groups(use)`, `group_of(use, rank)`, `rank_in(use, rank)` and `size(use)` answer for any use
or axis, so a new axis (experts, tensor parallelism) is a name in the mesh and, where it is
shared by a use, a line in `USES`. `from_config` builds the mesh without processes (validate,
estimate, the samplers); `connect` makes the process groups from it (`COMMUNICATORS`).

A parameter cut along an axis (an expert, owned by one rank of each ``expert`` group) is held
by the ranks of `without` that axis: the same layout with the axis left out, whose ``zero``
ranks split its state and whose ``world`` reduces it (`groups_along` answers for any set of
axes, in the full mesh's global ranks).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..config import ZeroEngineConfig
from ..errors import ConfigError

AXES = ("replicate", "shard", "expert", "sequence")  # the engine's layout, outermost first
SPLIT_A_SAMPLE = frozenset({"sequence", "tensor"})  # axes whose ranks read the same samples
USES: dict[str, tuple[str, ...]] = {
    "zero": ("shard", "expert", "sequence"),  # the ranks a sharded state is split over
}
# The groups `connect` makes, in this order on every rank: (use, communicator role, a
# communicator of its own even when the use spans the world). A use of one rank needs none; one
# spanning the world is the data group itself unless it needs its own (the sequence group's
# all-to-alls are waited inside forward and backward: on the data group they would have to
# interleave alike on every rank with gathers and reductions whose order follows each rank's
# data, GPU review R1; the expert group's token exchanges likewise). An axis of the mesh not
# named here gets a group of its own, by its name.
COMMUNICATORS = (
    ("zero", "data", False), ("replicate", "data", False), ("sequence", "sequence", True), ("expert", "expert", True),
)


def check_experts_fit(expert: int, world_size: int) -> None:
    """``expert_parallel_size`` must divide the world: a `ConfigError` naming the key."""
    if world_size % expert:
        raise ConfigError(
            f"expert_parallel_size = {expert} does not divide the world size {world_size}: the ranks are groups "
            f"of {expert} consecutive ranks, each owning its share of every block's experts"
        )


def check_sequence_fits(sequence: int, world_size: int) -> None:
    """``sequence_parallel_size`` must divide the world: a `ConfigError` naming the key."""
    if world_size % sequence:
        raise ConfigError(
            f"sequence_parallel_size = {sequence} does not divide the world size {world_size}: the ranks are "
            f"data-parallel groups of {sequence} consecutive ranks"
        )


@dataclass(frozen=True)
class Mesh:
    """Named axes, outermost first: ``((name, degree), ...)``. An axis not in the mesh has
    degree 1; no axes at all is one rank."""

    axes: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        names = [name for name, _ in self.axes]
        if len(set(names)) != len(names) or not all(isinstance(name, str) and name for name in names):
            raise ValueError(f"mesh axes must have distinct names, not {names}")
        for name, degree in self.axes:
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise ValueError(f"mesh degree {name} must be a positive integer, not {degree!r}")
        clash = set(names) & ({"world", "batch"} | set(USES))
        if clash:
            raise ValueError(f"mesh axes {sorted(clash)} are names of uses")

    @classmethod
    def of(cls, **degrees: int) -> Mesh:
        """The mesh of these axes, in the order given: ``Mesh.of(replicate=2, shard=4)``."""
        return cls(tuple(degrees.items()))

    @classmethod
    def for_world(cls, world_size: int, shard_group_size: int, sequence: int = 1, expert: int = 1) -> Mesh:
        """The engine's layout of ``world_size`` ranks sharded over groups of
        ``shard_group_size`` consecutive ranks, with expert groups of ``expert`` and sequence
        groups of ``sequence`` consecutive ranks inside them (an expert axis only above 1)."""
        if world_size % shard_group_size:
            raise ValueError(f"shard group size {shard_group_size} does not divide the world size {world_size}")
        if shard_group_size % (sequence * expert):
            raise ValueError(f"a shard group of {shard_group_size} ranks does not hold whole groups of {expert} "
                             f"expert x {sequence} sequence ranks")
        inner = {"expert": expert} if expert > 1 else {}
        return cls.of(replicate=world_size // shard_group_size, shard=shard_group_size // (sequence * expert),
                      **inner, sequence=sequence)

    @classmethod
    def from_config(cls, config: ZeroEngineConfig, world_size: int, shard_group_size: int | None = None,
                    local_world_size: int | None = None) -> Mesh:
        """The layout ``config`` asks for on ``world_size`` ranks, without processes (validate,
        estimate, samplers): ``sequence_parallel_size`` and the shard group size
        (``shard_group_size`` when the ranks agreed on one, else the config's for this world),
        checked against the world with a `ConfigError` naming the keys."""
        sequence, expert = config.sequence_parallel_size, config.expert_parallel_size
        check_sequence_fits(sequence, world_size)
        check_experts_fit(expert, world_size)
        if shard_group_size is None:
            shard_group_size = config.zero_optimization.shard_group_size_for(world_size, local_world_size)
        if shard_group_size % sequence:
            raise ConfigError(
                f"sequence_parallel_size = {sequence} does not divide zero_optimization.shard_group_size "
                f"{shard_group_size}: a sequence group must lie inside one shard group"
            )
        if shard_group_size % (expert * sequence):
            raise ConfigError(
                f"expert_parallel_size = {expert} does not divide zero_optimization.shard_group_size "
                f"{shard_group_size}: an expert group must lie inside one shard group"
            )
        return cls.for_world(world_size, shard_group_size, sequence, expert)

    # -- axes and uses -----------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    def degree(self, axis: str) -> int:
        """The degree of one axis (1 when the mesh has no such axis)."""
        return dict(self.axes).get(axis, 1)

    def axes_of(self, use: str) -> tuple[str, ...]:
        """The axes of this mesh a use or axis spans, in mesh order."""
        if use == "world":
            wanted = set(self.names)
        elif use == "batch":
            wanted = set(self.names) - SPLIT_A_SAMPLE
        else:
            wanted = set(USES.get(use, (use,)))
        return tuple(name for name in self.names if name in wanted)

    def size(self, use: str) -> int:
        """How many ranks a group of ``use`` holds."""
        return math.prod(self.degree(axis) for axis in self.axes_of(use))

    def without(self, axis: str) -> Mesh:
        """This layout with ``axis`` left out: the layout of the ranks that hold the same part of
        a parameter cut along it (its groups, in this mesh's ranks: `groups_along`)."""
        return Mesh(tuple((name, degree) for name, degree in self.axes if name != axis))

    def groups(self, use: str) -> list[tuple[int, ...]]:
        """The global ranks of each group of ``use`` (the ranks that differ only along its
        axes), groups and ranks in row-major order: every group is made in this order on every
        rank."""
        return self.groups_along(self.axes_of(use))

    def groups_along(self, axes: tuple[str, ...] | set[str]) -> list[tuple[int, ...]]:
        """The global ranks of each group of ranks that differ only along ``axes`` (`groups`)."""
        inside = set(axes)
        outside = [range(degree) for name, degree in self.axes if name not in inside]
        along = [range(degree) for name, degree in self.axes if name in inside]
        found = []
        for fixed in itertools.product(*outside):
            group = []
            for varying in itertools.product(*along):
                coords, fixed_at, varying_at = [], iter(fixed), iter(varying)
                for name, _ in self.axes:
                    coords.append(next(varying_at) if name in inside else next(fixed_at))
                group.append(self._rank_at(coords))
            found.append(tuple(group))
        return found

    def group_of(self, use: str, rank: int) -> tuple[int, ...]:
        """The global ranks of ``rank``'s group of ``use`` (itself included)."""
        return self.groups(use)[self.group_index(use, rank)]

    def rank_in(self, use: str, rank: int) -> int:
        """``rank``'s place in its group of ``use``."""
        return self._index(rank, set(self.axes_of(use)))

    def group_index(self, use: str, rank: int) -> int:
        """Which of `groups(use)` holds ``rank``."""
        return self.group_index_along(self.axes_of(use), rank)

    def group_index_along(self, axes: tuple[str, ...] | set[str], rank: int) -> int:
        """Which of `groups_along(axes)` holds ``rank``."""
        return self._index(rank, set(self.names) - set(axes))

    def rank_along(self, axes: tuple[str, ...] | set[str], rank: int) -> int:
        """``rank``'s place in its group of `groups_along(axes)`."""
        return self._index(rank, set(axes))

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s place on each axis."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not in a mesh of {self.world} ranks")
        found, rest = {}, rank
        for name, degree in reversed(self.axes):
            found[name], rest = rest % degree, rest // degree
        return {name: found[name] for name in self.names}

    def _rank_at(self, coords: list[int]) -> int:
        rank = 0
        for (_, degree), coord in zip(self.axes, coords):
            rank = rank * degree + coord
        return rank

    def _index(self, rank: int, axes: set[str]) -> int:
        coords, index = self.coordinates(rank), 0
        for name, degree in self.axes:
            if name in axes:
                index = index * degree + coords[name]
        return index

    # -- the counts by use the engine reads --------------------------------------------------

    @cached_property
    def world(self) -> int:
        """Every rank."""
        return self.size("world")

    @cached_property
    def batch(self) -> int:
        """The ranks that read different samples: the data-parallel degree (read per bucket in
        the step: kept)."""
        return self.size("batch")

    @property
    def grad_divisor(self) -> int:
        """What summed gradients are divided by: one micro-batch mean from each rank of `batch`."""
        return self.batch

    def slice_length(self, tokens: int) -> int:
        """The tokens of a sequence of ``tokens`` each rank of a sequence group holds (the last
        rank's slice may be shorter)."""
        return -(-tokens // self.size("sequence"))

    def communicators(self) -> tuple[tuple[str, str, bool], ...]:
        """The groups `connect` makes for this mesh (`COMMUNICATORS`, then one per axis of this
        mesh that no use there names, by its own name), in one order on every rank."""
        named = {axis for use, _, _ in COMMUNICATORS for axis in USES.get(use, (use,))} | {u for u, _, _ in COMMUNICATORS}
        extra = tuple((name, name, True) for name in self.names if name not in named)
        return COMMUNICATORS + extra

    def as_manifest(self) -> dict[str, Any]:
        """What a checkpoint's manifest records of the layout that wrote it (``shard``: the
        ranks a state is split over, as checkpoints have recorded it from the start)."""
        return {"replicate": self.size("replicate"), "shard": self.size("zero"), "sequence": self.size("sequence")}
