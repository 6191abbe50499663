"""A rank's swap file for NVMe offload, and what bounds the host memory around it.

- `SwapFile`: one file per rank (made with ``O_EXCL``, so no two ranks or engines share one,
  removed on close), regions allocated as shards are first written; transfers are ``os.pwrite``
  and ``os.preadv`` straight from and into the tensors' memory (no compiled op, no copy), each
  followed by dropping the pages from the page cache (after ``fdatasync`` for a write), so what
  is offloaded is not kept in RAM by the kernel instead;
- `SwapSpace`: the file, a read thread and a write thread (a shard's read waits for its own last
  write, never for another shard's) and ``buffer_count`` slots: at most that many shards are in
  host memory at once (the one stepping, the next one read ahead, the last ones being written
  behind); with the host buffers step gradients cross in (`GradBuffers`) and parameter shards
  are read into (`ReadBuffers`).

What lives in the file, and when it is in host memory, is the kinds' business: the masters and
parameter shards in `zero_engine.sharding.tiers.nvme`, the step gradient in
`zero_engine.sharding.tiers.nvme_gradient`.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import re
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from ... import offload
from ...devices import HOST

ALIGN = 4096  # regions start on page boundaries
PREFIX = "zero_engine-"


def remove_stale(directory: str | Path) -> list[Path]:
    """Remove the swap files that processes of this host left when they died (a rank killed
    mid-step cannot remove its own); returns them. Files of live processes, and of other hosts
    sharing the directory, are left alone."""
    pattern = re.compile(re.escape(PREFIX + socket.gethostname()) + r"-rank\d+-pid(\d+)-[0-9a-f]+\.swap$")
    removed = []
    for path in Path(directory).iterdir():
        found = pattern.match(path.name)
        if found and not _alive(int(found.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _memory_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as a writable buffer (no numpy, no copy); ``tensor`` is contiguous."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class SwapFile:
    """One rank's swap file and the bytes moved through it."""

    def __init__(self, directory: str | Path, rank: int) -> None:
        self.path = Path(directory) / f"{PREFIX}{socket.gethostname()}-rank{rank}-pid{os.getpid()}-{id(self):x}.swap"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        _left_at_exit.add(self.path)  # removed at the interpreter's exit unless closed before
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead past a region
        self.end = 0
        self.bytes_read = 0
        self.bytes_written = 0
        # The first read or write that failed, on whichever thread: the step agrees on it across
        # ranks (`zero_engine.step.OptimizerStep`), so that every rank raises, not this one alone.
        self.failure: OSError | None = None

    def allocate(self, nbytes: int) -> int:
        offset = self.end
        self.end += -(-nbytes // ALIGN) * ALIGN
        return offset

    def write(self, regions: list[tuple[int, torch.Tensor]]) -> None:
        """Each tensor to its region, then one ``fdatasync`` (dirty pages cannot be dropped) and
        the regions' pages dropped. Whole pages only: a partial last page is padded (writing part
        of a page that is not cached makes the kernel read it from the disk first)."""
        with self._recorded():
            self._write_regions(regions)

    def _write_regions(self, regions: list[tuple[int, torch.Tensor]]) -> None:
        for offset, tensor in regions:
            view = _memory_of(tensor)
            whole = len(view) // ALIGN * ALIGN
            self._write_all(view[:whole], offset)
            if whole < len(view):
                page = bytearray(ALIGN)
                page[: len(view) - whole] = view[whole:]
                self._write_all(memoryview(page), offset + whole)
            self.bytes_written += len(view)
        os.fdatasync(self.fd)
        for offset, tensor in regions:
            self._drop(offset, tensor.numel() * tensor.element_size())

    def _write_all(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def read(self, offset: int, tensor: torch.Tensor) -> None:
        view, done = _memory_of(tensor), 0
        with self._recorded():
            while done < len(view):
                count = os.preadv(self.fd, [view[done:]], offset + done)
                if count == 0:
                    raise OSError(f"{self.path}: {len(view) - done} bytes missing at offset {offset + done}")
                done += count
            self._drop(offset, len(view))
        self.bytes_read += len(view)

    @contextmanager
    def _recorded(self) -> Iterator[None]:
        """Keep the first failure (`failure`), then let it raise where it happened."""
        try:
            yield
        except OSError as err:
            if self.failure is None:
                self.failure = err
            raise

    def _drop(self, offset: int, nbytes: int) -> None:
        """Out of the page cache: the whole pages of the region (a partial last page would stay)."""
        os.posix_fadvise(self.fd, offset, -(-nbytes // ALIGN) * ALIGN, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.path.unlink(missing_ok=True)
        _left_at_exit.discard(self.path)


# Swap files of this process not closed yet: a script that never calls engine.close() (the
# README's loop) would leave them on the disk at its end, the size of its optimizer state; they
# are removed when the interpreter exits (a killed job's are removed by the next job's start,
# `remove_stale`).
_left_at_exit: set[Path] = set()


@atexit.register
def _remove_left_swap_files() -> None:
    for path in list(_left_at_exit):
        path.unlink(missing_ok=True)
    _left_at_exit.clear()


class SwapSpace:
    """A rank's swap file, its I/O thread, and the slots bounding the shards held in memory: a
    held resource (`zero_engine.sharding.tiers.held.Held`) the build registers, so the loop
    counts, reports, agrees on and closes it without naming NVMe."""

    kind = "nvme"
    what = "NVMe offload: a swap file's read or write"
    consequence = "The engine cannot go on (its state lives in those files): load the last checkpoint into a new engine"

    def __init__(
        self, directory: str | Path, rank: int, buffer_count: int, device: torch.device | None = None,
        *, step_read_ahead: bool = False,
    ) -> None:
        remove_stale(directory)
        self.file = SwapFile(directory, rank)
        self.device = device or HOST  # the engine's: where the copies out of and into its buffers run
        # One thread reads, one writes, so a shard's read-ahead need not queue behind the last
        # shard's write; a read of a shard still waits for that shard's own write. Each starts on
        # the rank's device (GPU review R4): its first CUDA call (an event's wait) would otherwise
        # make a context on GPU 0, on every rank.
        start = functools.partial(on_device, device)
        self.readers = ThreadPoolExecutor(1, thread_name_prefix="zero_engine-nvme-read", initializer=start)
        self.writers = ThreadPoolExecutor(1, thread_name_prefix="zero_engine-nvme-write", initializer=start)
        self.slots = threading.Semaphore(buffer_count)
        self.buffer_count = buffer_count
        self.grad_buffers = GradBuffers(buffer_count)  # step gradients on their way in (`NvmeGrad`)
        self.shard_buffers = ReadBuffers(buffer_count + 1)  # shards and step gradients read, given back after use
        self.requested = [0, 0]  # bytes asked to be read and written (a write completes behind the step)
        self._reported = (0, 0)
        # the masters' space: the step's first shards read during the last pass, one slot kept free
        self.step_read_ahead = buffer_count - 1 if step_read_ahead else 0

    @property
    def host_bytes(self) -> int:
        """The host buffers gradients cross in and shards and gradients are read into."""
        return self.grad_buffers.nbytes + self.shard_buffers.nbytes

    def failure(self) -> OSError | None:
        return self.file.failure

    def error(self, message: str) -> Exception:
        from ...errors import SwapError

        return SwapError(message)

    def drain(self) -> None:
        """Wait for every read and write submitted so far."""
        self.writers.submit(lambda: None).result()
        self.readers.submit(lambda: None).result()

    def report(self) -> dict[str, int]:
        """Bytes read from and written to the swap file since `reset_report`."""
        read, written = self._reported
        return {"read": self.requested[0] - read, "written": self.requested[1] - written}

    def reset_report(self) -> None:
        self._reported = (self.requested[0], self.requested[1])

    def close(self) -> None:
        self.readers.shutdown(wait=True)
        self.writers.shutdown(wait=True)
        self.file.close()
        self.grad_buffers.clear()  # a closed engine holds no host memory, whoever still holds it
        self.shard_buffers.clear()


def on_device(device: torch.device | None) -> None:
    """A thread's first step: make ``device`` its current CUDA device (elsewhere, nothing)."""
    if device is not None and device.type == "cuda":
        _set_cuda_device(device)


def _set_cuda_device(device: torch.device) -> None:
    torch.cuda.set_device(device)


class ReadBuffers:
    """The host buffers parameter shards and step gradients are read into: ``count`` of the
    largest region's bytes (`fit`; as many whatever the count of units, so host memory does
    not grow with the model's depth), made once every unit is built
    (`allocate`), each handed out as a view of the size asked (`take`) and given back after use
    (`give`). Made once, reads do not churn the heap (on a CPU glibc kept each freed buffer
    between the device's own allocations and the resident high-water grew with the count of
    units), and made pinned where CUDA is (DeepSpeed's swap buffers are too): a gather's copy
    from one then runs beside the device's work instead of making the host wait for everything
    queued (GPU review R3). A buffer is given back with the wait for the copy that reads it
    (CUDA's event), and the next read into it waits for that first, on the thread that fills
    it: no copy in flight is overwritten. ``count`` is the space's ``buffer_count`` and one: the
    slots bound the reads ahead and writes behind, and one more is read there and then (a
    gather's without a read ahead, a step gradient's sum on the write thread). None free: a
    pageable one is made, dropped when given back (a wait could close a cycle with the reads
    ahead that hold the others)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.nbytes_each = 0
        self._made: dict[int, torch.Tensor] = {}  # by address: the pool's own buffers (uint8)
        self._free: deque[tuple[torch.Tensor, Callable[[], None]]] = deque()
        self._lock = threading.Lock()

    def fit(self, numel: int, dtype: torch.dtype) -> None:
        self.nbytes_each = max(self.nbytes_each, numel * dtype.itemsize)

    def allocate(self) -> None:
        if self.nbytes_each and not self._made:
            made = [offload.host_empty(self.nbytes_each, torch.uint8, offload.PIN_CROSSING) for _ in range(self.count)]
            self._made = {buffer.data_ptr(): buffer for buffer in made}
            self._free = deque((buffer, offload.nothing_to_wait_for) for buffer in made)

    @property
    def nbytes(self) -> int:
        """The pool's buffers, free or taken (what holds a taken one counts it only if it is
        not the pool's: `owns`)."""
        return sum(offload.held_bytes(buffer) for buffer in self._made.values())

    def owns(self, buffer: torch.Tensor) -> bool:
        return buffer.data_ptr() in self._made

    def take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Callable[[], None]]:
        """A host buffer of ``numel`` ``dtype`` values, and the wait to call before filling it."""
        nbytes = numel * dtype.itemsize
        self.allocate()
        with self._lock:
            if self._free and nbytes <= self.nbytes_each:
                buffer, copied = self._free.popleft()  # the oldest given back: its copy most likely done
                return buffer[:nbytes].view(dtype), copied
        # pageable: a page-locked allocation inside a pass would wait for the whole device, every
        # stream's collectives included (CUDA's implicit synchronizations), a hang where another
        # rank's progress waits on this one's launches
        return offload.host_empty(numel, dtype, False), offload.nothing_to_wait_for

    def give(self, buffer: torch.Tensor, copied: Callable[[], None] | None = None) -> None:
        """``buffer`` (from `take`) back, once ``copied`` (the wait for a copy that reads it) returns."""
        with self._lock:
            own = self._made.get(buffer.data_ptr())
            if own is not None:
                self._free.append((own, copied or offload.nothing_to_wait_for))

    def clear(self) -> None:
        with self._lock:
            self._made, self._free = {}, deque()


class GradBuffers:
    """The host buffers reduced gradients cross in on their way to the swap file: ``count`` (at
    most one per gradient) of the largest gradient shard's size (`fit`), made once every unit is
    built (`allocate`: pinned where CUDA is, never inside a backward), each taken by a reduction
    and given back by its write. A reduction finding none free waits for the oldest write: the
    disk paces the backward rather than host memory growing. It cannot wait for ever: a write
    waits only for its own copy, queued on the device before the reduction that waits."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.numel = 0
        self.gradients = 0  # fitted
        self._made: list[torch.Tensor] = []
        self._free: list[torch.Tensor] = []
        self._given_back = threading.Condition()

    def fit(self, numel: int) -> None:
        self.numel = max(self.numel, numel)
        self.gradients += 1

    def allocate(self) -> None:
        if self.numel and not self._made:
            self._made = [
                offload.host_empty(self.numel, torch.float32, offload.PIN_CROSSING)
                for _ in range(min(self.count, self.gradients))
            ]
            self._free = list(self._made)

    @property
    def nbytes(self) -> int:
        return sum(offload.held_bytes(buffer) for buffer in self._made)

    def clear(self) -> None:
        self._made, self._free = [], []

    def take(self) -> torch.Tensor:
        self.allocate()
        with self._given_back:
            while not self._free:
                self._given_back.wait()
            return self._free.pop()

    def give(self, buffer: torch.Tensor) -> None:
        with self._given_back:
            self._free.append(buffer)
            self._given_back.notify()
