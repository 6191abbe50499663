"""A stage 3 parameter shard: what a rank keeps of a unit's values between uses, one kind per
place it can live, behind one interface (`ParamShard`), made by a tier (`ShardTier`) that
`zero_engine.sharding.tiers.placement.place` picks once from the offload plan.

- `DeviceShard`: on the unit's device (also the compute copy a master publishes into below
  stage 3: the owned range of the unit's flat buffer);
- `HostShard`: ``offload_param.device: cpu``, in host memory (pinned where CUDA exists: it
  crosses in every gather);
- `EncodedShard`: an int8 frozen shard (``zero_quantized_nontrainable_weights``), its bytes kept
  in any of the other kinds, decoded when read;
- `NvmeShard` (`zero_engine.sharding.tiers.nvme`): ``offload_param.device: nvme``, in the
  rank's swap file, read ahead of its gather.

The unit that holds one (`GatheredStorage`, `FrozenUnit`) never asks where it lives: it fills
the full buffer from it (`fill`), reads it (`values`), writes it (`writing`, `assign`) and asks
it in ahead of a gather (`prefetch`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import torch

from ... import offload
from ...devices import tensor_bytes
from ...quantize import BlockQuantizer


class ParamShard(Protocol):
    """A rank's shard of a unit's values, in the dtype it is kept in."""

    on_host: bool  # kept off the device (its bytes cross in every gather)
    tensor: torch.Tensor | None  # the shard itself, where it is a tensor in memory (None on NVMe)

    def values(self) -> torch.Tensor:
        """The values, to read (exports, checkpoints): the shard itself, or a copy of it."""
        ...

    def writing(self) -> AbstractContextManager[torch.Tensor]:
        """The values to write in place while inside; kept when the block ends."""
        ...

    def assign(self, values: torch.Tensor) -> None:
        """Replace the whole shard by ``values`` (a master published: cast where it lives)."""
        ...

    def fill(self, into: torch.Tensor) -> None:
        """Copy the values into ``into`` (the unit's full buffer's range: a gather's own part)."""
        ...

    def prefetch(self) -> None:
        """Start bringing the values in for a gather to come (nothing where they are in memory)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes kept in memory, device or host."""
        ...

    @property
    def host_bytes(self) -> int:
        """Of those, the host memory held."""
        ...

    @property
    def nvme_bytes(self) -> int:
        """Bytes kept in a swap file."""
        ...


class DeviceShard:
    """A shard that is a tensor on the unit's device (or, below stage 3, a range of its buffer)."""

    on_host = False
    nvme_bytes = 0

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def values(self) -> torch.Tensor:
        return self.tensor

    @contextmanager
    def writing(self) -> Iterator[torch.Tensor]:
        yield self.tensor

    def assign(self, values: torch.Tensor) -> None:
        offload.copy_across(self.tensor, values)

    def fill(self, into: torch.Tensor) -> None:
        offload.copy_across(into, self.tensor)

    def prefetch(self) -> None: ...

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.tensor)

    @property
    def host_bytes(self) -> int:
        return 0


class HostShard(DeviceShard):
    """``offload_param.device: cpu``: the shard in host memory, copied to the device at each
    gather (the copy casts nothing: the shard is in the compute dtype already)."""

    on_host = True

    @property
    def host_bytes(self) -> int:
        return offload.held_bytes(self.tensor)


class ShardTier(Protocol):
    """Where parameter shards live, one class per tier, picked once (`placement.place`)."""

    def make(self, values: torch.Tensor) -> ParamShard:
        """A shard holding ``values`` (a view of the full buffer about to be freed; any dtype)."""
        ...

    def settle(self) -> None:
        """Every unit is built: make what is sized by the largest shard (NVMe's read buffers)."""
        ...


class DeviceShards:
    def make(self, values: torch.Tensor) -> ParamShard:
        return DeviceShard(values.clone())

    def settle(self) -> None: ...


class HostShards:
    def make(self, values: torch.Tensor) -> ParamShard:
        return HostShard(offload.host_copy(values, offload.PIN_CROSSING))  # cast on the device first

    def settle(self) -> None: ...


DEVICE_SHARDS = DeviceShards()


class EncodedShard:
    """An int8 frozen shard (`zero_engine.sharding.units.quantized_frozen`): its encoded bytes
    kept in a shard of any kind (``kept``), decoded when read. A write goes to a decoded copy
    (``staged``), encoded at the next read, so that a load of every parameter of a unit encodes
    it once and a block two parameters share is quantized from its final values only."""

    def __init__(
        self, values: torch.Tensor, tier: ShardTier, quantizer: BlockQuantizer, dtype: torch.dtype
    ) -> None:
        self.quantizer, self.dtype, self.numel, self.device = quantizer, dtype, values.numel(), values.device
        self.kept = tier.make(self._encode(values))
        self.on_host = self.kept.on_host
        self.tensor = None  # never the values themselves
        self._staged: torch.Tensor | None = None

    def _encode(self, values: torch.Tensor) -> torch.Tensor:
        encoded = torch.empty(self.quantizer.encoded_bytes(self.numel), dtype=torch.uint8, device=self.device)
        self.quantizer.encode(values, encoded)
        return encoded

    def _encode_staged(self) -> None:
        if self._staged is not None:
            self.kept.assign(self._encode(self._staged))
            self._staged = None

    def encoded(self) -> torch.Tensor:
        """The encoded bytes (a staged write encoded first)."""
        self._encode_staged()
        return self.kept.values()

    def replace_encoded(self, encoded: torch.Tensor) -> None:
        """Keep ``encoded`` (another rank's encoded shard) instead; a staged write is dropped."""
        self._staged = None
        self.kept.assign(encoded)

    def fill_encoded(self, into: torch.Tensor) -> None:
        """The encoded bytes into ``into`` (a gather moves them encoded)."""
        self._encode_staged()
        self.kept.fill(into)

    def values(self) -> torch.Tensor:
        """The values as a gather decodes them: what the next forward computes with."""
        encoded = self.encoded().to(self.device)
        return self.quantizer.decode(encoded, self.numel).to(self.dtype)

    @contextmanager
    def writing(self) -> Iterator[torch.Tensor]:
        if self._staged is None:
            self._staged = self.values()
        yield self._staged

    def assign(self, values: torch.Tensor) -> None:
        with self.writing() as staged:
            staged.copy_(values)

    def fill(self, into: torch.Tensor) -> None:
        into.copy_(self.values())

    def prefetch(self) -> None:
        self.kept.prefetch()

    @property
    def nbytes(self) -> int:
        return self.kept.nbytes

    @property
    def host_bytes(self) -> int:
        return self.kept.host_bytes

    @property
    def nvme_bytes(self) -> int:
        return self.kept.nvme_bytes
