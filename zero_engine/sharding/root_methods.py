"""The root's methods that run the model without calling its forward, run as one forward of it.

A Hugging Face model's ``generate`` calls the model's forward once per token; a wrapper's
``generate`` (PEFT's ``PeftModel``) calls the *wrapped* model's forward, never its own, so the
hooks on the root (its own units: an embedding, an output head) would never run and those units
would stay sharded. As FSDP2's ``register_fsdp_forward_method``, the method is replaced on the
instance by one that runs inside the root's forward hooks: the root's units are gathered once
for the whole call, and the unit modules' own hooks run inside it as in any forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

ROOT_METHODS = ("generate",)  # Hugging Face's


class RootMethods:
    """``names`` of ``root`` (those it has) run between ``enter(args, kwargs)`` and
    ``exit(args, output)``, until `restore`."""

    def __init__(
        self,
        root: nn.Module,
        enter: Callable[[tuple[Any, ...], dict[str, Any]], None],
        exit: Callable[[tuple[Any, ...], Any], None],
        names: tuple[str, ...] = ROOT_METHODS,
    ) -> None:
        self.root = root
        self._originals: dict[str, Callable[..., Any]] = {}
        for name in names:
            method = getattr(root, name, None)
            if callable(method):
                self._originals[name] = method
                setattr(root, name, _bracketed(method, enter, exit))

    def restore(self) -> None:
        """The instance attributes go; the class's methods show again."""
        for name in self._originals:
            delattr(self.root, name)
        self._originals.clear()


def _bracketed(
    method: Callable[..., Any],
    enter: Callable[[tuple[Any, ...], dict[str, Any]], None],
    exit: Callable[[tuple[Any, ...], Any], None],
) -> Callable[..., Any]:
    @functools.wraps(method)
    def as_forward(*args: Any, **kwargs: Any) -> Any:
        output = None
        enter(args, kwargs)
        try:
            output = method(*args, **kwargs)
            return output
        finally:
            exit(args, output)  # as the root's forward hooks run, ``always_call``

    return as_forward
