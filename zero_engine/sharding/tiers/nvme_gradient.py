"""``offload_optimizer.device: nvme``: the step gradient in the swap file too, so that host memory
stays flat in the model's size (CPU offload keeps it in host memory: 4 bytes a parameter).

Each reduction's slice (cast to fp32 and scaled on the device, as CPU offload's is) is copied
into one of a few host buffers (`swap.GradBuffers`: pinned where CUDA is), and the write thread
waits for that copy (a CUDA event: the backward itself never waits), adds the window's gradient
so far when a later micro-step's arrives (read from the file), writes the sum to the gradient's
region, and takes its fp32 norm there, so the step's norm needs no read. The step reads each shard's
gradient in as it steps it (the next one read ahead), and gives its buffer back after (to the
swap space's `swap.ReadBuffers`, as the accumulation's read: host buffers of a shard's size are
reused, not allocated, faulted in and freed at each read).

The values are CPU offload's: the same fp32 slices, added in the same order (the window's sum
plus the new micro-step), the same norm kernel on the same values (intra-op threads are
torch's global count in every thread).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from ... import offload
from ...devices import HOST
from .placement import scaled_fp32
from .swap import SwapSpace


class NvmeGrad:
    """The step gradient of one optimizer shard in the swap file (a `placement.StepGrad`)."""

    on_host = True  # read on the host by the step
    persistent = False  # another buffer at each read: no views kept across steps
    waits_for_copies = False  # the write thread waits for each copy: no wait at the backward's end

    def __init__(self, numel: int, device: torch.device, space: SwapSpace) -> None:
        self.numel, self.device, self.space = numel, device, space
        self.nvme_bytes = numel * 4
        self.region = space.file.allocate(self.nvme_bytes)
        space.grad_buffers.fit(numel)
        space.shard_buffers.fit(numel, torch.float32)  # read for the step, and to add a micro-step's into
        self._started = False  # the file holds this window's gradient (else the next write overwrites it)
        self._written: Future | None = None  # the last write submitted
        self._norm: torch.Tensor | None = None  # the last write's fp32 norm (set on the write thread)
        self._ahead: tuple[Future, torch.Tensor] | None = None  # a read ahead of the step
        self._handed: torch.Tensor | None = None  # the read handed to the step: given back at `stepped`

    @property
    def nbytes(self) -> int:
        """In host memory between uses: a read ahead, if one is in and not in the space's own
        buffers (`swap.ReadBuffers` counts those), and the last write's norm."""
        ahead = self._ahead is not None and not self.space.shard_buffers.owns(self._ahead[1])
        return (self.nvme_bytes if ahead else 0) + (0 if self._norm is None else 4)

    def add(self, reduced: torch.Tensor, scale: float) -> None:
        update = scaled_fp32(reduced, scale)
        buffer = self.space.grad_buffers.take()
        landed = buffer[: self.numel]
        offload.copy_to_host(landed, update)
        copied = offload.copies_done(self.device)
        accumulate, self._started = self._started, True
        self.space.requested[0] += self.nvme_bytes if accumulate else 0
        self.space.requested[1] += self.nvme_bytes
        self._written = self.space.writers.submit(self._write, buffer, landed, copied, accumulate)

    def _write(self, buffer: torch.Tensor, landed: torch.Tensor, copied: Callable[[], None], accumulate: bool) -> None:
        """On the write thread (after this region's earlier writes: it runs them in order)."""
        values = landed
        try:
            copied()
            if accumulate:  # the window's sum so far, plus this micro-step's: CPU offload's order
                values, last_copied = self.space.shard_buffers.take(self.numel, torch.float32)
                last_copied()
                self.space.file.read(self.region, values)
                values.add_(landed)
            self.space.file.write([(self.region, values)])
            self._norm = torch.linalg.vector_norm(values, dtype=torch.float32)
        finally:
            self.space.grad_buffers.give(buffer)
            if values is not landed:
                self.space.shard_buffers.give(values)

    def replace(self, averaged: torch.Tensor) -> None:
        """Stages 0-1 reduce once per window: the copy is the window's gradient."""
        self._started = False
        self.add(averaged.float(), 1.0)

    def kept_norm(self) -> torch.Tensor | None:
        """The window's gradient's fp32 norm, taken as it was written (None: nothing written)."""
        if not self._started:
            return None
        assert self._written is not None
        self._written.result()
        return self._norm

    def prefetch(self) -> None:
        """Start reading the gradient in for its shard's step, after its last write."""
        if self._started and self._ahead is None:
            buffer, copied = self.space.shard_buffers.take(self.numel, torch.float32)
            self.space.requested[0] += self.nvme_bytes
            self._ahead = (self.space.readers.submit(self._read_into, buffer, self._written, copied), buffer)

    def _read_into(self, buffer: torch.Tensor, written: Future | None, copied: Callable[[], None]) -> None:
        copied()  # the last copy out of this buffer (a carry's) is done
        if written is not None:
            written.result()
        self.space.file.read(self.region, buffer)

    def value(self) -> torch.Tensor:
        """The window's gradient in a host tensor, the caller's until `stepped` or `clear`
        (zeros where nothing wrote it)."""
        if not self._started:
            return torch.zeros(self.numel, dtype=torch.float32, device=HOST)
        if self._ahead is None:
            self.prefetch()
        assert self._ahead is not None
        read, buffer = self._ahead
        self._ahead = None
        self._handed = buffer
        read.result()
        return buffer

    def move_into(self, destination: torch.Tensor) -> None:
        """Add the window's gradient so far into the device ``destination``; the next write
        starts the window anew. A read that failed adds nothing rather than raising on this rank
        alone inside the backward (the others would wait in the carry's reduction): the file kept
        the failure, and the step's agreement raises on every rank (`zero_engine.step`)."""
        if not self._started:
            return
        try:
            window = self.value()
        except OSError:
            if self.space.file.failure is None:
                raise
            window = None
        self._started = False
        if window is not None:
            destination.add_(offload.copied_to(window, destination.device))  # from a pinned buffer: no host sync
            self._give_back_handed(offload.copies_done(destination.device))

    def finish(self) -> None:
        """Nothing to add at the backward's end: the write thread added it."""

    def stepped(self) -> None:
        """The shard stepped: its gradient's buffer goes back for the next shard's read (held
        until the step's end instead, every shard's would be alive at once)."""
        self._give_back_handed()

    def clear(self) -> None:
        """After a step (or a skipped one): a read ahead left is dropped; the next write overwrites."""
        self._give_back_handed()
        if self._ahead is not None:
            read, buffer = self._ahead
            read.result()  # the read finished before its buffer serves another
            self._ahead = None
            self.space.shard_buffers.give(buffer)
        self._started = False

    def _give_back_handed(self, copied: Callable[[], None] | None = None) -> None:
        if self._handed is not None:
            self.space.shard_buffers.give(self._handed, copied)
            self._handed = None
