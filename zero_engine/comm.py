"""Collectives: the only module that calls ``torch.distributed``.

Every collective works on flat buffers whose length is a multiple of the world size, with
rank ``r``'s shard at ``[r * n / N, (r + 1) * n / N)``, and returns a `Pending` handle so the
caller decides when to wait. World size 1 needs no process group: every call is a no-op.

Which primitive implements a collective is chosen per backend, by measurement (see
``docs/benchmarks.md``): gloo's own reduce-scatter and all-gather are naive (3-8x slower than
all-reduce on 16 MB here), so on gloo a reduce-scatter is one ``reduce`` per destination rank
and an all-gather one ``broadcast`` per source rank, all launched at once. NCCL uses its native
collectives. ``comm.primitives`` overrides the choice (tests run the native path on gloo).
Sums are divided explicitly by the caller: ``ReduceOp.AVG`` has been a sum on gloo in some
torch versions.

Two groups: data (parameters, gradients: the device's backend, NCCL on CUDA) and control
(agreements between ranks and small JSON exchanges: always gloo, on CPU tensors, so they never
make the host wait for the device nor queue behind data collectives in flight).

Bytes are counted per collective kind as the ring algorithm's per-rank volume (an all-reduce
of ``b`` bytes sends and receives ``2 b (N-1)/N``; reduce-scatter and all-gather ``b (N-1)/N``
each), the lower bound that NCCL reaches and that the ZeRO paper's analysis uses.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence
from enum import Enum
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .config import CommConfig


class CollectiveKind(str, Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    GATHER = "gather"


class Pending(NamedTuple):
    """Collectives in flight; `wait` blocks until all of them are done."""

    works: tuple[Any, ...] = ()

    def wait(self) -> None:
        for work in self.works:
            work.wait()


DONE = Pending()


class EachRank(NamedTuple):
    """Every rank's small integer, summed into its own slot; `values` waits for them."""

    slots: torch.Tensor
    pending: Pending

    def values(self) -> list[int]:
        self.pending.wait()
        return self.slots.tolist()


class Comm:
    """A process group with a backend-specific choice of primitives and a byte counter."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        backend: str,
        group: Any = None,
        control_group: Any = None,
        primitives: str = "auto",
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.group = group
        # Agreements between ranks (`each_rank`, `all_gather_json`) go through a gloo group of
        # their own: CPU tensors, never behind the data collectives in flight on ``group``.
        self.control_group = control_group
        self.per_shard = primitives == "per_shard" or (primitives == "auto" and backend == "gloo")
        self._bytes = {kind: 0 for kind in CollectiveKind}

    # -- collectives -------------------------------------------------------------------------

    def all_reduce_sum(self, tensor: torch.Tensor) -> Pending:
        if self.world_size == 1:
            return DONE
        self._count(CollectiveKind.ALL_REDUCE, 2 * _bytes(tensor))
        return Pending((dist.all_reduce(tensor, group=self.group, async_op=True),))

    def reduce_scatter_sum(self, flat: torch.Tensor) -> Pending:
        """Sum ``flat`` over ranks into this rank's shard of it; other shards become undefined."""
        if self.world_size == 1:
            return DONE
        self._count(CollectiveKind.REDUCE_SCATTER, _bytes(flat))
        if self.per_shard:
            return self._shard_by_shard(dist.reduce, flat, "dst")
        shard = self._shards(flat)[self.rank]
        return Pending((_reduce_scatter_tensor(shard, flat, group=self.group, async_op=True),))

    def all_gather(self, flat: torch.Tensor) -> Pending:
        """Fill every shard of ``flat`` with its owner's values."""
        if self.world_size == 1:
            return DONE
        self._count(CollectiveKind.ALL_GATHER, _bytes(flat))
        if self.per_shard:
            return self._shard_by_shard(dist.broadcast, flat, "src")
        shard = self._shards(flat)[self.rank]
        return Pending((_all_gather_into_tensor(flat, shard, group=self.group, async_op=True),))

    def _shard_by_shard(self, collective: Any, flat: torch.Tensor, peer: str) -> Pending:
        """gloo: one rooted collective per shard, rooted at the shard's owner, all in flight."""
        return Pending(tuple(
            collective(shard, **{peer: self._global_rank(owner)}, group=self.group, async_op=True)
            for owner, shard in enumerate(self._shards(flat))
        ))

    def gather(self, flat: torch.Tensor, dst: int = 0) -> Pending:
        """Fill every shard of ``flat`` on rank ``dst`` alone with its owner's values (state
        export onto one rank); other ranks' buffers are left as they are."""
        if self.world_size == 1:
            return DONE
        self._count(CollectiveKind.GATHER, _bytes(flat))
        shards = self._shards(flat)
        own = shards[self.rank].clone()  # the input must not alias the destination on dst
        targets = shards if self.rank == dst else None
        work = dist.gather(own, gather_list=targets, dst=self._global_rank(dst), group=self.group, async_op=True)
        return Pending((work,))

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` with rank ``src``'s values, synchronously."""
        if self.world_size == 1:
            return
        works = []
        for tensor in tensors:
            self._count(CollectiveKind.BROADCAST, _bytes(tensor))
            works.append(dist.broadcast(tensor, src=self._global_rank(src), group=self.group, async_op=True))
        Pending(tuple(works)).wait()

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def each_rank(self, value: int) -> EachRank:
        """Start collecting every rank's ``value`` (control traffic, not counted)."""
        slots = torch.zeros(self.world_size, dtype=torch.int64)
        slots[self.rank] = value
        if self.world_size == 1:
            return EachRank(slots, DONE)
        return EachRank(slots, Pending((dist.all_reduce(slots, group=self.control_group, async_op=True),)))

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (small, JSON-serialisable), in rank order; not counted as traffic.

        Carried in byte tensors rather than by ``all_gather_object``, which needs numpy.
        """
        if self.world_size == 1:
            return [obj]
        payload = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([payload.numel()]), group=self.control_group)
        longest = max(int(size.item()) for size in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: payload.numel()] = payload
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded, group=self.control_group)
        return [json.loads(bytes(t[: int(n.item())].tolist())) for t, n in zip(gathered, sizes)]

    # -- accounting --------------------------------------------------------------------------

    def _count(self, kind: CollectiveKind, full_bytes: int) -> None:
        self._bytes[kind] += full_bytes * (self.world_size - 1) // self.world_size

    def report(self) -> dict[str, dict[str, int]]:
        """Bytes sent and received by this rank per collective kind since `reset_report`."""
        report = {kind.value: {"sent": n, "received": n} for kind, n in self._bytes.items()}
        total = sum(self._bytes.values())
        report["total"] = {"sent": total, "received": total}
        return report

    def reset_report(self) -> None:
        self._bytes = {kind: 0 for kind in CollectiveKind}

    # -- helpers -----------------------------------------------------------------------------

    def _shards(self, flat: torch.Tensor) -> list[torch.Tensor]:
        if flat.numel() % self.world_size:
            raise ValueError(f"flat buffer of {flat.numel()} elements does not split into {self.world_size} shards")
        return list(flat.view(self.world_size, -1).unbind(0))

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# torch 2.13 renamed the flat collectives; torch 2.4 has only the old names.
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def connect(config: CommConfig, device: torch.device) -> Comm:
    """The engine's `Comm`: a group of its own beside the caller's default group (so its
    collectives time out after ``comm.timeout_s`` whatever the caller chose), a new default
    group from torchrun's environment, or world size 1 without ``torch.distributed``."""
    timeout = config.timeout_s
    if dist.is_available() and dist.is_initialized():
        group, control = _own_group(timeout, "data", None), _own_group(timeout, "control", "gloo")
        return Comm(dist.get_rank(), dist.get_world_size(), dist.get_backend(), group, control, config.primitives)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Comm(0, 1, "none", primitives=config.primitives)
    backend = choose_backend(config.backend, device)
    options: dict[str, Any] = {}
    if backend == "nccl":
        options["device_id"] = _bind_cuda_device()
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout), **options)
    control = _own_group(timeout, "control", "gloo")
    return Comm(dist.get_rank(), dist.get_world_size(), backend, None, control, config.primitives)


_OWN_GROUPS: dict[tuple[int, float, str], Any] = {}


def _own_group(timeout_s: float, role: str, backend: str | None) -> Any:
    """One group over all ranks per default group, timeout and role (``new_group`` is
    collective, so engines created in the same order on every rank share it). ``backend``
    None: the default group's."""
    key = (id(dist.group.WORLD), timeout_s, role)
    if key not in _OWN_GROUPS:
        _OWN_GROUPS[key] = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s), backend=backend)
    return _OWN_GROUPS[key]


def choose_backend(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def local_cuda_device() -> torch.device:
    """CUDA only: this rank's GPU, one per local rank as torchrun numbers them (``LOCAL_RANK``,
    0 without torchrun)."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def _bind_cuda_device() -> torch.device:
    """CUDA only: make this rank's GPU current; NCCL is told it too (``device_id``), so it
    binds its communicator eagerly to that GPU."""
    device = local_cuda_device()
    torch.cuda.set_device(device)
    return device
