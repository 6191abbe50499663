"""A unit: parameters stored in one flat buffer, their gradients in another.

Each parameter's ``.data`` and ``.grad`` become views into the unit's flat buffers (in the
compute dtype), so a collective moves a whole unit in one call. The optimizer updates the
fp32 *master* of the range this rank owns: its shard when optimizer state is sharded, the
whole unit at stage 0. In fp32 training the master is a view of ``flat_param`` itself (no
second copy); under mixed precision it is a separate fp32 tensor, and the updated master is
cast back into ``flat_param`` after each step. Autograd accumulates into an existing
``.grad`` in place, which keeps the gradient views intact.

At stage 3, a `ShardedFlatUnit` keeps only this rank's shard between uses: the full buffer's
storage exists while the unit is gathered, and the parameters are empty tensors otherwise.

A unit can be built from parameters still on the meta device (a model too big to build
whole): they become aliases of the fp32 flat buffer first, and the ``materialize`` callback
initializes them there, in place, before the masters and shards are taken from it. So a
unit's values exist once, in the buffer, while the unit is made.

The engine never does offset arithmetic itself; it asks the unit for views.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from ..comm import DONE, Comm, Pending
from .layout import UnitLayout


class FlatUnit:
    """Parameters flattened in order into padded flat buffers (whole between steps)."""

    sharded_params = False  # stage 3 units hold only their shard between uses

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        group_indices: Sequence[int],
        rank: int,
        world_size: int,
        *,
        compute_dtype: torch.dtype = torch.float32,
        shard_master: bool = True,
        full_grads: bool = True,
        device: torch.device | None = None,
        materialize: Callable[[], None] | None = None,
    ) -> None:
        self.params = list(params)
        self.shapes = [param.shape for param in self.params]  # stage 3 empties the parameters
        self.names = list(names)
        self.group_indices = list(group_indices)  # each parameter's optimizer param group
        self.rank = rank
        self.layout = UnitLayout([p.numel() for p in self.params], world_size)
        self.device = device = device or self.params[0].device
        self.compute_dtype = compute_dtype
        # Masters start from the parameters' own values, before any cast to the compute dtype.
        full_fp32 = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=device)
        for index, param in enumerate(self.params):
            if param.is_meta:
                _point_meta_param(param, self.view_of(full_fp32, index), self.names[index], materialize)
            else:
                self.view_of(full_fp32, index).copy_(param.detach())
        if materialize is not None:
            materialize()  # fills the (former meta) parameters' aliases of full_fp32 in place
        self.shard_master = shard_master
        self.owned_range = self.layout.shard_range(rank) if shard_master else (0, self.layout.padded_numel)
        self.flat_param = full_fp32 if compute_dtype == torch.float32 else full_fp32.to(compute_dtype)
        start, end = self.owned_range
        self.master = self.flat_param[start:end] if self.master_is_param else full_fp32[start:end].clone()
        for index, param in enumerate(self.params):
            param.data = self.param_view(index)
        # Full gradients (stages 0-1): one flat buffer, each .grad a view into it. Sharded
        # gradients (stage 2): only this rank's shard persists; full ones pass through buckets.
        # Stage 3 starts with none: its first reduction makes the shard.
        self.flat_grad: torch.Tensor | None = None
        self.sharded_grad: torch.Tensor | None = None  # None while released (stage 3 between steps)
        if full_grads:
            self.flat_grad = torch.zeros_like(self.flat_param)
            self.sharded_grad = self._shard(self.flat_grad)
            self.attach_grads()
        elif not self.sharded_params:
            self.grad_shard()

    @property
    def master_is_param(self) -> bool:
        return self.compute_dtype == torch.float32

    def view_of(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s elements of any full flat buffer of this unit, shaped."""
        offset, numel = self.layout.param_offsets[index], self.layout.param_numels[index]
        return flat[offset : offset + numel].view(self.shapes[index])

    def param_view(self, index: int) -> torch.Tensor:
        return self.view_of(self.flat_param, index)

    def grad_view(self, index: int) -> torch.Tensor:
        if self.flat_grad is None:
            raise RuntimeError(f"unit of {self.names} keeps no full gradients")
        return self.view_of(self.flat_grad, index)

    def attach_grads(self) -> None:
        """Point every parameter's ``.grad`` at its slice of ``flat_grad`` (full gradients only)."""
        if self.flat_grad is not None:
            for index, param in enumerate(self.params):
                param.grad = self.grad_view(index)

    def grad_shard(self) -> torch.Tensor:
        """This rank's gradient shard, allocated (zeros) if it was released."""
        if self.sharded_grad is None:
            self.sharded_grad = torch.zeros(self.layout.shard_numel, dtype=self.compute_dtype, device=self.device)
        return self.sharded_grad

    def release_grad_shard(self) -> None:
        """Drop the gradient shard (sharded gradients only); `grad_shard` makes a new one."""
        if self.flat_grad is None:
            self.sharded_grad = None

    def _shard(self, flat: torch.Tensor) -> torch.Tensor:
        start, end = self.layout.shard_range(self.rank)
        return flat[start:end]

    @property
    def master_of_shard(self) -> torch.Tensor:
        """The fp32 master values of this rank's shard (what a checkpoint saves)."""
        start, end = self.layout.shard_range(self.rank)
        return self.master[start - self.owned_range[0] : end - self.owned_range[0]]

    @property
    def grad_bytes(self) -> int:
        """Gradient storage held now: the full flat buffer, or just this rank's shard."""
        held = self.flat_grad if self.flat_grad is not None else self.sharded_grad
        return 0 if held is None else _nbytes(held)

    @property
    def param_bytes(self) -> int:
        """Persistent parameter storage: the whole flat buffer (stages 0-2)."""
        return _nbytes(self.flat_param)

    @property
    def master_bytes(self) -> int:
        """A separate fp32 master (mixed precision); 0 when the master is the parameter."""
        return 0 if self.master_is_param else self.master.numel() * self.master.element_size()

    def owned_pieces(self) -> list[OwnedPiece]:
        """What the optimizer steps in this unit: the parameters' pieces in the owned range,
        shaped like their parameters when a piece is a whole parameter at stage 0."""
        pieces = []
        for index in range(len(self.params)):
            owned = self._owned_part(index)
            if owned is not None:
                param_offset, owned_offset, numel = owned
                shape = torch.Size([numel]) if self.shard_master else self.shapes[index]
                pieces.append(OwnedPiece(index, self.names[index], param_offset, owned_offset, numel, shape))
        return pieces

    def _owned_part(self, index: int) -> tuple[int, int, int] | None:
        """Parameter ``index``'s intersection with the owned range: (offset in the flattened
        parameter, offset in the owned range, length), or None when it lies outside."""
        offset, numel = self.layout.param_offsets[index], self.layout.param_numels[index]
        start, end = self.owned_range
        lo, hi = max(offset, start), min(offset + numel, end)
        return (lo - offset, lo - start, hi - lo) if lo < hi else None

    def _owned_values(self, index: int, values: torch.Tensor) -> tuple[slice, torch.Tensor] | None:
        """Where parameter ``index``'s owned part sits in the owned range, and its elements of
        the full ``values``."""
        owned = self._owned_part(index)
        if owned is None:
            return None
        param_offset, owned_offset, numel = owned
        return slice(owned_offset, owned_offset + numel), values.reshape(-1)[param_offset : param_offset + numel]

    def publish_master(self) -> None:
        """Cast the updated fp32 master into the compute copy (mixed precision only)."""
        if not self.master_is_param:
            start, end = self.owned_range
            self.flat_param[start:end].copy_(self.master)

    def kept_range(self, index: int) -> tuple[int, int] | None:
        """The elements of parameter ``index`` (flattened) that this rank keeps, as
        ``(start, numel)``: the whole parameter below stage 3, None when it keeps none."""
        return 0, self.layout.param_numels[index]

    def load_kept(self, index: int, values: torch.Tensor) -> None:
        """Set the kept elements of parameter ``index`` (``values``: fp32, `kept_range`): below
        stage 3 the whole parameter, compute copy and owned master."""
        self.param_view(index).copy_(values.view(self.shapes[index]))
        owned = self._owned_values(index, values)
        if owned is not None and not self.master_is_param:
            where, piece = owned
            self.master[where].copy_(piece)


class ShardedState(Enum):
    """Where a stage 3 unit's full buffer is in its lifecycle (moved only by the unit)."""

    SHARDED = "sharded"  # the full buffer has no storage; the parameters are empty tensors
    GATHERING = "gathering"  # storage allocated, the all-gather filling it is in flight
    GATHERED = "gathered"  # the full values are valid; the parameters are views of them


class ShardedFlatUnit(FlatUnit):
    """Stage 3: the unit's parameters exist in full only while it is gathered.

    Between uses the rank holds ``param_shard`` (its shard in the compute dtype; in fp32 the
    master itself). The full buffer ``flat_param`` is one tensor for the unit's whole life;
    resharding frees its *storage* (``resize_(0)``) and gathering allocates it again in place.
    That matters because autograd saves the weights a forward used (or views of them, as
    ``F.linear`` saves ``weight.t()``) for the backward: those saved tensors share the buffer's
    storage, so between forward and backward they hold no bytes, and the backward computes with
    the values its own gather put back (see note "Freeing storage, not tensors" in
    ``docs/architecture.md``). The parameters themselves are empty tensors between uses, as
    DeepSpeed leaves them, so a use outside the engine's hooks fails on a shape instead of
    reading freed memory.
    """

    sharded_params = True

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        group_indices: Sequence[int],
        rank: int,
        world_size: int,
        *,
        label: str,
        compute_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        materialize: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(
            params, names, group_indices, rank, world_size, compute_dtype=compute_dtype, shard_master=True,
            full_grads=False, device=device, materialize=materialize,
        )
        self.label = label  # the module path the unit stands for, for messages
        start, end = self.owned_range
        if self.master_is_param:  # the master was a view of the full buffer; own it now
            self.master = self.master.clone()
            self.param_shard = self.master
        else:
            self.param_shard = self.flat_param[start:end].clone()
        self._empty = torch.empty(0, dtype=compute_dtype, device=self.device)
        self.unsharded_bytes = self.flat_param.untyped_storage().nbytes()
        self.state = ShardedState.GATHERED
        self._pending: Pending = DONE  # the all-gather in flight while GATHERING
        self.reshard()

    @property
    def gathered(self) -> bool:
        """The full buffer holds storage (its values are valid once `finish_gather` ran)."""
        return self.state is not ShardedState.SHARDED

    def begin_gather(self, comm: Comm) -> None:
        """Allocate the full buffer's storage, point the parameters at it and start filling it
        from every rank's shard. A unit already gathered is gathered again in place (same
        values): the ranks agreed on that collective, so it must be issued."""
        if self.state is ShardedState.SHARDED:
            _allocate_storage(self.flat_param, self.unsharded_bytes)
            for index, param in enumerate(self.params):
                param.data = self.param_view(index)
        start, end = self.owned_range
        self.flat_param[start:end].copy_(self.param_shard)
        self._pending = Pending(self._pending.works + comm.all_gather(self.flat_param).works)
        self.state = ShardedState.GATHERING

    def finish_gather(self, wait: bool = True) -> None:
        """Wait for the gather in flight, if any (``wait=False`` after ranks diverged, when the
        others may never send: the buffer is then given up, see `reshard`)."""
        if self.state is ShardedState.GATHERING and wait:
            self._pending.wait()
            self._pending = DONE
            self.state = ShardedState.GATHERED

    def reshard(self) -> None:
        """Free the full buffer's storage and leave the parameters empty. A gather still in
        flight (ranks diverged) keeps writing into the old buffer, so that one is abandoned to
        the collective rather than freed under it."""
        for param in self.params:
            param.data = self._empty
        if self.state is ShardedState.GATHERING:
            self.flat_param = torch.empty_like(self.flat_param)
            self._pending = DONE
        _free_storage(self.flat_param)
        self.state = ShardedState.SHARDED

    @property
    def param_bytes(self) -> int:
        return _nbytes(self.param_shard)

    @property
    def gathered_bytes(self) -> int:
        """What the full buffer's storage holds now: the whole unit while gathered, else 0."""
        return self.flat_param.untyped_storage().nbytes()

    def publish_master(self) -> None:
        if not self.master_is_param:
            self.param_shard.copy_(self.master)

    def kept_range(self, index: int) -> tuple[int, int] | None:
        owned = self._owned_part(index)
        return None if owned is None else (owned[0], owned[2])

    def load_kept(self, index: int, values: torch.Tensor) -> None:
        owned = self._owned_part(index)
        if owned is None:
            return
        if self.gathered:
            raise RuntimeError(f"unit {self.label}: loading a shard while the unit is gathered (mid-step?)")
        where = slice(owned[1], owned[1] + owned[2])
        self.master[where].copy_(values)
        if self.param_shard is not self.master:
            self.param_shard[where].copy_(values)


def _point_meta_param(
    param: nn.Parameter, view: torch.Tensor, name: str, materialize: Callable[[], None] | None
) -> None:
    """Make a meta-device parameter an alias of its unit's buffer, keeping the Parameter object
    (optimizer groups, tied modules and user code hold it): ``.data =`` cannot leave meta.
    The parameter aliases the buffer through ``set_``, not as a view: a view would share the
    buffer's version counter with every other parameter of the unit, and autograd would then
    see one parameter's in-place update as a change to all of them."""
    if materialize is None:
        raise ValueError(f"parameter {name!r} is on the meta device and nothing initializes it")
    alias = torch.empty(0, dtype=view.dtype, device=view.device)
    with torch.no_grad():
        alias.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
    torch.utils.swap_tensors(param, nn.Parameter(alias, requires_grad=param.requires_grad))


def _free_storage(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _allocate_storage(tensor: torch.Tensor, nbytes: int) -> None:
    storage = tensor.untyped_storage()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class OwnedPiece:
    """One parameter's piece in the range this rank's optimizer updates."""

    param_index: int  # within the unit
    name: str
    param_offset: int  # first element of the piece, in the flattened parameter
    owned_offset: int  # where the piece starts within the owned range
    numel: int
    shape: torch.Size  # the optimizer tensor's shape
