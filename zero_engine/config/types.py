"""The config's value types: counts in DeepSpeed's float style, numbers that refuse booleans,
"never" as infinity, and the base of every section (unknown keys are errors, infinity and NaN
refused)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field


def _parse_count(value: Any) -> Any:
    """Accept DeepSpeed's float-style counts (``5e8`` in JSON, ``"5e8"`` in YAML 1.1)."""
    _not_boolean(value)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _not_boolean(value: Any) -> Any:
    """YAML reads ``yes``/``on``/``true`` as booleans, and pydantic would take them as 1."""
    if isinstance(value, bool):
        raise ValueError("a number is expected, not a boolean")
    return value


def _never_when_infinite(value: Any) -> Any:
    """Infinity as "never" (Accelerate writes ``steps_per_print: inf`` into every config)."""
    if isinstance(value, float) and value == math.inf or isinstance(value, str) and value.lower() in ("inf", "infinity"):
        return None
    return value


# The longest process-group timeout every backend takes: gloo refuses 9.3e12 s (its microseconds
# overflow an int64); torch turns 1e15 s into an OverflowError when it builds the timedelta.
MAX_TIMEOUT_S = 1e12
Count = Annotated[int, BeforeValidator(_parse_count), Field(ge=0)]
PositiveCount = Annotated[int, BeforeValidator(_parse_count), Field(ge=1)]
# DeepSpeed allows a bucket of 0 elements: every gradient flushes at once, as a bucket of 1 does.
BucketSize = Annotated[int, BeforeValidator(_parse_count), Field(ge=0), AfterValidator(lambda size: max(size, 1))]
Integer = Annotated[int, BeforeValidator(_not_boolean)]
Real = Annotated[float, BeforeValidator(_not_boolean)]
StageNumber = Annotated[int, BeforeValidator(_not_boolean), Field(ge=0, le=3)]


@dataclass(frozen=True)
class Refused:
    """A setting this version cannot run, declared beside its field in its section's ``REFUSED``
    (as ``NO_EFFECT`` is): where ``when(section)`` holds, `initialize` refuses it with
    ``says(section)``, the key (relative to the section) and why; ``status`` is its line in the
    key table of docs/config.md."""

    when: Callable[[Any], bool]
    says: Callable[[Any], str]
    status: str = "refused when on"


def _deepspeed_option(default: Any) -> Any:
    """A DeepSpeed key accepted so that its configs load; `NO_EFFECT` says why it changes nothing."""
    return Field(default, description="DeepSpeed option; accepted, no effect.")


class _Section(BaseModel):
    # Infinity and NaN are refused in every number (an infinite timeout overflowed at
    # initialize, an infinite static loss scale skipped every step).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
