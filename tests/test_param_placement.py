"""Placements on planned parameters (STRUCTURE item 4): the flat-range-to-boxes helper over
shapes and ranges in one process; a parameter cut on dim 0 over a 2-rank axis, flat-sharded
by ZeRO inside each of its groups, saves pieces that assemble to the global tensor; the compute
layout decided in the plan is what the matrix exchange is built from."""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict

import pytest
import torch
from torch import nn

from harness import run_on_ranks
from zero_engine.sharding.units.param_placement import Box, ComputeLayout, Placement, ShardedOn, flat_boxes


def _elements(shape: tuple[int, ...], box: Box) -> list[int]:
    """The flat indices of a box's elements, in row-major order."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    ranges = [range(o, o + s) for o, s in zip(box.offsets, box.sizes)]
    return [sum(i * st for i, st in zip(index, strides)) for index in itertools.product(*ranges)]


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (1, 5), (4, 1, 3), (2, 2, 2, 3)])
def test_flat_boxes_cover_every_range_in_order(shape: tuple[int, ...]) -> None:
    total = math.prod(shape)
    for start in range(total + 1):
        for numel in range(total - start + 1):
            boxes = flat_boxes(shape, start, numel)
            covered = [index for box in boxes for index in _elements(shape, box)]
            assert covered == list(range(start, start + numel)), (shape, start, numel, boxes)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
            assert all(box.numel > 0 for box in boxes)
    assert flat_boxes((3, 4), 2, 9) == [Box((0, 2), (1, 2)), Box((1, 0), (1, 4)), Box((2, 0), (1, 3))]
    with pytest.raises(ValueError, match="are not in a tensor of shape"):
        flat_boxes(shape, total, 1)


def test_a_cut_placement_knows_its_box_and_global_offsets() -> None:
    cut = Placement.cut((6, 5), [ShardedOn("expert", 0)], {"expert": 1}, {"expert": 2}, "w")
    assert cut.box == Box((3, 0), (3, 5)) and cut.local_shape == (3, 5) and not cut.replicated
    assert cut.global_start(4) == 19  # row 3 of 6, then 4 elements in
    assert cut.global_boxes(4, 3) == [Box((3, 4), (1, 1)), Box((4, 0), (1, 2))]
    columns = Placement.cut((6, 4), [ShardedOn("tensor", 1)], {"tensor": 1}, {"tensor": 2})
    assert columns.box == Box((0, 2), (6, 2))
    with pytest.raises(NotImplementedError, match="is not one flat range of it"):
        columns.global_start(0)
    assert columns.global_boxes(1, 2) == [Box((0, 3), (1, 1)), Box((1, 2), (1, 1))]
    with pytest.raises(ValueError, match="'w' of shape \\(5, 4\\) does not split along dim 0 into 2 equal parts"):
        Placement.cut((5, 4), [ShardedOn("expert", 0)], {"expert": 0}, {"expert": 2}, "'w'")
    whole = Placement.whole((6, 5))
    assert whole.replicated and whole.global_start(7) == 7 and whole.box == Box((0, 0), (6, 5))


GLOBAL = torch.arange(30, dtype=torch.float32).view(6, 5) / 7


def _cut_unit_pieces(rank: int, world_size: int) -> dict:
    """A 4-rank mesh (shard 2 x widget 2): the parameter cut on dim 0 over ``widget``, each
    widget rank's box flat-sharded by ZeRO over its ``zero`` group of 2 (pieces cut mid-row)."""
    from zero_engine.comm import GroupComm, Mesh
    from zero_engine.comm.connecting import make_comm
    from zero_engine.sharding.units.unit import FlatUnit

    mesh = Mesh.of(shard=2, widget=2)
    comm = make_comm(mesh, GroupComm(rank, world_size, "gloo", None, None), None, 60.0)
    placement = Placement.cut(GLOBAL.shape, [ShardedOn("widget", 0)], mesh.coordinates(rank), dict(mesh.axes))
    rows = slice(placement.box.offsets[0], placement.box.offsets[0] + placement.box.sizes[0])
    param = nn.Parameter(GLOBAL[rows].clone())
    unit = FlatUnit([param], ["w"], [0], comm.shard_rank, comm.num_shards, placements=[placement])
    pieces = unit.optimizer_shard.state_pieces()
    return {"pieces": pieces, "global_shape": unit.global_shape(0), "local_shape": tuple(param.shape)}


def test_a_parameter_cut_on_dim_0_over_a_2_rank_axis_consolidates_to_the_global_tensor() -> None:
    from zero_engine.state.payload import PieceIndex

    found = run_on_ranks(4, _cut_unit_pieces)
    assert {r["global_shape"] for r in found} == {(6, 5)} and {r["local_shape"] for r in found} == {(3, 5)}
    starts = sorted(piece["start"] for r in found for piece in r["pieces"])
    assert starts == [0, 8, 15, 23]  # each box's two ZeRO shards, in global coordinates
    index = PieceIndex(piece for r in found for piece in r["pieces"])
    assert torch.equal(index.assemble("w", 0, 30).view(6, 5), GLOBAL)


def test_the_compute_layout_is_decided_in_the_plan() -> None:
    from zero_engine import load_config
    from zero_engine.matrix_step import compute_layouts
    from zero_engine.param_groups import ParamGroup
    from zero_engine.sharding.units.module_plan import ModulePlan
    from zero_engine.sharding.units.unit_plan import UnitPlan

    model = nn.Sequential(OrderedDict(embed=nn.Embedding(8, 4), proj=nn.Linear(4, 4)))
    names = [name for name, _ in model.named_parameters()]
    groups = [ParamGroup({}, names, list(model.parameters()))]
    modules = ModulePlan(model, groups, load_config({"train_micro_batch_size_per_gpu": 1}).zero_optimization)
    plan = UnitPlan.derive(model, modules, groups, False, torch.float32, 1 << 20, compute_layout=compute_layouts("muon"))
    layouts = {p.name: p.placement.compute for unit in plan.whole for p in unit.params}
    assert layouts == {"embed.weight": ComputeLayout.ELEMENTWISE, "proj.weight": ComputeLayout.WHOLE_MATRIX,
                       "proj.bias": ComputeLayout.ELEMENTWISE}  # DeepSpeed's rule: matrices, no embedding
    assert compute_layouts("adamw") is None
    plain = UnitPlan.derive(model, modules, groups, False, torch.float32, 1 << 20)
    assert {p.placement.compute for unit in plain.whole for p in unit.params} == {ComputeLayout.ELEMENTWISE}
