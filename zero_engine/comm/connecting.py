"""Connecting: the engine's process groups, made from the caller's group or torchrun's environment.

`connect` settles the `Mesh` (the rank layout) and makes the data group (the device's backend),
the control group (gloo) and a group per use the mesh names (`make_comm`: the shard and replica
groups of hybrid sharding, the sequence groups, any other axis); `with_stage_groups` adds stage
3's group for reduce-scatters once the stage is known. Every rank calls them at the same point
(``new_group`` is collective).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..config import ZeroEngineConfig
from ..devices import local_cuda_device
from ..errors import ConfigError
from ..stage import Stage
from .groups import Comm, GroupComm, own_group
from .mesh import Mesh, check_sequence_fits

def connect(config: ZeroEngineConfig, device: torch.device) -> Comm:
    """The engine's `Comm`: groups of its own beside the caller's default group (so its
    collectives time out after ``comm.timeout_s`` whatever the caller chose), a new default
    group from torchrun's environment, or world size 1 without ``torch.distributed``. What
    the stage adds comes once it is known (`with_stage_groups`: ``stage: auto`` is agreed
    over this one)."""
    timeout, primitives = config.comm.timeout_s, config.comm.primitives
    if dist.is_available() and dist.is_initialized():
        backend = device_backend(device)
        if backend == "nccl":  # read by each NCCL group as it is made: ours come next
            avoid_nccl_record_streams()
        data = own_group(timeout, "data", None)
    elif "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        config.zero_optimization.shard_group_size_for(1)  # a group size that needs more ranks fails here too
        for key in ("sequence_parallel_size", "expert_parallel_size"):
            if getattr(config, key) > 1:
                raise ConfigError(f"{key} = {getattr(config, key)} needs as many ranks: this process runs alone "
                                  "(launch with torchrun)")
        return Comm.alone(primitives)
    else:
        backend = choose_backend(config.comm.backend, device)
        options: dict[str, Any] = {}
        if backend == "nccl":
            avoid_nccl_record_streams()
            options["device_id"] = _bind_cuda_device()
        dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout), **options)
        data = None  # the default group
    rank, world_size = dist.get_rank(), dist.get_world_size()
    force = config.comm.force_collectives
    world = GroupComm(rank, world_size, backend, data, own_group(timeout, "control", "gloo"), primitives, force)
    check_sequence_fits(config.sequence_parallel_size, world_size)  # before the agreement on the shard group size
    size = _agreed_shard_group_size(config.zero_optimization.shard_group_size_for, world)
    return make_comm(Mesh.from_config(config, world_size, shard_group_size=size), world, data, timeout)


def expected_place() -> tuple[int, int]:
    """This process's (rank, world size) before the engine connects: the caller's process
    group's, else torchrun's environment's, else one rank (what `connect` will find)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return 0, 1


def make_comm(mesh: Mesh, world: GroupComm, data: Any, timeout_s: float) -> Comm:
    """The `Comm` of ``mesh`` over ``world`` (``data``: its process group): a group per use of
    ``mesh.communicators()``, made in that order on every rank."""
    groups = {"world": world}
    for use, role, own in mesh.communicators():
        group = _group_of_use(timeout_s, mesh, use, role, own, world.rank, data)
        groups[use] = GroupComm(mesh.rank_in(use, world.rank), mesh.size(use), world.backend, group, None,
                                world.primitives, world.force_collectives)
    owners = {axis: _owners_comm(mesh, axis, world, timeout_s) for axis in CUT_AXES if mesh.degree(axis) > 1}
    return Comm(mesh, groups, timeout_s, owners=owners)


CUT_AXES = ("expert",)  # axes parameters may be cut along: each gets its owners' groups (`Comm.owners_of`)


def _owners_comm(mesh: Mesh, axis: str, world: GroupComm, timeout_s: float, stage_reduce: bool = False) -> Comm:
    """The `Comm` of the ranks that hold the same part of a parameter cut along ``axis``: the
    groups of each use of ``mesh.without(axis)``, in ``mesh``'s global ranks (a group of its
    own per use, role ``owners:<axis>``; with ``stage_reduce``, stage 3's reduce group too)."""
    sub, rank = mesh.without(axis), world.rank
    uses = [("world", True)] + [(use, own) for use, _, own in sub.communicators()]
    groups: dict[str, GroupComm] = {}
    for use, _ in uses + ([("reduce", True)] if stage_reduce else []):
        axes = sub.axes_of("zero" if use == "reduce" else use)
        size = sub.size("zero" if use == "reduce" else use)
        role = f"owners:{axis}:{'reduce' if use == 'reduce' else 'data'}"
        made = [own_group(timeout_s, role, None, ranks) for ranks in mesh.groups_along(axes)] if size > 1 else []
        group = made[mesh.group_index_along(axes, rank)] if made else None
        groups[use] = GroupComm(mesh.rank_along(axes, rank), size, world.backend, group, None, world.primitives,
                                world.force_collectives)
    return Comm(sub, groups, timeout_s)


def _group_of_use(timeout_s: float, mesh: Mesh, use: str, role: str, own: bool, rank: int, data: Any) -> Any:
    """This rank's process group of ``use``: none for a group of one rank, the data group for
    one spanning the world (unless it needs its own: ``own``), else one of its own per group
    (every rank makes every group: ``new_group`` is collective), shared by ``role``."""
    size = mesh.size(use)
    if size == 1:
        return None
    if size == mesh.world and not own:
        return data
    groups = [own_group(timeout_s, role, None, ranks) for ranks in mesh.groups(use)]
    return groups[mesh.group_index(use, rank)]


def with_stage_groups(comm: Comm, stage: Stage) -> Comm:
    """``comm`` with what ``stage`` needs besides: at stage 3, reduce-scatters on a group of
    their own (`_reduce_group`), made as ``comm``'s groups were (timeout, primitives). Every rank
    calls it at the same point (``new_group`` is collective)."""
    size = comm.num_shards
    if not (stage.shard_parameters and size > 1):
        return comm
    assert comm.timeout_s is not None  # groups of more than one rank come from `connect`
    group = _reduce_group(comm.timeout_s, comm.mesh, comm.rank)
    reduces = GroupComm(
        comm.shard_rank, size, comm.backend, group, None, comm.world.primitives, comm.world.force_collectives
    )
    owners = {axis: _owners_comm(comm.mesh, axis, comm.world, comm.timeout_s, stage_reduce=True) for axis in comm.owners}
    return comm.with_group("reduce", reduces).with_owners(owners)


def make_data_communicators(comm: Comm, device: torch.device) -> None:
    """NCCL: make every data communicator of ``comm`` now, in one order on every rank (a
    one-element all-reduce on each: world, shard, replica, reduce and sequence groups), not at
    its first use.

    A communicator made on first use blocks the host in its setup until every member arrives.
    The engine's first use of the reduce and replica groups is inside a backward, where the
    order of a rank's collectives follows its data (a mixture of experts); a rank blocked in a
    reduce group's setup could wait for a peer blocked reading an agreement round that this
    rank would issue only after the setup (GPU review Q6). A group made with ``device_id``
    (torch 2.6 on) is set up eagerly anyway; on gloo every group connects when made."""
    if not comm.orders_on_device:
        return
    made: set[int] = set()
    for group in comm.data_groups:
        key = id(group.group)
        if group.skips_collectives or key in made:
            continue
        made.add(key)
        group.all_reduce_sum(torch.zeros(1, device=device)).wait()


def _agreed_shard_group_size(size_for: Callable[[int, int | None], int], world: GroupComm) -> int:
    """``zero_optimization.shard_group_size`` for this world, the same on every rank ('auto'
    reads each node's LOCAL_WORLD_SIZE, which could differ between nodes)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    size = size_for(world.world_size, int(local) if local else None)
    sizes = world.each_rank(size).values()
    if len(set(sizes)) > 1:
        raise ConfigError(
            f"zero_optimization.shard_group_size resolves differently on different ranks (rank: size "
            f"{dict(enumerate(sizes))}): with 'auto', every node must run the same number of ranks"
        )
    return size


def _reduce_group(timeout_s: float, mesh: Mesh, rank: int) -> Any:
    """Stage 3: a group of this rank's shard group's ranks for reduce-scatters alone. Gathers
    launch in the order the ranks agree on (`zero_engine.sharding.gathering.agreement`), reductions in
    unit order as gradients complete; on one group the two orders would have to interleave
    alike on every rank, which depends on which parameters got gradients where."""
    return _group_of_use(timeout_s, mesh, "zero", "reduce", True, rank, None)


def choose_backend(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def _bind_cuda_device() -> torch.device:
    """CUDA only: make this rank's GPU current; NCCL is told it too (``device_id``), so it
    binds its communicator eagerly to that GPU."""
    device = local_cuda_device()
    torch.cuda.set_device(device)
    return device


def device_backend(device: torch.device, group: Any = None) -> str:
    """The backend that moves ``device``'s tensors on ``group`` (the default group when None).

    ``dist.get_backend`` reports the string the group was made with, which may name a backend
    per device: ``init_process_group("cuda:nccl,cpu:gloo")`` (torchtitan-style scripts) reports
    that string, and a plain ``init_process_group()`` reports "undefined". Compared with "nccl",
    either turned every NCCL-specific path off (GPU review P1); the group's backend
    configuration names the backend of each device type."""
    config = dist.get_backend_config(group)  # "cuda:nccl", "cpu:gloo,cuda:gloo", "cpu:gloo,cuda:nccl"
    per_device = dict(entry.split(":", 1) for entry in config.split(",") if ":" in entry)
    return per_device.get(device.type) or dist.get_backend(group)


def avoid_nccl_record_streams() -> None:
    """CUDA only, before the first NCCL group: before torch 2.8, ProcessGroupNCCL records the
    inputs and outputs of async collectives on its stream, so storage freed with ``resize_(0)``
    (stage 3's gathered units) or a dropped bucket cannot be reused until the NCCL stream
    catches up; stage 3 never syncs the host in forward and backward, so about one gathered
    unit per unit of lead would stay allocated. ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` makes it
    keep the tensors alive until ``wait()`` instead (the default from torch 2.8). A value the
    user set is kept."""
    if _torch_version() < (2, 8):
        os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)
