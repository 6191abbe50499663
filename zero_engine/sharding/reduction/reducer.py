"""Gradient reduction during backward, one unit (bucket) at a time.

A post-accumulate-grad hook on every trainable parameter records that it received a gradient
and counts it towards its unit. When a unit's parameters have all arrived, its reduction is
launched asynchronously while backward goes on. Units are launched strictly in list order
(the expected arrival order: reverse registration), a ready unit waiting for the ones before
it, so every rank issues the same collectives in the same order even when ranks differ in
which parameters they used. Units still incomplete when backward returns (parameters unused
on this rank) are launched then, in order, and everything is awaited.

At stage 3 the reductions run on a group of their own (`zero_engine.comm.Comm.reduce_group`):
the all-gathers launch in an order the ranks agree on, which cannot interleave alike with
these on every rank when ranks differ in which parameters got gradients. A backward then may
wait for a reduction only once it completed or every rank has said it launched it
(`may_wait_for`, from the rows the stage 3 schedule exchanges, `zero_engine.sharding.gathering.agreement`):
a rank where a parameter got no gradient launches it only after its backward, and may be
waiting for this rank meanwhile.

Two ways to hold gradients, one class each:

- `FullGradReducer` (stages 0-1): every ``.grad`` is a view into the unit's persistent flat
  gradient buffer; autograd accumulates there across micro-steps and the reduction runs on
  boundaries only: all-reduce (stage 0) or reduce-scatter into the rank's shard (stage 1).
- `ShardedGradReducer` (stages 2-3, `zero_engine.sharding.reduction.bucket_reducer`): only the rank's
  gradient shard persists; gradients stream through buckets into it, every micro-step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ... import offload
from ...comm import Comm
from ...comm.handles import Pending
from ...devices import HOST, tensor_bytes
from ..shards.codec import EXACT_GRADS, GradCodec, Reduction
from ..units.lifecycle import Lifecycle, TrainingState
from ..units.unit import FlatUnit


class GradReduction(Protocol):
    """How full-gradient stages reduce one unit's flat gradients and which part they keep."""

    def launch(self, flat: torch.Tensor, comm: Comm) -> Reduction: ...

    def kept(self, flat: torch.Tensor, unit: FlatUnit) -> torch.Tensor: ...


class AllReduceGrads:
    """Stage 0: every rank keeps the full averaged gradient."""

    def launch(self, flat: torch.Tensor, comm: Comm) -> Pending:
        return comm.all_reduce_sum(flat)

    def kept(self, flat: torch.Tensor, unit: FlatUnit) -> torch.Tensor:
        return flat


class ReduceScatterGrads:
    """Stage 1: each rank keeps the averaged gradient of its own shard; ``codec`` says how the
    gradients travel (quantized or not)."""

    def __init__(self, codec: GradCodec = EXACT_GRADS) -> None:
        self.codec = codec

    def launch(self, flat: torch.Tensor, comm: Comm) -> Reduction:
        return self.codec.reduce_scatter(comm, flat)

    def kept(self, flat: torch.Tensor, unit: FlatUnit) -> torch.Tensor:
        start, end = unit.layout.shard_range(unit.rank)
        return flat[start:end]


class GradReducer:
    """Hooks, arrival counting and in-order launching; subclasses say what a launch does."""

    reduces_every_micro_step = False  # full gradients accumulate locally between boundaries

    def __init__(
        self,
        units: Sequence[FlatUnit],
        comm: Comm,
        overlap: bool,
        reduce_dtype: torch.dtype,
        *,
        lifecycle: Lifecycle | None = None,
        on_unit_complete: Callable[[FlatUnit], None] | None = None,
        on_unarmed_grad: Callable[[], None] | None = None,
        may_wait_for: Callable[[int], bool | None] | None = None,
        before_launch: Callable[[], None] | None = None,
    ) -> None:
        self.units = list(units)
        self.lifecycle = lifecycle or Lifecycle()  # REDUCING or ACCUMULATING while a backward runs
        self.comm = comm
        self.overlap = overlap
        self.reduce_dtype = reduce_dtype  # gradients are summed in this dtype (fp32 by default)
        self.num_params = sum(len(unit.params) for unit in self.units)
        # 1 where a parameter received a gradient on this rank since the last optimizer step: a
        # bytearray, since a tensor item assignment per parameter per backward costs ~5 us.
        self.used = bytearray(self.num_params)
        self.peak_grad_bytes = self.held_grad_bytes()  # most gradient storage alive in the last backward
        self._arrived = [0] * len(self.units)
        self._next_unit = 0
        # Told when all of a unit's parameters have their gradient in a reducing backward
        # (stage 3 frees the unit's gathered parameters then).
        self.on_unit_complete = on_unit_complete
        # Told when a gradient arrives outside an armed backward (a loss that used a parameter
        # outside the model's forward): the engine arms the backward then.
        self.on_unarmed_grad = on_unarmed_grad
        # Asked before a backward waits for a unit's reduction to make room for a bucket
        # (stage 3: whether every rank has launched it; None: not known yet); None: always.
        self.may_wait_for = may_wait_for
        # Called before a reduction is launched (stages 0-2: the training call row sent at the
        # backward's start is read there, `zero_engine.sharding.gathering.calls.CallGuard.read`).
        self.before_launch = before_launch
        self._settled: set[int] = set()  # units that get no gradient here this backward
        self._index = {id(unit): index for index, unit in enumerate(self.units)}
        # offload_optimizer on the host: the units' host gradients, waited for at the end of a
        # reducing backward (on NVMe the write thread waits for each copy instead).
        self._host_grads = [
            unit.optimizer_shard.grad for unit in self.units if unit.optimizer_shard.grad.waits_for_copies
        ]
        self._handles: list[Any] = []
        for unit_index, unit in enumerate(self.units):
            for param_index, param in enumerate(unit.params):
                hook = self._hook(unit_index, param_index, unit.used_offset + param_index)
                self._handles.append(param.register_post_accumulate_grad_hook(hook))

    def _hook(self, unit_index: int, param_index: int, global_index: int):
        def on_grad_accumulated(param: torch.Tensor) -> None:
            if not self.lifecycle.state.in_backward and self.on_unarmed_grad is not None:
                self.on_unarmed_grad()
            self.used[global_index] = 1
            if self.lifecycle.state is TrainingState.REDUCING:
                self._accept(self.units[unit_index], unit_index, param_index, param)
                self._arrived[unit_index] += 1
                if self.overlap:
                    self._launch_ready_units()
                unit = self.units[unit_index]
                if self.on_unit_complete is not None and self._arrived[unit_index] == len(unit.params):
                    self.on_unit_complete(unit)

        return on_grad_accumulated

    def pre_backward(self, boundary: bool) -> None:
        """A backward starts: REDUCING, or (off boundaries, full gradients) ACCUMULATING."""
        self.lifecycle.begin_backward(reducing=boundary or self.reduces_every_micro_step)
        self._arrived = [0] * len(self.units)
        self._next_unit = 0
        self._settled = set()
        self.peak_grad_bytes = self.held_grad_bytes()

    def settle(self, units: Sequence[FlatUnit]) -> None:
        """``units`` will get no gradient here in this backward (stage 3: their modules did not
        run on this rank), so they count as ready: the ranks that did run them need not wait
        for the end of backward to reduce them."""
        self._settled.update(self._index[id(unit)] for unit in units if id(unit) in self._index)
        if self.overlap and self.lifecycle.state is TrainingState.REDUCING:
            self._launch_ready_units()  # the first units may be settled ones: launched now, with zeros

    def ready_units(self) -> int:
        """How many units, in launch order, have their reduction launched in this backward
        (0 outside a reducing backward). A unit is launched as soon as it and every unit
        before it are ready, so other ranks may wait for these."""
        return self._next_unit if self.lifecycle.state is TrainingState.REDUCING else 0

    def disarm(self) -> None:
        """Forget a backward that raised half-way (its end never came); the next one starts anew."""
        self.lifecycle.end_backward()

    def post_backward(self) -> None:
        """Launch what backward left unreduced, then wait and average."""
        reducing = self.lifecycle.state is TrainingState.REDUCING
        self.lifecycle.end_backward()
        if reducing:
            self._launch_until(len(self.units))
            self._finish()
            self._finish_host_copies()

    def _finish_host_copies(self) -> None:
        """offload_optimizer: wait once for this backward's gradient copies to the host (the
        one host sync an offloaded backward adds), then add any staged micro-step in."""
        if self._host_grads:
            offload.wait_for_host_copies(self._host_grads[0].device)
            for grad in self._host_grads:
                grad.finish()

    def _launch_ready_units(self) -> None:
        stop = self._next_unit
        while stop < len(self.units) and (
            self._arrived[stop] == len(self.units[stop].params) or stop in self._settled
        ):
            stop += 1
        self._launch_until(stop)

    def _launch_until(self, stop: int) -> None:
        """Launch the reductions of every unit before ``stop`` not launched yet, in order."""
        if self._next_unit < stop and self.before_launch is not None:
            self.before_launch()
        while self._next_unit < stop:
            self._launch(self._next_unit)
            self._next_unit += 1

    def held_grad_bytes(self) -> int:
        """Gradient storage the units hold now (full buffers or shards)."""
        return sum(unit.grad_bytes for unit in self.units)

    def reset_used(self) -> None:
        self.used[:] = bytes(self.num_params)

    def used_mask(self) -> torch.Tensor:
        """The used flags as a new float64 host tensor (ranks sum them)."""
        if not self.num_params:  # frombuffer refuses an empty buffer
            return torch.zeros(0, dtype=torch.float64, device=HOST)
        return torch.frombuffer(self.used, dtype=torch.uint8).to(torch.float64)  # frombuffer: always the host

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- what a stage's way of holding gradients decides -------------------------------------

    def _accept(self, unit: FlatUnit, unit_index: int, param_index: int, param: torch.Tensor) -> None:
        """A parameter's gradient has arrived in ``param.grad`` during a reducing backward."""

    def _launch(self, unit_index: int) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def grad_shard(self, unit: FlatUnit) -> torch.Tensor:
        """This rank's shard of ``unit``'s averaged gradient (each element on one rank of the
        shard group, for norms summed over ranks)."""
        raise NotImplementedError

    def zero_grads(self) -> None:
        raise NotImplementedError

    def buffer_bytes(self) -> int:
        """Reusable communication buffers held between steps."""
        return 0


class FullGradReducer(GradReducer):
    """Stages 0-1: full flat gradients persist; reduced once per accumulation window, through
    a temporary copy when the reduction dtype differs from the compute dtype. At most
    ``max_live_copies`` such copies exist at once: launching another first completes the
    oldest reduction (otherwise bf16 with fp32 reduction held an fp32 copy of the whole model)."""

    def __init__(
        self,
        units: Sequence[FlatUnit],
        comm: Comm,
        overlap: bool,
        reduce_dtype: torch.dtype,
        reduction: GradReduction,
        *,
        max_live_copies: int = 2,
        **callbacks: Any,
    ) -> None:
        super().__init__(units, comm, overlap, reduce_dtype, **callbacks)
        self.reduction = reduction
        self.max_live_copies = max_live_copies
        self._pending: deque[tuple[FlatUnit, torch.Tensor, Reduction]] = deque()
        self._copy_bytes = 0  # reduction copies alive now

    def pre_backward(self, boundary: bool) -> None:
        for unit in self.units:
            unit.attach_grads()  # in case user code set the gradients to None (zero_grad)
        super().pre_backward(boundary)

    def _launch(self, unit_index: int) -> None:
        unit = self.units[unit_index]
        flat = _full_grad(unit)
        if flat.dtype != self.reduce_dtype:
            while len(self._pending) >= self.max_live_copies:
                self._complete_oldest()
            flat = flat.to(self.reduce_dtype)
            self._copy_bytes += tensor_bytes(flat)
            self.peak_grad_bytes = max(self.peak_grad_bytes, self.held_grad_bytes() + self._copy_bytes)
        self._pending.append((unit, flat, self.reduction.launch(flat, unit.sharded_over(self.comm))))

    def _complete_oldest(self) -> None:
        unit, flat, pending = self._pending.popleft()
        pending.wait()
        unit.optimizer_shard.take_reduced(self.reduction.kept(flat, unit).div_(self.comm.mesh.grad_divisor))
        if flat is not unit.flat_grad:
            self._copy_bytes -= tensor_bytes(flat)

    def _finish(self) -> None:
        while self._pending:
            self._complete_oldest()

    def grad_shard(self, unit: FlatUnit) -> torch.Tensor:
        if unit.optimizer_shard.grad.on_host:  # the averaged shard is on the host (the device buffer was reduced elsewhere)
            return unit.optimizer_shard.ensure_grad()
        start, end = unit.layout.shard_range(unit.rank)
        return _full_grad(unit)[start:end]

    def zero_grads(self) -> None:
        for unit in self.units:
            _full_grad(unit).zero_()


def _full_grad(unit: FlatUnit) -> torch.Tensor:
    if unit.flat_grad is None:
        raise RuntimeError(f"unit of {unit.names} keeps no full gradients; it belongs to a sharded-gradient reducer")
    return unit.flat_grad
