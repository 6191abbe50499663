"""The optimizer's side of one unit: its fp32 master, its step gradient, what the optimizer
steps, the update, and the publication of the updated values.

Each `FlatUnit` owns one `OptimizerShard` for the range of its flat buffer that this rank's
optimizer updates (the rank's shard when optimizer state is sharded, the whole unit at stage
0). Everything about that range lives here and nowhere else:

- the *master*: fp32 values of the range. In fp32 training below stage 3 it is a view of the
  unit's own parameters (no second copy); at stage 3 in fp32 it is the parameter shard itself;
  with bf16/fp16 compute it is a tensor of its own, and `publish` casts it into the compute copy
  after each update;
- the *step gradient*: the averaged gradient of the range, in the compute dtype. Below stage 2
  it is a view of the unit's full gradient buffer (reduced in place); from stage 2 on the
  reducer hands each reduced slice to `add_reduced`, and at stage 3 the gradient exists only
  from the backward to the step (`clear_grad`);
- the *targets*: one optimizer tensor per parameter piece in the range (a view of the master),
  so torch optimizers keep their per-tensor semantics piece by piece.

Where the master and the gradient live is decided once for the engine
(`zero_engine.sharding.tiers.placement`): on the unit's device, or on the host with
``offload_optimizer``: then the step gradient is a `HostGrad` that reductions are copied into,
the optimizer steps the host masters, and `publish` copies them back. The step gradient's kind
is an object (`StepGrad`), so nothing here branches on where it lives. Nothing outside this
module touches them by offset.

The optimizer's state of the targets is read and written here alone, and lives where the
master's kind keeps it (`bind_optimizer`: in place, or on NVMe between steps): `state_pieces`
gives the shard as a checkpoint saves it (per parameter segment: master values and the state
covering them), `load_state` restores it from saved pieces of any layout, `state_bytes` counts
it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypedDict

import torch

from ... import offload
from ...devices import saved_copy, tensor_bytes
from .compute_layout import MatrixExchange, finish_window
from ..shards.layout import UnitLayout
from ..tiers.placement import Master, StepGrad


class OwningUnit(Protocol):
    """What a shard reads of its unit (`zero_engine.sharding.units.unit.FlatUnit`)."""

    layout: UnitLayout
    names: list[str]
    shapes: list[torch.Size]
    rank: int
    compute_dtype: torch.dtype
    device: torch.device
    used_offset: int  # the unit's first parameter in the used-mask

    def global_start(self, index: int, local_start: int) -> int: ...  # in the whole parameter (`param_placement`)


class SavedPiece(TypedDict):
    """One parameter's saved range, as every checkpoint file holds it (this engine's rank files,
    what the DeepSpeed reader and ``zero-engine convert`` make of DeepSpeed's): elements
    ``[start, start + numel)`` of the flattened parameter ``name``, their values (fp32 masters;
    a frozen parameter's in its stored dtype) and the optimizer state covering them."""

    name: str
    start: int
    numel: int
    master: torch.Tensor
    state: dict[str, Any]


def saved_piece(name: str, start: int, numel: int, master: torch.Tensor, state: dict[str, Any]) -> SavedPiece:
    return {"name": name, "start": start, "numel": numel, "master": master, "state": state}


class SavedPieces(Protocol):
    """Saved pieces of parameters by name and element range (`zero_engine.state.payload.PieceIndex`)."""

    def covering(self, name: str, start: int, numel: int) -> list[SavedPiece]: ...

    def assemble(self, name: str, start: int, numel: int, key: str | None = None) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class OwnedPiece:
    """One parameter's piece in the range this rank's optimizer updates."""

    param_index: int  # within the unit
    name: str
    param_offset: int  # first element of the piece, in the flattened parameter
    owned_offset: int  # where the piece starts within the owned range
    numel: int
    shape: torch.Size  # the optimizer tensor's shape


class OptimizerTarget(NamedTuple):
    """A tensor the optimizer steps: the fp32 master of one parameter's owned piece."""

    tensor: torch.Tensor
    piece: OwnedPiece

    @property
    def name(self) -> str:
        return self.piece.name

    @property
    def param_index(self) -> int:
        return self.piece.param_index

    @property
    def param_offset(self) -> int:
        return self.piece.param_offset


class OptimizerShard:
    """Master, step gradient and optimizer targets of one unit's owned range."""

    def __init__(
        self,
        unit: OwningUnit,
        owned_range: tuple[int, int],
        master: Master,
        grad: StepGrad,
        *,
        shaped_pieces: bool,
    ) -> None:
        self.unit = unit
        self.owned_range = owned_range
        self.master_kind = master  # where the master lives (`zero_engine.sharding.tiers.placement`)
        self.master = master.tensor
        self.grad = grad  # the step gradient (a view of the full buffer, a device tensor, or on the host)
        self.targets = [
            OptimizerTarget(self.master[p.owned_offset : p.owned_offset + p.numel].view(p.shape), p)
            for p in self._owned_pieces(shaped_pieces)
        ]
        self._cached_views: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        # The optimizer whose state of the targets this shard holds (`bind_optimizer`).
        self.optimizer: torch.optim.Optimizer | None = None
        # The unit's whole-matrix parameters, when the optimizer has some (`compute_layout`).
        self.matrices: MatrixExchange | None = None
        master.settle()  # the targets are views of the master now (on NVMe: out to the file)

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's elementwise state of the targets lives where the master lives (swapped
        with it on NVMe), keyed by target and state name."""

        def states() -> Iterator[tuple[tuple[int, str], torch.Tensor]]:
            for index, target in enumerate(self.targets):
                for key, value in optimizer.state.get(target.tensor, {}).items():
                    if torch.is_tensor(value) and value.dim() > 0 and value.numel() == target.tensor.numel():
                        yield (index, key), value

        self.optimizer = optimizer
        self.master_kind.bind_state(states)

    # -- the range ---------------------------------------------------------------------------

    def owned_part(self, index: int) -> tuple[int, int, int] | None:
        """Parameter ``index``'s intersection with the owned range: (offset in the flattened
        parameter, offset in the owned range, length), or None when it lies outside."""
        layout = self.unit.layout
        offset, numel = layout.param_offsets[index], layout.param_numels[index]
        start, end = self.owned_range
        lo, hi = max(offset, start), min(offset + numel, end)
        return (lo - offset, lo - start, hi - lo) if lo < hi else None

    def _owned_pieces(self, shaped: bool) -> list[OwnedPiece]:
        """The parameters' pieces in the owned range, shaped like their parameters when
        ``shaped`` (whole parameters at stage 0), else flat."""
        pieces = []
        for index, name in enumerate(self.unit.names):
            owned = self.owned_part(index)
            if owned is not None:
                param_offset, owned_offset, numel = owned
                shape = self.unit.shapes[index] if shaped else torch.Size([numel])
                pieces.append(OwnedPiece(index, name, param_offset, owned_offset, numel, shape))
        return pieces

    @property
    def master_of_shard(self) -> torch.Tensor:
        """The fp32 master values of this rank's shard (what a checkpoint saves)."""
        start, end = self.unit.layout.shard_range(self.unit.rank)
        return self.master[start - self.owned_range[0] : end - self.owned_range[0]]

    @property
    def master_is_compute_copy(self) -> bool:
        """The master is the parameters' own storage (fp32 compute)."""
        return self.master_kind.is_compute_copy

    @property
    def master_bytes(self) -> int:
        """A separate fp32 master (mixed precision, or offloaded); 0 when the master is the parameters."""
        return self.master_kind.nbytes

    @property
    def host_bytes(self) -> int:
        """What of the master and the step gradient lives on the host (offload_optimizer)."""
        return self.master_kind.host_bytes + (self.grad.nbytes if self.grad.on_host else 0)

    def resident(self) -> AbstractContextManager[torch.Tensor]:
        """The master present while inside (`Master.resident`): the step updates it there."""
        return self.master_kind.resident()

    def load_owned(self, index: int, values: torch.Tensor, values_start: int) -> None:
        """Set the owned part of parameter ``index`` from ``values`` (fp32, elements
        ``[values_start, values_start + len)`` of the flattened parameter), master and
        compute copy."""
        owned = self.owned_part(index)
        if owned is None:
            return
        param_offset, owned_offset, numel = owned
        piece = values.reshape(-1)[param_offset - values_start : param_offset - values_start + numel]
        with self.resident() as master:
            master[owned_offset : owned_offset + numel].copy_(piece)
        publish_to = self.master_kind.publish_to  # the compute copy of the range; None when the master is it
        if publish_to is not None:
            with publish_to.writing() as compute:
                offload.copy_across(compute[owned_offset : owned_offset + numel], piece)

    # -- the optimizer's state of the targets ------------------------------------------------

    def state_pieces(self) -> list[SavedPiece]:
        """This rank's shard as a checkpoint saves it: per parameter segment, host copies of its
        fp32 master values and of the optimizer state that covers them (none without an optimizer)."""
        with self.resident():  # the master (and its state) present while their values are copied out
            return self._state_pieces(self.optimizer)

    def _state_pieces(self, optimizer: torch.optim.Optimizer | None) -> list[SavedPiece]:
        unit, pieces = self.unit, []
        for segment in unit.layout.segments(unit.rank):
            name, start, numel = unit.names[segment.param_index], segment.param_offset, segment.numel
            master = self.master_of_shard[segment.shard_offset : segment.shard_offset + numel]
            saved = {}
            for target in self.targets:  # the optimizer tensor holding element `start`
                holds_start = target.param_offset <= start < target.param_offset + target.tensor.numel()
                if optimizer is not None and target.name == name and holds_start:
                    saved = _slice_state(optimizer.state.get(target.tensor, {}), target, start, numel)
            global_start = unit.global_start(segment.param_index, start)  # where the piece lies in the whole parameter
            pieces.append(saved_piece(name, global_start, numel, saved_copy(master), saved))
        return pieces

    def load_state(self, saved: SavedPieces, fitting: set[str]) -> None:
        """The optimizer state of every target whose parameter is in ``fitting``, assembled from
        ``saved`` (pieces of any layout: another stage, world size, or DeepSpeed's); placed where
        the master's kind keeps it (`resident`: on NVMe, written out with the master)."""
        assert self.optimizer is not None, "bind_optimizer first"
        with self.resident():
            self._load_state(self.optimizer, saved, fitting)

    def _load_state(self, optimizer: torch.optim.Optimizer, saved: SavedPieces, fitting: set[str]) -> None:
        group_of = {param: group for group in optimizer.param_groups for param in group["params"]}
        for target in self.targets:
            if target.name not in fitting:
                continue
            numel = target.tensor.numel()
            start = self.unit.global_start(target.piece.param_index, target.param_offset)  # in the whole parameter
            pieces = saved.covering(target.name, start, numel)
            restored: dict[str, Any] = {}
            for key in {key for piece in pieces for key in piece["state"]}:
                sample = next(p["state"][key] for p in pieces if key in p["state"])
                if _is_elementwise(pieces, key):
                    values = saved.assemble(target.name, start, numel, key)
                    assert values is not None
                    restored[key] = values.view(target.tensor.shape).to(target.tensor.device)
                elif torch.is_tensor(sample):  # a scalar (step), or saved whole (stage 0 only)
                    restored[key] = sample.clone().to(state_device(key, group_of[target.tensor], target.tensor))
                else:
                    restored[key] = sample
            if restored:
                optimizer.state[target.tensor] = restored

    def state_bytes(self) -> int:
        """The optimizer state's tensors of the targets, as held now (a tensor whose values wait
        on NVMe holds no memory)."""
        if self.optimizer is None:
            return 0
        states = [self.optimizer.state.get(target.tensor, {}) for target in self.targets]
        return sum(
            min(tensor_bytes(value), value.untyped_storage().nbytes())
            for state in states for value in state.values() if torch.is_tensor(value)
        )

    @property
    def nvme_bytes(self) -> int:
        """The master's, its optimizer state's and the step gradient's bytes in a swap file
        (offload to NVMe)."""
        return self.master_kind.nvme_bytes + self.grad.nvme_bytes

    # -- the step gradient (its kind: `zero_engine.sharding.tiers.placement`) -----------------------

    @property
    def grad_bytes(self) -> int:
        return self.grad.nbytes

    def ensure_grad(self) -> torch.Tensor:
        """The step gradient (zeros where nothing wrote it; a released one is made)."""
        return self.grad.value()

    def add_reduced(self, reduced: torch.Tensor, scale: float) -> None:
        """Add ``scale * reduced`` (this range, summed over ranks) into the step gradient."""
        self.grad.add(reduced, scale)

    def take_reduced(self, averaged: torch.Tensor) -> None:
        """The averaged gradient of the range, reduced outside the gradient (through a copy in
        another dtype, or on the device while the gradient is on the host) or in place."""
        self.grad.replace(averaged)

    def move_grad_into(self, destination: torch.Tensor) -> None:
        """Add the gradient accumulated so far into ``destination`` and zero it (hybrid
        sharding carries the window's gradient across groups once)."""
        self.grad.move_into(destination)

    def clear_grad(self) -> None:
        """After a step: release the gradient (stage 3) or zero it for the next window (a host
        gradient is overwritten by the window's first copy instead)."""
        self.grad.clear()

    # -- the update --------------------------------------------------------------------------

    def attach_grads(self, used: Sequence[bool], multiplier: float) -> tuple[list[OptimizerTarget], int]:
        """Give every target whose parameter some rank used its gradient (fp32, unscaled and
        clipped by ``multiplier``); returns those targets and the bytes of the fp32 copy made
        of a low-precision gradient (0 when the gradient is fp32 already)."""
        kept = self.ensure_grad()
        grad = kept if kept.dtype == torch.float32 else kept.float()
        if multiplier != 1.0:
            grad.mul_(multiplier)
        views = self._grad_views(grad, cache=grad is kept and self.grad.persistent)
        attached = []
        for target, view in zip(self.targets, views):
            if used[target.piece.param_index]:
                target.tensor.grad = view
                attached.append(target)
        return attached, 0 if grad is kept else tensor_bytes(grad)

    def _grad_views(self, grad: torch.Tensor, cache: bool) -> list[torch.Tensor]:
        """Each target's gradient, a view into ``grad``; kept from step to step while ``grad``
        is the same persistent tensor (two tensor ops per parameter saved per step)."""
        if cache and self._cached_views is not None and self._cached_views[0] is grad:
            return self._cached_views[1]
        pieces = [target.piece for target in self.targets]
        views = [grad[p.owned_offset : p.owned_offset + p.numel].view(p.shape) for p in pieces]
        if cache:
            self._cached_views = (grad, views)
        return views

    def publish(self) -> None:
        """The updated fp32 master into the compute copy (`Master.publish`)."""
        self.master_kind.publish()


def step_shards(
    optimizer: torch.optim.Optimizer,
    shards: Sequence[OptimizerShard],
    used: Sequence[bool],
    multiplier: float,
    swap_failed: Callable[[], bool] = lambda: False,
    windowed: bool = False,
) -> tuple[int, int]:
    """Step ``optimizer`` on every shard's fp32 gradient (``used``: per parameter, in unit
    order, offsets from each unit's ``used_offset``); a parameter no rank used keeps its values
    and its state. The optimizer steps once per shard, so a low-precision gradient's fp32 copy
    and a foreach optimizer's temporaries exist for one shard at a time; torch optimizers update
    each tensor on its own, so the result is the same. A unit with whole-matrix parameters
    then finishes them through its matrix exchange (every rank, every such unit, in order: the
    exchange is collective). The next shard's master and gradient are asked in while one steps
    (on NVMe: read ahead). Each shard is published as soon as it stepped: offloaded, its copy to the device
    (asynchronous from pinned memory) then runs while the host steps the next shard. An
    `OSError` for which ``swap_failed()`` holds (an NVMe swap file's) ends this rank's stepping
    but not its part in the exchanges left (`MatrixExchange.stand_in`), then is raised: the
    caller's agreement then raises on every rank. ``windowed`` (no swap files: a master stays
    in memory after its step): the units of a window of matrix exchanges
    (`compute_layout.plan_windows`) finish together after the window's last one stepped, then
    publish. Returns the most fp32 copy bytes alive at once, and the most bytes a matrix
    exchange's buffers held at once (`compute_layout.finish_window`)."""
    peak = matrix_peak = 0
    window: list[tuple[OptimizerShard, Sequence[bool]]] = []
    if shards:
        shards[0].grad.prefetch()
    for index, shard in enumerate(shards):
        unit_used = used[shard.unit.used_offset : shard.unit.used_offset + len(shard.unit.names)]
        exchanged = False
        try:
            with shard.resident():
                if index + 1 < len(shards):  # the next shard's master (and gradient) read ahead while this one steps
                    shards[index + 1].master_kind.prefetch()
                    shards[index + 1].grad.prefetch()
                attached, copy_bytes = shard.attach_grads(unit_used, multiplier)
                peak = max(peak, copy_bytes)
                if attached:
                    optimizer.step()
                for target in attached:
                    target.tensor.grad = None
                shard.grad.stepped()
                if shard.matrices is not None and windowed:
                    window.append((shard, unit_used))
                    if shard.matrices.closes_window or index + 1 == len(shards):
                        matrix_peak = max(matrix_peak, _finish_window(optimizer, window))
                    continue
                if shard.matrices is not None:
                    exchanged = True
                    matrix_peak = max(matrix_peak, shard.matrices.finish(optimizer, shard.targets, unit_used))
                shard.publish()
        except OSError:
            if not swap_failed():
                raise
            _stand_in(shards[index:] if not exchanged else shards[index + 1 :], used)
            raise
    return peak, matrix_peak


def _finish_window(optimizer: Any, window: list[tuple[OptimizerShard, Sequence[bool]]]) -> int:
    """A window's whole-matrix part, then its units published; the window emptied. Returns the
    exchange's peak bytes."""
    peak = finish_window(optimizer, [(shard.matrices, shard.targets, unit_used) for shard, unit_used in window])
    for shard, _ in window:
        shard.publish()
    window.clear()
    return peak


def _stand_in(shards: Sequence[OptimizerShard], used: Sequence[bool]) -> None:
    """This rank's part in the matrix exchanges of ``shards`` without stepping them."""
    for shard in shards:
        if shard.matrices is not None:
            shard.matrices.stand_in(used[shard.unit.used_offset : shard.unit.used_offset + len(shard.unit.names)])


def _slice_state(state: dict[str, Any], target: OptimizerTarget, start: int, numel: int) -> dict[str, Any]:
    """The part of one optimizer tensor's state that covers ``[start, start + numel)``."""
    sliced = {}
    offset = start - target.param_offset
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape == target.tensor.shape:
            sliced[key] = saved_copy(value.reshape(-1)[offset : offset + numel])
        elif torch.is_tensor(value) and value.dim() > 0:
            if start == target.param_offset:  # not elementwise (stage 0 only): saved whole, once
                sliced[key] = saved_copy(value)
        else:
            sliced[key] = saved_copy(value) if torch.is_tensor(value) else value
    return sliced


def state_device(key: str, group: dict[str, Any], param: torch.Tensor) -> torch.device:
    """Where torch.optim keeps a non-elementwise state tensor, as its ``load_state_dict`` does:
    ``step`` on the host unless the group is ``capturable`` or ``fused`` (a step on the GPU
    would make every later update wait for the device), everything else beside the parameter."""
    if key == "step" and not (group.get("capturable") or group.get("fused")):
        return torch.device("cpu")
    return param.device


def _is_elementwise(pieces: list[SavedPiece], key: str) -> bool:
    """Saved as slices of the pieces' ranges (rather than a scalar or a whole tensor)."""
    values = [(p["state"][key], p["numel"]) for p in pieces if key in p["state"]]
    return all(torch.is_tensor(v) and v.dim() == 1 and v.numel() == numel for v, numel in values)
