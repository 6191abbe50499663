"""The zero_engine configuration: one validated pydantic model for the whole file.

Key names follow DeepSpeed's wherever the feature is the same, so a ``ds_config.json`` that
uses only supported features loads unchanged. The whole schema is validated up front, even
for features a later release implements; `zero_engine.features` decides at `initialize`
which switched-on features are not built yet.

Every error is a `ConfigError` whose lines each name a key path, the offending value and
the fix (an unknown key suggests the closest known one).

The package: `types` (value types), `sections` (each section), `schema` (the whole file),
`checks` (optimizer and scheduler), `deepspeed` (DeepSpeed's keys without effect, the key
table), `load` (reading and errors).
"""

from __future__ import annotations

from .checks import (
    DEEPSPEED_OPTIMIZERS, check_optimizer, check_scheduler, optimizer_class, optimizer_classes, optimizer_options,
)
from .deepspeed import DEEPSPEED_SECTIONS, NO_EFFECT, auto_keys, key_reference, no_effect_settings
from .load import load_config, read_config_mapping
from .schema import BatchSizes, ZeroEngineConfig, resolve_batch_sizes
from .sections import (
    BF16Config, CometConfig, CommConfig, CsvMonitorConfig, FP16Config, OffloadConfig, OffloadOptimizerConfig,
    OffloadParamConfig, OptimizerConfig, SchedulerConfig, TensorBoardConfig, WandbConfig, ZeroOptimizationConfig,
)
from .types import MAX_TIMEOUT_S

__all__ = [
    "BF16Config", "BatchSizes", "CometConfig", "CommConfig", "CsvMonitorConfig", "DEEPSPEED_OPTIMIZERS",
    "DEEPSPEED_SECTIONS", "FP16Config", "MAX_TIMEOUT_S", "NO_EFFECT", "OffloadConfig", "OffloadOptimizerConfig",
    "OffloadParamConfig", "OptimizerConfig", "SchedulerConfig", "TensorBoardConfig", "WandbConfig",
    "ZeroEngineConfig", "ZeroOptimizationConfig", "auto_keys", "check_optimizer", "check_scheduler", "key_reference",
    "load_config", "no_effect_settings", "optimizer_class", "optimizer_classes", "optimizer_options",
    "read_config_mapping", "resolve_batch_sizes",
]
