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
  shape, and two integer sums over its bits: a changed element always changes the first), so no
  copy of the parameters is kept.
- Every rank then says which parameters it wrote (one small collective), so every rank decides
  the same: with ``modifier_rank=r`` the parameters rank ``r`` wrote are broadcast from it and
  written everywhere the engine keeps them (the gathered values, this rank's shard, the fp32
  master, a loose parameter's fp32 copy; the optimizer state is left as it is), and a write made
  on another rank only is undone from rank ``r``; without a modifier any write raises the same
  error on every rank, after the written parameters are put back from a rank that did not write
  them. An exception inside the context on any rank is raised on every rank, after the same
  exchange (no rank is left waiting in a collective).

The optimizer step writes the shards, so `Engine.step` refuses to step while a context is open.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..comm import Comm
from ..sharding.holds import HoldReason

if TYPE_CHECKING:
    from ..sharding.frozen_unit import FrozenUnit
    from ..sharding.gatherer import NoGather
    from ..sharding.unit import FlatUnit
    from .state_dict import ModelState

_CHUNK = 1 << 20  # elements per fingerprint chunk (an int64 temporary of 8 MiB)
_INTEGER_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], torch.dtype, int, int]:
    """Where ``tensor`` lives and what its bits sum to (plainly and weighted by position): any
    write changes it (a single changed element always changes the plain sum; two sums that a
    write keeps both are as unlikely as a hash collision). Exact and deterministic, unlike float
    sums, and a write of NaN or of -0.0 over 0.0 counts. Summed where the tensor lives, read
    back once per tensor (not once per chunk: each read would wait for a GPU)."""
    flat = tensor.detach().reshape(-1)
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)
    if flat.numel():
        bits = flat.view(_INTEGER_VIEW[flat.element_size()])
        for start in range(0, flat.numel(), _CHUNK):
            chunk = bits[start : start + _CHUNK].to(torch.int64)
            positions = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=chunk.device) % 65521 + 1
            sums[0] += chunk.sum()
            sums[1] += (chunk * positions).sum()
    plain, weighted = sums.tolist()
    return tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, plain, weighted


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
        if modifier_rank is not None and not 0 <= modifier_rank < comm.world_size:
            raise ValueError(
                f"engine.gathered(modifier_rank={modifier_rank}): not a rank of this job (0 to {comm.world_size - 1})"
            )
        self.model_state, self.gatherer, self.comm = model_state, gatherer, comm
        self.modifier_rank = modifier_rank
        self.targets = _targets(model_state, params)
        self._agree = agree  # a call row: a context entered on some ranks only raises on every rank
        self._open = open_contexts  # the engine's open contexts, innermost last (a kept write refreshes theirs)
        self._held: list[int] = []
        self._prints: list[tuple] = []

    @property
    def params(self) -> list[nn.Parameter]:
        return [target.param for target in self.targets]

    def __enter__(self) -> list[nn.Parameter]:
        self._held = _unit_indices(self.gatherer, self.targets)
        self.gatherer.hold(self._held, HoldReason.USER, first=self._agree)  # a prefetched unit is kept, not gathered again
        self._prints = [fingerprint(target.param) for target in self.targets]
        self._open.append(self)
        return self.params

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._open.remove(self)
        try:
            self._settle(failed=error is not None)
        finally:
            self.gatherer.release(self._held, HoldReason.USER)

    def _refresh(self, param: nn.Parameter) -> None:
        """An inner context kept a write into ``param``: it is this context's value from now on."""
        for position, target in enumerate(self.targets):
            if target.param is param:
                self._prints[position] = fingerprint(param)

    # -- exit -------------------------------------------------------------------------------

    def _settle(self, failed: bool) -> None:
        """One exchange says, for every rank, whether it raised, whether a parameter's shape
        changed, and which parameters it wrote; every rank then decides the same."""
        written = [fingerprint(target.param) != before for target, before in zip(self.targets, self._prints)]
        reshaped = [t.name for t in self.targets if list(t.param.shape) != list(_shape(t))]
        rows = self.comm.each_rank([int(failed), int(bool(reshaped)), *map(int, written)]).values()
        failed_ranks = [rank for rank, row in enumerate(rows) if row[0]]
        writers = [[rank for rank, row in enumerate(rows) if row[2 + i]] for i in range(len(self.targets))]
        if failed_ranks:  # the rank that raised re-raises its own error
            if not failed:
                raise RuntimeError(
                    f"engine.gathered(): rank(s) {failed_ranks} raised inside the context (see their error); "
                    "nothing was written back"
                )
            return
        if any(row[1] for row in rows):  # the values could not be broadcast into the engine's storage
            raise ValueError(
                f"engine.gathered(): a parameter's shape changed inside the context ({reshaped or 'on another rank'}): "
                "write new values into it, keeping its shape; nothing was written back"
            )
        if self.modifier_rank is None:
            self._refuse_writes(writers)
            return
        self._write_back(writers, self.modifier_rank)

    def _write_back(self, writers: list[list[int]], source: int) -> None:
        """The parameters ``source`` wrote, broadcast and written everywhere they are kept; those
        only other ranks wrote, put back from ``source``."""
        for target, ranks in zip(self.targets, writers):
            if not ranks:
                continue
            values = _full_values(target)
            self.comm.broadcast([values], src=source)
            if source in ranks:
                _write_everywhere(target, values)
                for outer in self._open:
                    outer._refresh(target.param)
            else:
                _write_compute_copy(target, values)

    def _refuse_writes(self, writers: list[list[int]]) -> None:
        written = [(target, ranks) for target, ranks in zip(self.targets, writers) if ranks]
        if not written:
            return
        unrestored = []
        for target, ranks in written:
            clean = [rank for rank in range(self.comm.world_size) if rank not in ranks]
            if clean:
                values = _full_values(target)
                self.comm.broadcast([values], src=clean[0])
                _write_compute_copy(target, values)
            elif target.unit is None or not target.unit.sharded_params:
                unrestored.append(target.name)
        listed = ", ".join(f"{target.name!r} on rank(s) {ranks}" for target, ranks in written[:6])
        more = f" and {len(written) - 6} more" if len(written) > 6 else ""
        lost = (
            f" Every rank wrote {unrestored}, which below stage 3 are the module's own tensors: those values stay "
            "in the compute copies (and in fp32 masters that are views of them) and cannot be undone here."
            if unrestored else " The parameters are as they were before the context."
        )
        raise RuntimeError(
            f"engine.gathered() without modifier_rank: parameters were written inside the context ({listed}{more}); "
            "a write is kept only with modifier_rank=<the rank whose values to keep> (as DeepSpeed's "
            f"GatheredParameters), so nothing was written back.{lost}"
        )


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
        items = [params] if isinstance(params, (nn.Parameter, str)) else list(params)
        by_name = dict(module.named_parameters(remove_duplicate=False))
        wanted = []
        for item in items:
            if isinstance(item, str):
                if item not in by_name:
                    raise KeyError(f"engine.gathered(): the model has no parameter named {item!r}")
                item = by_name[item]
            if not isinstance(item, nn.Parameter) or item not in names:
                raise ValueError(
                    f"engine.gathered(): {type(item).__name__} is not a parameter of the engine's model (pass its "
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


def _full_values(target: Target) -> torch.Tensor:
    """The parameter's values as this rank holds them now, in a buffer a broadcast may overwrite."""
    return target.param.detach().clone().contiguous()


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
