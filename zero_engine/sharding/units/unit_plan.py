"""Every unit a stage builds, planned once before any is built: which parameters each holds, in
which order, of which param group, and what kind of unit holds them.

Three kinds: at stage 3, a *sharded* unit per unit module (its trainable parameters) and a
*frozen* unit per unit module, stored dtype and encoding (exact, or int8 under
``zero_quantized_nontrainable_weights``: `zero_engine.sharding.units.quantized_frozen`); everywhere
else, *whole*-parameter units of at most ``reduce_bucket_size`` elements per param group (stages
0-2, and stage 3's resident parameters, below ``stage3_param_persistence_threshold``). The plan is
made from the module plan (`zero_engine.sharding.units.module_plan`, stage 3's unit modules) and the
param groups, allocates nothing, and is what `build_units` builds and what
`planned_host_buffers` sizes the host buffers of before anything is allocated: one reading of
the model, not two that must agree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import nn

from ...param_groups import ParamGroup
from .frozen_unit import frozen_dtype
from .quantized_frozen import NO_QUANTIZATION, FrozenQuantization
from ..shards.layout import plan_units
from .module_plan import ModulePlan, ModuleUnitPlan, frozen_params
from .param_placement import ComputeLayout, Placement


class UnitKind(Enum):
    WHOLE = "whole"  # whole parameters, optimizer state sharded or not (stages 0-2, stage 3's resident ones)
    SHARDED = "sharded"  # stage 3: a unit module's trainable parameters, sharded between uses
    FROZEN = "frozen"  # stage 3: a unit module's frozen parameters of one stored dtype


@dataclass(frozen=True)
class PlannedParam:
    """One parameter's place in its unit, as FSDP2's ``FSDPParam`` declares it: its name, the
    parameter, its optimizer param group (None: frozen), and its placement (global shape, the
    box this rank holds, compute layout; default: whole, elementwise)."""

    name: str
    param: nn.Parameter
    group: int | None
    placement: Placement | None = None

    def __post_init__(self) -> None:
        if self.placement is None:
            object.__setattr__(self, "placement", Placement.whole(self.param.shape))

    @property
    def numel(self) -> int:
        return self.param.numel()


@dataclass
class PlannedUnit:
    """One unit to build: its kind and parameters in order (its offsets follow from them), the
    module path it stands for, a frozen unit's stored dtype and whether it is kept in int8, the
    unit module's plan (stage 3)."""

    kind: UnitKind
    params: list[PlannedParam]
    label: str = ""
    dtype: torch.dtype | None = None
    module: ModuleUnitPlan | None = None
    quantized: bool = False
    replicated: bool = False  # an int8 frozen unit kept whole on every rank (frozen_weights: replicate)

    @property
    def names(self) -> list[str]:
        return [planned.name for planned in self.params]

    @property
    def tensors(self) -> list[nn.Parameter]:
        return [planned.param for planned in self.params]

    @property
    def group_indices(self) -> list[int]:
        return [planned.group if planned.group is not None else -1 for planned in self.params]

    @property
    def placements(self) -> list[Placement]:
        return [planned.placement for planned in self.params]  # type: ignore[misc]

    @property
    def numel(self) -> int:
        return sum(planned.numel for planned in self.params)

    @property
    def cut_axes(self) -> tuple[str, ...]:
        """The mesh axes this unit's parameters are cut along (none: whole on every rank); one
        unit's parameters are all cut alike (`_by_cut`), so one set of ranks shards it."""
        return _cut_axes(self.params[0]) if self.params else ()


def _cut_axes(planned: PlannedParam) -> tuple[str, ...]:
    return tuple(cut.axis for cut in planned.placement.sharded)  # type: ignore[union-attr]


def _by_cut(params: Sequence[PlannedParam]) -> list[list[PlannedParam]]:
    """``params`` in groups cut alike (whole ones first), each in its order."""
    groups: dict[tuple[str, ...], list[PlannedParam]] = {}
    for planned in params:
        groups.setdefault(_cut_axes(planned), []).append(planned)
    return [groups[key] for key in sorted(groups, key=len)]


@dataclass
class UnitPlan:
    """The units of one engine, by kind, in the order they are built."""

    modules: ModulePlan  # stage 3's unit modules (hooks, recomputed and compiled forwards)
    sharded: list[PlannedUnit] = field(default_factory=list)
    frozen: list[PlannedUnit] = field(default_factory=list)
    whole: list[PlannedUnit] = field(default_factory=list)

    @classmethod
    def derive(
        cls,
        model: nn.Module,
        modules: ModulePlan,
        groups: Sequence[ParamGroup],
        shard_parameters: bool,
        compute_dtype: torch.dtype,
        bucket_numel: int,
        quantization: FrozenQuantization = NO_QUANTIZATION,
        compute_layout: Callable[[str, nn.Parameter], ComputeLayout] | None = None,
        placement_of: Callable[[nn.Parameter], Placement | None] | None = None,
    ) -> UnitPlan:
        """The plan of a stage that shards parameters (stage 3) or does not; ``quantization``
        says which frozen parameters stage 3 keeps in int8, ``compute_layout`` how the optimizer
        computes on each trainable parameter (None: elementwise on every one), ``placement_of``
        where a parameter a transform cut lies (None: whole on every rank). Parameters cut
        along an axis go in units of their own, sharded over the ranks that hold the same part."""
        position = {param: index for index, param in enumerate(model.parameters())}
        if placement_of is not None:
            _refuse_cut_frozen(model, placement_of)

        def trainable(name: str, param: nn.Parameter, group: int) -> PlannedParam:
            layout = compute_layout(name, param) if compute_layout is not None else ComputeLayout.ELEMENTWISE
            cut = placement_of(param) if placement_of is not None else None
            if cut is not None:
                return PlannedParam(name, param, group, _cut_placement(name, cut, layout))
            return PlannedParam(name, param, group, Placement.whole(param.shape, layout))

        if not shard_parameters:
            per_group = [
                [trainable(name, param, index) for name, param in zip(group.names, group.params)]
                for index, group in enumerate(groups)
            ]
            return cls(modules, whole=_whole_units(per_group, position, bucket_numel))
        sharded = [
            PlannedUnit(UnitKind.SHARDED, params, unit.label + (f" [{', '.join(_cut_axes(params[0]))}]"
                                                                if _cut_axes(params[0]) else ""), module=unit)
            for unit in modules.units
            if unit.params
            for params in _by_cut(
                [trainable(n, p, g) for n, p, g in zip(unit.names, unit.params, unit.group_indices)]
            )
        ]
        quantization.check_patterns(list(frozen_params(model).values()))
        frozen = [
            planned for unit in modules.units for planned in _frozen_units(unit, compute_dtype, quantization)
        ]
        per_group: list[list[PlannedParam]] = [[] for _ in groups]
        for item in modules.resident:
            per_group[item.group_index].append(trainable(item.name, item.param, item.group_index))
        return cls(modules, sharded, frozen, _whole_units(per_group, position, bucket_numel))


def _frozen_units(
    unit: ModuleUnitPlan, compute_dtype: torch.dtype, quantization: FrozenQuantization
) -> list[PlannedUnit]:
    """A unit module's frozen parameters, one unit per dtype they are stored in (each gathers in
    it: the compute dtype under mixed precision, see `cast_frozen`, else the parameter's own) and
    per encoding (int8 or exact: norms and biases stay exact beside int8 matrices), in
    registration order within each."""
    by_kind: dict[tuple[torch.dtype, bool], list[PlannedParam]] = {}
    for name, param in zip(unit.frozen_names, unit.frozen_params):
        kind = (frozen_dtype(param, compute_dtype), quantization.applies(name, param))
        by_kind.setdefault(kind, []).append(PlannedParam(name, param, None))
    dtypes = {dtype for dtype, _ in by_kind}
    return [
        PlannedUnit(
            UnitKind.FROZEN, params,
            f"{unit.label if len(dtypes) == 1 else f'{unit.label} ({dtype})'} [frozen{' int8' if quantized else ''}]",
            dtype=dtype, module=unit, quantized=quantized, replicated=quantized and quantization.replicated,
        )
        for (dtype, quantized), params in by_kind.items()
    ]


def _whole_units(
    per_group: Sequence[Sequence[PlannedParam]], position: dict[nn.Parameter, int], bucket_numel: int
) -> list[PlannedUnit]:
    """Whole-parameter units of at most ``bucket_numel`` elements, per param group, each group's
    parameters in reverse model order (the order their gradients arrive in)."""
    units = []
    for planned in per_group:
        for alike in _by_cut(planned):
            ordered = sorted(alike, key=lambda item: position[item.param], reverse=True)
            for indices in plan_units([item.numel for item in ordered], bucket_numel):
                units.append(PlannedUnit(UnitKind.WHOLE, [ordered[i] for i in indices]))
    return units


def _refuse_cut_frozen(model: nn.Module, placement_of: Callable[[nn.Parameter], Placement | None]) -> None:
    """A frozen parameter cut along an axis (a frozen expert: a PEFT base) is not built yet:
    refused by name."""
    for name, param in model.named_parameters():
        if not param.requires_grad and placement_of(param) is not None:
            raise NotImplementedError(
                f"{name} is frozen and cut along {[c.axis for c in placement_of(param).sharded]} (expert "
                "parallelism): frozen experts owned per rank are not built; train them, or leave "
                "expert_parallel_size at 1"
            )


def _cut_placement(name: str, cut: Placement, layout: ComputeLayout) -> Placement:
    """A cut parameter's placement with the optimizer's compute layout, or a clear refusal
    where the optimizer computes on whole matrices."""
    if layout is ComputeLayout.WHOLE_MATRIX:
        raise NotImplementedError(
            f"{name} is cut along {[c.axis for c in cut.sharded]} (expert parallelism), and the optimizer computes "
            "on it as a whole matrix (Muon): give the experts to the elementwise optimizer (Muon's adam param "
            "group) or leave expert_parallel_size at 1"
        )
    return Placement(cut.global_shape, cut.box, cut.sharded, layout)
