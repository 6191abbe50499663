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

A model that builds a key/value cache in its forward when ``use_cache`` is on (Hugging Face's,
whose configs say ``use_cache: true``) keeps it through a training step: without recomputation
the attention keeps the same keys and values for its backward anyway, but with it the cache is
all that keeps them, one layer's keys and values per layer in memory for nothing. Under
recomputation the root's training forwards get ``use_cache=False`` unless the caller passes it,
as Hugging Face's own gradient checkpointing does.

Compilation: ``torch.compile`` of the forward (as FSDP2 and torchtitan compile each block and
keep the sharding hooks outside the graph).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import inspect

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
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


class UnitForwards:
    """Recomputation and compilation of the leaf unit modules' forwards, applied in one order:
    recomputation first, around each module's own forward; compilation over it, so that
    torch.compile traces the checkpointed forward; the engine's hooks outside both (torchtitan's
    order: activation checkpointing, then compile, then sharding)."""

    def __init__(self, leaf_modules: Callable[[], Sequence[nn.Module]], recompute: bool, root: nn.Module) -> None:
        self._leaf_modules = leaf_modules  # asked only where needed (the unit plan may fail on a wrap list)
        self._recomputed = WrappedForwards(leaf_modules() if recompute else [], recomputed)
        self._no_cache = no_cache_while_training(root) if recompute else None
        self._compiled: WrappedForwards | None = None

    def compile(self, options: dict[str, Any], whole: nn.Module) -> None:
        """``torch.compile(**options)`` each leaf unit's forward (``whole``'s, when there is none)."""
        if self._compiled is not None:
            raise RuntimeError(
                "engine.compile() was called already; call engine.close() and build a new engine to change it"
            )
        self._compiled = WrappedForwards(list(self._leaf_modules()) or [whole], compiled(options))

    @property
    def compiled_modules(self) -> list[nn.Module]:
        return self._compiled.modules if self._compiled is not None else []

    def remove(self) -> None:
        """Put every forward back, in the reverse order."""
        if self._compiled is not None:
            self._compiled.remove()
        if self._no_cache is not None:
            self._no_cache.remove()
        self._recomputed.remove()


def recomputed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def no_cache_while_training(root: nn.Module) -> RemovableHandle | None:
    """``use_cache=False`` in ``root``'s forwards while it trains with gradients on, unless the
    caller passes ``use_cache``; None for a forward without that argument."""
    if "use_cache" not in inspect.signature(root.forward).parameters:
        return None

    def without_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if "use_cache" in kwargs or not (module.training and torch.is_grad_enabled()):
            return None
        return args, {**kwargs, "use_cache": False}

    return root.register_forward_pre_hook(without_cache, with_kwargs=True)


def compiled(options: dict[str, Any]) -> Wrapper:
    return lambda forward: torch.compile(forward, **options)
