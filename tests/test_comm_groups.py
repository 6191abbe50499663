"""Which process group carries which traffic, and which primitives run, in real processes.

Control traffic (agreements between ranks, JSON exchanges) must use a gloo group of its own
with CPU tensors, even when data uses NCCL: NCCL cannot all-reduce a CPU tensor, and a control
exchange queued behind data collectives would stall. Every ``torch.distributed`` call the
engine makes is recorded with the `Comm` method that made it and the group it used, over a
training step, a save, a load and a state export at stage 1 and stage 3.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict

import pytest
import torch.distributed as dist

import zero_engine
from harness import NATIVE, recorded_collectives, run_on_ranks
from models import decay_groups, make_model, train_engine

CONTROL_METHODS = {"each_rank", "all_gather_json"}
# What each recorded torch function implements (gloo's per-shard primitives: reduce, broadcast).
KINDS = {
    "reduce": "reduce_scatter", "_reduce_scatter_tensor": "reduce_scatter", "broadcast": "all_gather",
    "_all_gather_into_tensor": "all_gather", "all_reduce": "all_reduce", "isend": "gather", "irecv": "gather",
    "all_gather": "all_gather", "barrier": "barrier",
}


def record_traffic(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    results = []
    made: list = []  # the backend each group the engine makes is asked for (None: the default's)
    new_group = dist.new_group
    dist.new_group = lambda **kwargs: made.append(kwargs.get("backend")) or new_group(**kwargs)
    for case in cases:
        calls: list = []
        model = make_model()
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": {
                "stage": case["stage"], "reduce_bucket_size": 40, "stage3_param_persistence_threshold": 0,
                "shard_group_size": case.get("shard_group_size"),
            },
            "comm": {"primitives": case["primitives"]},
        }
        engine = zero_engine.initialize(model, config, param_groups=decay_groups(model))
        dist.new_group = new_group
        with recorded_collectives(calls):
            train_engine(engine, rank, world_size, range(1), 2, 1)
            step_calls = len(calls)
            engine.full_state_dict(rank0_only=True)
            export_calls = (step_calls, len(calls))
            with tempfile.TemporaryDirectory() as tmp:
                directory = engine.comm.all_gather_json(tmp)[0]  # rank 0's directory for everyone
                engine.save_checkpoint(directory)
                engine.load_checkpoint(directory)
                engine.comm.barrier()
            engine.full_state_dict()
        roles = {id(engine.comm.control_group): "control", id(engine.comm.world.group): "data"}
        if engine.comm.num_replicas > 1:  # hybrid: the shard and replica groups are groups of their own
            shard_group, replica_group = engine.comm.shard_group.group, engine.comm.replica_group.group
            roles.update({id(shard_group): "shard_group", id(replica_group): "replica_group"})
        if engine.comm.reduce_group is not engine.comm.shard_group:  # stage 3: reduce-scatters apart
            roles[id(engine.comm.reduce_group.group)] = "reduce_group"
        groups = defaultdict(set)
        for method, function, group, _ in calls:
            groups[method, function].add(roles.get(id(group), "other"))
        data_bytes: dict[str, int] = defaultdict(int)  # by collective kind, on data groups, in the step
        for method, function, group, nbytes in calls[: step_calls]:
            if roles.get(id(group), "other") != "control":
                data_bytes[KINDS[function]] += nbytes
        export_bytes = {kind: sum(nbytes for _, function, _, nbytes in calls[slice(*export_calls)] if function == kind)
                        for kind in ("isend", "irecv")}
        results.append({
            "calls": {f"{method}:{function}": sorted(roles) for (method, function), roles in groups.items()},
            "control_backend": dist.get_backend(engine.comm.control_group),
            "step_bytes": dict(data_bytes),
            "export_gather_bytes": export_bytes,
            "num_params": sum(len(unit.params) for unit in engine.units),
            "num_units": len(engine.units),
            "root_unit_bytes": sum(
                4 * engine.gatherer.units[index].layout.padded_numel for index in engine.gatherer.root_units
            ),
            "frozen_unit_bytes": sum(4 * unit.layout.padded_numel for unit in engine.frozen_units),
            "groups_made": made,
        })
        engine.close()
    return results


CASES = [{"stage": 1, "primitives": "native"}, {"stage": 3, "primitives": "native"}, {"stage": 3, "primitives": "auto"}]


@pytest.fixture(scope="module")
def traffic() -> list[list[dict]]:
    """One spawn of 3 ranks (padded units; (N-1)/N differs from 1/N) for the tests below."""
    return run_on_ranks(3, record_traffic, CASES)


def test_control_traffic_uses_a_gloo_group_and_data_the_data_group(traffic: list[list[dict]]) -> None:
    per_rank = traffic
    # Data follows the default group's backend (NCCL on GPUs); control is gloo whatever it is.
    assert sorted(per_rank[0][0]["groups_made"], key=str) == [None, "gloo"]
    for case, result in zip(CASES, per_rank[0]):
        assert result["control_backend"] == "gloo"
        calls = result["calls"]
        assert any(key.startswith("each_rank") for key in calls), calls  # call rows; stage 3's rounds too
        assert any(key.startswith("all_gather_json") for key in calls), calls
        for key, roles in calls.items():
            method = key.split(":")[0]
            expected = ["control"] if method in CONTROL_METHODS else ["data"]
            if case["stage"] == 3 and _reduces(key):  # a group of their own beside the gathers
                expected = ["reduce_group"]
            assert roles == expected, (case, key, roles)
        native = {key.split(":")[1] for key in calls} & set(NATIVE)
        if case["primitives"] == "native":
            assert native == set(NATIVE), calls
            assert not any(key.startswith("_shard_by_shard") for key in calls), calls
        else:  # gloo's default: one rooted collective per shard
            assert not native and {"_shard_by_shard:reduce", "_shard_by_shard:broadcast"} <= set(calls), calls


def test_bytes_handed_to_torch_distributed_follow_the_formulas(traffic: list[list[dict]]) -> None:
    """Counted from the recorded ``torch.distributed`` calls, not from `comm_report()`: in one
    step of Ψ trainable elements in U units over N ranks, the gradients are reduce-scattered
    once (Ψ plus padding, fp32), stage 1 all-gathers the updated parameters once and stage 3
    gathers every unit twice (its forward and its backward) but the root unit once (it stays
    gathered from the forward into the backward), the frozen layer's unit too (never reduced),
    the only all-reduce is the used-mask and norm (8 bytes per parameter, plus one), and a
    rank-0 export sends each other rank's shard straight to rank 0, frozen ones included."""
    psi, n = sum(p.numel() for p in make_model().parameters() if p.requires_grad), 3
    for rank, per_case in enumerate(traffic):
        for case, result in zip(CASES, per_case):
            sent, label = result["step_bytes"], (rank, case)
            padding = 4 * (n - 1) * result["num_units"]
            assert 4 * psi <= sent["reduce_scatter"] <= 4 * psi + padding, (label, sent)
            assert sent["reduce_scatter"] % n == 0, (label, sent)
            if case["stage"] == 3:
                assert result["root_unit_bytes"] > 0, label  # the model has a root unit: the case is real
                assert result["frozen_unit_bytes"] > 0, label  # and a frozen unit, gathered, not reduced
                gathered = 2 * (sent["reduce_scatter"] + result["frozen_unit_bytes"]) - result["root_unit_bytes"]
                assert sent["all_gather"] == gathered, (label, sent)
            else:
                assert sent["all_gather"] == sent["reduce_scatter"], (label, sent)
            assert sent["all_reduce"] == 8 * (result["num_params"] + 1), (label, sent)
            # below stage 3 rank 0 has it all
            shards = (sent["reduce_scatter"] + result["frozen_unit_bytes"]) // n if case["stage"] == 3 else 0
            exported = {"isend": 0, "irecv": (n - 1) * shards} if rank == 0 else {"isend": shards, "irecv": 0}
            assert result["export_gather_bytes"] == exported, (label, result["export_gather_bytes"])
            assert set(sent) == {"reduce_scatter", "all_gather", "all_reduce"}, (label, sent)


HYBRID = [
    {"stage": 1, "primitives": "auto", "shard_group_size": 2},
    {"stage": 3, "primitives": "native", "shard_group_size": 2},
]


def _reduces(key: str) -> bool:
    """A recorded ``method:function`` that implements a reduce-scatter."""
    method, function = key.split(":")
    return method == "reduce_scatter_sum" or (method == "_shard_by_shard" and function == "reduce")


def test_hybrid_sharding_keeps_shard_traffic_inside_groups() -> None:
    """4 ranks as 2 groups of 2: reduce-scatters and gathers run in the shard group, only
    all-reduces of a shard in the replica group, agreements on the control group."""
    per_rank = run_on_ranks(4, record_traffic, HYBRID)
    # Besides data and control: two shard groups and two replica groups, each made by every rank.
    assert per_rank[0][0]["groups_made"] == [None, "gloo", None, None, None, None]
    for case, result in zip(HYBRID, per_rank[0]):
        calls = result["calls"]
        for key, roles in calls.items():
            method = key.split(":")[0]
            if method in CONTROL_METHODS:
                assert roles == ["control"], (case, key, roles)
            elif method == "all_reduce_sum":  # the agreement over every rank, and shards across groups
                assert roles == ["data", "replica_group"], (case, key, roles)
            elif method in ("barrier", "broadcast"):
                assert roles == ["data"], (case, key, roles)
            elif case["stage"] == 3 and _reduces(key):
                assert roles == ["reduce_group"], (case, key, roles)
            else:
                assert roles == ["shard_group"], (case, key, roles)
        assert calls.get("all_reduce_sum:all_reduce") == ["data", "replica_group"], calls


def test_the_mesh_lays_ranks_out_once():
    """Shard groups of consecutive ranks, replicas at the same place in each: the one layout
    `connect` makes groups from and `Comm` reports; counts by use, not the world size."""
    from zero_engine.comm import Comm, GroupComm, Mesh

    mesh = Mesh.for_world(6, 3)
    assert mesh.names == ("replicate", "shard", "sequence")
    assert (mesh.size("replicate"), mesh.size("zero"), mesh.world, mesh.batch, mesh.grad_divisor) == (2, 3, 6, 6, 6)
    assert mesh.groups("zero") == [(0, 1, 2), (3, 4, 5)]
    assert mesh.groups("replicate") == [(0, 3), (1, 4), (2, 5)]
    assert mesh.group_of("zero", 4) == (3, 4, 5) and mesh.group_of("replicate", 4) == (1, 4)
    assert mesh.as_manifest() == {"replicate": 2, "shard": 3, "sequence": 1}
    with pytest.raises(ValueError, match="shard group size 4 does not divide the world size 6"):
        Mesh.for_world(6, 4)
    with pytest.raises(ValueError, match="mesh degree shard must be a positive integer, not 0"):
        Mesh.of(replicate=1, shard=0)
    with pytest.raises(ValueError, match="are names of uses"):
        Mesh.of(zero=2)
    alone = Comm.alone()
    assert alone.mesh.world == 1 and alone.mesh.batch == 1 and alone.group("sequence").world_size == 1
    groups = {"world": GroupComm(0, 6, "none"), "zero": GroupComm(0, 3, "none"), "replicate": GroupComm(0, 2, "none")}
    assert Comm(mesh, groups).shard_group is groups["zero"]
    with pytest.raises(ValueError, match="has 2 ranks in a group of 'zero', not the 3 of the group given"):
        Comm(Mesh.for_world(6, 2), groups)


def test_sequence_groups_are_consecutive_ranks_inside_shard_groups():
    """``sequence_parallel_size``: consecutive ranks split a sequence and read the same samples;
    the batch counts the other ranks, and the gradients' sum over every rank is divided by it."""
    from zero_engine.comm import Mesh

    mesh = Mesh.for_world(8, 4, sequence=2)
    assert (mesh.world, mesh.batch, mesh.grad_divisor, mesh.size("zero")) == (8, 4, 4, 4)
    assert mesh.groups("sequence") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [mesh.rank_in("batch", rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert mesh.groups("zero") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    with pytest.raises(ValueError, match="a shard group of 4 ranks does not hold whole groups of 1 expert x 3 sequence ranks"):
        Mesh.for_world(8, 4, sequence=3)


def test_mesh_from_config_needs_no_processes():
    from zero_engine import ConfigError, load_config
    from zero_engine.comm import Mesh

    config = load_config({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2,
                          "zero_optimization": {"stage": 3, "shard_group_size": 4}})
    assert Mesh.from_config(config, 8) == Mesh.for_world(8, 4, sequence=2)
    with pytest.raises(ConfigError, match="sequence_parallel_size = 2 does not divide the world size 3"):
        Mesh.from_config(config, 3)
    with pytest.raises(ConfigError, match="does not divide zero_optimization.shard_group_size 3"):
        Mesh.from_config(config, 6, shard_group_size=3)


@pytest.mark.parametrize("seed", range(40))
def test_any_axes_in_any_order_partition_the_world(seed: int):
    """A property over random axis names, orders and degrees: each axis's and each use's groups
    partition the world, ``rank_in`` and ``group_index`` agree with ``groups``, and the last axis's
    ranks are neighbours."""
    import random

    from zero_engine.comm import Mesh

    rng = random.Random(seed)
    names = rng.sample(["replicate", "shard", "sequence", "expert", "tensor", "widget"], rng.randint(1, 5))
    mesh = Mesh(tuple((name, rng.randint(1, 4)) for name in names))
    uses = [*names, "world", "batch", "zero"]
    for use in uses:
        groups = mesh.groups(use)
        assert sorted(rank for group in groups for rank in group) == list(range(mesh.world)), (mesh, use)
        assert all(len(group) == mesh.size(use) for group in groups)
        for index, group in enumerate(groups):
            for place, rank in enumerate(group):
                assert (mesh.group_index(use, rank), mesh.rank_in(use, rank)) == (index, place), (mesh, use, rank)
                assert mesh.group_of(use, rank) == group
    last, degree = mesh.axes[-1]
    assert mesh.groups(last)[0] == tuple(range(degree))
    assert mesh.size("world") == mesh.size("batch") * mesh.degree("sequence") * mesh.degree("tensor")


def _a_test_axis(rank: int, world_size: int) -> dict:
    """A mesh with an axis the engine does not know (``widget``) gets a group of its own by its
    name from `make_comm`, whose collectives run over that axis's ranks only."""
    import torch

    from zero_engine.comm import GroupComm, Mesh
    from zero_engine.comm.connecting import make_comm

    mesh = Mesh.of(replicate=1, shard=2, sequence=1, widget=2)
    world = GroupComm(rank, world_size, "gloo", None, None)
    comm = make_comm(mesh, world, None, 60.0)
    widget = comm.group("widget")
    value = torch.tensor([float(rank)])
    widget.all_reduce_sum(value).wait()
    zero = torch.tensor([float(rank)])
    comm.shard_group.all_reduce_sum(zero).wait()
    return {"widget": (widget.rank, widget.world_size, value.item()), "zero": zero.item(),
            "scopes": sorted(key for key in comm.report() if key.endswith("_group"))}


def test_a_test_only_axis_gets_its_group_by_name():
    found = run_on_ranks(4, _a_test_axis)
    # widget is the last axis: ranks 0-1 and 2-3; zero (shard) is 0,2 and 1,3
    assert [r["widget"] for r in found] == [(0, 2, 1.0), (1, 2, 1.0), (0, 2, 5.0), (1, 2, 5.0)]
    assert [r["zero"] for r in found] == [2.0, 4.0, 2.0, 4.0]
    assert found[0]["scopes"] == ["inter_group", "intra_group", "widget_group"]
