"""Builds the torch optimizer named in the config over what the stage lets a rank update, from
one table of optimizers: how each computes (its layout) and the state it keeps.

At stage 0 that is the model's own parameters. From stage 1 on it is this rank's pieces of
them (1-D views into its shard), each piece its own optimizer tensor, so torch.optim keeps its
usual semantics piece by piece: a piece whose parameter got no gradient is skipped, state and
step count included. An *elementwise* optimizer gives the same result on pieces as on whole
parameters. A *whole-matrix* one (Muon) steps its matrices through the units' matrix exchanges
(`zero_engine.sharding.storage.compute_layout`). Any other is refused from stage 1 on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .config import OptimizerConfig, optimizer_class
from .sharding.units.param_placement import ComputeLayout
from .stage import Stage


@dataclass(frozen=True)
class OptimizerKind:
    """How an optimizer computes, and its fp32 state bytes per element it updates (from its
    params); a whole-matrix optimizer's partner (Muon's AdamW) has its own for the rest."""

    layout: ComputeLayout
    state_bytes: Callable[[dict[str, Any]], int]
    partner_state_bytes: Callable[[dict[str, Any]], int] | None = None


def _adam(params: dict[str, Any]) -> int:
    return 8 + (4 if params.get("amsgrad") else 0)


def _rmsprop(params: dict[str, Any]) -> int:
    return 4 + (4 if params.get("momentum", 0) else 0) + (4 if params.get("centered") else 0)


# By lower-case name, as ``optimizer.type`` is matched.
OPTIMIZERS = {
    **{name: OptimizerKind(ComputeLayout.ELEMENTWISE, _adam) for name in ("adam", "adamw", "adamax", "nadam", "radam")},
    "adadelta": OptimizerKind(ComputeLayout.ELEMENTWISE, lambda p: 8),  # square averages of gradients and updates
    "sgd": OptimizerKind(ComputeLayout.ELEMENTWISE, lambda p: 4 if p.get("momentum", 0) else 0),
    "rmsprop": OptimizerKind(ComputeLayout.ELEMENTWISE, _rmsprop),
    "rprop": OptimizerKind(ComputeLayout.ELEMENTWISE, lambda p: 8),  # previous gradient and step size
    "adagrad": OptimizerKind(ComputeLayout.ELEMENTWISE, lambda p: 4),  # sum of squares
    "asgd": OptimizerKind(ComputeLayout.ELEMENTWISE, lambda p: 4),  # averaged parameter
    "muon": OptimizerKind(ComputeLayout.WHOLE_MATRIX, lambda p: 4, _adam),  # momentum; AdamW for the rest
}
# Updates that depend on each element alone (plus per-tensor step counts), so splitting a
# parameter into pieces changes nothing.
ELEMENTWISE_OPTIMIZERS = frozenset(
    optimizer_class(name).__name__ for name, kind in OPTIMIZERS.items() if kind.layout is ComputeLayout.ELEMENTWISE
)
# Need a closure or whole-parameter structure at every stage.
UNSUPPORTED_OPTIMIZERS = frozenset({"LBFGS", "SparseAdam"})


def optimizer_kind(name: str) -> OptimizerKind | None:
    """The table's entry for ``optimizer.type`` ``name`` (None: not in the table)."""
    return OPTIMIZERS.get(name.lower())


def check_optimizer_for_stage(config: OptimizerConfig, stage: Stage) -> type[torch.optim.Optimizer]:
    """The optimizer class, or a clear refusal when the stage cannot run it."""
    cls = optimizer_class(config.type)
    if cls.__name__ in UNSUPPORTED_OPTIMIZERS:
        raise NotImplementedError(
            f"optimizer.type = {config.type!r}: {cls.__name__} needs a closure or sparse gradients, "
            "which the engine does not provide at any stage"
        )
    if stage.shard_optimizer_state and optimizer_kind(config.type) is None:
        raise NotImplementedError(
            f"optimizer.type = {config.type!r}: {cls.__name__} is neither elementwise nor a whole-matrix optimizer "
            f"built here, so it cannot update the flat shards of zero_optimization.stage = {stage.level}; it runs at "
            f"stage 0 only. At all stages: {', '.join(sorted(ELEMENTWISE_OPTIMIZERS))}, and Muon"
        )
    return cls


def state_bytes_per_param(name: str, params: dict[str, Any], matrix_fraction: float = 0.0) -> float:
    """fp32 optimizer state per trainable parameter of optimizer ``name`` with ``params``; for
    a whole-matrix optimizer, ``matrix_fraction`` of them are its matrices, the rest its partner's."""
    kind = optimizer_kind(name)
    if kind is None:
        raise ValueError(f"no per-parameter state size known for optimizer {name!r}")
    if kind.partner_state_bytes is None:
        return kind.state_bytes(params)
    return matrix_fraction * kind.state_bytes(params) + (1 - matrix_fraction) * kind.partner_state_bytes(params)


# Optimizers with a fused CPU kernel (torch >= 2.4), the fast host step for offload.
FUSED_ON_HOST = frozenset({"Adam", "AdamW", "SGD", "Adagrad", "MuonWithAdamW"})


def build_optimizer(
    config: OptimizerConfig, stage: Stage, groups: list[dict[str, Any]], *, on_host: bool = False
) -> torch.optim.Optimizer:
    """``groups`` are torch param-group dicts whose ``params`` are the tensors to update.

    ``on_host`` (offload_optimizer): Adam, AdamW, SGD, Adagrad and Muon's AdamW half step with
    torch's fused CPU kernel unless the config chooses ``fused`` or ``foreach`` itself (measured
    on 50M fp32 parameters: fused 28 ms, DeepSpeed's compiled CPU Adam 30, foreach 212,
    per-tensor 345)."""
    cls = check_optimizer_for_stage(config, stage)
    params = dict(config.params)
    if on_host and cls.__name__ in FUSED_ON_HOST and "fused" not in params and "foreach" not in params:
        params["fused"] = True
    return cls(groups, **params)
