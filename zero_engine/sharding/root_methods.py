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

from .lifecycle import Lifecycle

ROOT_METHODS = ("generate",)  # Hugging Face's


PreHooks = tuple[Callable[[nn.Module, Any], None], Callable[[nn.Module, Any, dict[str, Any]], Any]]
PostHooks = tuple[Callable[[nn.Module, Any, Any], None], Callable[[nn.Module, Any, Any], None]]


class RootMethods:
    """``names`` of ``root`` (those it has) run between the root's forward hooks, as a call of
    the root would run them: the lifecycle's forward entered, then ``pre`` (the outermost
    call's bookkeeping, the root unit module's pre-hook); after, ``post`` (its post-hook, the
    outermost call's end) and the lifecycle's exit, even when the method raises. Until `restore`."""

    def __init__(
        self,
        root: nn.Module,
        lifecycle: Lifecycle,
        pre: PreHooks,
        post: PostHooks,
        names: tuple[str, ...] = ROOT_METHODS,
    ) -> None:
        self.root, self.lifecycle, self.pre, self.post = root, lifecycle, pre, post
        self._originals: dict[str, Callable[..., Any]] = {}
        for name in names:
            method = getattr(root, name, None)
            if callable(method):
                self._originals[name] = method
                setattr(root, name, self._bracketed(method))

    def restore(self) -> None:
        """The instance attributes go; the class's methods show again."""
        for name in self._originals:
            delattr(self.root, name)
        self._originals.clear()

    def _bracketed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        root, (enter_root, pre_forward), (post_forward, exit_root) = self.root, self.pre, self.post

        @functools.wraps(method)
        def as_forward(*args: Any, **kwargs: Any) -> Any:
            output = None
            self.lifecycle.enter_forward()
            try:
                enter_root(root, args)
                pre_forward(root, args, kwargs)  # a generate runs without gradients: no signal to wrap in
                try:
                    output = method(*args, **kwargs)
                    return output
                finally:
                    post_forward(root, args, output)
                    exit_root(root, args, output)
            finally:
                self.lifecycle.exit_forward()

        return as_forward
