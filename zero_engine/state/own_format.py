"""This engine's own checkpoint format: its probe, reader and writer, the `formats` table's row
``zero_engine``.

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
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from ..comm import Comm
from ..errors import CheckpointError
from . import storage
from .every_rank import on_every_rank
from .payload import Counters, PieceIndex, Resumable, extra_payload, manifest_of, rank_payload
from .sources import Source
from .storage import EXTRA, MANIFEST, open_checkpoint, rank_file

NAME = "zero_engine"


def finds_own(directory: Path, tag: str | None) -> bool:
    """Whether ``directory``/``tag`` (tag None: what ``latest`` names) holds this format's manifest."""
    try:
        return (directory / storage.resolve_tag(directory, tag) / MANIFEST).is_file()
    except (OSError, CheckpointError):
        return False


def read_own(directory: Path, tag: str | None) -> Source:
    """The checkpoint, verified file by file against its manifest, and its pieces (mapped)."""
    checkpoint = open_checkpoint(directory, tag)
    try:
        return Source(checkpoint, PieceIndex.read(checkpoint), checkpoint.read(EXTRA), [], NAME)
    finally:
        checkpoint.close()  # what was read stays mapped


def save_own(
    state: Resumable,
    counters: Counters,
    directory: str | Path,
    tag: str,
    client_state: Any = None,
    writer: storage.FileWriter = storage.FILES,
) -> Path:
    """Write a checkpoint of ``state`` under ``directory``/``tag`` through ``writer``; returns
    its path. Collective."""

    def write(staging: Path) -> dict[str, dict[str, int | str]]:
        written = {rank_file(comm.rank): writer.write_file(staging / rank_file(comm.rank), rank_payload(state))}
        if comm.rank == 0:
            written[EXTRA] = writer.write_file(staging / EXTRA, extra_payload(state, counters, client_state))
        return written

    def manifest(staging: Path, results: list[dict[str, dict[str, int | str]]]) -> None:
        files = {name: entry for rank_files in results for name, entry in rank_files.items()}
        writer.write_text(staging / MANIFEST, json.dumps(manifest_of(state, counters, tag, files), indent=1))

    comm = state.model.comm
    return save_staged(comm, directory, tag, client_state, writer, write, manifest)


def save_staged(
    comm: Comm,
    directory: str | Path,
    tag: str,
    client_state: Any,
    writer: storage.FileWriter,
    write: Callable[[Path], Any],
    manifest: Callable[[Path, list[Any]], None],
) -> Path:
    """A save in phases, each agreed by every rank (`on_every_rank`): the tag and root checked;
    the staging directory made; every rank's ``write`` into it (its JSON result gathered); rank
    0's ``manifest`` of the results, then the directory published (`storage.publish`). Any
    failure removes the staging directory. Every format this engine writes saves through it."""
    root = Path(directory)
    staging = root / f".tmp-{tag}"

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

    def publish_files() -> None:
        if comm.rank == 0:
            manifest(staging, results)
            writer.publish(root, staging, tag)

    def remove_staging() -> None:  # nothing half-written stays behind
        if comm.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)

    try:
        results = on_every_rank(comm, f"save_checkpoint to {staging}", lambda: write(staging), remove_staging)
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
