"""Mixed precision: which dtype computes, which reduces, and fp16's dynamic loss scale.

Compute copies of the parameters (what forward and backward see) are bf16 or fp16; the
optimizer updates fp32 masters held only for the range a rank owns. Gradients are reduced
in fp32 unless ``communication_data_type`` says otherwise. With fp16, the loss is multiplied by
a scale before backward and the gradients divided by it before the update; a non-finite
gradient on any rank makes every rank skip the step (the engine agrees on it through the
same small all-reduce that carries the gradient norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .config import ZeroEngineConfig

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != torch.float32

    @classmethod
    def from_config(cls, config: ZeroEngineConfig) -> Precision:
        compute = torch.float16 if config.fp16.enabled else torch.bfloat16 if config.bf16.enabled else torch.float32
        return cls(compute, _DTYPES[config.communication_data_type or "fp32"])


class LossScaler:
    """DeepSpeed's loss scaling: static when ``loss_scale > 0``, else dynamic.

    Dynamic: start at ``2**initial_scale_power``; after an overflow, spend one unit of
    hysteresis, or when none is left halve the scale (not below ``min_loss_scale``); on a clean
    step that follows a multiple of ``loss_scale_window`` clean steps since the last overflow
    (or the start), double it (and refill the hysteresis): DeepSpeed 0.19's rule, step for step
    (``tests/data/deepspeed_loss_scale.json``).
    """

    def __init__(
        self,
        static_scale: float = 0.0,
        initial_scale_power: int = 16,
        window: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        consecutive_hysteresis: bool = False,
    ) -> None:
        self.dynamic = static_scale == 0
        self.scale = 2.0**initial_scale_power if self.dynamic else float(static_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.remaining_hysteresis = hysteresis
        self.min_scale = min_scale
        self.consecutive_hysteresis = consecutive_hysteresis
        self.iteration = 0
        self.last_overflow = -1

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.remaining_hysteresis == 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.remaining_hysteresis -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.remaining_hysteresis = self.hysteresis
            clean_before = self.iteration - self.last_overflow - 1  # clean steps before this one (DeepSpeed 0.19)
            if clean_before > 0 and clean_before % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.remaining_hysteresis = self.hysteresis
                self.scale *= 2
        self.iteration += 1

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self.scale,
            "remaining_hysteresis": self.remaining_hysteresis,
            "iteration": self.iteration,
            "last_overflow": self.last_overflow,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.remaining_hysteresis = int(state["remaining_hysteresis"])
        self.iteration = int(state["iteration"])
        self.last_overflow = int(state["last_overflow"])


class LossScaling(NamedTuple):
    """fp16's loss scaling as configured (`LossScaler`'s arguments, in its order)."""

    static_scale: float
    initial_scale_power: int
    window: int
    hysteresis: int
    min_scale: float
    consecutive_hysteresis: bool
