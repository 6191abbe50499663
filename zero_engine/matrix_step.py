"""A whole-matrix optimizer (Muon) over the units: which parameters it takes as matrices, its
param groups (each of the user's split in a matrix half and an elementwise half, as DeepSpeed
splits them), and each unit's `MatrixExchange` with the matrices' owners, chosen per window of
units that share their exchanges (`zero_engine.sharding.optimizer_side.compute_layout.plan_windows`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .comm import Comm
from .muon import matrix_shape, takes_muon
from .optim import ComputeLayout, optimizer_kind
from .param_groups import ParamGroup
from .sharding.optimizer_side.compute_layout import Matrix, MatrixExchange, assign_owners_by_window, matrix_cost, plan_windows
from .sharding.units.unit import FlatUnit
from .stage import Stage

MatrixParams = set[tuple[int, int]]  # (unit's index, parameter's index in the unit)


def compute_layouts(optimizer_type: str) -> Callable[[str, nn.Parameter], ComputeLayout] | None:
    """How ``optimizer_type`` computes on each parameter, for the unit plan: None for an
    elementwise optimizer (every parameter elementwise); for a whole-matrix one, whole-matrix on
    the parameters its table row takes as matrices (``takes``; Muon's: `zero_engine.muon.takes_muon`),
    a ``use_muon`` set on a parameter of fewer than two dimensions refused, naming it."""
    kind = optimizer_kind(optimizer_type)
    if kind is None or kind.layout is not ComputeLayout.WHOLE_MATRIX:
        return None
    takes = kind.takes or takes_muon

    def layout(name: str, param: nn.Parameter) -> ComputeLayout:
        if not takes(name, param):
            return ComputeLayout.ELEMENTWISE
        if param.dim() < 2:
            raise ValueError(
                f"parameter {name!r} has use_muon = True but shape {tuple(param.shape)}: Muon updates "
                "matrices (two or more dimensions); leave use_muon unset or False for it"
            )
        return ComputeLayout.WHOLE_MATRIX

    return layout


def matrix_params(units: list[FlatUnit]) -> MatrixParams:
    """The parameters the plan gave a whole-matrix compute layout (`compute_layouts`)."""
    return {
        (u, index) for u, unit in enumerate(units) for index, placement in enumerate(unit.placements)
        if placement.compute is ComputeLayout.WHOLE_MATRIX
    }


def split_groups(groups: list[ParamGroup], units: list[FlatUnit], matrices: MatrixParams) -> list[dict[str, Any]]:
    """Torch param groups over the units' optimizer targets: per user group, its matrices
    (``use_muon`` True) then the rest, each half present on every rank (empty where a rank
    holds none of it), so group indices agree between ranks."""
    halves: list[list[list[torch.Tensor]]] = [[[], []] for _ in groups]
    for u, unit in enumerate(units):
        for target in unit.optimizer_shard.targets:
            index = target.piece.param_index
            halves[unit.group_indices[index]][0 if (u, index) in matrices else 1].append(target.tensor)
    return [
        dict(group.options, params=tensors, use_muon=use_muon)
        for group, (matrix_half, rest) in zip(groups, halves)
        for tensors, use_muon in ((matrix_half, True), (rest, False))
    ]


def plan_exchanges(
    units: list[FlatUnit], matrices: MatrixParams, param_groups: list[dict[str, Any]], comm: Comm, stage: Stage
) -> int:
    """Give every unit with matrices its `MatrixExchange`: over the shard group where optimizer
    state is sharded (each rank steps its shard's pieces), else over every rank (each steps
    every matrix whole). Returns the number of matrices."""
    group, ranks = (comm.shard_group, comm.num_shards) if stage.shard_optimizer_state else (comm.world, comm.mesh.world)
    found = [
        (u, index, matrix_shape(units[u].global_shape(index))) for u, unit in enumerate(units)
        for index in range(len(unit.names)) if (u, index) in matrices
    ]
    costs = [matrix_cost(shape) for _, _, shape in found]
    with_matrices = sorted({u for u, _, _ in found})  # the units with matrices, in step order
    windows = [[with_matrices[w] for w in window] for window in plan_windows(
        [[cost for (u, _, _), cost in zip(found, costs) if u == unit] for unit in with_matrices], ranks)]
    owners = assign_owners_by_window(
        costs, [[i for i, (u, _, _) in enumerate(found) if u in window] for window in windows], ranks
    )
    closing = {window[-1] for window in windows}
    per_unit: dict[int, list[Matrix]] = {}
    for (u, index, shape), owner in zip(found, owners):
        unit = units[u]
        layout = unit.layout
        torch_group = param_groups[2 * unit.group_indices[index]]  # the matrix half (`split_groups`)
        per_unit.setdefault(u, []).append(
            Matrix(index, layout.param_offsets[index], layout.param_numels[index], shape, owner, torch_group)
        )
    for u, unit_matrices in per_unit.items():
        unit = units[u]
        if stage.shard_optimizer_state:
            ranges = [unit.layout.shard_range(rank) for rank in range(ranks)]
        else:
            ranges = [(0, unit.layout.padded_numel)] * ranks
        unit.optimizer_shard.matrices = MatrixExchange(
            unit_matrices, ranges, group, unit.device, replicated=not stage.shard_optimizer_state
        )
        unit.optimizer_shard.matrices.closes_window = u in closing
    return len(found)
