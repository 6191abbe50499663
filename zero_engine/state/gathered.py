"""``engine.gathered(params, modifier_rank=r)``: named parameters whole on every rank for a while,
and what rank ``r`` wrote into them put back everywhere the engine keeps it.

The tools of fine-tuning and RL reach the full weights at moments the training loop does not
control (PEFT's initializers that rewrite a frozen base, an EMA of a reference model, reading an
output head for a fused loss), as DeepSpeed's ``GatheredParameters`` serves them. Here:

- Entering holds the parameters' units for the user (`ParamGatherer.hold`, reason ``USER``:
  nested and overlapping contexts count, so a unit is resharded by the outermost exit only;
  tied and repeated parameters are one unit hold). Below stage 3 the parameters are whole
  already and nothing is gathered.
- What each rank wrote is found at exit by a fingerprint taken at entry (the tensor's place and
  shape, and three integer sums over its bits: a changed element always changes the first),
  so no copy of the parameters is kept; the sums of every parameter are read back once per
  device, at entry and at exit.
- Every rank then says which parameters it wrote (one small collective), so every rank decides
  the same: with ``modifier_rank=r`` the parameters rank ``r`` wrote are broadcast from it and
  written everywhere the engine keeps them (the gathered values, this rank's shard, the fp32
  master, a loose parameter's fp32 copy; the optimizer state is left as it is), and a write made
  on another rank only is undone from rank ``r``, one broadcast per dtype for all of them.
  Whatever is refused is undone on every rank before the error: without a modifier any write,
  a parameter given a tensor of another shape, and every write when a rank raised inside the
  context (raised on every rank, after the same exchange: no rank is left waiting in a
  collective). Written parameters are put back from a rank that did not write them; one that
  every rank wrote, from rank 0, so the ranks at least agree.

The optimizer step writes the shards, so `Engine.step` refuses to step while a context is open.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..comm import Comm
from ..sharding.gathering.holds import HoldReason

if TYPE_CHECKING:
    from ..sharding.units.frozen_unit import FrozenUnit
    from ..sharding.gathering.gatherer import NoGather
    from ..sharding.units.unit import FlatUnit
    from .state_dict import ModelState

_BLOCK = 4096  # elements per row of the fingerprint's sums (rows and columns sum without a widened copy)
_INTEGER_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Fingerprint = tuple[int, tuple[int, ...], torch.dtype, int, int, int]


def fingerprints(tensors: Sequence[torch.Tensor]) -> list[Fingerprint]:
    """Where each tensor lives and what its bits sum to (`bit_sums`): any write changes it.
    Summed where each tensor lives, and read back once per device for all of them (a read per
    tensor would wait for a GPU once per parameter: GPU review Q4)."""
    sums = [bit_sums(tensor) for tensor in tensors]
    values: list[list[int]] = [[]] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for position, tensor_sums in enumerate(sums):
        by_device.setdefault(tensor_sums.device, []).append(position)
    for positions in by_device.values():
        read = torch.stack([sums[position] for position in positions]).tolist()  # one sync per device
        for position, row in zip(positions, read):
            values[position] = row
    return [
        (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, *row) for tensor, row in zip(tensors, values)
    ]


def bit_sums(tensor: torch.Tensor) -> torch.Tensor:
    """Three integer sums over ``tensor``'s bit patterns, on its device: plain, weighted by row
    and weighted by column of the tensor laid out in rows of `_BLOCK` elements. A changed
    element changes the plain sum; two elements swapped change a weighted one (their rows or
    their columns differ). Exact and deterministic, unlike float sums (integer sums wrap the
    same way everywhere), and a write of NaN or of -0.0 over 0.0 counts. Rows and columns are
    summed in int64 straight from the integer view: a few kernels per tensor, whatever its size."""
    flat = tensor.detach().reshape(-1)
    sums = torch.zeros(3, dtype=torch.int64, device=flat.device)
    if not flat.numel():
        return sums
    bits = flat.view(_INTEGER_VIEW[flat.element_size()])
    rows = bits.numel() // _BLOCK
    if rows:
        matrix = bits[: rows * _BLOCK].view(rows, _BLOCK)
        per_row = matrix.sum(1, dtype=torch.int64)
        per_column = matrix.sum(0, dtype=torch.int64)
        sums[0] += per_row.sum()
        sums[1] += (per_row * torch.arange(1, rows + 1, dtype=torch.int64, device=flat.device)).sum()
        sums[2] += (per_column * torch.arange(1, _BLOCK + 1, dtype=torch.int64, device=flat.device)).sum()
    tail = bits[rows * _BLOCK :]
    if tail.numel():  # a last, shorter row
        tail_sum = tail.sum(dtype=torch.int64)
        sums[0] += tail_sum
        sums[1] += tail_sum * (rows + 1)
        columns = torch.arange(1, tail.numel() + 1, dtype=torch.int64, device=flat.device)
        sums[2] += (tail.to(torch.int64) * columns).sum()
    return sums


@dataclass
class Target:
    """One parameter of the context: where the engine keeps it."""

    name: str
    param: nn.Parameter
    unit: FlatUnit | FrozenUnit | None  # None: a loose parameter, whole on every rank
    index: int  # its place in the unit
    loose_master: torch.Tensor | None = None  # a loose trainable parameter's fp32 values (mixed precision)


class GatheredParameters:
    """The context `Engine.gathered` returns (see the module's docstring)."""

    def __init__(
        self,
        model_state: ModelState,
        gatherer: NoGather,
        comm: Comm,
        params: nn.Parameter | str | Iterable[nn.Parameter | str] | None,
        modifier_rank: int | None,
        agree: Callable[[], None],
        open_contexts: list[GatheredParameters],
    ) -> None:
        if modifier_rank is not None:
            if isinstance(modifier_rank, bool) or not isinstance(modifier_rank, numbers.Integral):
                raise TypeError(
                    f"engine.gathered(modifier_rank={modifier_rank!r}): the rank whose writes to keep, an int "
                    f"(0 to {comm.mesh.world - 1}) or None, not {type(modifier_rank).__name__}"
                )
            modifier_rank = int(modifier_rank)
            if not 0 <= modifier_rank < comm.mesh.world:
                raise ValueError(
                    f"engine.gathered(modifier_rank={modifier_rank}): not a rank of this job "
                    f"(0 to {comm.mesh.world - 1})"
                )
        self.model_state, self.gatherer, self.comm = model_state, gatherer, comm
        self.modifier_rank = modifier_rank
        self.targets = _targets(model_state, params)
        self._agree = agree  # a call row: a context entered on some ranks only raises on every rank
        self._open = open_contexts  # the engine's open contexts, innermost last (a kept write refreshes theirs)
        self._held: list[int] = []
        self._prints: list[Fingerprint] = []
        self._entered: list[torch.Tensor] = []  # each parameter's tensor at entry (a replaced .data is put back)

    @property
    def params(self) -> list[nn.Parameter]:
        return [target.param for target in self.targets]

    def __enter__(self) -> list[nn.Parameter]:
        self._held = _unit_indices(self.gatherer, self.targets)
        self.gatherer.hold(self._held, HoldReason.USER, first=self._agree)  # a prefetched unit is kept, not gathered again
        self._entered = [target.param.data for target in self.targets]
        self._prints = fingerprints(self.params)
        self._open.append(self)
        return self.params

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._open.remove(self)
        try:
            self._settle(failed=error is not None)
        finally:
            self._entered = []
            self.gatherer.release(self._held, HoldReason.USER)

    def _refresh(self, param: nn.Parameter) -> None:
        """An inner context kept a write into ``param``: it is this context's value from now on."""
        for position, target in enumerate(self.targets):
            if target.param is param:
                self._prints[position] = fingerprints([param])[0]

    # -- exit -------------------------------------------------------------------------------

    def _settle(self, failed: bool) -> None:
        """One exchange says, for every rank, whether it raised, whether a parameter's shape
        changed, and which parameters it wrote; every rank then decides the same. Whatever is
        refused is undone on every rank before it raises: a parameter given another tensor
        points at the engine's again, and what was written is put back (`_put_back`)."""
        written = [now != before for now, before in zip(fingerprints(self.params), self._prints)]
        reshaped = [t.name for t in self.targets if list(t.param.shape) != list(_shape(t))]
        self._restore_replaced()
        rows = self.comm.each_rank([int(failed), int(bool(reshaped)), *map(int, written)]).values()
        failed_ranks = [rank for rank, row in enumerate(rows) if row[0]]
        writers = [[rank for rank, row in enumerate(rows) if row[2 + i]] for i in range(len(self.targets))]
        if failed_ranks:  # the rank that raised re-raises its own error
            lost = self._put_back(writers)
            if not failed:
                raise RuntimeError(
                    f"engine.gathered(): rank(s) {failed_ranks} raised inside the context (see their error); "
                    f"nothing was written back.{lost}"
                )
            return
        if any(row[1] for row in rows):  # the values could not be broadcast into the engine's storage
            lost = self._put_back(writers)
            raise ValueError(
                f"engine.gathered(): a parameter's shape changed inside the context ({reshaped or 'on another rank'}): "
                f"write new values into it, keeping its shape; nothing was written back.{lost}"
            )
        if self.modifier_rank is None:
            self._refuse_writes(writers)
            return
        self._write_back(writers, self.modifier_rank)

    def _restore_replaced(self) -> None:
        """A parameter whose ``.data`` was replaced by another shape's tensor points at the
        tensor it had at entry again (the engine's storage), on this rank."""
        for target, entered in zip(self.targets, self._entered):
            if target.param.shape != entered.shape:
                target.param.data = entered

    def _write_back(self, writers: list[list[int]], source: int) -> None:
        """The parameters ``source`` wrote, broadcast and written everywhere they are kept; those
        only other ranks wrote, put back from ``source`` (one broadcast per dtype for all)."""
        written = [(target, ranks) for target, ranks in zip(self.targets, writers) if ranks]
        values = _broadcast_values([target for target, _ in written], self.comm, source)
        for (target, ranks), value in zip(written, values):
            if source in ranks:
                _write_everywhere(target, value)
                for outer in self._open:
                    outer._refresh(target.param)
            else:
                _write_compute_copy(target, value)

    def _put_back(self, writers: list[list[int]]) -> str:
        """Every written parameter as it was, on every rank: from the first rank that did not
        write it; one every rank wrote, from rank 0, so the ranks at least agree (below stage 3
        it is the module's own tensor: the old values are gone; at stage 3 the shards were never
        written). Returns what the error adds about those."""
        by_source: dict[int, list[Target]] = {}
        everywhere = []
        for target, ranks in zip(self.targets, writers):
            if not ranks:
                continue
            clean = [rank for rank in range(self.comm.mesh.world) if rank not in ranks]
            by_source.setdefault(clean[0] if clean else 0, []).append(target)
            if not clean and (target.unit is None or not target.unit.sharded_params):
                everywhere.append(target.name)
        for source, targets in sorted(by_source.items()):
            for target, value in zip(targets, _broadcast_values(targets, self.comm, source)):
                _write_compute_copy(target, value)
        if not everywhere:
            return " The parameters are as they were before the context."
        return (
            f" Every rank wrote {everywhere}, which below stage 3 are the module's own tensors: their values before "
            "the context are gone, so rank 0's were put on every rank (the ranks agree; fp32 masters that are views "
            "of them hold them too). Other parameters are as they were."
        )

    def _refuse_writes(self, writers: list[list[int]]) -> None:
        written = [(target, ranks) for target, ranks in zip(self.targets, writers) if ranks]
        if not written:
            return
        lost = self._put_back(writers)
        listed = ", ".join(f"{target.name!r} on rank(s) {ranks}" for target, ranks in written[:6])
        more = f" and {len(written) - 6} more" if len(written) > 6 else ""
        raise RuntimeError(
            f"engine.gathered() without modifier_rank: parameters were written inside the context ({listed}{more}); "
            "a write is kept only with modifier_rank=<the rank whose values to keep> (as DeepSpeed's "
            f"GatheredParameters), so nothing was written back.{lost}"
        )


def _broadcast_values(targets: Sequence[Target], comm: Comm, source: int) -> list[torch.Tensor]:
    """The targets' values as rank ``source`` holds them, each in a tensor of its own (views
    of one buffer per dtype and device: one broadcast each, not one per parameter)."""
    values: list[torch.Tensor | None] = [None] * len(targets)
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for position, target in enumerate(targets):
        groups.setdefault((target.param.dtype, target.param.device), []).append(position)
    for positions in groups.values():
        packed = torch.cat([targets[position].param.detach().reshape(-1) for position in positions])
        comm.broadcast([packed], src=source)
        pieces = packed.split([targets[position].param.numel() for position in positions])
        for position, piece in zip(positions, pieces):
            values[position] = piece.view(targets[position].param.shape)
    return values  # type: ignore[return-value]


def _targets(model_state: ModelState, params: nn.Parameter | str | Iterable | None) -> list[Target]:
    """The named parameters, once each (a tied or repeated parameter is one target), in the
    module's order; names are the module's parameter names."""
    module = model_state.module
    names = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(param, name)
    if params is None:
        wanted: Sequence = list(names)
    else:
        by_name = dict(module.named_parameters(remove_duplicate=False))
        wanted = []
        for item in _items(params):
            if isinstance(item, str):
                if item not in by_name:
                    raise KeyError(f"engine.gathered(): the model has no parameter named {item!r}")
                item = by_name[item]
            if not isinstance(item, nn.Parameter) or item not in names:
                raise ValueError(
                    f"engine.gathered(): {_described(item)} is not a parameter of the engine's model (pass its "
                    "parameters or their names)"
                )
            wanted.append(item)
    chosen = set(wanted)
    placed = model_state.placement()
    return [
        Target(name, param, *placed.get(param, (None, 0)), model_state.loose_masters.get(param))
        for param, name in names.items()
        if param in chosen
    ]


def _items(params: object) -> list:
    """The parameters or names ``gathered(params)`` was given, one by one; anything else is
    refused here, before the context exists (a module, a tensor that is not the parameter
    itself: ``p.detach()`` or ``p.data`` is an empty tensor at stage 3, whose rows would be
    taken as the parameters)."""
    if isinstance(params, (nn.Parameter, str)):
        return [params]
    if isinstance(params, nn.Module):
        raise TypeError(
            f"engine.gathered(): given a module ({type(params).__name__}); pass its parameters: "
            "engine.gathered(module.parameters())"
        )
    if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
        raise TypeError(
            f"engine.gathered(): given {_described(params)}; pass a parameter, a parameter's name, or an iterable of "
            "them (a tensor such as p.data or p.detach() is not the parameter: pass p)"
        )
    items = list(params)
    for item in items:
        if isinstance(item, torch.Tensor) and not isinstance(item, nn.Parameter):
            raise TypeError(
                f"engine.gathered(): given {_described(item)} among the parameters; pass the parameter itself (p, not "
                "p.data or p.detach())"
            )
    return items


def _described(item: object) -> str:
    if isinstance(item, torch.Tensor) and not isinstance(item, nn.Parameter):
        return f"a tensor of shape {tuple(item.shape)} that is not a parameter"
    return f"{type(item).__name__} {item!r}" if isinstance(item, (int, float)) else type(item).__name__


def _unit_indices(gatherer: NoGather, targets: Sequence[Target]) -> list[int]:
    """The gatherer's indices of the targets' sharded units, once each."""
    indices = []
    for target in targets:
        if target.unit is not None and target.unit.sharded_params:
            index = gatherer.index_of(target.unit)
            if index is not None and index not in indices:
                indices.append(index)
    return indices


def _shape(target: Target) -> torch.Size:
    return target.unit.shapes[target.index] if target.unit is not None else target.param.shape


def _write_compute_copy(target: Target, values: torch.Tensor) -> None:
    """Put ``values`` into what the module computes with (the gathered values at stage 3), and
    point a parameter whose ``.data`` was replaced back at the engine's storage."""
    with torch.no_grad():
        unit = target.unit
        if unit is None:
            target.param.copy_(values)
            return
        view = unit.param_view(target.index)
        if unit.sharded_params and not unit.has_full_storage:
            return
        if target.param.data_ptr() != view.data_ptr() or target.param.shape != view.shape:
            target.param.data = view
        view.copy_(values)


def _write_everywhere(target: Target, values: torch.Tensor) -> None:
    """The compute copy, and what this rank keeps of the parameter: its shard, its fp32 master
    (or a loose parameter's fp32 copy). The optimizer state is left as it is."""
    _write_compute_copy(target, values)
    with torch.no_grad():
        if target.unit is not None:
            target.unit.write_kept(target.index, values.reshape(-1))
        elif target.loose_master is not None:
            target.loose_master.copy_(values)
