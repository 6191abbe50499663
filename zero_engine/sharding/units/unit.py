"""A unit: parameters stored in one flat buffer, their gradients in another.

Each parameter's ``.data`` and ``.grad`` become views into the unit's flat buffers (in the
compute dtype), so a collective moves a whole unit in one call. Autograd accumulates into an
existing ``.grad`` in place, which keeps the gradient views intact. The optimizer's side of
the range this rank owns (its shard when optimizer state is sharded, the whole unit at stage
0: the fp32 master, the step gradient, the optimizer's tensors) belongs to the unit's
`OptimizerShard` (``unit.optimizer_shard``), made here once the values exist.

At stage 3, a `ShardedFlatUnit` keeps only this rank's shard between uses: the full buffer's
storage exists while the unit is gathered, and the parameters are empty tensors otherwise.

A unit can be built from parameters still on the meta device (a model too big to build
whole): they become aliases of the fp32 flat buffer first, and the ``materialize`` callback
initializes them there, in place, before the masters and shards are taken from it. So a
unit's values exist once, in the buffer, while the unit is made.

The engine never does offset arithmetic itself; it asks the unit (or its shard) for views.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum

import torch
from torch import nn

from ...comm import Comm
from ...devices import tensor_bytes
from ...stage import UnitSpec
from ..shards.codec import IDENTITY, GatherCodec, Gathering
from ..shards.layout import UnitLayout
from ..shards.param_shard import ParamShard
from ..tiers.placement import ON_DEVICE, Placement
from ..optimizer_side.optimizer_shard import OptimizerShard
from .param_placement import Placement as ParamPlacement
from .param_placement import PlacedParams


class FlatUnit(PlacedParams):
    """Parameters flattened in order into padded flat buffers (whole between steps)."""

    sharded_params = False  # stage 3 units hold only their shard between uses
    frozen = False  # a unit of trainable parameters, with an optimizer shard (frozen ones: `FrozenUnit`)

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        group_indices: Sequence[int],
        rank: int,
        num_shards: int,
        *,
        compute_dtype: torch.dtype = torch.float32,
        spec: UnitSpec = UnitSpec(shard_master=True, full_grads=True, releases_grad=False),
        device: torch.device | None = None,
        materialize: Callable[[], None] | None = None,
        placement: Placement = ON_DEVICE,
        codec: GatherCodec = IDENTITY,
        placements: Sequence[ParamPlacement] | None = None,
    ) -> None:
        self.params = list(params)
        self.placement = placement  # where the optimizer's side lives (host with offload)
        self.codec = codec  # how the unit's compute values travel in its all-gathers (`gather`)
        self.shapes = [param.shape for param in self.params]  # what this rank holds; stage 3 empties the parameters
        # each parameter's global shape, this rank's box of it and its compute layout (`param_placement`)
        self.placements = list(placements) if placements is not None else [ParamPlacement.whole(s) for s in self.shapes]
        self.names = list(names)
        self.group_indices = list(group_indices)  # each parameter's optimizer param group
        self.rank = rank
        self.layout = UnitLayout([p.numel() for p in self.params], num_shards)
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
        self.shard_master = shard_master = spec.shard_master
        full_grads, releases_grad = spec.full_grads, spec.releases_grad
        self.used_offset = 0  # this unit's first parameter in the used-mask (set when units are ordered)
        self.flat_param = full_fp32 if compute_dtype == torch.float32 else full_fp32.to(compute_dtype)
        # Full gradients (stages 0-1): one flat buffer, each .grad a view into it. Sharded
        # gradients (stages 2-3): the optimizer shard's step gradient; full ones pass through
        # buckets. Stage 3 (``releases_grad``) starts with none: its first reduction makes it.
        self.flat_grad: torch.Tensor | None = torch.zeros_like(self.flat_param) if full_grads else None
        owned_range = self.layout.shard_range(rank) if shard_master else (0, self.layout.padded_numel)
        self.optimizer_shard = self._make_optimizer_shard(full_fp32, owned_range, releases_grad)
        for index, param in enumerate(self.params):
            param.data = self.param_view(index)
        if full_grads:
            self.attach_grads()

    def _make_optimizer_shard(
        self, full_fp32: torch.Tensor, owned_range: tuple[int, int], releases_grad: bool
    ) -> OptimizerShard:
        """In fp32 the master is a view of the parameters; otherwise (or offloaded: on the
        host) an fp32 copy of the owned range, published into ``flat_param`` after each update;
        the step gradient is the owned range of ``flat_grad`` when the unit keeps one."""
        start, end = owned_range
        master = self.placement.masters(self.flat_param, full_fp32, start, end)
        full_grad = self.flat_grad[start:end] if self.flat_grad is not None else None
        grad = self.placement.step_grad(end - start, self.compute_dtype, self.device, full_grad, releases_grad)
        return OptimizerShard(self, owned_range, master, grad, shaped_pieces=not self.shard_master)

    def gather(self, comm: Comm) -> Gathering:
        """Start the all-gather of the unit's compute values from every rank's shard of
        ``flat_param``, through the unit's codec: the one path by which a unit's values are
        gathered for compute (after a step below stage 3; in forward and backward at stage 3)."""
        return self.codec.launch(comm, self.flat_param)

    def gather_masters(self, comm: Comm, onto: int | None = None) -> torch.Tensor | None:
        """The fp32 masters over the whole flat buffer, exactly (no codec: an export), gathered
        from every rank's shard; onto rank ``onto`` alone, when given: the others send their
        shard from the master itself (a device copy when offloaded) and return None."""
        start, end = self.optimizer_shard.owned_range
        with self.optimizer_shard.resident() as master:
            if onto is not None and comm.rank != onto:
                comm.gather(master.to(self.device), None, dst=onto).wait()
                return None
            full = torch.empty(self.layout.padded_numel, dtype=torch.float32, device=self.device)
            full[start:end] = master
        (comm.all_gather(full) if onto is None else comm.gather(full[start:end], full, dst=onto)).wait()
        return full

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

    @property
    def grad_bytes(self) -> int:
        """Gradient storage held now: the full flat buffer, or just this rank's shard (both at
        stage 1 with offload_optimizer: the shard is then an fp32 host copy, not a view)."""
        full = tensor_bytes(self.flat_grad) if self.flat_grad is not None else 0
        return full + self.optimizer_shard.grad_bytes

    @property
    def param_bytes(self) -> int:
        """Persistent parameter storage: the whole flat buffer (stages 0-2)."""
        return tensor_bytes(self.flat_param)

    @property
    def host_bytes(self) -> int:
        """What of the unit's persistent state lives on the host (offload)."""
        return self.optimizer_shard.host_bytes

    @property
    def nvme_bytes(self) -> int:
        """What of the unit's persistent state waits in a swap file (NVMe offload)."""
        return self.optimizer_shard.nvme_bytes

    def kept_range(self, index: int) -> tuple[int, int] | None:
        """The elements of parameter ``index`` (flattened) that this rank keeps, as
        ``(start, numel)``: the whole parameter below stage 3, None when it keeps none."""
        return 0, self.layout.param_numels[index]

    def load_kept(self, index: int, values: torch.Tensor) -> None:
        """Set the kept elements of parameter ``index`` (``values``: fp32, `kept_range`): below
        stage 3 the whole parameter, compute copy and owned master."""
        self.param_view(index).copy_(values.view(self.shapes[index]))
        self.optimizer_shard.load_owned(index, values, 0)

    def write_kept(self, index: int, values: torch.Tensor) -> None:
        """Set what this rank keeps of parameter ``index`` from its full flattened ``values``,
        whether or not the unit is gathered (`zero_engine.state.gathered` writes the gathered
        values itself): the owned master and its compute copy (the shard at stage 3)."""
        self.optimizer_shard.load_owned(index, values.to(torch.float32), 0)


# Stage 3's module units: the optimizer owns the shard, gradients stream through buckets, and the
# gradient shard exists from a backward to its step (as stage 3's own `Stage.unit_spec`).
SHARDED_UNIT = UnitSpec(shard_master=True, full_grads=False, releases_grad=True)


class ShardedState(Enum):
    """Where a stage 3 unit's full buffer is in its lifecycle (moved only by the unit)."""

    SHARDED = "sharded"  # the full buffer has no storage; the parameters are empty tensors
    GATHERING = "gathering"  # storage allocated, the all-gather filling it is in flight
    GATHERED = "gathered"  # the full values are valid; the parameters are views of them


class GatheredStorage:
    """Stage 3's storage of a unit: its shard between uses, the full buffer while gathered.

    Between uses the rank holds ``shard`` (`zero_engine.sharding.shards.param_shard`: on the
    device, on the host, on NVMe, encoded), never asking where it lives. The full buffer ``flat_param`` is one tensor
    for the unit's whole life; resharding frees its *storage* (``resize_(0)``) and gathering
    allocates it again in place. That matters because autograd saves the weights a forward
    used (or views of them, as ``F.linear`` saves ``weight.t()``) for the backward: those saved
    tensors share the buffer's storage, so between forward and backward they hold no bytes, and
    the backward computes with the values its own gather put back (see note "Freeing storage,
    not tensors" in ``docs/architecture.md``). The parameters themselves are empty tensors
    between uses, as DeepSpeed leaves them, so a use outside the engine's hooks fails on a
    shape instead of reading freed memory. Shared by trainable units (`ShardedFlatUnit`) and
    frozen ones (`zero_engine.sharding.units.frozen_unit.FrozenUnit`), which differ only in what
    they keep beside the shard.
    """

    sharded_params = True
    replicated = False  # each rank keeps a shard (an int8 frozen unit may be kept whole: `QuantizedFrozenUnit`)
    params: list[nn.Parameter]
    flat_param: torch.Tensor
    shard: ParamShard
    layout: UnitLayout
    rank: int

    def _start_sharded(self, label: str) -> None:
        """Record the full buffer's size, then free it: the unit starts sharded."""
        self.label = label  # the module path the unit stands for, for messages
        self._empty = torch.empty(0, dtype=self.flat_param.dtype, device=self.flat_param.device)
        self.unsharded_bytes = self.flat_param.untyped_storage().nbytes()
        self.state = ShardedState.GATHERED
        self._gatherings: list[Gathering] = []  # the all-gathers in flight while GATHERING
        self.reshard()

    # and, from the unit: ``gather(comm)``, the all-gather of ``flat_param``; ``param_view(i)``

    @property
    def has_full_storage(self) -> bool:
        """The full buffer holds storage (its values are valid once `wait_for_unshard` ran)."""
        return self.state is not ShardedState.SHARDED

    def unshard(self, comm: Comm) -> None:
        """Allocate the full buffer's storage, point the parameters at it and start filling it
        from every rank's shard. A unit already gathered is gathered again in place (same
        values): the ranks agreed on that collective, so it must be issued."""
        if self.state is ShardedState.SHARDED:
            _allocate_storage(self.flat_param, self.unsharded_bytes)
            for index, param in enumerate(self.params):
                param.data = self.param_view(index)
        self._fill_own_shard()
        self._gatherings.append(self.gather(comm))
        self.state = ShardedState.GATHERING

    def _fill_own_shard(self) -> None:
        """Put this rank's shard into the full buffer before the gather fills the others'."""
        start, end = self.layout.shard_range(self.rank)
        self.shard.fill(self.flat_param[start:end])

    @property
    def param_shard(self) -> torch.Tensor:
        """What this rank keeps, as it keeps it, to read: its shard's values (a copy of them where
        the shard is no tensor; encoded for `QuantizedFrozenUnit`)."""
        return self.shard.values()

    def wait_for_unshard(self, wait: bool = True) -> None:
        """Wait for the gather in flight, if any (``wait=False`` after ranks diverged, when the
        others may never send: the buffer is then given up, see `reshard`)."""
        if self.state is ShardedState.GATHERING and wait:
            for gathering in self._gatherings:
                gathering.wait()
            self._gatherings = []
            self.state = ShardedState.GATHERED

    def reshard(self) -> None:
        """Free the full buffer's storage and leave the parameters empty. A gather still in
        flight (ranks diverged) keeps writing into the old buffer, so that one is abandoned to
        the collective rather than freed under it."""
        for param in self.params:
            param.data = self._empty
        if self.state is ShardedState.GATHERING:
            self.flat_param = torch.empty_like(self.flat_param)
            self._gatherings = []
        _free_storage(self.flat_param)
        self.state = ShardedState.SHARDED

    @property
    def gathered_bytes(self) -> int:
        """What the full buffer's storage holds now: the whole unit while gathered, else 0."""
        return self.flat_param.untyped_storage().nbytes()


class ShardedFlatUnit(GatheredStorage, FlatUnit):
    """Stage 3: a trainable unit's parameters exist in full only while it is gathered
    (`GatheredStorage`). Between uses the rank holds ``shard`` (in the compute dtype; in fp32
    its tensor is the master itself where both live in one place) and its optimizer shard."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        group_indices: Sequence[int],
        rank: int,
        num_shards: int,
        *,
        label: str,
        compute_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        materialize: Callable[[], None] | None = None,
        placement: Placement = ON_DEVICE,
        codec: GatherCodec = IDENTITY,
        placements: Sequence[ParamPlacement] | None = None,
    ) -> None:
        FlatUnit.__init__(
            self, params, names, group_indices, rank, num_shards, compute_dtype=compute_dtype, spec=SHARDED_UNIT,
            device=device, materialize=materialize, placement=placement, codec=codec, placements=placements,
        )
        self._start_sharded(label)

    def _make_optimizer_shard(
        self, full_fp32: torch.Tensor, owned_range: tuple[int, int], releases_grad: bool
    ) -> OptimizerShard:
        """The unit keeps ``shard``, its shard in the compute dtype, made here beside the
        master (`Placement.sharded`): in fp32 one tensor when they live in one place (no second
        copy), else the master is published into it after each update."""
        start, end = owned_range
        self.shard, master = self.placement.sharded(self.flat_param, full_fp32, start, end)
        grad = self.placement.step_grad(end - start, self.compute_dtype, self.device, None, releases_grad)
        return OptimizerShard(self, owned_range, master, grad, shaped_pieces=False)

    @property
    def param_bytes(self) -> int:
        return self.shard.nbytes

    @property
    def host_bytes(self) -> int:
        return self.shard.host_bytes + self.optimizer_shard.host_bytes

    @property
    def nvme_bytes(self) -> int:
        return self.shard.nvme_bytes + self.optimizer_shard.nvme_bytes

    def kept_range(self, index: int) -> tuple[int, int] | None:
        owned = self.optimizer_shard.owned_part(index)
        return None if owned is None else (owned[0], owned[2])

    def load_kept(self, index: int, values: torch.Tensor) -> None:
        kept = self.kept_range(index)
        if kept is None:
            return
        if self.has_full_storage:
            raise RuntimeError(f"unit {self.label}: loading a shard while the unit is gathered (mid-step?)")
        self.optimizer_shard.load_owned(index, values, kept[0])


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
