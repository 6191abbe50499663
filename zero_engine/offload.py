"""Offload: where the optimizer's state and the parameter shards live, and how bytes cross.

`OffloadPlan` names a tier (`Tier`: device, host, NVMe) per kind of state: the optimizer side
(``offload_optimizer``: the fp32 master and the optimizer's state of this rank's shard, and off
the device its fp32 step gradient with them) and stage 3's parameter shards (``offload_param``);
`zero_engine.sharding.tiers.placement.place` maps each to its tier class. The rest of this
module is the few operations that cross between the device and the host, kept here so the
CUDA-only lines (pinned memory, stream waits) are in small named functions:

- gradients go to the host once per reduction, already fp32 (upcast on the device: a host
  dtype conversion inside a copy is what made DeepSpeed's offloaded backward 82x slower);
- those copies are asynchronous (``non_blocking`` from pinned memory on a GPU), ordered by the
  device's stream, and the host waits for them once, at the end of the backward that made them
  (`wait_for_host_copies`), before it reads them;
- updated values go back to the device in the master's dtype and are cast there.

On a CPU-only torch there is no pinned memory (``pin_memory()`` raises) and copies are plain
``copy_``; the waits do nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from .config import ZeroOptimizationConfig
from .devices import HOST
from .stage import Stage


class Tier(Enum):
    """Where a kind of state lives."""

    DEVICE = "device"
    HOST = "host"  # ``device: cpu``
    NVME = "nvme"  # a swap file per rank


@dataclass(frozen=True)
class Placed:
    """One kind of state's tier, and on NVMe its directory and how many shards of it may be in
    host memory at once (``buffer_count``)."""

    tier: Tier = Tier.DEVICE
    nvme_path: str | None = None
    buffer_count: int = 4

    @property
    def on_nvme(self) -> bool:
        return self.tier is Tier.NVME


ON_DEVICE = Placed()


@dataclass(frozen=True)
class OffloadPlan:
    """Where a rank keeps what offload moves off the device: a tier per kind of state."""

    # fp32 masters and the optimizer state of the shard; off the device, the fp32 step gradient
    # goes with them (host memory, or the swap file).
    state: Placed = ON_DEVICE
    param_shards: Placed = ON_DEVICE  # stage 3's parameter shards (compute dtype), frozen ones too
    pin_memory: bool = False  # host buffers page-locked (only where CUDA exists)
    # Several reductions reach a window's step gradient (accumulation over micro-steps at
    # stages 2-3): a staging buffer beside it, allocated with it (`HostGradient`).
    staged_gradients: bool = False

    @property
    def optimizer(self) -> bool:
        """The optimizer side off the device (``offload_optimizer``)."""
        return self.state.tier is not Tier.DEVICE

    @property
    def params(self) -> bool:
        """Stage 3's parameter shards off the device (``offload_param``)."""
        return self.param_shards.tier is not Tier.DEVICE

    @property
    def params_on_host(self) -> bool:
        return self.param_shards.tier is Tier.HOST

    @property
    def any(self) -> bool:
        return self.optimizer or self.params


NO_OFFLOAD = OffloadPlan()


def offload_plan(zero: ZeroOptimizationConfig, stage: Stage, accumulation: int = 1) -> OffloadPlan:
    """The plan from a ``zero_optimization`` section (validated: `zero_engine.config`);
    ``offload_param`` counts at stage 3 only (below it parameters are whole, as in DeepSpeed).
    ``accumulation``: micro-steps per optimizer step (stages 2-3 reduce at every one)."""
    state, param_shards = (ON_DEVICE if section is None else _placed(section.device, section.nvme_path,
                                                                     section.buffer_count)
                           for section in (zero.offload_optimizer, zero.offload_param))
    param_shards = param_shards if stage.shard_parameters else ON_DEVICE
    pin = any(section is not None and section.device == "cpu" and section.pin_memory
              for section in (zero.offload_optimizer, zero.offload_param))
    optimizer = state.tier is not Tier.DEVICE
    staged = optimizer and accumulation > 1 and stage.streams_gradients(zero.reduce_scatter_each_micro_step)
    return OffloadPlan(state, param_shards, pin, staged)


def _placed(device: str, nvme_path: str | None, buffer_count: int) -> Placed:
    """The tier of an offload device (none: the device)."""
    if device == "cpu":
        return Placed(Tier.HOST)
    if device == "nvme":
        return Placed(Tier.NVME, nvme_path, buffer_count)
    return ON_DEVICE


# Host buffers that cross to or from the device in every forward or backward are pinned
# wherever CUDA exists, whatever ``pin_memory`` says: a copy between the device and pageable
# memory makes the host wait for everything queued on the stream before it, once per bucket in
# backward (gradients) or per gather (parameter shards). ``pin_memory`` decides for the master,
# which crosses in the step only, after its one host sync anyway.
PIN_CROSSING = True


def pinned_block_bytes(nbytes: int) -> int:
    """What a pinned host buffer of ``nbytes`` takes: torch's caching host allocator hands out
    power-of-two blocks, so up to twice the bytes asked for."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 1 else nbytes


def held_bytes(tensor: torch.Tensor) -> int:
    """The host memory a host buffer (a whole tensor, not a view) holds: a pinned one its
    allocator block."""
    nbytes = tensor.numel() * tensor.element_size()
    return pinned_block_bytes(nbytes) if tensor.is_pinned() else nbytes


def pinning_overshoot(buffer_bytes: list[int]) -> int:
    """How much more than ``buffer_bytes`` pinned buffers of those sizes take, where pinning
    happens (a CUDA machine); 0 elsewhere."""
    if not _can_pin():
        return 0
    return sum(pinned_block_bytes(nbytes) - nbytes for nbytes in buffer_bytes)


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host buffer, page-locked when asked and possible (a copy from pinned memory can run
    asynchronously beside the device's work)."""
    return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=pin and _can_pin())


def host_copy(values: torch.Tensor, pin: bool) -> torch.Tensor:
    """A new host tensor holding ``values`` (flat), in their dtype (cast them on the device first)."""
    out = host_empty(values.numel(), values.dtype, pin)
    out.copy_(values.reshape(-1))
    return out


def copy_to_host(destination: torch.Tensor, values: torch.Tensor) -> None:
    """Start copying device ``values`` (same dtype: cast them on the device first) into the
    host ``destination``. Asynchronous from pinned memory: read ``destination`` only after
    `wait_for_host_copies`."""
    if values.dtype != destination.dtype:
        raise TypeError(f"copy_to_host: cast on the device first ({values.dtype} -> {destination.dtype})")
    # non_blocking always: asynchronous into pinned memory; into pageable memory CUDA completes
    # the copy, and everything queued before it, before returning (why `PIN_CROSSING`).
    destination.copy_(values, non_blocking=True)


def copy_across(destination: torch.Tensor, values: torch.Tensor) -> None:
    """Copy ``values`` into ``destination``, wherever each lives, casting on the device side:
    host to device moves the host's own bytes and casts after the copy; device to host casts
    before it (`copy_to_host`). On one side, a plain cast copy."""
    if values.device == destination.device:
        destination.copy_(values)
    elif destination.device == HOST:
        copy_to_host(destination, values.to(destination.dtype))
    elif values.dtype == destination.dtype:
        destination.copy_(values, non_blocking=values.is_pinned())
    else:
        destination.copy_(values.to(destination.device, non_blocking=values.is_pinned()))


def copied_to(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` where ``device`` is, in their dtype: themselves when there already, else a new
    tensor filled by `copy_across` (asynchronously from pinned memory)."""
    if values.device == device:
        return values
    moved = torch.empty(values.shape, dtype=values.dtype, device=device)
    copy_across(moved, values)
    return moved


def copies_done(device: torch.device) -> Callable[[], None]:
    """A wait for the copies the device has queued so far (its copies to the host among them),
    for any thread to call: CUDA's event recorded now; nothing to wait for elsewhere (a CPU
    copy is done when it returns)."""
    if device.type == "cuda":
        return _cuda_event_now(device)
    return nothing_to_wait_for


def nothing_to_wait_for() -> None:
    """The wait for a copy already done (a CPU copy, a buffer filled on the host)."""


def _cuda_event_now(device: torch.device) -> Callable[[], None]:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event.synchronize


def wait_for_host_copies(device: torch.device) -> None:
    """Block the host until the device's queued work (its copies to the host among it) is done."""
    if device.type == "cuda":
        _synchronize_cuda_stream(device)


def _synchronize_cuda_stream(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()


def _can_pin() -> bool:
    return torch.cuda.is_available()


# -- host memory ---------------------------------------------------------------------------------


def available_host_bytes() -> int | None:
    """Memory the node can still give (Linux ``MemAvailable``); None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def local_ranks() -> int:
    """Ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``; 1 without torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def check_host_memory(bytes_per_rank: int, what: str) -> None:
    """Fail before allocating when the host state of every rank on this node does not fit in
    the memory the node has available (host exhaustion is the common offload failure: the
    kernel kills a rank mid-initialization, with no message)."""
    available = available_host_bytes()
    ranks = local_ranks()
    if available is None or bytes_per_rank * ranks <= available:
        return
    gib = 2**30
    raise MemoryError(
        f"{what} puts {bytes_per_rank / gib:.2f} GiB per rank on the host, x {ranks} rank(s) on this node = "
        f"{bytes_per_rank * ranks / gib:.2f} GiB, but the node has {available / gib:.2f} GiB available "
        "(MemAvailable): use more nodes or ranks to shard over, offload less (offload_param off), or free memory"
    )
