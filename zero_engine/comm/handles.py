"""Handles of collectives in flight: what a caller waits for, and when.

A collective returns a `Pending` (torch's work objects, waited for together), a `Finishing`
(a pending collective and what to do once it is done: decode, copy out) or a `TwoPhase` (a
hybrid reduction: within the shard group, then across replicas, the second launched once the
first is done, by a starter that no host wait holds up: a side stream on NCCL, a thread on
gloo). Nothing here calls ``torch.distributed``: codecs and reducers import this module alone,
and the groups (`zero_engine.comm.groups`) make the handles.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any, NamedTuple, Protocol

import torch


class CollectiveKind(str, Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_GATHER_FROZEN = "all_gather_frozen"  # stage 3's gathers of frozen units, apart from the trainable ones
    BROADCAST = "broadcast"
    GATHER = "gather"
    ALL_TO_ALL = "all_to_all"  # Ulysses: sequence slices for heads and back
    MATRIX_EXCHANGE = "matrix_exchange"  # whole-matrix optimizers (Muon): pieces to a matrix's owner and back


class Pending(NamedTuple):
    """Collectives in flight; `wait` blocks until all of them are done."""

    works: tuple[Any, ...] = ()

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def done(self) -> bool:
        """Completed, without waiting."""
        return all(work.is_completed() for work in self.works)


class Finishing:
    """Collectives in flight and the local work, if any, that completes their result once
    they are done (decoding a quantized buffer into place, `zero_engine.sharding.shards.codec`);
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

    def done(self) -> bool:
        """The collectives completed (the finishing work runs at `wait`), without waiting."""
        return self.pending.done()


class TwoPhase:
    """A collective whose second phase needs the first one's result (hybrid sharding: the
    shard across groups once the group has reduced it). ``starter`` launches the second phase
    as soon as it can, never behind a wait of this rank's host, so a replica waiting for it
    never waits for whatever this rank blocks on (`OnSideStream` on NCCL, `SecondPhaseThread`
    on gloo); `wait` waits for both phases."""

    def __init__(
        self,
        first: Pending | Finishing,
        second: Callable[[], Pending | Finishing],
        starter: SecondPhaseStarter,
        device: torch.device | None = None,
    ) -> None:
        self.first = first
        self.device = device  # where its tensors live (the side stream is that device's)
        self._second: Callable[[], Pending | Finishing] | None = second
        self.second: Pending | Finishing | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        starter.start(self)

    def done(self) -> bool:
        """Both phases completed, without waiting."""
        return self._started.is_set() and self.second is not None and self.second.done()

    def wait(self) -> None:
        self._started.wait()
        if self._error is not None:
            raise self._error
        assert self.second is not None
        self.second.wait()

    def start_second(self) -> None:
        """The starter's call: wait for the first phase (on NCCL this orders the side stream,
        on gloo it blocks the starter's thread), then launch the second. An error is raised
        to whoever waits for the reduction."""
        launch, self._second = self._second, None  # what it holds (buckets, units) is not kept
        try:
            self.first.wait()
            self.second = launch()
        except BaseException as error:  # noqa: BLE001 - raised again by `wait`
            self._error = error
        finally:
            self._started.set()


class SecondPhaseStarter(Protocol):
    def start(self, reduction: TwoPhase) -> None: ...


class OnSideStream:
    """NCCL: the second phase is launched at once, on a side stream (`second_phase_stream`).
    There ``is_completed()`` reflects GPU completion, which the host is ahead of, and ``wait()``
    on an NCCL work makes the *current* stream wait: the side stream waits for the first phase
    and the compute stream goes on, so backward kernels are never queued behind a
    reduce-scatter (which serialized backward and, at stage 3, closed a cycle with the gathers
    queued behind it: a GPU hang). `TwoPhase.wait` makes the compute stream wait for the second
    phase's collective itself, never for the side stream, whose queue by then holds the waits
    for later reductions too."""

    def start(self, reduction: TwoPhase) -> None:
        with second_phase_stream(reduction.device):
            reduction.start_second()


ON_SIDE_STREAM = OnSideStream()


class SecondPhaseThread:
    """gloo: a thread of the rank's own launches the second phases, each once its first phase
    has completed, in launch order (the same order on every rank). The host cannot do it: a
    rank blocked on a gather would leave its replicas waiting for the second phase, while the
    gather waits for a shard-group peer that is itself waiting for a second phase (four ranks
    in two groups closed that cycle: a gloo timeout). On the thread, a reduction every rank has
    launched completes whatever the hosts wait for, as on NCCL's side stream. The thread lives
    while there is work and `LINGER_S` after, then ends (a later reduction starts another)."""

    LINGER_S = 1.0

    def __init__(self) -> None:
        self._queue: deque[TwoPhase] = deque()
        self._ready = threading.Condition()
        self._running = False

    def start(self, reduction: TwoPhase) -> None:
        with self._ready:
            self._queue.append(reduction)
            if self._running:
                self._ready.notify()
                return
            self._running = True
        threading.Thread(target=self._run, name="zero_engine second phases", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._ready:
                if not self._queue:
                    self._ready.wait(timeout=self.LINGER_S)
                if not self._queue:
                    self._running = False
                    return
                reduction = self._queue.popleft()
            reduction.start_second()
            del reduction  # a lingering thread keeps no reduction (and its buffers) alive


DONE = Pending()


@contextlib.contextmanager
def second_phase_stream(device: torch.device | None = None) -> Iterator[None]:
    """Where the second phases of hybrid reductions run (`TwoPhase`): for tensors on a CUDA
    ``device``, that device's side stream, which first waits for the device's current stream;
    elsewhere the current stream (nothing to order)."""
    if device is None or device.type != "cuda":
        yield
        return
    with _cuda_side_stream(device):
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
def _cuda_side_stream(device: torch.device) -> Iterator[None]:
    """CUDA only: ``device``'s side stream, current for the block, after waiting for the
    device's current stream (what the block reads was written there). The device is the
    tensors', not the calling thread's current one: a training step run on a worker thread
    whose current device is GPU 0 would otherwise wait on GPU 0's stream and leave the second
    phase on the compute stream (GPU review Q7). Tensors made in the block belong to the side
    stream's pool; one read later on another stream is marked (`used_on_current_stream`)."""
    with torch.cuda.device(device):
        current = torch.cuda.current_stream(device)
        side = _cuda_side_stream_of(device.index if device.index is not None else current.device.index)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            yield


def _cuda_record_stream(tensor: torch.Tensor) -> None:
    tensor.record_stream(torch.cuda.current_stream(tensor.device))


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
