"""The resume cases several test modules run (checkpoints, offload): a global batch of 12 at
every world size, ``FIRST`` steps trained and saved, ``SECOND`` more after a resume at any stage
and world size."""

from __future__ import annotations

import zero_engine
from configs import engine_config
from models import decay_groups, make_model, train_engine

LR, GLOBAL_BATCH, FIRST, SECOND = 0.05, 12, 3, 3
# The global batch stays 12 at every world size: (micro-batch, accumulation) per world size.
SETUPS = {1: (4, 3), 2: (3, 2), 3: (2, 2), 4: (3, 1)}


def checkpoint_config(stage: int, world_size: int, **zero) -> dict:
    micro, accum = SETUPS[world_size]
    # At stage 3 the size policy makes embed, fc1 and fc2 units of their own.
    return engine_config(
        stage, micro=micro, lr=LR, accum=accum, reduce_bucket_size=50, stage3_param_persistence_threshold=0, **zero
    )


def train_steps(engine, rank: int, world_size: int, steps: range) -> list[list[float]]:
    micro, accum = SETUPS[world_size]
    return train_engine(engine, rank, world_size, steps, micro, accum)[0]


def resume_jobs(rank: int, world_size: int, jobs: list[tuple]) -> list[dict]:
    """("save", stage, dir): train the first steps and save. ("load", stage, dir): resume.
    A fourth item holds more zero_optimization keys (offload)."""
    results = []
    for kind, stage, directory, *zero in jobs:
        model = make_model(seed=1 if kind == "load" else 0)  # a resumed model starts elsewhere
        config = checkpoint_config(stage, world_size, **(zero[0] if zero else {}))
        engine = zero_engine.initialize(model, config, param_groups=decay_groups(model))
        if kind == "save":
            losses = train_steps(engine, rank, world_size, range(FIRST))
            engine.save_checkpoint(directory, client_state={"note": "first", "step": FIRST})
            results.append({"losses": losses})
        else:
            client = engine.load_checkpoint(directory)
            assert client == {"note": "first", "step": FIRST}, client
            assert engine.global_step == FIRST
            losses = train_steps(engine, rank, world_size, range(FIRST, FIRST + SECOND))
            results.append({"losses": losses, "state": engine.full_state_dict()})
        engine.close()
    return results


def global_means(per_rank: list[dict]) -> list[float]:
    steps = len(per_rank[0]["losses"])
    means = []
    for step in range(steps):
        window = [loss for result in per_rank for loss in result["losses"][step]]
        means.append(sum(window) / len(window))
    return means
