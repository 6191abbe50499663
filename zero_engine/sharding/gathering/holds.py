"""Stage 3: who holds each gathered unit, and why; a unit nobody holds is resharded.

A unit is gathered while at least one reason holds it (`HoldReason`), and each reason counts
its own holds, so one reason letting go never frees a unit another still needs:

- ``FORWARD``: a module that uses the unit is running its forward (nested and tied uses
  count, sharing one gather);
- ``BACKWARD``: a trainable unit's backward began and some parameter of it still lacks its
  gradient (one hold; the reducer ends it, `ParamGatherer.unit_complete`); the root's units are
  held so from the end of a forward into the backward that starts with them;
- ``CALL``: a frozen unit, per call of a module that uses it whose backward began, until that
  call's post-backward signal (`PostBackward`) runs; it gets no gradient to end a hold;
- ``USER``: code outside the hooks asked for the unit whole (`ParamGatherer.hold`), counted so
  nested and overlapping holds release on the outermost exit only.

A new reason is a member here: `ParamGatherer.hold` and `ParamGatherer.release` take any.
`GatheredUnits` applies the rule: it reshards a unit when its last hold goes, frees what only
other ranks wanted (served) or nobody holds at a pass's end, and counts the bytes gathered.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from ..units.frozen_unit import FrozenUnit
from ..units.unit import ShardedFlatUnit


class HoldReason(Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    CALL = "call"
    USER = "user"


# What a pass's end or a new forward lets go of: every reason the hooks take; a user's hold
# lasts until the user releases it.
PASS_REASONS = (HoldReason.FORWARD, HoldReason.BACKWARD, HoldReason.CALL)


class UnitHolds:
    """The holds on each of a gatherer's units, counted per reason."""

    def __init__(self, num_units: int) -> None:
        self._counts = [Counter[HoldReason]() for _ in range(num_units)]

    def take(self, index: int, reason: HoldReason) -> None:
        self._counts[index][reason] += 1

    def set(self, index: int, reason: HoldReason, held: bool) -> None:
        """A hold that does not count (``BACKWARD``): on or off."""
        self._counts[index][reason] = int(held)

    def drop(self, index: int, reason: HoldReason) -> bool:
        """Let one of ``reason``'s holds go (none held: nothing); whether the unit is held by
        nobody now."""
        counts = self._counts[index]
        counts[reason] = max(0, counts[reason] - 1)
        return not self.held(index)

    def count(self, index: int, reason: HoldReason) -> int:
        return self._counts[index][reason]

    def held(self, index: int) -> bool:
        return any(count > 0 for count in self._counts[index].values())

    def clear(self, reasons: tuple[HoldReason, ...] = PASS_REASONS) -> None:
        for counts in self._counts:
            for reason in reasons:
                counts[reason] = 0


class GatheredUnits:
    """A gatherer's units, what holds each, and the rule: a gathered unit nobody holds is
    resharded. ``diverged``: whether the ranks diverged (then a gather in flight is given up,
    not waited for); ``in_forward``: where a peak counts."""

    def __init__(
        self,
        units: Sequence[ShardedFlatUnit | FrozenUnit],
        diverged: Callable[[], bool],
        in_forward: Callable[[], bool],
    ) -> None:
        self.units = units
        self.holds = UnitHolds(len(units))
        self._diverged = diverged
        self._in_forward = in_forward
        self._served: set[int] = set()  # gathered only because other ranks wanted them
        self.peak_forward_bytes = 0
        self.peak_backward_bytes = 0

    def release(self, index: int, reason: HoldReason, keep: bool = False) -> None:
        """One of ``reason``'s holds goes; reshard the unit if nobody holds it (unless ``keep``)."""
        if self.holds.drop(index, reason) and not keep and self.units[index].has_full_storage:
            self.reshard(index)

    def complete(self, index: int) -> None:
        """Wait for the unit's gather, if one is in flight (not after a divergence, when the
        other ranks may never send)."""
        self.units[index].wait_for_unshard(wait=not self._diverged())

    def reshard(self, index: int) -> None:
        self.complete(index)
        self.units[index].reshard()

    def launched(self, index: int, wanted: bool) -> None:
        """A gather was launched; one only other ranks wanted is freed at this rank's next
        module hook unless something here holds it by then (`free_served`)."""
        if not wanted:
            self._served.add(index)
        self.note_peak()

    def free_served(self) -> None:
        for index in self._served:
            if not self.holds.held(index) and self.units[index].has_full_storage:
                self.reshard(index)
        self._served.clear()

    def free_unheld(self, wait: bool = False) -> None:
        """Free every gathered unit nobody here holds (``wait``: let its gather complete first,
        rather than abandon the buffer to it)."""
        self._served.clear()
        for index, unit in enumerate(self.units):
            if unit.has_full_storage and not self.holds.held(index):
                if wait:
                    unit.wait_for_unshard()
                self.reshard(index)

    def full(self) -> list[bool]:
        return [unit.has_full_storage for unit in self.units]

    def check_resharded(self, call: str) -> None:
        """Before ``call`` writes the shards (the optimizer step): no unit is gathered that
        nothing holds, which would be a gather launched between the backward and the step,
        carrying the shards from before it into the next forward."""
        stray = [self.describe(index) for index, full in enumerate(self.full()) if full and not self.holds.held(index)]
        if stray:
            raise RuntimeError(
                f"engine.{call}: {', '.join(stray)} gathered with nothing holding it, after the backward's end "
                "freed every unit: a gather was launched between the backward and the step, and would carry "
                "the parameters from before the step into the next forward (an engine defect: please report it)"
            )

    def describe(self, index: int) -> str:
        if 0 <= index < len(self.units):
            return f"unit {self.units[index].label!r}"
        return f"an unknown unit ({index})"

    def live_bytes(self) -> int:
        return sum(unit.gathered_bytes for unit in self.units if unit.has_full_storage)

    def begin_peak(self, forward: bool) -> None:
        if forward:
            self.peak_forward_bytes = self.live_bytes()
        else:
            self.peak_backward_bytes = self.live_bytes()

    def note_peak(self) -> None:
        live = self.live_bytes()
        if self._in_forward():
            self.peak_forward_bytes = max(self.peak_forward_bytes, live)
        else:
            self.peak_backward_bytes = max(self.peak_backward_bytes, live)


@dataclass(eq=False)
class ModuleCall:
    """One call of a hooked module: the frozen units it needs, and where its backward is."""

    frozen: tuple[int, ...]
    backward_started: bool = False
    backward_done: bool = False


def signal_post_backward(
    on_backward: Callable[[], None], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A module call's arguments with the input tensors that need a gradient passed through
    `PostBackward`, whose backward calls ``on_backward`` (None: no input needs one, so no
    signal will come; the backward's end frees what the call held)."""
    flat = [*args, *kwargs.values()]
    positions = [i for i, value in enumerate(flat) if isinstance(value, torch.Tensor) and value.requires_grad]
    if not positions:
        return None
    passed = PostBackward.apply(on_backward, *[flat[i] for i in positions])
    for i, tensor in zip(positions, passed):
        flat[i] = tensor
    return tuple(flat[: len(args)]), dict(zip(kwargs, flat[len(args) :]))


class PostBackward(torch.autograd.Function):
    """Identity over a module call's inputs; its backward runs once their gradients are
    computed, i.e. after every operation of the call (FSDP2's ``RegisterPostBackwardFunction``)."""

    @staticmethod
    def forward(ctx: Any, on_backward: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.on_backward = on_backward
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.on_backward()
        return (None, *grads)


class PassRecord:
    """The units a gatherer's passes used: this forward's, in first-use order; the last complete
    forward's order, which prefetching follows; and those that ran in a forward since the last
    backward ended, the only ones that can get gradients in the backwards that follow (several
    may, of forwards run before them)."""

    def __init__(self) -> None:
        self._ran: set[int] = set()
        self._backward_ended = False
        self._order: list[int] = []
        self.recorded: list[int] = []

    def forward_begins(self) -> None:
        if self._backward_ended:
            self._ran, self._backward_ended = set(), False
        self._order = []

    def used(self, index: int) -> None:
        self._ran.add(index)
        if index not in self._order:
            self._order.append(index)

    def forward_ends(self) -> None:
        if self._order:
            self.recorded = self._order

    def backward_ends(self) -> None:
        self._backward_ended = True

    def ran(self, index: int) -> bool:
        return index in self._ran
