"""Sequence parallelism's part of Hugging Face's Trainer on the engine: `SequenceGroupsTrainer`, a
mixin of `zero_engine.integrations.transformers.ZeroEngineTrainer`.

Under ``sequence_parallel_size: k`` the ``k`` ranks of a sequence group read the same batches
and the engine splits each along the sequence. What the Trainer's loop must do differently, in
its own overridable methods:

- its loaders (training's, and evaluation's when evaluation is split: ``sequence_parallel_eval``)
  sharded over the data-parallel ranks, rank // k of world / k, as Accelerate's own loader does
  under its parallelism config (`config_filling.shard_over_data_ranks`);
- its token count, gathered over every rank, counts each group's batch ``k`` times, and its loss
  is scaled by the world size where the engine averages over data-parallel ranks: both divided
  by ``k`` (while the group reads one batch), so the logged losses are those of ``k`` = 1 on
  world / k ranks; the batch size it reports counts data-parallel ranks;
- evaluation's metrics gathered over the data-parallel ranks once per group (its ranks evaluated
  one batch), and the logits a ``compute_metrics`` reads gathered whole over the group;
- TRL's token count kept once per group (its losses, from the fused LM head's per-token outputs,
  are whole already: the split gathers those outputs over the group);
- TRL's GRPO and RLOO: each rank of a group generates (at stage 3 every rank must run the
  model's forwards), then every rank keeps the group's first rank's completions
  (`zero_engine.sequence_loader.share_leaders_rows`), so the group scores, splits and trains
  one batch. TRL gathers rewards over every rank, each group's ``k`` times: means, the
  per-prompt groups (each rank's generation batch holds whole groups, checked at
  ``__init__``) and each rank's slice of the advantages are those of ``k`` = 1; its count of
  tokens seen is divided by ``k``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..sequence_loader import share_leaders_rng, share_leaders_rows
from ..transforms.seam import MODEL
from ..transforms.ulysses import UlyssesAttention
from .config_filling import data_parallel_place, shard_over_data_ranks

GENERATING_TRL_TRAINERS = {"GRPOTrainer", "RLOOTrainer"}  # TRL's, whose completions are made on each rank


def trl_classes(trainer: Any) -> list[type]:
    """TRL's classes in ``trainer``'s class order (none: not a TRL trainer)."""
    return [cls for cls in type(trainer).__mro__ if cls.__module__.startswith("trl.")]


class SequenceGroupsTrainer:
    """Methods of a `transformers.Trainer` under ``sequence_parallel_size`` (see the module);
    mixed in before the Trainer, so each calls the Trainer's own (or TRL's) with ``super()``."""

    _sequence_parallel: int  # k, 1 without the split
    _split_eval: bool  # evaluation split over the group too
    _loss_from_outputs: bool  # the trainer is TRL's (its loss from the fused head's per-token outputs)
    args: Any
    accelerator: Any
    model: nn.Module
    _require_engine: Any  # the engine, once built (the Trainer's)
    state: Any
    _metrics: Any  # TRL's
    num_generations: int  # TRL's GRPO / RLOO
    _shares_generations = False  # TRL's GRPO / RLOO under the split: each group's completions its first rank's

    def get_train_dataloader(self) -> Any:
        return shard_over_data_ranks(super().get_train_dataloader(), self.args.world_size, self.args.process_index,
                                     self._sequence_parallel, "Hugging Face's Trainer")

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        return self._evaluation_loader(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        return self._evaluation_loader(super().get_test_dataloader(test_dataset))

    def _evaluation_loader(self, loader: Any) -> Any:
        """Under the split, evaluation's loader too is sharded over the data-parallel ranks: the
        ranks of a group split each batch between them."""
        if not self._split_eval:
            return loader
        return shard_over_data_ranks(loader, self.args.world_size, self.args.process_index, self._sequence_parallel,
                                     "Hugging Face's Trainer (evaluation)")

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        if self._split_eval:  # the loop resets it at its end
            self.gather_function = self._gather_over_data_ranks
        return super().evaluation_loop(*args, **kwargs)

    def _gather_over_data_ranks(self, tensors: Any) -> Any:
        """``gather_for_metrics`` over the data-parallel ranks: every rank's tensors gathered,
        one copy kept per sequence group (its ranks evaluated the same batch), then the last
        batch's padding cut as Accelerate cuts it (its remainder counts data-parallel ranks)."""
        from accelerate.utils import recursively_apply

        world, k = self.args.world_size, self._sequence_parallel
        gathered = self.accelerator.gather(tensors)
        kept = recursively_apply(lambda t: t.view(world, -1, *t.shape[1:])[::k].flatten(0, 1), gathered)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            kept = recursively_apply(lambda t: t[: state.remainder], kept)
        return kept

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> Any:
        """The Trainer's; under the split the logits a rank got (its slice) gathered whole over
        its group, for metrics (only where they are asked for: the whole logits are the largest
        tensor of a long sequence's evaluation)."""
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if logits is not None and self._split_eval and self._split_active():
            engine = self._require_engine()
            logits = tuple(engine.sequence_gather(t) for t in logits) if isinstance(logits, tuple) else \
                engine.sequence_gather(logits)
        return loss, logits, labels

    def _split_active(self) -> bool:
        split = [t for t in self._require_engine().transforms.of_order(MODEL) if isinstance(t, UlyssesAttention)]
        return bool(split) and split[0].active

    def _share_generations_over_groups(self) -> None:
        """TRL's GRPO / RLOO under the split (see the module): what generates elsewhere than the
        model's own ``generate`` on each rank (vLLM, continuous batching, a ``rollout_func``),
        tools and environments (run on every rank of a group), vision models, a generation
        batch of partial prompt groups, and advantages scaled by the whole batch's deviation
        refused by name; the generation batch counted over the data-parallel ranks, and each
        group seeded as its data-parallel rank, as at ``k`` = 1 on world / k ranks."""
        k, args = self._sequence_parallel, self.args
        trl = trl_classes(self)
        if k == 1 or not GENERATING_TRL_TRAINERS & {cls.__name__ for cls in trl}:
            return
        name = trl[0].__name__
        unsupported = [
            reason for reason, present in (
                ("use_vllm", getattr(self, "use_vllm", False)),
                ("use_transformers_continuous_batching", getattr(self, "use_transformers_continuous_batching", False)),
                ("rollout_func", getattr(self, "rollout_func", None) is not None),
                ("tools", bool(getattr(self, "tools", None))),
                ("environment_factory", getattr(self, "environment_factories", None) is not None),
                ("a vision model", getattr(self, "_is_vlm", False)),
            ) if present
        ]
        if unsupported:
            raise NotImplementedError(
                f"sequence_parallel_size = {k} through {name} with {', '.join(unsupported)} is not wired: only the "
                "model's own generate on every rank is (its completions shared over each sequence group)"
            )
        batch_scaled = [
            option for option, present in (
                ("scale_rewards='batch'", getattr(self, "scale_rewards", None) == "batch"),
                ("multi_objective_aggregation='normalize_then_sum'",
                 getattr(self, "multi_objective_aggregation", None) == "normalize_then_sum"),
                ("normalize_advantages=True", getattr(self, "normalize_advantages", False) is True),
            ) if present
        ]
        if batch_scaled:
            raise NotImplementedError(
                f"sequence_parallel_size = {k} through {name} with {', '.join(batch_scaled)}: TRL gathers each "
                "sequence group's rewards k times, so a standard deviation over the whole gathered batch is not "
                "k = 1's (per-prompt groups' are); use the default per-group scaling"
            )
        local = args.per_device_train_batch_size * args.steps_per_generation
        if local % self.num_generations:
            raise ValueError(
                f"sequence_parallel_size = {k} through {name}: each rank's generation batch "
                f"(per_device_train_batch_size x steps_per_generation = {args.per_device_train_batch_size} x "
                f"{args.steps_per_generation}) must hold whole prompt groups of num_generations = "
                f"{self.num_generations} (TRL gathers each group's rewards k times)"
            )
        evaluated = getattr(self, "num_generations_eval", None) or self.num_generations
        if self._split_eval and args.per_device_eval_batch_size % evaluated:
            raise ValueError(
                f"sequence_parallel_size = {k} through {name}: each rank's evaluation batch "
                f"(per_device_eval_batch_size = {args.per_device_eval_batch_size}) must hold whole prompt groups of "
                f"{evaluated} generations, or set sequence_parallel_eval: false"
            )
        args.generation_batch_size = local * (args.world_size // k)
        self._shares_generations = True
        # TRL seeds each rank apart (seed + rank) so that ranks sample apart: a group samples as
        # its data-parallel rank would at k = 1 on world / k ranks
        from accelerate.utils import set_seed

        set_seed(args.seed + data_parallel_place(args.world_size, args.process_index, k)[0])

    def _prepare_inputs(self, inputs: Any) -> Any:
        """The Trainer's (TRL's GRPO / RLOO: generation, scoring, shuffling); under the split
        every rank of a group first takes its first rank's random state, so the group draws
        as one rank: the same shuffle, the same samples."""
        if self._shares_generations and self._groups_share_batches():
            share_leaders_rng(self._require_engine())
        return super()._prepare_inputs(inputs)  # type: ignore[misc]

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's GRPO / RLOO generation; under the split every rank of a group then holds its
        first rank's completions (and their log-probabilities, where the backend gives them:
        GRPO returns both, RLOO the completions alone)."""
        generated = super()._generate_single_turn(*args, **kwargs)  # type: ignore[misc]
        if not self._groups_share_batches():
            return generated
        if isinstance(generated, tuple):
            return share_leaders_rows(self._require_engine(), *generated)
        return share_leaders_rows(self._require_engine(), generated)[0]

    def _generate(self, prompts: list) -> Any:
        """TRL's GRPO / RLOO; its count of tokens seen summed over every rank, each group's
        completions ``k`` times: counted once."""
        seen = self.state.num_input_tokens_seen
        result = super()._generate(prompts)  # type: ignore[misc]
        if self._groups_share_batches() and self.model.training:
            self.state.num_input_tokens_seen = seen + (self.state.num_input_tokens_seen - seen) // self._sequence_parallel
            self._metrics["train"]["num_tokens"] = [self.state.num_input_tokens_seen]
        return result

    def get_total_train_batch_size(self, args: Any) -> int:
        return super().get_total_train_batch_size(args) // self._sequence_parallel

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        counted = super()._get_num_items_in_batch(batch_samples, device)
        if counted is not None and self._groups_share_batches() and self.args.average_tokens_across_devices:
            counted = counted / self._sequence_parallel  # each group's batch was gathered k times
        return counted

    def _groups_share_batches(self) -> bool:
        """Whether the ranks of each sequence group read one batch now: in training, and in
        evaluation when it is split too (else every rank evaluates batches of its own)."""
        return self._sequence_parallel > 1 and (self.model.training or self._split_eval)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        k = self._sequence_parallel
        tokens_before = getattr(self, "_total_train_tokens", None)  # TRL's count of the tokens trained on
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if not self._groups_share_batches():
            return result
        loss, outputs = result if return_outputs else (result, None)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss / k  # scaled by the world size where the engine averages over the data-parallel ranks
        # TRL's losses come from the fused head's per-token outputs, gathered whole by the split
        if self._loss_from_outputs and tokens_before is not None and self.model.training and not self._shares_generations:
            # TRL gathered each group's batch k times (GRPO and RLOO count theirs at generation: `_generate`)
            self._total_train_tokens = tokens_before + (self._total_train_tokens - tokens_before) // k
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return (loss, outputs) if return_outputs else loss
