"""Stage 3's agreement rounds on hand-made rows, in one process: what a round's rows make every
rank gather, in which order, and which reductions every rank may wait for.

The multi-rank tests run the same logic over gloo, where a wrong agreement shows only as a hang
until the collective times out; here the other ranks' rows are written by the test, so a wrong
order or a wrong bound is an assertion naming the rows.
"""

from __future__ import annotations

from collections import deque
import pytest
import torch

from zero_engine.comm import ABORTED, DONE, EachRank
from zero_engine.errors import DivergedRanksError
from zero_engine.sharding.gathering.agreement import (
    NO_UNIT, PASS_DONE, Call, CollectiveSchedule, PassKind, call_row, make_row,
)


class ScriptedComm:
    """Rank 0 of ``world_size`` ranks; each round's other rows come from ``script``."""

    def __init__(self, world_size: int, orders_on_device: bool = False) -> None:
        self.rank = 0
        self.world_size = world_size
        self.orders_on_device = orders_on_device  # NCCL: a wait orders the stream
        self.aborted = 0
        self.script: deque[list[list[int]]] = deque()
        self.sent: list[list[int]] = []

    def abort_data_groups(self) -> str:
        self.aborted += 1
        return ABORTED if self.orders_on_device else ""

    def each_rank(self, value: list[int]) -> EachRank:
        self.sent.append(list(value))
        others = self.script.popleft()
        assert len(others) == self.world_size - 1
        return EachRank(torch.tensor([list(value), *others], dtype=torch.int64), DONE)


class Reductions:
    def __init__(self, ready: int = 0) -> None:
        self.ready = ready

    def ready_units(self) -> int:
        return self.ready


def _schedule(
    world_size: int, gathered: set[int] | None = None, orders_on_device: bool = False
) -> tuple[CollectiveSchedule, ScriptedComm, list]:
    comm = ScriptedComm(world_size, orders_on_device)
    launched: list[tuple[int, bool]] = []
    gathered = gathered if gathered is not None else set()

    def launch(index: int, wanted: bool) -> None:
        launched.append((index, wanted))
        gathered.add(index)

    schedule = CollectiveSchedule(comm, launch, lambda index: index in gathered, lambda index: f"unit {index}")  # type: ignore[arg-type]
    return schedule, comm, launched


def _row(wants: list[int], ready: int = 0, passes: int = 0, kind: PassKind = PassKind.FORWARD) -> list[int]:
    return make_row(passes, kind, wants, ready)


def test_a_round_agrees_on_every_ranks_wants_first_wants_first() -> None:
    """Each rank's first want, in rank order, then each second want, ...; a unit wanted twice
    once; a rank takes part in the gathers only others wanted (``wanted`` False)."""
    schedule, comm, launched = _schedule(3)
    schedule.begin_pass(PassKind.FORWARD)
    comm.script.append([_row([3]), _row([2, 7, 9])])
    schedule.issue([2, 5])
    schedule.need(5)
    assert launched == [(2, True), (3, False), (5, True)]  # 7 and 9 wait their turn
    assert schedule.queued(7) and schedule.queued(9) and not schedule.asked(3)
    schedule.need(9)
    assert launched[3:] == [(7, False), (9, False)]


def test_a_gather_no_round_agreed_yet_issues_one_and_launches_in_the_agreed_order() -> None:
    schedule, comm, launched = _schedule(2)
    schedule.begin_pass(PassKind.FORWARD)
    comm.script.append([_row([4])])
    schedule.need(1)  # nothing agreed: a round asking for 1
    assert comm.sent == [_row([1])]
    assert launched == [(1, True)]  # 4 waits until it is needed, or the rank blocks
    schedule.launch_all()
    assert launched == [(1, True), (4, False)]


@pytest.mark.parametrize("ready, agreed", [([4, 2, 3], 2), ([0, 5, 5], 0), ([6, 6, 6], 6)])
def test_every_rank_may_wait_for_a_reduction_only_once_every_row_says_it_launched(ready: list[int], agreed: int) -> None:
    """``agreed_ready`` is the least count of launched reductions over the rows: waiting for a
    reduction some rank has not launched could wait for a rank that waits for this one."""
    schedule, comm, _ = _schedule(3)
    schedule.reductions = Reductions(ready=ready[0])
    schedule.begin_pass(PassKind.BACKWARD)
    comm.script.append([_row([], ready[1], kind=PassKind.BACKWARD), _row([], ready[2], kind=PassKind.BACKWARD)])
    schedule.issue()
    assert comm.sent[-1][3] == ready[0]  # this rank's row reports its own launched reductions
    for reduction in range(7):
        expected = True if reduction < agreed else False
        assert schedule.launched_everywhere(reduction) is expected, (ready, reduction)
    assert schedule.agreed_ready == agreed


@pytest.mark.parametrize("orders_on_device", [False, True])
def test_on_nccl_agreed_gathers_launch_before_a_wait_for_a_reduction(orders_on_device: bool) -> None:
    """GPU review N6: on NCCL a wait for a reduction orders this rank's stream, and a gather
    launched after it queues behind the reduction, which another rank may have launched only
    after that very gather: every agreed gather is launched before the answer "you may wait"
    (a prefetch earlier than planned). On gloo the wait blocks only the host: gathers launch
    when needed."""
    schedule, comm, launched = _schedule(2, orders_on_device=orders_on_device)
    schedule.begin_pass(PassKind.BACKWARD)
    comm.script.append([_row([4, 6], ready=2, kind=PassKind.BACKWARD)])
    schedule.reductions = Reductions(ready=2)
    schedule.issue([3])
    schedule.need(3)
    assert launched == [(3, True)] and schedule.queued(4) and schedule.queued(6)
    assert schedule.launched_everywhere(1) is True
    expected = [(3, True), (4, False), (6, False)] if orders_on_device else [(3, True)]
    assert launched == expected


def test_a_pass_ends_when_every_row_says_so() -> None:
    """Drain rows until a round in which every rank is done; then every agreed gather is launched."""
    schedule, comm, launched = _schedule(2)
    schedule.begin_pass(PassKind.FORWARD)
    comm.script.extend([[_row([6])], [_row([], 0)], [_row([PASS_DONE])]])
    schedule.end_pass()
    sent_wants = [row[2] for row in comm.sent]
    assert sent_wants == [PASS_DONE, PASS_DONE, PASS_DONE]  # three rounds until the peer was done too
    assert launched == [(6, False)] and schedule.passes == 1 and schedule.kind is PassKind.BETWEEN


@pytest.mark.parametrize("orders_on_device", [False, True])
def test_on_nccl_a_divergence_aborts_the_data_communicators(orders_on_device: bool) -> None:
    """GPU review N10: the gathers one rank launched and another never will would otherwise
    hold the next device sync, or the exit, for the collective timeout (30 minutes)."""
    schedule, comm, _ = _schedule(2, orders_on_device=orders_on_device)
    schedule.begin_pass(PassKind.FORWARD)
    comm.script.append([_row([1], passes=1, kind=PassKind.BACKWARD)])
    schedule.issue([0])
    with pytest.raises(DivergedRanksError) as raised:
        schedule.need(0)
    assert comm.aborted == 1
    assert ("communicators were aborted" in str(raised.value)) is orders_on_device


def test_rows_from_different_passes_raise_naming_each_rank() -> None:
    schedule, comm, _ = _schedule(2)
    schedule.begin_pass(PassKind.FORWARD)
    comm.script.append([_row([1], passes=1, kind=PassKind.BACKWARD)])
    schedule.issue([0])
    with pytest.raises(DivergedRanksError, match=r"rank 0 is in forward after 0 passes, gathering unit 0, rank 1 is in "
                       r"backward after 1 passes, gathering unit 1"):
        schedule.need(0)
    assert schedule.divergence


def test_a_call_row_against_a_training_row_raises_on_the_call() -> None:
    schedule, comm, _ = _schedule(2)
    comm.script.append([_row([NO_UNIT], kind=PassKind.FORWARD)])
    with pytest.raises(DivergedRanksError, match=r"rank 0 is in save_checkpoint\(\) \(count 0\), rank 1 is in forward"):
        schedule.agree_on_call(Call.SAVE_CHECKPOINT)
    schedule, comm, _ = _schedule(2)
    comm.script.append([call_row(0, Call.SAVE_CHECKPOINT)])
    schedule.agree_on_call(Call.SAVE_CHECKPOINT)  # the same call on every rank: nothing to gather

