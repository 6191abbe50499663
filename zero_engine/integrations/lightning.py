"""PyTorch Lightning on zero_engine: `ZeroEngineStrategy`.

For users of ``Trainer(strategy="deepspeed_stage_3")``: ``Trainer(strategy=ZeroEngineStrategy(
"ds_config.json"))``, or by name, ``strategy="zero_engine_stage_3"`` (registered when this module
is imported). ``pip install -e ".[lightning]"`` (from a clone of the repository) installs the
tested Lightning range.

Lightning's own loop runs unchanged, with its DDP strategy's accumulation: it divides each loss
by ``accumulate_grad_batches``, runs the micro-batches of a window under
``block_backward_sync`` and steps on the last one, or on the epoch's last batch. What the
strategy changes, through Lightning's public seams (the ``Strategy`` and ``Precision`` hooks):

- ``setup`` builds the engine once, over the LightningModule itself (parameter names unchanged):
  the config's ``"auto"`` and absent keys filled from the Trainer (``accumulate_grad_batches``,
  ``gradient_clip_val``, ``precision``; a value that disagrees fails, naming both); the optimizer
  from ``configure_optimizers`` rebuilt over the engine's shards with its class, options and
  parameter groups, unless the config has an ``optimizer`` section.
- The schedule: a step-interval schedule from ``configure_optimizers`` is stepped by the engine on
  applied steps only; one on another interval, frequency or a monitored metric stays Lightning's
  to step, on the engine's optimizer.
- ``training_step`` (and the validation, test and predict steps) run through the engine: the
  strategy's model is the engine as a module, and Lightning routes each step through its forward.
- The precision plugin (`_EnginePrecision`) runs ``engine.backward`` and ``engine.step``: the
  boundary is said before the backward (False under ``block_backward_sync``, True inside
  ``optimizer_step``); the engine clips, by norm only; the global gradient norm is logged as
  ``grad_norm``.
- Checkpoints: ``trainer.save_checkpoint(path)`` writes the engine's checkpoint directory on
  every rank, Lightning's own dict (epoch, loops, callbacks, ...) inside it;
  ``fit(ckpt_path=...)`` resumes from it, at any stage and world size.
  `convert_to_lightning_checkpoint` writes one ordinary ``.ckpt`` file for the model alone.
- ``configure_model`` runs under the meta device at stage 3, and the engine materializes the
  model one unit at a time (DeepSpeed's ``zero.Init``); ``weights=`` and ``param_init_fn=`` are
  `initialize`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn

from .. import Engine, ZeroEngineConfig, initialize, load_config
from ..config import auto_keys, read_config_mapping
from ..state.consolidate import load_client_state, load_consolidated
from ..state.storage import write_atomically
from .config_filling import (
    AUTO, Authority, Rule, fill, rebind, rebuilt_optimizer, refuse_sequence_parallel, with_stand_ins,
)
from .engine_model import EngineModel

__all__ = ["ZeroEngineStrategy", "convert_to_lightning_checkpoint"]

LIGHTNING = Authority(
    heading="the Lightning Trainer's arguments", giver="the Lightning Trainer has", filled_from="the Lightning Trainer"
)
# What the Lightning Trainer decides, standing in for "auto" until it is known (validation).
TRAINER_STAND_INS = {
    "gradient_accumulation_steps": 1, "gradient_clipping": 0.0, "fp16.enabled": False, "bf16.enabled": False,
}
# Lightning's precision -> (fp16, bf16) of the engine: mixed precision with fp32 masters.
PRECISIONS = {"32-true": (False, False), "16-mixed": (True, False), "bf16-mixed": (False, True)}


class ZeroEngineStrategy(DDPStrategy):
    """Lightning's strategy for zero_engine: ``config`` a path, dict or `ZeroEngineConfig`;
    ``weights`` / ``param_init_fn``: `initialize`'s, for a model built on the meta device in
    ``configure_model``. Other keywords are `DDPStrategy`'s (``process_group_backend``,
    ``timeout``, ...). The engine is built at the first ``setup`` and kept: ``strategy.engine``."""

    strategy_name = "zero_engine"

    def __init__(
        self,
        config: str | Path | dict[str, Any] | ZeroEngineConfig,
        *,
        weights: Any = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("precision_plugin") is not None:
            raise ValueError(
                "ZeroEngineStrategy: set the precision with Trainer(precision=...), not a precision plugin"
            )
        super().__init__(**kwargs)
        self._raw, self._origin = _raw_config(config)
        # Every error of the file now, not at fit(): what the Trainer decides stands in meanwhile.
        load_config(with_stand_ins(self._raw, TRAINER_STAND_INS))
        self._weights = weights
        self._param_init_fn = param_init_fn
        self.engine: Engine | None = None
        self._lightning_schedules: list[LRSchedulerConfig] = []  # the schedules Lightning still steps

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for stage in range(4):
            name = f"zero_engine_stage_{stage}"
            if name not in strategy_registry:
                strategy_registry.register(
                    name, cls, description=f"zero_engine at ZeRO stage {stage}",
                    config={"zero_optimization": {"stage": stage}},
                )

    @property
    def stage(self) -> int | str:
        """The config's ``zero_optimization.stage`` (``"auto"`` until the engine chooses)."""
        zero = self._raw.get("zero_optimization")
        return zero.get("stage", 0) if isinstance(zero, dict) else 0

    # -- building the engine ---------------------------------------------------------------------

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """At stage 3, ``configure_model`` builds on the meta device: no rank ever holds the
        whole model; the engine materializes it unit by unit (``weights=``, ``param_init_fn=``)."""
        if self.stage != 3:  # 'auto' too: whether stage 3 fits is known only once the model is built
            yield
            return
        with torch.device("meta"):
            yield

    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise ValueError(
                "ZeroEngineStrategy: manual optimization (automatic_optimization = False) is not supported: the "
                "engine steps its own optimizer; use automatic optimization"
            )
        if trainer.gradient_clip_algorithm == "value":
            raise ValueError(
                "ZeroEngineStrategy: gradient_clip_algorithm='value' is not supported; the engine clips by the global "
                "norm (gradient_clip_algorithm='norm')"
            )
        if self.engine is None or self.engine.module is not module:
            if not any(tensor.is_meta for tensor in [*module.parameters(), *module.buffers()]):
                self.model_to_device()  # as DDPStrategy.setup: the engine keeps the module where it lies
            self.engine = self._build_engine(trainer, module)
            self.precision_plugin = _EnginePrecision(self.precision_plugin.precision, self.engine)
        self.model = EngineModel(self.engine)
        self.optimizers = [self.engine.optimizer]
        self.lr_scheduler_configs = list(self._lightning_schedules)

    def _build_engine(self, trainer: Trainer, module: LightningModule) -> Engine:
        raw = fill(self._raw, _trainer_rules(trainer, self._raw), self._origin, LIGHTNING)
        groups, schedule = None, None
        self._lightning_schedules = []  # this module's, not a module built before
        if "optimizer" not in raw:
            optimizers, schedules = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1 or len(schedules) > 1:
                raise ValueError(
                    f"ZeroEngineStrategy: configure_optimizers gave {len(optimizers)} optimizers and {len(schedules)} "
                    "schedulers; the engine takes one optimizer and at most one scheduler"
                )
            raw["optimizer"], groups = rebuilt_optimizer(optimizers[0])
            if schedules:
                schedule = self._take_schedule(schedules[0])
        refuse_sequence_parallel(raw, "Lightning")
        engine = initialize(
            module, load_config(raw), param_groups=groups, lr_scheduler=schedule, weights=self._weights,
            param_init_fn=self._param_init_fn,
        )
        for config in self._lightning_schedules:
            rebind(config.scheduler, engine.optimizer)
        return engine

    def _take_schedule(self, config: LRSchedulerConfig) -> Callable[[torch.optim.Optimizer], Any] | None:
        """A schedule stepped every optimizer step goes to the engine (stepped on applied steps
        only); any other stays Lightning's (``self._lightning_schedules``)."""
        if config.interval == "step" and config.frequency == 1 and not config.reduce_on_plateau:
            return lambda optimizer: rebind(config.scheduler, optimizer)
        self._lightning_schedules = [config]
        return None

    # -- the step --------------------------------------------------------------------------------

    @property
    def handles_gradient_accumulation(self) -> bool:
        return False  # Lightning's windows, as with DDP: the epoch's last batch steps too

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """A micro-batch that does not end its window (Lightning runs it outside ``optimizer_step``)."""
        assert self.engine is not None
        self.engine.set_gradient_accumulation_boundary(False)
        yield

    # -- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """The engine's checkpoint directory at ``filepath``, on every rank, with Lightning's
        own dict (epoch, loops, callbacks, ...) as its client state.

        Lightning may save between the micro-batches of a window: after a resume mid-epoch its
        ``ModelCheckpoint`` saves again at the restored step on the first micro-batch (it does not
        restore when it last saved). As with DDP, whose checkpoint holds no gradients, that saves
        the state of the last optimizer step and Lightning's loop position; the window's gradients
        so far stay in this run (a resume from it starts where Lightning's loop says)."""
        if storage_options is not None:
            raise TypeError("ZeroEngineStrategy.save_checkpoint: storage_options is not supported (no CheckpointIO)")
        assert self.engine is not None
        filepath = self.broadcast(str(filepath))
        state = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, tag="checkpoint", client_state=state, within_window=True)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.engine is not None and self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        return self.engine.load_checkpoint(str(checkpoint_path), load_optimizer_states=fitting)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine loads its own checkpoint, so it must exist first

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # restored with the engine's checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: the engine's checkpoint held the model."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: the engine's checkpoint held the optimizer."""

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the model is in the engine's checkpoint (a full state_dict would gather it)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}  # likewise

    def teardown(self) -> None:
        """Lightning's teardown without moving the module: the engine owns where its flat
        buffers live (and keeps them for a later validate / test / fit)."""
        self.precision_plugin.teardown()
        assert self.accelerator is not None and self.cluster_environment is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        self.cluster_environment.teardown()


class _EnginePrecision(Precision):
    """Backward and step through the engine; it clips and scales (fp16) itself."""

    def __init__(self, precision: str, engine: Engine) -> None:
        super().__init__()
        self.precision = precision
        self.engine = engine

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        self.engine.backward(tensor, scale_wrt_gas=False)  # Lightning divided by accumulate_grad_batches
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # the micro-step ends here; on the boundary, optimizer_step ends it

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        self.engine.set_gradient_accumulation_boundary(True)
        result = closure()  # the window's last training_step and its backward
        self._after_closure(model, optimizer)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        if norm is not None and isinstance(model, LightningModule):
            model.log("grad_norm", norm, on_step=True, on_epoch=False)
        return result

    def clip_gradients(self, optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = None) -> None:
        """Nothing: the engine clips by the global norm (``gradient_clipping``) inside ``step``."""


def convert_to_lightning_checkpoint(checkpoint_dir: str | Path, output_file: str | Path) -> Path:
    """One ordinary Lightning ``.ckpt`` file from a ``ZeroEngineStrategy`` checkpoint: its
    Lightning dict with the full fp32 ``state_dict``, loadable by ``Module.load_from_checkpoint``
    without zero_engine or torch.distributed (DeepSpeed's ``convert_zero_checkpoint_to_fp32_state_dict``)."""
    state = dict(load_client_state(checkpoint_dir) or {})
    state["state_dict"] = load_consolidated(checkpoint_dir)
    return write_atomically(Path(output_file), lambda staging: torch.save(state, staging))


def _raw_config(config: Any) -> tuple[dict[str, Any], str]:
    if isinstance(config, ZeroEngineConfig):  # back to a mapping, its "auto" included, to fill from the Trainer
        raw = config.model_dump(exclude_unset=True)
        for path in auto_keys(config):
            *sections, key = path.split(".")
            target = raw
            for name in sections:
                target = target.setdefault(name, {})
            target[key] = AUTO
        return raw, "ZeroEngineConfig"
    return read_config_mapping(config)


def _trainer_rules(trainer: Trainer, raw: dict[str, Any]) -> list[Rule]:
    """What the Lightning Trainer decides: accumulation, clipping (where it sets a value), precision."""
    precision = str(trainer.precision)
    if precision not in PRECISIONS:
        raise ValueError(
            f"ZeroEngineStrategy: precision={precision!r} is not supported; use '32-true', 'bf16-mixed' or '16-mixed' "
            "(the engine computes in bf16 / fp16 on copies of fp32 masters)"
        )
    fp16, bf16 = PRECISIONS[precision]
    rules = [
        Rule("gradient_accumulation_steps", trainer.accumulate_grad_batches, "accumulate_grad_batches", True),
        Rule("fp16.enabled", fp16, f"precision={precision!r}", fp16),
        Rule("bf16.enabled", bf16, f"precision={precision!r}", bf16),
    ]
    if trainer.gradient_clip_val is not None:
        rules.append(Rule("gradient_clipping", float(trainer.gradient_clip_val), "gradient_clip_val", True))
    elif raw.get("gradient_clipping", AUTO) == AUTO:  # left out: Lightning's DeepSpeed strategy does not clip either
        rules.append(Rule("gradient_clipping", 0.0, "gradient_clip_val = None (no clipping)", True))
    return rules


ZeroEngineStrategy.register_strategies(StrategyRegistry)
