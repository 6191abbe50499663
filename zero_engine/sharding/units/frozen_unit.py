"""A frozen unit: parameters that train not (a LoRA base, a frozen tower, a reference model),
sharded at stage 3 as trainable units are, but with nothing beside the shard.

A `FrozenUnit` keeps only ``shard``, its 1/N of the flat buffer in the parameters' own
dtype (the compute dtype under mixed precision: `zero_engine.state.state_dict.cast_frozen`
rounds frozen weights to it once, as DeepSpeed's ``module.bfloat16()`` does), and is gathered
and freed around its modules exactly as a trainable unit (`GatheredStorage`). It has no fp32
master, no gradient and no optimizer state; nothing reduces it. Its values change only by
loading (a checkpoint, ``weights=``). In backward a frozen unit is gathered where autograd
needs its values for input gradients (a LoRA model back-propagates through every frozen
layer) and released by the gatherer's post-backward signal, since no gradient ever completes
it (`zero_engine.sharding.gathering.gatherer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ... import offload
from ...comm import Comm
from ...comm.handles import CollectiveKind
from ..shards.codec import Gathering
from ..shards.layout import UnitLayout
from ..shards.param_shard import DEVICE_SHARDS, ShardTier
from .param_placement import PlacedParams, Placement
from .unit import FlatUnit, GatheredStorage, _point_meta_param


def frozen_dtype(param: torch.Tensor, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a frozen parameter is stored in: the compute dtype under mixed precision (it
    never updates, so an fp32 copy would only double what a rank holds), else its own."""
    mixed = compute_dtype != torch.float32
    return compute_dtype if mixed and param.is_floating_point() else param.dtype


class FrozenUnit(GatheredStorage, PlacedParams):
    """Frozen parameters of one dtype, of one unit module, flattened and sharded."""

    frozen = True
    quantized = False  # kept and gathered exactly (`QuantizedFrozenUnit`: in int8)
    shard_master = True  # what this rank keeps is its shard, as a trainable stage 3 unit
    optimizer_shard = None  # nothing to optimize

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        rank: int,
        num_shards: int,
        *,
        label: str,
        device: torch.device,
        dtype: torch.dtype,
        materialize: Callable[[], None] | None = None,
        shards: ShardTier = DEVICE_SHARDS,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.shapes = [param.shape for param in self.params]
        self.placements = [Placement.whole(shape) for shape in self.shapes]  # frozen parameters: whole today
        self.dtype = dtype  # what the unit stores and gathers: the parameters' own, or the compute dtype
        self.rank = rank
        self.device = device
        self.layout = UnitLayout([param.numel() for param in self.params], num_shards)
        self.used_offset = 0
        self.flat_param = torch.zeros(self.layout.padded_numel, dtype=dtype, device=device)
        # A meta parameter is initialized in its declared dtype (the values eager construction
        # gives), in a buffer of its own for the moment, then cast into the unit's.
        staged = {
            index: torch.empty(param.shape, dtype=param.dtype, device=device)
            for index, param in enumerate(self.params) if param.is_meta
        }
        for index, param in enumerate(self.params):
            if index in staged:
                _point_meta_param(param, staged[index], self.names[index], materialize)
            else:
                self.param_view(index).copy_(param.detach())
        if materialize is not None:
            materialize()  # fills the (former meta) parameters' staged values in place
        for index, values in staged.items():
            self.param_view(index).copy_(values)
        del staged
        start, end = self.layout.shard_range(rank)
        self._segments = {segment.param_index: segment for segment in self.layout.segments(rank)}  # what it keeps
        self.shards = shards  # where the shard lives (offload_param: host memory or NVMe)
        self._keep(self.flat_param[start:end])
        for index, param in enumerate(self.params):
            param.data = self.param_view(index)  # then emptied, with the buffer's storage freed
        self._start_sharded(label)

    def _keep(self, values: torch.Tensor) -> None:
        """Keep this rank's shard (a view of the full buffer, about to be freed) where the
        tier says. `QuantizedFrozenUnit` keeps it encoded."""
        self.shard = self.shards.make(values)

    def shard_values(self) -> torch.Tensor:
        """This rank's shard's values, in the unit's dtype, to read (exports, checkpoints)."""
        return self.shard.values()

    def keep(self, kept: torch.Tensor) -> None:
        """Replace what this rank keeps by another rank's ``param_shard`` (the same form)."""
        self.shard.assign(kept)

    def gather(self, comm: Comm) -> Gathering:
        """The all-gather of the unit's values, in their own dtype, counted apart in the
        communication report (``all_gather_frozen``)."""
        return Gathering(comm.all_gather(self.flat_param, kind=CollectiveKind.ALL_GATHER_FROZEN))

    view_of = FlatUnit.view_of  # parameter ``index``'s elements of a full flat buffer, shaped
    param_view = FlatUnit.param_view

    @property
    def param_bytes(self) -> int:
        """What this rank keeps in memory: its shard (nothing when it is on NVMe)."""
        return self.shard.nbytes

    @property
    def host_bytes(self) -> int:
        return self.shard.host_bytes

    @property
    def nvme_bytes(self) -> int:
        return self.shard.nvme_bytes

    @property
    def grad_bytes(self) -> int:
        return 0

    def kept_range(self, index: int) -> tuple[int, int] | None:
        """The elements of parameter ``index`` in this rank's shard, as ``(start, numel)``."""
        segment = self._segments.get(index)
        return None if segment is None else (segment.param_offset, segment.numel)

    def load_kept(self, index: int, values: torch.Tensor) -> None:
        """Set this rank's elements of parameter ``index`` (``values``: `kept_range`'s, any
        floating dtype: cast to the unit's)."""
        segment = self._segments.get(index)
        if segment is None:
            return
        if self.has_full_storage:
            raise RuntimeError(f"unit {self.label}: loading a shard while the unit is gathered (mid-step?)")
        with self.shard.writing() as shard:
            shard[segment.shard_offset : segment.shard_offset + segment.numel].copy_(values.reshape(-1))

    def write_kept(self, index: int, values: torch.Tensor) -> None:
        """Set this rank's shard of parameter ``index`` from its full flattened ``values``,
        whether or not the unit is gathered (`zero_engine.state.gathered` writes the gathered
        values itself)."""
        segment = self._segments.get(index)
        if segment is not None:
            piece = values[segment.param_offset : segment.param_offset + segment.numel]
            with self.shard.writing() as shard:
                offload.copy_across(shard[segment.shard_offset : segment.shard_offset + segment.numel], piece)

    def shard_pieces(self) -> list[tuple[int, int, int, torch.Tensor]]:
        """This rank's pieces: ``(param index, start in the parameter, numel, values)``."""
        shard = self.shard_values()
        return [
            (piece.param_index, piece.param_offset, piece.numel,
             shard[piece.shard_offset : piece.shard_offset + piece.numel])
            for piece in self._segments.values()
        ]

    def gather_masters(self, comm: Comm, onto: int | None = None) -> torch.Tensor | None:
        """The unit's values over the whole flat buffer, in its own dtype, gathered from every
        rank's shard (for exports: the same call as a trainable unit's fp32 masters); onto rank
        ``onto`` alone when given (the others return None)."""
        shard = self.shard_values()
        if onto is not None and comm.rank != onto:
            comm.gather(shard.to(self.device), None, dst=onto).wait()
            return None
        start, end = self.layout.shard_range(self.rank)
        full = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        full[start:end] = shard
        (comm.all_gather(full) if onto is None else comm.gather(full[start:end], full, dst=onto)).wait()
        return full
