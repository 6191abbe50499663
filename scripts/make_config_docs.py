"""Regenerate the key table in docs/config.md from the schema (a test checks it is current).

    python scripts/make_config_docs.py
"""

from __future__ import annotations

from pathlib import Path

from zero_engine.config import DEEPSPEED_SECTIONS, NO_EFFECT, key_reference
from zero_engine.features import PARTLY_BUILT, REFUSED_WHEN_ON

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"
BEGIN, END = "<!-- keys:begin -->", "<!-- keys:end -->"
# Keys DeepSpeed does not have.
OURS = ("comm", "zero_optimization.shard_group_size", "zero_optimization.stage3_wrap_modules",
        "zero_optimization.reduce_scatter_each_micro_step", "zero_optimization.memory_budget_gib",
        "zero_optimization.activation_memory_gib", "zero_optimization.memory_margin_gib")


def status(path: str, default: str) -> str:
    """How a key fares against DeepSpeed's meaning of it."""
    if path in PARTLY_BUILT:
        return PARTLY_BUILT[path]
    if path.startswith(REFUSED_WHEN_ON):
        return "refused when on"
    if path in NO_EFFECT or path in DEEPSPEED_SECTIONS:
        return "no effect (named at initialize)"
    if path.startswith(OURS):
        return "ours"
    return "section" if default == "section" else "honoured"


def key_table() -> str:
    lines = ["| key | default | status | meaning |", "|---|---|---|---|"]
    lines += [
        f"| `{path}` | `{default}` | {status(path, default)} | {text} |" for path, default, text in key_reference()
    ]
    return "\n".join(lines)


def render(doc: str) -> str:
    head, rest = doc.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{key_table()}\n{END}{tail}"


if __name__ == "__main__":
    DOC.write_text(render(DOC.read_text()))
