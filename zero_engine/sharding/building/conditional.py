"""Conditional computation (a mixture of experts) under ``sequence_parallel_size``.

The ranks of a sequence group route different tokens (each its slice), so an expert may run
on one rank of the group and not on another. Without the split that is safe (stage 3's
gathers are agreed in rounds, reductions launched in one order). With it, every attention
exchange is a collective the ranks block on, and a collective that only some ranks launch
late waits behind it (GPU review R1):

- at stage 3, a unit that a rank skips is still gathered there, but only at that rank's next
  gather: a rank that ran the expert waits for its gather while the other waits in the next
  layer's all-to-all, each for the other. So no unit may lie inside a mixture of experts'
  block: the block is one unit, run (its router at least) by every rank, as DeepSpeed asks of
  ``set_z3_leaf_modules``. A wrap list naming the experts (or anything under the block) is
  refused at `initialize`, naming the block and the unit;
- at stages 0-2, a unit one of whose parameters got no gradient on a rank is launched there at
  the backward's end, while another rank waits for it (a full bucket, stage 2's out-of-room
  wait) before its next exchange. So a model with such a block reduces after its backward, not
  during it (``overlap_comm`` off), as a rank with no expert's gradient does anyway.

A mixture of experts' block is a module with an ``experts`` module (Hugging Face's name in
Mixtral, Qwen2/3-MoE, DeepSeek, OLMoE, GPT-OSS; a plain model names its own so).
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

from ..units.module_plan import ModulePlan
from .build import BuildSettings

logger = logging.getLogger("zero_engine")


def expert_blocks(model: nn.Module) -> list[str]:
    """The paths of ``model``'s mixture-of-experts blocks (modules with an ``experts`` module)."""
    return [name for name, module in model.named_modules() if isinstance(getattr(module, "experts", None), nn.Module)]


def settings_under_split(model: nn.Module, plan: ModulePlan, settings: BuildSettings, k: int,
                         log: bool = False) -> BuildSettings:
    """``settings`` for a model split over sequence groups of ``k`` ranks: unchanged for a model
    without a mixture of experts; else, at stage 3, `NotImplementedError` for a unit inside an
    experts block, and below it reductions after the backward (``log``: say so)."""
    blocks = expert_blocks(model)
    if not blocks:
        return settings
    if settings.stage.shard_parameters:
        for unit in plan.units:
            block = next((b for b in blocks if unit.path.startswith(f"{b}." if b else "")), None)
            if block is not None and unit.path != block:
                raise NotImplementedError(
                    f"sequence_parallel_size = {k} at stage 3: the unit {unit.label} ({type(unit.module).__name__}) "
                    f"lies inside the mixture of experts' block {block or '<root>'}: the ranks of a sequence group "
                    "route different tokens, and a unit some rank skips would be gathered there behind its next "
                    "attention exchange, which the others wait in (a hang). Keep the block one unit: take the "
                    "experts' class out of zero_optimization.stage3_wrap_modules (name the block's class instead)"
                )
        return settings
    if settings.overlap_comm and log:
        logger.info(
            "sequence_parallel_size = %d with a mixture of experts (%s): gradients are reduced after each backward, "
            "not during it (overlap_comm off), since an expert may get no gradient on some rank of a sequence group",
            k, blocks[0] or "<root>",
        )
    return dataclasses.replace(settings, overlap_comm=False)
