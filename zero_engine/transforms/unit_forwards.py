"""Two entries of the module transforms (`zero_engine.transforms.seam`): each unit module's
forward recomputed in backward (``recompute_units``) and compiled (``engine.compile``).

Both replace the module's ``forward`` on the instance and keep its ``__call__``, so names, state
dicts and the engine's hooks stay as they are: the hooks run eagerly around the wrapped forward,
never inside a checkpoint's recomputation or a compiled graph.

Recomputation: torch's non-reentrant checkpoint around the forward. At stage 3 it happens while
autograd runs the unit's backward, which starts only after the gatherer's hook on the unit's
outputs has gathered it: that gather serves it, and nothing gathers a second time (FairScale
#777 and transformers #30404 are that bug in other engines). Units holding other units are left
whole, since recomputing them would run the inner units' hooks inside the backward.

A training forward builds no key/value cache (`zero_engine.transforms.no_cache`): under
recomputation a cache would be all that keeps each layer's keys and values.

Compilation: ``torch.compile`` of the forward (as FSDP2 and torchtitan compile each block and
keep the sharding hooks outside the graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

from .offloaded_inputs import OffloadedInputs
from .seam import COMPILE, RECOMPUTE, TransformTarget, WrappedForwards, Wrapper


class Recompute:
    """``recompute_units``: each leaf unit module's forward under torch's non-reentrant checkpoint;
    with ``offload`` (``recompute_offload``), what each checkpoint keeps in host memory
    (`zero_engine.transforms.offloaded_inputs`)."""

    ORDER = RECOMPUTE

    def __init__(self, offload: bool = False) -> None:
        self.offloaded = OffloadedInputs() if offload else None
        self._recomputed: WrappedForwards | None = None
        self._new_forward: RemovableHandle | None = None

    def apply(self, target: TransformTarget) -> None:
        offloaded = self.offloaded
        self._recomputed = WrappedForwards(target.leaf_modules(), lambda forward: recomputed(forward, offloaded))
        if offloaded is not None:
            self._new_forward = target.model.register_forward_pre_hook(
                lambda module, args: offloaded.new_forward() if torch.is_grad_enabled() else None
            )

    def remove(self) -> None:
        if self._new_forward is not None:
            self._new_forward.remove()
        if self._recomputed is not None:
            self._recomputed.remove()


class Compile:
    """``engine.compile(**options)``: ``torch.compile`` of each leaf unit module's forward, or of
    the whole model's when it has none (torchtitan's order: checkpoint, then compile, then
    sharding)."""

    ORDER = COMPILE

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self._compiled: WrappedForwards | None = None

    def apply(self, target: TransformTarget) -> None:
        self._compiled = WrappedForwards(list(target.leaf_modules()) or [target.model], compiled(self.options))

    @property
    def modules(self) -> list[nn.Module]:
        return self._compiled.modules if self._compiled is not None else []

    def remove(self) -> None:
        if self._compiled is not None:
            self._compiled.remove()


def recomputed(forward: Callable[..., Any], offloaded: OffloadedInputs | None = None) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to recompute
            return forward(*args, **kwargs)
        with offloaded.hooks() if offloaded is not None else contextlib.nullcontext():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def compiled(options: dict[str, Any]) -> Wrapper:
    return lambda forward: torch.compile(forward, **options)
