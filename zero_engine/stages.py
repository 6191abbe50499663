"""A ZeRO stage as a small value object: which states are sharded and how gradients reduce.

The engine looks the stage up once, in `STAGES`, and composes shared machinery from it; no
``if stage == ...`` elsewhere. Stages 2 and 3 are listed with what is not built yet, so that
asking for them fails at `initialize` with a clear message.
"""

from __future__ import annotations

from dataclasses import dataclass

from .reducer import AllReduceGrads, GradReduction, ReduceScatterGrads


@dataclass(frozen=True)
class Stage:
    level: int
    shard_optimizer_state: bool  # the optimizer updates only this rank's pieces, then all-gather
    reduction: GradReduction | None  # None: this stage is not built yet
    summary: str


STAGES: dict[int, Stage] = {
    0: Stage(0, False, AllReduceGrads(), "replicated data parallelism (all-reduce)"),
    1: Stage(1, True, ReduceScatterGrads(), "optimizer state sharded (reduce-scatter + all-gather)"),
    2: Stage(2, True, None, "gradients sharded too"),
    3: Stage(3, True, None, "parameters sharded too"),
}


def stage_for(level: int) -> Stage:
    stage = STAGES[level]
    if stage.reduction is None:
        raise NotImplementedError(
            f"zero_optimization.stage = {level} ({stage.summary}) is validated but not built yet; "
            "use stage 0 or 1"
        )
    return stage
