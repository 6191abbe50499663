"""Collectives: the only package that calls ``torch.distributed``.

- `handles`: what a collective in flight returns (`Pending`, `Finishing`, `TwoPhase`) and the
  byte counter's kinds; no ``torch.distributed``, so codecs and reducers import it alone;
- `mesh`: `Mesh`, the rank layout as named axes (replicate, shard, sequence, any other) and the
  ranks by use (world, batch, zero: groups, counts, a rank's place): what code outside `comm/`
  asks instead of the world size;
- `groups`: `GroupComm` (one process group, its primitives and byte counts) and `Comm` (the
  engine's groups by use: world and control, zero, replicate, sequence, reduce, `Comm.group`);
- `connecting`: making those groups from the caller's process group or torchrun's environment
  (`make_comm`: one per use of the mesh), and (NCCL) their communicators, in one order on every
  rank.
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
