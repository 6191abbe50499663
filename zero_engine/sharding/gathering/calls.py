"""Call rows: a collective call made on some ranks only is caught on every rank.

The engine's collective calls (``save_checkpoint``, ``load_checkpoint``, ``full_state_dict`` when
state is sharded, and at stages 0-2 every micro-step's first backward) open with a *call row*
on the control group, shaped like the agreement rounds' rows (`zero_engine.sharding.gathering.agreement`).
When rank 0 saves under ``if rank == 0:`` while rank 1 trains on, rank 0's call row meets rank
1's next row, both read the same mismatch, and both raise `DivergedRanksError` naming each
rank's call, instead of pairing the save's collectives with the next step's.

- Stages 0-2 (`CallGuard`): a training row is only sent at the backward's start; the backward
  issues no collective before its first reduction, which reads it (`before_reduction`), so the
  round completes behind the compute. Any other call reads its row at once: its own
  collectives come next. Every earlier row is read before a new one is sent, so at most one is
  unread, and after a divergence every rank has sent the same rows.
- Stage 3 (`PassCallGuard`): every pass sends rows of its own (its drain at least), and any of
  them pairs with another rank's call row, so training needs no row; a call's row goes after
  this rank's rounds in flight, and the gatherer then settles every unit sharded for the call.

After a divergence no later collective of the engine can pair up: every call raises at once,
on every rank (`check_usable`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...comm import Comm, EachRank
from ...errors import DivergedRanksError
from .agreement import Call, call_divergence, call_row
from .gatherer import ParamGatherer


class CallGuard:
    """Stages 0-2: call rows of their own on the control group."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.divergence = ""  # the DivergedRanksError's message once ranks were in different calls
        self._unread: EachRank | None = None  # a training row sent and not read yet

    @property
    def before_reduction(self) -> Callable[[], None]:
        """What the reducer calls before it launches a reduction: read the training row."""
        return self.read

    def agree(self, call: Call, count: int, facts: Sequence[int] = ()) -> None:
        """Raise `DivergedRanksError` on every rank unless every rank is in ``call`` after
        ``count`` micro-steps (with the same ``facts``, as `call_divergence` compares them); a
        training row is sent and read later (`read`)."""
        self.read()
        self._unread = self.comm.each_rank(call_row(count, call, facts))
        if call is not Call.TRAIN:
            self.read()

    def agree_at_once(self, call: Call, count: int, facts: Sequence[int] = ()) -> None:
        """``call``'s row, sent and read now, even a training one: for a call whose collectives
        are not the engine's reductions (a split forward's exchanges, `sequence_loss`'s sum)."""
        self.agree(call, count, facts)
        self.read()

    def read(self) -> None:
        """Read the row sent and not read yet, if any (waiting for the other ranks' where needed),
        before any other collective: raise `DivergedRanksError` if the rows are different calls
        (every rank reads that round, so every rank raises)."""
        self.check_usable()
        if self._unread is not None:
            rows, self._unread = self._unread.values(), None
            self.divergence = call_divergence(rows) or ""
            if self.divergence:
                self.divergence += self.comm.abort_data_groups()
            self.check_usable()

    def check_usable(self) -> None:
        if self.divergence:
            raise DivergedRanksError(self.divergence)


class PassCallGuard:
    """Stage 3: call rows among the gatherer's agreement rounds."""

    before_reduction = None  # the reductions' order is agreed in the rounds themselves

    def __init__(self, gatherer: ParamGatherer) -> None:
        self.gatherer = gatherer

    def agree(self, call: Call, count: int) -> None:
        """``count`` is the rounds' own (passes finished); training needs no row."""
        self.check_usable()
        if call is not Call.TRAIN:
            self.gatherer.schedule.agree_on_call(call)
            self.gatherer.settle_for_call()

    def agree_at_once(self, call: Call, count: int, facts: Sequence[int] = ()) -> None:
        """A row of ``call`` agreed now, shards left as they are (`CallGuard.agree_at_once`)."""
        self.check_usable()
        self.gatherer.schedule.agree_on_call(call, facts)

    def read(self) -> None:
        self.check_usable()

    def check_usable(self) -> None:
        """After a divergence the ranks have launched different numbers of gathers: on NCCL an
        unmatched kernel would spin until the watchdog."""
        self.gatherer.check_usable()
