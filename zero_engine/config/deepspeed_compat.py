"""DeepSpeed's other spellings of a config, translated before validation.

A ``ds_config.json`` that DeepSpeed accepts should load here with every key honoured or
accounted for. `translate` rewrites what DeepSpeed spells differently, on a copy of the raw
mapping, and returns notes for `initialize` to log:

- keys that start with ``_`` are comments (``"_comment": "..."``), at every level;
- ``"auto"`` (Hugging Face's placeholder): where plain ``initialize`` can fill it (`FILLED_AT_INITIALIZE`:
  the batch sizes from the world size, the bucket sizes from the model's hidden size) the key
  is left out and listed in ``Translated.auto``; anywhere else it is refused with every key
  that holds it named;
- both spellings of the stage 3 keys (``max_live_parameters`` and
  ``stage3_max_live_parameters``: DeepSpeed accepts either), refusing both at once with
  different values; likewise ``bfloat16``, DeepSpeed's other name of the ``bf16`` section;
- deprecated names (``stage3_gather_fp16_weights_on_model_save``, ``cpu_offload``, ...),
  each with a one-line `FutureWarning` naming the current key;
- DeepSpeed's Adam and AdamW, as DeepSpeed 0.19.8 builds them: ``type: Adam`` is AdamW
  (decoupled weight decay) unless ``adam_w_mode: false``, and ``weight_decay`` left out is 0
  (its fused Adam's default; torch's AdamW would decay by 0.01), except with ``torch_adam:
  true``, where DeepSpeed builds torch's own class with torch's defaults (torch.optim is always
  used here, so the key has no other effect); ``bias_correction: false`` is refused (torch's
  Adam and AdamW always correct).

What cannot be translated is returned as problems, reported in one `ConfigError` with the
validation errors of the rest (never in rounds).

Sections and top-level keys that only DeepSpeed has (monitors, profilers, ...) are fields of
the schema (`zero_engine.config`), so that the key table documents them.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

STAGE3_SHORT_NAMES = (
    "max_live_parameters",
    "max_reuse_distance",
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "allgather_sequential",
)
# Deprecated DeepSpeed names -> the current key (in zero_optimization).
DEPRECATED_ZERO_KEYS = {
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}
# Deprecated offload switches -> (section, key in it, value when the switch is true).
DEPRECATED_OFFLOAD = {
    "cpu_offload": ("offload_optimizer", "device", "cpu"),
    "cpu_offload_param": ("offload_param", "device", "cpu"),  # DeepSpeed 0.19.8's field
    "cpu_offload_params": ("offload_param", "device", "cpu"),  # its documentation's spelling
    "cpu_offload_use_pin_memory": ("offload_optimizer", "pin_memory", True),
}


# Keys of ours where "auto" is a value with its own meaning.
OWN_AUTO = {"zero_optimization.stage", "zero_optimization.shard_group_size", "comm.backend", "comm.primitives"}
# "auto" that `zero_engine.auto_values.fill_auto` fills at initialize, as Hugging Face's
# integration does: the batch triple from the world size and the other two, the bucket sizes
# from the model's hidden size (stage 3 keys in their long spelling).
AUTO_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
AUTO_BUCKET_KEYS = (
    "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)
FILLED_AT_INITIALIZE = frozenset((*AUTO_BATCH_KEYS, *AUTO_BUCKET_KEYS))


# The keys whose default here is not DeepSpeed 0.19.8's, and why. Every other key that DeepSpeed
# has takes its default (tests/test_deepspeed_defaults.py holds them to DeepSpeed's own, recorded
# by scripts/record_deepspeed_traces.py); docs/config.md shows both columns.
DEFAULTS_THAT_DIFFER: dict[str, str] = {
    "zero_optimization.reduce_bucket_size": "a bucket is also a stage 1-2 shard unit, and two are alive during "
    "backward: DeepSpeed's 500,000,000 elements would hold 4 GB of fp32 buckets; no number changes with it (the "
    "reduction sums the same values in any cut)",
    "zero_optimization.overlap_comm": "DeepSpeed overlaps at stage 3 only (unset: false below); we overlap at every "
    "stage: the same numbers, sooner",
    "zero_optimization.leaf_module": "DeepSpeed makes Mixtral's and Qwen-MoE's sparse blocks leaf modules (gathered "
    "whole); every unit here is a whole module already, and those blocks sit inside the decoder layers Hugging Face "
    "declares in _no_split_modules",
    "communication_data_type": "the same unset value, another meaning: DeepSpeed then reduces gradients in the "
    "compute dtype (bf16, fp16), we reduce in fp32 (exact sums; set bf16 or fp16 for DeepSpeed's, half the bytes)",
}
SAME_DEFAULT_OTHER_MEANING = frozenset({"communication_data_type"})


class ConfigFutureWarning(FutureWarning):
    """A DeepSpeed key that still works but has a current name."""


class Translated(NamedTuple):
    config: dict[str, Any]  # in this schema's spelling
    notes: list[str]  # for initialize to log
    problems: list[str]  # what could not be translated, each naming its keys
    auto: list[str]  # keys left out for initialize to fill (`FILLED_AT_INITIALIZE`)
    refused_auto: list[str] = []  # "auto" nothing here fills, left out too: refused in `problems`


def translate(raw: dict[str, Any]) -> Translated:
    """A copy of ``raw`` in this schema's spelling, notes, and the problems found."""
    config = _without_comments(raw)  # a copy: every mapping and list is rebuilt
    notes: list[str] = []
    problems: list[str] = []
    auto = [path for path in _auto_paths(config) if path not in OWN_AUTO]
    unfillable = [path for path in auto if _long_spelling(path) not in FILLED_AT_INITIALIZE]
    if unfillable:
        problems.append(
            f"'auto' is Hugging Face's placeholder, filled from TrainingArguments by its Trainer integration; "
            "plain initialize fills only the batch sizes (from the world size) and the bucket sizes (from the "
            f"model's hidden size): give values for {', '.join(unfillable)}"
        )
    for path in auto:  # left out: filled at initialize, or reported above (and no second error each)
        *sections, key = path.split(".")
        _section(config, sections).pop(key)
    if "bfloat16" in config:  # DeepSpeed's other name of the section
        _merge_spellings(config, "bfloat16", "bf16", "", problems)
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        _merge_stage3_spellings(zero, problems)
        _rename_deprecated(zero, problems)
    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict) and isinstance(optimizer.setdefault("params", {}), dict):
        notes.extend(_translate_fused_adam(optimizer, problems))
    filled = [_long_spelling(path) for path in auto if _long_spelling(path) in FILLED_AT_INITIALIZE]
    return Translated(config, notes, problems, filled, unfillable)


def _long_spelling(path: str) -> str:
    """A stage 3 key in its ``stage3_`` spelling (DeepSpeed accepts both)."""
    section, _, key = path.rpartition(".")
    return f"{section}.stage3_{key}" if section == "zero_optimization" and key in STAGE3_SHORT_NAMES else path


def _section(config: dict[str, Any], sections: list[str]) -> dict[str, Any]:
    for name in sections:
        config = config[name]
    return config


def _auto_paths(value: Any, prefix: str = "") -> list[str]:
    """Every key path whose value is the string ``"auto"``."""
    if isinstance(value, dict):
        return [path for key, item in value.items() for path in _auto_paths(item, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if value == "auto" else []


def _without_comments(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_comments(v) for k, v in value.items() if not (isinstance(k, str) and k.startswith("_"))}
    if isinstance(value, list):
        return [_without_comments(v) for v in value]
    return value


def _merge_spellings(section: dict[str, Any], other: str, key: str, prefix: str, problems: list[str]) -> None:
    """``section[key] = section.pop(other)`` unless ``key`` is set already to something else (a
    problem naming both, under ``prefix``)."""
    value = section.pop(other)
    if key in section and section[key] != value:
        problems.append(
            f"{prefix}{other} = {value!r} and {prefix}{key} = {section[key]!r} are two spellings of one key and "
            "disagree: keep one"
        )
        return
    section[key] = value


def _merge_stage3_spellings(zero: dict[str, Any], problems: list[str]) -> None:
    for short in STAGE3_SHORT_NAMES:
        if short in zero:
            _merge_spellings(zero, short, f"stage3_{short}", "zero_optimization.", problems)


def _rename_deprecated(zero: dict[str, Any], problems: list[str]) -> None:
    for old, new in DEPRECATED_ZERO_KEYS.items():
        if old in zero:
            _deprecated(f"zero_optimization.{old}", f"zero_optimization.{new}")
            _merge_spellings(zero, old, new, "zero_optimization.", problems)
    for old, (section, key, on) in DEPRECATED_OFFLOAD.items():
        if old in zero:
            switched_on = zero.pop(old)
            _deprecated(f"zero_optimization.{old}", f"zero_optimization.{section}.{key}")
            if switched_on:
                target = zero.setdefault(section, {})
                if isinstance(target, dict):
                    target.setdefault(key, on)


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is DeepSpeed's deprecated name: use {new}", ConfigFutureWarning, stacklevel=4)


def _translate_fused_adam(optimizer: dict[str, Any], problems: list[str]) -> list[str]:
    """DeepSpeed's Adam and AdamW onto torch.optim's, as DeepSpeed 0.19.8 builds them
    (``_configure_basic_optimizer``): decoupled decay unless ``adam_w_mode: false`` (the
    switch is ignored for AdamW), and its fused Adam's ``weight_decay`` of 0 unless
    ``torch_adam: true`` asks for torch's class with torch's defaults."""
    params = optimizer["params"]
    kind = str(optimizer.get("type", "AdamW")).lower()
    notes = []
    torch_adam = params.pop("torch_adam", False)
    if torch_adam is True:
        notes.append("optimizer.params.torch_adam = true: torch's defaults apply (weight_decay 0.01 for AdamW, as "
                     "DeepSpeed builds torch's class); torch.optim's optimizers are always used here")
    if params.pop("bias_correction", True) is not True:
        problems.append(
            "optimizer.params.bias_correction = false: torch's Adam and AdamW always correct the bias of their "
            "moments; remove the key (true is the default)"
        )
    mode = params.pop("adam_w_mode", True)
    if not isinstance(mode, bool):
        problems.append(f"optimizer.params.adam_w_mode = {mode!r}: must be true or false")
    elif kind == "adam":
        optimizer["type"] = "AdamW" if mode else "Adam"
    if kind in ("adam", "adamw") and torch_adam is not True:
        params.setdefault("weight_decay", 0.0)
    return notes
