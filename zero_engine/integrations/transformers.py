"""Hugging Face's Trainer on zero_engine: `ZeroEngineTrainer`.

For users of ``TrainingArguments(deepspeed="ds_config.json")``: the same Trainer and the same
arguments, the DeepSpeed config passed as ``zero_config=`` instead. ``pip install -e ".[hf]"``
(from a clone of the repository) installs the tested transformers range.

How the Trainer's loop meets the engine, through the Trainer's own overridable methods:

- ``_prepare_for_training`` builds the engine once, where the Trainer would wrap the model in
  DDP: the config with its ``"auto"`` filled from the arguments
  (`zero_engine.integrations.training_arguments`); the Trainer's optimizer (its class, keyword
  arguments and decay / no-decay groups) unless the config has an ``optimizer`` section (the
  groups still keep biases and norms undecayed); the Trainer's schedule unless the config has a
  ``scheduler`` section.
- ``training_step`` is the Trainer's own (through what a subclass wraps it in, TRL's); its
  ``accelerator.backward`` is the engine's: it tells the engine the Trainer's accumulation
  boundary, then runs ``engine.backward(loss, scale_wrt_gas=False)`` (the Trainer divides by
  its own count, a short last window included) and ``engine.step()``, as Accelerate does for
  DeepSpeed. The engine
  clips, steps the optimizer and steps the schedule on applied steps only, so the optimizer and
  schedule the Trainer steps afterwards are stand-ins that do nothing (`engine_model.SteppedByEngine`).
  The logged gradient norm is the engine's, the logged rate the one the step used.
- Checkpoints: ``save_checkpoint`` on every rank into the Trainer's ``checkpoint-N`` folder
  (model, optimizer, schedule and loss scale, resumable at any stage and world size), beside
  the Trainer's own state and RNG files and a ``from_pretrained`` model; resuming loads it once
  the engine is built.
- ``save_model`` gathers the full state onto rank 0 (`Engine.full_state_dict`) and saves it with
  ``save_pretrained``; evaluation and prediction run through the engine at every stage.
- ``sequence_parallel_size: k`` (or Hugging Face's own ``parallelism_config``, read as the key:
  `zero_engine.integrations.parallelism_config`): the ranks of a sequence group read the same
  batches and the engine splits each along the sequence; what the Trainer's loop does
  differently then is `zero_engine.integrations.sequence_trainer.SequenceGroupsTrainer`'s.
  TRL's SFT, DPO, GRPO and RLOO train split; its other trainers are refused.

A model too large for one rank is built on the meta device and materialized by the engine
(``zero_weights=`` a Hugging Face directory or safetensors file, ``zero_param_init_fn=`` for
what no file holds), the counterpart of DeepSpeed's ``zero.Init``; see docs/guides/big-models.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer

from .. import Engine, initialize, load_config
from ..config import optimizer_class, optimizer_options, read_config_mapping
from ..state.adapters import adapter_names, is_peft_model
from .config_filling import optimizer_section, refuse_sequence_parallel, sequence_parallel_size
from .engine_model import EngineModel, SteppedByEngine
from .parallelism_config import accelerate_without_parallelism, merge_parallelism, parallelism_from, set_attention
from .sequence_trainer import GENERATING_TRL_TRAINERS, SequenceGroupsTrainer, trl_classes
from .training_arguments import fill_from_arguments, fill_schedule, provisional_schedule

__all__ = ["ZeroEngineTrainer"]

SPLIT_TRL_TRAINERS = {"SFTTrainer", "DPOTrainer", *GENERATING_TRL_TRAINERS}  # TRL's, under sequence_parallel_size


class ZeroEngineTrainer(SequenceGroupsTrainer, Trainer):
    """A `transformers.Trainer` that trains with zero_engine.

    ``zero_config``: the DeepSpeed / zero_engine config (a path or a dict), ``"auto"`` allowed
    where Hugging Face allows it. ``zero_weights`` / ``zero_param_init_fn``: `initialize`'s
    ``weights`` / ``param_init_fn``, for a model built on the meta device. Everything else is
    the Trainer's own arguments. The engine is built on the first ``train()`` and kept:
    ``trainer.zero_engine``.
    """

    def __init__(
        self,
        *args: Any,
        zero_config: str | Path | dict[str, Any],
        zero_weights: Any = None,
        zero_param_init_fn: Callable[[nn.Module], None] | None = None,
        **kwargs: Any,
    ) -> None:
        # Hugging Face's own key for Ulysses (`parallelism_config`): read as the config's keys, kept
        # from Accelerate, which refuses it outside DeepSpeed and FSDP2 (`integrations.parallelism_config`)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        given = getattr(training_args, "parallelism_config", None)
        parallelism = parallelism_from(given)
        if given is not None:
            training_args.parallelism_config = None
        try:
            with accelerate_without_parallelism():
                super().__init__(*args, **kwargs)
        finally:
            if given is not None:
                training_args.parallelism_config = given
        self._refuse_unsupported_arguments()
        raw, self._zero_origin = read_config_mapping(zero_config)
        raw = merge_parallelism(raw, parallelism, self.args.world_size, "TrainingArguments")
        set_attention(self.model, parallelism)
        raw = self._offloaded_checkpointing(raw)
        self._loss_from_outputs = self._refuse_sequence_parallel_losses(raw)
        self._sequence_parallel = sequence_parallel_size(raw, self.args.world_size)
        raw = fill_from_arguments(raw, self.args, self.args.world_size // self._sequence_parallel, self._zero_origin)
        self._decay_options: dict[str, Any] = {}  # the decayed group's options
        if "optimizer" not in raw:  # the Trainer's optimizer, its weight decay on the decayed group
            raw["optimizer"] = self._trainer_optimizer_section()
            self._decay_options = {"weight_decay": self.args.weight_decay}
        self._zero_raw = raw
        checked = load_config(provisional_schedule(raw))  # every other error now, not at train()
        # evaluation split over the sequence group too (sequence_parallel_eval): its loaders and metrics follow
        self._split_eval = self._sequence_parallel > 1 and checked.sequence_parallel_eval
        self._share_generations_over_groups()
        self._zero_weights = zero_weights
        self._zero_param_init_fn = zero_param_init_fn
        self.zero_engine: Engine | None = None
        self._engine_model: EngineModel | None = None
        self._step_lr: float | None = None  # the rate the last optimizer step used

    def _refuse_sequence_parallel_losses(self, raw: dict[str, Any]) -> bool:
        """Whether the trainer is TRL's. Under the split, TRL's losses computed from its fused LM
        head's per-token outputs (SFT's sum of token losses, DPO's sigmoid of sequences' summed
        log-probabilities) train as in one process: the split gathers those outputs whole over the
        group (`zero_engine.transforms.ulysses`). Refused at ``sequence_parallel_size``
        above 1: losses read from the logits (``compute_loss_func``, label smoothing), a rank
        holding a slice of them, and TRL's trainers other than SFT's, DPO's, GRPO's and RLOO's
        (GRPO's and RLOO's completions are shared over each group: `SequenceGroupsTrainer`)."""
        trl = trl_classes(self)
        if not trl:
            return False
        if self.compute_loss_func is not None or self.args.label_smoothing_factor:
            refuse_sequence_parallel(raw, trl[0].__name__, "its loss reads the logits (compute_loss_func or label "
                                     "smoothing), and a rank holds a slice of each sequence's")
        if not SPLIT_TRL_TRAINERS & {cls.__name__ for cls in trl}:
            refuse_sequence_parallel(raw, trl[0].__name__, "its batches are made on each rank, and the ranks of a "
                                     "sequence group must split the same sequences; SFTTrainer, DPOTrainer, "
                                     "GRPOTrainer and RLOOTrainer train split")
        return True

    def _offloaded_checkpointing(self, raw: dict[str, Any]) -> dict[str, Any]:
        """``gradient_checkpointing=True`` with ``gradient_checkpointing_kwargs={"offload": True}``:
        the engine's own, ``recompute_units`` with ``recompute_offload`` (each unit's input in
        pinned host memory, brought back ahead of its recomputation, where Hugging Face's
        ``save_on_cpu`` copies each back when reached), and the model's own checkpointing left
        off (it would recompute inside the recomputation). A config saying ``recompute_units:
        false`` keeps Hugging Face's."""
        args = self.args
        wanted = args.activation_checkpointing and (args.activation_checkpointing_kwargs or {}).get("offload")
        zero = dict(raw.get("zero_optimization") or {})
        if not wanted or zero.get("recompute_units") is False:
            return raw
        zero.update(recompute_units=True, recompute_offload=True)
        args.activation_checkpointing = args.gradient_checkpointing = False
        return {**raw, "zero_optimization": zero}

    def _refuse_unsupported_arguments(self) -> None:
        args = self.args
        if args.deepspeed or self.is_deepspeed_enabled:
            raise ValueError(
                "ZeroEngineTrainer: pass the DeepSpeed config as zero_config=, not TrainingArguments.deepspeed"
            )
        if args.fsdp:
            raise ValueError("ZeroEngineTrainer: TrainingArguments.fsdp is another sharding engine; leave it unset")
        if self.model_init is not None:
            raise ValueError("ZeroEngineTrainer: model_init is not supported (the engine wraps one model); pass model=")
        if self.optimizer is not None or self.lr_scheduler is not None:
            raise ValueError(
                "ZeroEngineTrainer: optimizers=(optimizer, scheduler) built beforehand would drive other tensors than "
                "the engine's shards: give optimizer_cls_and_kwargs=, TrainingArguments.optim, or the config's "
                "optimizer and scheduler sections"
            )
        if "reduce_lr_on_plateau" in str(args.lr_scheduler_type):
            raise ValueError(
                "ZeroEngineTrainer: lr_scheduler_type 'reduce_lr_on_plateau' steps on evaluation metrics; the engine "
                "steps its schedule on optimizer steps. Use another schedule"
            )
        if args.torch_compile:
            raise ValueError("ZeroEngineTrainer: TrainingArguments.torch_compile is not supported yet; leave it False")

    # -- building the engine ---------------------------------------------------------------------

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        if not any(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()]):
            super()._move_model_to_device(model, device)  # a meta model is materialized by the engine instead

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None) -> Any:
        if self.zero_engine is None:
            self.zero_engine = self._build_engine(max_steps)
            self._engine_model = EngineModel(self.zero_engine)
        engine = self.zero_engine
        self.optimizer = SteppedByEngine(engine.optimizer)
        self.lr_scheduler = SteppedByEngine(engine.lr_scheduler)
        self.model_wrapped = self._engine_model
        self.accelerator.backward = self._engine_backward  # what the Trainer's training_step ends with
        if resume_from_checkpoint is not None:
            self._load_engine_checkpoint(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self._engine_model, train_dataloader

    def _build_engine(self, max_steps: int) -> Engine:
        raw = fill_schedule(self._zero_raw, self.args, max_steps, self._zero_origin)
        config = load_config(raw)
        schedule = self._trainer_schedule(max_steps) if "scheduler" not in raw else None
        return initialize(
            self.model, config, param_groups=self._decay_groups(config.optimizer.type),
            lr_scheduler=schedule, weights=self._zero_weights, param_init_fn=self._zero_param_init_fn,
        )

    def _trainer_optimizer_section(self) -> dict[str, Any]:
        """The config's ``optimizer`` section for the optimizer the Trainer would build."""
        if self.optimizer_cls_and_kwargs is not None:
            cls, kwargs = self.optimizer_cls_and_kwargs
        else:
            cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        optim = str(getattr(self.args.optim, "value", self.args.optim))
        return optimizer_section(cls, kwargs, f"TrainingArguments.optim = {optim!r}")

    def _decay_groups(self, optimizer_type: str) -> list[dict[str, Any]] | None:
        """The Trainer's two groups: weight decay on every parameter but biases and norms."""
        if "weight_decay" not in optimizer_options(optimizer_class(optimizer_type)):
            return None
        decayed = set(self.get_decay_parameter_names(self.model))
        named = [(name, param) for name, param in self.model.named_parameters() if param.requires_grad]
        return [
            {"params": [param for name, param in named if name in decayed], **self._decay_options},
            {"params": [param for name, param in named if name not in decayed], "weight_decay": 0.0},
        ]

    def _trainer_schedule(self, max_steps: int) -> Callable[[torch.optim.Optimizer], Any]:
        def build(optimizer: torch.optim.Optimizer) -> Any:
            self.lr_scheduler = None  # create_scheduler builds only where none exists
            return self.create_scheduler(max_steps, optimizer=optimizer)

        return build

    # -- the training step -----------------------------------------------------------------------

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if self._engine_model is not None:  # evaluation and prediction go through the engine too
            return self._engine_model
        return super()._wrap_model(model, training, dataloader)

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """The Trainer's own (through what a subclass wraps it in: TRL's GRPO counts its
        micro-steps there, DPO enters its activation offload), its loss divided by the
        accumulation as the Trainer divides it; the backward is the engine's
        (`_engine_backward`)."""
        self._require_engine().train()
        return super().training_step(model, inputs, num_items_in_batch)

    def _engine_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The accelerator's ``backward`` for this trainer: ``engine.backward`` (the Trainer
        divided by its own count, a short last window included) and ``engine.step()``, which
        applies the optimizer on the Trainer's accumulation boundary, as Accelerate does for
        DeepSpeed."""
        engine = self._require_engine()
        boundary = self.accelerator.sync_gradients  # the Trainer's: its short last window included
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss, scale_wrt_gas=False)
        if boundary:
            self._step_lr = engine.get_lr()[0]
        engine.step()

    def _clip_grad_norm(self, model: nn.Module) -> float | None:
        return self._require_engine().get_global_grad_norm()  # clipped inside engine.step()

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> float | None:
        return grad_norm if grad_norm is not None else self._require_engine().get_global_grad_norm()

    def _get_learning_rate(self) -> float:
        if self._step_lr is not None:
            return self._step_lr
        return self._require_engine().get_lr()[0]

    def _require_engine(self) -> Engine:
        if self.zero_engine is None:
            raise RuntimeError("ZeroEngineTrainer: the engine is built by train(); call it first")
        return self.zero_engine

    # -- saving and resuming ---------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A ``from_pretrained``-loadable model from every stage: the full state gathered onto
        rank 0, one unit at a time (collective: every rank calls it, as the Trainer does). A
        PEFT model saves its adapters in PEFT's layout (``adapter_model.safetensors``,
        ``adapter_config.json``), as the plain Trainer does: only they are gathered, streamed."""
        if self.zero_engine is None:
            super().save_model(output_dir, _internal_call)
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        engine = self.zero_engine
        if is_peft_model(self.model):
            wanted = adapter_names(self.model)
            stream = engine.named_full_parameters(rank0_only=True, names=wanted.__contains__)
            state_dict = {name: tensor.cpu() for name, tensor in stream}
        else:
            state_dict = engine.full_state_dict(rank0_only=True)
        self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self._require_engine().save_checkpoint(output_dir)  # every rank; schedule and loss scale included

    def _save_scaler(self, output_dir: str) -> None:
        """Nothing: the engine's checkpoint holds its loss scale."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Nothing here: `_prepare_for_training` loads the engine's checkpoint once the engine exists."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Nothing: loaded with the engine's checkpoint."""

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Nothing: loaded with the engine's checkpoint."""

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        self._require_engine().load_checkpoint(best, load_optimizer_states=False)

    def _load_engine_checkpoint(self, checkpoint: str) -> None:
        if not (Path(checkpoint) / "latest").is_file():
            raise FileNotFoundError(
                f"{checkpoint}: no zero_engine checkpoint (no 'latest' file); a checkpoint of another Trainer holds "
                f"only its weights: start from them with zero_weights={str(checkpoint)!r} instead of resuming"
            )
        self._require_engine().load_checkpoint(checkpoint)
