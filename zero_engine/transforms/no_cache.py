"""Training forwards without a key/value cache (a Hugging Face model's ``use_cache``).

A Hugging Face causal LM's config says ``use_cache: true``, so a forward called without the
argument builds a cache even in training, where nothing reads it: it costs memory (under
``recompute_units`` the cache is all that keeps each layer's keys and values, for nothing), and
with a cache Hugging Face does not detect packed documents (``position_ids`` restarting) and
lets them attend across their boundaries, where a forward without one keeps them apart
(``masking_utils``' packed-sequence mask). So a training forward (the model in ``train()``,
gradients on) gets ``use_cache=False`` unless the caller passes ``use_cache``, at every
``sequence_parallel_size`` (the split keeps documents apart the same way), as Hugging Face's
gradient checkpointing does. Evaluation and ``generate`` keep the model's own default.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .seam import MODEL, TransformTarget


class NoCacheInTraining:
    """``use_cache=False`` in the root's training forwards, for a model whose forward takes it."""

    ORDER = MODEL

    def __init__(self) -> None:
        self._handle: RemovableHandle | None = None

    def apply(self, target: TransformTarget) -> None:
        if takes_use_cache(target.model):
            self._handle = target.model.register_forward_pre_hook(_without_cache, with_kwargs=True)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def takes_use_cache(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model whose forward takes ``use_cache`` (through a PEFT
    wrapper too, whose forward passes it on by ``**kwargs``)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if not hasattr(getattr(base, "config", None), "use_cache"):
        return False
    return "use_cache" in inspect.signature(base.forward).parameters


def _without_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
    if "use_cache" in kwargs or not (module.training and torch.is_grad_enabled()):
        return None
    return args, {**kwargs, "use_cache": False}
