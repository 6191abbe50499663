"""``zero-engine convert``: a checkpoint rewritten in another format, in one process. A
DeepSpeed ZeRO checkpoint into this engine's format one DeepSpeed rank's pieces at a time (each
becomes a rank file of ours; loading re-shards them to any stage and world size); any checkpoint
(ours, DeepSpeed's, DCP's) into this engine's format or DCP's (`convert_checkpoint`). Published as
`own_format.save_own` publishes: staged, then renamed into place, then ``latest``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from ..errors import CheckpointError
from . import dcp_format, formats, storage
from .deepspeed_checkpoint import Translated, read_deepspeed
from .sources import Source
from .storage import EXTRA, FORMAT, MANIFEST, rank_file


def convert_deepspeed(source: str | Path, out: str | Path, tag: str | None = None) -> tuple[Path, Translated]:
    """Write DeepSpeed's checkpoint ``source`` (tag: its latest) under ``out`` with the same tag."""
    translated = read_deepspeed(source, tag)
    tag = translated.checkpoint.path.name
    written = _published(Path(out), tag, lambda staging: _write_own(
        staging, tag, translated.pieces_by_rank, translated.extra, translated.checkpoint.manifest))
    return written, translated


def convert_checkpoint(
    source: str | Path, out: str | Path, tag: str | None = None, to: str = "zero_engine"
) -> tuple[Path, Source]:
    """Write the checkpoint ``source``/``tag`` (any format; tag: its latest) under ``out`` with
    the same tag in format ``to`` (``zero_engine`` or ``dcp``)."""
    if to not in ("zero_engine", dcp_format.NAME):
        raise ValueError(f"--to {to!r}: the formats written are 'zero_engine' and 'dcp'")
    found = formats.open_source(source, tag)
    if found.writer == to:
        raise CheckpointError(f"{found.checkpoint.path}: already a {to} checkpoint")
    if found.writer == "deepspeed" and to == "zero_engine":  # one rank file per DeepSpeed rank
        return convert_deepspeed(source, out, tag)[0], found
    root, tag = Path(out), found.checkpoint.path.name
    if to == dcp_format.NAME:
        return _published(root, tag, lambda staging: dcp_format.convert_to_dcp(found, staging, str(root / tag))), found
    manifest = found.checkpoint.manifest
    pieces = [piece for name in manifest["params"] for piece in found.index.pieces.get(name, ())]
    own = {"params": manifest["params"], "optimizer": manifest.get("optimizer"), "excluded_frozen": [], "config": None}
    return _published(root, tag, lambda staging: _write_own(staging, tag, [pieces], found.extra, own)), found


def _published(root: Path, tag: str, write: Callable[[Path], None]) -> Path:
    """``write`` into a staging directory, then published as ``root/tag`` (and ``latest``); a
    failure removes the staging directory."""
    storage.check_root(root)
    staging = root / f".tmp-{tag}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        write(staging)
        storage.finish_publish(root, tag)
        storage.publish(root, staging, tag)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return root / tag


def _write_own(staging: Path, tag: str, pieces_by_rank: list[list[Any]], extra: dict[str, Any],
               manifest: dict[str, Any]) -> None:
    """A rank file of ours per list of pieces (copies: a view would save its whole file),
    ``extra.pt`` and the manifest (``manifest``'s entries, the files added). A DCP checkpoint's
    options per parameter stay as they are: loading maps them onto the groups."""
    files = {}
    for rank, pieces in enumerate(pieces_by_rank):
        payload = {"pieces": [_copied(piece) for piece in pieces], "rng": None}
        files[rank_file(rank)] = storage.write_file(staging / rank_file(rank), payload)
    extra = {**extra, "module": {name: value.clone() for name, value in extra["module"].items()}}
    files[EXTRA] = storage.write_file(staging / EXTRA, extra)
    manifest = {
        **manifest, "format": FORMAT, "tag": tag, "global_step": extra["global_step"],
        "world_size": len(pieces_by_rank), "shard_group_size": len(pieces_by_rank), "files": files,
    }
    storage.write_text(staging / MANIFEST, json.dumps(manifest, indent=1, default=str))


def _copied(piece: dict[str, Any]) -> dict[str, Any]:
    state = {key: value.clone() if torch.is_tensor(value) else value for key, value in piece["state"].items()}
    master = piece["master"]
    return {**piece, "master": master.clone() if master is not None else None, "state": state}
