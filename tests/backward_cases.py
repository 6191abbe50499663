"""Several backwards in one micro-step (a loss split into halves): the engine's SGD setup, the
run on each rank, and the check that the halves add up to the whole (test_backward, and hybrid
sharding's test)."""

from __future__ import annotations

import torch

import zero_engine
from configs import engine_config
from models import decay_groups, make_model, micro_batch

MICRO = 2


def backward_config(
    stage: int, bf16: bool = False, fp16: bool = False, accum: int = 1, shard_group_size: int | None = None
) -> dict:
    return engine_config(
        stage, micro=MICRO, lr=0.5, accum=accum, optimizer="SGD", dtype="bf16" if bf16 else "fp16" if fp16 else "fp32",
        reduce_bucket_size=40, stage3_param_persistence_threshold=0, shard_group_size=shard_group_size,
    )


def sgd_engine(config: dict) -> zero_engine.Engine:
    model = make_model()
    return zero_engine.initialize(model, config, param_groups=decay_groups(model))


def two_backwards_per_micro_step(rank: int, world_size: int, cases: list[tuple[int, ...]]) -> list[list[dict]]:
    """Each micro-batch's loss in one backward, or as two half-batch backwards: stages 2-3
    reduce each backward into the shard, stages 0-1 accumulate off the boundary (where two
    backwards are allowed there). A case is (stage, accumulation steps[, shard group size])."""
    results = []
    for stage, accum, *group in cases:
        states = []
        for split in (False, True):
            engine = sgd_engine(backward_config(stage, accum=accum, shard_group_size=group[0] if group else None))
            for step in range(2):
                for micro in range(accum):
                    tokens, targets = micro_batch(step, micro, rank, world_size, MICRO, accum)
                    halves = [engine(tokens[i : i + 1], targets[i : i + 1]) / 2 for i in range(2)]
                    may_split = stage >= 2 or not engine.is_gradient_accumulation_boundary()
                    if split and may_split:
                        for half in halves:
                            engine.backward(half)
                    else:
                        engine.backward(halves[0] + halves[1])
                    engine.step()
            states.append(engine.full_state_dict())
            engine.close()
        results.append(states)
    return results


def check_backwards_add_up(cases: list[tuple[int, ...]], per_case: list[list[dict]]) -> None:
    for (stage, *_), (joined, split) in zip(cases, per_case):
        for name, value in joined.items():
            torch.testing.assert_close(split[name], value, rtol=0, atol=1e-6, msg=f"stage {stage}: {name}")
