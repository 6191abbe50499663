"""Regenerate the key table in docs/config.md from the schema (a test checks it is current).

    python scripts/make_config_docs.py

DeepSpeed's defaults come from ``tests/data/deepspeed_defaults.json``, recorded from DeepSpeed
itself by ``scripts/record_deepspeed_traces.py``.
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from zero_engine.config import ZeroEngineConfig, DEEPSPEED_SECTIONS, NO_EFFECT, key_reference
from zero_engine.config.deepspeed_compat import DEFAULTS_THAT_DIFFER
from zero_engine.config.refusals import KEY_STATUS, REFUSED_STATUS

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "config.md"
DEEPSPEED_DEFAULTS = json.loads((ROOT / "tests" / "data" / "deepspeed_defaults.json").read_text())["defaults"]
BEGIN, END = "<!-- keys:begin -->", "<!-- keys:end -->"
# Keys DeepSpeed does not have.
OURS = ("comm", "zero_optimization.shard_group_size", "zero_optimization.stage3_wrap_modules",
        "zero_optimization.reduce_scatter_each_micro_step", "zero_optimization.memory_budget_gib",
        "zero_optimization.activation_memory_gib", "zero_optimization.memory_margin_gib",
        "zero_optimization.zero_quantized_gradients_bits")


def status(path: str, default: str) -> str:
    """How a key fares against DeepSpeed's meaning of it."""
    if path in KEY_STATUS:
        return KEY_STATUS[path]
    if path in REFUSED_STATUS:
        return REFUSED_STATUS[path]
    if path in NO_EFFECT or path in DEEPSPEED_SECTIONS:
        return "no effect (named at initialize)"
    if path.startswith(OURS):
        return "ours"
    return "section" if default == "section" else "honoured"


def deepspeed_default(path: str, default: str) -> str:
    """DeepSpeed 0.19.8's default beside ours: "same", its value and why ours differs, or a dash
    for keys DeepSpeed does not have (ours, and its sections taken whole)."""
    if default == "section" or path not in DEEPSPEED_DEFAULTS:
        return "—"
    if path in DEFAULTS_THAT_DIFFER:
        theirs = repr(DEEPSPEED_DEFAULTS[path])
        theirs = f"`{theirs}`" if len(theirs) <= 40 else "a list of classes"  # leaf_module: its MoE blocks
        return f"{theirs}; ours differs: {DEFAULTS_THAT_DIFFER[path]}"
    return "same"


def type_name(annotation: Any) -> str:
    """A field's type as a reader of the config needs it: int, number, bool, string, list,
    mapping, one of the listed values, or null where the key may be unset."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{value!r}`" for value in args)
    if origin in (typing.Union, types.UnionType):
        names = [type_name(arg) for arg in args if arg is not type(None)]
        return " or ".join(dict.fromkeys(names)) + (" or null" if type(None) in args else "")
    if origin in (list, tuple):
        return "list"
    if origin is dict or annotation is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if annotation is Any:
        return "any"
    return {int: "int", float: "number", bool: "bool", str: "string"}.get(annotation, getattr(annotation, "__name__", str(annotation)))


def key_types(model: type[BaseModel] = ZeroEngineConfig, prefix: str = "") -> dict[str, str]:
    """Every key path's `type_name`, walking the sections as `key_reference` does."""
    found = {}
    for name, field in model.model_fields.items():
        found[prefix + name] = type_name(field.annotation)
        sections = [a for a in (typing.get_args(field.annotation) or (field.annotation,))
                    if isinstance(a, type) and issubclass(a, BaseModel)]
        if sections:
            found[prefix + name] = "section"
            found.update(key_types(sections[0], prefix + name + "."))
    return found


def key_table() -> str:
    types_of = key_types()
    lines = ["| key | type | default | DeepSpeed 0.19.8's default | status | meaning |", "|---|---|---|---|---|---|"]
    lines += [
        f"| `{path}` | {types_of[path]} | `{default}` | {deepspeed_default(path, default)} | {status(path, default)} | {text} |"
        for path, default, text in key_reference()
    ]
    return "\n".join(lines)


def render(doc: str) -> str:
    head, rest = doc.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{key_table()}\n{END}{tail}"


if __name__ == "__main__":
    DOC.write_text(render(DOC.read_text()))
