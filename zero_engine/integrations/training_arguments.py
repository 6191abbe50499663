"""A DeepSpeed config's ``"auto"`` filled from Hugging Face's ``TrainingArguments``.

Hugging Face's Trainer fills ``"auto"`` from its arguments and refuses a config whose values
disagree with them, every disagreement listed in one error. This module does the same on the
raw mapping, before it is validated, in two passes because the Trainer knows its values at two
times:

- when it is built (`fill_from_arguments`): the batch sizes, clipping, precision, the
  optimizer's hyperparameters and the schedule's learning-rate bounds;
- when training starts (`fill_schedule`): the schedule's step counts, from ``max_steps``.

What stays ``"auto"`` after both (the bucket sizes) `zero_engine.initialize` fills from the
model's hidden size (`zero_engine.auto_values`).

One choice differs from Hugging Face's DeepSpeed path, in favour of what the same Trainer does
without DeepSpeed: the batch sizes, ``gradient_clipping`` and the precision switches are taken
from the arguments when the config leaves them out (DeepSpeed would clip at its own default,
1.0, whatever ``max_grad_norm`` says). Keys of the optimizer and scheduler sections are filled
only where the config has them, as Hugging Face does.

Duck-typed on the arguments: nothing here imports transformers.
"""

from __future__ import annotations

from typing import Any

from .config_filling import Authority, Rule, fill, with_stand_ins

TRAINING_ARGUMENTS = Authority(
    heading="the Trainer's TrainingArguments", giver="TrainingArguments give", filled_from="TrainingArguments"
)


def argument_rules(args: Any, data_ranks: int) -> list[Rule]:
    """The keys the Trainer's arguments decide, with Hugging Face's rules."""
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    fp16 = bool(args.fp16 or args.fp16_full_eval)
    bf16 = bool(args.bf16 or args.bf16_full_eval)
    return [
        Rule("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size", True),
        Rule("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps", True),
        Rule(
            "train_batch_size", data_ranks * micro * accumulation,
            "world size * per_device_train_batch_size * gradient_accumulation_steps", False,
        ),
        Rule("gradient_clipping", args.max_grad_norm, "max_grad_norm", True),
        Rule("fp16.enabled", fp16, "fp16 or fp16_full_eval", fp16),
        Rule("bf16.enabled", bf16, "bf16 or bf16_full_eval", bf16),
        Rule("optimizer.params.lr", args.learning_rate, "learning_rate", False),
        Rule("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "[adam_beta1, adam_beta2]", False),
        Rule("optimizer.params.eps", args.adam_epsilon, "adam_epsilon", False),
        Rule("optimizer.params.weight_decay", args.weight_decay, "weight_decay", False),
        Rule("scheduler.params.warmup_min_lr", 0, "0 (the Trainer warms up from 0)", False),
        Rule("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate", False),
    ]


def schedule_rules(args: Any, max_steps: int) -> list[Rule]:
    """The schedule's step counts, known once the Trainer has counted its steps."""
    return [
        Rule("scheduler.params.total_num_steps", max_steps, "the Trainer's max_steps", False),
        Rule(
            "scheduler.params.warmup_num_steps", args.get_warmup_steps(max_steps),
            "warmup_steps (below 1: a fraction of max_steps)", False,
        ),
    ]


def fill_from_arguments(raw: dict[str, Any], args: Any, data_ranks: int, origin: str) -> dict[str, Any]:
    """A copy of the raw config with the arguments' ``"auto"`` filled; a `ConfigError` listing
    every value that disagrees with the arguments."""
    return fill(raw, argument_rules(args, data_ranks), origin, TRAINING_ARGUMENTS)


def fill_schedule(raw: dict[str, Any], args: Any, max_steps: int, origin: str) -> dict[str, Any]:
    return fill(raw, schedule_rules(args, max_steps), origin, TRAINING_ARGUMENTS)


def provisional_schedule(raw: dict[str, Any]) -> dict[str, Any]:
    """The config with its schedule's step counts still ``"auto"`` standing in as the least
    and the greatest count, to validate everything else before the Trainer knows ``max_steps``."""
    return with_stand_ins(raw, {"scheduler.params.warmup_num_steps": 1, "scheduler.params.total_num_steps": 2**31 - 1})
