"""A checkpoint to read, whichever engine wrote it: this engine's format, or DeepSpeed's ZeRO
layout (`deepspeed_checkpoint`), told apart by what the tag directory holds. Loading,
consolidation, export and ``initialize(weights=...)`` read both through `open_source`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from .deepspeed_checkpoint import find_deepspeed_tag, read_deepspeed
from .payload import PieceIndex
from .storage import EXTRA, Checkpoint, open_checkpoint


class Source(NamedTuple):
    checkpoint: Checkpoint  # the tag directory, and its manifest (or DeepSpeed's, translated)
    index: PieceIndex  # every saved piece of every trainable parameter
    extra: dict[str, Any]  # loose entries, counters, param-group options, schedule, scaler, client_state
    ignored: list[str]  # what the checkpoint holds that loading does not restore
    writer: str  # "zero_engine" or "deepspeed"


def open_source(directory: str | Path, tag: str | None = None) -> Source:
    if find_deepspeed_tag(directory, tag) is not None:
        translated = read_deepspeed(directory, tag)
        return Source(translated.checkpoint, translated.piece_index(), translated.extra, translated.ignored, "deepspeed")
    checkpoint = open_checkpoint(directory, tag)
    try:
        return Source(checkpoint, PieceIndex.read(checkpoint), checkpoint.read(EXTRA), [], "zero_engine")
    finally:
        checkpoint.close()  # what was read stays mapped
