"""Handles of collectives in flight: what a caller waits for, and when.

A collective returns a `Pending` (torch's work objects, waited for together), a `Finishing`
(a pending collective and what to do once it is done: decode, copy out) or a `TwoPhase` (a
hybrid reduction: within the shard group, then across replicas, the second launched once the
first is done, on a side stream on CUDA). `advance_in_order` starts second phases in launch
order, the same on every rank. Nothing here calls ``torch.distributed``: codecs and reducers
import this module alone, and the groups (`zero_engine.comm.groups`) make the handles.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from enum import Enum
from typing import Any, NamedTuple

import torch


class CollectiveKind(str, Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_GATHER_FROZEN = "all_gather_frozen"  # stage 3's gathers of frozen units, apart from the trainable ones
    BROADCAST = "broadcast"
    GATHER = "gather"


class Pending(NamedTuple):
    """Collectives in flight; `wait` blocks until all of them are done."""

    works: tuple[Any, ...] = ()

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def advance(self) -> bool:
        """Everything is launched already (see `TwoPhase`)."""
        return True

    def launch_rest(self) -> None:
        """Everything is launched already (see `TwoPhase`)."""

    def done(self) -> bool:
        """Completed, without waiting."""
        return all(work.is_completed() for work in self.works)


class Finishing:
    """Collectives in flight and the local work, if any, that completes their result once
    they are done (decoding a quantized buffer into place, `zero_engine.sharding.codec`);
    `wait` runs it once. Stands wherever a `Pending` does."""

    def __init__(self, pending: Pending, finish: Callable[[], None] | None = None) -> None:
        self.pending = pending
        self._finish: Callable[[], None] | None = finish

    @property
    def works(self) -> tuple[Any, ...]:
        return self.pending.works

    def wait(self) -> None:
        self.pending.wait()
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    def advance(self) -> bool:
        return True

    def launch_rest(self) -> None:
        """Everything is launched already."""

    def done(self) -> bool:
        """The collectives completed (the finishing work runs at `wait`), without waiting."""
        return self.pending.done()


class TwoPhase:
    """A collective whose second phase needs the first one's result (hybrid sharding: the
    shard across groups once the group has reduced it). `advance` launches the second phase
    if the first has completed, without waiting; `wait` waits for both. Callers advance their
    reductions in launch order, stopping at the first not ready, so every rank launches the
    second phases in the same order.

    On NCCL (``start_now``) the second phase is launched at once, on a side stream
    (`second_phase_stream`): there ``is_completed()`` reflects GPU completion, which the host
    is ahead of, so polling would almost never succeed and every cross-group reduction would
    start after backward. ``wait()`` on an NCCL work makes the *current* stream wait, so the
    side stream waits for the first phase and the compute stream goes on: backward kernels
    are never queued behind a reduce-scatter (which serialized backward and, at stage 3,
    closed a cycle with the gathers queued behind it: a GPU hang). `wait` makes the compute
    stream wait for the second phase's collective itself, never for the side stream, whose
    queue by then holds the waits for later reductions too."""

    def __init__(
        self, first: Pending | Finishing, second: Callable[[], Pending | Finishing], *, start_now: bool = False
    ) -> None:
        self.first, self._second = first, second
        self.second: Pending | Finishing | None = None
        if start_now:  # NCCL (`Comm.orders_on_device`): the device orders the phases
            with second_phase_stream():
                self._start_second()

    def advance(self) -> bool:
        if self.second is None and all(work.is_completed() for work in self.first.works):
            self._start_second()
        return self.second is not None

    def done(self) -> bool:
        """Both phases completed, without waiting (starts the second if the first has)."""
        return self.advance() and self.second is not None and self.second.done()

    def launch_rest(self) -> None:
        """Launch the second phase now, waiting for the first if it has not completed."""
        if self.second is None:
            self._start_second()

    def wait(self) -> None:
        self.launch_rest()
        assert self.second is not None
        self.second.wait()

    def _start_second(self) -> None:
        self.first.wait()  # done already when advanced; on NCCL this orders the side stream
        self.second = self._second()


DONE = Pending()


@contextlib.contextmanager
def second_phase_stream() -> Iterator[None]:
    """Where the second phases of hybrid reductions run (`TwoPhase`): on CUDA a side stream
    that first waits for the current one; elsewhere the current stream (nothing to order)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        yield
        return
    with _cuda_side_stream():
        yield


def used_on_current_stream(tensor: torch.Tensor) -> None:
    """``tensor`` was made on the side stream and is read on the current one (a second phase's
    encoded buffer, decoded after its wait): CUDA must not hand its memory back to the side
    stream before the current stream is done with it. Elsewhere nothing to do."""
    if tensor.is_cuda:
        _cuda_record_stream(tensor)


_SIDE_STREAMS: dict[int, Any] = {}


def _cuda_side_stream_of(device: int) -> Any:
    """CUDA only: the device's side stream for second phases, made once."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


@contextlib.contextmanager
def _cuda_side_stream() -> Iterator[None]:
    """CUDA only: the side stream, current for the block, after waiting for the current stream
    (what the block reads was written there). Tensors made in the block belong to the side
    stream's pool; one read later on another stream is marked (`used_on_current_stream`)."""
    current = torch.cuda.current_stream()
    side = _cuda_side_stream_of(current.device.index)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield


def _cuda_record_stream(tensor: torch.Tensor) -> None:
    tensor.record_stream(torch.cuda.current_stream(tensor.device))


def advance_in_order(reductions: Iterable[Pending | Finishing | TwoPhase]) -> None:
    """Start the second phase of reductions whose first is done, in launch order, stopping at
    the first not ready: the same order on every rank, and crossing groups overlaps whatever
    the caller does next."""
    for reduction in reductions:
        if not reduction.advance():
            break


class EachRank(NamedTuple):
    """Every rank's small integer (or row of them), summed into its own slot; `values` waits
    for them, `arrived` says without waiting whether every rank has sent its own."""

    slots: torch.Tensor
    pending: Pending

    def values(self) -> list[Any]:
        self.pending.wait()
        return self.slots.tolist()

    def arrived(self) -> bool:
        return self.pending.done()
