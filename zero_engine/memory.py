"""Per-rank memory of model states: the ZeRO formula, and what a rank actually holds.

The two must agree (up to padding and a few bytes of per-tensor optimizer step counters);
tests check both against each other, because users distrust estimators that disagree with
what they see.

The formula (ZeRO paper, section 5, for Psi parameters sharded over N ranks; with hybrid
sharding N is the shard group size G, whatever the world size): stage 0 holds every
state in full; stage 1 shards optimizer state; stage 2 shards gradients too; stage 3 shards
parameters too. In fp32 the optimizer's master copy is the parameter itself, so it costs
nothing extra.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from .devices import tensor_bytes
from .config import ZeroEngineConfig
from .stage import Stage, stage_for
from .offload import OffloadPlan, offload_plan
from .optim import state_bytes_per_param
from .quantize import BLOCK
from .sharding.reduction.reducer import GradReducer
from .sharding.units.frozen_unit import FrozenUnit
from .sharding.units.unit import FlatUnit


class MemoryReport(NamedTuple):
    """Bytes of each kind of model state on one rank."""

    parameters: int  # persistent parameter storage, frozen ones included
    gradients: int  # gradient storage held now (stage 3: from the backward to the step)
    optimizer_states: int  # optimizer state tensors
    master_parameters: int  # separate fp32 masters (mixed precision only)
    buffers: int  # reusable communication buffers
    peak_gradients: int  # most gradient storage alive at once in the last backward (reduction copies too)
    peak_gathered_forward: int = 0  # stage 3: most gathered (full) unit parameters alive in the last forward
    peak_gathered_backward: int = 0  # stage 3: the same in the last backward
    peak_step_gradients: int = 0  # fp32 copies of low-precision gradients alive at once in the last step
    host: int = 0  # of the held-now kinds, what lives in host memory (offload); the rest is on the device
    peak_quantized_buffers: int = 0  # most encoded (ZeRO++ quantized) communication buffers alive at once this step
    frozen_parameters: int = 0  # of `parameters`, the frozen ones (requires_grad False): sharded at stage 3
    nvme: int = 0  # offload_optimizer on NVMe: masters and optimizer state in the rank's swap file
    # Muon: its exchange's buffers alive at once in the last step (an owner's whole matrices of a window)
    peak_matrix_exchange: int = 0

    @property
    def model_states(self) -> int:
        """The formula's four kinds together: parameters, gradients, optimizer states, masters."""
        return self.parameters + self.gradients + self.optimizer_states + self.master_parameters


# The fields of `MemoryReport` that count storage held now (the others are peaks).
HELD_NOW = ("parameters", "gradients", "optimizer_states", "master_parameters", "buffers")


def formula_bytes(
    num_params: int,
    stage: Stage,
    shards: int,
    *,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer_bytes: float = 8,
    master_bytes: int = 0,
) -> MemoryReport:
    """Per-rank bytes for ``num_params`` trainable parameters, ignoring padding.

    ``optimizer_bytes`` is optimizer state per parameter (fp32 Adam: 8, SGD with momentum: 4).
    """
    def per_rank(bytes_per_param: float, sharded: bool) -> int:
        total = round(num_params * bytes_per_param)
        return total // shards if sharded else total

    return MemoryReport(
        parameters=per_rank(param_bytes, stage.shard_parameters),
        gradients=per_rank(grad_bytes, stage.shard_gradients),
        optimizer_states=per_rank(optimizer_bytes, stage.shard_optimizer_state),
        master_parameters=per_rank(master_bytes, stage.shard_optimizer_state),
        buffers=0,
        peak_gradients=per_rank(grad_bytes, stage.shard_gradients),
    )


def estimate_from_config(
    config: ZeroEngineConfig,
    num_params: int,
    ranks: int,
    shard_group_size: int | None = None,
    frozen_params: int = 0,
    matrix_params: int = 0,
) -> MemoryReport:
    """The formula for a config: its stage, precision, optimizer and offload (state bytes from
    `zero_engine.optim.OPTIMIZERS`; with Muon, ``matrix_params`` of the trainable ones are its
    matrices, the rest AdamW's). States are
    sharded over the shard group (``shard_group_size``, else the config's for ``ranks``: every rank, sequence
    ranks too),
    not over every rank: with hybrid sharding ``G`` takes the place of ``N``. ``num_params``
    trainable parameters; ``frozen_params`` frozen ones add their storage alone (2 bytes under
    fp16/bf16, else 4; about 1 in int8 at stage 3 under ``zero_quantized_nontrainable_weights``),
    sharded at stage 3 unless ``frozen_weights`` is ``replicate``."""
    mixed = config.fp16.enabled or config.bf16.enabled
    if shard_group_size is None:
        shard_group_size = config.zero_optimization.shard_group_size_for(ranks)
    elif ranks % shard_group_size:
        raise ValueError(f"shard group size {shard_group_size} does not divide the world size {ranks}")
    stage = stage_for(config.zero_optimization.stage)
    report = formula_bytes(
        num_params,
        stage,
        shard_group_size,
        param_bytes=2 if mixed else 4,
        grad_bytes=2 if mixed else 4,
        optimizer_bytes=state_bytes_per_param(
            config.optimizer.type, config.optimizer.params, matrix_params / num_params if num_params else 0.0
        ),
        master_bytes=4 if mixed else 0,
    )
    plan = offload_plan(config.zero_optimization, stage)
    report = with_offload(report, plan, num_params, shard_group_size, mixed=mixed, stage=stage)
    sharded = stage.shard_parameters and config.zero_optimization.frozen_weights == "shard"
    frozen = int(frozen_params * frozen_element_bytes(
        stage, mixed=mixed, int8_frozen=config.zero_optimization.zero_quantized_nontrainable_weights
    )) // (shard_group_size if sharded else 1)
    moved = frozen if plan.params and sharded else 0  # offload_param moves frozen shards too
    host = report.host + (moved if plan.params_on_host else 0)
    nvme = report.nvme + (0 if plan.params_on_host else moved)
    return report._replace(parameters=report.parameters + frozen, frozen_parameters=frozen, host=host, nvme=nvme)


def frozen_element_bytes(stage: Stage, *, mixed: bool, int8_frozen: bool) -> float:
    """Bytes a frozen element is stored in: the compute dtype's (2 under fp16/bf16, else 4), or
    int8 and its block's share of an fp32 scale at stage 3 under
    ``zero_quantized_nontrainable_weights`` (``int8_frozen``; vectors stay exact: too few to
    count here)."""
    if stage.shard_parameters and int8_frozen:
        return 1 + 4 / BLOCK
    return 2 if mixed else 4


def nvme_parts(report: MemoryReport, plan: OffloadPlan) -> tuple[int, int]:
    """A formula's NVMe bytes (`with_offload`) as the two swap files hold them: the optimizer
    side's (masters, optimizer state and step gradient) and the parameter shards' (frozen ones
    too)."""
    shards = report.parameters if plan.param_shards.on_nvme else 0  # frozen shards among them
    return report.nvme - shards, shards


def check_offload_directories(plan: OffloadPlan, formula: MemoryReport, local_ranks: int) -> None:
    """At `initialize`: each NVMe offload's directory usable, with room for what this node's
    ranks put there (the formula's bytes: `nvme_parts`); nothing without NVMe offload."""
    from .sharding.storage.nvme import check_swap_directories

    check_swap_directories(plan, *nvme_parts(formula, plan), local_ranks)


def with_offload(
    report: MemoryReport, plan: OffloadPlan, num_params: int, shards: int, *, mixed: bool, stage: Stage
) -> MemoryReport:
    """The formula with `OffloadPlan` applied: offloaded, the shard's master is a separate fp32
    host copy (also in fp32 training, except when the parameter shard is on the host too), its
    gradient an fp32 host tensor (4 bytes, whatever the compute dtype; at stage 1 beside the
    device's full gradients), and the optimizer state host memory; on NVMe all three are in the
    swap file (host memory keeps a few buffers in flight, bounded by ``buffer_count``, not counted)."""
    if not plan.any:
        return report
    per_rank = num_params * 4 // shards
    host = 0
    if plan.optimizer:
        device_grads = 0 if stage.shard_gradients else report.gradients  # stage 1 keeps full gradients for backward
        shared_master = plan.params_on_host and not mixed
        report = report._replace(
            gradients=device_grads + per_rank, peak_gradients=device_grads + per_rank,
            master_parameters=0 if shared_master else per_rank,
        )
        host = report.master_parameters + per_rank + report.optimizer_states
        if plan.state.on_nvme:  # masters, state and the step gradient in the swap file
            report = report._replace(nvme=report.master_parameters + report.optimizer_states + per_rank)
            host = 0
    if plan.params_on_host:
        host += report.parameters
    elif plan.params:  # offload_param on NVMe: the shards in the swap file
        report = report._replace(nvme=report.nvme + report.parameters)
    return report._replace(host=host)


def measure_memory(
    loose_params: Sequence[nn.Parameter],
    units: Sequence[FlatUnit],
    frozen_units: Sequence[FrozenUnit],
    optimizer: torch.optim.Optimizer | None,
    reducer: GradReducer,
    gathered_peaks: tuple[int, int] = (0, 0),
    step_grad_bytes: int = 0,
    optimizer_on_host: bool = False,
    peak_encoded_bytes: int = 0,
) -> MemoryReport:
    """What this rank holds now, counted from the tensors themselves. ``loose_params`` are the
    parameters outside every unit (frozen ones below stage 3 or replicated), counted as they
    are stored; stage 3 units count their shard (gathered copies are transient and reported as
    peaks). ``frozen_parameters`` is the part of ``parameters`` that trains not. ``host``
    counts what offload put in host memory (``optimizer_on_host``: the optimizer's state too)."""
    optimizer_states = sum(unit.optimizer_shard.state_bytes() for unit in units) if optimizer else 0
    frozen = sum(tensor_bytes(p) for p in loose_params if not p.requires_grad)
    frozen += sum(unit.param_bytes for unit in frozen_units)
    return MemoryReport(
        parameters=sum(tensor_bytes(p) for p in loose_params)
        + sum(unit.param_bytes for unit in [*units, *frozen_units]),
        gradients=reducer.held_grad_bytes(),
        optimizer_states=optimizer_states,
        master_parameters=sum(unit.optimizer_shard.master_bytes for unit in units),
        buffers=reducer.buffer_bytes(),
        peak_gradients=reducer.peak_grad_bytes,
        peak_gathered_forward=gathered_peaks[0],
        peak_gathered_backward=gathered_peaks[1],
        peak_step_gradients=step_grad_bytes,
        host=sum(unit.host_bytes for unit in [*units, *frozen_units]) + (optimizer_states if optimizer_on_host else 0),
        peak_quantized_buffers=peak_encoded_bytes,
        frozen_parameters=frozen,
        nvme=sum(unit.nvme_bytes for unit in [*units, *frozen_units]),
    )
