"""GPU hangs found on the CPU: multi-rank runs under the NCCL model
(`zero_engine.testing.nccl_model`), checked for the dependency cycles NCCL would meet.

The grid: stages 2 and 3 with the mixture of experts of ``tests/moe.py`` (experts skipped or
guarded per rank, one expert that no rank ever uses), hybrid sharding as 2 groups of 2,
offload with pageable memory (DeepSpeed's default), accumulation, and a rank that lags. The
planted case puts hybrid second phases back on the compute stream (the GPU review's N1),
which the model must find.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from moe import EXPERTS, make_moe, moe_batch
from zero_engine.testing.nccl_model import Event, NcclModel, find_hang, opposite_orders

STEPS, MICRO = 2, 2


def _config(case: dict[str, Any]) -> dict[str, Any]:
    zero: dict[str, Any] = {"shard_group_size": case.get("group"), "reduce_bucket_size": 200}
    if case["stage"] == 3:
        zero.update(stage3_wrap_modules=["Expert", "MoEBlock"], stage3_param_persistence_threshold=0)
    if case.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}  # what crosses every pass is pinned anyway
        if case["stage"] == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    if case.get("quantized"):  # the encoded second phase: made on the side stream, decoded after its wait
        zero.update(zero_quantized_gradients=True, zero_quantized_weights=True)
    config = engine_config(case["stage"], micro=MICRO, lr=0.05, accum=case.get("accum", 1), **zero)
    config["comm"] = {"timeout_s": 60, "primitives": "native"}  # NCCL's: one collective per gather or reduction
    return config


def _batch(step: int, micro: int, rank: int, untouched: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = moe_batch(step, micro, rank, MICRO)
    if untouched:  # the last expert gets no token on any rank, ever
        tokens = torch.where(tokens % EXPERTS == EXPERTS - 1, tokens - 1, tokens)
    return tokens, targets


def traced_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[list[Event]]:
    """Every case trained under the NCCL model; each rank's trace per case."""
    traces = []
    for case in cases:
        model = make_moe(case["form"])
        if case.get("lag") == rank:  # this rank's host falls behind the others in forward
            for module in model.modules():
                module.register_forward_pre_hook(lambda *_: time.sleep(0.01))
        with NcclModel(second_phase_on_compute_stream=case.get("plant_n1", False)) as nccl:
            engine = zero_engine.initialize(model, _config(case))
            for step in range(STEPS):
                for micro in range(case.get("accum", 1)):
                    nccl.mark("forward")
                    engine.backward(engine(*_batch(step, micro, rank, case.get("untouched", False))))
                    nccl.mark("step")
                    engine.step()
        traces.append(nccl.events)
    return traces


GRID = [
    {"stage": 3, "form": "skip", "group": 2},
    {"stage": 3, "form": "guard", "group": 2, "accum": 2},
    {"stage": 2, "form": "skip", "group": 2, "accum": 2},
    {"stage": 3, "form": "skip"},
    {"stage": 3, "form": "guard", "untouched": True, "lag": 1},
    {"stage": 2, "form": "skip", "accum": 2, "untouched": True},
    {"stage": 3, "form": "skip", "offload": True, "accum": 2},
    {"stage": 2, "form": "guard", "offload": True, "group": 2},
    {"stage": 3, "form": "skip", "group": 2, "quantized": True},
    {"stage": 3, "form": "skip", "group": 2, "plant_n1": True},
]


@pytest.fixture(scope="module")
def grid_traces() -> dict[int, list[list[Event]]]:
    """Each case's traces, one per rank (one spawn of 4 ranks for the whole grid)."""
    per_rank = run_on_ranks(4, traced_cases, GRID, timeout=300)
    return {index: [rank_traces[index] for rank_traces in per_rank] for index in range(len(GRID))}


@pytest.mark.parametrize("index", [i for i, case in enumerate(GRID) if not case.get("plant_n1")],
                         ids=lambda i: "-".join(f"{k}{v}" for k, v in GRID[i].items()))
def test_no_nccl_hang(grid_traces: dict[int, list[list[Event]]], index: int) -> None:
    traces = grid_traces[index]
    assert all(any(event.kind == "launch" for event in trace) for trace in traces)  # it recorded collectives
    hang = find_hang(traces)
    assert hang is None, str(hang)


def test_the_model_finds_hybrid_second_phases_waited_on_the_compute_stream(
    grid_traces: dict[int, list[list[Event]]],
) -> None:
    """The GPU review's N1: stage 3, 2x2, an expert skipped on some rank of a shard group."""
    planted = next(index for index, case in enumerate(GRID) if case.get("plant_n1"))
    hang = find_hang(grid_traces[planted])
    assert hang is not None and hang.cycle, "the planted N1 must close a cycle"
    assert any("reduce[" in step for step in hang.cycle) and any("data[" in step for step in hang.cycle)


def test_offload_with_pageable_memory_syncs_the_host_once_per_backward(
    grid_traces: dict[int, list[list[Event]]],
) -> None:
    """The GPU review's N3: a gradient copy into pageable memory would block the host per bucket."""
    for index, case in enumerate(GRID):
        if not case.get("offload"):
            continue
        for trace in grid_traces[index]:
            syncs = [event.what for event in trace if event.kind == "sync"]
            backwards = STEPS * case.get("accum", 1)
            assert syncs.count("host_values") == STEPS, syncs
            assert _syncs_in_passes(trace) == ["wait_for_host_copies"] * backwards


def _syncs_in_passes(trace: list[Event]) -> list[str]:
    """The host syncs of forwards and backwards (the step's own, after its read-back, are not)."""
    in_pass, found = False, []
    for event in trace:
        if event.kind == "mark":
            in_pass = event.what == "forward"
        elif event.kind == "sync" and in_pass:
            found.append(event.what)
    return found


# -- the checker itself, on traces made by hand ---------------------------------------------------


def _launch(group: str, seq: int) -> Event:
    return Event("launch", group, seq, "all_reduce")


def test_crossed_stream_waits_are_a_cycle() -> None:
    """Each rank makes its stream wait for one communicator before launching on the other, in
    opposite orders: each launch waits for a collective the other rank launches behind it.
    Launched in opposite orders but waited for only after both launches, nothing waits."""
    rank0 = [_launch("a", 0), _launch("b", 0), Event("swait", "a", 0), Event("swait", "b", 0), Event("sync")]
    rank1 = [_launch("b", 0), _launch("a", 0), Event("swait", "b", 0), Event("swait", "a", 0), Event("sync")]
    assert find_hang([rank0, rank1]) is None
    crossed0 = [_launch("a", 0), Event("swait", "a", 0), _launch("b", 0), Event("sync")]
    crossed1 = [_launch("b", 0), Event("swait", "b", 0), _launch("a", 0), Event("sync")]
    hang = find_hang([crossed0, crossed1])
    assert hang is not None and len(hang.cycle) == 4 and set(hang.blocked) == {0, 1}, hang
    assert "rank 0 starts all_reduce b#0" in hang.cycle and "rank 1 starts all_reduce a#0" in hang.cycle


def test_a_side_stream_wait_does_not_hold_the_compute_stream() -> None:
    side0 = [_launch("a", 0), Event("side_begin"), Event("swait", "a", 0), Event("side_end"), _launch("b", 0),
             Event("swait", "a", 0), Event("sync")]
    side1 = [_launch("b", 0), Event("side_begin"), Event("swait", "b", 0), Event("side_end"), _launch("a", 0),
             Event("swait", "b", 0), Event("sync")]
    assert find_hang([side0, side1]) is None
    compute0 = [event for event in side0 if not event.kind.startswith("side")]
    compute1 = [event for event in side1 if not event.kind.startswith("side")]
    assert find_hang([compute0, compute1]) is not None


def test_a_round_waits_for_every_rank_and_a_missing_launch_is_named() -> None:
    """A host reading a round waits for every rank to issue it: a rank that first syncs on a
    collective the reader launches only after the round hangs both hosts. A collective some
    member never launches is named."""
    rank0 = [Event("issue", "control", 0), Event("read", "control", 0), _launch("a", 0), Event("swait", "a", 0),
             Event("sync")]
    rank1 = [_launch("a", 0), Event("issue", "control", 0), Event("swait", "a", 0), Event("sync"),
             Event("read", "control", 0)]
    assert find_hang([rank0, rank1]) is None
    late = [_launch("a", 0), Event("swait", "a", 0), Event("sync"), Event("issue", "control", 0),
            Event("read", "control", 0)]
    hang = find_hang([rank0, late])
    assert hang is not None and any("round control#0" in step for step in hang.cycle), hang
    rank1 = [Event("issue", "control", 0), Event("read", "control", 0), _launch("a", 0)]
    rank0 = [Event("issue", "control", 0), Event("read", "control", 0), _launch("a", 0), _launch("a", 1),
             Event("swait", "a", 1), Event("sync")]
    hang = find_hang([rank0, rank1])
    assert hang is not None and hang.missing == ["rank 1 never starts a#1"] and 0 in hang.blocked, hang


def test_opposite_orders_counts_pairs_launched_in_different_orders() -> None:
    rank0 = [_launch("reduce", 0), _launch("data", 0), _launch("data", 1)]
    rank1 = [_launch("data", 0), _launch("reduce", 0), _launch("data", 1)]
    assert opposite_orders([rank0, rank1], "reduce", "data") == 1
    assert opposite_orders([rank0, rank0], "reduce", "data") == 0
