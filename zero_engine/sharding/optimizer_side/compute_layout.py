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

Units are grouped in windows of consecutive units (`plan_windows`) that share one exchange each
way, and owners are chosen within each window (`assign_owners_by_window`), the largest matrices
first to the least loaded rank: the exchanges wait for each window's busiest owner, so balance
within windows is what the step's time follows.
Below stage 1 every rank holds every matrix (``replicated``): nothing is gathered, and the
owner sends its result to the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ... import offload
from ...comm import GroupComm


class WholeMatrixOptimizer(Protocol):
    """What the exchange asks of the optimizer (`zero_engine.muon.MuonWithAdamW`)."""

    pending: dict[torch.Tensor, torch.Tensor]  # each stepped piece's elementwise update

    def orthogonalise_matrix(self, update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor: ...

    def apply_orthogonal(
        self, param: torch.Tensor, orthogonal: torch.Tensor, group: dict[str, Any], shape: tuple[int, int]
    ) -> None: ...


class Piece(Protocol):
    """A stepped tensor and where it lies (`zero_engine.sharding.optimizer_side.optimizer_shard.OptimizerTarget`)."""

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


def plan_windows(unit_costs: Sequence[Sequence[int]], ranks: int) -> list[list[int]]:
    """Consecutive units (their matrices' costs, in step order) grouped in windows that share
    one exchange each way (`finish_window`): a window closes once it holds twice the work of
    ``ranks`` of the largest matrix, so that its owners can share it evenly (Llama-8B's shapes at
    2-64 ranks: the step's whole-matrix work within 1.12x the balanced ideal, against 1.26-16.9x
    with an exchange per layer), while an owner holds whole matrices of one window at a time
    (about two of the largest), not the model's. Returns each window's units."""
    largest = max((cost for costs in unit_costs for cost in costs), default=0)
    windows: list[list[int]] = []
    current: list[int] = []
    held = 0
    for unit, costs in enumerate(unit_costs):
        current.append(unit)
        held += sum(costs)
        if held >= 2 * ranks * largest:
            windows.append(current)
            current, held = [], 0
    if current:
        windows.append(current)
    return windows


def assign_owners_by_window(costs: Sequence[int], windows: Sequence[Sequence[int]], ranks: int) -> list[int]:
    """The owner of each matrix (``costs``; ``windows``: each window's matrix indices): within
    a window largest first, each to the rank with the least work in the window so far, then the
    least over the windows before (ties to the lowest rank), the same on every rank. Each
    window's busiest owner is what its exchanges wait for."""
    owners = [0] * len(costs)
    total = [0] * ranks
    for window in windows:
        load = [0] * ranks
        for index in sorted(window, key=lambda i: (-costs[i], i)):
            rank = min(range(ranks), key=lambda r: (load[r], total[r], r))
            owners[index] = rank
            load[rank] += costs[index]
            total[rank] += costs[index]
    return owners


def serialized_work(costs: Sequence[int], owners: Sequence[int], windows: Sequence[Sequence[int]], ranks: int) -> int:
    """What a step's whole-matrix work costs when each window waits for its busiest owner:
    the sum over windows of the largest rank's share."""
    total = 0
    for window in windows:
        load = [0] * ranks
        for index in window:
            load[owners[index]] += costs[index]
        total += max(load)
    return total


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
        self.closes_window = True  # the last unit of its window (`plan_windows`): the window's exchanges follow it

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

    def finish(self, optimizer: WholeMatrixOptimizer, targets: Sequence[Piece], used: Sequence[bool]) -> int:
        """The whole-matrix part of the step for the matrices some rank used (``used``: per
        parameter of the unit, agreed by every rank): called on every rank of the group, in
        the same unit order, whether or not the rank steps a piece of them. Returns the most
        bytes its buffers held at once (`finish_window`)."""
        return finish_window(optimizer, [(self, targets, used)])

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
        sends, sizes = self._no_pieces()
        self._pieces_to_owners(matrices, updates, sends, sizes)
        return self._exchange(sends, sizes)

    def _no_pieces(self) -> tuple[list[list[torch.Tensor]], list[int]]:
        return [[] for _ in self.ranges], [0] * len(self.ranges)

    def _pieces_to_owners(
        self, matrices: list[Matrix], updates: dict[int, torch.Tensor],
        sends: list[list[torch.Tensor]], sizes: list[int],
    ) -> None:
        """Add this rank's pieces of the matrices' updates to ``sends`` (per owner) and what it
        receives as their owner to ``sizes`` (per source rank)."""
        me, ranks = self.comm.rank, len(self.ranges)
        for m in matrices:
            if m.owner != me and m.param_index in updates:
                sends[m.owner].append(updates[m.param_index].reshape(-1))
            elif m.owner == me:
                for rank in range(ranks):
                    if rank != me:
                        lo, hi = self.piece(m, rank)
                        sizes[rank] += hi - lo

    def _assemble(
        self, m: Matrix, updates: dict[int, torch.Tensor], received: list[torch.Tensor] | None
    ) -> torch.Tensor:
        """The whole update of an owned matrix from its pieces (in the order `_to_owners` sent
        them: matrix order per source rank)."""
        if self.replicated or received is None:
            return offload.copied_to(updates[m.param_index].reshape(-1), self.device)
        whole = torch.empty(m.numel, dtype=torch.float32, device=self.device)
        for rank in range(len(self.ranges)):
            lo, hi = self.piece(m, rank)
            if hi == lo:
                continue
            if rank == self.comm.rank:
                offload.copy_across(whole[lo:hi], updates[m.param_index].reshape(-1))
            else:
                whole[lo:hi] = received[rank][: hi - lo]
                received[rank] = received[rank][hi - lo :]
        return whole

    def _from_owners(self, matrices: list[Matrix], results: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """Each owner's results, every rank's slice sent to it; returns the slices this rank
        received, per owner (matrix order)."""
        sends, sizes = self._no_pieces()
        self._slices_from_owners(matrices, results, sends, sizes)
        return self._exchange(sends, sizes)

    def _slices_from_owners(
        self, matrices: list[Matrix], results: dict[int, torch.Tensor],
        sends: list[list[torch.Tensor]], sizes: list[int],
    ) -> None:
        """Add every rank's slice of this rank's results to ``sends`` and what it receives from
        each owner to ``sizes``."""
        me, ranks = self.comm.rank, len(self.ranges)
        for m in matrices:
            if m.owner == me:
                for rank in range(ranks):
                    lo, hi = self.piece(m, rank)
                    if rank != me and hi > lo:
                        sends[rank].append(results[m.param_index][lo:hi])
            else:
                lo, hi = self.piece(m, me)
                sizes[m.owner] += hi - lo

    def _exchange(self, sends: list[list[torch.Tensor]], sizes: list[int]) -> list[torch.Tensor]:
        send_sizes = [sum(part.numel() for part in parts) for parts in sends]
        # float32 even when empty, not the default dtype (the received buffer is float32)
        send = torch.empty(sum(send_sizes), dtype=torch.float32, device=self.device)
        offset = 0
        for part in (part for parts in sends for part in parts):  # a host master's from the host
            offload.copy_across(send[offset : offset + part.numel()], part.reshape(-1))
            offset += part.numel()
        received = torch.empty(sum(sizes), dtype=torch.float32, device=self.device)
        self.comm.exchange_pieces(send, send_sizes, received, sizes).wait()
        return list(received.split(sizes))


@dataclass
class _Finishing:
    """One unit's part of a window's exchanges: its used matrices, its pieces and their updates."""

    exchange: MatrixExchange
    matrices: list[Matrix]
    mine: dict[int, torch.Tensor]  # param index -> the tensor this rank steps of it
    updates: dict[int, torch.Tensor]  # param index -> that piece's elementwise update
    results: dict[int, torch.Tensor]  # param index -> an owned matrix's whole result


def finish_window(
    optimizer: WholeMatrixOptimizer, units: Sequence[tuple[MatrixExchange, Sequence[Piece], Sequence[bool]]]
) -> int:
    """The whole-matrix part of the step for a window of units (`MatrixExchange.finish` for
    each, in order), with one exchange to the owners and one back for all of them (GPU review
    R5: an exchange per unit waits, unit by unit, for that unit's busiest owner, so a step cost
    the sum of the units' largest shares instead of the busiest rank's total). Every unit of a
    window shares its group, ranges count and replication (`plan_windows`); called on every rank
    of the group with the same units. Returns the most bytes the exchange's own buffers held at
    once (pieces received, whole updates and results, slices sent and received: an owner's are
    whole matrices, `memory_report()`'s ``peak_matrix_exchange``; the optimizer's iteration
    temporaries besides)."""
    meter = _Meter()
    parts = []
    for exchange, targets, used in units:
        matrices = [m for m in exchange.matrices if used[m.param_index]]
        if matrices:
            mine = {target.param_index: target.tensor for target in targets}
            updates = {m.param_index: optimizer.pending.pop(mine[m.param_index])
                       for m in matrices if m.param_index in mine}
            parts.append(_Finishing(exchange, matrices, mine, updates, {}))
    if not parts:
        return 0
    first = parts[0].exchange
    me = first.comm.rank
    moves = any(part.exchange._moves(part.matrices) for part in parts)
    received = None
    if moves and not first.replicated:
        sends, sizes = first._no_pieces()
        for part in parts:
            part.exchange._pieces_to_owners(part.matrices, part.updates, sends, sizes)
        received = first._exchange(sends, sizes)
        meter.hold(4 * sum(sizes))
    for part in parts:  # the owned matrices' whole updates, in the order they were sent
        for m in part.matrices:
            if m.owner == me:
                whole = part.exchange._assemble(m, part.updates, received)
                meter.hold(4 * m.numel)
                orthogonal = optimizer.orthogonalise_matrix(whole.view(m.shape), m.group)
                part.results[m.param_index] = orthogonal.reshape(-1).float()
                meter.hold(4 * m.numel)
                meter.release(4 * m.numel)  # the whole update goes as its result is made
                del whole
    if received is not None:
        meter.release(4 * sum(sizes))
        del received
    slices = None
    if moves:
        sends, sizes = first._no_pieces()
        for part in parts:
            part.exchange._slices_from_owners(part.matrices, part.results, sends, sizes)
        meter.hold(4 * sum(part.numel() for parts in sends for part in parts) + 4 * sum(sizes))
        slices = first._exchange(sends, sizes)
    cursors = [0] * len(first.ranges)
    for part in parts:
        for m in part.matrices:
            lo, hi = part.exchange.piece(m, me)
            if hi == lo:
                continue
            if m.owner == me:
                orthogonal = part.results[m.param_index][lo:hi]
            else:
                assert slices is not None
                orthogonal = slices[m.owner][cursors[m.owner] : cursors[m.owner] + hi - lo]
                cursors[m.owner] += hi - lo
            param = part.mine[m.param_index]
            optimizer.apply_orthogonal(param, offload.copied_to(orthogonal, param.device), m.group, m.shape)
        part.results.clear()
    return meter.peak


class _Meter:
    """Bytes held now and at most (the exchange's own buffers)."""

    def __init__(self) -> None:
        self.held = self.peak = 0

    def hold(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def release(self, nbytes: int) -> None:
        self.held -= nbytes
