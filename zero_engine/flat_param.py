"""A unit: parameters stored in one flat buffer, their gradients in another.

Each parameter's ``.data`` and ``.grad`` become views into the unit's flat buffers, so a
collective moves a whole unit in one call and the optimizer updates a rank's shard in place:
in fp32 the rank's slice of ``flat_param`` *is* its master copy, with no second fp32 copy.
Autograd accumulates into an existing ``.grad`` in place, which keeps the views intact.

The engine never does offset arithmetic itself; it asks the unit for views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .layout import Segment, UnitLayout


class FlatUnit:
    """Parameters of one param group, flattened in order into padded flat buffers."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        group_index: int,
        rank: int,
        world_size: int,
        *,
        full_grads: bool = True,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.group_index = group_index  # the optimizer param group its parameters belong to
        self.rank = rank
        self.layout = UnitLayout([p.numel() for p in self.params], world_size)
        first = self.params[0]
        self.flat_param = torch.zeros(self.layout.padded_numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for index, param in enumerate(self.params):
                view = self.param_view(index)
                view.copy_(param.detach())
                param.data = view
        # Full gradients (stages 0-1): one flat buffer, each .grad a view into it. Sharded
        # gradients (stage 2): only this rank's shard persists; full ones pass through buckets.
        self.flat_grad: torch.Tensor | None = None
        if full_grads:
            self.flat_grad = torch.zeros_like(self.flat_param)
            self.sharded_grad = self._shard(self.flat_grad)
            self.attach_grads()
        else:
            self.sharded_grad = torch.zeros(self.layout.shard_numel, dtype=first.dtype, device=first.device)

    def _view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        offset, param = self.layout.param_offsets[index], self.params[index]
        return flat[offset : offset + param.numel()].view(param.shape)

    def param_view(self, index: int) -> torch.Tensor:
        return self._view(self.flat_param, index)

    def grad_view(self, index: int) -> torch.Tensor:
        if self.flat_grad is None:
            raise RuntimeError(f"unit of {self.names} keeps no full gradients")
        return self._view(self.flat_grad, index)

    def attach_grads(self) -> None:
        """Point every parameter's ``.grad`` at its slice of ``flat_grad`` (full gradients only)."""
        if self.flat_grad is not None:
            for index, param in enumerate(self.params):
                param.grad = self.grad_view(index)

    def _shard(self, flat: torch.Tensor) -> torch.Tensor:
        start, end = self.layout.shard_range(self.rank)
        return flat[start:end]

    @property
    def grad_bytes(self) -> int:
        """Persistent gradient storage: the full flat buffer, or just this rank's shard."""
        held = self.flat_grad if self.flat_grad is not None else self.sharded_grad
        return held.numel() * held.element_size()

    @property
    def sharded_param(self) -> torch.Tensor:
        """This rank's shard of the parameters: its fp32 master copy."""
        return self._shard(self.flat_param)

    def segments(self) -> list[ShardSegment]:
        """This rank's pieces of each parameter, as views an optimizer can update in place."""
        return [
            ShardSegment(self, piece, self.sharded_param[piece.shard_offset : piece.shard_offset + piece.numel],
                         self.sharded_grad[piece.shard_offset : piece.shard_offset + piece.numel])
            for piece in self.layout.segments(self.rank)
        ]


@dataclass
class ShardSegment:
    """One parameter's piece in this rank's shard: the tensor the sharded optimizer steps."""

    unit: FlatUnit
    piece: Segment
    tensor: torch.Tensor
    grad: torch.Tensor

    @property
    def name(self) -> str:
        return self.unit.names[self.piece.param_index]
