"""Stage 3: which gathers to start before a module needs them, within the prefetch budgets.

A pass (forward or backward) runs the units in the order the last complete forward recorded
(backwards for a backward). When a module starts, the unit that follows it in that order is
gathered ahead, and the *window* after it (up to `WANTS_PER_ROW` units in a forward, one in a
backward) is proposed in one agreement round, so the round completes in the background and the
next prefetch launches without waiting. Two budgets bound it: ``stage3_prefetch_bucket_size``
(a larger unit is not prefetched; a window holds at most this many elements) and
``stage3_max_live_parameters`` (no prefetch or window that would exceed it, counting every
unit gathered or agreed). A guess that turns out wrong costs a wasted gather, never a wrong one.

The units it gathers next and proposes are asked to bring their shards in (`ParamShard.prefetch`:
on NVMe, a read ahead of the gather; nothing where the shard is in memory).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .agreement import WANTS_PER_ROW, CollectiveSchedule
from ..units.frozen_unit import FrozenUnit
from ..units.unit import ShardedFlatUnit


class Prefetcher:
    """Starts gathers ahead of the modules that need them, and proposes the windows to agree on."""

    def __init__(
        self,
        units: Sequence[ShardedFlatUnit | FrozenUnit],
        schedule: CollectiveSchedule,
        prefetch_numel: int,
        max_live_numel: int,
    ) -> None:
        self.units = units
        self.schedule = schedule
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel

    def after(self, needs: tuple[int, ...], order: list[int], window: int) -> bool:
        """Start gathering the unit that followed ``needs`` in ``order``, if it fits, and,
        when the one after it is not agreed yet, propose the window (of up to ``window`` units)
        that starts there; whether a round was issued.

        The backward proposes one unit at a time: it sends a row per unit anyway (each reports
        the reductions launched, which the reducer needs before it may wait for one), and a
        longer queue of agreed gathers would keep the reducer from waiting (it may not wait
        while a gather is queued), costing a gradient bucket more.

        Every decision to issue a round reads what is *claimed* (gathered, or agreed and not
        launched yet), never whether a gather was launched already: a rank launches agreed
        gathers early before it blocks, and the ranks must still issue the same rounds in the
        same order when they run the same modules, or the rounds would pair one rank's proposal
        with another's and gather units twice. Launching an agreed gather early is this rank's
        own choice: every rank launches the same sequence, each when it needs to."""
        positions = [order.index(index) for index in needs if index in order]
        if not positions:
            return False
        after = max(positions)
        if after + 1 < len(order) and not self.units[order[after + 1]].has_full_storage:
            following = order[after + 1]
            self.units[following].shard.prefetch()
            agreed = self.schedule.queued(following)
            if self._fits(following, counting=self._gathered if agreed else self._claimed):
                self.schedule.need(following)  # not agreed yet: a round first
        if after + 2 < len(order) and not self._claimed(order[after + 2]):
            proposal = self.window(order[after + 2 :], window)
            if proposal:
                self._read_ahead(proposal)
                self.schedule.issue(proposal)
                return True
        return False

    def propose_next_pass(self, recorded: list[int], root_units: tuple[int, ...], backward_follows: bool) -> None:
        """Propose the first window of the pass expected next, so it starts without waiting:
        a backward starts at the root's output and runs the recorded order backwards (its first
        two units: the rest one at a time, see `after`); a forward runs it forwards."""
        if self.schedule.divergence:
            return
        if backward_follows:
            window = self.window([*root_units, *reversed(recorded)], size=2)
        else:
            window = self.window(recorded)
        if window:
            self._read_ahead(window)
            self.schedule.issue(window)

    def _read_ahead(self, units: list[int]) -> None:
        for index in units:
            self.units[index].shard.prefetch()

    def window(self, expected: list[int], size: int = WANTS_PER_ROW) -> list[int]:
        """The units to propose in one round: the first unclaimed ones of ``expected``, at most
        ``size``, together within ``stage3_prefetch_bucket_size`` and, with every claimed unit,
        within ``stage3_max_live_parameters`` (a rank that blocks on a round launches everything
        agreed first)."""
        claimed = sum(unit.layout.padded_numel for i, unit in enumerate(self.units) if self._claimed(i))
        budget = min(self.prefetch_numel, self.max_live_numel - claimed)
        window: list[int] = []
        for index in dict.fromkeys(expected):
            if self._claimed(index):
                continue
            numel = self.units[index].layout.padded_numel
            if numel > budget or len(window) == size:
                break
            window.append(index)
            budget -= numel
        return window

    def _claimed(self, index: int) -> bool:
        return self.units[index].has_full_storage or self.schedule.asked(index)

    def _gathered(self, index: int) -> bool:
        return self.units[index].has_full_storage

    def _fits(self, index: int, counting: Callable[[int], bool]) -> bool:
        """Prefetching ``index`` stays within both limits, counting the units ``counting`` says."""
        numel = self.units[index].layout.padded_numel
        others = sum(unit.layout.padded_numel for i, unit in enumerate(self.units) if i != index and counting(i))
        return numel <= self.prefetch_numel and others + numel <= self.max_live_numel
