"""A ZeRO stage as a small value object: which states are sharded.

The engine looks the stage up once, in `STAGES`, and composes shared machinery from it
(`build_reducer` picks how gradients are held and reduced); no ``if stage == ...`` elsewhere.
Stage 3 adds sharded parameters: units become modules (`zero_engine.sharding.build`) whose parameters
are gathered around their use (`zero_engine.sharding.gatherer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..comm import Comm
from ..config import ZeroOptimizationConfig
from .lifecycle import Lifecycle
from .reducer import AllReduceGrads, FullGradReducer, GradReducer, ReduceScatterGrads, ShardedGradReducer
from .unit import FlatUnit


@dataclass(frozen=True)
class Stage:
    level: int
    shard_optimizer_state: bool  # the optimizer updates only this rank's pieces, then all-gather
    shard_gradients: bool  # only this rank's gradient shard persists
    shard_parameters: bool  # parameters exist in full only while their unit is gathered
    summary: str

    def streams_gradients(self, zero: ZeroOptimizationConfig) -> bool:
        """Gradients pass through buckets into the shard every micro-step (stage 2's default,
        always at stage 3, where no full gradient can persist because no full parameter does);
        otherwise full gradients persist and are reduced once per accumulation window."""
        return self.shard_parameters or (self.shard_gradients and zero.reduce_scatter_each_micro_step)

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


STAGES: dict[int, Stage] = {
    0: Stage(0, False, False, False, "replicated data parallelism (all-reduce)"),
    1: Stage(1, True, False, False, "optimizer state sharded (reduce-scatter + all-gather)"),
    2: Stage(2, True, True, False, "optimizer state and gradients sharded (reduce-scatter + all-gather)"),
    3: Stage(3, True, True, True, "parameters sharded too (all-gather per unit in forward and backward)"),
}


def stage_for(level: int) -> Stage:
    return STAGES[level]


def build_reducer(
    stage: Stage,
    units: Sequence[FlatUnit],
    comm: Comm,
    zero: ZeroOptimizationConfig,
    reduce_dtype: torch.dtype,
    *,
    lifecycle: Lifecycle,
    on_unit_complete: Callable[[FlatUnit], None],
    on_unarmed_grad: Callable[[], None],
    may_wait_for: Callable[[int], bool | None],
    before_launch: Callable[[], None] | None,
) -> GradReducer:
    callbacks = {
        "lifecycle": lifecycle, "on_unit_complete": on_unit_complete, "on_unarmed_grad": on_unarmed_grad,
        "may_wait_for": may_wait_for, "before_launch": before_launch,
    }
    if stage.streams_gradients(zero):
        return ShardedGradReducer(
            units, comm, zero.overlap_comm, reduce_dtype,
            max_live_buckets=stage.live_grad_buckets, release_after_step=stage.releases_gradients, **callbacks,
        )
    reduction = ReduceScatterGrads() if stage.shard_optimizer_state else AllReduceGrads()
    return FullGradReducer(units, comm, zero.overlap_comm, reduce_dtype, reduction, **callbacks)
