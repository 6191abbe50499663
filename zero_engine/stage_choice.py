"""``zero_optimization.stage: auto``: the lowest stage, then stage 3 with offload, whose
per-rank device memory fits a budget, picked at `initialize` before anything is built.

DeepSpeed's autotuner runs trial jobs; FSDP and Accelerate have nothing. Here the choice is the
estimator's arithmetic, so `zero-engine estimate` prints the same table. A candidate's device
bytes per rank are:

- the ZeRO formula for the model's trainable parameters (`memory.estimate_from_config`:
  parameters, gradients, optimizer states and fp32 masters, less what offload keeps on the host),
- at stage 3, the largest unit gathered whole, in the compute dtype (forward and backward hold
  it beside the shards; its gradient is reduced into the shard's place),
- ``activation_memory_gib``, an allowance the user sets (1 GiB unless told).

Candidates in order: stages 0, 1, 2, 3, then stage 3 with the optimizer offloaded, then with the
parameters offloaded too. The budget is ``memory_budget_gib``, or on a GPU its free memory less
``memory_margin_gib``. The chosen config is the same as that stage set by hand, so training,
checkpoints and reports are those of that stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .comm import Comm
from .devices import free_cuda_bytes
from .config import OffloadOptimizerConfig, OffloadParamConfig, ZeroEngineConfig
from .devices import tensor_bytes
from .errors import ConfigError
from .memory import estimate_from_config
from .muon import takes_muon
from .optimizer_kinds import optimizer_kind
from .param_groups import ParamGroup
from .precision import Precision
from .sharding.units.module_plan import ModulePlan, frozen_params

GIB = 2**30
CANDIDATES: list[tuple[str, dict[str, Any]]] = [
    ("stage 0", {"stage": 0}),
    ("stage 1", {"stage": 1}),
    ("stage 2", {"stage": 2}),
    ("stage 3", {"stage": 3}),
    ("stage 3 + offload_optimizer", {"stage": 3, "offload_optimizer": OffloadOptimizerConfig(device="cpu")}),
    (
        "stage 3 + offload_optimizer + offload_param",
        {
            "stage": 3, "offload_optimizer": OffloadOptimizerConfig(device="cpu"),
            "offload_param": OffloadParamConfig(device="cpu"),
        },
    ),
]


class Candidate(NamedTuple):
    name: str
    config: ZeroEngineConfig  # the config with this stage (and offload) set
    states: int  # model states on the device, by the formula
    gathered: int  # the largest unit gathered whole (stage 3)
    activations: int
    host: int  # what offload keeps in host memory

    @property
    def device(self) -> int:
        return self.states + self.gathered + self.activations


def candidates(
    config: ZeroEngineConfig, num_params: int, ranks: int, largest_unit_numel: int, frozen_params: int = 0,
    matrix_params: int = 0,
) -> list[Candidate]:
    """Every candidate's figures, in the order they are tried; the largest stage 3 unit counted
    gathered whole in the compute dtype; ``frozen_params`` frozen parameters counted as stored
    (whole below stage 3, sharded at stage 3 unless replicated); with Muon, ``matrix_params``
    of the trainable ones are its matrices."""
    zero = config.zero_optimization
    if zero.offload_optimizer is not None or zero.offload_param is not None:
        raise ConfigError(
            "zero_optimization.stage = 'auto' chooses offload itself: leave offload_optimizer and offload_param out"
        )
    activations = int(zero.activation_memory_gib * GIB)
    gathered_unit = largest_unit_numel * Precision.from_config(config).compute_dtype.itemsize
    table = []
    for name, update in CANDIDATES:
        settled = zero.model_copy(update={**update, "memory_budget_gib": None})  # as if set by hand
        chosen = config.model_copy(update={"zero_optimization": settled})
        report = estimate_from_config(
            chosen, num_params, ranks, frozen_params=frozen_params, matrix_params=matrix_params
        )
        gathered = gathered_unit if update["stage"] == 3 else 0
        table.append(Candidate(name, chosen, report.model_states - report.host, gathered, activations, report.host))
    return table


def choose(table: Sequence[Candidate], budget: int) -> Candidate:
    """The first candidate that fits ``budget`` bytes, else a `ConfigError` with the table."""
    for candidate in table:
        if candidate.device <= budget:
            return candidate
    raise ConfigError(
        f"zero_optimization.stage = 'auto': nothing fits the budget of {_size(budget)} per rank:\n"
        + format_table(table, budget, None)
        + "\nRaise memory_budget_gib, lower activation_memory_gib, or add ranks"
    )


def format_table(table: Sequence[Candidate], budget: int | None, chosen: Candidate | None) -> str:
    """One line per candidate: device total and its parts, host bytes, whether it fits
    ``budget`` (no verdict without one)."""
    lines = []
    for candidate in table:
        fits = "" if budget is None else "  [fits]" if candidate.device <= budget else "  [too large]"
        mark = "  [chosen]" if candidate is chosen else fits
        host = f", host {_size(candidate.host)}" if candidate.host else ""
        lines.append(
            f"  {candidate.name:44s} {_size(candidate.device):>12s} = states {_size(candidate.states)} + "
            f"gathered unit {_size(candidate.gathered)} + activations {_size(candidate.activations)}{host}{mark}"
        )
    return "\n".join(lines)


def _size(size: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20)):
        if size >= scale:
            return f"{size / scale:.3f} {unit}"
    return f"{size / 2**10:.3f} KiB"


def budget_bytes(
    budget_gib: float | None, margin_gib: float, device: torch.device, model_bytes_on_device: int = 0
) -> int:
    """This rank's budget: ``memory_budget_gib``, else the GPU's free memory less the margin,
    plus what the model already holds on that GPU (the driver counts it as used, and every
    candidate counts it again). ``budget_gib``, ``margin_gib``: ``zero_optimization.memory_budget_gib``
    and ``memory_margin_gib``."""
    if budget_gib is not None:
        return int(budget_gib * GIB)
    if device.type == "cuda":
        return free_cuda_bytes(device) + model_bytes_on_device - int(margin_gib * GIB)
    raise ConfigError(
        "zero_optimization.stage = 'auto' needs zero_optimization.memory_budget_gib (GiB per rank) on "
        f"{device.type}: only a GPU's free memory can stand in for it"
    )


def resolve_stage(
    config: ZeroEngineConfig, plan: ModulePlan, groups: Sequence[ParamGroup], device: torch.device, comm: Comm | None
) -> tuple[ZeroEngineConfig, str | None]:
    """``config`` with ``stage: auto`` replaced by the chosen stage (and offload), and the
    table to log; a config with a stage set comes back as it is. Every rank weighs the
    smallest budget of any rank (``comm``, connected for it), so all choose alike: GPUs whose
    free memory differs would otherwise build different stages and pair unrelated collectives."""
    if config.zero_optimization.stage != "auto":
        return config, None
    assert comm is not None, "stage: auto is agreed between the ranks: connect first"
    num_params = sum(param.numel() for group in groups for param in group.params)
    frozen = sum(param.numel() for param in frozen_params(plan.model))
    kind = optimizer_kind(config.optimizer.type)
    takes = kind.takes if kind is not None and kind.takes is not None else takes_muon  # its matrices
    matrices = sum(p.numel() for g in groups for n, p in zip(g.names, g.params) if takes(n, p))
    # ZeRO shards over every rank
    table = candidates(config, num_params, comm.mesh.world, plan.largest_unit_numel(), frozen, matrices)
    zero = config.zero_optimization
    own = budget_bytes(zero.memory_budget_gib, zero.memory_margin_gib, device, _bytes_on(plan.model, device))
    budgets = comm.each_rank(own).values()
    budget = min(budgets)
    chosen = choose(table, budget)
    smallest = "" if len(set(budgets)) == 1 else f", the smallest of the ranks' (rank {budgets.index(budget)}'s)"
    text = (
        f"zero_optimization.stage = 'auto' chose {chosen.name} for a budget of {_size(budget)} per rank{smallest} "
        f"({num_params:,} trainable and {frozen:,} frozen parameters, {comm.mesh.world} rank(s)):\n"
        f"{format_table(table, budget, chosen)}"
    )
    return chosen.config, text


def _bytes_on(model: torch.nn.Module, device: torch.device) -> int:
    """What the model's parameters and buffers hold on ``device`` now (CUDA: counted as used)."""
    if device.type != "cuda":
        return 0
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers()) if t.device == device}
    return sum(tensor_bytes(tensor) for tensor in tensors.values())
