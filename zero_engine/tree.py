"""Tensors inside the nested structures models take and return.

Forward inputs and outputs can be tuples, lists, named tuples, dicts (``OrderedDict`` and
``ModelOutput``-like subclasses), dataclasses, or anything else; only tensors are visited,
every other value passes through untouched (a cache object, a string, ``None``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``, depth first."""
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from iter_tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from iter_tensors(getattr(value, field.name))


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``value`` with every tensor replaced by ``fn(tensor)``; containers are copied, never
    changed in place, and keep their type."""
    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, dict):
        mapped = copy.copy(value)  # keeps the subclass and its attributes
        for key, item in value.items():
            mapped[key] = map_tensors(fn, item)
        return mapped
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(map_tensors(fn, item) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(fn, item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        mapped = copy.copy(value)
        for field in dataclasses.fields(value):
            object.__setattr__(mapped, field.name, map_tensors(fn, getattr(value, field.name)))
        return mapped
    return value
