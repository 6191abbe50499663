"""Checks of keyword values against the kind of their defaults, shared by the optimizer and
scheduler checks of the config: a switch must be a boolean (Python reads the string ``"false"``
as true), a number a finite number (never a boolean, which Python counts as 0 or 1)."""

from __future__ import annotations

import math
from typing import Any


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def as_count(value: Any) -> int | None:
    """An integer from ``value`` (``1e4`` and ``"1e4"`` included: YAML reads ``1e4`` without a
    dot as a string); None when it is no integer."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_value_type(path: str, value: Any, default: Any, flag: bool = False) -> Any:
    """``value`` has the kind of ``default`` (``flag``: a switch whose default is None, which
    then accepts None too); returns it, an integer where the default is one."""
    if isinstance(default, bool) or flag:
        if not isinstance(value, bool) and not (value is None and default is None):
            raise ValueError(f"{path} = {value!r}: must be true or false")
    elif isinstance(default, int):
        count = as_count(value)
        if count is None:
            raise ValueError(f"{path} = {value!r}: must be an integer")
        return count
    elif isinstance(default, float) and not is_finite_number(value):
        raise ValueError(f"{path} = {value!r}: must be a finite number")
    return value


def check_switch(value: Any, where: str) -> bool:
    """``value`` if it is True or False; else a `TypeError` naming ``where`` (``"yes"`` and 1
    would otherwise be read as true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{where} = {value!r}: must be True or False")
    return value
