"""The engine's units, as the stage says, listed in expected gradient-arrival order, and the
mechanism around them, built and linked in one place (`build_mechanism`): the gatherer, the
reducer and the call guard.

What units, holding which parameters, is planned before (`zero_engine.sharding.units.unit_plan`):
stages 0-2, buckets of ``reduce_bucket_size`` elements per param group, whole parameters
always present; stage 3, one `ShardedFlatUnit` per unit module and a `FrozenUnit` per unit
module and stored dtype, plus buckets of the small parameters that stay resident, and the
`ParamGatherer` that gathers the sharded units around their modules.

A model on the meta device is materialized here too (`DeferredInit`): at stage 3 each unit's
modules as the unit is made, so only one unit is ever whole; below stage 3 the whole model
first, as those stages keep it whole anyway.

Units are listed in reverse registration order, as backward produces gradients, so the
reducer launches them as they fill.

The builders read `BuildSettings`, derived once from the config by `initialize`
(`BuildSettings.derive`), never the config itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from ...comm import Comm
from ...config import ZeroOptimizationConfig
from ...offload import NO_OFFLOAD, OffloadPlan
from ...quantize import BlockQuantizer
from ...stage import Stage, UnitSpec
from ..gathering.calls import CallGuard, PassCallGuard
from ..shards.codec import Codecs, asked_wire_forms, choose_codecs
from .deferred_init import DeferredInit
from ..gathering.gatherer import NoGather, ParamGatherer
from ..units.lifecycle import Lifecycle
from ..units.frozen_unit import FrozenUnit
from ..units.quantized_frozen import NO_QUANTIZATION, FrozenQuantization, QuantizedFrozenUnit
from ..tiers.held import Holdings
from ..tiers.nvme import nvme_masters, nvme_shards
from ..shards.param_shard import DEVICE_SHARDS, ShardTier
from ..tiers.placement import Placement, place
from ..reduction.bucket_reducer import ShardedGradReducer
from ..reduction.reducer import AllReduceGrads, FullGradReducer, GradReducer, ReduceScatterGrads
from ..units.unit import FlatUnit, ShardedFlatUnit
from ..units.unit_plan import PlannedUnit, UnitPlan


@dataclass(frozen=True)
class BuildSettings:
    """What building the units and the mechanism around them reads: the stage and what the
    config says for it, derived once (`derive`)."""

    stage: Stage
    unit_spec: UnitSpec  # what a unit holds at this stage (`Stage.unit_spec`)
    streams_gradients: bool  # gradients through buckets into the shard every micro-step
    bucket_numel: int  # reduce_bucket_size: a whole-parameter unit's most elements
    prefetch_numel: int  # stage3_prefetch_bucket_size
    max_live_numel: int  # stage3_max_live_parameters
    overlap_comm: bool
    codecs: Codecs  # how gathers and reductions travel (ZeRO++'s quantized ones where asked)
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    offload: OffloadPlan = NO_OFFLOAD
    frozen_quantization: FrozenQuantization = NO_QUANTIZATION  # which frozen weights stage 3 keeps in int8

    @classmethod
    def derive(
        cls,
        zero: ZeroOptimizationConfig,
        stage: Stage,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        offload: OffloadPlan = NO_OFFLOAD,
    ) -> BuildSettings:
        each = zero.reduce_scatter_each_micro_step
        weights, grads = asked_wire_forms(
            zero.weight_wire_format, zero.gradient_wire_format, zero.zero_quantized_weights,
            zero.zero_quantized_gradients, zero.zero_quantized_gradients_bits,
        )
        return cls(
            stage, stage.unit_spec(each), stage.streams_gradients(each), zero.reduce_bucket_size,
            zero.stage3_prefetch_bucket_size, zero.stage3_max_live_parameters, zero.overlap_comm,
            # the wire forms asked for where the stage has them: weights where stage 3 gathers its units
            # for compute (below stage 3 parameters are whole, and DeepSpeed ignores its key too),
            # gradients wherever they are reduce-scattered (stages 1-3; stage 0 all-reduces)
            choose_codecs(
                weights=weights if stage.shard_parameters else "exact",
                grads=grads if stage.shard_optimizer_state else "exact",
            ),
            compute_dtype, reduce_dtype, offload,
            FrozenQuantization.from_config(zero, stage.shard_parameters),
        )


class Mechanism(NamedTuple):
    """What shards a model: its units, what gathers them (stage 3), what reduces their
    gradients, and what catches a collective call made on some ranks only."""

    units: list[FlatUnit]  # the trainable units: reduced, stepped
    frozen_units: list[FrozenUnit]  # stage 3's frozen ones: gathered only
    gatherer: NoGather
    reducer: GradReducer
    calls: CallGuard | PassCallGuard
    codecs: Codecs  # how gathers and reductions travel (quantized or not)
    held: Holdings  # what the tiers opened besides (NVMe's swap spaces): counted, agreed on, closed


def build_mechanism(
    model: nn.Module,
    plan: UnitPlan,
    comm: Comm,
    settings: BuildSettings,
    device: torch.device,
    lifecycle: Lifecycle,
    on_unarmed_grad: Callable[[], None],
    deferred: DeferredInit | None = None,
) -> Mechanism:
    """The units (`build_units`), and the reducer and the call guard linked to the gatherer:
    the reducer tells the gatherer when a unit's gradients are complete and asks it whether it
    may wait for a reduction; the gatherer's rounds report the reducer's launches; the call
    guard reads its rows before the reducer's first launch (stages 0-2) or among the rounds
    (stage 3). ``on_unarmed_grad``: the engine's, for a gradient outside an armed backward."""
    held = Holdings()
    units, frozen_units, gatherer = build_units(model, plan, comm, settings, device, lifecycle, deferred, held)
    calls = PassCallGuard(gatherer) if isinstance(gatherer, ParamGatherer) else CallGuard(comm)
    if isinstance(gatherer, ParamGatherer):  # a held resource's failure (a gather's read), agreed in its rounds
        gatherer.schedule.held = held
    reducer = build_reducer(
        settings, units, comm, lifecycle=lifecycle, on_unit_complete=gatherer.unit_complete,
        on_unarmed_grad=on_unarmed_grad, may_wait_for=gatherer.may_wait_for_reduction,
        before_launch=calls.before_reduction,
    )
    gatherer.attach_reducer(reducer)
    return Mechanism(units, frozen_units, gatherer, reducer, calls, settings.codecs, held)


def build_units(
    model: nn.Module,
    plan: UnitPlan,
    comm: Comm,
    settings: BuildSettings,
    device: torch.device,
    lifecycle: Lifecycle,
    deferred: DeferredInit | None = None,
    held: Holdings | None = None,
) -> tuple[list[FlatUnit], list[FrozenUnit], NoGather]:
    """The planned units: all trainable units in reducer order, stage 3's frozen units, and what
    gathers them (nothing below stage 3). ``settings.offload`` puts sharded state on the host:
    optimizer state in every unit, parameter shards in the stage 3 units, frozen ones included
    (resident parameters stay whole on the device, as DeepSpeed's persistent ones). What the
    tiers open besides (NVMe's swap spaces) is registered in ``held``."""
    held = held if held is not None else Holdings()
    stage, compute_dtype, offload = settings.stage, settings.compute_dtype, settings.offload
    # Where every unit's optimizer side lives, decided once.
    placement = place(
        offload, lambda placed: _opened(nvme_masters(placed, comm.rank, device), held),
        lambda placed: _opened(nvme_shards(placed, comm.rank, device), held),
    )
    position = {param: index for index, param in enumerate(model.parameters())}
    if not stage.shard_parameters:
        if deferred is not None:
            deferred.materialize_all()
            _agree_on_drawn_values(model, [], comm)
        units = [_whole_unit(planned, comm, settings, placement) for planned in plan.whole]
        placement.settle()  # every unit built: what the tiers size by the largest
        return _in_arrival_order(units, position), [], NoGather()
    sharded = [
        _owned_by(ShardedFlatUnit(
            planned.tensors, planned.names, planned.group_indices, owners.shard_rank, owners.num_shards,
            label=planned.label, compute_dtype=compute_dtype, device=device,
            materialize=_materializer(deferred, planned.tensors), placement=placement, codec=settings.codecs.gather,
            placements=planned.placements,
        ), owners, comm)
        for planned in plan.sharded
        for owners in [comm.owners_of(planned.cut_axes)]
    ]
    quantizer = BlockQuantizer(8)  # one for every int8 frozen unit: its decode buffer is shared
    frozen = [
        _frozen_unit(planned, comm, settings, device, deferred, quantizer, placement.shards) for planned in plan.frozen
    ]
    if deferred is not None:  # what no sharded unit took: buffers, small parameters
        deferred.materialize_all()
        _agree_on_drawn_values(model, [*sharded, *frozen], comm)
    gathered: list[ShardedFlatUnit | FrozenUnit] = [*sharded, *frozen]
    index_of = {param: index for index, unit in enumerate(gathered) for param in unit.params}
    hooked = []
    for module in plan.modules.units:
        needs = tuple(sorted({index_of[param] for param in module.uses if param in index_of}))
        if needs:
            hooked.append((module.module, needs))
    gatherer = ParamGatherer(
        model, gathered, hooked, comm, settings.prefetch_numel, settings.max_live_numel, lifecycle
    )
    resident = [_whole_unit(planned, comm, settings, placement) for planned in plan.whole]
    placement.settle()
    return _in_arrival_order([*sharded, *resident], position), frozen, gatherer


def _owned_by(unit: FlatUnit, owners: Comm, comm: Comm) -> FlatUnit:
    """``unit``, sharded over ``owners`` when they are not the engine's ``comm`` (a unit of
    parameters cut along an axis: `Comm.owners_of`)."""
    if owners is not comm:
        unit.comm = owners
    return unit


def _opened(tier: Any, held: Holdings) -> Any:
    """An NVMe tier, its swap space registered as held."""
    held.add(tier.space)
    return tier


def _agree_on_drawn_values(
    model: nn.Module, sharded: Sequence[ShardedFlatUnit | FrozenUnit], comm: Comm
) -> None:
    """After materializing from the meta device: random numbers on a GPU depend on its launch
    grid, so ranks on different GPUs (or MIG slices) draw different values. What every rank
    keeps whole takes rank 0's, as for an eager model; each shard takes its copy's in the first
    shard group (hybrid replicas; nothing to do without them)."""
    in_units = {param for unit in sharded for param in unit.params}
    whole = [tensor.detach() for tensor in (*model.parameters(), *model.buffers()) if tensor not in in_units]
    whole += [unit.param_shard for unit in sharded if unit.replicated]  # int8 frozen units kept whole (on the device)
    sharded = [unit for unit in sharded if not unit.replicated]
    comm.broadcast(whole, src=0)
    if sharded and comm.num_replicas > 1:
        trained = [unit for unit in sharded if unit.optimizer_shard is not None]
        staged = []
        for unit in trained:
            with unit.optimizer_shard.resident() as master:
                staged.append(master.to(unit.device))  # offloaded masters cross on the device
        frozen = [unit for unit in sharded if unit.optimizer_shard is None]
        frozen_staged = [unit.param_shard.to(unit.device) for unit in frozen]
        comm.broadcast_across_groups(staged + frozen_staged)
        for unit, values in zip(trained, staged):
            with unit.optimizer_shard.resident() as master:
                master.copy_(values)
                unit.optimizer_shard.publish()
        for unit, values in zip(frozen, frozen_staged):
            unit.keep(values)


def _frozen_unit(
    planned: PlannedUnit,
    comm: Comm,
    settings: BuildSettings,
    device: torch.device,
    deferred: DeferredInit | None,
    quantizer: BlockQuantizer,
    shard_tier: ShardTier,
) -> FrozenUnit:
    """A stage 3 frozen unit: exact, or kept and gathered in int8 (`QuantizedFrozenUnit`),
    sharded (its shard where ``shard_tier`` keeps the trainable ones) or, with ``frozen_weights:
    replicate``, whole on every rank's device."""
    rank, shards = (0, 1) if planned.replicated else (comm.shard_rank, comm.num_shards)  # whole: a shard of one
    args = (planned.tensors, planned.names, rank, shards)
    kwargs: dict = dict(
        label=planned.label, device=device, dtype=planned.dtype, materialize=_materializer(deferred, planned.tensors),
        shards=DEVICE_SHARDS if planned.replicated else shard_tier,
    )
    if planned.quantized:
        return QuantizedFrozenUnit(
            *args, quantizer=quantizer, meter=settings.codecs.meter, replicated=planned.replicated, **kwargs
        )
    return FrozenUnit(*args, **kwargs)


def _materializer(deferred: DeferredInit | None, params: list[nn.Parameter]) -> Callable[[], None] | None:
    """What initializes a stage 3 unit's meta parameters once they alias its buffer."""
    if deferred is None:
        return None
    return lambda: deferred.materialize_owners(params)


def _whole_unit(planned: PlannedUnit, comm: Comm, settings: BuildSettings, placement: Placement) -> FlatUnit:
    owners = comm.owners_of(planned.cut_axes)
    return _owned_by(FlatUnit(
        planned.tensors, planned.names, planned.group_indices, owners.shard_rank, owners.num_shards,
        compute_dtype=settings.compute_dtype, spec=settings.unit_spec, placement=placement,
        placements=planned.placements,
    ), owners, comm)


def planned_host_buffers(plan: UnitPlan, settings: BuildSettings, num_shards: int) -> list[int]:
    """The bytes of each pinned host buffer offload will allocate, unit by unit, before any is
    (`zero_engine.offload.pinning_overshoot`: the allocator rounds each one up): the host
    gradient (and its staging buffer when several micro-steps reduce into a window; on NVMe the few
    buffers gradients cross in), the parameter shard of each stage 3 unit with ``offload_param`` on
    the host, and the master with ``pin_memory``."""
    stage, compute_dtype, offload = settings.stage, settings.compute_dtype, settings.offload

    def shard(numel: int) -> int:  # each rank's shard, padded
        return -(-numel // num_shards)

    buffers: list[int] = []
    # each frozen unit's shard (per module, stored dtype, encoding)
    if offload.params_on_host and stage.shard_parameters:
        buffers += [
            BlockQuantizer(8).encoded_bytes(shard(planned.numel)) if planned.quantized
            else planned.dtype.itemsize * shard(planned.numel)
            for planned in plan.frozen
            if not planned.replicated  # int8 frozen units kept whole stay on the device
        ]
    units = [*((planned.numel, True) for planned in plan.sharded), *((planned.numel, False) for planned in plan.whole)]
    if offload.state.on_nvme:  # the buffers gradients cross in on their way to the swap file (`GradBuffers`)
        largest = max((4 * shard(numel) for numel, _ in units), default=0)
        buffers += [largest] * min(offload.state.buffer_count, len(units))
    for numel, is_sharded in units:
        if offload.optimizer and not offload.state.on_nvme:
            buffers += [4 * shard(numel)] * (2 if offload.staged_gradients else 1)  # host gradient (and staging)
            shared_master = is_sharded and offload.params and compute_dtype == torch.float32
            if offload.pin_memory and not shared_master:
                buffers.append(4 * shard(numel))
        if offload.params_on_host and is_sharded:
            buffers.append(torch.tensor([], dtype=compute_dtype).element_size() * shard(numel))
    return buffers


def _in_arrival_order(units: list[FlatUnit], position: dict[nn.Parameter, int]) -> list[FlatUnit]:
    """Sorted as backward produces gradients; each unit's parameters numbered from its
    ``used_offset`` in that order (the one numbering of the used-mask)."""
    ordered = sorted(units, key=lambda unit: min(position[param] for param in unit.params), reverse=True)
    offset = 0
    for unit in ordered:
        unit.used_offset = offset
        offset += len(unit.params)
    return ordered


def build_reducer(
    settings: BuildSettings,
    units: Sequence[FlatUnit],
    comm: Comm,
    *,
    lifecycle: Lifecycle,
    on_unit_complete: Callable[[FlatUnit], None],
    on_unarmed_grad: Callable[[], None],
    may_wait_for: Callable[[int], bool | None],
    before_launch: Callable[[], None] | None,
) -> GradReducer:
    callbacks = {
        "lifecycle": lifecycle, "on_unit_complete": on_unit_complete, "on_unarmed_grad": on_unarmed_grad,
        "may_wait_for": may_wait_for, "before_launch": before_launch,
    }
    stage, codec = settings.stage, settings.codecs.grads
    if settings.streams_gradients:
        return ShardedGradReducer(
            units, comm, settings.overlap_comm, settings.reduce_dtype,
            max_live_buckets=stage.live_grad_buckets, release_after_step=stage.releases_gradients, codec=codec,
            **callbacks,
        )
    reduction = ReduceScatterGrads(codec) if stage.shard_optimizer_state else AllReduceGrads()
    return FullGradReducer(units, comm, settings.overlap_comm, settings.reduce_dtype, reduction, **callbacks)
