"""Stage 3: a sharded parameter read during a forward where no module hook gathered its unit.

The gatherer gathers a unit around the forward of every module that uses it: the unit's module
and each module that registers one of its parameters. Ordinary model code also reads parameters
elsewhere: a head that calls ``F.linear(h, self.embed.weight)`` after the embedding's forward
ended, a container whose own ``forward`` never runs while its parent calls its members
(``for layer in self.encoder.layers: ...``). Between uses a sharded parameter is an empty
tensor, so such a read would reach torch as a shape error.

DeepSpeed 0.19.8 serves these reads by watching each module's ``_parameters`` (its
``ZeROOrderedDict``): reading a parameter that is not available, during a forward, gathers it
and registers it with the module running. We do the same: `watch_reads` makes the
``_parameters`` mapping of every module that registers a sharded parameter a
`WatchedParameters`, a ``dict`` whose ``__getitem__`` (what ``module.name`` reads) tells the
gatherer, which gathers the unit where it is read (`ParamGatherer._on_read`). Outside a
forward the watch is off: reading ``module.weight.shape`` between steps gathers nothing.
`ParamReads` is the gatherer's side of this: the watch, the names, and what to say about a
read the gatherer cannot serve (from another thread) or could not see (`unserved_reads`).

What cannot be served this way, a reference kept outside the module (a list, a closure), is
explained where torch raises (`unserved_reads`): the error names the parameter, the code that
used it and the fix, instead of a bare shape error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn

from ...errors import ShardedParameterError
from ..units.frozen_unit import FrozenUnit
from ..units.unit import ShardedFlatUnit

logger = logging.getLogger("zero_engine")


class ParamReads:
    """The reads of one gatherer's sharded parameters: watched while a forward runs (each read
    goes to ``on_read`` with its unit's index), named, and explained where they cannot be served."""

    def __init__(
        self,
        root: nn.Module,
        units: Sequence[ShardedFlatUnit | FrozenUnit],
        on_read: Callable[[int, nn.Parameter], None],
        rank: int,
    ) -> None:
        self.root = root
        self.units = units
        self.rank = rank
        self.unit_of = {param: index for index, unit in enumerate(units) for param in unit.params}
        self._on_read = on_read
        self.watch = ReadWatch(self._read)
        self.forward_thread = threading.get_ident()
        self._unwatch = watch_reads(
            [module for module in root.modules() if any(p in self.unit_of for p in module._parameters.values())],
            self.watch,
        )

    def _read(self, param: nn.Parameter) -> None:
        """A watched parameter was read during a forward: to ``on_read`` with its unit.

        Nothing to do inside a compiled forward (its unit is gathered around it), asked first:
        dynamo traces this, and a unit's own state read here became a guard of every compiled
        unit forward, so each unit recompiled the shared code, and past dynamo's limit of 8
        the rest ran eager (seen on an H200: a recompile per GPT block)."""
        if torch.compiler.is_compiling():
            return
        index = self.unit_of.get(param)
        if index is not None:
            self._on_read(index, param)

    def begin_forward(self) -> None:
        self.forward_thread = threading.get_ident()
        self.watch.active = True

    def end_forward(self) -> None:
        self.watch.active = False

    def close(self) -> None:
        self._unwatch()

    def check_thread(self, param: nn.Parameter, holder: nn.Module) -> None:
        """A gather must run on the forward's thread, in the same order on every rank."""
        if threading.get_ident() != self.forward_thread:
            raise ShardedParameterError(
                f"stage 3: parameter {self.name_of(param)!r} (unit {self._unit(param).label!r}) was read from "
                f"another thread during the forward of {self.where(holder)}: its unit is sharded, and a "
                "gather must run on the forward's thread, in the same order on every rank. Read it on that thread, "
                f"or keep it whole on every rank (zero_optimization.stage3_param_persistence_threshold above "
                f"{self.numel_of(param)})"
            )

    def log_served(self, param: nn.Parameter, holder: nn.Module) -> None:
        if self.rank == 0:
            where = self.where(holder)
            logger.info(
                "stage 3: unit %r is read outside the modules that gather it (first: %r, during the forward of %s); "
                "it is gathered with %s's units from now on",
                self._unit(param).label, self.name_of(param), where, where,
            )

    def explain_failed_forward(self, error: BaseException) -> str | None:
        """When a forward failed on a sharded parameter that nothing gathered (a reference kept
        outside its module: a list, a closure), what to say instead of torch's shape error."""
        if isinstance(error, ShardedParameterError):
            return None  # said already
        for param, frame in unserved_reads(error, self._is_sharded_empty):
            user = frame.f_locals.get("self")
            where = f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
            if isinstance(user, nn.Module):
                where = f"module {self.where(user)} ({type(user).__name__}), {where}"
            return (
                f"stage 3: parameter {self.name_of(param)!r} (unit {self._unit(param).label!r}) was used in a forward "
                f"while sharded, by {where}, through a reference the engine cannot see: it gathers a unit when a "
                "module that registers the parameter runs, or when the forward reads it from its module "
                "(module.weight). Read it from its module where it is used, register it on the module that uses it, or keep it whole "
                f"on every rank (zero_optimization.stage3_param_persistence_threshold above {self.numel_of(param)})"
            )
        return None

    def name_of(self, param: nn.Parameter) -> str:
        unit = self._unit(param)
        return next(name for name, own in zip(unit.names, unit.params) if own is param)

    def numel_of(self, param: nn.Parameter) -> int:
        unit = self._unit(param)
        return unit.layout.param_numels[next(i for i, own in enumerate(unit.params) if own is param)]

    def where(self, module: nn.Module) -> str:
        path = next((path for path, candidate in self.root.named_modules() if candidate is module), None)
        return "<root>" if path == "" else repr(path) if path is not None else "a module outside the model"

    def _unit(self, param: nn.Parameter) -> ShardedFlatUnit | FrozenUnit:
        return self.units[self.unit_of[param]]

    def _is_sharded_empty(self, value: Any) -> bool:
        index = self.unit_of.get(value) if isinstance(value, nn.Parameter) else None
        return index is not None and value.numel() == 0 and not self.units[index].has_full_storage


class ReadWatch:
    """What every watched mapping of one engine shares: whether a forward is running, and whom
    to tell about a read then."""

    def __init__(self, on_read: Callable[[nn.Parameter], None]) -> None:
        self.active = False
        self.on_read = on_read


class WatchedParameters(dict):
    """A module's ``_parameters`` that reports reads of its parameters while a forward runs.
    Copies and pickles of it are plain dicts (``copy.deepcopy(model)`` takes no engine along)."""

    __slots__ = ("watch",)

    def __init__(self, items: Iterable[tuple[str, Any]], watch: ReadWatch) -> None:
        super().__init__(items)
        self.watch = watch

    def __getitem__(self, key: str) -> Any:
        param = dict.__getitem__(self, key)
        if self.watch.active and param is not None:
            self.watch.on_read(param)
        return param

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __reduce__(self) -> tuple[type, tuple[dict[str, Any]]]:
        return dict, (dict(self),)


def watch_reads(modules: Iterable[nn.Module], watch: ReadWatch) -> Callable[[], None]:
    """Watch the parameters of ``modules``; returns what puts plain dicts back (same entries,
    including any registered meanwhile)."""
    watched = []
    for module in modules:
        if not isinstance(module._parameters, WatchedParameters):
            module._parameters = WatchedParameters(module._parameters.items(), watch)
            watched.append(module)

    def unwatch() -> None:
        for module in watched:
            if isinstance(module._parameters, WatchedParameters):
                module._parameters = dict(module._parameters.items())

    return unwatch


def unserved_reads(error: BaseException, is_sharded_empty: Callable[[Any], bool]) -> Iterator[tuple[Any, Any]]:
    """The sharded parameters, still empty, within reach of the frames of ``error``'s traceback
    when it was raised (innermost frame first), each with its frame: a frame's own variables,
    and what its variables hold one level down (``self.kept = [weight]``, a tuple of weights).
    Nothing a forward reads from its module is among them: those reads are served."""
    frames = []
    traceback: TracebackType | None = error.__traceback__
    while traceback is not None:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    seen: set[int] = set()
    for frame in reversed(frames):
        for value in _within_reach(frame.f_locals.values()):
            if id(value) not in seen and is_sharded_empty(value):
                seen.add(id(value))
                yield value, frame


def _within_reach(values: Iterable[Any]) -> Iterator[Any]:
    for value in list(values):
        yield value
        held = vars(value) if isinstance(value, nn.Module) else value
        if isinstance(held, dict):
            held = list(held.values())
        if isinstance(held, (list, tuple)):
            for item in held:
                yield item
                if isinstance(item, (list, tuple)):
                    yield from item
