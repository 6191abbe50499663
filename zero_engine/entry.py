"""``initialize``: from a model and a config to a ready `Engine`.

Everything that could fail later is checked here, before a process group or a buffer exists
(the config and its unbuilt features, the optimizer for the stage, the schedule, the model's
parameters and devices, host memory for offload), ``stage: auto`` is settled, the ranks connect,
a meta-device model is given its initialization, and what the config chose is logged on rank
0 (keys that change nothing here, the clipping in effect). Pretrained ``weights`` are read into
the engine's shards last, each rank reading only what it keeps.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from . import offload
from .comm import Comm, connect, make_data_communicators, with_stage_groups
from .devices import local_cuda_device
from .config import ZeroEngineConfig, load_config, no_effect_settings, optimizer_class
from .engine import Engine, is_wrapped, left_sharded
from .engine_settings import EngineSettings
from .transforms.seam import ModuleTransforms
from .transforms.table import planned_transforms
from .logs import show_by_default
from .accounting import Counted, check_room
from .memory import estimate_from_config
from .offload import offload_plan
from .matrix_step import compute_layouts
from .optim import check_optimizer_for_stage
from .param_groups import ParamGroup, resolve_param_groups
from .precision import Precision
from .sharding.building.build import BuildSettings, planned_host_buffers
from .sharding.building.conditional import settings_under_split
from .sharding.units.module_plan import ModulePlan
from .sharding.units.unit_plan import UnitPlan
from .sharding.building.deferred_init import DeferredInit, draw_base_seed, has_meta_tensors, materialization_device
from .stage import Stage, stage_for
from .stage_choice import resolve_stage
from .state.weights import WeightsSource, load_weights, match_weights, open_weights
from .validation import check_config

logger = logging.getLogger("zero_engine")


def initialize(
    model: nn.Module,
    config: str | Path | dict[str, Any] | ZeroEngineConfig,
    *,
    param_groups: Iterable[Any] | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    weights: WeightsSource | None = None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> Engine:
    """Wrap ``model`` for ZeRO training as ``config`` (path, dict or `ZeroEngineConfig`) says.

    Starts a process group from torchrun's environment if none exists (world size 1 without
    one), broadcasts rank 0's parameters and buffers, and checks everything that could fail
    later: unbuilt features, the optimizer for the stage, the batch arithmetic. ``stage: auto``
    is settled first: the lowest stage (then stage 3 with offload) whose per-rank memory fits
    the budget (`zero_engine.stage_choice`), logged on rank 0.

    A model built on the meta device is materialized here, one unit at a time at stage 3: each
    module initialized by ``param_init_fn(module)`` or its own ``reset_parameters()``, the same
    at every stage and world size. ``weights`` (a safetensors file, a Hugging Face directory, a
    torch state dict file, a checkpoint directory, or a state dict) sets the values it holds,
    each rank reading only what it keeps (`zero_engine.state.weights`). ``lr_scheduler`` builds
    a schedule from the engine's optimizer (``lambda optimizer: LambdaLR(optimizer, fn)``) for
    a config without a ``scheduler`` section; it steps on applied steps only and is saved.
    """
    _check_not_wrapped(model)
    show_by_default()  # the engine's lines on stdout, unless the application configured logging
    settled, comm, stage_table = _settle(model, config, param_groups, lr_scheduler)
    config, stage, device = settled.config, settled.stage, settled.device
    weights_file, engine = None, None
    try:
        weights_file = open_weights(weights) if weights is not None else None
        file_names = match_weights(model, weights_file) if weights_file is not None else {}
        _check_device(device)
        comm = with_stage_groups(comm or connect(config, device), stage)
        make_data_communicators(comm, device)
        if stage_table is not None and comm.rank == 0:
            logger.info(stage_table)
        deferred = _deferred_init(model, comm, device, param_init_fn, set(file_names))
        engine = _build_engine(model, settled, comm, deferred, lr_scheduler)
        if weights_file is not None:
            load_weights(engine.model_state, weights_file, file_names)
    except BaseException:
        if engine is None:  # the model as it was given: the transforms' first phase undone
            settled.transforms.revert()
        raise
    finally:
        if weights_file is not None:
            weights_file.close()
    return engine


class Settled(NamedTuple):
    """What `initialize` settled before the ranks build anything."""

    config: ZeroEngineConfig
    stage: Stage
    precision: Precision
    groups: list[ParamGroup]
    plan: ModulePlan
    device: torch.device
    engine: EngineSettings
    transforms: ModuleTransforms  # planned, their first phase run: applied by the engine


def _settle(
    model: nn.Module,
    config: str | Path | dict[str, Any] | ZeroEngineConfig,
    param_groups: Iterable[Any] | None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None,
) -> tuple[Settled, Comm | None, str | None]:
    """The config checked (what `zero-engine validate` checks too), the module transforms
    planned and their first phase run (a transform may replace modules and parameters: the
    groups and the plan see what it made; reverted if anything after fails), the parameter
    groups and the module plan decided once, the stage settled: ``stage: auto`` is agreed
    between the ranks, so they connect first (the connection is returned, with the table of the
    stages weighed)."""
    config = check_config(load_config(config), model).config
    _check_scheduler_factory(lr_scheduler, config.scheduler.type if config.scheduler else None)
    engine = EngineSettings.derive(config)  # a monitor without its package fails here
    transforms = planned_transforms(engine.transforms)
    transforms.convert(model)
    try:
        groups = resolve_param_groups(model, param_groups, optimizer_class(config.optimizer.type))
        device = materialization_device(model)
        plan = ModulePlan(model, groups, config.zero_optimization)  # decided once, for everything that asks
        _make_current(device)
        comm = connect(config, device) if config.zero_optimization.stage == "auto" else None
        config, stage_table = resolve_stage(config, plan, groups, device, comm)
        stage = stage_for(config.zero_optimization.stage)
        check_optimizer_for_stage(config.optimizer, stage)  # again: stage: auto is settled only now
        precision = Precision.from_config(config)
        _check_params(model, precision)
    except BaseException:
        transforms.revert()
        raise
    engine = dataclasses.replace(engine, config=config)  # resolved: engine.config and the manifest's
    return Settled(config, stage, precision, groups, plan, device, engine, transforms), comm, stage_table


def _deferred_init(
    model: nn.Module, comm: Comm, device: torch.device, param_init_fn: Callable[[nn.Module], None] | None,
    provided: set[str],
) -> DeferredInit | None:
    """A model on the meta device is initialized as it is built, under one seed agreed by the
    ranks; ``provided``: the parameters pretrained weights will set instead."""
    if has_meta_tensors(model):
        base_seed = comm.each_rank(draw_base_seed() if comm.rank == 0 else 0).values()[0]
        return DeferredInit(model, device, base_seed, param_init_fn, provided=provided)
    if param_init_fn is not None and comm.rank == 0:
        logger.warning("param_init_fn is not called: the model has no tensors on the meta device")
    return None


def _build_engine(
    model: nn.Module, settled: Settled, comm: Comm, deferred: DeferredInit | None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None,
) -> Engine:
    """The units planned, the host memory checked against them, the settings logged, the engine built."""
    config, stage, precision = settled.config, settled.stage, settled.precision
    batch = config.batch_sizes(comm.mesh.batch)
    zero = config.zero_optimization
    placement = offload_plan(zero, stage, batch.gradient_accumulation_steps)
    settings = BuildSettings.derive(zero, stage, precision.compute_dtype, precision.reduce_dtype, placement)
    sequence = comm.mesh.size("sequence")
    if sequence > 1:  # a mixture of experts under the split: see `settings_under_split`
        settings = settings_under_split(model, settled.plan, settings, sequence, log=comm.rank == 0)
    units = UnitPlan.derive(
        model, settled.plan, settled.groups, stage.shard_parameters, precision.compute_dtype, settings.bucket_numel,
        settings.frozen_quantization, compute_layouts(config.optimizer.type), settled.transforms.placement_of,
    )  # every unit, planned once: built by the engine, sized for the host check before
    if settings.offload.any:  # the formula's host bytes, before any of them is allocated
        trainable, experts = _global_counts(model, settled.transforms)
        counted: list[Counted] = []
        formula = estimate_from_config(config, trainable, comm.mesh.world, terms=counted, expert_params=experts)
        _check_host_memory(formula.host, units, settings, comm)
        check_room(settings.offload, counted, offload.local_ranks())  # NVMe: each rank's files
    if comm.rank == 0:
        _log_settings(config, stage, settled.groups)
        _warn_if_one_hardware_queue(stage, comm)
    return Engine(
        model, settled.engine, comm, stage, batch, settled.groups, precision, units, settings, device=settled.device,
        deferred=deferred, lr_scheduler=lr_scheduler, transforms=settled.transforms,
    )


def _global_counts(model: nn.Module, transforms: ModuleTransforms) -> tuple[int, int]:
    """The trainable elements of the whole model, and of them those a transform cut per rank
    (experts): counted by their whole shapes, as the formula counts them."""
    trainable = experts = 0
    for param in model.parameters():
        if not param.requires_grad:
            continue
        cut = transforms.placement_of(param)
        numel = math.prod(cut.global_shape) if cut is not None else param.numel()
        trainable += numel
        experts += numel if cut is not None else 0
    return trainable, experts


def _check_not_wrapped(model: Any) -> None:
    if isinstance(model, Engine):
        raise TypeError("initialize(model, ...) got an Engine: pass the nn.Module (engine.module), or keep the engine")
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize(model, ...): model must be a torch.nn.Module, got {type(model).__name__}")
    if type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        raise TypeError(
            "initialize(model, ...) got a torch.compile'd model, whose parameters are all named '_orig_mod.*' and "
            "whose graph would hold the engine's hooks: pass the module itself (model._orig_mod), then call "
            "engine.compile(**the same options) to compile each unit with the hooks outside the graph"
        )
    if is_wrapped(model):
        raise ValueError(
            "initialize: this model is already wrapped by an engine (its hooks and flat parameters are in place): "
            "call engine.close() on that engine first, or build a new model"
        )
    if left_sharded(model):
        raise ValueError(
            "initialize: a stage 3 engine (or one with expert_parallel_size) was closed on this model without "
            "unshard, so each rank holds only its shard of the parameters (or its own experts): close it with engine.close(unshard=True) (collective: the whole model on "
            "every rank) before building a new engine, or save (engine.save_checkpoint), build the model again "
            "(on the meta device for a big one) and initialize it with weights=<the checkpoint directory>"
        )


def _make_current(device: torch.device) -> None:
    """CUDA only: the model's GPU becomes the current device, as torchrun scripts set it, also
    where the caller made the process group without ``torch.cuda.set_device``: otherwise
    tensors made without a device and every CUDA context of this rank land on GPU 0."""
    if device.type == "cuda":
        _set_cuda_device(device)


def _set_cuda_device(device: torch.device) -> None:
    torch.cuda.set_device(device)


def _check_device(device: torch.device) -> None:
    """CUDA only: under torchrun each rank trains on its own GPU, ``cuda:LOCAL_RANK``."""
    if device.type != "cuda" or "LOCAL_RANK" not in os.environ:
        return
    expected = local_cuda_device()
    if device != expected:
        raise ValueError(
            f"the model is on {device}, but this rank's GPU is {expected} (torchrun's LOCAL_RANK): "
            f"move it there first, model.to({str(expected)!r})"
        )


def _check_scheduler_factory(factory: Any, config_scheduler: str | None) -> None:
    """``lr_scheduler=`` is a callable of the optimizer (the engine builds the optimizer over its
    shards, so a schedule made beforehand would drive another one), and not beside a config
    ``scheduler`` (``config_scheduler``: its type, if given)."""
    if factory is None:
        return
    if hasattr(factory, "state_dict") and hasattr(factory, "step"):
        raise TypeError(
            "initialize(lr_scheduler=...): pass a function of the optimizer, e.g. lambda optimizer: "
            f"{type(factory).__name__}(optimizer, ...), not a {type(factory).__name__} built on another optimizer "
            "(the engine builds its own, over this rank's shards)"
        )
    if not callable(factory):
        raise TypeError(f"initialize(lr_scheduler=...): expected a function of the optimizer, got {type(factory).__name__}")
    if config_scheduler:
        raise ValueError(
            f"initialize(lr_scheduler=...) and the config's scheduler section ({config_scheduler}) both give a "
            "schedule: keep one"
        )


def _check_host_memory(formula_bytes: int, plan: UnitPlan, settings: BuildSettings, comm: Comm) -> None:
    """With offload: the host state of every rank on this node must fit the node's available
    memory, checked before any of it is allocated: the formula's bytes, plus what the pinned
    allocator rounds each pinned buffer up by (up to twice its size)."""
    pinned = planned_host_buffers(plan, settings, comm.num_shards)
    needed = formula_bytes + offload.pinning_overshoot(pinned)
    offload.check_host_memory(needed, "zero_optimization.offload_optimizer / offload_param")


def _log_settings(config: ZeroEngineConfig, stage: Stage, groups: list[ParamGroup]) -> None:
    """What the config asks for that changes nothing here, and the clipping in effect (rank 0).
    A model without a trainable parameter (a reference or reward model, built with the policy's
    config as TRL does) gets no optimizer: its optimizer and scheduler sections have no effect."""
    if stage.shard_parameters and not config.zero_optimization.reduce_scatter_each_micro_step:
        logger.warning("zero_optimization.reduce_scatter_each_micro_step: false has no effect at stage 3")
    for message in no_effect_settings(config):
        logger.warning(message)
    given = config.model_fields_set
    logger.info(_clipping_in_effect(config.gradient_clipping, "gradient_clipping" in given))
    sections = [name for name in ("optimizer", "scheduler") if name in given and getattr(config, name)]
    if sections and not any(group.params for group in groups):
        logger.info(
            "the model has no trainable parameter: this engine serves forwards only, and the config's %s "
            "section(s) have no effect (no optimizer is built)", " and ".join(sections)
        )


def _warn_if_one_hardware_queue(stage: Stage, comm: Comm) -> None:
    """Stage 3 on NCCL runs gathers and reductions on two communicators whose launch orders
    differ between ranks (docs/architecture.md, "On GPUs"): they progress only while both
    kernels can be resident, which one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``, set
    by Megatron-style stacks) does not allow."""
    if stage.shard_parameters and comm.orders_on_device and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        logger.warning(
            "CUDA_DEVICE_MAX_CONNECTIONS=1 with stage 3 on NCCL may hang: gathers and reductions run on two "
            "communicators in orders that differ between ranks, and one hardware queue serializes them. Unset it "
            "for this job (see docs/architecture.md, 'On GPUs')"
        )


def _clipping_in_effect(max_norm: float, chosen: bool) -> str:
    """The clipping a step applies, and whether the config chose it (left out, it is DeepSpeed's
    default, 1.0: a config written for no clipping must say 0)."""
    given = "" if chosen else " (left out of the config: DeepSpeed's default)"
    if max_norm == 0:
        return f"gradient clipping: off (gradient_clipping = 0{given})"
    return f"gradient clipping: the global gradient norm to {max_norm:g} (gradient_clipping = {max_norm:g}{given})"


def _check_params(model: nn.Module, precision: Precision) -> None:
    _check_one_device(model)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if not param.is_floating_point():
            raise TypeError(f"parameter {name!r} is {param.dtype}: trainable parameters must be floating point")
        if not precision.mixed and param.dtype != torch.float32:
            raise NotImplementedError(
                f"parameter {name!r} is {param.dtype}: without fp16/bf16 enabled, trainable parameters must be "
                "float32 (enable bf16 or fp16 in the config to compute in low precision with fp32 masters)"
            )


def _check_one_device(model: nn.Module) -> None:
    """Parameters and buffers (every one is broadcast on the data group: NCCL refuses a host
    tensor) on one device, meta aside; the error names a tensor on each device found."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    where = {}
    for name, tensor in tensors:
        if not tensor.is_meta:
            where.setdefault(str(tensor.device), name)
    if len(where) > 1:
        found = ", ".join(f"{name!r} on {device}" for device, name in sorted(where.items()))
        raise ValueError(f"the model's parameters and buffers are on several devices ({found}); move the model to one")
