"""Builds the torch optimizer named in the config over what the stage lets a rank update, from
one table of optimizers: how each computes (its layout) and the state it keeps.

At stage 0 that is the model's own parameters. From stage 1 on it is this rank's pieces of
them (1-D views into its shard), each piece its own optimizer tensor, so torch.optim keeps its
usual semantics piece by piece: a piece whose parameter got no gradient is skipped, state and
step count included. An *elementwise* optimizer gives the same result on pieces as on whole
parameters. A *whole-matrix* one (Muon) steps its matrices through the units' matrix exchanges
(`zero_engine.sharding.optimizer_side.compute_layout`). Any other is refused from stage 1 on.
"""

from __future__ import annotations

from typing import Any

import torch

from .config import OptimizerConfig, optimizer_class
from .optimizer_kinds import OPTIMIZERS, ComputeLayout, OptimizerKind, optimizer_kind  # noqa: F401 (re-exported)
from .stage import Stage


# Updates that depend on each element alone (plus per-tensor step counts), so splitting a
# parameter into pieces changes nothing.
ELEMENTWISE_OPTIMIZERS = frozenset(
    optimizer_class(name).__name__ for name, kind in OPTIMIZERS.items() if kind.layout is ComputeLayout.ELEMENTWISE
)
# Need a closure or whole-parameter structure at every stage.
UNSUPPORTED_OPTIMIZERS = frozenset({"LBFGS", "SparseAdam"})


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
