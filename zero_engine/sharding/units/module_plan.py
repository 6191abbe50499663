"""Stage 3: which modules become units, which parameters each unit owns, what each needs.

A *unit module* is the model itself (the root) and every submodule picked by the wrap policy:
its class named in ``stage3_wrap_modules``; without that list, its class named in the model's
``_no_split_modules`` (Hugging Face models declare their blocks there: ``["GPT2Block"]``), as
Accelerate's FSDP plugin and DeepSpeed's leaf-module logic read it; otherwise every module whose
not yet wrapped trainable parameters reach ``min_unit_numel`` elements (bottom-up, like FSDP's
size-based policy). A unit is gathered when its module is called, so a container that is only
iterated (``nn.ModuleList``, ``nn.ModuleDict``: no ``forward`` of their own) is never a unit:
where the size rule reaches one, each of its members that can be called becomes a unit instead
(through nested containers), and a wrap list naming a container class is refused. A unit owns
the trainable parameters registered in its part of the tree (its subtree minus nested unit
modules). A parameter registered twice (tied weights) is owned
by the unit that registers it first, in ``named_parameters`` order, and *used* by every unit
that registers it: an output head tied to the input embedding needs the embedding's unit
gathered while it runs. Parameters below ``persistence_threshold`` elements are not sharded:
they stay resident on every rank (saves many tiny collectives), and are returned apart.

Pure module-tree logic: no tensors are allocated and nothing is communicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn

from ...config import ZeroOptimizationConfig
from ...param_groups import ParamGroup
from .quantized_frozen import FrozenQuantization


@dataclass
class ModuleUnitPlan:
    """One unit module: the sharded parameters it owns and every parameter it uses."""

    path: str  # the module's path in the model, "" for the root
    module: nn.Module
    names: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)
    group_indices: list[int] = field(default_factory=list)
    uses: list[nn.Parameter] = field(default_factory=list)
    frozen_names: list[str] = field(default_factory=list)  # the frozen parameters it shards (`FrozenUnit`)
    frozen_params: list[nn.Parameter] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.path or "<root>"


@dataclass
class ResidentParam:
    name: str
    param: nn.Parameter
    group_index: int


def can_be_called(module: nn.Module) -> bool:
    """Whether ``module`` has a forward of its own (``nn.ModuleList``, ``nn.ModuleDict`` and the
    parameter containers have none: code iterates them and calls their members)."""
    return "forward" in vars(module) or type(module).forward is not nn.Module.forward


def plan_module_units(
    model: nn.Module,
    groups: Sequence[ParamGroup],
    wrap_classes: Sequence[str] | None,
    min_unit_numel: int,
    persistence_threshold: int,
    shard_frozen: bool = True,
    kept_int8: Callable[[str, nn.Parameter], bool] | None = None,
) -> tuple[list[ModuleUnitPlan], list[ResidentParam]]:
    """Unit plans in module order (root first) and the parameters that stay resident.
    ``shard_frozen``: frozen floating-point parameters of at least ``persistence_threshold``
    elements are sharded too, each with the unit module that registers it first. Otherwise
    (``frozen_weights: replicate``) the frozen ones ``kept_int8`` names are in units too, each
    rank keeping them whole in int8 (`zero_engine.sharding.units.quantized_frozen`)."""
    in_group = {
        param: (index, name) for index, group in enumerate(groups) for name, param in zip(group.names, group.params)
    }
    frozen = frozen_params(model) if shard_frozen or kept_int8 else {}
    if not shard_frozen and kept_int8 is not None:
        frozen = {param: name for param, name in frozen.items() if kept_int8(name, param)}
    sharded = {param for param in in_group if param.numel() >= persistence_threshold}
    sharded |= {param for param in frozen if param.numel() >= persistence_threshold or not shard_frozen}
    if wrap_classes:
        unit_modules = _modules_of_classes(model, wrap_classes)
    elif declared := declared_unit_classes(model):
        unit_modules = _modules_of_classes(model, declared)
    else:
        unit_modules = _modules_by_size(model, sharded, min_unit_numel)
    plans: dict[int, ModuleUnitPlan] = {id(model): ModuleUnitPlan("", model)}
    for path, module in model.named_modules():
        if module in unit_modules and id(module) not in plans:
            plans[id(module)] = ModuleUnitPlan(path, module)
    owner: dict[nn.Parameter, ModuleUnitPlan] = {}

    def walk(module: nn.Module, plan: ModuleUnitPlan, stack: tuple[int, ...]) -> None:
        if id(module) in stack:  # a module containing itself: nothing new below
            return
        plan = plans.get(id(module), plan)
        for param in module._parameters.values():
            if param is None:
                continue
            if all(param is not used for used in plan.uses):
                plan.uses.append(param)
            if param in sharded and param not in owner:
                owner[param] = plan
                if param in frozen:
                    plan.frozen_names.append(frozen[param])
                    plan.frozen_params.append(param)
                    continue
                group_index, name = in_group[param]
                plan.names.append(name)
                plan.params.append(param)
                plan.group_indices.append(group_index)
        for child in module._modules.values():
            if child is not None:
                walk(child, plan, stack + (id(module),))

    walk(model, plans[id(model)], ())
    resident = [
        ResidentParam(name, param, group_index)
        for param, (group_index, name) in in_group.items()
        if param not in sharded
    ]
    return list(plans.values()), resident


def frozen_params(model: nn.Module) -> dict[nn.Parameter, str]:
    """The model's frozen floating-point parameters (``requires_grad=False``), each once, by
    its first name: what stage 3 shards beside the trainable ones."""
    found: dict[nn.Parameter, str] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad and param.is_floating_point() and param not in found:
            found[param] = name
    return found


def declared_unit_classes(model: nn.Module) -> list[str]:
    """The block classes a Hugging Face model declares in ``_no_split_modules`` (on the model or
    a wrapped model inside it), those it has; empty for other models."""
    present = {type(module).__name__ for module in model.modules()}
    declared: list[str] = []
    for module in model.modules():
        for name in sorted(getattr(module, "_no_split_modules", None) or ()):  # a set in transformers 5
            if isinstance(name, str) and name in present and name not in declared:
                declared.append(name)
    return declared


def _modules_of_classes(model: nn.Module, wrap_classes: Sequence[str]) -> set[nn.Module]:
    present = {type(module).__name__ for module in model.modules()}
    missing = [name for name in wrap_classes if name not in present]
    if missing:
        raise ValueError(
            f"zero_optimization.stage3_wrap_modules: no module of class {missing} in the model; "
            f"classes present: {sorted(present)}"
        )
    chosen = {module for module in model.modules() if type(module).__name__ in wrap_classes and module is not model}
    containers = {module for module in chosen if not can_be_called(module)}
    if containers:
        names = sorted({type(module).__name__ for module in containers})
        members = sorted({type(child).__name__ for module in containers for child in module.children()})
        raise ValueError(
            f"zero_optimization.stage3_wrap_modules names {names}, which has no forward of its own: code iterates it "
            "and calls its members, so a unit made of it would never be gathered. Name the classes of its members "
            f"instead ({members})"
        )
    return chosen


def _modules_by_size(model: nn.Module, sharded: set[nn.Parameter], min_unit_numel: int) -> set[nn.Module]:
    """Bottom-up: a module whose unwrapped sharded parameters reach the limit becomes a unit; a
    container that cannot be called gives its callable members instead (`can_be_called`)."""
    chosen: set[nn.Module] = set()
    counted: set[nn.Parameter] = set()
    own: dict[nn.Module, int] = {}  # elements of the sharded parameters each module registers itself
    left: dict[nn.Module, int] = {}  # elements of each module's subtree not wrapped yet

    def remaining(module: nn.Module) -> int:
        total = sum(remaining(child) for child in module.children())
        own[module] = 0
        for param in module._parameters.values():
            if param is not None and param in sharded and param not in counted:
                counted.add(param)
                own[module] += param.numel()
        total += own[module]
        left[module] = _wrap(module) if total >= min_unit_numel and module is not model else total
        return left[module]

    def _wrap(module: nn.Module) -> int:
        """Make ``module`` a unit, or, for a container, each member holding unwrapped parameters
        (going into member containers); returns what stays unwrapped (a container's own)."""
        if can_be_called(module):
            chosen.add(module)
            return 0
        return own[module] + sum(_wrap(child) for child in module.children() if left[child])

    remaining(model)
    return chosen


class ModulePlan:
    """The model's unit plan, computed once, when first asked (a wrap list naming a class the
    model lacks fails then, as before: at stage 3, or where recomputation or compilation asks
    for the leaf units), and handed to everything that needs it: `stage: auto`'s largest unit,
    stage 3's units, the modules recomputed and compiled."""

    def __init__(self, model: nn.Module, groups: Sequence[ParamGroup], zero: ZeroOptimizationConfig) -> None:
        self.model = model
        int8 = FrozenQuantization.from_config(zero, shards_parameters=True)  # where units are built: stage 3
        self._args = (
            groups, zero.stage3_wrap_modules, zero.reduce_bucket_size, zero.stage3_param_persistence_threshold,
            zero.frozen_weights == "shard", int8.applies if int8.enabled and int8.replicated else None,
        )
        self._planned: tuple[list[ModuleUnitPlan], list[ResidentParam]] | None = None

    def _plan(self) -> tuple[list[ModuleUnitPlan], list[ResidentParam]]:
        if self._planned is None:
            self._planned = plan_module_units(self.model, *self._args)
        return self._planned

    @property
    def units(self) -> list[ModuleUnitPlan]:
        """Unit plans in module order (root first)."""
        return self._plan()[0]

    @property
    def resident(self) -> list[ResidentParam]:
        """The parameters that stay whole on every rank at stage 3."""
        return self._plan()[1]

    def largest_unit_numel(self) -> int:
        """The parameters of the largest unit stage 3 would gather whole (frozen ones too)."""
        return max((sum(p.numel() for p in [*plan.params, *plan.frozen_params]) for plan in self.units), default=0)

    def leaf_modules(self) -> list[nn.Module]:
        """The unit modules (the root aside) holding no other unit module: what
        ``recompute_units`` recomputes and ``engine.compile()`` compiles, at every stage."""
        modules = [plan.module for plan in self.units if plan.module is not self.model]
        planned = {id(module) for module in modules}
        return [
            module for module in modules
            if not any(id(sub) in planned for sub in module.modules() if sub is not module)
        ]
