"""docs/reference/api.md from the docstrings: the public surface as plain Markdown, so that it reads
the same in the repository as on the built site (issue 65).

    python scripts/make_api_docs.py           # rewrite docs/reference/api.md
    python scripts/make_api_docs.py --check   # exit 1 if it is out of date (the tests run this)
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zero_engine  # noqa: E402
from zero_engine.engine import Engine  # noqa: E402
from zero_engine.errors import (  # noqa: E402
    CheckpointError, ConfigError, DivergedRanksError, ShardedParameterError, SwapError,
)

OUT = ROOT / "docs" / "reference" / "api.md"
ENGINE_MEMBERS = [
    "__call__", "backward", "step", "module", "optimizer", "global_step", "train", "eval", "zero_grad", "no_sync",
    "set_gradient_accumulation_boundary", "is_gradient_accumulation_boundary", "was_step_applied",
    "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "full_state_dict",
    "gathered", "named_full_parameters", "save_pretrained", "memory_report", "comm_report", "save_checkpoint",
    "load_checkpoint", "get_lr", "get_global_grad_norm", "compile", "close",
    "data_parallel_rank", "data_parallel_world_size", "sequence_slice", "sequence_loss", "sequence_gather",
    "sequence_log_probs",
]
HEADER = """# API reference

The public surface: what scripts and tests outside the repository rely on. Generated from the
docstrings by `python scripts/make_api_docs.py` (the tests check that it is current); the
[architecture](../architecture.md) says how the parts fit.
"""
COMMAND_LINE = """## The command line

`zero-engine validate CONFIG [--world-size N] [--trainer] [--hidden-size H]`, `zero-engine
estimate CONFIG --params P --world-size N [--shard-group-size G] [--model-config config.json --seq-len S]`, `zero-engine consolidate
CHECKPOINT OUT [--format hf]` and `zero-engine convert DEEPSPEED_DIR OUT_DIR`; `zero-engine
--version`; `zero-engine COMMAND --help` lists each one's options.
"""


def _text(doc: str | None) -> str:
    """A docstring as Markdown: reStructuredText's double backticks as code."""
    return re.sub(r"``(.+?)``", r"`\1`", doc or "", flags=re.S).strip()


def _signature(name: str, obj: object) -> str:
    """``name(params) -> returns`` as the source writes it (annotations are strings there)."""
    try:
        signature = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return name
    params, star = [], False
    for param in signature.parameters.values():
        if param.name == "self":
            continue
        if param.kind is param.KEYWORD_ONLY and not star:
            params.append("*")
            star = True
        text = {param.VAR_POSITIONAL: "*", param.VAR_KEYWORD: "**"}.get(param.kind, "") + param.name
        if param.annotation is not param.empty:
            text += f": {_annotation(param.annotation)}"
        if param.default is not param.empty:
            text += f" = {param.default!r}"
        params.append(text)
    returns = signature.return_annotation
    shown = "" if returns is signature.empty else f" -> {_annotation(returns)}"
    return f"{name}({', '.join(params)}){shown}"


def _annotation(annotation: object) -> str:
    """As the source writes it: annotations are strings there (``from __future__ import annotations``)."""
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _entry(title: str, obj: object, name: str | None = None) -> str:
    shown = _signature(name or title, obj) if callable(obj) and not isinstance(obj, property) else (name or title)
    return f"### `{title}`\n\n```python\n{shown}\n```\n\n{_text(inspect.getdoc(obj))}\n"


def _engine_member(member: str) -> str:
    attribute = inspect.getattr_static(Engine, member, None)
    for klass in Engine.__mro__:  # inherited members: their own class's attribute
        if member in vars(klass):
            attribute = vars(klass)[member]
            break
    if attribute is None:  # an instance attribute set in __init__
        notes = {"module": "The model, as given to `initialize` (its parameters sharded at stage 3).",
                 "global_step": "Optimizer steps applied or skipped so far (restored by `load_checkpoint`)."}
        return f"### `Engine.{member}`\n\n{notes[member]}\n"
    if isinstance(attribute, property):
        return f"### `Engine.{member}`\n\n{_text(inspect.getdoc(attribute.fget))}\n"
    return _entry(f"Engine.{member}", getattr(Engine, member), "engine" if member == "__call__" else f"engine.{member}")


def render() -> str:
    from zero_engine.integrations.accelerate import Accelerator
    from zero_engine.integrations.lightning import ZeroEngineStrategy
    from zero_engine.integrations.transformers import ZeroEngineTrainer

    parts = [HEADER, "## Entry points\n"]
    parts += [_entry("zero_engine.initialize", zero_engine.initialize),
              _entry("zero_engine.load_config", zero_engine.load_config),
              _entry("zero_engine.load_consolidated", zero_engine.load_consolidated)]
    parts += ["## The engine\n", f"### `zero_engine.Engine`\n\n{_text(inspect.getdoc(Engine))}\n"]
    parts += [_engine_member(member) for member in ENGINE_MEMBERS]
    parts.append("## Sequence parallelism\n")
    parts.append(_entry("zero_engine.SequenceParallelAttention", zero_engine.SequenceParallelAttention))
    parts.append(_entry("zero_engine.SequenceGroupLoader", zero_engine.SequenceGroupLoader))
    parts.append("## Errors\n")
    parts += [f"### `zero_engine.{error.__name__}`\n\n{_text(inspect.getdoc(error))}\n"
              for error in (ConfigError, DivergedRanksError, CheckpointError, ShardedParameterError, SwapError)]
    parts.append("## Integrations\n")
    for cls, where in ((ZeroEngineTrainer, "transformers"), (ZeroEngineStrategy, "lightning"),
                       (Accelerator, "accelerate")):
        parts.append(f"### `zero_engine.integrations.{where}.{cls.__name__}`\n\n{_text(inspect.getdoc(cls))}\n")
    parts.append(COMMAND_LINE)
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/reference/api.md is out of date")
    args = parser.parse_args()
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date: python scripts/make_api_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
