"""The root's methods that run the model without calling its forward, run as one forward of it.

A Hugging Face model's ``generate`` calls the model's forward once per token; a wrapper's
``generate`` (PEFT's ``PeftModel``) calls the *wrapped* model's forward, never its own, so the
hooks on the root (its own units: an embedding, an output head) would never run and those units
would stay sharded. As FSDP2's ``register_fsdp_forward_method``, the method is replaced on the
instance by one that runs inside the root's forward hooks: the root's units are gathered once
for the whole call, and the unit modules' own hooks run inside it as in any forward.

With more than one rank every forward gathers, so every rank must run as many: ``generate``
gets ``synced_gpus=True`` unless the caller says otherwise (transformers turns it on itself
under DeepSpeed ZeRO-3 and FSDP), so a rank whose sequences end first (at EOS, or a shorter
``max_new_tokens``) keeps stepping with the others instead of leaving them waiting.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from ..units.lifecycle import Lifecycle

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
        synced: bool = False,
    ) -> None:
        self.root, self.lifecycle, self.pre, self.post = root, lifecycle, pre, post
        self._originals: dict[str, Callable[..., Any]] = {}
        for name in names:
            method = getattr(root, name, None)
            if callable(method):
                self._originals[name] = method
                defaults = {"synced_gpus": True} if synced and name == "generate" and _takes_synced_gpus(root) else {}
                setattr(root, name, self._bracketed(method, defaults))

    def restore(self) -> None:
        """The instance attributes go; the class's methods show again."""
        for name in self._originals:
            delattr(self.root, name)
        self._originals.clear()

    def _bracketed(self, method: Callable[..., Any], defaults: dict[str, Any]) -> Callable[..., Any]:
        root, (enter_root, pre_forward), (post_forward, exit_root) = self.root, self.pre, self.post

        @functools.wraps(method)
        def as_forward(*args: Any, **kwargs: Any) -> Any:
            kwargs = {**defaults, **kwargs}  # the caller's own choice wins
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


def _takes_synced_gpus(root: nn.Module) -> bool:
    """Whether ``root.generate`` is transformers' (which takes ``synced_gpus``), itself or
    behind a wrapper that passes its keywords on (PEFT's, whose base model's is)."""
    for module in (root, getattr(root, "get_base_model", lambda: None)()):
        generate = getattr(type(module), "generate", None) if module is not None else None
        if generate is not None and "synced_gpus" in inspect.signature(generate).parameters:
            return True
    return False
