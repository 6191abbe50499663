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

Two phases. A transform may have a first one (`ConvertsModel`: ``convert``/``revert``), run
in `initialize` before the param groups and the module plan, that replaces modules and
parameters (torchtitan's model converters: experts owned per rank, tensor-parallel or FP8
linears), so the plan sees what it made; its forward phase (``apply``/``remove``) runs once the
units are built. ``close()`` undoes both, the forward phase first.

What a transform needs of the engine comes through its `TransformTarget`: the model, its unit
modules, the mesh, its groups by name (``target.group("sequence")``), the call agreement at the
current micro-step (``target.agree``) and the loop's hooks (`LoopHooks`): no transform takes an
engine callback. A new transform is one class with an ``ORDER`` and ``apply``/``remove``, and
one row in the table (`zero_engine.transforms.table`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

from torch import nn

from ..comm import GroupComm, Mesh

MODEL, RECOMPUTE, COMPILE = 0, 1, 2
ORDER_NAMES = {MODEL: "a model transform", RECOMPUTE: "recompute_units", COMPILE: "engine.compile()"}


class ModuleTransform(Protocol):
    """Changes what some of a model's modules compute, until `remove`."""

    ORDER: ClassVar[int]  # MODEL, RECOMPUTE or COMPILE: where it sits, innermost first

    def apply(self, target: TransformTarget) -> None: ...

    def remove(self) -> None: ...


class ConvertsModel(Protocol):
    """A transform's first phase: at `initialize`, before the param groups and the module plan,
    it may replace the model's modules and parameters; `revert` puts back what it replaced."""

    def convert(self, model: nn.Module) -> None: ...

    def revert(self) -> None: ...


class Agreement(Protocol):
    """The engine's call rows (`zero_engine.sharding.gathering.calls`): one sent and read at once."""

    def agree_at_once(self, call: Any, micro_step: int, facts: Sequence[int] = ()) -> None: ...


class MicroSteps(Protocol):
    micro_steps: int  # the loop's micro-steps so far (`zero_engine.accumulation.AccumulationWindow`)


class LoopHooks:
    """What the training loop tells its transforms, and asks them: a micro-step ended
    (``engine.step()``), and whether the coming backward exchanges inside a transform (its row
    is then sent and read before the backward's first exchange)."""

    def __init__(self) -> None:
        self._micro_step_ends: list[Callable[[], None]] = []
        self._exchanges_in_backward: list[Callable[[], bool]] = []

    def on_micro_step_end(self, hook: Callable[[], None]) -> None:
        self._micro_step_ends.append(hook)

    def on_exchanges_in_backward(self, hook: Callable[[], bool]) -> None:
        self._exchanges_in_backward.append(hook)

    def micro_step_ended(self) -> None:
        for hook in self._micro_step_ends:
            hook()

    def exchanges_in_backward(self) -> bool:
        return any(hook() for hook in self._exchanges_in_backward)


class TransformTarget:
    """What a transform is given: the model, its unit modules (asked only when needed: the unit
    plan may fail on a wrap list), the mesh and this rank's global rank, its groups by use
    (`group`), the call agreement (`agree`: a row at the loop's current micro-step) and the
    loop's hooks. Tests give the first three alone."""

    def __init__(
        self, model: nn.Module, leaf_modules: Callable[[], Sequence[nn.Module]], mesh: Mesh, *, rank: int = 0,
        groups: Callable[[str], GroupComm] | None = None, calls: Agreement | None = None,
        window: MicroSteps | None = None, loop: LoopHooks | None = None,
    ) -> None:
        self.model = model
        self.leaf_modules = leaf_modules
        self.mesh = mesh
        self.rank = rank
        self._groups, self._calls, self._window = groups, calls, window
        self.loop = loop if loop is not None else LoopHooks()

    def group(self, use: str) -> GroupComm:
        """This rank's group of a use or axis of the mesh (a group of one where none was given)."""
        return self._groups(use) if self._groups is not None else GroupComm(0, 1, "none")

    def agree(self, call: Any, facts: Sequence[int] = ()) -> None:
        """Send and read a call row at the loop's current micro-step (nothing without an engine)."""
        if self._calls is not None and self._window is not None:
            self._calls.agree_at_once(call, self._window.micro_steps, facts)


class ModuleTransforms:
    """An engine's transforms: the planned ones (`zero_engine.transforms.table`) converted
    before the plan (`convert`) and applied once the units are built (`apply_planned`), then
    any added later (``compile()``), in `ModuleTransform.ORDER`; removed in the reverse."""

    def __init__(self, target: TransformTarget | None = None, planned: Sequence[ModuleTransform] = ()) -> None:
        self.target = target
        self._planned = sorted(planned, key=lambda t: t.ORDER)  # stable: rows of one order keep the table's
        self._converted: list[Any] = []
        self._applied: list[ModuleTransform] = []

    @property
    def planned(self) -> list[ModuleTransform]:
        return list(self._planned)

    def convert(self, model: nn.Module) -> None:
        """The planned transforms' first phase, in order (those that have one); on a failure,
        what was converted is reverted."""
        try:
            for transform in self._planned:
                if hasattr(transform, "convert"):
                    transform.convert(model)  # type: ignore[attr-defined]
                    self._converted.append(transform)
        except BaseException:
            self.revert()
            raise

    def placement_of(self, param: nn.Parameter) -> Any:
        """Where a parameter the first phase made lies (a `Placement`: an expert cut along the
        expert axis), or None: whole on every rank."""
        for transform in self._converted:
            found = getattr(transform, "placements", {}).get(param)
            if found is not None:
                return found
        return None

    def whole_sources(self) -> list[tuple[nn.Parameter, Any, int]]:
        """Each parameter the first phase cut from a whole one, with that whole tensor and the
        offset of its part along dim 0 (the engine starts every rank from rank 0's whole ones)."""
        return [found for t in self._converted if hasattr(t, "whole_sources") for found in t.whole_sources()]

    def revert(self) -> None:
        """Undo the first phase, the last converted first."""
        while self._converted:
            self._converted.pop().revert()

    def apply_planned(self, target: TransformTarget) -> None:
        """The planned transforms' forward phase, on ``target`` (the units built)."""
        self.target = target
        planned, self._planned = self._planned, []
        for transform in planned:
            self.add(transform)

    def add(self, transform: ModuleTransform) -> None:
        # Model transforms may be several (each changes its own part of the model); a second
        # recomputation or compilation would wrap the first.
        later = [t for t in self._applied if t.ORDER > transform.ORDER or (t.ORDER == transform.ORDER != MODEL)]
        if later:
            raise RuntimeError(
                f"{ORDER_NAMES[transform.ORDER]} after {ORDER_NAMES[max(t.ORDER for t in later)]}: it would wrap outside it; "
                "call engine.close() and build a new engine to change it"
            )
        if self.target is None:
            raise RuntimeError("a transform applied before the engine gave its target (apply_planned)")
        transform.apply(self.target)
        self._applied.append(transform)

    def of_order(self, order: int) -> list[ModuleTransform]:
        return [t for t in self._applied if t.ORDER == order]

    def remove_forwards(self) -> None:
        """Put every forward back, the last applied first."""
        while self._applied:
            self._applied.pop().remove()

    def remove(self) -> None:
        """Undo both phases: the forwards, then what the first phase replaced."""
        self.remove_forwards()
        self.revert()


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
