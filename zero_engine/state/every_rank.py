"""Every rank's outcome of a phase, exchanged: an error on one rank raises on all of them.

Checkpoints and exports run in phases (check, write, publish; read and check, restore); each
ends with `on_every_rank`, so a full disk, a read-only directory or a missing file on one node
raises the same error on every rank, and no rank goes on into collectives the others never join.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..comm import Comm
from ..errors import CheckpointError


def on_every_rank(
    comm: Comm, action: str, work: Callable[[], Any], on_failure: Callable[[], None] | None = None
) -> list[Any]:
    """Run ``work`` here, then exchange every rank's outcome: its (JSON) result, or the error it
    raised. When any rank failed, every rank raises the same error naming each failed rank and
    its error, so no rank goes on into collectives the others never join: a `CheckpointError`,
    or a `FileNotFoundError` when every failure was one (a job's "no checkpoint yet, start
    fresh" test). One process raises its own error unchanged. ``on_failure`` runs first on
    every rank, and no rank raises before every rank has run it."""
    local: Exception | None = None
    try:
        outcome: dict[str, Any] = {"result": work()}
    except Exception as err:  # noqa: BLE001 (every failure must reach the other ranks)
        local, outcome = err, {"error": f"{type(err).__name__}: {err}", "type": type(err).__name__}
    outcomes = comm.all_gather_json(outcome)
    failed = [item for item in outcomes if "error" in item]
    if failed and on_failure is not None:
        on_failure()
        comm.each_rank(0).values()  # every rank has run it (on the control group, as every agreement)
    if local is not None and len(outcomes) == 1:
        raise local
    if failed:
        described = "; ".join(f"rank {rank}: {item['error']}" for rank, item in enumerate(outcomes) if "error" in item)
        error = FileNotFoundError if all(item["type"] == "FileNotFoundError" for item in failed) else CheckpointError
        raise error(f"{action} failed on {len(failed)} of {len(outcomes)} ranks (every rank raises this): {described}") from local
    return [item["result"] for item in outcomes]
