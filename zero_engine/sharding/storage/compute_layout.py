"""How the optimizer computes on a unit's parameters, apart from how they are stored.

Storage cuts a unit's flat buffer into one range per rank, across parameter boundaries. An
*elementwise* optimizer (AdamW, SGD, ...: `zero_engine.optim.OPTIMIZERS`) steps each rank's
pieces as they lie. A *whole-matrix* one (Muon) needs each matrix whole for part of its update,
so a unit with such parameters has a `MatrixExchange`: after the optimizer's elementwise part
has left each piece's update in ``optimizer.pending``, every rank sends its pieces of each
matrix to the matrix's owner (one all-to-all), the owner computes the whole matrix's update,
and sends every rank its slice back (a second one), which the rank applies to its piece. So
each matrix is computed once per step, by one rank, from its whole gradient; momentum and the
rest of the state stay in pieces, sharded as any optimizer state is.

Owners are chosen once for the whole model (`assign_owners`), the largest matrices first to the
least loaded rank, so that no rank does much more of the whole-matrix work than the mean.
Below stage 1 every rank holds every matrix (``replicated``): nothing is gathered, and the
owner sends its result to the others.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...comm import GroupComm


class WholeMatrixOptimizer(Protocol):
    """What the exchange asks of the optimizer (`zero_engine.muon.MuonWithAdamW`)."""

    pending: dict[torch.Tensor, torch.Tensor]  # each stepped piece's elementwise update

    def orthogonalise_matrix(self, update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor: ...

    def apply_orthogonal(
        self, param: torch.Tensor, orthogonal: torch.Tensor, group: dict[str, Any], shape: tuple[int, int]
    ) -> None: ...


class Piece(Protocol):
    """A stepped tensor and where it lies (`zero_engine.sharding.storage.optimizer_shard.OptimizerTarget`)."""

    tensor: torch.Tensor

    @property
    def param_index(self) -> int: ...


@dataclass(frozen=True)
class Matrix:
    """One whole-matrix parameter of a unit."""

    param_index: int
    offset: int  # its first element in the unit's flat buffer
    numel: int
    shape: tuple[int, int]  # the matrix it is computed as
    owner: int  # the group rank that computes its whole-matrix part
    group: dict[str, Any]  # its torch param group (options; the same on every rank)


def matrix_cost(shape: tuple[int, int]) -> int:
    """Newton-Schulz work of one iteration on a ``shape`` matrix, up to a constant factor:
    with ``m <= n`` the sides, ``X X^T`` and ``B X`` are ``m^2 n`` each, ``A A`` is ``m^3``."""
    m, n = sorted(shape)
    return 2 * m * m * n + m ** 3


def assign_owners(costs: Sequence[int], ranks: int) -> list[int]:
    """The owner of each matrix: largest first, each to the rank with the least work so far
    (ties to the lowest rank), the same on every rank."""
    owners = [0] * len(costs)
    loads = [(0, rank) for rank in range(ranks)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + costs[index], rank))
    return owners


class MatrixExchange:
    """A unit's whole-matrix parameters and the ranges every group rank steps of it."""

    def __init__(
        self,
        matrices: list[Matrix],
        ranges: Sequence[tuple[int, int]],
        comm: GroupComm,
        device: torch.device,
        *,
        replicated: bool,
    ) -> None:
        self.matrices = matrices
        self.ranges = list(ranges)  # group rank -> the range of the unit's flat buffer it steps
        self.comm = comm
        self.device = device  # where pieces travel and matrices are computed (the unit's device)
        self.replicated = replicated  # every rank steps every matrix whole (below stage 1)

    def piece(self, matrix: Matrix, rank: int) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of the flattened matrix that group rank ``rank`` steps."""
        start, end = self.ranges[rank]
        lo, hi = max(matrix.offset, start), min(matrix.offset + matrix.numel, end)
        return (lo - matrix.offset, hi - matrix.offset) if lo < hi else (0, 0)

    def _moves(self, matrices: list[Matrix]) -> bool:
        """Whether any rank other than a matrix's owner steps part of it (the same answer on
        every rank, so all or none call the exchanges)."""
        return any(
            self.piece(m, rank)[1] > 0 for m in matrices for rank in range(len(self.ranges)) if rank != m.owner
        )

    def finish(self, optimizer: WholeMatrixOptimizer, targets: Sequence[Piece], used: Sequence[bool]) -> None:
        """The whole-matrix part of the step for the matrices some rank used (``used``: per
        parameter of the unit, agreed by every rank): called on every rank of the group, in
        the same unit order, whether or not the rank steps a piece of them."""
        matrices = [m for m in self.matrices if used[m.param_index]]
        if not matrices:
            return
        me = self.comm.rank
        mine = {target.param_index: target.tensor for target in targets}
        updates = {m.param_index: optimizer.pending.pop(mine[m.param_index]) for m in matrices if m.param_index in mine}
        moves = self._moves(matrices)
        received = self._to_owners(matrices, updates) if moves and not self.replicated else None
        results = {}
        for m in matrices:
            if m.owner == me:
                whole = self._assemble(m, updates, received)
                orthogonal = optimizer.orthogonalise_matrix(whole.view(m.shape), m.group)
                results[m.param_index] = orthogonal.reshape(-1).float()
        slices = self._from_owners(matrices, results) if moves else None
        cursors = [0] * len(self.ranges)
        for m in matrices:
            lo, hi = self.piece(m, me)
            if hi == lo:
                continue
            if m.owner == me:
                orthogonal = results[m.param_index][lo:hi]
            else:
                assert slices is not None
                orthogonal = slices[m.owner][cursors[m.owner] : cursors[m.owner] + hi - lo]
                cursors[m.owner] += hi - lo
            param = mine[m.param_index]
            optimizer.apply_orthogonal(param, orthogonal.to(param.device), m.group, m.shape)

    def stand_in(self, used: Sequence[bool]) -> None:
        """This rank's part in `finish`'s exchanges when its own step of the unit failed (a swap
        file's read on NVMe): zeros sent where its pieces and results would go, what it receives
        dropped, so the other ranks finish the step and reach the agreement that raises on all."""
        matrices = [m for m in self.matrices if used[m.param_index]]
        if not matrices or not self._moves(matrices):
            return
        me = self.comm.rank
        if not self.replicated:
            pieces = {m.param_index: torch.zeros(hi - lo, device=self.device) for m in matrices
                      for lo, hi in [self.piece(m, me)] if hi > lo}
            self._to_owners(matrices, pieces)
        self._from_owners(matrices, {m.param_index: torch.zeros(m.numel, device=self.device)
                                     for m in matrices if m.owner == me})

    def _to_owners(self, matrices: list[Matrix], updates: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's pieces of each matrix's update, sent to its owner; returns what this
        rank received, per source rank."""
        me, ranks = self.comm.rank, len(self.ranges)
        sends: list[list[torch.Tensor]] = [[] for _ in range(ranks)]
        sizes = [0] * ranks
        for m in matrices:
            if m.owner != me and m.param_index in updates:
                sends[m.owner].append(updates[m.param_index].reshape(-1))
            elif m.owner == me:
                for rank in range(ranks):
                    if rank != me:
                        lo, hi = self.piece(m, rank)
                        sizes[rank] += hi - lo
        return self._exchange(sends, sizes)

    def _assemble(
        self, m: Matrix, updates: dict[int, torch.Tensor], received: list[torch.Tensor] | None
    ) -> torch.Tensor:
        """The whole update of an owned matrix from its pieces (in the order `_to_owners` sent
        them: matrix order per source rank)."""
        if self.replicated or received is None:
            return updates[m.param_index].reshape(-1).to(self.device)
        whole = torch.empty(m.numel, dtype=torch.float32, device=self.device)
        for rank in range(len(self.ranges)):
            lo, hi = self.piece(m, rank)
            if hi == lo:
                continue
            if rank == self.comm.rank:
                whole[lo:hi] = updates[m.param_index].reshape(-1)
            else:
                whole[lo:hi] = received[rank][: hi - lo]
                received[rank] = received[rank][hi - lo :]
        return whole

    def _from_owners(self, matrices: list[Matrix], results: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """Each owner's results, every rank's slice sent to it; returns the slices this rank
        received, per owner (matrix order)."""
        me, ranks = self.comm.rank, len(self.ranges)
        sends: list[list[torch.Tensor]] = [[] for _ in range(ranks)]
        sizes = [0] * ranks
        for m in matrices:
            if m.owner == me:
                for rank in range(ranks):
                    lo, hi = self.piece(m, rank)
                    if rank != me and hi > lo:
                        sends[rank].append(results[m.param_index][lo:hi])
            else:
                lo, hi = self.piece(m, me)
                sizes[m.owner] += hi - lo
        return self._exchange(sends, sizes)

    def _exchange(self, sends: list[list[torch.Tensor]], sizes: list[int]) -> list[torch.Tensor]:
        send_sizes = [sum(part.numel() for part in parts) for parts in sends]
        flat = [part.to(self.device, torch.float32) for parts in sends for part in parts]
        # an empty send in float32 too, not the default dtype (the received buffer is float32)
        send = torch.cat(flat) if flat else torch.empty(0, dtype=torch.float32, device=self.device)
        received = torch.empty(sum(sizes), dtype=torch.float32, device=self.device)
        self.comm.exchange_pieces(send, send_sizes, received, sizes).wait()
        return list(received.split(sizes))
