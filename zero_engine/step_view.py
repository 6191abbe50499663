"""The optimizer step as the engine shows it: DeepSpeed's engine attributes and readings
(``optimizer``, ``lr_scheduler``, ``loss_scale``, ``get_lr``, ``get_global_grad_norm``, ...),
each read from the `OptimizerStep` (`zero_engine.step`) that owns it, so that neither the loop
(`zero_engine.engine`) nor the state surface (`zero_engine.model_access`) restates them."""

from __future__ import annotations

from typing import Any

import torch

from .step import NoOptimizerStep, OptimizerStep


class StepView:
    """A mixin of `zero_engine.engine.Engine`: the step's parts, read through ``optimizer_step``."""

    optimizer_step: OptimizerStep | NoOptimizerStep

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The torch optimizer over this rank's shards; None for an engine with nothing to train."""
        return self.optimizer_step.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self.optimizer_step.lr_scheduler

    @property
    def loss_scaler(self) -> Any:
        return self.optimizer_step.loss_scaler

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for a non-finite gradient norm (fp16 overflows among them)."""
        return self.optimizer_step.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.optimizer_step.skipped_steps = value

    def was_step_applied(self) -> bool:
        """Whether the last boundary's ``step()`` updated the parameters (False after a step
        skipped for a non-finite gradient, e.g. an fp16 overflow, and before the first)."""
        return self.optimizer_step.applied

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale; 1.0 without fp16."""
        return self.optimizer_step.loss_scale

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_global_grad_norm(self) -> float | None:
        """The L2 norm of the whole averaged, unscaled gradient at the last optimizer step
        (before clipping)."""
        return self.optimizer_step.grad_norm
