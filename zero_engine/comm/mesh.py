"""The mesh: how the ranks are laid out, axis by axis, and how many ranks each use counts.

One shape serves every layout the engine builds: ``replicate`` shard groups of ``shard``
consecutive ranks each. Plain ZeRO is one group of every rank (``replicate=1``); hybrid
sharding (``zero_optimization.shard_group_size``) is one group per node, replicated across
nodes (FSDP's HYBRID_SHARD, a 2-D (replicate, shard) device mesh). The layout is written here
alone; `connect` makes the process groups from it.

Code outside `comm/` that needs a count of ranks asks the mesh by use, never the world size:

- ``batch``: the ranks that read different samples (the batch arithmetic ``train_batch_size =
  micro x accumulation x batch``, samplers, samples per second);
- ``grad_divisor``: what the summed gradients are divided by to give the mean over the global
  batch (every rank that read samples contributes one micro-batch's mean);
- ``shard``: the ranks a sharded state is split over; ``replicate``: the groups holding the same
  shards;
- ``world``: every rank (agreements, control traffic, a checkpoint's rank files).

A third degree, ``sequence`` (Ulysses sequence parallelism, ``sequence_parallel_size``), groups
``sequence`` consecutive ranks (as DeepSpeed lays them out: the all-to-all is the most
bandwidth-hungry collective, neighbours share a node) that read the same samples and split each
sequence between them: they count in ``world`` and not in ``batch``. ZeRO shards over every
rank, sequence ranks included, as DeepSpeed does; the gradients of a sequence group are summed
(each rank's loss is its slice's share of the micro-batch's), and the sum over every rank is
divided by ``batch`` (torchtitan's ``ParallelDims`` names its meshes by use the same way:
"batch", "loss", "fsdp").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Mesh:
    """``replicate`` groups of ``shard`` consecutive ranks: group ``g`` is ranks
    ``[g shard, (g + 1) shard)``; a rank's replicas are the ranks at its place in every group."""

    replicate: int = 1
    shard: int = 1
    sequence: int = 1  # ranks that split one sequence (consecutive); 1: none

    def __post_init__(self) -> None:
        for axis in ("replicate", "shard", "sequence"):
            degree = getattr(self, axis)
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise ValueError(f"mesh degree {axis} must be a positive integer, not {degree!r}")
        if self.shard % self.sequence:
            raise ValueError(f"a shard group of {self.shard} ranks does not hold whole sequence groups of "
                             f"{self.sequence}")

    @classmethod
    def for_world(cls, world_size: int, shard_group_size: int, sequence: int = 1) -> Mesh:
        """The mesh of ``world_size`` ranks sharded over groups of ``shard_group_size``, with
        sequence groups of ``sequence`` consecutive ranks inside them."""
        if world_size % shard_group_size:
            raise ValueError(f"shard group size {shard_group_size} does not divide the world size {world_size}")
        return cls(replicate=world_size // shard_group_size, shard=shard_group_size, sequence=sequence)

    @property
    def world(self) -> int:
        """Every rank."""
        return self.replicate * self.shard

    @property
    def batch(self) -> int:
        """The ranks that read different samples: the data-parallel degree."""
        return self.replicate * self.shard // self.sequence

    @property
    def grad_divisor(self) -> int:
        """What summed gradients are divided by: one micro-batch mean from each rank of `batch`."""
        return self.batch

    def shard_groups(self) -> list[range]:
        """The global ranks of each shard group, in group order."""
        return [range(g * self.shard, (g + 1) * self.shard) for g in range(self.replicate)]

    def replica_groups(self) -> list[range]:
        """The global ranks of each replica group (one per place in a shard group)."""
        return [range(place, self.world, self.shard) for place in range(self.shard)]

    def sequence_groups(self) -> list[range]:
        """The global ranks of each sequence group: ``sequence`` consecutive ranks."""
        return [range(g * self.sequence, (g + 1) * self.sequence) for g in range(self.world // self.sequence)]

    def batch_rank(self, rank: int) -> int:
        """Which of the `batch` data-parallel ranks ``rank`` reads the samples of."""
        return rank // self.sequence

    def shard_group_of(self, rank: int) -> range:
        return self.shard_groups()[rank // self.shard]

    def replica_group_of(self, rank: int) -> range:
        return self.replica_groups()[rank % self.shard]

    def as_manifest(self) -> dict[str, Any]:
        """What a checkpoint's manifest records of the layout that wrote it."""
        return {"replicate": self.replicate, "shard": self.shard, "sequence": self.sequence}
