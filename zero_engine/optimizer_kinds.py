"""The one table of optimizers: for each ``optimizer.type`` (lower-case), its class, how it
computes (its layout), the fp32 state it keeps per element it updates, and, for a whole-matrix
optimizer, which parameters it takes as matrices. The config's class lookup, the optimizer's
build, the unit plan's compute layouts and the memory formula all read it, so a new optimizer
is one row here.

An *elementwise* optimizer gives the same result on pieces of a parameter as on the whole
parameter (AdamW, SGD, ...). A *whole-matrix* one (Muon) needs each matrix whole for part of its
update: the engine gathers each on one owner (`zero_engine.sharding.optimizer_side.compute_layout`).
Its class must implement that split (`zero_engine.muon.MuonWithAdamW`: ``pending``,
``orthogonalise_matrix``, ``apply_orthogonal``, param groups marked ``use_muon``).

Imports `muon` alone of ours, so `config/` reads the classes from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from .muon import MuonWithAdamW, takes_muon


class ComputeLayout(str, Enum):
    """How an optimizer computes on a parameter."""

    ELEMENTWISE = "elementwise"  # each element from its own state (AdamW, SGD, ...): pieces as they lie
    WHOLE_MATRIX = "whole_matrix"  # part of the update needs the whole matrix (Muon: gathered on one rank)


@dataclass(frozen=True)
class OptimizerKind:
    """How an optimizer computes, and its fp32 state bytes per element it updates (from its
    params); a whole-matrix optimizer's partner (Muon's AdamW) has its own for the rest, and
    ``takes`` says which parameters are its matrices. ``cls`` None: torch.optim's class of the
    name."""

    layout: ComputeLayout
    state_bytes: Callable[[dict[str, Any]], int]
    partner_state_bytes: Callable[[dict[str, Any]], int] | None = None
    cls: type[torch.optim.Optimizer] | None = None
    takes: Callable[[str, torch.Tensor], bool] | None = None
    names: tuple[str, str] | None = None  # a whole-matrix optimizer's and its partner's, for the estimate


def _adam(params: dict[str, Any]) -> int:
    return 8 + (4 if params.get("amsgrad") else 0)


def _rmsprop(params: dict[str, Any]) -> int:
    return 4 + (4 if params.get("momentum", 0) else 0) + (4 if params.get("centered") else 0)


ELEMENTWISE, WHOLE_MATRIX = ComputeLayout.ELEMENTWISE, ComputeLayout.WHOLE_MATRIX

# By lower-case name, as ``optimizer.type`` is matched.
OPTIMIZERS: dict[str, OptimizerKind] = {
    **{name: OptimizerKind(ELEMENTWISE, _adam) for name in ("adam", "adamw", "adamax", "nadam", "radam")},
    "adadelta": OptimizerKind(ELEMENTWISE, lambda p: 8),  # square averages of gradients and updates
    "sgd": OptimizerKind(ELEMENTWISE, lambda p: 4 if p.get("momentum", 0) else 0),
    "rmsprop": OptimizerKind(ELEMENTWISE, _rmsprop),
    "rprop": OptimizerKind(ELEMENTWISE, lambda p: 8),  # previous gradient and step size
    "adagrad": OptimizerKind(ELEMENTWISE, lambda p: 4),  # sum of squares
    "asgd": OptimizerKind(ELEMENTWISE, lambda p: 4),  # averaged parameter
    # momentum; AdamW for the rest; DeepSpeed's rule (or use_muon) for which parameters are matrices
    "muon": OptimizerKind(WHOLE_MATRIX, lambda p: 4, _adam, cls=MuonWithAdamW, takes=takes_muon,
                          names=("Muon", "AdamW")),
}


def optimizer_kind(name: str) -> OptimizerKind | None:
    """The table's entry for ``optimizer.type`` ``name`` (None: not in the table)."""
    return OPTIMIZERS.get(name.lower())


def state_note(name: str, params: dict[str, Any], matrix_params: int) -> str | None:
    """What `zero-engine estimate` says of an optimizer's state when it is not one size for every
    parameter (a whole-matrix optimizer: its matrices', its partner's for the rest); None else."""
    kind = optimizer_kind(name)
    if kind is None or kind.partner_state_bytes is None:
        return None
    own, partner = kind.names or (name, "its partner")
    return (f"{own}: {matrix_params:,} matrix parameters with {kind.state_bytes(params)} bytes of state, "
            f"the rest {partner}'s {kind.partner_state_bytes(params)}")


def table_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """The classes the table names itself (beside torch.optim's, found by name)."""
    return {name: kind.cls for name, kind in OPTIMIZERS.items() if kind.cls is not None}
