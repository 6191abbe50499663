"""What the engine itself reads of the config, derived once at `initialize` (`EngineSettings.derive`).

The engine's parts each get the settings they act on, never the config: the optimizer step its
`StepSettings`, the module transforms theirs, rank 0's progress line its interval, the monitors
their sections. The resolved config rides along for what shows it whole: ``engine.config`` and
each checkpoint's manifest.
"""

from __future__ import annotations

from dataclasses import dataclass
from .config import ZeroEngineConfig
from .errors import ConfigError
from .monitor import Monitors
from .precision import LossScaling
from .state import formats
from .step import StepSettings
from .transforms.table import TransformSettings


@dataclass(frozen=True)
class EngineSettings:
    """The engine's settings: the step's, the transforms', the progress line's, the monitors'."""

    step: StepSettings
    transforms: TransformSettings
    print_interval: int | None  # ``steps_per_print``: rank 0's progress line; None: never
    wall_clock_breakdown: bool  # the line's phase times
    monitors: Monitors
    checkpoint_format: str  # what save_checkpoint writes by default
    config: ZeroEngineConfig  # resolved (``stage: auto`` settled): ``engine.config`` and the manifest's

    @classmethod
    def derive(cls, config: ZeroEngineConfig) -> EngineSettings:
        """From the resolved config; a monitor switched on without its package fails here
        (`Monitors.from_config`), on every rank, as does a checkpoint format not written."""
        fp16, zero, checkpointing = config.fp16, config.zero_optimization, config.activation_checkpointing or {}
        scaling = LossScaling(
            fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis, fp16.min_loss_scale,
            fp16.consecutive_hysteresis,
        ) if fp16.enabled else None
        return cls(
            StepSettings(config.optimizer, config.scheduler or None, config.gradient_clipping, scaling),
            TransformSettings(
                config.sequence_parallel_eval, config.tiled_loss_tokens, config.tiled_mlp_tokens, zero.recompute_units,
                # DeepSpeed's activation_checkpointing.cpu_checkpointing: with recompute_units, recompute_offload
                zero.recompute_units and (zero.recompute_offload or bool(checkpointing.get("cpu_checkpointing"))),
                config.sequence_parallel_size, config.expert_parallel_size,
            ),
            config.steps_per_print, config.wall_clock_breakdown, Monitors.from_config(config),
            _written_format(config.checkpoint_format), config,
        )


def _written_format(name: str) -> str:
    """``checkpoint_format``, checked against the formats this engine writes (`ConfigError`)."""
    try:
        formats.writing(name)
    except ValueError as err:
        raise ConfigError(f"checkpoint_format: {err}") from None
    return name
