"""Regenerate the key table in docs/config.md from the schema (a test checks it is current).

    python scripts/make_config_docs.py
"""

from __future__ import annotations

from pathlib import Path

from zero_engine.config import key_reference

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"
BEGIN, END = "<!-- keys:begin -->", "<!-- keys:end -->"


def key_table() -> str:
    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{path}` | `{default}` | {text} |" for path, default, text in key_reference()]
    return "\n".join(lines)


def render(doc: str) -> str:
    head, rest = doc.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{key_table()}\n{END}{tail}"


if __name__ == "__main__":
    DOC.write_text(render(DOC.read_text()))
