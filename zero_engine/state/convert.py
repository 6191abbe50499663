"""``zero-engine convert``: a checkpoint rewritten in another format, in one process. A
DeepSpeed ZeRO checkpoint into this engine's format one DeepSpeed rank's pieces at a time (each
becomes a rank file of ours; loading re-shards them to any stage and world size); any checkpoint
(ours, DeepSpeed's, DCP's) into this engine's format or DCP's (`convert_checkpoint`). Published as
`own_format.save_own` publishes: staged, then renamed into place, then ``latest``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
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
    root, tag = Path(out), translated.checkpoint.path.name
    storage.check_root(root)
    staging = root / f".tmp-{tag}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        files = {}
        for rank, pieces in enumerate(translated.pieces_by_rank):  # copies: a view would save its whole file
            payload = {"pieces": [_copied(piece) for piece in pieces], "rng": None}
            files[rank_file(rank)] = storage.write_file(staging / rank_file(rank), payload)
        extra = {**translated.extra, "module": {name: value.clone() for name, value in translated.extra["module"].items()}}
        files[EXTRA] = storage.write_file(staging / EXTRA, extra)
        manifest = {
            **translated.checkpoint.manifest, "format": FORMAT, "tag": tag, "global_step": extra["global_step"],
            "world_size": len(translated.pieces_by_rank), "shard_group_size": len(translated.pieces_by_rank),
            "files": files,
        }
        storage.write_text(staging / MANIFEST, json.dumps(manifest, indent=1, default=str))
        storage.finish_publish(root, tag)
        storage.publish(root, staging, tag)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return root / tag, translated


def convert_checkpoint(source: str | Path, out: str | Path, tag: str | None = None, to: str = "zero_engine") -> tuple[Path, Source]:
    """Write the checkpoint ``source``/``tag`` (any format; tag: its latest) under ``out`` with
    the same tag in format ``to`` (``zero_engine`` or ``dcp``)."""
    if to not in ("zero_engine", dcp_format.NAME):
        raise ValueError(f"--to {to!r}: the formats written are 'zero_engine' and 'dcp'")
    found = formats.open_source(source, tag)
    if found.writer == to:
        raise CheckpointError(f"{found.checkpoint.path}: already a {to} checkpoint")
    if found.writer == "deepspeed" and to == "zero_engine":
        return convert_deepspeed(source, out, tag)[0], found
    root, tag = Path(out), found.checkpoint.path.name
    storage.check_root(root)
    staging = root / f".tmp-{tag}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        if to == dcp_format.NAME:
            dcp_format.convert_to_dcp(found, staging, str(root / tag))
        else:
            _write_own(found, staging, tag)
        storage.finish_publish(root, tag)
        storage.publish(root, staging, tag)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return root / tag, found


def _write_own(found: Source, staging: Path, tag: str) -> None:
    """One rank file holding every piece, ``extra.pt`` and the manifest (a DCP checkpoint's
    options per parameter stay as they are: loading maps them onto the groups)."""
    params = found.checkpoint.manifest["params"]
    pieces = [_copied(piece) for name in params for piece in found.index.pieces.get(name, ())]
    files = {rank_file(0): storage.write_file(staging / rank_file(0), {"pieces": pieces, "rng": None})}
    extra = {**found.extra, "module": {name: value.clone() for name, value in found.extra["module"].items()}}
    files[EXTRA] = storage.write_file(staging / EXTRA, extra)
    manifest = {
        "format": FORMAT, "tag": tag, "global_step": extra["global_step"], "world_size": 1, "shard_group_size": 1,
        "optimizer": found.checkpoint.manifest.get("optimizer"), "params": params, "excluded_frozen": [],
        "config": None, "files": files,
    }
    storage.write_text(staging / MANIFEST, json.dumps(manifest, indent=1, default=str))


def _copied(piece: dict[str, Any]) -> dict[str, Any]:
    state = {key: value.clone() if torch.is_tensor(value) else value for key, value in piece["state"].items()}
    master = piece["master"]
    return {**piece, "master": master.clone() if master is not None else None, "state": state}
