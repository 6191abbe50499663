"""What a checkpoint's files hold (format ``zero_engine/1``, ``docs/checkpoint-format.md``):
the payload of each rank's file, of ``extra.pt`` and of the manifest, made from the engine's
state, and the way back: every saved piece indexed to assemble any range, the optimizer state
of each piece restored, each rank's random generators.

`zero_engine.state.checkpoint` runs saving and loading across the ranks with these;
`zero_engine.state.storage` puts the files on disk and reads them back.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from ..config import ZeroEngineConfig
from ..errors import CheckpointError
from ..devices import saved_copy
from ..sharding.optimizer_side.optimizer_shard import SavedPiece
from .state_dict import ModelState
from . import storage
from .storage import FORMAT, Checkpoint, rank_file

class Counters(NamedTuple):
    """The engine's step counters, saved and restored with the state."""

    global_step: int
    skipped_steps: int


@dataclass(frozen=True)
class Resumable:
    """Everything a checkpoint saves and restores, handed over by the engine."""

    model: ModelState
    step: Stepping  # the optimizer, its schedule and scaler (`zero_engine.step.OptimizerStep`)
    config: ZeroEngineConfig
    stage: int
    device: torch.device
    exclude_frozen: bool = False  # save the trainable state only (DeepSpeed's exclude_frozen_parameters)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:  # None: an engine with nothing to train
        return self.step.optimizer


class Stepping(Protocol):
    """What a checkpoint saves and restores of the step (`zero_engine.step.OptimizerStep` and
    `NoOptimizerStep`): it reads and writes its own state."""

    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any

    def state_pieces(self) -> list[SavedPiece]: ...

    def extra_state(self) -> dict[str, Any]: ...

    def options_by_name(self) -> dict[str, dict[str, Any]]: ...

    def check_loadable(self, extra: dict[str, Any]) -> None: ...

    def load_state(self, saved: PieceIndex, extra: dict[str, Any], fitting: set[str]) -> None: ...


def rank_payload(state: Resumable) -> dict[str, Any]:
    model = state.model
    saves_shards = model.comm.replica_rank == 0  # replicas hold the same shards
    pieces = [*state.step.state_pieces(), *model.state_pieces(with_frozen=not state.exclude_frozen)] if saves_shards else []
    return {"pieces": pieces, "rng": _rng_state(state.device)}


def extra_payload(state: Resumable, counters: Counters, client_state: Any) -> dict[str, Any]:
    return {
        "module": {k: saved_copy(v) for k, v in state.model.loose_state(with_frozen=not state.exclude_frozen).items()},
        "global_step": counters.global_step,
        "skipped_steps": counters.skipped_steps,
        **state.step.extra_state(),  # param_groups, lr_scheduler, loss_scaler
        "client_state": client_state,
    }


def manifest_of(state: Resumable, counters: Counters, tag: str, files: dict[str, Any]) -> dict[str, Any]:
    model = state.model
    params = model.saved_params(with_frozen=not state.exclude_frozen)
    excluded = sorted(model.frozen_names()) if state.exclude_frozen else []
    return {
        "format": FORMAT,
        "tag": tag,
        "global_step": counters.global_step,
        "stage": state.stage,
        "world_size": model.comm.mesh.world,  # the rank files
        "shard_group_size": model.comm.num_shards,
        "mesh": model.comm.mesh.as_manifest(),  # the rank layout that wrote it (read at any other)
        "optimizer": type(state.optimizer).__name__ if state.optimizer is not None else None,
        "config": state.config.model_dump(mode="json"),
        "params": params,
        "excluded_frozen": excluded,  # left out by exclude_frozen_parameters: the model as built provides them
        "files": files,
    }


def _rng_state(device: torch.device) -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), **_cuda_rng_state(device)}


def _cuda_rng_state(device: torch.device) -> dict[str, Any]:
    """CUDA only: the generator of this rank's own GPU (not every visible one: the next run
    may see another number of GPUs per node)."""
    return {"cuda": torch.cuda.get_rng_state(device)} if device.type == "cuda" else {}


def _restore_cuda_rng(state: dict[str, Any], device: torch.device) -> None:
    """CUDA only: this rank's GPU generator, from a state saved by a rank on a GPU (older
    checkpoints saved a list, one state per visible GPU: take this rank's index)."""
    saved = state.get("cuda")
    if saved is None or device.type != "cuda":
        return
    if isinstance(saved, (list, tuple)):
        index = device.index or 0
        if index >= len(saved):
            return
        saved = saved[index]
    torch.cuda.set_rng_state(saved, device)


class PieceIndex:
    """Every saved piece of every parameter, to assemble any range from."""

    def __init__(self, pieces: Iterable[SavedPiece], rng: Sequence[dict[str, Any]] = ()) -> None:
        self.pieces: dict[str, list[SavedPiece]] = defaultdict(list)
        self.rng = list(rng)  # each saving rank's generators (none from another engine's checkpoint)
        for piece in pieces:
            self.pieces[piece["name"]].append(piece)

    @classmethod
    def read(cls, checkpoint: Checkpoint) -> PieceIndex:
        """Every rank file's pieces (memory-mapped)."""
        payloads = [checkpoint.read(rank_file(rank)) for rank in range(checkpoint.manifest["world_size"])]
        rng = [payload["rng"] for payload in payloads]  # None: converted from another engine's checkpoint
        return cls((piece for payload in payloads for piece in payload["pieces"]), rng if None not in rng else [])

    def covering(self, name: str, start: int, numel: int) -> list[SavedPiece]:
        return [p for p in self.pieces[name] if p["start"] < start + numel and start < p["start"] + p["numel"]]

    def assemble(self, name: str, start: int, numel: int, key: str | None = None) -> torch.Tensor | None:
        """Elements ``[start, start + numel)`` of parameter ``name``: its master values, or
        state ``key`` (None when no covering piece has that state)."""
        out: torch.Tensor | None = None
        covered = 0
        for piece in self.covering(name, start, numel):
            values = piece["master"] if key is None else piece["state"].get(key)
            if values is None:
                continue
            if out is None:
                out = torch.empty(numel, dtype=values.dtype, device="cpu")
            lo, hi = max(start, piece["start"]), min(start + numel, piece["start"] + piece["numel"])
            out[lo - start : hi - start] = values[lo - piece["start"] : hi - piece["start"]]
            covered += hi - lo
        if out is not None and covered != numel:
            raise CheckpointError(f"parameter {name!r}: saved pieces cover {covered} of elements [{start}, {start + numel})")
        return out


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    _restore_cuda_rng(state, device)


def _as_tuples(value: Any) -> Any:
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
