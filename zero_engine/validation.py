"""One set of checks of a config, before any model or process group: `initialize` runs them, and
``zero-engine validate`` runs the same, so the two agree on what passes (issue 65: validate
passed an all-``"auto"`` batch that initialize refused, and refused a Trainer's ``"auto"``
config that the Trainer accepts).

`check_config` takes a loaded config and what is known of the model (its hidden size, for the
bucket sizes Hugging Face writes as ``"auto"``): ``"auto"`` filled or refused
(`zero_engine.auto_values`), features not built refused, the optimizer checked against the stage,
the precision resolved and, given a world size, the batch arithmetic; the keys that will have no
effect listed. `trainer_stand_ins` is what a config meant for Hugging Face's Trainer (or TRL's,
or Lightning's) is checked with: each ``"auto"`` the Trainer fills from its arguments replaced by
a valid stand-in, so that everything else is checked before the Trainer knows its values.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

from .auto_values import fill_auto
from .comm import Mesh
from .config import BatchSizes, ZeroEngineConfig, auto_keys, no_effect_settings
from .errors import ConfigError
from .config.deepspeed_compat import AUTO_BATCH_KEYS
from .config.refusals import refuse as refuse_unbuilt_features
from .optim import check_optimizer_for_stage
from .precision import Precision
from .sharding.shards.codec import asked_wire_forms
from .sharding.tiers.nvme import check_swap_directory
from .stage import stage_for

# What Hugging Face's Trainer fills from its arguments (`zero_engine.integrations.training_arguments`),
# with a value that passes every check, for validating a Trainer's config without the Trainer.
TRAINER_STAND_INS: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "fp16.enabled": False,
    "bf16.enabled": False,
    "optimizer.params.lr": 1e-3,
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_min_lr": 0.0,
    "scheduler.params.warmup_max_lr": 1e-3,
    "scheduler.params.warmup_num_steps": 1,
    "scheduler.params.total_num_steps": 2**31 - 1,
}


class Checked(NamedTuple):
    """A config that passed, filled for the model, with what was noted on the way."""

    config: ZeroEngineConfig
    batch: BatchSizes | None  # given a world size
    notes: list[str]  # keys that change nothing here; "auto" filled and from what


class _Model:
    """What `fill_auto` reads of a model (its config's hidden size), for a check without one."""

    def __init__(self, hidden_size: int | None) -> None:
        self.config = type("Config", (), {"hidden_size": hidden_size})()


def check_config(config: ZeroEngineConfig, model: Any = None, ranks: int | None = None, *,
                 hidden_size: int | None = None) -> Checked:
    """`initialize`'s checks of ``config`` that need no process group, in its order (a
    `ConfigError` or `NotImplementedError` naming the keys). ``model``: the model (its hidden
    size fills bucket sizes); without one, ``hidden_size`` stands for it, and bucket sizes left
    ``"auto"`` with neither are noted, not refused (`initialize` sizes them from the model).
    ``ranks``: the ranks it will run on, for the batch arithmetic (over ``ranks /
    sequence_parallel_size`` data-parallel ranks)."""
    notes = []
    auto = [key for key in auto_keys(config) if key not in AUTO_BATCH_KEYS]
    if model is None:
        if auto and hidden_size is None:
            notes += [f"{key} is 'auto': initialize fills it from the model's config.hidden_size (a model "
                      "without one refuses it; --hidden-size fills it here)" for key in auto]
        model = _Model(hidden_size if hidden_size is not None else 1)
    elif auto:
        notes.append(f"{', '.join(auto)}: 'auto', filled from the model's hidden size")
    batch_auto = [key for key in auto_keys(config) if key in AUTO_BATCH_KEYS]
    config = fill_auto(config, model)
    notes += [
        f"{key} is 'auto': initialize fills it from the world size and the other batch keys" for key in batch_auto
    ]
    refuse_unbuilt_features(config)
    zero, without_model = config.zero_optimization, isinstance(model, _Model)
    offloads = [(f"zero_optimization.{name}.nvme_path", section.device, section.nvme_path)
                for name in ("offload_optimizer", "offload_param") if (section := getattr(zero, name)) is not None]
    notes += swap_directory_notes(offloads, without_model)
    for key, what in (("tiled_loss_tokens", "a Hugging Face causal language model with an output head"),
                      ("tiled_mlp_tokens", "a model with modules named 'mlp'")):
        if without_model and getattr(config, key):
            notes.append(f"{key}: the model must be {what} (checked at initialize)")
    if config.zero_optimization.stage != "auto":
        check_optimizer_for_stage(config.optimizer, stage_for(config.zero_optimization.stage))
    Precision.from_config(config)
    try:  # the wire forms named exist, and agree with the ZeRO++ keys
        asked_wire_forms(zero.weight_wire_format, zero.gradient_wire_format, zero.zero_quantized_weights,
                         zero.zero_quantized_gradients, zero.zero_quantized_gradients_bits)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    batch = None
    if ranks is not None:
        batch = config.batch_sizes(Mesh.from_config(config, ranks, shard_group_size=ranks).batch)
    return Checked(config, batch, [*no_effect_settings(config), *notes])


def swap_directory_notes(offloads: list[tuple[str, str, str | None]], without_model: bool) -> list[str]:
    """NVMe offload's directories (``(key, device, nvme_path)`` of each offload section) checked
    as `initialize` checks them (there, a `ConfigError`: missing, a file, in memory, read-only,
    ``~``), their room left to `initialize` where the model's size is unknown; a path given with
    another device noted."""
    notes = []
    for key, device, path in offloads:
        if path is None:
            continue
        if device != "nvme":
            notes.append(f"{key} = {path!r} has no effect with device = {device!r}")
            continue
        check_swap_directory(path, 0, (key,))
        if without_model:
            notes.append(f"{key}: the room for the swap files is checked at initialize (it needs the model's size)")
    return notes


def trainer_stand_ins(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A copy of a raw config meant for Hugging Face's Trainer with each ``"auto"`` the Trainer
    fills from its arguments replaced by a stand-in, and those keys. ``train_batch_size`` left
    ``"auto"`` is dropped: the Trainer derives it from the others."""
    config, filled = copy.deepcopy(raw), []
    for path, value in {**TRAINER_STAND_INS, "train_batch_size": None}.items():
        *sections, key = path.split(".")
        section = config
        for name in sections:
            section = section.get(name) if isinstance(section, dict) else None
        if isinstance(section, dict) and section.get(key) == "auto":
            if value is None:
                del section[key]
            else:
                section[key] = value
            filled.append(path)
    return config, filled


def summary(config: ZeroEngineConfig, batch: BatchSizes | None, ranks: int | None) -> str:
    """One line: the stage, precision, batch arithmetic (over ``ranks``) and offload."""
    zero = config.zero_optimization
    precision = "fp16" if config.fp16.enabled else "bf16" if config.bf16.enabled else "fp32"
    parts = [f"stage {zero.stage}", precision, config.optimizer.type]
    if batch is not None and ranks:
        k = config.sequence_parallel_size
        reading = f"{ranks // k} data-parallel rank(s) ({ranks} ranks, sequences split over {k})" if k > 1 else (
            f"{ranks} rank(s)")
        parts.append(f"micro {batch.micro_batch_size} x accumulation {batch.gradient_accumulation_steps} x "
                     f"{reading} = {batch.train_batch_size} samples a step")
    offloaded = [f"{name.split('_')[1]} to {section.device}" for name in ("offload_optimizer", "offload_param")
                 if (section := getattr(zero, name)) is not None and section.device != "none"]
    parts.append("offload: " + ", ".join(offloaded) if offloaded else "no offload")
    if zero.shard_group_size not in (None, "auto") and ranks and zero.shard_group_size < ranks:
        parts.append(f"sharded over groups of {zero.shard_group_size}")
    elif zero.shard_group_size == "auto":
        parts.append("shard groups of each node's ranks (settled at launch)")
    if config.sequence_parallel_size > 1:
        parts.append("evaluation split too" if config.sequence_parallel_eval else "evaluation whole")
    if config.expert_parallel_size > 1:
        owners = f", each expert's state over {ranks // config.expert_parallel_size} rank(s)" if ranks else ""
        parts.append(f"experts owned per rank: 1/{config.expert_parallel_size} of every MoE block's on each, tokens "
                     f"exchanged over groups of {config.expert_parallel_size}{owners}")
    if zero.recompute_units:
        offloads = zero.recompute_offload or bool((config.activation_checkpointing or {}).get("cpu_checkpointing"))
        parts.append("units recomputed, their inputs on the host" if offloads else "units recomputed")
    return ", ".join(parts)
