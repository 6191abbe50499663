"""Collectives: the only package that calls ``torch.distributed``.

- `handles`: what a collective in flight returns (`Pending`, `Finishing`, `TwoPhase`) and the
  byte counter's kinds; no ``torch.distributed``, so codecs and reducers import it alone;
- `mesh`: `Mesh`, the rank layout (replicate x shard) and the rank counts by use (batch,
  gradient divisor, shard): what code outside `comm/` asks instead of the world size;
- `groups`: `GroupComm` (one process group, its primitives and byte counts) and `Comm` (the
  engine's groups: data, control, shard, replica, reduce);
- `connecting`: making those groups from the caller's process group or torchrun's environment,
  and (NCCL) their communicators, in one order on every rank.
"""

from .connecting import choose_backend, connect, device_backend, make_data_communicators, with_stage_groups
from .groups import ABORTED, NOT_ABORTED, Comm, GroupComm, p2p_through_host
from .handles import DONE, CollectiveKind, EachRank, Finishing, Pending, TwoPhase
from .mesh import Mesh

__all__ = [
    "ABORTED", "DONE", "NOT_ABORTED", "CollectiveKind", "Comm", "EachRank", "Finishing", "GroupComm", "Mesh", "Pending",
    "TwoPhase", "choose_backend", "connect", "device_backend", "make_data_communicators", "p2p_through_host",
    "with_stage_groups",
]
