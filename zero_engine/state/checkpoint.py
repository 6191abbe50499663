"""Checkpoints: one format for every stage and world size.

Format (``docs/checkpoint-format.md``): a checkpoint is a directory ``DIR/TAG`` holding

- ``rank{r}.pt`` from every rank: its *pieces*, one per parameter range it owns
  (``name``, ``start``, ``numel`` in the flattened parameter), each with the fp32 master
  values and the optimizer state of that range, plus the rank's RNG states. Ranks own
  1/G of every unit at every stage (stage 0 too; G is the shard group size, all ranks by
  default), so saving is parallel and balanced. With hybrid sharding only the first shard
  group writes pieces: one copy per shard, not per replica (the others write their RNG).
- ``extra.pt`` from rank 0: what is not sharded (frozen parameters, buffers, parameters
  outside every param group), the engine's counters, the optimizer's param-group options,
  and the user's ``client_state``.
- ``manifest.json``: format version, shapes and aliases of every trainable parameter, the
  config, and every file with its size and SHA-256.

Nothing in it depends on the stage, the world size or the bucket size: loading assembles
each range a rank needs from whichever saved pieces cover it. ``DIR/latest`` names the newest
tag. How the files reach the disk atomically, are verified and read without running code is
`zero_engine.state.storage`'s; the plain ``state_dict`` of one process,
`zero_engine.state.consolidate`'s.

Failures: every phase ends with the ranks exchanging their outcome (`on_every_rank`), so an
error on one rank (a full disk, a read-only directory, a ``client_state`` that would not load
back) raises the same `CheckpointError` on every rank, and the staging directory is removed.
"""

from __future__ import annotations

import io
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..comm import Comm
from ..errors import CheckpointError
from . import storage
from .payload import (
    Counters, Resumable, extra_payload, manifest_of, rank_payload, restore_rng,
)
from .sources import Source, open_source
from .state_dict import ModelState
from .storage import EXTRA, MANIFEST, Checkpoint, rank_file


# ---------------------------------------------------------------------------------------------
# Saving


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


def save(
    state: Resumable,
    counters: Counters,
    directory: str | Path,
    tag: str,
    client_state: Any = None,
    writer: storage.FileWriter = storage.FILES,
) -> Path:
    """Write a checkpoint of ``state`` under ``directory``/``tag`` through ``writer``; returns
    its path. Collective."""
    root = Path(directory)
    staging = root / f".tmp-{tag}"
    comm = state.model.comm

    def checked_tag() -> str:
        storage.check_tag(tag)
        storage.check_root(root)
        return tag

    tags = on_every_rank(comm, "save_checkpoint", checked_tag)
    if len(set(tags)) > 1:
        raise CheckpointError(f"save_checkpoint: the ranks gave different tags ({', '.join(map(repr, tags))})")

    def prepare() -> None:
        if comm.rank == 0:
            _check_client_state(client_state)
            writer.finish_publish(root, tag)  # a re-save of this tag killed half-way
            shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
            staging.mkdir(parents=True)

    on_every_rank(comm, "save_checkpoint", prepare)

    def write() -> dict[str, dict[str, int | str]]:
        written = {rank_file(comm.rank): writer.write_file(staging / rank_file(comm.rank), rank_payload(state))}
        if comm.rank == 0:
            written[EXTRA] = writer.write_file(staging / EXTRA, extra_payload(state, counters, client_state))
        return written

    def publish_files() -> None:
        if comm.rank == 0:
            manifest = manifest_of(state, counters, tag, files)
            writer.write_text(staging / MANIFEST, json.dumps(manifest, indent=1))
            writer.publish(root, staging, tag)

    def remove_staging() -> None:  # nothing half-written stays behind
        if comm.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)

    try:
        files: dict[str, dict[str, int | str]] = {}
        for rank_files in on_every_rank(comm, f"save_checkpoint to {staging}", write, remove_staging):
            files.update(rank_files)
        on_every_rank(comm, f"save_checkpoint publishing {root / tag}", publish_files, remove_staging)
    except BaseException:  # a peer that died mid-save, an interrupt: remove what this rank can
        remove_staging()
        raise
    return root / tag


def _check_client_state(client_state: Any) -> None:
    """``client_state`` must load back with ``weights_only=True`` (as every checkpoint file is
    read): checked in memory before anything is written, or the saved checkpoint, model
    included, would be refused at load."""
    buffer = io.BytesIO()
    try:
        torch.save(client_state, buffer)
        buffer.seek(0)
        torch.load(buffer, map_location="cpu", weights_only=True)  # a GPU tensor is not copied back to the GPU
    except Exception as err:  # noqa: BLE001 (pickling and weights-only refusals alike)
        detail = next((line for line in str(err).splitlines() if "Unsupported global" in line), str(err).splitlines()[0])
        raise ValueError(
            f"client_state would not load back ({detail.strip()}): checkpoints are read with "
            "torch.load(weights_only=True), which takes tensors, numbers, strings, None and lists, tuples and dicts "
            "of them; convert the rest (vars(args) for an argparse.Namespace, str() or .isoformat() for a datetime, "
            ".item() for a numpy scalar)"
        ) from None


# ---------------------------------------------------------------------------------------------
# Reading


class Loaded(NamedTuple):
    """What `load` gives back to the engine."""

    counters: Counters
    client_state: Any


def load(
    state: Resumable,
    directory: str | Path,
    tag: str | None = None,
    *,
    strict: bool = True,
    load_optimizer_states: bool = True,
) -> Loaded:
    """Restore ``state`` from a checkpoint saved at any stage and world size; returns the saved
    counters and ``client_state``."""
    model = state.model
    read: list[Any] = []  # checkpoint, piece index, extra.pt

    def open_and_check() -> None:
        source = open_source(directory, tag)
        read.append(source)
        _check_fit(model, source.checkpoint, source.extra, strict)
        if load_optimizer_states and state.optimizer is not None:
            _check_optimizer_type(source.checkpoint, state.optimizer)
            state.step.check_loadable(source.extra)
            if source.writer == "deepspeed":
                _check_schedule(state.step.lr_scheduler, source)

    # Every rank reads and checks first, then all restore or none does (a file missing on one
    # node's disk fails every rank, not that one alone): whatever can refuse is checked here,
    # so a refused load leaves the engine as it was.
    on_every_rank(model.comm, f"load_checkpoint from {directory}", open_and_check)
    checkpoint, index, extra, ignored, _ = read[0]
    if ignored and model.comm.rank == 0:
        warnings.warn(f"{checkpoint.path}: not restored (this engine has no such state): {', '.join(ignored)}", stacklevel=3)
    saved = checkpoint.manifest["params"]

    def restore() -> None:
        model.load_state(index, saved, extra["module"])
        if load_optimizer_states:
            state.step.load_state(index, extra, model.fitting(saved))
        if model.comm.rank < len(index.rng):
            restore_rng(index.rng[model.comm.rank], state.device)

    on_every_rank(model.comm, f"load_checkpoint from {checkpoint.path}", restore)
    return Loaded(Counters(extra["global_step"], extra["skipped_steps"]), extra["client_state"])


def _check_schedule(scheduler: Any, source: Source) -> None:
    """A DeepSpeed run's schedule position must fit this engine's scheduler: DeepSpeed's
    schedules (ours mirror them: ``last_batch_iteration``) or a torch scheduler's state
    (``last_epoch``) into the same kind. A schedule saved with none configured here is left
    (listed as not restored)."""
    saved = source.extra.get("lr_scheduler")
    if saved is None:
        return
    if scheduler is None:
        source.ignored.append(f"lr_scheduler (the schedule's position {saved}; this engine has no scheduler)")
        return
    ours = scheduler.state_dict()
    if isinstance(saved, dict) and set(saved) >= set(ours) and ("last_batch_iteration" in ours) == ("last_batch_iteration" in saved):
        return
    raise CheckpointError(
        f"{source.checkpoint.path}: the saved learning-rate schedule ({sorted(saved) if isinstance(saved, dict) else saved}) "
        f"does not fit this engine's {type(scheduler).__name__} ({sorted(ours)}): configure the schedule the run was "
        "saved with (scheduler.type and its params, as in its config), or load with load_optimizer_states=False"
    )


def _check_optimizer_type(checkpoint: Checkpoint, optimizer: torch.optim.Optimizer) -> None:
    """Optimizer state of another optimizer would fail at the first step (an SGD state has no
    ``exp_avg``); checkpoints from before the manifest said are not checked."""
    saved = checkpoint.manifest.get("optimizer")
    ours = type(optimizer).__name__
    if saved is not None and saved != ours:
        raise CheckpointError(
            f"{checkpoint.path / MANIFEST}: saved with optimizer {saved}, this engine's is {ours}: use the same "
            "optimizer.type, or load with load_optimizer_states=False to take the model alone"
        )


def _check_fit(model: ModelState, checkpoint: Checkpoint, extra: dict[str, Any], strict: bool) -> None:
    """Missing, unexpected and re-shaped entries, all listed at once."""
    ours = model.unit_param_shapes()
    ours.update({k: list(v.shape) for k, v in model.loose_state().items()})
    theirs = {name: entry["shape"] for name, entry in checkpoint.manifest["params"].items()}
    theirs.update({k: list(v.shape) for k, v in extra["module"].items()})
    excluded = set(checkpoint.manifest.get("excluded_frozen", ()))
    still_frozen = set(model.frozen_names())
    if "*" in excluded:  # a DeepSpeed checkpoint that recorded no frozen parameter
        excluded = still_frozen
    # Saved with exclude_frozen_parameters: the frozen weights come from the model as built (or weights=).
    missing = sorted(set(ours) - set(theirs) - (excluded & still_frozen))
    unexpected = sorted(set(theirs) - set(ours))
    reshaped = sorted(f"{k} (checkpoint {theirs[k]}, model {ours[k]})" for k in set(ours) & set(theirs) if ours[k] != theirs[k])
    message = misfit_message(str(checkpoint.path), missing, unexpected, reshaped)
    if message is None:
        return
    if excluded & set(missing):
        message += (
            f" ({', '.join(sorted(excluded & set(missing)))} were frozen when saved with "
            "exclude_frozen_parameters=True, so the checkpoint holds no values for them: freeze them as then, the "
            "model as built or weights= giving their values)"
        )
    if strict:
        raise CheckpointError(message + ". Load with strict=False to take what matches.")
    warnings.warn(message + "; loaded what matches", stacklevel=3)


def misfit_message(source: str, missing: list[str], unexpected: list[str], reshaped: list[str]) -> str | None:
    """What does not fit, all listed at once (None when everything fits)."""
    problems = [
        f"{label}: {', '.join(items)}"
        for label, items in (("missing", missing), ("unexpected", unexpected), ("re-shaped", reshaped))
        if items
    ]
    return f"{source} does not fit the model: " + "; ".join(problems) if problems else None


# ---------------------------------------------------------------------------------------------
# Consolidation: a plain state_dict, in one process


