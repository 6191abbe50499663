"""The model's values as state dicts, wherever the stage keeps them.

Trainable parameters live in units (`zero_engine.sharding.units.unit`): whole or sharded, with their
fp32 masters in each unit's `OptimizerShard`. At stage 3 frozen parameters live in frozen units
(`zero_engine.sharding.units.frozen_unit`), sharded in their own dtype. Everything else of
``module.state_dict()`` (frozen parameters below stage 3 or replicated, parameters left out of
every param group, buffers) is *loose*: whole on every rank, kept as the module holds it.

Frozen weights are never copied to fp32: under mixed precision they are rounded to the compute
dtype once, in place (`cast_frozen`), as DeepSpeed's ``module.bfloat16()`` does; a bf16 base
under ``bf16`` is left as it is. Loose *trainable* parameters (left out of ``param_groups``)
compute in the compute dtype too, and their fp32 values are kept here for state dicts.

`ModelState` is what the engine, checkpoints and pretrained weights share: the full state dict
(gathered unit by unit), the loose entries, and loading values into what each rank keeps. It
saves and loads its own part of a checkpoint (`state_pieces`, `saved_params`, `load_state`), as
the optimizer step saves and loads its own (`zero_engine.step.OptimizerStep`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ..comm import Comm
from ..devices import saved_copy
from ..sharding.units.frozen_unit import FrozenUnit, frozen_dtype
from ..sharding.optimizer_side.optimizer_shard import SavedPiece, saved_piece
from ..sharding.units.unit import FlatUnit

# Values of elements [start, start + numel) of a unit's parameter ``index``, or None to leave it.
ValuesFor = Callable[[FlatUnit, int, int, int], "torch.Tensor | None"]


class SavedValues(Protocol):
    """A checkpoint's pieces, indexed (`zero_engine.state.payload.PieceIndex`)."""

    def assemble(self, name: str, start: int, numel: int, key: str | None = None) -> torch.Tensor | None: ...


class ModelState:
    """The module, its units and its loose entries, read and written by name."""

    def __init__(
        self,
        module: nn.Module,
        units: Sequence[FlatUnit],
        comm: Comm,
        compute_dtype: torch.dtype,
        frozen_units: Sequence[FrozenUnit] = (),
    ) -> None:
        self.module = module
        self.units = list(units)  # the trainable units
        self.frozen_units = list(frozen_units)
        self.comm = comm
        in_units = {param for unit in self.all_units for param in unit.params}
        # Parameters outside every unit: frozen ones below stage 3, and any left out of param_groups.
        self.loose_params = [param for param in module.parameters() if param not in in_units]
        self.loose_masters = _cast_loose_params([p for p in self.loose_params if p.requires_grad], compute_dtype)

    @property
    def all_units(self) -> list[FlatUnit | FrozenUnit]:
        """Trainable and frozen units: everything held in units."""
        return [*self.units, *self.frozen_units]

    # -- reading -----------------------------------------------------------------------------

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The complete module state on CPU, same keys as ``state_dict()`` (tied parameters'
        names share one tensor, as there), parameters as their fp32 masters. Collective when
        masters are sharded; with ``rank0_only`` gathered onto rank 0 alone, one unit at a time
        (other ranks get an empty dict)."""
        keep = not rank0_only or self.comm.rank == 0
        # One CPU fp32 copy per parameter, made once: a unit's straight from its full master.
        copies: dict[nn.Parameter, torch.Tensor] = {}
        for unit in self.all_units:
            if unit.is_cut:  # parts on several ranks: every rank takes part in gathering each whole
                for index, param in enumerate(unit.params):
                    whole = self.whole_value(unit, index)
                    if keep:
                        copies[param] = whole.to("cpu", torch.float32, copy=True)
                continue
            full = self.full_master(unit, rank0_only)
            if keep:
                for index, param in enumerate(unit.params):
                    copies[param] = unit.view_of(full, index).to("cpu", torch.float32, copy=True)
        if not keep:
            return {}
        by_name = dict(self.module.named_parameters(remove_duplicate=False))
        state = {}
        for name, tensor in self.module.state_dict().items():
            if name not in by_name:
                state[name] = tensor.detach().to("cpu", copy=True)
                continue
            param = by_name[name]
            if param not in copies:  # outside every unit: a frozen parameter, as its fp32 value
                copies[param] = self.loose_masters.get(param, tensor).detach().to("cpu", torch.float32, copy=True)
            state[name] = copies[param]
        return state

    def full_master(self, unit: FlatUnit | FrozenUnit, rank0_only: bool = False) -> torch.Tensor | None:
        """The unit's fp32 master values over the whole flat buffer (a frozen unit's values, in
        its dtype), on rank 0 alone with ``rank0_only`` when they must be gathered (the other
        ranks get None)."""
        whole = self.whole_master(unit)
        if whole is not None:
            return whole
        return unit.gather_masters(unit.sharded_over(self.comm), onto=0 if rank0_only else None)

    def whole_value(self, unit: FlatUnit | FrozenUnit, index: int) -> torch.Tensor:
        """Parameter ``index`` of ``unit`` whole, on every rank: its fp32 master (a frozen unit's
        values in its dtype), gathered over the ranks of its unit, then, for a parameter cut along
        an axis (an expert's weights, owned per rank), over that axis's group into the whole
        parameter. Collective on every rank."""
        kept = unit.view_of(self.full_master(unit), index)
        placement = unit.placements[index]
        if placement.replicated:
            return kept
        if len(placement.sharded) != 1 or placement.box.offsets[1:] != (0,) * (kept.dim() - 1):
            raise NotImplementedError(f"{unit.names[index]}: only parameters cut along dim 0 of one axis are gathered")
        group = self.comm.group(placement.sharded[0].axis)
        whole = torch.empty(placement.global_shape, dtype=kept.dtype, device=kept.device)
        flat, numel = whole.view(-1), kept.numel()  # equal parts along dim 0, in the group's rank order
        flat[group.rank * numel : (group.rank + 1) * numel] = kept.reshape(-1)
        group.all_gather(flat).wait()
        return whole

    @staticmethod
    def whole_master(unit: FlatUnit | FrozenUnit) -> torch.Tensor | None:
        """The unit's exact values over its whole flat buffer where every rank holds them whole,
        with no collective (None where they are sharded: a frozen unit, or sharded masters); an
        int8 frozen unit kept whole gives its decoded values."""
        shard = unit.optimizer_shard
        if shard is None:
            return unit.shard_values() if unit.replicated else None
        if not unit.shard_master:  # stage 0: the master is the whole unit, never offloaded
            return shard.master
        if shard.master_is_compute_copy and not unit.sharded_params:
            return unit.flat_param  # stages 1-2 in fp32: the whole buffer is up to date
        return None

    def units_in_model_order(self) -> list[FlatUnit | FrozenUnit]:
        """The units by their first parameter's place in ``module.parameters()`` (an empty unit
        last): the order exports and checkpoint manifests list parameters in, so a checkpoint's
        export writes the same shards as the engine's."""
        place = {param: index for index, param in enumerate(self.module.parameters())}
        return sorted(self.all_units, key=lambda unit: min((place[p] for p in unit.params), default=len(place)))

    def loose_state(self, *, with_frozen: bool = True) -> dict[str, torch.Tensor]:
        """State-dict entries outside the units (frozen parameters as they are stored, loose
        trainable ones as their fp32 values, buffers), for checkpoints; ``with_frozen=False``
        leaves frozen parameters out."""
        loose = set(self.loose_params)
        by_name = dict(self.module.named_parameters(remove_duplicate=False))
        state = {}
        for name, tensor in self.module.state_dict().items():
            param = by_name.get(name)
            if param is not None and (param not in loose or not (with_frozen or param.requires_grad)):
                continue
            state[name] = self.loose_masters.get(param, tensor) if param is not None else tensor
        return state

    def frozen_names(self) -> list[str]:
        """Every name of ``module.state_dict()`` that holds a frozen parameter (aliases too)."""
        return [name for name, param in self.module.named_parameters(remove_duplicate=False) if not param.requires_grad]

    def placement(self) -> dict[nn.Parameter, tuple[FlatUnit | FrozenUnit, int]]:
        """Each parameter held in a unit: the unit and its place there."""
        return {param: (unit, index) for unit in self.all_units for index, param in enumerate(unit.params)}

    # -- a checkpoint's part -------------------------------------------------------------------

    def state_pieces(self, *, with_frozen: bool) -> list[SavedPiece]:
        """What this rank saves of the model beside the optimizer's pieces: its frozen units'
        shards, in their own dtype, with no state (the trainable masters are the step's); a unit
        every rank keeps whole (int8, replicated), from rank 0 alone."""
        return [
            saved_piece(unit.names[index], unit.global_start(index, start), numel, saved_copy(values), {})
            for unit in (self.frozen_units if with_frozen else ())
            if not unit.replicated or self.comm.rank == 0
            for index, start, numel, values in unit.shard_pieces()
        ]

    def saved_params(self, *, with_frozen: bool) -> dict[str, dict[str, Any]]:
        """The manifest's record of every parameter held in units, in model order: its shape,
        its aliases (tied names) and whether it is frozen."""
        aliases: dict[int, list[str]] = defaultdict(list)
        for name, param in self.module.named_parameters(remove_duplicate=False):
            aliases[id(param)].append(name)
        return {
            name: {"shape": list(unit.global_shape(index)), "aliases": aliases[id(param)],
                   **({"frozen": True} if unit.frozen else {})}
            for unit in self.units_in_model_order()
            if with_frozen or not unit.frozen
            for index, (name, param) in enumerate(zip(unit.names, unit.params))
        }

    def fitting(self, saved_params: dict[str, dict[str, Any]]) -> set[str]:
        """The unit parameters a checkpoint saved with this engine's shapes."""
        return {
            name for name, shape in self.unit_param_shapes().items()
            if name in saved_params and saved_params[name]["shape"] == shape
        }

    def load_state(
        self, saved: SavedValues, saved_params: dict[str, dict[str, Any]], loose: dict[str, torch.Tensor]
    ) -> None:
        """Restore the model's values from a checkpoint: each rank assembles only the elements
        it keeps, from the saved pieces or (a frozen parameter saved whole, below stage 3 or
        replicated) from the loose entries; loose entries from those, or from pieces (frozen
        parameters saved sharded, resumed where they are whole)."""
        fitting = self.fitting(saved_params)

        def values_for(unit: FlatUnit, param_index: int, start: int, numel: int) -> torch.Tensor | None:
            name, start = unit.names[param_index], unit.global_start(param_index, start)  # in the whole parameter
            if name in fitting:
                return saved.assemble(name, start, numel)
            whole = loose.get(name)
            if whole is not None and list(whole.shape) == list(unit.global_shape(param_index)):
                return whole.reshape(-1)[start : start + numel]
            return None

        self.load_kept(values_for)
        from_pieces = {}
        for name, tensor in self.loose_state().items():
            entry = saved_params.get(name)
            if entry is not None and entry["shape"] == list(tensor.shape):
                values = saved.assemble(name, 0, tensor.numel())
                if values is not None:
                    from_pieces[name] = values.view(tensor.shape)
        self.load_loose_state({**from_pieces, **loose})

    def unit_param_shapes(self) -> dict[str, list[int]]:
        """Shape of every parameter held in units, by its name."""
        return {name: list(unit.global_shape(index)) for unit in self.all_units for index, name in enumerate(unit.names)}

    # -- writing -----------------------------------------------------------------------------

    def load_kept(self, values_for: ValuesFor) -> None:
        """Set what this rank keeps of every unit parameter (its kept range: the whole
        parameter below stage 3, its shard at stage 3) from ``values_for`` (fp32)."""
        with torch.no_grad():
            for unit in self.all_units:
                for index in range(len(unit.params)):
                    kept = unit.kept_range(index)
                    if kept is not None:
                        values = values_for(unit, index, *kept)
                        if values is not None:
                            unit.load_kept(index, values)

    def load_loose_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy loose entries in (those that fit, by name and shape)."""
        by_name = dict(self.module.named_parameters(remove_duplicate=False))
        ours = self.module.state_dict()
        with torch.no_grad():
            for name, value in state.items():
                if name not in ours or ours[name].shape != value.shape:
                    continue
                ours[name].copy_(value)
                master = self.loose_masters.get(by_name.get(name))  # type: ignore[arg-type]
                if master is not None:
                    master.copy_(value)


def cast_frozen(module: nn.Module, compute_dtype: torch.dtype) -> None:
    """Under mixed precision, frozen floating-point parameters are stored in the compute dtype,
    cast once in place and never kept in fp32 (a bf16 base under ``bf16`` is untouched): they
    never update, so their fp32 values would only double what a rank holds. In fp32 they stay
    as they are. Parameters still on the meta device are left: they are initialized in their
    declared dtype first (a frozen unit casts them as it takes them; the engine calls this again
    once the units are built, for those that stay whole)."""
    with torch.no_grad():
        for param in module.parameters():
            if not param.requires_grad and not param.is_meta:
                dtype = frozen_dtype(param, compute_dtype)
                if param.dtype != dtype:
                    param.data = param.data.to(dtype)


def _cast_loose_params(params: Sequence[nn.Parameter], compute_dtype: torch.dtype) -> dict[nn.Parameter, torch.Tensor]:
    """Loose trainable parameters (outside every param group) compute in the compute dtype too;
    their fp32 values are kept (mixed precision only)."""
    if compute_dtype == torch.float32:
        return {}
    masters = {}
    for param in params:
        masters[param] = param.detach().to(torch.float32, copy=True)
        param.data = param.data.to(compute_dtype)
    return masters
