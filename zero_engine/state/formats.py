"""Checkpoint formats: each a probe, a reader and, where this engine writes it, a writer, in one
table, so that another format is a module and a row (DCP's: `dcp_format`).

- ``finds(directory, tag)``: whether ``directory``/``tag`` (None: what the format calls its
  latest) holds a checkpoint of this format, from its files alone (cheap; errors are left to the
  reader);
- ``read(directory, tag)``: the checkpoint as the engine reads it (`sources.Source`: pieces of
  each parameter, loose state, counters), whatever its layout;
- ``save(state, counters, directory, tag, client_state, writer)``: collective, the tag's path
  back; None for a format only read (DeepSpeed's).

Readers are picked by probe, in table order, this engine's own last: a directory no other
format claims is read as ours, whose errors name what is missing. A format recognised but
neither read nor written has a ``refusal`` (none of the built-in ones now): reading or writing
it raises that, naming the directory, instead of our reader's "manifest missing". `register`
puts a format
ahead of the built-in ones; ``save_checkpoint(format=...)`` and the ``checkpoint_format`` key
choose the writer (`writing`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import dcp_format, own_format
from .deepspeed_checkpoint import find_deepspeed_tag, read_deepspeed
from ..errors import CheckpointError
from .payload import Counters, Resumable
from .sources import Source
from .storage import FileWriter

Save = Callable[[Resumable, Counters, Path, str, Any, FileWriter], Path]


@dataclass(frozen=True)
class CheckpointFormat:
    name: str
    finds: Callable[[Path, str | None], bool]
    read: Callable[[Path, str | None], Source] | None  # None: recognised only (its ``refusal`` says why)
    save: Save | None = None  # None: read only
    refusal: str | None = None  # recognised, neither read nor written yet: why, and what to do


def _read_deepspeed(directory: Path, tag: str | None) -> Source:
    translated = read_deepspeed(directory, tag)
    return Source(translated.checkpoint, translated.piece_index(), translated.extra, translated.ignored, "deepspeed")


DEEPSPEED = CheckpointFormat("deepspeed", lambda d, t: find_deepspeed_tag(d, t) is not None, _read_deepspeed)
OWN = CheckpointFormat(own_format.NAME, own_format.finds_own, own_format.read_own, own_format.save_own)
DCP = CheckpointFormat(dcp_format.NAME, dcp_format.finds_dcp, dcp_format.read_dcp, dcp_format.save_dcp)
_BUILT_IN = (DCP, DEEPSPEED, OWN)
_FORMATS: list[CheckpointFormat] = list(_BUILT_IN)  # probed in this order; ours last


def register(format: CheckpointFormat) -> None:
    """Read (and, with a ``save``, write) ``format`` from now on, probed before the built-in
    ones; a format of the same name is replaced."""
    unregister(format.name)
    _FORMATS.insert(0, format)


def unregister(name: str) -> None:
    """Forget a registered format (the built-in ones stay)."""
    _FORMATS[:] = [f for f in _FORMATS if f.name != name or f in _BUILT_IN]


def known() -> tuple[CheckpointFormat, ...]:
    return tuple(_FORMATS)


def reading(directory: str | Path, tag: str | None = None) -> CheckpointFormat:
    """The format of the checkpoint at ``directory``/``tag``: the first whose probe finds it,
    else this engine's own (whose reader then says what is missing)."""
    root = Path(directory)
    return next((f for f in _FORMATS if f is not OWN and f.finds(root, tag)), OWN)


def finds_any(directory: str | Path, tag: str | None) -> bool:
    """Whether any format finds a checkpoint at ``directory``/``tag``."""
    root = Path(directory)
    return any(f.finds(root, tag) for f in _FORMATS)


def open_source(directory: str | Path, tag: str | None = None) -> Source:
    """The checkpoint at ``directory``/``tag``, read by its format."""
    found, root = reading(directory, tag), Path(directory)
    if found.read is None:
        raise CheckpointError(f"{root / tag if tag else root}: a {found.name} checkpoint; {found.refusal}")
    return found.read(root, tag)


def writing(name: str) -> CheckpointFormat:
    """The format ``name`` to save in; a `ValueError` naming the formats this engine writes."""
    for f in _FORMATS:
        if f.name == name and f.save is not None:
            return f
        if f.name == name and f.refusal is not None:
            raise ValueError(f"checkpoint format {name!r}: {f.refusal}")
    written = ", ".join(repr(f.name) for f in _FORMATS if f.save is not None)
    read_only = [f.name for f in _FORMATS if f.name == name]
    why = "is read, not written" if read_only else "is not a registered format"
    raise ValueError(f"checkpoint format {name!r} {why}: the formats written are {written}")
