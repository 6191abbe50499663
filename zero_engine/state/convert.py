"""``zero-engine convert``: a DeepSpeed ZeRO checkpoint rewritten in this engine's format, in one
process, one DeepSpeed rank's pieces at a time (each becomes a rank file of ours; loading
re-shards them to any stage and world size). Published as `own_format.save_own` publishes: staged,
then renamed into place, then ``latest``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from . import storage
from .deepspeed_checkpoint import Translated, read_deepspeed
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


def _copied(piece: dict[str, Any]) -> dict[str, Any]:
    state = {key: value.clone() if torch.is_tensor(value) else value for key, value in piece["state"].items()}
    return {**piece, "master": piece["master"].clone(), "state": state}
