"""Module transforms: the one seam where the engine changes what a model's modules compute.

A transform replaces module forwards (or adds forward hooks) and can put everything back. The
engine's transforms live in one ordered list, `ModuleTransforms`, applied at `initialize` and
by `Engine.compile`, and removed together by `Engine.close`. The order is fixed, whatever the
order of the calls that add them (torchtitan's ``parallelize_llama`` applies its techniques in
one commented order for the same reason):

1. ``MODEL``: transforms of the model's own computation, innermost (an attention wrapper
   that splits the sequence over ranks would go here, given the mesh for its group);
2. ``RECOMPUTE``: torch's checkpoint around each unit module's forward (``recompute_units``),
   so that a recomputation reruns the model transforms too;
3. ``COMPILE``: ``torch.compile`` over all of it (``engine.compile()``), tracing the
   checkpointed forward.

The engine's own sharding hooks run outside every transform, around each module's call: never
inside a checkpoint's recomputation or a compiled graph. A transform whose place comes before
one already applied is refused: it would wrap outside it (a recomputation outside a compiled
forward recompiles it; a model transform outside the checkpoint keeps its activations).

A new transform is one class with an ``ORDER`` and ``apply``/``remove``, and one entry where
the engine adds it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

from torch import nn

from ...comm import Mesh

MODEL, RECOMPUTE, COMPILE = 0, 1, 2
ORDER_NAMES = {MODEL: "a model transform", RECOMPUTE: "recompute_units", COMPILE: "engine.compile()"}


class ModuleTransform(Protocol):
    """Changes what some of a model's modules compute, until `remove`."""

    ORDER: ClassVar[int]  # MODEL, RECOMPUTE or COMPILE: where it sits, innermost first

    def apply(self, target: TransformTarget) -> None: ...

    def remove(self) -> None: ...


class TransformTarget:
    """What a transform is given: the model, its unit modules (asked only when needed: the unit
    plan may fail on a wrap list) and the mesh, for the groups a transform's collectives use."""

    def __init__(self, model: nn.Module, leaf_modules: Callable[[], Sequence[nn.Module]], mesh: Mesh) -> None:
        self.model = model
        self.leaf_modules = leaf_modules
        self.mesh = mesh


class ModuleTransforms:
    """An engine's transforms, applied in `ModuleTransform.ORDER`, removed in the reverse."""

    def __init__(self, target: TransformTarget) -> None:
        self.target = target
        self._applied: list[ModuleTransform] = []

    def add(self, transform: ModuleTransform) -> None:
        # Model transforms may be several (each changes its own part of the model); a second
        # recomputation or compilation would wrap the first.
        later = [t for t in self._applied if t.ORDER > transform.ORDER or (t.ORDER == transform.ORDER != MODEL)]
        if later:
            raise RuntimeError(
                f"{ORDER_NAMES[transform.ORDER]} after {ORDER_NAMES[max(t.ORDER for t in later)]}: it would wrap outside it; "
                "call engine.close() and build a new engine to change it"
            )
        transform.apply(self.target)
        self._applied.append(transform)

    def of_order(self, order: int) -> list[ModuleTransform]:
        return [t for t in self._applied if t.ORDER == order]

    def remove(self) -> None:
        """Put every forward back, the last applied first."""
        while self._applied:
            self._applied.pop().remove()


Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


class WrappedForwards:
    """``forward`` of each of ``modules`` replaced by ``wrap(forward)`` until `remove`, which puts
    back what was there (another wrapper, or the class's own). Names, state dicts and the
    modules' hooks stay as they are: only the instance's ``forward`` changes."""

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
