"""Every ``"auto"`` rule of `zero_engine.integrations.training_arguments` and every mismatch
error, with Hugging Face's real TrainingArguments (one process: filling a mapping)."""

from __future__ import annotations

from typing import Any

import pytest

from zero_engine import ConfigError, load_config
from zero_engine.integrations.training_arguments import fill_from_arguments, fill_schedule, provisional_schedule

pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[hf]'")  # CI installs it


def _arguments(**overrides: Any) -> Any:
    from transformers import TrainingArguments

    options = dict(
        output_dir="unused", per_device_train_batch_size=3, gradient_accumulation_steps=4, learning_rate=2e-4,
        adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7, weight_decay=0.05, max_grad_norm=0.7, warmup_steps=0.1,
        use_cpu=True, report_to=[],
    )
    options.update(overrides)
    return TrainingArguments(**options)


AUTO_CONFIG = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto",
    }},
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
}


def test_every_auto_the_arguments_decide_is_filled_from_them() -> None:
    args = _arguments(bf16=True)
    filled = fill_schedule(fill_from_arguments(AUTO_CONFIG, args, data_ranks=2, origin="ds.json"), args, 200, "ds.json")
    assert filled["train_micro_batch_size_per_gpu"] == 3
    assert filled["gradient_accumulation_steps"] == 4
    assert filled["train_batch_size"] == 2 * 3 * 4
    assert filled["gradient_clipping"] == 0.7
    assert filled["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.8, 0.95], "eps": 1e-7, "weight_decay": 0.05}
    assert filled["scheduler"]["params"] == {
        "warmup_min_lr": 0, "warmup_max_lr": 2e-4, "warmup_num_steps": 20, "total_num_steps": 200,  # ratio 0.1
    }
    assert filled["fp16"] == {"enabled": False} and filled["bf16"] == {"enabled": True}
    assert filled["zero_optimization"]["reduce_bucket_size"] == "auto"  # initialize fills it from the model
    assert AUTO_CONFIG["gradient_clipping"] == "auto", "the caller's mapping is not modified"
    config = load_config(filled)
    assert config.bf16.enabled and config.optimizer.params["betas"] == [0.8, 0.95]


def test_keys_the_config_leaves_out_take_the_trainers_values_except_in_optimizer_and_scheduler() -> None:
    """The same Trainer without DeepSpeed clips at max_grad_norm and runs its batch sizes and
    precision; the optimizer and scheduler sections keep their own defaults (as Hugging Face)."""
    args = _arguments(fp16=False, bf16=True)
    raw = {"zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    filled = fill_from_arguments(raw, args, data_ranks=2, origin="ds.json")
    assert filled["train_micro_batch_size_per_gpu"] == 3 and filled["gradient_accumulation_steps"] == 4
    assert "train_batch_size" not in filled  # derived from the two and the world size
    assert filled["gradient_clipping"] == 0.7
    assert filled["bf16"] == {"enabled": True} and "fp16" not in filled
    assert filled["optimizer"]["params"] == {"lr": 2e-4}
    assert "scheduler" not in filled


def test_every_value_that_disagrees_with_the_arguments_is_named_in_one_error() -> None:
    args = _arguments()
    raw = {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-7, "weight_decay": 0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 2e-4}},
    }
    with pytest.raises(ConfigError) as caught:
        fill_from_arguments(raw, args, data_ranks=2, origin="ds.json")
    message = str(caught.value)
    assert message.startswith("ds.json: values that disagree with the Trainer's TrainingArguments")
    expected = [
        "train_batch_size = 16, but TrainingArguments give world size * per_device_train_batch_size * "
        "gradient_accumulation_steps = 24",
        "gradient_accumulation_steps = 2, but TrainingArguments give gradient_accumulation_steps = 4",
        "gradient_clipping = 1.0, but TrainingArguments give max_grad_norm = 0.7",
        "bf16.enabled = True, but TrainingArguments give bf16 or bf16_full_eval = False",
        "optimizer.params.lr = 0.001, but TrainingArguments give learning_rate = 0.0002",
        "optimizer.params.betas = [0.9, 0.999], but TrainingArguments give [adam_beta1, adam_beta2] = [0.8, 0.95]",
        "optimizer.params.weight_decay = 0, but TrainingArguments give weight_decay = 0.05",
        "scheduler.params.warmup_min_lr = 1e-05, but TrainingArguments give 0 (the Trainer warms up from 0) = 0",
    ]
    for line in expected:
        assert f"- {line}\n" in message, line
    assert message.count("\n- ") == len(expected)  # the micro-batch, eps and warmup_max_lr agree
    assert message.endswith('Set them to "auto" (filled from TrainingArguments) or make the two agree.')


def test_the_schedules_step_counts_are_checked_against_max_steps() -> None:
    args = _arguments(warmup_steps=5)
    raw = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}}}
    with pytest.raises(ConfigError) as caught:
        fill_schedule(raw, args, max_steps=80, origin="ds.json")
    assert "total_num_steps = 100, but TrainingArguments give the Trainer's max_steps = 80" in str(caught.value)
    warmup = "warmup_num_steps = 10, but TrainingArguments give warmup_steps (below 1: a fraction of max_steps) = 5"
    assert warmup in str(caught.value)


def test_a_config_is_validated_before_max_steps_is_known() -> None:
    raw = fill_from_arguments(AUTO_CONFIG, _arguments(), data_ranks=1, origin="ds.json")
    load_config(provisional_schedule(raw))  # the step counts stand in
    assert raw["scheduler"]["params"]["total_num_steps"] == "auto", "left for fill_schedule"
    raw["optimizer"]["params"]["lrr"] = 1.0
    with pytest.raises(ConfigError, match="lrr"):
        load_config(provisional_schedule(raw))


def test_an_auto_the_trainer_does_not_fill_is_named_by_the_config_loader() -> None:
    raw = dict(AUTO_CONFIG, zero_optimization={"stage": 3, "stage3_gather_16bit_weights_on_model_save": "auto"})
    with pytest.raises(ConfigError, match="stage3_gather_16bit_weights_on_model_save"):
        load_config(provisional_schedule(fill_from_arguments(raw, _arguments(), data_ranks=1, origin="ds.json")))
