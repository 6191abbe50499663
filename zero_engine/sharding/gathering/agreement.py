"""Stage 3: gathers in one order that every rank derives from agreed facts.

During forward and backward, stage 3 all-gathers a unit before its modules run. gloo and NCCL
pair collectives by their order on a group, so every rank must issue the same gathers in the
same order, although ranks may run different modules (a mixture of experts routes no token to
some expert on some rank).

So no rank decides alone. The ranks exchange small rows of facts in *rounds* (`Comm.each_rank`
on the control group): each rank issues its rounds in its own time, but the k-th round of
every rank is one all-reduce, so every rank reads the same rows for it. A row says which pass
the rank is in (forward or backward, counted), which units it wants gathered next (up to
`WANTS_PER_ROW`, in the order it expects to use them, or none), and how many units, in the
reducer's order, have their reductions launched here (or ready to be). From a round's rows
every rank queues the same gathers: every unit some rank wants, each rank's first wants before
their second ones. One round agrees on a window of the order a rank expects (the previous
pass's), so a pass that follows it needs a round per window, not per gather. Each rank
launches its queue in order, a gather when its unit is needed (a prefetch agreed early still
launches late), so a rank takes part in the gathers of units only other ranks want. A rank
with nothing more to ask at the end of a pass sends rows that say so ("drain") until every
rank's row does, so every rank issues the same number of rounds per pass.

Reduce-scatters run on a group of their own (`zero_engine.comm.Comm.reduce_group`), in the
reducer's unit order on every rank, launched as gradients complete; a rank where a parameter
got no gradient launches that unit (and, in order, the later ones) after its backward, with
zeros. The rows' minimum of launched reductions, `agreed_ready`, says which of them a rank may
wait for without waiting for a rank that waits for it.

Rows from different passes cannot be reconciled (one rank runs two forwards before its
backward, another one): every rank raises `DivergedRanksError` on the same round.

The engine's collective calls (saving, loading, exporting; at stages 0-2 also a micro-step's
first backward) open with a *call row* on the same control group
(`CollectiveSchedule.agree_on_call`, through `zero_engine.sharding.gathering.calls`; at stages 0-2
`CallGuard`, which reads a training row only before the next reduction): a rank that skipped a call
(``if rank == 0: engine.save_checkpoint(...)``) pairs its next row with another rank's call
row, and every rank raises `DivergedRanksError` naming each rank's call instead of pairing
unrelated collectives until the timeout.

Why nothing hangs: every rank launches a prefix of the same sequence of gathers, and launches
everything it has queued before it blocks on a round; it waits only for gathers it launched and
reductions every rank launched. See "Stage 3 with conditional computation" in
``docs/architecture.md``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import NamedTuple, Protocol

from ...comm import Comm, EachRank
from ...errors import DivergedRanksError
from ..tiers.held import Holdings

NO_UNIT = -1  # a row that asks for no gather
PASS_DONE = -2  # a row that asks for no gather and has nothing left to ask in this pass
# How many gathers one row may ask for: a prefetch window agreed in one round. Each round is a
# small all-reduce that costs ~0.25 ms to launch on gloo, and one the ranks may wait on; a
# rank that blocks on a round first launches what it has queued, so the window also bounds
# what a rank whose modules differ from the others' may gather ahead of use.
WANTS_PER_ROW = 4


class PassKind(IntEnum):
    BETWEEN = 0  # between passes (rows proposing the next pass's first gathers)
    FORWARD = 1
    BACKWARD = 2
    CALL = 3  # a call row: the third field is a `Call`
    FAILED = 4  # a resource this rank holds failed (a swap file's read for a gather): every rank stops


class Call(IntEnum):
    """The engine's collective calls, as call rows name them."""

    TRAIN = 1  # a micro-step's first backward (stages 0-2)
    SAVE_CHECKPOINT = 2
    LOAD_CHECKPOINT = 3
    FULL_STATE_DICT = 4
    SAVE_PRETRAINED = 5
    GATHERED = 6  # engine.gathered()
    FULL_PARAMETERS = 7  # engine.named_full_parameters()
    FULL_PARAMETERS_BUCKET = 8  # its next bucket's gather (the count: the bucket's number)
    FULL_PARAMETERS_END = 9  # its end (the count: the buckets gathered)
    SEQUENCE_LOSS = 10  # engine.sequence_loss() after a split forward (a plain model's loop)
    SPLIT_FORWARD = 11  # a training forward split over the sequence group (its facts: `split_forward_facts`)
    SEQUENCE_LOG_PROBS = 12  # engine.sequence_log_probs() after a split forward (a plain model's loop)
    SEQUENCE_GATHER = 13  # engine.sequence_gather(): a split forward's output gathered over the group

    @property
    def label(self) -> str:
        """How messages name the call: its method's name (``save_checkpoint()``,
        ``sequence_loss()``), unless `_CALL_LABELS` says otherwise."""
        return _CALL_LABELS.get(self, f"{self.name.lower()}()")


# The calls not named by their method's name.
_CALL_LABELS = {
    Call.TRAIN: "training",
    Call.FULL_PARAMETERS_BUCKET: "named_full_parameters(), gathering a bucket",
    Call.FULL_PARAMETERS_END: "the end of named_full_parameters()",
    Call.SPLIT_FORWARD: "a training forward split over its sequence group",
}


def make_row(passes: int, kind: PassKind, wants: Sequence[int], ready: int) -> list[int]:
    """A row: ``[passes, kind, first want, ready, further wants...]``, padded with `NO_UNIT`
    (the first want stays at index 2, where a call row has its call)."""
    first, *more = [*wants, *[NO_UNIT] * (WANTS_PER_ROW - len(wants))]
    return [passes, int(kind), first, ready, *more]


def row_wants(row: Sequence[int]) -> list[int]:
    """The units a row asks for, in its rank's order of use."""
    return [unit for unit in (row[2], *row[4:]) if unit >= 0]


def call_row(count: int, call: Call, facts: Sequence[int] = ()) -> list[int]:
    """A call row, shaped as the schedule's rows so that either may pair with the other; a
    split forward's ``facts`` (`split_forward_facts`) in the places of the wants."""
    row = make_row(count, PassKind.CALL, [int(call)], 0)
    row[3 : 3 + len(facts)] = facts
    return row


def split_forward_facts(ordinal: int, group_leader: int, batch: int, tokens: int, fingerprint: int) -> list[int]:
    """What a split training forward's row says, read by `split_batch_divergence`: which split
    forward of its micro-step it is (the same on every rank), and, compared within the sequence
    group whose first rank is ``group_leader``, the micro-batch's shape and a fingerprint of its
    contents (every rank of a group must split the same micro-batch)."""
    return [ordinal, group_leader, batch << 32 | tokens, fingerprint]


def split_batch_divergence(rows: list[list[int]]) -> str | None:
    """The message when every rank is in the same split forward but some sequence group's ranks
    were given different micro-batches; None when each group's agree."""
    by_group: dict[int, list[int]] = {}
    for rank, row in enumerate(rows):
        by_group.setdefault(row[4], []).append(rank)
    for leader, ranks in by_group.items():
        odd = [rank for rank in ranks if rows[rank][5:] != rows[leader][5:]]
        if not odd:
            continue
        first, other = rows[leader], rows[odd[0]]

        def shape(row: list[int]) -> str:
            return f"{row[5] >> 32} x {row[5] & 0xFFFFFFFF} tokens"

        what = (f"rank {leader}: {shape(first)}, rank {odd[0]}: {shape(other)}" if first[5] != other[5]
                else f"both {shape(first)}, other tokens")
        return (
            f"ranks {leader} and {odd[0]} of sequence group {ranks} were given different micro-batches ({what}), "
            "and a sequence group splits one micro-batch between its ranks: give every rank of a group the same "
            "batches, with DistributedSampler(dataset, num_replicas=engine.data_parallel_world_size, "
            "rank=engine.data_parallel_rank), or wrap a per-rank loader in zero_engine.SequenceGroupLoader(loader, "
            "engine), which shares each rank's batches over its group"
        )
    return None


def call_divergence(rows: list[list[int]], describe_unit: Callable[[int], str] = str) -> str | None:
    """The `DivergedRanksError` message when some rank sent a call row and the rows are not all
    the same call after the same count (a split forward's: the same one, and each sequence
    group given one micro-batch); None otherwise."""
    if all(row[1] != PassKind.CALL for row in rows) or all(row == rows[0] for row in rows):
        return None
    if all(row[:4] == rows[0][:4] for row in rows) and rows[0][2] == Call.SPLIT_FORWARD:
        return split_batch_divergence(rows)
    return (
        f"ranks are in different calls: {describe_rows(rows, describe_unit)}. save_checkpoint, load_checkpoint, "
        "save_pretrained, gathered(), named_full_parameters() (iterated to its end), generation at stage 3 and (when "
        "state is sharded) full_state_dict are collective, and so are sequence_loss, sequence_log_probs, "
        "sequence_gather and every training forward under sequence_parallel_size: call them on every rank, at "
        "the same step. The ranks' collectives are now out of step: end the job"
    )


def describe_rows(rows: list[list[int]], describe_unit: Callable[[int], str] = str) -> str:
    """Every rank's row, for a divergence message."""
    return ", ".join(f"rank {rank} {describe_row(row, describe_unit)}" for rank, row in enumerate(rows))


def describe_row(row: list[int], describe_unit: Callable[[int], str] = str) -> str:
    passes, kind = row[0], PassKind(row[1])
    if kind is PassKind.CALL and row[2] == Call.SPLIT_FORWARD:
        return f"is in its training forward number {row[3]} of the micro-step, split over its sequence group " \
               f"(count {passes})"
    if kind is PassKind.CALL:
        return f"is in {Call(row[2]).label} (count {passes})"
    where = "between passes" if kind is PassKind.BETWEEN else f"is in {kind.name.lower()}"
    wants = row_wants(row)
    asks = f"gathering {', '.join(describe_unit(unit) for unit in wants)}" if wants else "asking for no unit"
    return f"{where} after {passes} passes, {asks}"


class Reductions(Protocol):
    """What the rows report about the gradient reductions (`zero_engine.sharding.reduction.reducer.GradReducer`)."""

    def ready_units(self) -> int: ...


class _NoReductions:
    def ready_units(self) -> int:
        return 0


class _Round(NamedTuple):
    wants: tuple[int, ...]  # what this rank's row asked for
    agreement: EachRank


class _Event(NamedTuple):
    index: int  # the unit to gather
    wanted: bool  # this rank asked for it (else it only takes part for other ranks)


class CollectiveSchedule:
    """Rounds issued, gathers agreed and not launched yet, and the pass this rank is in."""

    def __init__(
        self,
        comm: Comm,
        launch_gather: Callable[[int, bool], None],
        is_gathered: Callable[[int], bool],
        describe_unit: Callable[[int], str],
    ) -> None:
        self.comm = comm
        self.launch_gather = launch_gather  # (unit index, wanted here)
        self.is_gathered = is_gathered  # whether a unit's storage is full (or filling) here
        self.describe_unit = describe_unit
        self.reductions: Reductions = _NoReductions()
        self.passes = 0  # passes this rank has finished
        self.kind = PassKind.BETWEEN
        self.agreed_ready = 0  # reductions (in the reducer's order) every rank has launched
        self.divergence = ""  # the DivergedRanksError's message once the ranks' passes parted
        # what this rank holds (`held.Holdings`: offload_param's swap space); once one failed, this
        # rank's rows say so, and every rank raises its error on that round (`_check_same_pass`)
        self.held = Holdings()
        self._rounds: deque[_Round] = deque()  # issued here, not read yet
        self._events: deque[_Event] = deque()  # gathers agreed, not launched here yet

    # -- passes ------------------------------------------------------------------------------

    def begin_pass(self, kind: PassKind) -> None:
        self.kind = kind
        self.agreed_ready = 0

    def end_pass(self) -> None:
        """Drain: rows that ask for nothing until every rank's row says it is done with the
        pass, then launch every agreed gather."""
        while True:
            self.issue([PASS_DONE])
            if all(row[2] == PASS_DONE for row in self._read_all()):
                break
        self.launch_all()
        self.passes += 1
        self.kind = PassKind.BETWEEN

    # -- rounds ------------------------------------------------------------------------------

    def issue(self, wants: Sequence[int] = ()) -> None:
        """Start a round whose row asks for ``wants`` (at most `WANTS_PER_ROW` unit indices, in
        this rank's order of use; none to only report reductions; ``[PASS_DONE]`` to drain),
        without waiting."""
        ready = self.reductions.ready_units() if self.kind is PassKind.BACKWARD else 0
        kind = PassKind.FAILED if self.held.failure() is not None else self.kind
        row = make_row(self.passes, kind, wants, ready)
        self._rounds.append(_Round(tuple(wants), self.comm.each_rank(row)))

    def agree_on_call(self, call: Call, facts: Sequence[int] = ()) -> None:
        """A call row after every round issued so far; raises `DivergedRanksError` on every
        rank if the ranks are not all in this call."""
        self._rounds.append(_Round((), self.comm.each_rank(call_row(self.passes, call, facts))))
        self._read_all()
        self.launch_all()  # the call's own collectives come next: no gather agreed before may be left

    def asked(self, unit: int) -> bool:
        """Whether this rank asked for ``unit`` in a round it has not read yet, or the gather
        of ``unit`` is agreed and not launched here yet."""
        return any(unit in round_.wants for round_ in self._rounds) or self._queued(unit)

    @property
    def diverged(self) -> bool:
        return bool(self.divergence)

    def check_usable(self) -> None:
        """After a divergence the ranks have launched different numbers of gathers, so no later
        collective of this engine can pair up: every call raises at once, on every rank,
        instead of issuing one (on NCCL an unmatched kernel would spin until the watchdog)."""
        if self.divergence:
            raise DivergedRanksError(f"{self.divergence} (raised earlier; this engine cannot go on)")

    def may_wait_for(self, reduction: int) -> bool | None:
        """`launched_everywhere`, and never after a divergence (the others may never launch it)."""
        return False if self.divergence else self.launched_everywhere(reduction)

    def launched_everywhere(self, reduction: int) -> bool | None:
        """Whether the rows say every rank has launched ``reduction`` (in the reducer's order),
        reading the rounds that have arrived. None while rounds this rank issued are still in
        flight and may say so; the caller may keep asking, which is waiting for a round, so
        only while no agreed gather is queued (waiting would first launch it: a prefetch
        earlier than planned). False when this rank cannot learn more now. (A hybrid
        reduction's cross-group phase is launched by no host, `zero_engine.comm.handles.TwoPhase`:
        one every rank launched completes whatever the hosts wait for.)"""
        self._read_arrived()
        if self.agreed_ready > reduction:
            if self.comm.orders_on_device:
                # NCCL: the wait orders this rank's stream, and every gather launched after it
                # queues behind the reduction, which on another rank may follow a gather agreed
                # here and not launched yet: launch them all first (a prefetch earlier than
                # planned), so none is left behind the wait.
                self.launch_all()
            return True
        if not self._rounds or self._events:
            return False
        return None

    def need(self, unit: int) -> None:
        """Launch the gather of ``unit`` (and every gather queued before it), agreeing on it
        first if no round has yet."""
        self._read_arrived()
        if not self._queued(unit):
            self._read_all()  # may launch ``unit`` already: everything is launched before a wait
            if self.is_gathered(unit):
                return
        if not self._queued(unit):
            self.issue([unit])
            self._read_all()
            if self.is_gathered(unit) and not self._queued(unit):
                return
        while self._events:
            event = self._events.popleft()
            self.launch_gather(event.index, event.wanted)
            if event.index == unit:
                return
        raise AssertionError(f"unit {unit} was asked for but not agreed on")  # our own row wants it

    def launch_all(self) -> None:
        """Launch every agreed gather: before this rank blocks, nobody may be left waiting for it."""
        while self._events:
            event = self._events.popleft()
            self.launch_gather(event.index, event.wanted)

    def queued(self, unit: int) -> bool:
        """Whether the gather of ``unit`` is agreed and not launched here yet (reading the
        rounds that have arrived)."""
        self._read_arrived()
        return self._queued(unit)

    def _queued(self, unit: int) -> bool:
        return any(event.index == unit for event in self._events)

    def _read_arrived(self) -> None:
        """Read the rounds every rank has sent already, in order, without waiting."""
        while self._rounds and self._rounds[0].agreement.arrived():
            self._read_next()

    def _read_all(self) -> list[list[int]]:
        """Read every round issued here, in order (waiting for the other ranks where needed),
        and return the last one's rows."""
        rows: list[list[int]] = []
        while self._rounds:
            if not self._rounds[0].agreement.arrived():
                self.launch_all()
            rows = self._read_next()
        return rows

    def _read_next(self) -> list[list[int]]:
        round_ = self._rounds.popleft()
        rows = round_.agreement.values()
        if self.divergence:
            return rows
        self._check_same_pass(rows)
        if rows[0][1] == PassKind.CALL:  # the same call on every rank: nothing to gather
            return rows
        self.agreed_ready = max(self.agreed_ready, min(row[3] for row in rows))
        wants = [row_wants(row) for row in rows]
        agreed: dict[int, None] = {}  # each rank's first wants, then their second ones, ...
        for position in range(WANTS_PER_ROW):
            agreed.update((row[position], None) for row in wants if position < len(row))
        for unit in agreed:
            self._events.append(_Event(unit, unit in round_.wants))
        return rows

    # -- ranks in different passes ---------------------------------------------------------------

    def _check_same_pass(self, rows: list[list[int]]) -> None:
        failed = [rank for rank, row in enumerate(rows) if row[1] == PassKind.FAILED]
        message = self.held.failure_message(
            f"rank {', '.join(map(str, failed))}", " (a read for a gather, which filled zeros there)"
        ) if failed else None
        message = message or call_divergence(rows, self.describe_unit) or self._pass_divergence(rows)
        if message is None:
            return
        self.divergence = message
        # Every rank agreed on the events of the earlier rounds and may be waiting for one of
        # them: launch them all, so each rank gets to read this round and raise too; then
        # (NCCL) drop what no other rank will match.
        self.launch_all()
        self._rounds.clear()
        self.divergence += self.comm.abort_data_groups()
        if failed:
            raise self.held.agreed_error(self.divergence)
        raise DivergedRanksError(self.divergence)

    def _pass_divergence(self, rows: list[list[int]]) -> str | None:
        """The message when the rows come from different passes; None when they do not."""
        passes = {row[0] for row in rows}
        kinds = {row[1] for row in rows} - {int(PassKind.BETWEEN)}
        if len(passes) == 1 and len(kinds) <= 1:
            return None
        return (
            f"stage 3 ranks diverged: {describe_rows(rows, self.describe_unit)}. Ranks may run different modules within a pass, but every "
            "rank must run the same passes (forwards and backwards through the model) in the same order. The "
            "ranks' collectives are now out of step: end the job"
        )
