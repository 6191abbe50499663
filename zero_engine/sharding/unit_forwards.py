"""What runs inside each unit module's forward: recomputed in backward (``recompute_units``)
and compiled (``engine.compile``).

Both replace the module's ``forward`` on the instance and keep its ``__call__``, so names, state
dicts and the engine's hooks stay as they are: the hooks run eagerly around the wrapped forward,
never inside a checkpoint's recomputation or a compiled graph.

Recomputation: torch's non-reentrant checkpoint around the forward. At stage 3 it happens while
autograd runs the unit's backward, which starts only after the gatherer's hook on the unit's
outputs has gathered it: that gather serves it, and nothing gathers a second time (FairScale
#777 and transformers #30404 are that bug in other engines). Units holding other units are left
whole, since recomputing them would run the inner units' hooks inside the backward.

Compilation: ``torch.compile`` of the forward (as FSDP2 and torchtitan compile each block and
keep the sharding hooks outside the graph).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


class WrappedForwards:
    """``forward`` of each of ``modules`` replaced by ``wrap(forward)`` until `remove`, which puts
    back what was there (another wrapper, or the class's own)."""

    def __init__(self, modules: Sequence[nn.Module], wrap: Wrapper) -> None:
        self._previous = [(module, module.__dict__.get("forward")) for module in modules]
        for module in modules:
            module.forward = wrap(module.forward)  # type: ignore[method-assign]

    @property
    def modules(self) -> list[nn.Module]:
        return [module for module, _ in self._previous]

    def remove(self) -> None:
        for module, previous in reversed(self._previous):
            if previous is None:
                del module.forward
            else:
                module.forward = previous  # type: ignore[method-assign]
        self._previous = []


def recomputed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def compiled(options: dict[str, Any]) -> Wrapper:
    return lambda forward: torch.compile(forward, **options)
