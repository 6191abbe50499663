"""Loading a config: a YAML, JSON (or hjson, as DeepSpeed reads it) file, a dict, or a config
object; DeepSpeed's spellings translated first (`zero_engine.config.deepspeed_compat`); every problem
reported at once as one `ConfigError` whose lines each name a key path, the value and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hjson
import yaml
from pydantic import BaseModel, ValidationError

from .deepspeed_compat import translate
from ..errors import ConfigError, suggest
from .schema import ZeroEngineConfig


def load_config(source: str | Path | dict[str, Any] | ZeroEngineConfig) -> ZeroEngineConfig:
    """A validated config from a ``.yaml``/``.yml``/``.json`` path, a dict, or a config object."""
    if isinstance(source, ZeroEngineConfig):
        return source
    raw, origin = read_config_mapping(source)
    translated = translate(raw)
    try:
        config = ZeroEngineConfig.model_validate(translated.config)
    except ValidationError as err:
        raise ConfigError(_format_errors(origin, translated.problems, err, translated.refused_auto)) from None
    if translated.problems:
        raise ConfigError(_format_errors(origin, translated.problems))
    config._notes = translated.notes
    config._auto = translated.auto
    return config


def read_config_mapping(source: str | Path | dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The raw mapping of a config file or dict, not yet translated or validated (integrations
    fill Hugging Face's ``"auto"`` in it first), and where it came from, for error messages."""
    origin = "config dict"
    if isinstance(source, (str, Path)):
        origin = str(source)
        source = _read_file(Path(source))
    if not isinstance(source, dict):
        raise ConfigError(f"{origin}: expected a mapping of keys at the top level, got {type(source).__name__}")
    return source, origin


def _read_file(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
            if data is None:
                raise ConfigError(f"{path}: the config file is empty (nothing but comments or blank lines)")
            return data
        if path.suffix in (".json", ".hjson"):
            return _read_json(text)
    except _DuplicateKey as err:
        raise ConfigError(f"{path}:{err}") from None
    except (yaml.YAMLError, hjson.HjsonDecodeError) as err:
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {err}") from None
    raise ConfigError(f"{path}: unknown config suffix {path.suffix!r}; use .yaml, .yml or .json")


def _read_json(text: str) -> Any:
    """Strict JSON first (it reads ``Infinity``, which Accelerate writes); else hjson, as
    DeepSpeed reads its config: comments, trailing and missing commas. Errors name the line."""
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except json.JSONDecodeError:
        return hjson.loads(text, object_pairs_hook=_unique_pairs)


class _DuplicateKey(ValueError):
    """A key given twice in one mapping: YAML and JSON parsers keep the last one silently (a
    second ``zero_optimization:`` block turned stage 3 into stage 1)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor``: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise _DuplicateKey(f"{line}: key {key!r} given twice in one mapping (first on line {first_line[key]})")
            first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: one object's keys, refusing a key given twice."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(f" key {key!r} given twice in one object")
        result[key] = value
    return result


def _format_errors(
    origin: str, problems: list[str], err: ValidationError | None = None, refused_auto: list[str] = ()
) -> str:
    """One message for every problem of a config: translation problems, then field errors. A
    field error about a key refused as ``"auto"`` (left out, so missing) is the first error's
    echo, and is left out (issue 65: a scheduler "required" its step count given as "auto")."""
    items = [
        item for item in _merged_union_errors(err.errors() if err is not None else [])
        if not any(path in str(item["msg"]) or path == ".".join(map(str, item["loc"])) for path in refused_auto)
    ]
    lines = [f"{origin}: {len(problems) + len(items)} invalid setting(s)"]
    lines += [f"  {problem}" for problem in problems]
    for item in items:
        loc = item["loc"]
        path = ".".join(str(part) for part in loc)
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            known = list(_model_at(loc[:-1]).model_fields)
            elsewhere = [where for where in _paths_of_key(str(loc[-1])) if where != path]
            if 0 < len(elsewhere) <= 2:  # a key of another section (offload_optimizer at the top level)
                lines.append(f"  {path}: not a key here; it belongs at {' or '.join(elsewhere)}")
            else:
                lines.append(f"  {path}: unknown key{suggest(str(loc[-1]), known)}")
        elif path:
            lines.append(f"  {path} = {item['input']!r}: {message}")
        else:
            lines.append(f"  {message}")
    return "\n".join(lines)


# pydantic's names for the members of a union (``int``, ``literal['auto']``, ``function-after[...]``).
_UNION_TAGS = {"int", "str", "float", "bool", "none", "list", "dict"}


def _merged_union_errors(items: list[Any]) -> list[Any]:
    """One error per key for a value that fits no member of a union (``stage: 4`` against
    ``0-3 | 'auto'``), the members' messages joined, without pydantic's member names in the path."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for item in items:
        loc = tuple(part for part in item["loc"] if not _is_union_tag(part))
        key = (loc, repr(item.get("input")))
        if key in merged:
            merged[key]["msg"] += f"; or {item['msg'].removeprefix('Value error, ')}"
        else:
            merged[key] = {**item, "loc": loc}
    return list(merged.values())


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and ("[" in part or "(" in part or part in _UNION_TAGS)


def _paths_of_key(key: str, model: type[BaseModel] = ZeroEngineConfig, prefix: str = "") -> list[str]:
    """Every key path of the schema whose last key is ``key``."""
    found = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        if name == key:
            found.append(path)
        for candidate in getattr(field.annotation, "__args__", (field.annotation,)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                found += _paths_of_key(key, candidate, f"{path}.")
    return found


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel]:
    """The pydantic section class found at a key path, for listing its known keys."""
    model: type[BaseModel] = ZeroEngineConfig
    for part in loc:
        annotation = model.model_fields[str(part)].annotation
        candidates = getattr(annotation, "__args__", (annotation,))
        model = next(c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel))
    return model
