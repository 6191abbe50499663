"""Stages 2-3's way of holding gradients: only the rank's gradient shard persists; every
gradient streams through a bucket into it, reduce-scattered as soon as its unit is complete.

Each gradient is copied into its unit's bucket and freed at once; a complete bucket is
reduce-scattered and its slice added into the shard, every micro-step. At stage 2 at most two
buckets are alive (one filling, one reducing; a third waits for the oldest reduction); at
stage 3 one, sized for its unit, and the shards exist only from the backward to the step.
Arrival counting and launching in order are the base class's (`zero_engine.sharding.reduction.reducer`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ...comm import Comm
from ...comm.handles import TwoPhase
from ...devices import tensor_bytes
from ..shards.codec import EXACT_GRADS, GradCodec, Reduction
from .reducer import GradReducer
from ..units.unit import FlatUnit


class _Bucket(NamedTuple):
    """A unit's gradients on their way to its reduce-scatter. Not zero-filled: a parameter's
    first gradient is copied in, later ones added, and what got none (the padding, unused
    parameters) is zeroed at launch, so the common backward writes each element once."""

    storage: torch.Tensor  # reusable, sized for the largest unit
    flat: torch.Tensor  # the unit's padded view of it
    arrived: bytearray  # 1 where the unit's parameter has its gradient in ``flat``

    def zero_missing(self, unit: FlatUnit) -> None:
        """Zero every element no gradient was written to (before the reduction reads them)."""
        layout = unit.layout
        for index, offset in enumerate(layout.param_offsets):
            if not self.arrived[index]:
                self.flat[offset : offset + layout.param_numels[index]].zero_()
        self.flat[layout.unpadded_numel :].zero_()


class ShardedGradReducer(GradReducer):
    """Stages 2-3: gradients stream through at most ``max_live_buckets`` buckets into the
    rank's shard. With ``release_after_step`` (stage 3) the shards and the buckets exist only
    from the backward to the optimizer step."""

    reduces_every_micro_step = True

    def __init__(
        self,
        units: Sequence[FlatUnit],
        comm: Comm,
        overlap: bool,
        reduce_dtype: torch.dtype,
        *,
        max_live_buckets: int = 2,
        release_after_step: bool = False,
        codec: GradCodec = EXACT_GRADS,
        **callbacks: Any,
    ) -> None:
        super().__init__(units, comm, overlap, reduce_dtype, **callbacks)
        self.codec = codec  # how the buckets travel (quantized or not)
        self.max_live_buckets = max_live_buckets
        self.release_after_step = release_after_step
        self._shard_bytes = self.held_grad_bytes()  # kept up to date: the peak is taken per parameter
        # Pooled buckets are sized for the largest unit and reused; released ones (stage 3) are
        # sized for their unit and freed as soon as their reduction completes.
        self._bucket_numel = max((unit.layout.padded_numel for unit in self.units), default=0)
        self._free: list[torch.Tensor] = []  # pooled bucket storage ready for reuse
        self._filling: dict[int, _Bucket] = {}  # unit index -> its bucket, not yet launched
        # (unit, bucket, reduction, whether the reduced shard is averaged over every rank already)
        self._in_flight: deque[tuple[FlatUnit, _Bucket, Reduction, bool]] = deque()
        self._boundary = False
        self._crossed: set[int] = set()  # hybrid: units whose shard crossed groups in this window
        self._num_live = 0  # buckets filling or reducing
        self._live_bytes = 0

    def pre_backward(self, boundary: bool) -> None:
        self._boundary = boundary
        super().pre_backward(boundary)

    def _accept(self, unit: FlatUnit, unit_index: int, param_index: int, param: torch.Tensor) -> None:
        if unit_index < self._next_unit:
            raise RuntimeError(
                f"parameter {unit.names[param_index]!r} received a second gradient after its bucket was reduced "
                "(reentrant activation checkpointing?); use torch.utils.checkpoint with use_reentrant=False, "
                "or zero_optimization.overlap_comm: false"
            )
        bucket = self._filling.get(unit_index)
        if bucket is None:
            bucket = self._filling[unit_index] = self._acquire(unit)
        grad = param.grad
        if grad is None:
            raise RuntimeError(f"post-accumulate-grad hook of {unit.names[param_index]!r} found no gradient")
        offset = unit.layout.param_offsets[param_index]
        target = bucket.flat[offset : offset + grad.numel()]
        if bucket.arrived[param_index]:
            target.add_(grad.reshape(-1))
        else:
            target.copy_(grad.reshape(-1))
            bucket.arrived[param_index] = 1
        self._record_peak(extra=grad.numel() * grad.element_size())
        param.grad = None  # the full gradient lives only in the bucket now

    def _acquire(self, unit: FlatUnit) -> _Bucket:
        if self._num_live >= self.max_live_buckets and self._in_flight and self._may_wait_for_oldest():
            self._complete_oldest()
        if self._free:
            storage = self._free.pop()
        else:
            numel = unit.layout.padded_numel if self.release_after_step else self._bucket_numel
            storage = torch.empty(numel, dtype=self.reduce_dtype, device=unit.device)
        self._num_live += 1
        self._live_bytes += tensor_bytes(storage)
        return _Bucket(storage, storage[: unit.layout.padded_numel], bytearray(len(unit.params)))

    def _launch(self, unit_index: int) -> None:
        unit = self.units[unit_index]
        bucket = self._filling.pop(unit_index, None)
        if bucket is None:  # no gradient here this backward; other ranks may have some
            bucket = self._acquire(unit)
        bucket.zero_missing(unit)
        comm = unit.sharded_over(self.comm)
        if comm.num_replicas == 1:
            self._in_flight.append((unit, bucket, self.codec.reduce_scatter(comm, bucket.flat), False))
        else:
            self._in_flight.append((unit, bucket, *self._reduce_hybrid(unit, bucket.flat)))

    def _reduce_hybrid(self, unit: FlatUnit, flat: torch.Tensor) -> tuple[Reduction, bool]:
        """Hybrid sharding: off boundaries, a micro-step reduces inside the shard group only
        and accumulates; on the boundary the shard crosses groups once, carrying the whole
        window (as FSDP's HSDP skips the all-reduce on accumulation micro-steps), so
        inter-group traffic is one shard all-reduce per optimizer step, whatever the
        accumulation. A further backward on the boundary crosses with its own part only."""
        comm = unit.sharded_over(self.comm)
        inside = self.codec.reduce_scatter_in_group(comm, flat)
        if not self._boundary:
            return inside, False
        start, end = unit.layout.shard_range(unit.rank)
        shard = flat[start:end]

        def across_groups() -> Reduction:  # on the starter's thread (gloo): touches this unit only
            shard.mul_(1.0 / self.comm.mesh.grad_divisor)
            if id(unit) not in self._crossed:  # carry the group's part of the window, once
                self._crossed.add(id(unit))
                unit.optimizer_shard.move_grad_into(shard)
            return self.codec.all_reduce_across_groups(comm, shard)

        return TwoPhase(inside, across_groups, comm.second_phases, flat.device), True

    def _may_wait_for_oldest(self) -> bool:
        """Whether waiting for the oldest reduction in flight is safe: it completed already, or
        every rank has launched it. Until one of them is known, check both again (briefly
        sleeping: the other ranks share the cores); if neither can be, hold one more bucket."""
        unit, _, pending, _ = self._in_flight[0]
        if self.may_wait_for is None:
            return True
        index = self._index[id(unit)]
        while True:
            if pending.done():
                return True
            verdict = self.may_wait_for(index)
            if verdict is not None:
                return verdict
            time.sleep(20e-6)

    def _complete_oldest(self) -> None:
        unit, bucket, pending, averaged = self._in_flight.popleft()
        pending.wait()
        start, end = unit.layout.shard_range(unit.rank)
        reduced = bucket.flat[start:end]
        held = unit.optimizer_shard.grad_bytes
        unit.optimizer_shard.add_reduced(reduced, 1.0 if averaged else 1.0 / self.comm.mesh.grad_divisor)
        self._shard_bytes += unit.optimizer_shard.grad_bytes - held
        self._num_live -= 1
        self._live_bytes -= tensor_bytes(bucket.storage)
        if not self.release_after_step:
            self._free.append(bucket.storage)

    def _finish(self) -> None:
        while self._in_flight:
            self._complete_oldest()

    def _record_peak(self, extra: int) -> None:
        current = self._shard_bytes + self._live_bytes + extra
        self.peak_grad_bytes = max(self.peak_grad_bytes, current)

    def grad_shard(self, unit: FlatUnit) -> torch.Tensor:
        """The shard's step gradient (made of zeros if no reduction wrote it, and counted)."""
        held = unit.optimizer_shard.grad_bytes
        grad = unit.optimizer_shard.ensure_grad()
        self._shard_bytes += unit.optimizer_shard.grad_bytes - held
        return grad

    def zero_grads(self) -> None:
        self._crossed.clear()
        for unit in self.units:
            unit.optimizer_shard.clear_grad()
        self._shard_bytes = self.held_grad_bytes()

    def buffer_bytes(self) -> int:
        return self._live_bytes + sum(tensor_bytes(storage) for storage in self._free)

