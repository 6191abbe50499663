"""Conditional computation: experts that get no tokens on some ranks train as DDP would.

A mixture-of-experts model (`moe.MoEModel`) whose experts idle on some ranks in some
micro-steps, in both forms real code takes (an expert called but untouched, an expert not
called), trains at every stage to the same parameters as one process on the global batch,
with plain SGD (a scale error shows). Every rank issues the same collectives in the same order
on every process group; what cannot be reconciled (a different number of forward passes) raises
`DivergedRanksError` on every rank within seconds.

The fast run keeps one case of each kind (stage, form, accumulation, dtype, overlap,
activation checkpointing, odd world size, hybrid sharding); ``-m slow`` runs the whole grid.
"""

from __future__ import annotations

import time
from collections import defaultdict
from itertools import product

import pytest
import torch
from harness import recorded_collectives, run_on_ranks
from moe import global_moe_batch, make_moe, moe_batch, train_moe_engine, train_moe_reference

import zero_engine
from configs import engine_config

STEPS, MICRO, LR = 3, 2, 0.2
FP32_TOL, BF16_TOL = 2e-5, 1e-3  # bf16: against the same policy in one process (measured 2.3e-4)


def _config(case: dict, world_size: int) -> dict:
    zero = {"overlap_comm": case.get("overlap", True), "shard_group_size": case.get("shard_group_size")}
    if case["stage"] == 3:
        zero.update(stage3_wrap_modules=["Expert", "MoEBlock"], stage3_param_persistence_threshold=0)
    config = engine_config(
        case["stage"], micro=MICRO, lr=LR, accum=case.get("accum", 1), optimizer="SGD",
        dtype=case.get("dtype"), **zero,
    )
    config["comm"] = {"timeout_s": 60}  # a hang becomes a timeout error, not a stuck test
    return config


def train_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Train every case; record each rank's collectives per process group for the first step."""
    results = []
    for case in cases:
        model = make_moe(case["form"], checkpointing=case.get("checkpointing", False))
        engine = zero_engine.initialize(model, _config(case, world_size))
        calls: list = []
        with recorded_collectives(calls):
            losses = train_moe_engine(engine, rank, range(1), MICRO, case.get("accum", 1))
        losses += train_moe_engine(engine, rank, range(1, STEPS), MICRO, case.get("accum", 1))
        results.append({
            "case": case,
            "state": engine.full_state_dict(),
            "losses": losses,
            "collectives": _per_group(engine, calls),
        })
        engine.close()
    return results


def _per_group(engine, calls: list) -> dict[str, list[tuple[str, int]]]:
    """Each process group's collectives in issue order: (torch function, bytes). Named by
    role, with the members for the hybrid groups (ranks compare with their own group)."""
    comm = engine.comm
    roles = {id(comm.control_group): "control", id(comm.world.group): "data"}
    if comm.num_replicas > 1:
        roles[id(comm.shard_group.group)] = f"shard_group {comm.shard_group_ranks}"
        roles[id(comm.replica_group.group)] = f"replica_group {comm.replica_group_ranks}"
    if comm.reduce_group is not comm.shard_group:  # stage 3: reduce-scatters on a group of their own
        roles[id(comm.reduce_group.group)] = f"reduce_group {comm.shard_group_ranks}"
    sequences: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for _, function, group, nbytes in calls:
        sequences[roles.get(id(group), "unknown")].append((function, nbytes))
    return dict(sequences)


def _check(results: list[list[dict]], world_size: int) -> None:
    for per_rank in zip(*results):
        case = per_rank[0]["case"]
        accum = case.get("accum", 1)
        # The same collectives in the same order on every group, as seen by each of its members.
        by_group: dict[str, list] = defaultdict(list)
        for result in per_rank:
            for group, sequence in result["collectives"].items():
                by_group[group].append(sequence)
        for group, sequences in by_group.items():
            assert all(sequence == sequences[0] for sequence in sequences), (case, group)
        # Every rank's state equals one process on the global batch.
        if case.get("dtype") == "bf16":
            reference, tol = _one_process_engine(case, world_size), BF16_TOL
        else:
            reference, tol = train_moe_reference(case["form"], STEPS, world_size, MICRO, accum, LR), FP32_TOL
        for result in per_rank:
            for name, value in reference.items():
                diff = (result["state"][name].float() - value.float()).abs().max().item()
                assert diff <= tol, (case, name, diff)
        moved = max((reference[n] - make_moe(case["form"]).state_dict()[n]).abs().max().item() for n in reference)
        assert moved > 20 * tol, case  # training moved the parameters far beyond the tolerance


def _one_process_engine(case: dict, world_size: int) -> dict[str, torch.Tensor]:
    """The same config in one process (no process group: world size 1), micro-batches of every
    rank's micro-batch concatenated."""
    accum = case.get("accum", 1)
    config = _config({**case, "shard_group_size": None}, 1)
    config["train_micro_batch_size_per_gpu"] = MICRO * world_size
    engine = zero_engine.initialize(make_moe(case["form"]), config)
    for step in range(STEPS):
        tokens, targets = global_moe_batch(step, world_size, MICRO, accum)
        for micro in range(accum):
            rows = slice(micro * world_size * MICRO, (micro + 1) * world_size * MICRO)
            engine.backward(engine(tokens[rows], targets[rows]))
            engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


FAST_TWO_RANKS = [
    *({"stage": stage, "form": form} for stage, form in product(range(4), ("guard", "skip"))),
    {"stage": 3, "form": "guard", "accum": 3},
    {"stage": 3, "form": "skip", "accum": 3},
    {"stage": 2, "form": "skip", "accum": 3},
    {"stage": 3, "form": "skip", "dtype": "bf16"},
    {"stage": 3, "form": "guard", "overlap": False},
    {"stage": 3, "form": "skip", "checkpointing": True},
]
FAST_THREE_RANKS = [{"stage": 3, "form": "skip"}, {"stage": 3, "form": "guard", "accum": 3}, {"stage": 1, "form": "skip"}]
HYBRID = [{"stage": 3, "form": form, "shard_group_size": 2} for form in ("guard", "skip")]


def _grid() -> list[dict]:
    return [
        {"stage": stage, "form": form, "accum": accum, "dtype": dtype, "overlap": overlap, "checkpointing": ac}
        for stage, form, accum, dtype, overlap, ac in product(
            range(4), ("guard", "skip"), (1, 3), ("fp32", "bf16"), (True, False), (False, True)
        )
    ]


@pytest.mark.parametrize(  # the fast run: 3 ranks (odd); 2 ranks' cases and 4 (hybrid) in the slow run
    "world_size, cases",
    [pytest.param(2, FAST_TWO_RANKS, marks=pytest.mark.slow), (3, FAST_THREE_RANKS),
     pytest.param(4, HYBRID, marks=pytest.mark.slow)],
)
def test_idle_experts_train_as_one_process_with_the_same_collectives_on_every_rank(
    world_size: int, cases: list[dict]
) -> None:
    _check(run_on_ranks(world_size, train_cases, cases, timeout=300), world_size)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_idle_experts_whole_grid(world_size: int) -> None:
    _check(run_on_ranks(world_size, train_cases, _grid(), timeout=1200), world_size)


def extra_forward(rank: int, world_size: int) -> tuple[str, float, list[str]]:
    """The last rank runs two forwards per micro-step, the others one: not reconcilable."""
    engine = zero_engine.initialize(make_moe("skip"), _config({"stage": 3, "form": "skip"}, world_size))
    started = time.monotonic()
    try:
        for step in range(2):
            tokens, targets = moe_batch(step, 0, rank, MICRO)
            loss = engine(tokens, targets)
            if rank == world_size - 1:
                loss = loss + engine(tokens, targets)
            engine.backward(loss)
            engine.step()
    except zero_engine.DivergedRanksError as error:
        seconds = time.monotonic() - started
        after = []  # every later collective call refuses at once instead of issuing a collective
        for call in (lambda: engine(tokens, targets), engine.step, engine.full_state_dict):
            try:
                call()
                after.append("no error")
            except zero_engine.DivergedRanksError as again:
                after.append(str(again))
        return str(error), seconds, after
    return "no error", time.monotonic() - started, []


def test_a_different_number_of_passes_raises_on_every_rank_within_seconds() -> None:
    results = run_on_ranks(3, extra_forward, timeout=120)
    messages = {message for message, _, _ in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("stage 3 ranks diverged: rank 0 is in backward after 1 passes"), message
    assert "rank 2 is in forward after 1 passes" in message and "end the job" in message, message
    assert all(seconds < 20 for _, seconds, _ in results), results  # the collectives time out after 60 s
    for _, _, after in results:
        assert after == [f"{message} (raised earlier; this engine cannot go on)"] * 3, after
