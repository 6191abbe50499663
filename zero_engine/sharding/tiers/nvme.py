"""NVMe offload (``device: nvme``) of the optimizer side (``offload_optimizer``: each unit's fp32
master and elementwise optimizer state live in this rank's swap file between steps, and in host
memory only around their shard's step) and of stage 3's parameter shards (``offload_param``: in
a swap file of their own, in host memory only from a read ahead of their gather to its use).
The swap file and its threads and slots: `zero_engine.sharding.tiers.swap`; the step gradient
there: `zero_engine.sharding.tiers.nvme_gradient`.

- `NvmeMaster`: the master's kind on NVMe. Between steps its tensors keep their identity (the
  optimizer's targets are views of the master, its state is keyed by them) but their storage is
  resized to nothing; `resident()` reads master and state back, and writes them behind after;
- `NvmeShard`: the parameter shard's kind on NVMe (`zero_engine.sharding.shards.param_shard`).

The values a step computes are the same as ``device: cpu``'s: the same host tensors, the same
kernels, only where they wait between steps differs.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ... import offload
from ...devices import HOST
from ...offload import Placed
from .nvme_gradient import NvmeGrad
from .placement import HostMaster
from .swap import SwapSpace


def _free(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _give_back_freed_pages() -> None:
    """Return the freed pages to the system: glibc keeps freed blocks in its heap (its mmap
    threshold grows after the first large free), where they would still count as resident."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: its allocator has no malloc_trim
    _LIBC = None


def _restore(tensor: torch.Tensor, nbytes: int) -> None:
    tensor.untyped_storage().resize_(nbytes)


class NvmeMaster(HostMaster):
    """The master of a unit's owned range, and its elementwise optimizer state, on NVMe between
    steps (see the module's docstring). ``states`` (`bind_state`) lists the state tensors to
    swap with it, by a key stable from step to step."""

    def __init__(self, values: torch.Tensor, publish_to: torch.Tensor | None, space: SwapSpace) -> None:
        super().__init__(values, publish_to)
        self.space = space
        self.nbytes_master = values.numel() * values.element_size()
        self.region = space.file.allocate(self.nbytes_master)
        self.state_regions: dict[Any, tuple[int, int]] = {}  # key -> (offset, bytes)
        self.swapped: list[tuple[Any, torch.Tensor]] = []  # the state tensors out with the master
        self.states: Callable[[], Iterable[tuple[Any, torch.Tensor]]] = lambda: ()
        self.status = "in"  # in, reading, writing, out
        self.future: Future | None = None
        space.slots.acquire()

    def bind_state(self, states: Callable[[], Iterable[tuple[Any, torch.Tensor]]]) -> None:
        self.states = states

    @property
    def nbytes(self) -> int:
        """The master's bytes in host memory now (none between steps)."""
        return self.tensor.untyped_storage().nbytes()

    @property
    def nvme_bytes(self) -> int:
        """The master's and its state's bytes in the swap file."""
        return self.nbytes_master + sum(nbytes for _, nbytes in self.state_regions.values())

    @property
    def host_bytes(self) -> int:
        """What of the master and its state is in host memory now."""
        held = [self.tensor, *(tensor for _, tensor in self.swapped)] if self.status != "out" else []
        return sum(tensor.untyped_storage().nbytes() for tensor in held)

    def settle(self) -> None:
        """After the targets were made (views of the master): out to the file."""
        self._send_out()

    def prefetch(self, wait_for_slot: bool = False) -> None:
        """Start reading master and state in (the next shard to step), after the shard's own
        last write: if a slot is free now, or (``wait_for_slot``: read ahead of the step, while
        writes behind the last one still hold the slots) as soon as one is, on the read thread."""
        if self.status not in ("out", "writing"):
            return
        if wait_for_slot:
            self._submit_read(acquire_on_read_thread=True)
        elif self.space.slots.acquire(blocking=False):
            self._submit_read()

    @contextmanager
    def resident(self) -> Iterator[torch.Tensor]:
        self._bring_in()
        try:
            yield self.tensor
        finally:
            self._send_out()

    def _bring_in(self) -> None:
        if self.status in ("out", "writing"):  # after its own write (the read thread waits for it)
            self.space.slots.acquire()
            self._submit_read()
        if self.status == "reading":
            assert self.future is not None
            self.future.result()
            self.status = "in"

    def _send_out(self) -> None:
        swapped = []
        for key, tensor in self.states():
            nbytes = tensor.numel() * tensor.element_size()
            if key not in self.state_regions:
                self.state_regions[key] = (self.space.file.allocate(nbytes), nbytes)
            if self.state_regions[key][1] != nbytes:
                raise RuntimeError(f"optimizer state {key!r} changed size on NVMe offload")
            swapped.append((key, tensor))
        self.swapped = swapped
        self.space.requested[1] += self._bytes()
        self.status, self.future = "writing", self.space.writers.submit(self._write_all)

    def _submit_read(self, acquire_on_read_thread: bool = False) -> None:
        """Queue the read, after the shard's last write; its slot taken already, or (read ahead
        of the step) by the read thread when one is free."""
        self.space.requested[0] += self._bytes()
        written = self.future if self.status == "writing" else None
        self.status, self.future = "reading", self.space.readers.submit(self._read_all, written, acquire_on_read_thread)

    def _bytes(self) -> int:
        return self.nbytes_master + sum(self.state_regions[key][1] for key, _ in self.swapped)

    def _write_all(self) -> None:
        """On the write thread: master and state to the file, then their memory freed."""
        try:
            self.space.file.write(
                [(self.region, self.tensor), *((self.state_regions[key][0], tensor) for key, tensor in self.swapped)]
            )
            _free(self.tensor)
            for _, tensor in self.swapped:
                _free(tensor)
            _give_back_freed_pages()
        finally:
            self.space.slots.release()

    def _read_all(self, written: Future | None, acquire: bool) -> None:
        """On the read thread, after the shard's last write (``written``) finished (and a slot
        is free, with ``acquire``): memory back, master and state read into it."""
        if written is not None:
            written.result()
        if acquire:
            self.space.slots.acquire()
        _restore(self.tensor, self.nbytes_master)
        self.space.file.read(self.region, self.tensor)
        for key, tensor in self.swapped:
            offset, nbytes = self.state_regions[key]
            _restore(tensor, nbytes)
            self.space.file.read(offset, tensor)


class NvmeShard:
    """``offload_param.device: nvme``: a stage 3 parameter shard in the rank's swap file
    (`zero_engine.sharding.shards.param_shard`). It is in host memory only from a read (ahead
    of its gather: `prefetch`; or when asked) to the use that takes it, and from a write until
    the write is done. Reads ahead and writes behind each take one of the space's slots (at
    most ``buffer_count`` shards in host memory for them); when none is free the read or write
    is done there and then instead, so nothing ever waits for a slot. A read waits for the
    shard's own last write; a write lets a read in flight finish first."""

    on_host = True  # its bytes cross from host memory in every gather
    tensor = None  # no tensor between uses: never an fp32 master's storage

    def __init__(self, values: torch.Tensor, space: SwapSpace) -> None:
        self.space = space
        self.numel, self.dtype = values.numel(), values.dtype
        self.nvme_bytes = self.numel * values.element_size()
        self.region = space.file.allocate(self.nvme_bytes)
        self.future: Future | None = None  # the last read or write submitted
        self.buffer: torch.Tensor | None = None  # a read's destination, from its submission to its use
        self.holds_slot = False  # the read in ``buffer`` took a slot
        space.shard_buffers.fit(self.numel, self.dtype)
        self._write(values.detach().to(HOST, copy=True).reshape(-1), pooled=False)

    @property
    def nbytes(self) -> int:
        """In memory between uses: a read ahead's buffer, if one is in and not the space's own
        (`swap.ReadBuffers` counts those)."""
        return 0 if self.buffer is None or self.space.shard_buffers.owns(self.buffer) else self.nvme_bytes

    host_bytes = nbytes

    def prefetch(self) -> None:
        """Start reading the shard for a gather to come, if a slot is free (else the gather reads it)."""
        if self.buffer is None and self.space.slots.acquire(blocking=False):
            self.space.requested[0] += self.nvme_bytes
            buffer, copied = self._host_buffer()
            self.buffer, self.holds_slot = buffer, True
            self.future = self.space.readers.submit(self._read_into, buffer, self.future, copied)

    def _host_buffer(self) -> tuple[torch.Tensor, Callable[[], None]]:
        """A host buffer of the shard's size (on the host whatever default device the user set:
        its memory is handed to ``os.preadv``/``os.pwrite``) from the space's pool, and the wait
        for the copy that last read it (`swap.ReadBuffers`)."""
        return self.space.shard_buffers.take(self.numel, self.dtype)

    def _read_into(self, buffer: torch.Tensor, written: Future | None, copied: Callable[[], None]) -> None:
        copied()  # the last gather's copy out of this buffer is done
        if written is not None:
            written.result()
        self.space.file.read(self.region, buffer)

    def _take(self) -> torch.Tensor:
        """The values in a host buffer that is now the caller's: the read ahead, or one read now."""
        if self.buffer is None:
            self.space.requested[0] += self.nvme_bytes
            buffer, copied = self._host_buffer()
            self._read_into(buffer, self.future, copied)
        else:
            assert self.future is not None
            self.future.result()
            buffer, self.buffer = self.buffer, None
            if self.holds_slot:
                self.space.slots.release()
                self.holds_slot = False
        self.future = None
        return buffer

    def _write(
        self, host: torch.Tensor, copied: Callable[[], None] = offload.nothing_to_wait_for, pooled: bool = True
    ) -> None:
        """``host`` (the shard's values, a buffer nobody else holds, filled once ``copied``
        returns) to the file: behind, on the write thread, if a slot is free; else now. A
        ``pooled`` buffer goes back to the pool after."""
        if self.buffer is not None:
            self.space.shard_buffers.give(self._take())  # a read in flight finishes first (its values dropped)
        self.space.requested[1] += self.nvme_bytes
        if self.space.slots.acquire(blocking=False):  # the write thread runs writes in order
            self.future = self.space.writers.submit(self._write_from, host, copied, True, pooled)
        else:
            if self.future is not None:
                self.future.result()
            self._write_from(host, copied, False, pooled)
            self.future = None

    def _write_from(self, host: torch.Tensor, copied: Callable[[], None], holds_slot: bool, pooled: bool) -> None:
        try:
            copied()
            self.space.file.write([(self.region, host)])
        finally:
            if holds_slot:
                self.space.slots.release()
            if pooled:
                self.space.shard_buffers.give(host)

    def values(self) -> torch.Tensor:
        """A copy of the values, the caller's (exports, checkpoints): the read buffer goes back."""
        buffer = self._take()
        values = buffer.clone()
        self.space.shard_buffers.give(buffer)
        return values

    @contextmanager
    def writing(self) -> Iterator[torch.Tensor]:
        values = self._take()
        yield values
        self._write(values, offload.copies_done(self.space.device))  # the caller's copies into it, if any

    def assign(self, values: torch.Tensor) -> None:
        """The whole shard from ``values`` (a master published), cast as CPU offload's host
        shard casts it (`offload.copy_across`: from a device master asynchronously, into the
        pinned buffer; the write waits for that copy). A shard read ahead (for the next
        forward, asked before the step) keeps the new values as what was read: they are written
        behind from that buffer, in its slot, and the gather takes them without reading the
        file again."""
        host, last_copied = self._host_buffer()
        last_copied()
        offload.copy_across(host, values.reshape(-1))
        copied = offload.copies_done(values.device)
        if self.buffer is None:
            self._write(host, copied)
            return
        assert self.future is not None
        self.future.result()  # the read ahead done: its values are replaced
        self.space.shard_buffers.give(self.buffer)
        self.buffer = host
        self.space.requested[1] += self.nvme_bytes
        self.future = self.space.writers.submit(self._write_from, host, copied, False, False)

    def fill(self, into: torch.Tensor) -> None:
        """Into a gather's buffer. A read that failed fills zeros instead of raising here, on
        this rank alone, while the others wait in the gather: the file kept the failure, and the
        ranks' next agreement round raises on every rank
        (`zero_engine.sharding.gathering.agreement.CollectiveSchedule`)."""
        try:
            buffer = self._take()
        except OSError:
            if self.space.file.failure is None:
                raise
            into.zero_()
            return
        offload.copy_across(into, buffer)  # from pinned memory where CUDA is: beside the device's work
        self.space.shard_buffers.give(buffer, offload.copies_done(into.device))


class NvmeShards:
    """The NVMe tier of parameter shards (`zero_engine.sharding.shards.param_shard.ShardTier`)."""

    def __init__(self, space: SwapSpace) -> None:
        self.space = space

    def make(self, values: torch.Tensor) -> NvmeShard:
        return NvmeShard(values, self.space)

    def settle(self) -> None:
        self.space.shard_buffers.allocate()


class NvmeMasters:
    """The NVMe tier of masters (`zero_engine.sharding.tiers.placement.MasterTier`), over one
    rank's swap space: a master of its own always (never the parameters' storage)."""

    def __init__(self, space: SwapSpace) -> None:
        self.space = space

    def shares(self, on_host: bool) -> bool:
        return False

    def shared(self, tensor: torch.Tensor) -> NvmeMaster:
        raise AssertionError("a master on NVMe is never the parameters' own storage")

    def separate(self, values: torch.Tensor, publish_to: torch.Tensor) -> NvmeMaster:
        return NvmeMaster(values.to("cpu", copy=True), publish_to, self.space)

    def step_grad(self, numel: int, device: torch.device, staged: bool) -> NvmeGrad:
        return NvmeGrad(numel, device, self.space)  # a later micro-step's is added on the write thread

    def settle(self) -> None:
        self.space.grad_buffers.allocate()
        self.space.shard_buffers.allocate()


def nvme_masters(placed: Placed, rank: int, device: torch.device | None = None) -> NvmeMasters:
    """The masters' NVMe tier: this rank's swap space (its file made now; its I/O threads on
    ``device``, the engine's)."""
    return NvmeMasters(SwapSpace(placed.nvme_path, rank, placed.buffer_count, device, step_read_ahead=True))


def nvme_shards(placed: Placed, rank: int, device: torch.device | None = None) -> NvmeShards:
    """The parameter shards' NVMe tier: this rank's swap space of parameter shards (a file of
    its own, beside the masters' one)."""
    return NvmeShards(SwapSpace(placed.nvme_path, rank, placed.buffer_count, device))


def swap_space(units: Iterable[Any]) -> SwapSpace | None:
    """The swap space the units' masters live in, if they are on NVMe."""
    for unit in units:
        tier = unit.placement.tier
        if isinstance(tier, NvmeMasters):
            return tier.space
    return None


def shard_swap_space(units: Iterable[Any]) -> SwapSpace | None:
    """The swap space the units' parameter shards live in, if they are on NVMe."""
    for unit in units:
        tier = unit.placement.shards if hasattr(unit, "placement") else unit.shards
        if isinstance(tier, NvmeShards):
            return tier.space
    return None


# Filesystems that are memory, not a disk: a swap file there would be host memory after all.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
OPTIMIZER_KEY = "zero_optimization.offload_optimizer.nvme_path"
PARAM_KEY = "zero_optimization.offload_param.nvme_path"


def check_swap_directories(plan: Any, optimizer: int, shards: int, local_ranks: int) -> None:
    """Each NVMe offload's directory (`check_swap_directory`), with room for what every rank of
    this node puts there (a rank's ``optimizer`` and ``shards`` bytes:
    `zero_engine.accounting.swap_file_bytes`; both offloads' where they share a directory)."""
    needs: dict[str, tuple[str, list[str], int]] = {}
    for key, placed, nbytes in ((OPTIMIZER_KEY, plan.state, optimizer), (PARAM_KEY, plan.param_shards, shards)):
        path = placed.nvme_path
        if placed.on_nvme and path is not None:
            _, keys, total = needs.get(os.path.realpath(path), (path, [], 0))
            needs[os.path.realpath(path)] = (path, [*keys, key], total + nbytes * local_ranks)
    for path, keys, total in needs.values():
        check_swap_directory(path, total, keys)


def check_swap_directory(path: str, needed: int, keys: Sequence[str] = (OPTIMIZER_KEY,)) -> None:
    """Refuse, at `initialize`, a swap directory that is missing, not writable, in memory, or
    without room for ``needed`` bytes (what every rank on this node offloads there), naming the
    ``keys`` that gave it."""
    from ...errors import ConfigError

    where = " and ".join(f"{key} = {path!r}" for key in keys)
    directory = Path(path)
    if path.startswith("~"):
        raise ConfigError(f"{where}: '~' is not expanded here (a config is read as written); give the directory's "
                          "full path")
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{where} is a file, not a directory: give the directory the swap files go in")
    if not directory.is_dir():
        raise ConfigError(f"{where}: no such directory")
    filesystem = filesystem_of(directory)
    if filesystem in MEMORY_FILESYSTEMS:
        raise ConfigError(
            f"{where} is on {filesystem}, which is memory, not a disk: the swap files would hold what is "
            "offloaded in RAM after all; give a directory on an NVMe drive"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: not writable by this process")
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    if free < needed:
        raise ConfigError(
            f"{where}: {readable_size(free)} free, what this node's ranks offload there needs {readable_size(needed)}"
        )


def readable_size(nbytes: int) -> str:
    """Bytes as GiB from one GiB on, MiB below (``0.00 GiB`` said nothing)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def filesystem_of(path: Path) -> str:
    """The type of the filesystem ``path`` is on (the longest mount point above it)."""
    real, best, kind = os.path.realpath(path), "", ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) < 3:
                continue
            point = fields[1].replace("\\040", " ")
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind
