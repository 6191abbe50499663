"""Checkpoints: one format for every stage and world size, written atomically, read safely.

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
tag.

Atomicity: every rank writes into ``DIR/.tmp-TAG`` and fsyncs; once all ranks have reported
their files' checksums, rank 0 writes the manifest, renames the directory into place, and
only then replaces ``latest`` (write, fsync, ``os.replace``). A process killed at any point
leaves the previous checkpoint and ``latest`` untouched. Saving a tag again publishes the new
copy complete as ``DIR/.next-TAG`` first, which is what the tag resolves to while it exists;
then the old copy is renamed away and the new one renamed into place. A kill at any instant
leaves the tag loadable (old or new copy), and the next save finishes the move.

Failures: every phase ends with the ranks exchanging their outcome (`on_every_rank`), so an
error on one rank (a full disk, a read-only directory, a ``client_state`` that would not load
back) raises the same `CheckpointError` on every rank, and the staging directory is removed.

Safety: every file is checked against the manifest before use, and read with
``torch.load(weights_only=True)``: loading never runs code from a checkpoint. A tag, whether
given or read from ``latest``, is a plain name that resolves inside the checkpoint directory,
and the manifest is checked whole (its keys, their types, the files it must list) before any
tensor is read: a malformed checkpoint is a `CheckpointError` naming the file and what is wrong.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import shutil
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import save_file

from ..comm import Comm
from ..config import ZeroEngineConfig
from ..errors import CheckpointError
from ..sharding.optimizer_shard import OptimizerTarget
from ..sharding.unit import FlatUnit
from .state_dict import ModelState

FORMAT = "zero_engine/1"
MANIFEST, EXTRA, LATEST = "manifest.json", "extra.pt", "latest"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


class Counters(NamedTuple):
    """The engine's step counters, saved and restored with the state."""

    global_step: int
    skipped_steps: int


@dataclass(frozen=True)
class Resumable:
    """Everything a checkpoint saves and restores, handed over by the engine."""

    model: ModelState
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any  # with state_dict / load_state_dict, or None
    loss_scaler: Any  # likewise
    config: ZeroEngineConfig
    stage: int
    device: torch.device

    def targets(self) -> list[OptimizerTarget]:
        return [target for unit in self.model.units for target in unit.optim.targets]


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


def save(state: Resumable, counters: Counters, directory: str | Path, tag: str, client_state: Any = None) -> Path:
    """Write a checkpoint of ``state`` under ``directory``/``tag``; returns its path. Collective."""
    root = Path(directory)
    staging = root / f".tmp-{tag}"
    comm = state.model.comm

    def check_tag() -> str:
        _check_tag(tag)
        _check_root(root)
        return tag

    tags = on_every_rank(comm, "save_checkpoint", check_tag)
    if len(set(tags)) > 1:
        raise CheckpointError(f"save_checkpoint: the ranks gave different tags ({', '.join(map(repr, tags))})")

    def prepare() -> None:
        if comm.rank == 0:
            _check_client_state(client_state)
            _finish_publish(root, tag)  # a re-save of this tag killed half-way
            shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
            staging.mkdir(parents=True)

    on_every_rank(comm, "save_checkpoint", prepare)

    def write() -> dict[str, dict[str, int | str]]:
        written = {rank_file(comm.rank): _write(staging / rank_file(comm.rank), _rank_payload(state))}
        if comm.rank == 0:
            written[EXTRA] = _write(staging / EXTRA, _extra_payload(state, counters, client_state))
        return written

    def publish() -> None:
        if comm.rank == 0:
            manifest = _manifest(state, counters, tag, files)
            _write_text(staging / MANIFEST, json.dumps(manifest, indent=1))
            _publish(root, staging, tag)

    def remove_staging() -> None:  # nothing half-written stays behind
        if comm.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)

    try:
        files: dict[str, dict[str, int | str]] = {}
        for rank_files in on_every_rank(comm, f"save_checkpoint to {staging}", write, remove_staging):
            files.update(rank_files)
        on_every_rank(comm, f"save_checkpoint publishing {root / tag}", publish, remove_staging)
    except BaseException:  # a peer that died mid-save, an interrupt: remove what this rank can
        remove_staging()
        raise
    return root / tag


def _check_tag(tag: Any) -> None:
    if not _is_plain_name(tag) or tag == LATEST:
        raise ValueError(
            f"checkpoint tag {tag!r} must be a plain name (no '/' or '\\', not starting with '.', not 'latest')"
        )


def _is_plain_name(name: Any) -> bool:
    """A file or directory name of its own: no separator, not hidden, '.' or '..', not empty."""
    return isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and not name.startswith(".")


def _check_root(root: Path) -> None:
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"{root}: is a file, not a checkpoint directory; give a directory (it is made if missing)")


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


def _rank_payload(state: Resumable) -> dict[str, Any]:
    targets: dict[str, list[OptimizerTarget]] = defaultdict(list)
    for target in state.targets():
        targets[target.name].append(target)
    pieces = []
    model = state.model
    for unit in model.units if model.comm.replica_rank == 0 else ():  # replicas hold the same shards
        for piece in unit.layout.segments(unit.rank):
            name = unit.names[piece.param_index]
            start, numel = piece.param_offset, piece.numel
            master = unit.optim.master_of_shard[piece.shard_offset : piece.shard_offset + numel]
            saved = {}
            for target in targets[name]:  # the optimizer tensor holding element `start`
                if target.param_offset <= start < target.param_offset + target.tensor.numel():
                    saved = _slice_state(state.optimizer.state.get(target.tensor, {}), target, start, numel)
            # a copy: torch.save of a view would write the whole flat buffer behind it
            pieces.append({"name": name, "start": start, "numel": numel, "master": _to_host(master), "state": saved})
    return {"pieces": pieces, "rng": _rng_state(state.device)}


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy to save: on a GPU, no second copy of the state on the device."""
    return tensor.detach().to("cpu", copy=True)


def _slice_state(state: dict[str, Any], target: OptimizerTarget, start: int, numel: int) -> dict[str, Any]:
    """The part of one optimizer tensor's state that covers ``[start, start + numel)``."""
    sliced = {}
    offset = start - target.param_offset
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape == target.tensor.shape:
            sliced[key] = _to_host(value.reshape(-1)[offset : offset + numel])
        elif torch.is_tensor(value) and value.dim() > 0:
            if start == target.param_offset:  # not elementwise (stage 0 only): saved whole, once
                sliced[key] = _to_host(value)
        else:
            sliced[key] = _to_host(value) if torch.is_tensor(value) else value
    return sliced


def _extra_payload(state: Resumable, counters: Counters, client_state: Any) -> dict[str, Any]:
    return {
        "module": {k: _to_host(v) for k, v in state.model.loose_state().items()},
        "global_step": counters.global_step,
        "skipped_steps": counters.skipped_steps,
        "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in state.optimizer.param_groups],
        "lr_scheduler": state.lr_scheduler.state_dict() if state.lr_scheduler is not None else None,
        "loss_scaler": state.loss_scaler.state_dict() if state.loss_scaler is not None else None,
        "client_state": client_state,
    }


def _manifest(state: Resumable, counters: Counters, tag: str, files: dict[str, Any]) -> dict[str, Any]:
    model = state.model
    aliases: dict[int, list[str]] = defaultdict(list)
    for name, param in model.module.named_parameters(remove_duplicate=False):
        aliases[id(param)].append(name)
    params = {
        name: {"shape": list(shape), "aliases": aliases[id(param)]}
        for unit in model.units
        for name, param, shape in zip(unit.names, unit.params, unit.shapes)
    }
    return {
        "format": FORMAT,
        "tag": tag,
        "global_step": counters.global_step,
        "stage": state.stage,
        "world_size": model.comm.world_size,
        "shard_group_size": model.comm.num_shards,
        "optimizer": type(state.optimizer).__name__,
        "config": state.config.model_dump(mode="json"),
        "params": params,
        "files": files,
    }


def _write(path: Path, payload: Any) -> dict[str, int | str]:
    try:
        with open(path, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
    except (OSError, RuntimeError) as err:  # torch.save reports a full disk as a RuntimeError
        raise OSError(f"{path}: writing failed: {err}") from err
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _write_text(path: Path, text: str) -> None:
    try:
        with open(path, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        raise OSError(f"{path}: writing failed: {err}") from err


def _publish(root: Path, staging: Path, tag: str) -> None:
    """Move the finished checkpoint into place, then point ``latest`` at it, each atomically."""
    _fsync_dir(staging)
    final = root / tag
    if final.exists():  # re-saving a tag: the new copy is published whole before the old one moves
        os.rename(staging, _pending(root, tag))
        _fsync_dir(root)
        _finish_publish(root, tag)
    else:
        os.rename(staging, final)
    _fsync_dir(root)
    _write_text(root / f".{LATEST}.tmp", tag)
    os.replace(root / f".{LATEST}.tmp", root / LATEST)
    _fsync_dir(root)


def _pending(root: Path, tag: str) -> Path:
    """Where a complete new copy of an existing tag waits to replace it."""
    return root / f".next-{tag}"


def _finish_publish(root: Path, tag: str) -> None:
    """Put a pending new copy of ``tag`` in place of the old one (retired, then deleted); a
    kill at any point leaves one of them where `tag_path` finds it."""
    pending, final, retired = _pending(root, tag), root / tag, root / f".old-{tag}"
    shutil.rmtree(retired, ignore_errors=True)
    if not pending.exists():
        return
    if final.exists():
        os.rename(final, retired)
    os.rename(pending, final)
    _fsync_dir(root)
    shutil.rmtree(retired, ignore_errors=True)


def tag_path(root: Path, tag: str) -> Path:
    """The directory holding ``tag``: its pending new copy while a re-save is being moved into
    place (it exists only once complete), else ``root/tag``."""
    pending = _pending(root, tag)
    return pending if (pending / MANIFEST).is_file() else root / tag


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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


# ---------------------------------------------------------------------------------------------
# Reading


class Checkpoint(NamedTuple):
    path: Path
    manifest: dict[str, Any]


def open_checkpoint(directory: str | Path, tag: str | None = None) -> Checkpoint:
    """Resolve ``tag`` (default: ``latest``), check the manifest and verify every file against it."""
    root = Path(directory)
    _check_root(root)
    if tag is None:
        pointer = root / LATEST
        if not pointer.is_file():
            raise FileNotFoundError(f"{pointer}: no 'latest' file; is {root} a checkpoint directory?")
        tag = pointer.read_text().strip()
        _check_read_tag(root, tag, f"{pointer} names tag")
    else:
        _check_read_tag(root, tag, "tag")
    path = tag_path(root, tag)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{manifest_path}: missing; {path} is not a complete checkpoint")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{manifest_path}: corrupted ({err})") from None
    _check_manifest(manifest, manifest_path)
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in the manifest but missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{file}: {size} bytes, the manifest says {expected['bytes']} (truncated?)")
        if _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"{file}: checksum does not match the manifest (corrupted)")
    return Checkpoint(path, manifest)


def _check_read_tag(root: Path, tag: str, what: str) -> None:
    """A tag is a plain name, and it stays inside ``root`` once symbolic links are followed (a
    ``latest`` copied or edited by hand could point anywhere)."""
    if not _is_plain_name(tag) or tag == LATEST:
        raise CheckpointError(
            f"{what} {tag!r}: a tag is a plain name of a directory inside {root} (no '/', not starting with '.')"
        )
    for candidate in (root / tag, _pending(root, tag)):
        if candidate.exists() and candidate.resolve().parent != root.resolve():
            raise CheckpointError(
                f"{what} {tag!r}: {candidate} leads outside {root} (to {candidate.resolve()}); a checkpoint's tags "
                "are directories inside it"
            )


# What manifest.json must hold, and of which type (json's): checked before any file is read.
_MANIFEST_KEYS: dict[str, type | tuple[type, ...]] = {
    "format": str, "world_size": int, "params": dict, "files": dict,
}


def _check_manifest(manifest: Any, path: Path) -> None:
    """Every key the reader uses, of its type, and the files the world size implies listed: all
    problems at once, before any tensor is read."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: malformed: a JSON object is expected, found {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    problems = [
        f"{key!r} is missing" if key not in manifest else f"{key!r} is {type(manifest[key]).__name__}, not {kind.__name__}"
        for key, kind in _MANIFEST_KEYS.items()
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool)
    ]
    if not problems:
        problems += _manifest_entry_problems(manifest)
    if problems:
        raise CheckpointError(f"{path}: malformed: " + "; ".join(problems))


def _manifest_entry_problems(manifest: dict[str, Any]) -> list[str]:
    problems = []
    world_size, files = manifest["world_size"], manifest["files"]
    if world_size < 1:
        problems.append(f"world_size is {world_size}")
    for name, entry in files.items():
        if not _is_plain_name(name):
            problems.append(f"files lists {name!r}, not a file of this directory")
        elif not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)):
            problems.append(f"files[{name!r}] is {entry!r}, not {{'bytes': int, 'sha256': str}}")
    expected = [rank_file(rank) for rank in range(max(world_size, 0))] + [EXTRA]
    unlisted = [name for name in expected if name not in files]
    if unlisted:
        problems.append(f"world_size {world_size} needs {', '.join(unlisted)} in files, which lists {sorted(files)}")
    for name, entry in manifest["params"].items():
        shape, aliases = (entry.get("shape"), entry.get("aliases")) if isinstance(entry, dict) else (None, None)
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(aliases, list) and all(isinstance(a, str) for a in aliases)):
            problems.append(f"params[{name!r}] is {entry!r}, not {{'shape': [int], 'aliases': [str]}}")
    return problems


def _load(path: Path) -> Any:
    """A checkpoint file, read without running code from it; a refusal names the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        detail = next((line for line in str(err).splitlines() if "Unsupported global" in line), "")
        raise CheckpointError(
            f"{path}: refused by torch.load(weights_only=True), which never runs code from a file "
            f"({detail.strip() or str(err).splitlines()[0]}); only load it with weights_only=False if you trust "
            "whoever wrote it"
        ) from None


class PieceIndex:
    """Every saved piece of every parameter, to assemble any range from."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.pieces: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.rng: list[dict[str, Any]] = []
        for rank in range(checkpoint.manifest["world_size"]):
            payload = _load(checkpoint.path / rank_file(rank))
            self.rng.append(payload["rng"])
            for piece in payload["pieces"]:
                self.pieces[piece["name"]].append(piece)

    def covering(self, name: str, start: int, numel: int) -> list[dict[str, Any]]:
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
        checkpoint = open_checkpoint(directory, tag)
        read.extend([checkpoint, PieceIndex(checkpoint), _load(checkpoint.path / EXTRA)])
        _check_fit(model, checkpoint, read[2], strict)
        if load_optimizer_states:
            _check_optimizer_type(checkpoint, state.optimizer)

    # Every rank reads and checks first, then all restore or none does (a file missing on one
    # node's disk fails every rank, not that one alone).
    on_every_rank(model.comm, f"load_checkpoint from {directory}", open_and_check)
    checkpoint, index, extra = read
    saved = checkpoint.manifest["params"]
    shapes = model.unit_param_shapes()
    fitting = {name for name, shape in shapes.items() if name in saved and saved[name]["shape"] == shape}

    def saved_values(unit: FlatUnit, param_index: int, start: int, numel: int) -> torch.Tensor | None:
        name = unit.names[param_index]
        return index.assemble(name, start, numel) if name in fitting else None

    def restore() -> None:
        model.load_kept(saved_values)  # each rank assembles only the elements it keeps
        model.load_loose_state(extra["module"])
        if load_optimizer_states:
            _load_optimizer(state, index, extra, fitting)
            if state.lr_scheduler is not None and extra["lr_scheduler"] is not None:
                state.lr_scheduler.load_state_dict(extra["lr_scheduler"])
            if state.loss_scaler is not None and extra["loss_scaler"] is not None:
                state.loss_scaler.load_state_dict(extra["loss_scaler"])
        if model.comm.rank < len(index.rng):
            _restore_rng(index.rng[model.comm.rank], state.device)

    on_every_rank(model.comm, f"load_checkpoint from {checkpoint.path}", restore)
    return Loaded(Counters(extra["global_step"], extra["skipped_steps"]), extra["client_state"])


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


# Param-group options that choose torch's implementation, not the math: kept from the resuming
# run (offload picks the fused CPU kernel; a run without offload keeps torch's default).
IMPLEMENTATION_OPTIONS = frozenset({"foreach", "fused", "capturable", "differentiable"})


def _load_optimizer(state: Resumable, index: PieceIndex, extra: dict[str, Any], fitting: set[str]) -> None:
    """Group options, and the state of every piece whose parameter fits the checkpoint."""
    optimizer = state.optimizer
    groups = extra["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint has {len(groups)} optimizer param groups, the engine {len(optimizer.param_groups)}:"
            " pass the same param_groups, or load with load_optimizer_states=False"
        )
    for group, options in zip(optimizer.param_groups, groups):  # how to compute is this run's choice (offload)
        group.update({key: value for key, value in options.items() if key not in IMPLEMENTATION_OPTIONS})
    optimizer.state.clear()
    group_of = {param: group for group in optimizer.param_groups for param in group["params"]}
    for target in state.targets():
        if target.name not in fitting:
            continue
        numel = target.tensor.numel()
        pieces = index.covering(target.name, target.param_offset, numel)
        keys = {key for piece in pieces for key in piece["state"]}
        restored: dict[str, Any] = {}
        for key in keys:
            sample = next(p["state"][key] for p in pieces if key in p["state"])
            if _is_elementwise(pieces, key):
                values = index.assemble(target.name, target.param_offset, numel, key)
                assert values is not None
                restored[key] = values.view(target.tensor.shape).to(target.tensor.device)
            elif torch.is_tensor(sample):  # a scalar (step), or saved whole (stage 0 only)
                restored[key] = sample.clone().to(_state_device(key, group_of[target.tensor], target.tensor))
            else:
                restored[key] = sample
        if restored:
            optimizer.state[target.tensor] = restored


def _state_device(key: str, group: dict[str, Any], param: torch.Tensor) -> torch.device:
    """Where torch.optim keeps a non-elementwise state tensor, as its ``load_state_dict`` does:
    ``step`` on the host unless the group is ``capturable`` or ``fused`` (a step on the GPU
    would make every later update wait for the device), everything else beside the parameter."""
    if key == "step" and not (group.get("capturable") or group.get("fused")):
        return torch.device("cpu")
    return param.device


def _is_elementwise(pieces: list[dict[str, Any]], key: str) -> bool:
    """Saved as slices of the pieces' ranges (rather than a scalar or a whole tensor)."""
    values = [(p["state"][key], p["numel"]) for p in pieces if key in p["state"]]
    return all(torch.is_tensor(v) and v.dim() == 1 and v.numel() == numel for v, numel in values)


def _check_fit(model: ModelState, checkpoint: Checkpoint, extra: dict[str, Any], strict: bool) -> None:
    """Missing, unexpected and re-shaped entries, all listed at once."""
    ours = model.unit_param_shapes()
    ours.update({k: list(v.shape) for k, v in model.loose_state().items()})
    theirs = {name: entry["shape"] for name, entry in checkpoint.manifest["params"].items()}
    theirs.update({k: list(v.shape) for k, v in extra["module"].items()})
    missing = sorted(set(ours) - set(theirs))
    unexpected = sorted(set(theirs) - set(ours))
    reshaped = sorted(f"{k} (checkpoint {theirs[k]}, model {ours[k]})" for k in set(ours) & set(theirs) if ours[k] != theirs[k])
    message = misfit_message(str(checkpoint.path), missing, unexpected, reshaped)
    if message is None:
        return
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


def _restore_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    _restore_cuda_rng(state, device)


def _as_tuples(value: Any) -> Any:
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


# ---------------------------------------------------------------------------------------------
# Consolidation: a plain state_dict, in one process


def load_consolidated(directory: str | Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's full model as a plain fp32 ``state_dict`` (every alias of a tied
    parameter included), without torch.distributed."""
    checkpoint = open_checkpoint(directory, tag)
    index = PieceIndex(checkpoint)
    extra = _load(checkpoint.path / EXTRA)
    state: dict[str, torch.Tensor] = {}
    for name, entry in checkpoint.manifest["params"].items():
        numel = 1
        for dim in entry["shape"]:
            numel *= dim
        full = index.assemble(name, 0, numel)
        if full is None:
            raise CheckpointError(f"parameter {name!r}: no saved values")
        for alias in entry["aliases"]:
            state[alias] = full.view(entry["shape"]).to(torch.float32)
    for name, value in extra["module"].items():
        state[name] = value.clone()
    return state


def load_client_state(directory: str | Path, tag: str | None = None) -> Any:
    """The ``client_state`` the checkpoint was saved with, without torch.distributed."""
    return _load(open_checkpoint(directory, tag).path / EXTRA)["client_state"]


def write_state_dict(state: dict[str, torch.Tensor], out: str | Path) -> None:
    """Save ``state`` as ``.pt`` or ``.safetensors``, by the suffix of ``out``."""
    out = Path(out)
    if out.suffix == ".safetensors":
        unshared = {k: v.contiguous().clone() for k, v in state.items()}  # safetensors refuses shared storage
        write_atomically(out, lambda staging: save_file(unshared, str(staging)))
    elif out.suffix == ".pt":
        write_atomically(out, lambda staging: torch.save(state, staging))
    else:
        raise ValueError(f"{out}: unknown suffix {out.suffix!r}; use .pt or .safetensors")


def write_atomically(out: Path, write: Callable[[Path], Any]) -> Path:
    """``write`` a staging file beside ``out``, then put it in place: ``out`` is never half-written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.tmp")
    write(staging)
    os.replace(staging, out)
    return out
