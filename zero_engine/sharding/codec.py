"""How a unit's values travel in its all-gather: the one seam where a gather may change form.

Every all-gather of a unit's compute values goes through `FlatUnit.gather` (stage 3's gathers
in forward and backward, the gather of updated parameters after a step at stages 1-2), which
asks the unit's codec to launch it. A codec starts the collective from the rank's own shard and
returns a `Gathering`: the collective in flight and what completes it once it is done (decoding
a compressed form into the unit's buffer, for instance). `IdentityCodec` moves the values as
they are; a quantizing codec (ZeRO++'s int8 weights) would all-gather a smaller encoded buffer
and decode it in ``finish``. Exported masters are gathered exactly, outside any codec
(`FlatUnit.gather_masters`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from ..comm import Comm, Pending


class Gathering(NamedTuple):
    """An all-gather in flight and what completes it after the wait (None: nothing)."""

    pending: Pending
    finish: Callable[[], None] | None = None

    def wait(self) -> None:
        self.pending.wait()
        if self.finish is not None:
            self.finish()


class GatherCodec(Protocol):
    def launch(self, comm: Comm, flat: torch.Tensor) -> Gathering:
        """Start filling every shard of ``flat`` with its owner's values (this rank's shard of
        ``flat`` holds its own already)."""
        ...


class IdentityCodec:
    """The values as they are, in the buffer's dtype."""

    def launch(self, comm: Comm, flat: torch.Tensor) -> Gathering:
        return Gathering(comm.all_gather(flat))


IDENTITY = IdentityCodec()
