"""Hugging Face Accelerate on zero_engine: `Accelerator`.

For scripts written for ``accelerate`` without the Trainer: change the import, keep the loop.

    from zero_engine.integrations.accelerate import Accelerator
    accelerator = Accelerator(gradient_accumulation_steps=2, zero_config="ds_config.json")

Without ``zero_config=``, the DeepSpeed config that ``accelerate launch --use_deepspeed
--deepspeed_config_file ds.json`` names (``ACCELERATE_DEEPSPEED_CONFIG_FILE``) is taken, so such
a launch needs only the import changed. The engine then plays the part DeepSpeed plays under
Accelerate, with the same semantics:

- ``prepare(model, optimizer, dataloader, scheduler)`` in any order: the model becomes the
  engine (the returned module calls it), built from the user's optimizer (its class, defaults
  and groups, rebuilt over the shards) unless the config has an optimizer section, and driving
  the user's scheduler on applied steps. As with DeepSpeed, the model and its optimizer (and a
  scheduler the engine should step) come in one call. Dataloaders are Accelerate's own. The
  config's ``"auto"`` is filled from the script: the micro-batch from the dataloader, the
  accumulation from ``gradient_accumulation_steps``, bf16/fp16 from ``mixed_precision``, and a
  value that disagrees is refused, all in one error.
- ``backward(loss)`` marks the accumulation boundary from ``sync_gradients`` and runs the
  engine's backward and step (it clips, steps the optimizer and the schedule on boundaries).
  ``clip_grad_norm_`` returns the engine's global norm (the config's ``gradient_clipping``
  clips, as under DeepSpeed); ``optimizer.step()``, ``zero_grad()`` and ``scheduler.step()`` do
  nothing. The schedule advances as Accelerate's own wrapper advances it: once per process per
  optimizer step unless ``split_batches`` (so warm-up counted in ``num_processes`` units, as
  Accelerate's examples write it, means the same here as under DDP).
- ``save_state(dir)`` / ``load_state(dir)``: the engine's checkpoint (resumable at any stage
  and world size) beside Accelerate's RNG and dataloader states; ``get_state_dict(model)`` the
  full state on rank 0, one unit at a time; ``unwrap_model`` the user's module; ``save_model``
  the streamed ``save_pretrained`` layout.
- ``sequence_parallel_size: k``: prepared dataloaders give the ``k`` ranks of a sequence group
  the same batches (sharded over the data-parallel ranks, rank // k of world / k); the engine
  splits each along the sequence, and a Hugging Face model's ``outputs.loss`` is the
  micro-batch's on every rank of the group.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import accelerate
import torch
from torch import nn
from torch.utils.data import DataLoader

from .. import ConfigError, Engine, initialize, load_config
from ..config import read_config_mapping
from .config_filling import AUTO, Authority, Rule, fill, rebind, rebuilt_optimizer, sequence_parallel_size
from .config_filling import shard_over_data_ranks
from .engine_model import EngineModel, SteppedByEngine
from .parallelism_config import accelerate_without_parallelism, merge_parallelism, parallelism_from, set_attention

__all__ = ["Accelerator"]

ACCELERATE = Authority("the Accelerator", "the Accelerator has", "the Accelerator and the prepared objects")


class Accelerator(accelerate.Accelerator):
    """An `accelerate.Accelerator` whose model, optimizer and scheduler are zero_engine's.

    ``zero_config``: the DeepSpeed / zero_engine config (a path, a dict or a
    `ZeroEngineConfig`); default: ``ACCELERATE_DEEPSPEED_CONFIG_FILE``. ``zero_weights`` /
    ``zero_param_init_fn``: `initialize`'s ``weights`` / ``param_init_fn``. Everything else is
    Accelerate's. The engine is ``accelerator.zero_engine`` once prepared.
    """

    def __init__(
        self,
        *args: Any,
        zero_config: Any = None,
        zero_weights: Any = None,
        zero_param_init_fn: Callable[[nn.Module], None] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("deepspeed_plugin") is not None or kwargs.get("deepspeed_plugins") is not None:
            raise ValueError("zero_engine's Accelerator: pass the DeepSpeed config as zero_config=, not a DeepSpeedPlugin")
        if zero_config is None:
            zero_config = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
            if not zero_config:
                raise ValueError(
                    "zero_engine's Accelerator: give zero_config= (a DeepSpeed config path or dict), or launch with "
                    "accelerate launch --use_deepspeed --deepspeed_config_file FILE"
                )
        # `accelerate launch --use_deepspeed` asks Accelerate to run DeepSpeed; the engine runs instead.
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "false"
        # Hugging Face's own key for Ulysses: read as the config's keys, kept from Accelerate
        # (`zero_engine.integrations.parallelism_config`)
        self._parallelism = parallelism_from(kwargs.pop("parallelism_config", None))
        with accelerate_without_parallelism():
            super().__init__(*args, **kwargs)
        self._zero_raw, self._zero_origin = read_config_mapping(zero_config)
        self._zero_raw = merge_parallelism(self._zero_raw, self._parallelism, self.num_processes, "the Accelerator")
        self._sequence_parallel = sequence_parallel_size(self._zero_raw, self.num_processes)
        self._zero_weights, self._zero_param_init_fn = zero_weights, zero_param_init_fn
        self.zero_engine: Engine | None = None
        self._engine_model: EngineModel | None = None
        self._warned_clip = False

    # -- prepare ---------------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        models = [a for a in args if isinstance(a, nn.Module)]
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        schedulers = [a for a in args if _is_scheduler(a)]
        loaders = [a for a in args if isinstance(a, DataLoader)]
        if len(models) > 1 or len(optimizers) > 1 or len(schedulers) > 1:
            raise ValueError("zero_engine's Accelerator: one model, one optimizer and one scheduler (the engine's)")
        if models and self.zero_engine is not None:
            raise ValueError("zero_engine's Accelerator: a model is prepared already; the engine wraps one model")
        if (optimizers or schedulers) and not models:
            raise ValueError(
                "zero_engine's Accelerator: prepare the model with its optimizer and scheduler in one call (as with "
                "DeepSpeed): the engine rebuilds the optimizer over its shards and steps the scheduler"
            )
        if models:
            self._build_engine(models[0], optimizers[0] if optimizers else None,
                               schedulers[0] if schedulers else None, loaders[0] if loaders else None)
        prepared = []
        for arg in args:
            if isinstance(arg, nn.Module):
                prepared.append(self._engine_model)
            elif isinstance(arg, torch.optim.Optimizer):
                prepared.append(SteppedByEngine(self._require_engine().optimizer))
            elif _is_scheduler(arg):
                prepared.append(SteppedByEngine(arg))
            elif isinstance(arg, DataLoader):  # a sequence group's ranks read the same batches
                prepared.append(shard_over_data_ranks(
                    super().prepare(arg, device_placement=device_placement), self.num_processes, self.process_index,
                    self._sequence_parallel, "Accelerate",
                ))
            else:
                prepared.append(super().prepare(arg, device_placement=device_placement))
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _build_engine(self, model: nn.Module, optimizer: Any, scheduler: Any, loader: DataLoader | None) -> None:
        set_attention(model, self._parallelism)
        raw = fill(self._zero_raw, self._rules(loader), self._zero_origin, ACCELERATE)
        if raw.get("gradient_clipping") == AUTO:  # else refused in the Trainer's terms, which do not apply here
            raise ConfigError(
                f"{self._zero_origin}: gradient_clipping = 'auto' is filled from accelerate launch's "
                "--gradient_clipping (the launcher sets ACCELERATE_GRADIENT_CLIPPING), which this run does not have: "
                "launch with --gradient_clipping VALUE, or give a number in the config (0: no clipping)"
            )
        groups = None
        if "optimizer" not in raw:
            if optimizer is None:
                raise ValueError(
                    "zero_engine's Accelerator: prepare the model's optimizer with it, or give the config an optimizer "
                    "section"
                )
            raw["optimizer"], groups = rebuilt_optimizer(optimizer)
        schedule = self._engine_schedule(scheduler, raw)
        if not any(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()]):
            model.to(self.device)  # as Accelerate places a model; a meta one is the engine's to build
        self.zero_engine = initialize(
            model, load_config(raw), param_groups=groups, lr_scheduler=schedule, weights=self._zero_weights,
            param_init_fn=self._zero_param_init_fn,
        )
        self._engine_model = EngineModel(self.zero_engine)

    def _engine_schedule(self, scheduler: Any, raw: dict[str, Any]) -> Callable[[torch.optim.Optimizer], Any] | None:
        """The prepared scheduler as the engine's schedule: rebound to the engine's optimizer and
        stepped as Accelerate's `AcceleratedScheduler` steps it (`_RepeatedSchedule`)."""
        if scheduler is None:
            return None
        if "scheduler" in raw:
            raise ValueError(
                f"zero_engine's Accelerator: both a prepared scheduler and the config's scheduler section "
                f"({self._zero_origin}); keep one"
            )
        repeats = 1 if self.split_batches or not self.step_scheduler_with_optimizer else self.num_processes
        return lambda engine_optimizer: _RepeatedSchedule(rebind(scheduler, engine_optimizer), repeats)

    def _rules(self, loader: DataLoader | None) -> list[Rule]:
        rules = [
            Rule("gradient_accumulation_steps", self.gradient_accumulation_steps, "gradient_accumulation_steps", True),
            Rule("bf16.enabled", self.mixed_precision == "bf16", "mixed_precision", False),
            Rule("fp16.enabled", self.mixed_precision == "fp16", "mixed_precision", False),
        ]
        if loader is not None and loader.batch_size is not None:
            micro = loader.batch_size // (self.num_processes if self.split_batches else 1)
            rules.append(Rule("train_micro_batch_size_per_gpu", micro, "the dataloader's batch_size", False))
        clipping = os.environ.get("ACCELERATE_GRADIENT_CLIPPING")
        if clipping:
            rules.append(Rule("gradient_clipping", float(clipping), "ACCELERATE_GRADIENT_CLIPPING", False))
        return rules

    # -- the step --------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The engine's backward (it divides by the accumulation steps, as DeepSpeed's does),
        then its step: on a boundary (``sync_gradients``) that clips and steps the optimizer and
        the schedule; between boundaries it ends the micro-step."""
        engine = self._require_engine()
        engine.set_gradient_accumulation_boundary(self.sync_gradients)
        engine.backward(loss, **kwargs)
        engine.step()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """The global gradient norm of the last step, before clipping: the engine clips by the
        config's ``gradient_clipping`` (as DeepSpeed does under Accelerate)."""
        engine = self._require_engine()
        clipping = engine.config.gradient_clipping
        if not self._warned_clip and (float(max_norm) != float(clipping) or norm_type != 2):
            warnings.warn(
                f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}): the engine clips by the config's "
                f"gradient_clipping = {clipping} (L2); set it there", stacklevel=2,
            )
            self._warned_clip = True
        norm = engine.get_global_grad_norm()
        return None if norm is None else torch.tensor(norm)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Nothing: the engine unscales inside its step."""

    # -- models and state ------------------------------------------------------------------------

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> nn.Module:
        if isinstance(model, EngineModel):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state (fp32 masters) on the main process, gathered one unit at a time
        (collective: every process calls it); ``{}`` elsewhere."""
        if self._is_engines(model):
            return self._require_engine().full_state_dict(rank0_only=True)
        return super().get_state_dict(model, unwrap)

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:
        """The engine's streamed ``save_pretrained`` layout (sharded safetensors and an index)."""
        if not self._is_engines(model):
            return super().save_model(model, save_directory, max_shard_size, safe_serialization)
        if not safe_serialization:
            raise ValueError("zero_engine's Accelerator.save_model writes safetensors only")
        self._require_engine().save_pretrained(save_directory, max_shard_size=max_shard_size)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """Accelerate's own state (RNG, dataloaders, registered objects), then the engine's
        checkpoint into the same directory (collective)."""
        directory = super().save_state(output_dir, safe_serialization, **kwargs)
        self._require_engine().save_checkpoint(directory, tag="zero_engine")
        return directory

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        super().load_state(input_dir, load_kwargs, **kwargs)
        directory = input_dir if input_dir is not None else self._latest_state_dir()
        self._require_engine().load_checkpoint(directory, tag="zero_engine")

    def _latest_state_dir(self) -> str:
        folder = Path(self.project_dir) / "checkpoints"
        return str(max(folder.iterdir(), key=lambda p: int(p.name.rsplit("_", 1)[-1])))

    def _is_engines(self, model: nn.Module) -> bool:
        """``model`` is what `prepare` returned for the engine, or the module it wraps."""
        return isinstance(model, EngineModel) or model is getattr(self._engine_model, "module", None)

    def _require_engine(self) -> Engine:
        if self.zero_engine is None:
            raise RuntimeError("zero_engine's Accelerator: prepare the model first")
        return self.zero_engine


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        hasattr(obj, "step") and hasattr(obj, "optimizer") and not isinstance(obj, torch.optim.Optimizer)
        and not isinstance(obj, (nn.Module, DataLoader))
    )


class _RepeatedSchedule:
    """The user's scheduler as the engine steps it: ``repeats`` steps per applied optimizer
    step, as Accelerate's ``AcceleratedScheduler`` steps it once per process (a OneCycle-like
    schedule not past its ``total_steps``)."""

    def __init__(self, scheduler: Any, repeats: int) -> None:
        self.scheduler, self.repeats = scheduler, repeats

    def step(self) -> None:
        for _ in range(self.repeats):
            total = getattr(self.scheduler, "total_steps", None)
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)
