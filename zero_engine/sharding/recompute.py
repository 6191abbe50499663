"""``zero_optimization.recompute_units``: each unit module's forward runs under torch's
non-reentrant checkpoint, so its activations are recomputed in backward instead of kept.

The module's ``forward`` is replaced on the instance (names and hooks unchanged): its
``__call__`` still runs the engine's hooks around it, so at stage 3 the unit is gathered for the
forward and freed after. The recomputation calls the original forward directly, during the
backward of the unit's outputs, after the gatherer's backward hook on those outputs has gathered
the unit again: that gather serves it, and no third gather happens (FairScale #777 and
transformers #30404 are that bug in other engines). Units holding other units are left whole,
since recomputing them would run the inner units' forward hooks inside the backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Recompute:
    """Checkpointed forwards on ``modules`` until `remove`."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = list(modules)
        for module in self.modules:
            module.forward = _checkpointed(module.forward)  # type: ignore[method-assign]

    def remove(self) -> None:
        for module in self.modules:
            del module.forward  # the class's forward again
        self.modules = []


def _checkpointed(forward: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
