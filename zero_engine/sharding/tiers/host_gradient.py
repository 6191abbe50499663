"""offload_optimizer: the step gradient of one optimizer shard, fp32 in host memory.

Reductions happen on the device; each reduced slice (cast to fp32 there) is copied to the host
asynchronously, and the host reads the gradient only after the backward's one wait
(`zero_engine.offload.wait_for_host_copies`). Accumulating over micro-steps without zeroing
anything under a copy in flight:

- the window's first copy overwrites the gradient (nothing is zeroed between windows);
- a later micro-step's copy lands in a staging buffer, added on the host after the wait: one
  host add over the shard per later micro-step (the staging buffer is made with the gradient
  where windows have several micro-steps, else at a second backward in one micro-step);
- hybrid sharding takes the window's part back to the device once (`move_into`), and the next
  copy overwrites it again.
"""

from __future__ import annotations

import torch

from ... import offload


class HostGradient:
    """The fp32 host gradient of ``numel`` elements and where its window stands."""

    def __init__(self, numel: int, device: torch.device, staged: bool = False) -> None:
        self.device = device  # where the copies come from
        self.values = offload.host_empty(numel, torch.float32, offload.PIN_CROSSING)  # written every backward
        self._started = False  # ``values`` holds this window's gradient (else the next copy overwrites it)
        # ``staged``: windows of several reductions. Pinned now, not at the first later copy: a
        # page-locked allocation there, inside a backward, is an implicit device-wide sync
        # (GPU review P2), a stall of the driver's lock, and memory the plan did not place.
        self._staging = offload.host_empty(numel, torch.float32, offload.PIN_CROSSING) if staged else None
        self._staged = False  # the staging buffer holds a copy not added yet

    @property
    def nbytes(self) -> int:
        return offload.held_bytes(self.values) + (0 if self._staging is None else offload.held_bytes(self._staging))

    def receive(self, update: torch.Tensor) -> None:
        """Start copying a device fp32 ``update`` in: over the values on the window's first,
        else into the staging buffer (added by `finish`)."""
        if not self._started:
            offload.copy_to_host(self.values, update)
            self._started = True
            return
        if self._staged:  # a second backward in one micro-step: add the first one's copy first
            offload.wait_for_host_copies(self.device)
            self.finish()
        if self._staging is None:
            self._staging = offload.host_empty(self.values.numel(), torch.float32, offload.PIN_CROSSING)
        offload.copy_to_host(self._staging, update)
        self._staged = True

    def replace(self, update: torch.Tensor) -> None:
        """The window's whole gradient (stages 0-1 reduce once per window)."""
        self._started = False
        self.receive(update)

    def finish(self) -> None:
        """After the wait for this backward's copies: add a staged micro-step in."""
        if self._staged and self._staging is not None:
            self.values.add_(self._staging)
            self._staged = False

    def value(self) -> torch.Tensor:
        """The window's gradient (zeros if no reduction wrote it)."""
        if not self._started:
            self.values.zero_()
            self._started = True
        return self.values

    def move_into(self, destination: torch.Tensor) -> None:
        """Add the window's gradient so far into the device ``destination``; the next copy
        starts the window anew (so nothing is zeroed under the copy to the device)."""
        if self._started:
            destination.add_(self.values.to(destination.device, non_blocking=self.values.is_pinned()))
            self._started = False

    def clear(self) -> None:
        """After a step: the next window's first copy overwrites the values."""
        self._started = False
