"""Where a unit's optimizer side lives, decided once for the engine (`place`), and the three
kinds of step gradient, one class each.

A unit's range that this rank's optimizer updates has a master (fp32 values), a compute copy
to publish the master into after each update (unless the master is the compute copy itself),
at stage 3 a parameter shard kept between uses, and a step gradient. `Placement` says where
each of them lives, from the offload plan, for every unit alike (FSDP2 decides its
``offload_to_cpu`` once, in its parameter objects); the units ask it once, when they are made.

The step gradient is one of three kinds, behind one interface (`StepGrad`):

- `GradView` (stages 0-1): the owned range of the unit's full gradient buffer, which the
  reduction writes in place;
- `DeviceGrad` (stages 2-3): a tensor of its own that reductions add into; at stage 3 it exists
  only from a backward to its step (``releases``);
- `HostGrad` (``offload_optimizer``): fp32 in host memory, written by asynchronous copies
  (`zero_engine.sharding.tiers.host_gradient.HostGradient`), ready after the backward's one wait.

The master is one of three kinds, behind one interface (`Master`): on the unit's device,
`HostMaster` (``offload_optimizer.device: cpu``), or `NvmeMaster`
(`zero_engine.sharding.tiers.nvme`); a tier (`DeviceTier`, `HostTier`, `nvme.NvmeMasters`),
picked once by `place`, makes them. The master kind also keeps the optimizer state of its range
where it keeps the master (`Master.bind_state`), and the optimizer step enters
`Master.resident` around each shard's update (on NVMe: read in before, written behind after)
and calls `Master.prefetch` for the next one.

A stage 3 parameter shard is one of the kinds of `zero_engine.sharding.shards.param_shard`
(device, host, NVMe), made by the shard tier `place` picks; a master publishes into its shard
(below stage 3: a `DeviceShard` over its range of the unit's flat buffer).

A new placement (a quantized master) is a new tier and kind here, not a branch in every method.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ... import offload
from ...devices import tensor_bytes
from ...offload import OffloadPlan, Placed, Tier
from .host_gradient import HostGradient
from ..shards.param_shard import DEVICE_SHARDS, DeviceShard, HostShards, ParamShard, ShardTier


class Master:
    """The fp32 master of a unit's owned range on the device, and the compute copy it is
    published into after each update (``publish_to``; None: the master is the compute copy,
    fp32 training, so nothing is published and nothing is held twice)."""

    on_host = False
    nvme_bytes = 0  # of the master and its state, what waits in a swap file (`nvme.NvmeMaster`)

    def __init__(self, tensor: torch.Tensor, publish_to: ParamShard | None) -> None:
        self.tensor = tensor
        self.publish_to = publish_to

    @contextmanager
    def resident(self) -> Iterator[torch.Tensor]:
        """The master's values (and its optimizer state: `bind_state`), present while inside (a
        step updates them here)."""
        yield self.tensor

    def bind_state(self, states: Callable[[], Any]) -> None:
        """The optimizer state that lives where the master lives (kept in place here; on NVMe
        swapped with it: `zero_engine.sharding.tiers.nvme.NvmeMaster`)."""

    def settle(self) -> None:
        """After the optimizer's targets were made as views of the master."""

    def prefetch(self, wait_for_slot: bool = False) -> None:
        """Start bringing the master in ahead of its `resident` (the next shard to step)."""

    @property
    def is_compute_copy(self) -> bool:
        return self.publish_to is None

    @property
    def nbytes(self) -> int:
        """A separate fp32 master's bytes; 0 when the master is the parameters themselves."""
        return 0 if self.is_compute_copy else tensor_bytes(self.tensor)

    @property
    def host_bytes(self) -> int:
        return 0

    def publish(self) -> None:
        """Cast the updated master into the compute copy (mixed precision), or copy it to the
        device (offloaded): the cast happens where the compute copy lives."""
        if self.publish_to is not None:
            self.publish_to.assign(self.tensor)


class HostMaster(Master):
    """``offload_optimizer``: the master in host memory (pinned where asked), stepped by the
    host and copied to the device's compute copy after each update."""

    on_host = True

    @property
    def host_bytes(self) -> int:
        return 0 if self.is_compute_copy else offload.held_bytes(self.tensor)


class StepGrad(Protocol):
    """The averaged gradient of a unit's owned range, in the compute dtype (fp32 on the host)."""

    on_host: bool  # the averaged gradient is read on the host (not the device's reduced buffer)
    persistent: bool  # `value` is the same tensor from step to step (views into it may be kept)
    waits_for_copies: bool  # written by copies that the backward's one wait completes (`finish`)
    nvme_bytes: int  # in a swap file (`nvme_gradient.NvmeGrad`)

    @property
    def nbytes(self) -> int: ...

    def value(self) -> torch.Tensor:
        """The window's gradient (zeros where no reduction wrote it)."""
        ...

    def add(self, reduced: torch.Tensor, scale: float) -> None:
        """Add ``scale * reduced`` (this range, summed over ranks)."""
        ...

    def replace(self, averaged: torch.Tensor) -> None:
        """The window's whole averaged gradient, reduced elsewhere (stages 0-1)."""
        ...

    def move_into(self, destination: torch.Tensor) -> None:
        """Add the window's gradient so far into the device ``destination`` and start anew."""
        ...

    def finish(self) -> None:
        """After the backward's wait for its copies."""
        ...

    def stepped(self) -> None:
        """The step is done with `value` (on NVMe: the buffer it was read into is given back)."""
        ...

    def clear(self) -> None:
        """After a step."""
        ...

    def kept_norm(self) -> torch.Tensor | None:
        """The gradient's fp32 norm where it was taken already (on NVMe, as it was written); None:
        the step takes it from `value`."""
        ...

    def prefetch(self) -> None:
        """Start bringing the gradient in for its shard's step (on NVMe: a read ahead)."""
        ...


class _InMemory:
    """What a step gradient held in memory does not do: wait for its copies, keep its norm,
    read ahead, give a read's buffer back."""

    waits_for_copies = False
    nvme_bytes = 0

    def finish(self) -> None: ...

    def stepped(self) -> None: ...

    def kept_norm(self) -> torch.Tensor | None:
        return None

    def prefetch(self) -> None: ...


class GradView(_InMemory):
    """Stages 0-1: the owned range of the unit's full gradient buffer, reduced in place."""

    on_host = False
    persistent = True
    nbytes = 0  # counted with the full buffer

    def __init__(self, view: torch.Tensor) -> None:
        self.view = view

    def value(self) -> torch.Tensor:
        return self.view

    def add(self, reduced: torch.Tensor, scale: float) -> None:
        self.view.add_(reduced, alpha=scale)

    def replace(self, averaged: torch.Tensor) -> None:
        if averaged.data_ptr() != self.view.data_ptr():  # reduced through a copy in another dtype
            self.view.copy_(averaged)

    def move_into(self, destination: torch.Tensor) -> None:
        destination.add_(self.view)
        self.view.zero_()

    def clear(self) -> None: ...  # the full buffer is zeroed with the others


class DeviceGrad(_InMemory):
    """Stages 2-3: a tensor of its own beside the unit; ``releases`` (stage 3): it exists only
    from the backward to the step, made by the window's first reduction (no zeros pass)."""

    on_host = False

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, releases: bool) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.releases = releases
        self.persistent = not releases
        self.grad: torch.Tensor | None = None if releases else self._zeros()

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=self.dtype, device=self.device)

    @property
    def nbytes(self) -> int:
        return 0 if self.grad is None else tensor_bytes(self.grad)

    def value(self) -> torch.Tensor:
        if self.grad is None:
            self.grad = self._zeros()
        return self.grad

    def add(self, reduced: torch.Tensor, scale: float) -> None:
        if self.grad is None:
            self.grad = torch.mul(reduced, scale).to(self.dtype)
        else:
            self.grad.add_(reduced, alpha=scale)

    def replace(self, averaged: torch.Tensor) -> None:
        self.value().copy_(averaged)

    def move_into(self, destination: torch.Tensor) -> None:
        if self.grad is not None:
            destination.add_(self.grad)
            self.grad.zero_()

    def clear(self) -> None:
        if self.releases:
            self.grad = None
        elif self.grad is not None:
            self.grad.zero_()


def scaled_fp32(reduced: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * reduced`` in fp32, computed where ``reduced`` lives (the device): what an
    offloaded step gradient receives, on the host or on NVMe."""
    return reduced if scale == 1.0 and reduced.dtype == torch.float32 else reduced.float() * scale


class HostGrad(_InMemory):
    """``offload_optimizer.device: cpu``: fp32 in host memory, written by asynchronous copies of
    reduced slices cast to fp32 (and scaled) on the device."""

    on_host = True
    persistent = True
    waits_for_copies = True

    def __init__(self, numel: int, device: torch.device, staged: bool) -> None:
        self.host = HostGradient(numel, device, staged)
        self.device = device  # where the copies come from

    @property
    def nbytes(self) -> int:
        return self.host.nbytes

    def value(self) -> torch.Tensor:
        return self.host.value()

    def add(self, reduced: torch.Tensor, scale: float) -> None:
        self.host.receive(scaled_fp32(reduced, scale))

    def replace(self, averaged: torch.Tensor) -> None:
        self.host.replace(averaged.float())  # stages 0-1 reduce once per window: the copy is its value

    def move_into(self, destination: torch.Tensor) -> None:
        self.host.move_into(destination)

    def finish(self) -> None:
        self.host.finish()

    def clear(self) -> None:
        self.host.clear()


class MasterTier(Protocol):
    """Where masters live, one class per tier (the device, the host, NVMe: `nvme.NvmeMasters`),
    picked once by `place` from the offload plan."""

    def shares(self, on_host: bool) -> bool:
        """Whether an fp32 master can be the parameters' own storage there (on the host, or not)."""
        ...

    def shared(self, tensor: torch.Tensor) -> Master:
        """A master that is ``tensor`` itself (nothing published)."""
        ...

    def separate(self, values: torch.Tensor, publish_to: ParamShard) -> Master:
        """A master of its own with ``values`` (fp32), published into ``publish_to``."""
        ...

    def step_grad(self, numel: int, device: torch.device, staged: bool) -> StepGrad:
        """Off the device: the fp32 step gradient beside the masters (``staged``: windows of
        several reductions, `HostGradient`)."""
        ...

    def settle(self) -> None:
        """Every unit is built: make what is sized by the largest (NVMe's gradient buffers)."""
        ...


class DeviceTier:
    """Masters on the unit's device."""

    def shares(self, on_host: bool) -> bool:
        return not on_host

    def shared(self, tensor: torch.Tensor) -> Master:
        return Master(tensor, None)

    def separate(self, values: torch.Tensor, publish_to: ParamShard) -> Master:
        return Master(values.clone(), publish_to)

    def step_grad(self, numel: int, device: torch.device, staged: bool) -> StepGrad:
        raise AssertionError("a step gradient of its own on the device is `DeviceGrad` (Placement.step_grad)")

    def settle(self) -> None: ...


@dataclass(frozen=True)
class HostTier:
    """``offload_optimizer.device: cpu``: masters in host memory, pinned where asked."""

    pin_memory: bool

    def shares(self, on_host: bool) -> bool:
        return on_host

    def shared(self, tensor: torch.Tensor) -> Master:
        return HostMaster(tensor, None)

    def separate(self, values: torch.Tensor, publish_to: ParamShard) -> Master:
        return HostMaster(offload.host_copy(values, self.pin_memory), publish_to)

    def step_grad(self, numel: int, device: torch.device, staged: bool) -> StepGrad:
        return HostGrad(numel, device, staged)

    def settle(self) -> None: ...


@dataclass(frozen=True)
class Placement:
    """Where every unit's optimizer side lives (`place`)."""

    offload_optimizer: bool  # step gradients (and masters and optimizer state: `tier`) off the device
    tier: MasterTier  # where masters live
    shards: ShardTier = DEVICE_SHARDS  # where stage 3's parameter shards live (`param_shard`)
    staged_gradients: bool = False  # host gradients get their staging buffer when made (`HostGradient`)

    def masters(self, flat_param: torch.Tensor, full_fp32: torch.Tensor, start: int, end: int) -> Master:
        """A whole-parameter unit's master of ``[start, end)``, published into ``flat_param``'s
        range unless it is that range (fp32 on the device)."""
        if flat_param.dtype == torch.float32 and self.tier.shares(on_host=False):
            return self.tier.shared(flat_param[start:end])
        return self.tier.separate(full_fp32[start:end], DeviceShard(flat_param[start:end]))

    def sharded(
        self, flat_param: torch.Tensor, full_fp32: torch.Tensor, start: int, end: int
    ) -> tuple[ParamShard, Master]:
        """A stage 3 unit's parameter shard (compute dtype, kept between uses) and its master,
        published into the shard: in fp32 the shard's tensor is the master where both live in
        one place (no second copy; never on NVMe, where the shard is no tensor)."""
        shard = self.shards.make(flat_param[start:end])
        if flat_param.dtype == torch.float32 and shard.tensor is not None and self.tier.shares(on_host=shard.on_host):
            return shard, self.tier.shared(shard.tensor)
        return shard, self.tier.separate(full_fp32[start:end], shard)

    def step_grad(
        self, numel: int, dtype: torch.dtype, device: torch.device, full_grad: torch.Tensor | None, releases: bool
    ) -> StepGrad:
        """The step gradient's kind: on the host (offloaded), a view of the full gradient buffer's
        range (``full_grad``, stages 0-1), or a device tensor of its own."""
        if self.offload_optimizer:  # beside the masters: host memory, or NVMe
            return self.tier.step_grad(numel, device, self.staged_gradients)
        if full_grad is not None:
            return GradView(full_grad)
        return DeviceGrad(numel, dtype, device, releases)

    def settle(self) -> None:
        """Every unit is built: each tier makes what it sizes by the largest (NVMe's buffers)."""
        self.tier.settle()
        self.shards.settle()


def place(
    plan: OffloadPlan,
    nvme_masters: Callable[[Placed], MasterTier] | None = None,
    nvme_shards: Callable[[Placed], ShardTier] | None = None,
) -> Placement:
    """The placement of an offload plan: each kind of state's tier class, picked from a table by
    the plan's tier for it. NVMe's tiers are made by the caller's ``nvme_masters`` and
    ``nvme_shards`` (each opens the rank's swap space: `zero_engine.sharding.tiers.nvme`)."""
    masters: dict[Tier, Callable[[Placed], MasterTier]] = {
        Tier.DEVICE: lambda placed: DeviceTier(), Tier.HOST: lambda placed: HostTier(plan.pin_memory),
    }
    shards: dict[Tier, Callable[[Placed], ShardTier]] = {
        Tier.DEVICE: lambda placed: DEVICE_SHARDS, Tier.HOST: lambda placed: HostShards(),
    }
    if nvme_masters is not None:
        masters[Tier.NVME] = nvme_masters
    if nvme_shards is not None:
        shards[Tier.NVME] = nvme_shards
    tier = masters[plan.state.tier](plan.state)
    return Placement(plan.optimizer, tier, shards[plan.param_shards.tier](plan.param_shards), plan.staged_gradients)


ON_DEVICE = Placement(offload_optimizer=False, tier=DeviceTier())
