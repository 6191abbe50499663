"""Process groups: the only module that calls ``torch.distributed``'s collectives.

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

import atexit
import datetime
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..devices import HOST, tensor_bytes
from .mesh import Mesh
from .handles import (
    DONE, ON_SIDE_STREAM, CollectiveKind, EachRank, Finishing, Pending, SecondPhaseStarter, SecondPhaseThread, TwoPhase,
)

# Control tensors (agreements, JSON exchanges) live here, named explicitly: a factory without
# ``device=`` follows ``torch.set_default_device``, which would put every agreement through
# gloo's CUDA staging and sync the GPU once per gather.


_FIRST_USES = ("zero", "replicate", "sequence")  # a `Comm`'s own properties name their groups


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
        self.primitives, self.force_collectives = primitives, force_collectives  # as given: groups made later copy them
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

    def all_to_all(
        self, send: torch.Tensor, received: torch.Tensor, kind: CollectiveKind = CollectiveKind.REDUCE_SCATTER
    ) -> Pending:
        """Send shard ``j`` of ``send`` to group rank ``j``, receiving rank ``j``'s shard for
        this rank into shard ``j`` of ``received``: a quantized reduce-scatter (each rank's
        encoded slice for each owner, counted as a reduce-scatter of the encoded bytes), or
        Ulysses' exchange of sequence slices and heads (``kind`` ALL_TO_ALL)."""
        if self.skips_collectives:
            return DONE
        self._count(kind, tensor_bytes(send))
        return Pending((dist.all_to_all_single(received, send, group=self.group, async_op=True),))

    def exchange_pieces(
        self, send: torch.Tensor, send_sizes: Sequence[int], received: torch.Tensor, received_sizes: Sequence[int],
        kind: CollectiveKind = CollectiveKind.MATRIX_EXCHANGE,
    ) -> Pending:
        """Send ``send``'s ``send_sizes[j]`` elements (consecutive, in group rank order) to group
        rank ``j``, receiving rank ``j``'s into ``received`` likewise: an all-to-all of pieces
        of any sizes, zero included (a whole-matrix optimizer's pieces to each matrix's owner
        and back; tokens to their experts' owners, ``kind`` ALL_TO_ALL). Counted as the bytes
        this rank sends to others."""
        if self.skips_collectives:
            return DONE
        own = send_sizes[self.rank]
        self._bytes[kind] += (sum(send_sizes) - own) * send.element_size()
        return Pending((dist.all_to_all_single(
            received, send, list(received_sizes), list(send_sizes), group=self.group, async_op=True
        ),))

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
        send 1/N of it). ``own`` on rank ``dst`` is its shard of ``flat`` already. Point to
        point, each shard received straight into its place (`gather_pieces`): ``dist.gather``
        would take a copy of the own shard and, on gloo, a staging buffer of the whole buffer,
        so rank ``dst`` would hold the unit 2.5 times over instead of once."""
        if self.rank == dst and flat is None:
            raise ValueError("the gathering rank needs the full buffer")
        pieces = self._shards(flat) if self.rank == dst else [own if rank == self.rank else None
                                                               for rank in range(self.world_size)]
        return self.gather_pieces(pieces, onto=dst)

    def gather_pieces(self, pieces: Sequence[torch.Tensor | None], onto: int | None = None) -> Pending | Finishing:
        """Fill ``pieces[k]`` with group rank ``k``'s values, pieces of any sizes (some empty):
        on every rank, one broadcast per piece rooted at its owner; or on rank ``onto`` alone,
        point to point (the other ranks pass only their own piece, None for the rest), each
        received straight into its place (through a host copy where the backend's point to
        point cannot read device memory: `p2p_through_host`). For streaming a model's
        parameters (`zero_engine.state.streaming`): a parameter lies in the shards of the ranks
        it spans, in pieces that an all-gather would pad to the largest. On NCCL the
        broadcasts are one call, ``all_gather`` of pieces of their own sizes, which
        ProcessGroupNCCL runs as one coalesced group of broadcasts (one launch, not one per owner)."""
        if self.skips_collectives:
            return DONE
        own = pieces[self.rank]
        sizes = [piece.numel() if piece is not None else 0 for piece in pieces]
        if onto is None:
            self._count(CollectiveKind.ALL_GATHER, sum(sizes) * own.element_size())
            if self.backend == "nccl":  # pieces of their own sizes: NCCL runs them as one group of broadcasts (Q5)
                return Pending((dist.all_gather(list(pieces), own, group=self.group, async_op=True),))
            return Pending(tuple(  # gloo's all-gather takes pieces of one size only
                dist.broadcast(piece, src=self._global_rank(owner), group=self.group, async_op=True)
                for owner, piece in enumerate(pieces) if piece is not None and piece.numel()
            ))
        self._count(CollectiveKind.GATHER, (sum(sizes) if self.rank == onto else own.numel() * self.world_size)
                    * own.element_size())
        staged = p2p_through_host(self.backend, own)
        if self.rank == onto:
            peers = [(rank, piece) for rank, piece in enumerate(pieces) if rank != onto and piece.numel()]
            landing = [torch.empty_like(piece, device=HOST) if staged else piece for _, piece in peers]
            ops = [dist.P2POp(dist.irecv, into, self._global_rank(rank), self.group)
                   for (rank, _), into in zip(peers, landing)]

            def place() -> None:
                for (_, piece), into in zip(peers, landing):
                    piece.copy_(into)

            finish = place if staged else None
        else:
            ops = [dist.P2POp(dist.isend, own.to(HOST) if staged else own, self._global_rank(onto), self.group)]
            ops, finish = (ops if own.numel() else []), None
        if not ops:  # a group of one (``force_collectives``), or nothing to send
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
    """The engine's collectives, over ranks laid out as its `Mesh` says, with one `GroupComm`
    per use of the mesh (`group`): shard groups (``zero``) that replicate each other, sequence
    groups inside them, any other axis by its name.

    Shard group ``g`` is ranks ``[g G, (g + 1) G)`` (``G``: ``zero_optimization.shard_group_size``,
    all ranks by default); a rank's replicas are the ranks at its place in the other groups.
    Sharded buffers split into ``G`` shards (``shard_rank`` owns one). A reduce-scatter sums
    over every rank: inside the group, then the owned shard is all-reduced across replicas, so
    only ``1/G`` of the bytes crosses groups (nodes). An all-gather stays inside the group.
    Whole-buffer all-reduces (stage 0, agreements), broadcasts and control traffic span all
    ranks. With one group (the default) this is plain ZeRO over every rank.
    """

    def __init__(
        self, mesh: Mesh, groups: Mapping[str, GroupComm], timeout_s: float | None = None, *, checked: bool = True,
        owners: Mapping[str, Comm] | None = None,
    ) -> None:
        """``groups``: ``world`` and the groups of ``mesh.communicators()`` (one that is
        missing: a group of one rank, which its use must have); ``reduce``, stage 3's
        reduce-scatters on a group of the zero ranks of their own (the zero group itself when
        missing), so their order needs no agreement with the gathers'. ``owners``: for an axis
        parameters are cut along (``expert``), the `Comm` of the ranks holding the same part
        (`owners_of`)."""
        self.owners = dict(owners or {})
        world = groups["world"]
        self.world = world
        self.mesh = mesh  # the layout and the rank counts by use
        self.timeout_s = timeout_s  # the engine's groups' (``comm.timeout_s``): groups made later take it too
        self._groups = {"world": world}
        for use, _, _ in mesh.communicators():
            self._groups[use] = groups.get(use) or GroupComm(0, 1, world.backend, primitives=world.primitives)
        self._groups["reduce"] = groups.get("reduce") or self._groups["zero"]
        for name, group in self._groups.items() if checked else ():
            expected = mesh.size("zero" if name == "reduce" else name)
            if group.world_size != expected:
                raise ValueError(f"{mesh} has {expected} ranks in a group of {name!r}, not the {group.world_size} "
                                 "of the group given")
        self.rank, self.world_size, self.backend = world.rank, world.world_size, world.backend
        self.control_group = world.control_group  # agreements; the data process group is `world.group`
        self.shard_rank, self.num_shards = self.shard_group.rank, self.shard_group.world_size
        self.replica_rank, self.num_replicas = self.replica_group.rank, self.replica_group.world_size
        # Who launches a hybrid reduction's second phase (`TwoPhase`): never this rank's host.
        self.second_phases: SecondPhaseStarter = ON_SIDE_STREAM if self.orders_on_device else SecondPhaseThread()

    @classmethod
    def alone(cls, primitives: str = "auto") -> Comm:
        """World size 1, without ``torch.distributed``: every collective is a no-op."""
        return cls(Mesh.for_world(1, 1), {"world": GroupComm(0, 1, "none", primitives=primitives)})

    @classmethod
    def of_groups(
        cls, world: GroupComm, shard_group: GroupComm, replica_group: GroupComm, reduce_group: GroupComm | None = None,
    ) -> Comm:
        """Tests and fakes: a `Comm` over the groups given, its mesh read from the shard and
        replica groups' sizes (the world group's own size not checked against it)."""
        mesh = Mesh.of(replicate=replica_group.world_size, shard=shard_group.world_size)
        groups = {"world": world, "zero": shard_group, "replicate": replica_group}
        return cls(mesh, {**groups, **({"reduce": reduce_group} if reduce_group else {})}, checked=False)

    def group(self, use: str) -> GroupComm:
        """This rank's group of a use or axis of the mesh (``world``, ``zero``, ``replicate``,
        ``sequence``, ``reduce``, any other axis by its name)."""
        if use not in self._groups:
            raise KeyError(f"no group {use!r}: this engine's groups are {sorted(self._groups)}")
        return self._groups[use]

    def with_group(self, use: str, group: GroupComm) -> Comm:
        """This `Comm` with ``group`` as its group of ``use`` (stage 3's reduce group)."""
        return Comm(self.mesh, {**self._groups, use: group}, self.timeout_s, owners=self.owners)

    def with_owners(self, owners: Mapping[str, Comm]) -> Comm:
        """This `Comm` with these owners' `Comm`s (`owners_of`)."""
        return Comm(self.mesh, self._groups, self.timeout_s, owners=owners)

    def owners_of(self, axes: tuple[str, ...]) -> Comm:
        """The `Comm` that shards, reduces and gathers a parameter cut along ``axes``: over the
        ranks that hold the same part of it (the mesh `without` those axes: its ``zero`` group
        splits the part's state, its ``world`` sums its gradients), this `Comm` itself for a
        parameter cut along none."""
        if not axes:
            return self
        if len(axes) > 1 or axes[0] not in self.owners:
            raise KeyError(f"no owners' groups for a parameter cut along {list(axes)}: this engine has "
                           f"{sorted(self.owners) or 'none'}")
        return self.owners[axes[0]]

    @property
    def shard_group(self) -> GroupComm:
        """The ranks a sharded state is split over (the ``zero`` use)."""
        return self._groups["zero"]

    @property
    def replica_group(self) -> GroupComm:
        """The ranks holding the same shard in every shard group."""
        return self._groups["replicate"]

    @property
    def sequence_group(self) -> GroupComm:
        """The ranks that split one sequence between them (Ulysses; a group of one without it)."""
        return self._groups["sequence"]

    @property
    def reduce_group(self) -> GroupComm:
        """Reduce-scatters inside the shard group: the shard group itself, or (stage 3) a group
        of the same ranks of their own."""
        return self._groups["reduce"]

    @property
    def orders_on_device(self) -> bool:
        """Waiting on a collective orders the device's stream instead of blocking the host (NCCL)."""
        return self.backend == "nccl"

    @property
    def shard_group_ranks(self) -> list[int]:
        """The global ranks this rank shards with (itself included)."""
        return list(self.mesh.group_of("zero", self.rank))

    @property
    def replica_group_ranks(self) -> list[int]:
        """The global ranks holding the same shard as this one (itself included)."""
        return list(self.mesh.group_of("replicate", self.rank))

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
        return TwoPhase(inside, lambda: self.all_reduce_across_groups(shard), self.second_phases, flat.device)

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

    def gather_pieces(self, pieces: Sequence[torch.Tensor | None], onto: int | None = None) -> Pending | Finishing:
        """`GroupComm.gather_pieces` inside the shard group (onto its rank 0 of the first
        replica group alone, as `gather`, when ``onto`` is 0)."""
        if onto not in (None, 0):
            raise ValueError("gather_pieces collects onto rank 0 only")
        if onto == 0 and self.replica_rank != 0:
            return DONE
        return self.shard_group.gather_pieces(pieces, onto)

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        self.world.broadcast(tensors, src)

    def broadcast_across_groups(self, shards: Sequence[torch.Tensor]) -> None:
        """Overwrite this rank's ``shards`` with their copies in the first shard group."""
        self.replica_group.broadcast(shards, src=0)

    @property
    def data_groups(self) -> tuple[GroupComm, ...]:
        """Every group the data collectives run on, in one order on every rank: the world, the
        shard, replica and reduce groups, the sequence group, then any other axis's (some may be
        the same group)."""
        first = (self.world, self.shard_group, self.replica_group, self.reduce_group, self.sequence_group)
        others = tuple(self._groups[use] for use, _, _ in self.mesh.communicators() if use not in _FIRST_USES)
        return first + others + tuple(group for owners in self.owners.values() for group in owners.data_groups)

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
        groups = [comm.group for comm in self.data_groups]
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
        if self.sequence_group.world_size > 1:  # Ulysses' all-to-alls, inside each sequence group
            per_scope["sequence_group"] = self.sequence_group.report()
        for use, _, _ in self.mesh.communicators():  # any other axis's (the expert group's exchanges)
            if use in _FIRST_USES:
                continue
            if self._groups[use].world_size > 1:
                per_scope[f"{use}_group"] = self._groups[use].report()
        if self.reduce_group is not self.shard_group:
            per_scope["intra_group"] = _sum_reports(per_scope["intra_group"], self.reduce_group.report())
        for axis, owners in self.owners.items():  # the reductions and gathers of parameters cut along an axis
            per_scope[f"{axis}_owners"] = _owned_report(owners)
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
        for comm in {id(c): c for c in self.data_groups}.values():
            comm.reset_report()


def _owned_report(owners: Comm) -> dict[str, dict[str, int]]:
    """An owners' `Comm`'s bytes per kind, each of its groups counted once."""
    parts = [group.report() for group in {id(g): g for g in owners.data_groups}.values()]
    total = parts[0]
    for part in parts[1:]:
        total = _sum_reports(total, part)
    return total


def _sum_reports(a: dict[str, dict[str, int]], b: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {key: {d: a[key][d] + b[key][d] for d in a[key]} for key in a}


# torch 2.13 renamed the flat collectives; torch 2.4 has only the old names.
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_OWN_GROUPS: dict[tuple[int, float, str, tuple[int, ...] | None], Any] = {}


def own_group(timeout_s: float, role: str, backend: str | None, ranks: range | None = None) -> Any:
    """One group per default group, timeout, role and ranks (all ranks when None; ``new_group``
    is collective, so engines created in the same order on every rank share it). ``backend``
    None: the default group's."""
    members = tuple(ranks) if ranks is not None else None
    key = (id(dist.group.WORLD), timeout_s, role, members)
    if key not in _OWN_GROUPS:
        timeout = datetime.timedelta(seconds=timeout_s)
        _OWN_GROUPS[key] = dist.new_group(ranks=list(members) if members else None, timeout=timeout, backend=backend)
        _exit_after_gloo_threads()
    return _OWN_GROUPS[key]


_EXIT_PAUSE_S = 0.05
_exit_pause_registered = False


def _exit_after_gloo_threads() -> None:
    """Before Python finalizes, let gloo's worker threads let go of the last collectives.

    A gloo worker thread releases a collective's tensors after the caller's ``wait()`` has
    returned; releasing a tensor that Python made takes the GIL. A script that ends right after
    a collective (the README's loop ends with ``full_state_dict()``) could reach finalization
    while such a thread waited for the GIL, and a thread that takes the GIL once Python is
    finalizing ends the process: "terminate called without an active exception", a SIGABRT at
    exit in 1 run in 5 on 2 ranks here (issue 65; seen in gdb: ``~AsyncAllreduceWork`` on a
    ``pt_gloo_runloop`` thread, in ``take_gil``). atexit callbacks run before finalization: a
    moment there with the GIL released lets those threads finish. No collective, so a rank
    that exits on an error waits for nobody."""
    global _exit_pause_registered
    if not _exit_pause_registered:
        _exit_pause_registered = True
        atexit.register(time.sleep, _EXIT_PAUSE_S)


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
