"""A checkpoint as the engine reads it, whichever format wrote it (`Source`): its parameters as
saved pieces, its loose state and counters. Each format's reader makes one (`formats`); loading,
consolidation, export and ``initialize(weights=...)`` read every format through it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .payload import PieceIndex
from .storage import Checkpoint


class Source(NamedTuple):
    checkpoint: Checkpoint  # the tag directory, and its manifest (or another format's, translated)
    index: PieceIndex  # every saved piece of every trainable parameter
    extra: dict[str, Any]  # loose entries, counters, param-group options, schedule, scaler, client_state
    ignored: list[str]  # what the checkpoint holds that loading does not restore
    writer: str  # the format that wrote it: "zero_engine", "deepspeed", ...

