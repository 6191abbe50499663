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
from .accounting import Counted, Holding, by_tier, bytes_of, declared
from .offload import offload_plan
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
    nvme: int = 0  # of the held-now kinds, what lives in the rank's swap files (offload to NVMe)
    # a whole-matrix optimizer: its exchange's buffers alive at once in the last step (an owner's
    # whole matrices of a window)
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
    """Per-rank bytes for ``num_params`` trainable parameters, ignoring padding, without offload:
    the paper's formula as the tests state it (`estimate_from_config` is a config's).

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
    *,
    terms: list[Counted] | None = None,
    expert_params: int = 0,
) -> MemoryReport:
    """The formula for a config: the terms `zero_engine.accounting.declared` gives for its stage,
    precision, optimizer (state bytes from its kind, `zero_engine.optimizer_kinds`; for a
    whole-matrix one, ``matrix_params`` of the trainable ones are its matrices, the rest its
    partner's) and offload plan, summed by kind of state and by tier off the device (``terms``,
    a list given, receives them: the estimate prints them by tier, `initialize` checks each
    tier's room). States are sharded over the shard group (``shard_group_size``, else the
    config's for ``ranks``: every rank, sequence ranks too), not over every rank: with hybrid
    sharding ``G`` takes the place of ``N``. ``num_params`` trainable parameters;
    ``frozen_params`` frozen ones add their storage alone (2 bytes under fp16/bf16, else 4; about
    1 in int8 at stage 3 under ``zero_quantized_nontrainable_weights``), sharded at stage 3 unless
    ``frozen_weights`` is ``replicate``. ``expert_params`` of the trainable ones are experts,
    owned by 1 of each ``expert_parallel_size`` ranks: whole states count this rank's share."""
    mixed = config.fp16.enabled or config.bf16.enabled
    zero = config.zero_optimization
    if shard_group_size is None:
        shard_group_size = zero.shard_group_size_for(ranks)
    elif ranks % shard_group_size:
        raise ValueError(f"shard group size {shard_group_size} does not divide the world size {ranks}")
    stage = stage_for(zero.stage)
    holding = Holding(
        trainable=num_params, frozen=frozen_params, group=shard_group_size, mixed=mixed,
        optimizer_bytes=state_bytes_per_param(
            config.optimizer.type, config.optimizer.params, matrix_params / num_params if num_params else 0.0
        ),
        frozen_bytes=frozen_element_bytes(stage, mixed=mixed, int8_frozen=zero.zero_quantized_nontrainable_weights),
        frozen_sharded=stage.shard_parameters and zero.frozen_weights == "shard",
        experts=expert_params if config.expert_parallel_size > 1 else 0, expert_parallel=config.expert_parallel_size,
    )
    counted = declared(offload_plan(zero, stage), stage, holding)
    if terms is not None:
        terms.extend(counted)
    return report_of(counted)


def report_of(counted: Sequence[Counted]) -> MemoryReport:
    """The report of the formula's terms: each kind of state's bytes, the frozen parameters'
    among them, and each tier's off the device (the report's field of the tier's name)."""
    kinds = {kind: bytes_of(counted, kind=kind) for kind in ("parameters", "gradients", "optimizer_states",
                                                              "master_parameters")}
    return MemoryReport(
        **kinds, buffers=0, peak_gradients=kinds["gradients"],
        frozen_parameters=bytes_of(counted, part="frozen parameters"),
        **{tier.value: nbytes for tier, nbytes in by_tier(counted).items()},
    )


def frozen_element_bytes(stage: Stage, *, mixed: bool, int8_frozen: bool) -> float:
    """Bytes a frozen element is stored in: the compute dtype's (2 under fp16/bf16, else 4), or
    int8 and its block's share of an fp32 scale at stage 3 under
    ``zero_quantized_nontrainable_weights`` (``int8_frozen``; vectors stay exact: too few to
    count here)."""
    if stage.shard_parameters and int8_frozen:
        return 1 + 4 / BLOCK
    return 2 if mixed else 4


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
