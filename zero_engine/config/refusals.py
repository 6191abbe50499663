"""What this version cannot run, gathered from the sections: each declares its ``REFUSED``
beside its fields (`Refused`: when a value is refused, and what the refusal says), as it
declares ``NO_EFFECT``. `refused_settings` lists a config's refused values by key path;
`initialize` raises on them (`refuse`), and the key table of docs/config.md reads
`REFUSED_STATUS` and `KEY_STATUS`. Building a feature edits its section alone: its entry goes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from .schema import ZeroEngineConfig
from .types import Refused


def _section_classes(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel]]]:
    """Every section class under ``model``, with its key-path prefix."""
    found = [(prefix, model)]
    for name, field in model.model_fields.items():
        for member in getattr(field.annotation, "__args__", (field.annotation,)):
            if isinstance(member, type) and issubclass(member, BaseModel):
                found += _section_classes(member, f"{prefix}{name}.")
    return found


def _declared(attribute: str) -> dict[str, Any]:
    return {
        prefix + key: value
        for prefix, section in _section_classes(ZeroEngineConfig)
        for key, value in getattr(section, attribute, {}).items()
    }


# Each refused key's line in the key table ("refused when on", "refused when given", ...).
REFUSED_STATUS: dict[str, str] = {path: rule.status for path, rule in _declared("REFUSED").items()}
# Keys whose line in the key table says more than their kind does.
KEY_STATUS: dict[str, str] = _declared("KEY_STATUS")


def refused_settings(config: ZeroEngineConfig) -> list[str]:
    """Each refused value of ``config``: its key path and why, in the sections' order."""
    return _refused_in(config, "")


def _refused_in(section: BaseModel, prefix: str) -> list[str]:
    rules: dict[str, Refused] = getattr(type(section), "REFUSED", {})
    found = [prefix + rule.says(section) for rule in rules.values() if rule.when(section)]
    for name in type(section).model_fields:
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            found += _refused_in(value, f"{prefix}{name}.")
    return found


def refuse(config: ZeroEngineConfig) -> None:
    """`NotImplementedError` naming every refused value of ``config``, all at once."""
    found = refused_settings(config)
    if found:
        raise NotImplementedError("not built yet: " + "; ".join(found) + ". Switch them off in the config.")
