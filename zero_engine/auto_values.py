"""Hugging Face's ``"auto"``, filled where plain `initialize` can know the value.

Hugging Face's DeepSpeed integration fills ``"auto"`` from ``TrainingArguments`` and the model.
Without a Trainer, two groups can still be filled, with the integration's own rules:

- the batch triple: any two of ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and
  ``gradient_accumulation_steps`` give the third through the world size (`BatchSizes`), so one
  ``"auto"`` among them is filled and two or three are not;
- the bucket sizes, from the model's ``config.hidden_size`` h (a Hugging Face model; the largest
  of ``config.hidden_sizes`` where a model has several): ``reduce_bucket_size`` h*h,
  ``stage3_prefetch_bucket_size`` 0.9*h*h, ``stage3_param_persistence_threshold`` 10*h.

Every other ``"auto"`` is refused when the config loads (`zero_engine.config.deepspeed_compat`); what
cannot be filled here fails at `initialize`, every key named at once.
"""

from __future__ import annotations

from typing import Any

from .config import ZeroEngineConfig, auto_keys
from .config.deepspeed_compat import AUTO_BATCH_KEYS
from .errors import ConfigError

_FROM_HIDDEN_SIZE = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def fill_auto(config: ZeroEngineConfig, model: Any) -> ZeroEngineConfig:
    """``config`` with its fillable ``"auto"`` keys filled for ``model`` (the batch keys stay
    unset: `ZeroEngineConfig.batch_sizes` derives them); a `ConfigError` naming every one that
    cannot be."""
    auto = auto_keys(config)
    if not auto:
        return config
    unfilled = []
    batch = [key for key in AUTO_BATCH_KEYS if key in auto]
    if len(batch) == 3:
        unfilled.append(
            "train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps (all three 'auto': "
            "Hugging Face's Trainer fills them from its TrainingArguments; without it give "
            "train_micro_batch_size_per_gpu, and gradient_accumulation_steps or train_batch_size)"
        )
    elif len(batch) == 2:
        unfilled.append(f"{' and '.join(batch)} (the world size and one batch key give only one of the three)")
    hidden = hidden_size(model)
    buckets = {}
    for path in auto:
        section, _, key = path.rpartition(".")
        if section != "zero_optimization":
            continue
        if hidden is None:
            unfilled.append(f"{path} (the model has no config.hidden_size to size it from)")
        else:
            buckets[key] = _FROM_HIDDEN_SIZE[key](hidden)
    if unfilled:
        raise ConfigError("'auto' that initialize cannot fill: " + "; ".join(unfilled) + ". Give values for them.")
    if not buckets:
        return config
    filled = config.model_copy(update={"zero_optimization": config.zero_optimization.model_copy(update=buckets)})
    return filled


def hidden_size(model: Any) -> int | None:
    """A Hugging Face model's hidden size (the largest of ``hidden_sizes``), else None."""
    model_config = getattr(model, "config", None)
    size = getattr(model_config, "hidden_size", None)
    if isinstance(size, int) and size > 0:
        return size
    sizes = getattr(model_config, "hidden_sizes", None)
    if isinstance(sizes, (list, tuple)) and sizes and all(isinstance(s, int) for s in sizes):
        return max(sizes)
    return None
