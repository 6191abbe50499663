"""The engine's error classes and the "did you mean" helper: a leaf module, imported by every
layer and importing none of them."""

from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names each key path at fault."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file or parameters at fault."""


class DivergedRanksError(RuntimeError):
    """The ranks are about to run different collectives, raised on every rank at once: their
    forward passes took different paths (stage 3), some rank called a collective method the
    others did not (a save under ``if rank == 0:``, an extra training forward under
    ``sequence_parallel_size``), or the ranks of a sequence group were given different
    micro-batches. The message names each rank's call or batch; the engine cannot go on."""


class SwapError(OSError):
    """NVMe offload: a read or write of some rank's swap file failed (a full or failing disk).
    Raised on every rank at the same step; the engine cannot go on (its state is in the files):
    load the last checkpoint into a new one."""


class ShardedParameterError(RuntimeError):
    """Stage 3: a forward used a sharded parameter where the engine cannot gather it; the message
    names the parameter, the code that used it and the fix."""


def suggest(name: str, known: list[str]) -> str:
    """A clause for an error about an unknown ``name``: the closest of ``known``, or all of them."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; known: {', '.join(sorted(known))}"
