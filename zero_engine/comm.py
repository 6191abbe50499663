"""Collectives: the only module that calls ``torch.distributed``.

Every collective of a `GroupComm` works on flat buffers whose length is a multiple of its
group size ``N``, with group rank ``r``'s shard at ``[r * n / N, (r + 1) * n / N)``, and
returns a `Pending` handle so the caller decides when to wait. World size 1 needs no process
group: every call is a no-op.

Which primitive implements a collective is chosen per backend, by measurement (see
``docs/benchmarks.md``): gloo's own reduce-scatter and all-gather are naive (3-8x slower than
all-reduce on 16 MB here), so on gloo a reduce-scatter is one ``reduce`` per destination rank
and an all-gather one ``broadcast`` per source rank, all launched at once. NCCL uses its native
collectives. ``comm.primitives`` overrides the choice (tests run the native path on gloo).
Sums are divided explicitly by the caller: ``ReduceOp.AVG`` has been a sum on gloo in some
torch versions.

Two groups over all ranks: data (parameters, gradients: the device's backend, NCCL on CUDA)
and control (agreements between ranks and small JSON exchanges: always gloo, on CPU tensors,
so they never make the host wait for the device nor queue behind data collectives in flight).
With hybrid sharding (``zero_optimization.shard_group_size``), data traffic of sharded buffers
uses two more: the rank's shard group and its replica group (`Comm`).

Bytes are counted per collective kind as the ring algorithm's per-rank volume (an all-reduce
of ``b`` bytes sends and receives ``2 b (N-1)/N``; reduce-scatter and all-gather ``b (N-1)/N``
each), the lower bound that NCCL reaches and that the ZeRO paper's analysis uses.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from enum import Enum
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .config import ZeroEngineConfig, ZeroOptimizationConfig
from .devices import HOST, local_cuda_device, tensor_bytes
from .errors import ConfigError
from .stage import Stage


# Control tensors (agreements, JSON exchanges) live here, named explicitly: a factory without
# ``device=`` follows ``torch.set_default_device``, which would put every agreement through
# gloo's CUDA staging and sync the GPU once per gather.


class CollectiveKind(str, Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_GATHER_FROZEN = "all_gather_frozen"  # stage 3's gathers of frozen units, apart from the trainable ones
    BROADCAST = "broadcast"
    GATHER = "gather"


class Pending(NamedTuple):
    """Collectives in flight; `wait` blocks until all of them are done."""

    works: tuple[Any, ...] = ()

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def advance(self) -> bool:
        """Everything is launched already (see `TwoPhase`)."""
        return True

    def launch_rest(self) -> None:
        """Everything is launched already (see `TwoPhase`)."""

    def done(self) -> bool:
        """Completed, without waiting."""
        return all(work.is_completed() for work in self.works)


class Finishing:
    """Collectives in flight and the local work, if any, that completes their result once
    they are done (decoding a quantized buffer into place, `zero_engine.sharding.codec`);
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

    def advance(self) -> bool:
        return True

    def launch_rest(self) -> None:
        """Everything is launched already."""

    def done(self) -> bool:
        """The collectives completed (the finishing work runs at `wait`), without waiting."""
        return self.pending.done()


class TwoPhase:
    """A collective whose second phase needs the first one's result (hybrid sharding: the
    shard across groups once the group has reduced it). `advance` launches the second phase
    if the first has completed, without waiting; `wait` waits for both. Callers advance their
    reductions in launch order, stopping at the first not ready, so every rank launches the
    second phases in the same order.

    On NCCL (``start_now``) the second phase is launched at once, on a side stream
    (`second_phase_stream`): there ``is_completed()`` reflects GPU completion, which the host
    is ahead of, so polling would almost never succeed and every cross-group reduction would
    start after backward. ``wait()`` on an NCCL work makes the *current* stream wait, so the
    side stream waits for the first phase and the compute stream goes on: backward kernels
    are never queued behind a reduce-scatter (which serialized backward and, at stage 3,
    closed a cycle with the gathers queued behind it: a GPU hang). `wait` makes the compute
    stream wait for the second phase's collective itself, never for the side stream, whose
    queue by then holds the waits for later reductions too."""

    def __init__(
        self, first: Pending | Finishing, second: Callable[[], Pending | Finishing], *, start_now: bool = False
    ) -> None:
        self.first, self._second = first, second
        self.second: Pending | Finishing | None = None
        if start_now:  # NCCL (`Comm.orders_on_device`): the device orders the phases
            with second_phase_stream():
                self._start_second()

    def advance(self) -> bool:
        if self.second is None and all(work.is_completed() for work in self.first.works):
            self._start_second()
        return self.second is not None

    def done(self) -> bool:
        """Both phases completed, without waiting (starts the second if the first has)."""
        return self.advance() and self.second is not None and self.second.done()

    def launch_rest(self) -> None:
        """Launch the second phase now, waiting for the first if it has not completed."""
        if self.second is None:
            self._start_second()

    def wait(self) -> None:
        self.launch_rest()
        assert self.second is not None
        self.second.wait()

    def _start_second(self) -> None:
        self.first.wait()  # done already when advanced; on NCCL this orders the side stream
        self.second = self._second()


DONE = Pending()


@contextlib.contextmanager
def second_phase_stream() -> Iterator[None]:
    """Where the second phases of hybrid reductions run (`TwoPhase`): on CUDA a side stream
    that first waits for the current one; elsewhere the current stream (nothing to order)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        yield
        return
    with _cuda_side_stream():
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
def _cuda_side_stream() -> Iterator[None]:
    """CUDA only: the side stream, current for the block, after waiting for the current stream
    (what the block reads was written there). Tensors made in the block belong to the side
    stream's pool; one read later on another stream is marked (`used_on_current_stream`)."""
    current = torch.cuda.current_stream()
    side = _cuda_side_stream_of(current.device.index)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield


def _cuda_record_stream(tensor: torch.Tensor) -> None:
    tensor.record_stream(torch.cuda.current_stream(tensor.device))


def advance_in_order(reductions: Iterable[Pending | Finishing | TwoPhase]) -> None:
    """Start the second phase of reductions whose first is done, in launch order, stopping at
    the first not ready: the same order on every rank, and crossing groups overlaps whatever
    the caller does next."""
    for reduction in reductions:
        if not reduction.advance():
            break


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


class GroupComm:
    """One process group with a backend-specific choice of primitives and a byte counter."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        backend: str,
        group: Any = None,
        control_group: Any = None,
        primitives: str = "auto",
        force_collectives: bool = False,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        # A group of one rank issues nothing, unless told to (``comm.force_collectives``, tests;
        # ``group`` None is then the default group, of one rank).
        self.skips_collectives = world_size == 1 and not (force_collectives and dist.is_initialized())
        self.backend = backend
        self.group = group
        # Agreements between ranks (`each_rank`, `all_gather_json`) go through a gloo group of
        # their own: CPU tensors, never behind the data collectives in flight on ``group``.
        self.control_group = control_group
        self.per_shard = primitives == "per_shard" or (primitives == "auto" and backend == "gloo")
        self._bytes = {kind: 0 for kind in CollectiveKind}

    # -- collectives -------------------------------------------------------------------------

    def all_reduce_sum(self, tensor: torch.Tensor) -> Pending:
        if self.skips_collectives:
            return DONE
        self._count(CollectiveKind.ALL_REDUCE, 2 * tensor_bytes(tensor))
        return Pending((dist.all_reduce(tensor, group=self.group, async_op=True),))

    def reduce_scatter_sum(self, flat: torch.Tensor) -> Pending:
        """Sum ``flat`` over ranks into this rank's shard of it; other shards become undefined."""
        if self.skips_collectives:
            return DONE
        self._count(CollectiveKind.REDUCE_SCATTER, tensor_bytes(flat))
        if self.per_shard:
            return self._shard_by_shard(dist.reduce, flat, "dst")
        shard = self._shards(flat)[self.rank]
        return Pending((_reduce_scatter_tensor(shard, flat, group=self.group, async_op=True),))

    def all_gather(self, flat: torch.Tensor, kind: CollectiveKind = CollectiveKind.ALL_GATHER) -> Pending:
        """Fill every shard of ``flat`` with its owner's values (counted as ``kind``: a
        quantized all-reduce is an all-gather of encoded shards)."""
        if self.skips_collectives:
            return DONE
        self._count(kind, tensor_bytes(flat))
        if self.per_shard:
            return self._shard_by_shard(dist.broadcast, flat, "src")
        shard = self._shards(flat)[self.rank]
        return Pending((_all_gather_into_tensor(flat, shard, group=self.group, async_op=True),))

    def all_to_all(self, send: torch.Tensor, received: torch.Tensor) -> Pending:
        """Send shard ``j`` of ``send`` to group rank ``j``, receiving rank ``j``'s shard for
        this rank into shard ``j`` of ``received`` (a quantized reduce-scatter: each rank's
        encoded slice for each owner, counted as a reduce-scatter of the encoded bytes)."""
        if self.skips_collectives:
            return DONE
        self._count(CollectiveKind.REDUCE_SCATTER, tensor_bytes(send))
        return Pending((dist.all_to_all_single(received, send, group=self.group, async_op=True),))

    def _shard_by_shard(self, collective: Any, flat: torch.Tensor, peer: str) -> Pending:
        """gloo: one rooted collective per shard, rooted at the shard's owner, all in flight."""
        return Pending(tuple(
            collective(shard, **{peer: self._global_rank(owner)}, group=self.group, async_op=True)
            for owner, shard in enumerate(self._shards(flat))
        ))

    def gather(self, own: torch.Tensor, flat: torch.Tensor | None, dst: int = 0) -> Pending | Finishing:
        """Fill every shard of ``flat`` on rank ``dst`` with its owner's ``own`` shard (state
        export onto one rank). Only rank ``dst`` holds a full buffer: the others send their
        shard and pass ``flat`` None (GPU review P4: a whole unit allocated on every rank to
        send 1/N of it). ``own`` on rank ``dst`` is its shard of ``flat`` already.

        Point to point, each shard received straight into its place: ``dist.gather`` would
        take a copy of the own shard and, on gloo, a staging buffer of the whole buffer, so
        rank ``dst`` would hold the unit 2.5 times over instead of once. Where the backend's
        point to point cannot read device memory (`p2p_through_host`), each shard crosses
        through a host copy."""
        if self.skips_collectives:
            return DONE
        self._count(CollectiveKind.GATHER, tensor_bytes(own) * self.world_size)
        staged = p2p_through_host(self.backend, own)
        if self.rank == dst:
            if flat is None:
                raise ValueError("the gathering rank needs the full buffer")
            peers = [(rank, shard) for rank, shard in enumerate(self._shards(flat)) if rank != dst]
            landing = [torch.empty_like(shard, device=HOST) if staged else shard for _, shard in peers]
            ops = [dist.P2POp(dist.irecv, into, self._global_rank(rank), self.group)
                   for (rank, _), into in zip(peers, landing)]

            def place() -> None:
                for (_, shard), into in zip(peers, landing):
                    shard.copy_(into)

            finish = place if staged else None
        else:
            ops = [dist.P2POp(dist.isend, own.to(HOST) if staged else own, self._global_rank(dst), self.group)]
            finish = None
        if not ops:  # a group of one (``force_collectives``): no peer, the unit is already whole
            return DONE
        return Finishing(Pending(tuple(dist.batch_isend_irecv(ops))), finish)

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` with rank ``src``'s values, synchronously."""
        if self.skips_collectives:
            return
        works = []
        for tensor in tensors:
            self._count(CollectiveKind.BROADCAST, tensor_bytes(tensor))
            works.append(dist.broadcast(tensor, src=self._global_rank(src), group=self.group, async_op=True))
        Pending(tuple(works)).wait()

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def each_rank(self, value: int | Sequence[int]) -> EachRank:
        """Start collecting every rank's ``value``, an integer or a row of integers of the same
        length on every rank (control traffic, not counted)."""
        row = torch.tensor(value, dtype=torch.int64, device=HOST)
        slots = torch.zeros((self.world_size, *row.shape), dtype=torch.int64, device=HOST)
        slots[self.rank] = row
        if self.skips_collectives:
            return EachRank(slots, DONE)
        return EachRank(slots, Pending((dist.all_reduce(slots, group=self.control_group, async_op=True),)))

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (small, JSON-serialisable), in rank order; not counted as traffic.

        Carried in byte tensors rather than by ``all_gather_object``, which needs numpy.
        """
        if self.skips_collectives:
            return [obj]
        payload = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=HOST)
        sizes = [torch.zeros(1, dtype=torch.int64, device=HOST) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([payload.numel()], device=HOST), group=self.control_group)
        longest = max(int(size.item()) for size in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=HOST)
        padded[: payload.numel()] = payload
        gathered = [torch.empty(longest, dtype=torch.uint8, device=HOST) for _ in range(self.world_size)]
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

    def own_shard(self, flat: torch.Tensor) -> torch.Tensor:
        return self._shards(flat)[self.rank]

    def _shards(self, flat: torch.Tensor) -> list[torch.Tensor]:
        if flat.numel() % self.world_size:
            raise ValueError(f"flat buffer of {flat.numel()} elements does not split into {self.world_size} shards")
        return list(flat.view(self.world_size, -1).unbind(0))

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)


class Comm:
    """The engine's collectives, over ranks laid out as shard groups that replicate each other.

    Shard group ``g`` is ranks ``[g G, (g + 1) G)`` (``G``: ``zero_optimization.shard_group_size``,
    all ranks by default); a rank's replicas are the ranks at its place in the other groups.
    Sharded buffers split into ``G`` shards (``shard_rank`` owns one). A reduce-scatter sums
    over every rank: inside the group, then the owned shard is all-reduced across replicas, so
    only ``1/G`` of the bytes crosses groups (nodes). An all-gather stays inside the group.
    Whole-buffer all-reduces (stage 0, agreements), broadcasts and control traffic span all
    ranks. With one group (the default) this is plain ZeRO over every rank.
    """

    def __init__(
        self,
        world: GroupComm,
        shard_group: GroupComm,
        replica_group: GroupComm,
        reduce_group: GroupComm | None = None,
    ) -> None:
        self.world, self.shard_group, self.replica_group = world, shard_group, replica_group
        # Reduce-scatters inside the shard group: the shard group itself, or (stage 3) a group
        # of the same ranks of their own, so their order needs no agreement with the gathers'.
        self.reduce_group = reduce_group or shard_group
        self.rank, self.world_size, self.backend = world.rank, world.world_size, world.backend
        self.group, self.control_group = world.group, world.control_group
        self.shard_rank, self.num_shards = self.shard_group.rank, self.shard_group.world_size
        self.replica_rank, self.num_replicas = self.replica_group.rank, self.replica_group.world_size

    @classmethod
    def alone(cls, primitives: str = "auto") -> Comm:
        """World size 1, without ``torch.distributed``: every collective is a no-op."""
        return cls(*(GroupComm(0, 1, "none", primitives=primitives) for _ in range(3)))

    @property
    def orders_on_device(self) -> bool:
        """Waiting on a collective orders the device's stream instead of blocking the host (NCCL)."""
        return self.backend == "nccl"

    @property
    def shard_group_ranks(self) -> list[int]:
        """The global ranks this rank shards with (itself included)."""
        first = self.rank - self.shard_rank
        return list(range(first, first + self.num_shards))

    @property
    def replica_group_ranks(self) -> list[int]:
        """The global ranks holding the same shard as this one (itself included)."""
        return list(range(self.shard_rank, self.world_size, self.num_shards))

    # -- data --------------------------------------------------------------------------------

    def all_reduce_sum(self, tensor: torch.Tensor) -> Pending:
        return self.world.all_reduce_sum(tensor)

    def reduce_scatter_sum(self, flat: torch.Tensor) -> Pending | TwoPhase:
        """Sum ``flat`` over every rank into this rank's shard of it (``num_shards`` shards);
        other shards become undefined. Across groups, only the shard travels, once the group's
        reduce-scatter has filled it."""
        inside = self.reduce_scatter_in_group(flat)
        if self.num_replicas == 1:
            return inside
        shard = self.shard_group.own_shard(flat)
        return TwoPhase(inside, lambda: self.all_reduce_across_groups(shard), start_now=self.orders_on_device)

    def reduce_scatter_in_group(self, flat: torch.Tensor) -> Pending:
        """Sum ``flat`` over this rank's shard group only, into this rank's shard."""
        return self.reduce_group.reduce_scatter_sum(flat)

    def all_reduce_across_groups(self, shard: torch.Tensor) -> Pending:
        """Sum a shard over the ranks that hold the same shard in every group."""
        return self.replica_group.all_reduce_sum(shard)

    def all_gather(self, flat: torch.Tensor, kind: CollectiveKind = CollectiveKind.ALL_GATHER) -> Pending:
        """Fill every shard of ``flat`` with its owner's values (inside the shard group)."""
        return self.shard_group.all_gather(flat, kind)

    def gather(self, own: torch.Tensor, flat: torch.Tensor | None, dst: int = 0) -> Pending | Finishing:
        """Fill every shard of ``flat`` on rank 0 alone (`GroupComm.gather`: the others pass
        None); only rank 0's group takes part."""
        if dst != 0:
            raise ValueError("gather collects onto rank 0 only")
        return self.shard_group.gather(own, flat, dst=0) if self.replica_rank == 0 else DONE

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        self.world.broadcast(tensors, src)

    def broadcast_across_groups(self, shards: Sequence[torch.Tensor]) -> None:
        """Overwrite this rank's ``shards`` with their copies in the first shard group."""
        self.replica_group.broadcast(shards, src=0)

    def abort_data_groups(self) -> str:
        """After the ranks diverged, on NCCL: abort the engine's data communicators, whose
        queues hold collectives one rank launched and another never will; otherwise the next
        device sync (``loss.item()``) or the exit would wait ``comm.timeout_s`` for them (30
        minutes by default) before the watchdog ends the job. On gloo nothing waits on a device:
        the host raises and its collectives time out on their own.

        Returns what the divergence message adds: that they were aborted, that they could not
        be (torch before 2.6 has no ``ProcessGroup.abort``: the job must be killed), or nothing
        (gloo)."""
        if not self.orders_on_device:
            return ""
        groups = [comm.group for comm in (self.world, self.shard_group, self.replica_group, self.reduce_group)]
        aborted = {id(group): group for group in groups if group is not None}
        if self.world.group is None and dist.is_initialized():  # the default group, which the engine made
            aborted[id(dist.group.WORLD)] = dist.group.WORLD
        done = [_abort_group(group) for group in aborted.values()]
        for key, group in list(_OWN_GROUPS.items()):  # a later engine makes new ones
            if id(group) in aborted:
                del _OWN_GROUPS[key]
        return ABORTED if all(done) else NOT_ABORTED

    # -- control -----------------------------------------------------------------------------

    def barrier(self) -> None:
        self.world.barrier()

    def each_rank(self, value: int | Sequence[int]) -> EachRank:
        return self.world.each_rank(value)

    def all_gather_json(self, obj: Any) -> list[Any]:
        return self.world.all_gather_json(obj)

    # -- accounting --------------------------------------------------------------------------

    def report(self) -> dict[str, dict[str, int]]:
        """Bytes sent and received by this rank since `reset_report`: per collective kind, in
        total, and by scope: ``intra_group`` (reduce-scatters and gathers inside the shard
        group), ``inter_group`` (shard all-reduces across groups), ``all_ranks`` (whole-buffer
        all-reduces, agreements, broadcasts)."""
        scopes = {"intra_group": self.shard_group, "inter_group": self.replica_group, "all_ranks": self.world}
        per_scope = {name: comm.report() for name, comm in scopes.items()}
        if self.reduce_group is not self.shard_group:
            per_scope["intra_group"] = _sum_reports(per_scope["intra_group"], self.reduce_group.report())
        report = {
            kind.value: {
                direction: sum(part[kind.value][direction] for part in per_scope.values())
                for direction in ("sent", "received")
            }
            for kind in CollectiveKind
        }
        report["total"] = {d: sum(part["total"][d] for part in per_scope.values()) for d in ("sent", "received")}
        report.update({name: part["total"] for name, part in per_scope.items()})
        return report

    def reset_report(self) -> None:
        for comm in {id(c): c for c in (self.world, self.shard_group, self.replica_group, self.reduce_group)}.values():
            comm.reset_report()


def _sum_reports(a: dict[str, dict[str, int]], b: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {key: {d: a[key][d] + b[key][d] for d in a[key]} for key in a}


# torch 2.13 renamed the flat collectives; torch 2.4 has only the old names.
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def connect(config: ZeroEngineConfig, device: torch.device) -> Comm:
    """The engine's `Comm`: groups of its own beside the caller's default group (so its
    collectives time out after ``comm.timeout_s`` whatever the caller chose), a new default
    group from torchrun's environment, or world size 1 without ``torch.distributed``. What
    the stage adds comes once it is known (`with_stage_groups`: ``stage: auto`` is agreed
    over this one)."""
    timeout, primitives = config.comm.timeout_s, config.comm.primitives
    if dist.is_available() and dist.is_initialized():
        backend = device_backend(device)
        if backend == "nccl":  # read by each NCCL group as it is made: ours come next
            avoid_nccl_record_streams()
        data = _own_group(timeout, "data", None)
    elif "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        config.zero_optimization.shard_group_size_for(1)  # a group size that needs more ranks fails here too
        return Comm.alone(primitives)
    else:
        backend = choose_backend(config.comm.backend, device)
        options: dict[str, Any] = {}
        if backend == "nccl":
            avoid_nccl_record_streams()
            options["device_id"] = _bind_cuda_device()
        dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout), **options)
        data = None  # the default group
    rank, world_size = dist.get_rank(), dist.get_world_size()
    force = config.comm.force_collectives
    world = GroupComm(rank, world_size, backend, data, _own_group(timeout, "control", "gloo"), primitives, force)
    size = _agreed_shard_group_size(config.zero_optimization, world)
    shard_group, replica_group = _hybrid_groups(timeout, world_size, rank, size, data)
    shards = GroupComm(rank % size, size, backend, shard_group, None, primitives, force)
    replicas = GroupComm(rank // size, world_size // size, backend, replica_group, None, primitives, force)
    return Comm(world, shards, replicas)


def with_stage_groups(comm: Comm, config: ZeroEngineConfig, stage: Stage) -> Comm:
    """``comm`` with what ``stage`` needs besides: at stage 3, reduce-scatters on a group of
    their own (`_reduce_group`). Every rank calls it at the same point (``new_group`` is
    collective)."""
    size = comm.num_shards
    if not (stage.shard_parameters and size > 1):
        return comm
    group = _reduce_group(config.comm.timeout_s, comm.world_size, comm.rank, size)
    reduces = GroupComm(
        comm.shard_rank, size, comm.backend, group, None, config.comm.primitives, config.comm.force_collectives
    )
    return Comm(comm.world, comm.shard_group, comm.replica_group, reduces)


def _agreed_shard_group_size(zero: ZeroOptimizationConfig, world: GroupComm) -> int:
    """``zero_optimization.shard_group_size`` for this world, the same on every rank ('auto'
    reads each node's LOCAL_WORLD_SIZE, which could differ between nodes)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    size = zero.shard_group_size_for(world.world_size, int(local) if local else None)
    sizes = world.each_rank(size).values()
    if len(set(sizes)) > 1:
        raise ConfigError(
            f"zero_optimization.shard_group_size resolves differently on different ranks (rank: size "
            f"{dict(enumerate(sizes))}): with 'auto', every node must run the same number of ranks"
        )
    return size


def _hybrid_groups(timeout_s: float, world_size: int, rank: int, size: int, data: Any) -> tuple[Any, Any]:
    """This rank's shard group (``size`` consecutive ranks) and replica group (the ranks at
    the same place in every shard group). A single group is the data group itself, and a
    group of one rank needs none. Every rank makes every group (``new_group`` is collective)."""
    if size == world_size:
        return data, None
    if size == 1:
        return None, data
    shard_groups = [
        _own_group(timeout_s, "data", None, range(g * size, (g + 1) * size)) for g in range(world_size // size)
    ]
    replica_groups = [_own_group(timeout_s, "data", None, range(s, world_size, size)) for s in range(size)]
    return shard_groups[rank // size], replica_groups[rank % size]


def _reduce_group(timeout_s: float, world_size: int, rank: int, size: int) -> Any:
    """Stage 3: a group of this rank's shard group's ranks for reduce-scatters alone. Gathers
    launch in the order the ranks agree on (`zero_engine.sharding.agreement`), reductions in
    unit order as gradients complete; on one group the two orders would have to interleave
    alike on every rank, which depends on which parameters got gradients where."""
    groups = [
        _own_group(timeout_s, "reduce", None, range(g * size, (g + 1) * size)) for g in range(world_size // size)
    ]
    return groups[rank // size]


_OWN_GROUPS: dict[tuple[int, float, str, tuple[int, ...] | None], Any] = {}


def _own_group(timeout_s: float, role: str, backend: str | None, ranks: range | None = None) -> Any:
    """One group per default group, timeout, role and ranks (all ranks when None; ``new_group``
    is collective, so engines created in the same order on every rank share it). ``backend``
    None: the default group's."""
    members = tuple(ranks) if ranks is not None else None
    key = (id(dist.group.WORLD), timeout_s, role, members)
    if key not in _OWN_GROUPS:
        timeout = datetime.timedelta(seconds=timeout_s)
        _OWN_GROUPS[key] = dist.new_group(ranks=list(members) if members else None, timeout=timeout, backend=backend)
    return _OWN_GROUPS[key]


ABORTED = " (the engine's NCCL communicators were aborted, so nothing waits for the unmatched collectives)"
NOT_ABORTED = (
    f" (this torch, {torch.__version__}, cannot abort NCCL communicators (ProcessGroup.abort came in 2.6): the "
    "unmatched collectives stay queued, so the next device sync or the exit waits comm.timeout_s for them. "
    "Kill the job)"
)


def _abort_group(group: Any) -> bool:
    """NCCL: abort a process group's communicators (drops what is queued; torch 2.6 on has it).
    Returns whether it could."""
    abort = getattr(group, "abort", None)
    if abort is None:
        return False
    abort()
    return True


def p2p_through_host(backend: str, tensor: torch.Tensor) -> bool:
    """Whether point-to-point sends and receives of ``tensor`` must cross through host memory:
    gloo's read and write the tensor's pointer as host memory, so a CUDA tensor ends the
    process ("writev: Bad address"; seen on an H200 with torch 2.11, ranks sharing the GPU
    over gloo). The collectives the engine runs on gloo (all-reduce, reduce, broadcast) took
    CUDA tensors there."""
    return backend == "gloo" and tensor.device.type != "cpu"


def device_backend(device: torch.device, group: Any = None) -> str:
    """The backend that moves ``device``'s tensors on ``group`` (the default group when None).

    ``dist.get_backend`` reports the string the group was made with, which may name a backend
    per device: ``init_process_group("cuda:nccl,cpu:gloo")`` (torchtitan-style scripts) reports
    that string, and a plain ``init_process_group()`` reports "undefined". Compared with "nccl",
    either turned every NCCL-specific path off (GPU review P1); the group's backend
    configuration names the backend of each device type."""
    config = dist.get_backend_config(group)  # "cuda:nccl", "cpu:gloo,cuda:gloo", "cpu:gloo,cuda:nccl"
    per_device = dict(entry.split(":", 1) for entry in config.split(",") if ":" in entry)
    return per_device.get(device.type) or dist.get_backend(group)


def choose_backend(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def free_cuda_bytes(device: torch.device) -> int:
    """CUDA only: the device's free memory, as the driver reports it."""
    free, _total = torch.cuda.mem_get_info(device)
    return free


def avoid_nccl_record_streams() -> None:
    """CUDA only, before the first NCCL group: before torch 2.8, ProcessGroupNCCL records the
    inputs and outputs of async collectives on its stream, so storage freed with ``resize_(0)``
    (stage 3's gathered units) or a dropped bucket cannot be reused until the NCCL stream
    catches up; stage 3 never syncs the host in forward and backward, so about one gathered
    unit per unit of lead would stay allocated. ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` makes it
    keep the tensors alive until ``wait()`` instead (the default from torch 2.8). A value the
    user set is kept."""
    if _torch_version() < (2, 8):
        os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _bind_cuda_device() -> torch.device:
    """CUDA only: make this rank's GPU current; NCCL is told it too (``device_id``), so it
    binds its communicator eagerly to that GPU."""
    device = local_cuda_device()
    torch.cuda.set_device(device)
    return device
