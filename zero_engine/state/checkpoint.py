"""Loading a checkpoint (saving is each format's writer: `formats.writing`, this engine's own
in `own_format`), from whichever format a probe finds there (ours, DeepSpeed's, a registered
one), at any stage and world size: every format reads into the same
`sources.Source` (pieces of each parameter, loose state, counters), which loading assembles
into the ranges each rank owns.

Failures: every phase ends with the ranks exchanging their outcome (`on_every_rank`), so an
error on one rank (a full disk, a read-only directory, a ``client_state`` that would not load
back) raises the same `CheckpointError` on every rank. A load reads and checks everything first
(names and shapes, the optimizer's type, the schedule), then every rank restores or none does.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..errors import CheckpointError
from . import formats
from .every_rank import on_every_rank
from .payload import Counters, Resumable, restore_rng
from .sources import Source
from .state_dict import ModelState
from .storage import MANIFEST, Checkpoint


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
        source = formats.open_source(directory, tag)
        read.append(source)
        _check_fit(model, source.checkpoint, source.extra, strict)
        if load_optimizer_states and state.optimizer is not None:
            _check_optimizer_type(source.checkpoint, state.optimizer)
            state.step.check_loadable(source.extra)
            if source.writer != "zero_engine":  # another program's schedule (DeepSpeed's, DCP's torch scheduler)
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
    # A format that lists every name (DCP's: a tied weight under each of its names) names our aliases too.
    aliases = {alias for entry in model.saved_params(with_frozen=True).values() for alias in entry["aliases"]}
    unexpected = sorted(set(theirs) - set(ours) - aliases)
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


