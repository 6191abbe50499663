"""Gradient reduction during backward, one unit (bucket) at a time.

A post-accumulate-grad hook on every trainable parameter records that it received a gradient
and counts it towards its unit. On a boundary backward, a unit whose parameters have all
arrived is reduced asynchronously while backward goes on. Units are launched strictly in their
list order (the expected arrival order: reverse registration), a ready unit waiting for the
ones before it, so every rank issues the same collectives in the same order even when ranks
differ in which parameters they used. Units still incomplete when backward returns (unused
parameters) are launched then, in order, and everything is awaited.

The stage decides what "reduce" means through a `GradReduction` (all-reduce for stage 0,
reduce-scatter into the rank's shard for stage 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from .comm import Comm, Pending
from .flat_param import FlatUnit


class GradReduction(Protocol):
    """How a stage reduces one unit's gradients and which part of them it keeps."""

    def launch(self, unit: FlatUnit, comm: Comm) -> Pending: ...

    def kept_grad(self, unit: FlatUnit) -> torch.Tensor:
        """The gradients this rank holds averaged after the reduction."""
        ...


class AllReduceGrads:
    """Stage 0: every rank keeps the full averaged gradient."""

    def launch(self, unit: FlatUnit, comm: Comm) -> Pending:
        return comm.all_reduce_sum(unit.flat_grad)

    def kept_grad(self, unit: FlatUnit) -> torch.Tensor:
        return unit.flat_grad


class ReduceScatterGrads:
    """Stages 1-2: each rank keeps the averaged gradient of its own shard."""

    def launch(self, unit: FlatUnit, comm: Comm) -> Pending:
        return comm.reduce_scatter_sum(unit.flat_grad)

    def kept_grad(self, unit: FlatUnit) -> torch.Tensor:
        return unit.sharded_grad


class GradReducer:
    """Launches each unit's reduction as soon as its gradients (and its predecessors') are in."""

    def __init__(self, units: Sequence[FlatUnit], comm: Comm, reduction: GradReduction, overlap: bool) -> None:
        self.units = list(units)
        self.comm = comm
        self.reduction = reduction
        self.overlap = overlap
        self.num_params = sum(len(unit.params) for unit in self.units)
        # 1.0 where a parameter received a gradient on this rank since the last optimizer step.
        self.used = torch.zeros(self.num_params, dtype=torch.float32)
        self._arrived = [0] * len(self.units)
        self._reducing = False
        self._next_unit = 0
        self._pending: list[Pending] = []
        self._handles: list[Any] = []
        index = 0
        for unit_index, unit in enumerate(self.units):
            for param in unit.params:
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook(unit_index, index)))
                index += 1

    def _hook(self, unit_index: int, param_index: int):
        def on_grad_accumulated(_param: torch.Tensor) -> None:
            self.used[param_index] = 1.0
            if self._reducing:
                self._arrived[unit_index] += 1
                if self.overlap:
                    self._launch_ready_units()

        return on_grad_accumulated

    def pre_backward(self, reduce: bool) -> None:
        """Arm the reducer; with ``reduce`` false, gradients only accumulate locally."""
        self._reducing = reduce
        self._arrived = [0] * len(self.units)
        self._next_unit = 0

    def post_backward(self) -> None:
        """Launch what backward left unreduced, wait for all, and average."""
        if not self._reducing:
            return
        self._launch(len(self.units))
        for pending in self._pending:
            pending.wait()
        self._pending.clear()
        for unit in self.units:
            self.reduction.kept_grad(unit).div_(self.comm.world_size)
        self._reducing = False

    def _launch_ready_units(self) -> None:
        stop = self._next_unit
        while stop < len(self.units) and self._arrived[stop] == len(self.units[stop].params):
            stop += 1
        self._launch(stop)

    def _launch(self, stop: int) -> None:
        while self._next_unit < stop:
            self._pending.append(self.reduction.launch(self.units[self._next_unit], self.comm))
            self._next_unit += 1

    def reset_used(self) -> None:
        self.used.zero_()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
