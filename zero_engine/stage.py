"""A ZeRO stage as a small value object: which states are sharded, decided once.

`initialize` looks the stage up once, in `STAGES`, and everything else takes the `Stage` (never
its number): the mechanism composes shared parts from it (`zero_engine.sharding.building.build`), the
units take its `UnitSpec`, and the formula, offload, the optimizer check and the process groups
ask it what they need. Stage 3 adds sharded parameters: units become modules whose parameters
are gathered around their use (`zero_engine.sharding.gathering.gatherer`).

A leaf module (it imports only the config), so that every layer may take a `Stage`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple



class UnitSpec(NamedTuple):
    """What a stage makes of a unit (`zero_engine.sharding.units.unit.FlatUnit`)."""

    shard_master: bool  # its optimizer owns this rank's shard (else the whole unit: stage 0)
    full_grads: bool  # full gradients persist in a flat buffer (else they pass through buckets into the shard)
    releases_grad: bool  # its gradient shard exists only from a backward to the step (stage 3)


@dataclass(frozen=True)
class Stage:
    level: int
    shard_optimizer_state: bool  # the optimizer updates only this rank's pieces, then all-gather
    shard_gradients: bool  # only this rank's gradient shard persists
    shard_parameters: bool  # parameters exist in full only while their unit is gathered
    summary: str

    def streams_gradients(self, each_micro_step: bool) -> bool:
        """Gradients pass through buckets into the shard every micro-step (stage 2's default,
        always at stage 3, where no full gradient can persist because no full parameter does);
        otherwise full gradients persist and are reduced once per accumulation window.
        ``each_micro_step``: ``zero_optimization.reduce_scatter_each_micro_step``."""
        return self.shard_parameters or (self.shard_gradients and each_micro_step)

    @property
    def releases_gradients(self) -> bool:
        """Gradient shards and buckets exist only from a window's backward to its optimizer
        step (as FSDP2's ``zero_grad(set_to_none=True)``): at stage 3 the forward and the
        backward hold gathered units, and the step's high-water mark must not hold both."""
        return self.shard_parameters

    @property
    def live_grad_buckets(self) -> int:
        """Gradient buckets alive at once in backward: one filling while one reduces at stage 2;
        at stage 3 the running and the prefetched unit take that room, so a bucket waits for the
        previous reduction (see "Stage 3 memory" in ``docs/architecture.md``)."""
        return 1 if self.shard_parameters else 2

    def unit_spec(self, each_micro_step: bool) -> UnitSpec:
        return UnitSpec(self.shard_optimizer_state, not self.streams_gradients(each_micro_step), self.releases_gradients)


STAGES: dict[int, Stage] = {
    0: Stage(0, False, False, False, "replicated data parallelism (all-reduce)"),
    1: Stage(1, True, False, False, "optimizer state sharded (reduce-scatter + all-gather)"),
    2: Stage(2, True, True, False, "optimizer state and gradients sharded (reduce-scatter + all-gather)"),
    3: Stage(3, True, True, True, "parameters sharded too (all-gather per unit in forward and backward)"),
}


def stage_for(level: int) -> Stage:
    return STAGES[level]
