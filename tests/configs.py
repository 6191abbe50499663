"""One builder for the engine configs the tests use (each test file states only what differs).

Keys left at None are left out of the config, so the engine's defaults apply to them. Clipping
is off unless a test asks for it (``clip=None`` leaves the key out: DeepSpeed's default, 1.0):
the single-process references the tests train do not clip.
"""

from __future__ import annotations

from typing import Any


def engine_config(
    stage: int,
    *,
    micro: int,
    lr: float,
    accum: int | None = None,
    optimizer: str = "AdamW",
    optimizer_params: dict[str, Any] | None = None,
    clip: float | None = 0.0,
    dtype: str | None = None,
    fp16: dict[str, Any] | None = None,
    primitives: str | None = None,
    **zero: Any,
) -> dict[str, Any]:
    """A config dict: ``dtype`` is "fp32", "bf16" or "fp16" (``fp16``: more keys of that
    section); ``zero`` holds ``zero_optimization`` keys besides the stage."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": optimizer, "params": {"lr": lr, **(optimizer_params or {})}},
        "zero_optimization": {"stage": stage, **{key: value for key, value in zero.items() if value is not None}},
    }
    if accum is not None:
        config["gradient_accumulation_steps"] = accum
    if clip is not None:
        config["gradient_clipping"] = clip
    if dtype is not None:
        config["bf16"] = {"enabled": dtype == "bf16"}
        config["fp16"] = {"enabled": dtype == "fp16", **(fp16 or {})}
    if primitives is not None:
        config["comm"] = {"primitives": primitives}
    return config
