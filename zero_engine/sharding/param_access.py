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
gatherer, which gathers the unit where it is read (`ParamGatherer._serve_read`). Outside a
forward the watch is off: reading ``module.weight.shape`` between steps gathers nothing.

What cannot be served this way, a reference kept outside the module (a list, a closure), is
explained where torch raises (`unserved_reads`): the error names the parameter, the code that
used it and the fix, instead of a bare shape error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any

from torch import nn


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
