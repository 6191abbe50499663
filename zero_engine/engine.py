"""The training-loop surface: forward, backward, step, state and reports.

The engine owns no offset arithmetic and no collective calls of its own: units (`FlatUnit`)
hold the flat buffers and masters, the `GradReducer` reduces gradients during backward, and
the stage (`Stage`) says what is sharded. ``step()`` runs on accumulation boundaries in named
phases: agree on which parameters were used and on the gradient norm (and so on fp16
overflow), unscale and clip, update this rank's masters, gather the updated parameters.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .comm import Comm, connect, expected_world_size, local_cuda_device
from .config import BatchSizes, ZeroEngineConfig, load_config, no_effect_settings, optimizer_class
from .errors import ShardedParameterError
from .features import refuse_unbuilt_features
from . import offload
from .accumulation import AccumulationWindow
from .auto_values import fill_auto
from .memory import host_bytes_needed, measure_memory
from .monitor import Event, build_monitors, check_monitor_packages
from .offload import offload_plan
from .optim import build_optimizer, check_optimizer_for_stage
from .param_groups import ParamGroup, resolve_param_groups
from .precision import Precision, build_loss_scaler
from .schedules import build_scheduler, dry_run
from .stage_choice import resolve_stage
from .sharding.build import build_units
from .sharding.deferred_init import DeferredInit, draw_base_seed, has_meta_tensors, materialization_device
from .sharding.lifecycle import Lifecycle
from .sharding.module_plan import leaf_unit_modules
from .sharding.optimizer_shard import step_shards
from .sharding.unit_forwards import WrappedForwards, compiled, recomputed
from .sharding.schedule import Call
from .sharding.stages import Stage, build_reducer, stage_for
from .sharding.unit import FlatUnit
from .state import checkpoint
from .state.state_dict import ModelState
from .state.weights import WeightsSource, load_weights, match_weights, open_weights
from .tree import iter_tensors, map_tensors

logger = logging.getLogger("zero_engine")


def initialize(
    model: nn.Module,
    config: str | Path | dict[str, Any] | ZeroEngineConfig,
    *,
    param_groups: Iterable[Any] | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    weights: WeightsSource | None = None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> Engine:
    """Wrap ``model`` for ZeRO training as ``config`` (path, dict or `ZeroEngineConfig`) says.

    Starts a process group from torchrun's environment if none exists (world size 1 without
    one), broadcasts rank 0's parameters and buffers, and checks everything that could fail
    later: unbuilt features, the optimizer for the stage, the batch arithmetic.

    A model built on the meta device is materialized here, one unit at a time at stage 3
    (`zero_engine.sharding.deferred_init`): each module initialized by ``param_init_fn(module)`` or its
    own ``reset_parameters()``, identically at every stage and world size. ``weights`` (a
    safetensors file, a Hugging Face directory, a torch state dict file, a checkpoint
    directory, or a state dict) sets the values it holds, each rank reading only what it
    keeps (`zero_engine.state.weights`).

    ``zero_optimization.stage: auto`` is settled first: the lowest stage (then stage 3 with
    offload) whose per-rank memory fits the budget (`zero_engine.stage_choice`), logged on rank 0.

    ``lr_scheduler`` builds a schedule from the engine's optimizer (``lambda optimizer:
    LambdaLR(optimizer, fn)``), for a config without a ``scheduler`` section; like the config's,
    it steps on applied optimizer steps only and is saved in checkpoints.
    """
    _check_not_wrapped(model)
    config = fill_auto(load_config(config), model)
    _check_scheduler_factory(lr_scheduler, config)
    check_monitor_packages(config)
    groups = resolve_param_groups(model, param_groups, optimizer_class(config.optimizer.type))
    device = materialization_device(model)
    config, stage_table = resolve_stage(config, model, groups, expected_world_size(), device)
    refuse_unbuilt_features(config)
    stage = stage_for(config.zero_optimization.stage)
    check_optimizer_for_stage(config.optimizer, stage.level)
    precision = Precision.from_config(config)
    _check_params(model, precision)
    weights_file = open_weights(weights) if weights is not None else None
    try:
        file_names = match_weights(model, weights_file) if weights_file is not None else {}
        _check_device(device)
        comm = connect(config, device)
        if stage_table is not None and comm.rank == 0:
            logger.info(stage_table)
        deferred = None
        if has_meta_tensors(model):
            base_seed = comm.each_rank(draw_base_seed() if comm.rank == 0 else 0).values()[0]
            deferred = DeferredInit(model, device, base_seed, param_init_fn, provided=set(file_names))
        elif param_init_fn is not None and comm.rank == 0:
            logger.warning("param_init_fn is not called: the model has no tensors on the meta device")
        batch = config.batch_sizes(comm.world_size)
        _check_host_memory(model, config, comm.world_size)
        engine = Engine(
            model, config, comm, stage, batch, groups, precision, device=device, deferred=deferred,
            lr_scheduler=lr_scheduler,
        )
        if weights_file is not None:
            load_weights(engine.model_state, weights_file, file_names)
    finally:
        if weights_file is not None:
            weights_file.close()
    return engine


class Engine:
    """A model wrapped for data-parallel training with ZeRO sharding."""

    def __init__(
        self,
        model: nn.Module,
        config: ZeroEngineConfig,
        comm: Comm,
        stage: Stage,
        batch: BatchSizes,
        groups: list[ParamGroup],
        precision: Precision,
        *,
        device: torch.device | None = None,
        deferred: DeferredInit | None = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    ) -> None:
        self.module = model
        _WRAPPED[model] = None
        self.config = config
        self.comm = comm
        self.stage = stage
        self.batch = batch
        self.precision = precision
        self.global_step = 0
        self.window = AccumulationWindow(batch.gradient_accumulation_steps)  # where the loop is in its window
        self._step_applied = False  # whether the last boundary updated the parameters
        self.skipped_steps = 0
        self._window_opened = False
        self._train_row_sent = False  # this micro-step's call row (`_agree_on_training`)
        self._global_grad_norm: float | None = None
        self._scaling_backward = False  # inside engine.backward
        zero = config.zero_optimization
        self._sync_from_rank0()
        if comm.rank == 0:
            if stage.shard_parameters and not zero.reduce_scatter_each_micro_step:
                logger.warning("zero_optimization.reduce_scatter_each_micro_step: false has no effect at stage 3")
            for message in no_effect_settings(config):
                logger.warning(message)
            logger.info(_clipping_in_effect(config))
        self.device = device or _model_device(model)  # where parameters, gradients and state live
        self.offload = offload_plan(zero)  # what lives in host memory instead
        self.lifecycle = Lifecycle()  # where training is; the reducer and the gatherer share it
        self.lifecycle.track_forward(model)
        self.units, self.gatherer = build_units(
            model, groups, comm, stage, zero, precision.compute_dtype, self.device, self.lifecycle, deferred,
            self.offload,
        )
        self.model_state = ModelState(model, self.units, comm, precision.compute_dtype)
        self._groups = groups
        self.recompute = WrappedForwards(self._leaf_unit_modules() if zero.recompute_units else [], recomputed)
        self._compiled: WrappedForwards | None = None
        self.reducer = build_reducer(
            stage, self.units, comm, zero, precision.reduce_dtype, lifecycle=self.lifecycle,
            on_unit_complete=self.gatherer.unit_complete, on_unarmed_grad=self._begin_backward,
            may_wait_for=self.gatherer.may_wait_for_reduction,
        )
        self.gatherer.attach_reducer(self.reducer)
        self.peak_step_grad_bytes = 0  # fp32 copies of low-precision gradients alive at once in the last step
        self.optimizer = build_optimizer(
            config.optimizer, stage.level, _optimizer_groups(groups, self.units), on_host=self.offload.optimizer
        )
        if config.scheduler:
            dry_run(config.scheduler, self.optimizer)
        self.lr_scheduler = build_scheduler(config.scheduler, self.optimizer) if config.scheduler else None
        if lr_scheduler is not None:
            self.lr_scheduler = lr_scheduler(self.optimizer)
        self.loss_scaler = build_loss_scaler(config)
        self.monitors = build_monitors(config) if comm.rank == 0 else []  # DeepSpeed's monitor sections
        self._window_loss: torch.Tensor | None = None  # losses given to backward in this window (monitors)
        self._window_backwards = 0

    # -- construction --------------------------------------------------------------------------

    def _sync_from_rank0(self) -> None:
        """Every rank starts from rank 0's parameters and buffers (those on the meta device
        are initialized identically on every rank instead)."""
        tensors = [p.data for p in self.module.parameters()] + list(self.module.buffers())
        self.comm.broadcast([t for t in tensors if not t.is_meta], src=0)

    # -- the training loop -----------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.gatherer.check_usable()  # after ranks diverged, every call raises
        self._open_window()
        if self.lifecycle.state.in_backward:  # the last backward raised before autograd ran its end
            self.reducer.disarm()
        if self.precision.mixed:
            args, kwargs = map_tensors(self._to_compute_dtype, (args, kwargs))
        try:
            output = self.module(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 (re-raised as it is unless stage 3 can say more)
            explained = self.gatherer.explain_failed_forward(error)
            if explained is None:
                raise
            raise ShardedParameterError(explained) from error
        if torch.is_grad_enabled():
            for tensor in iter_tensors(output):
                if tensor.requires_grad:  # its gradient is the first a backward through the model computes
                    tensor.register_hook(self._on_output_grad)
        return output

    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> None:
        """Backward of ``loss * loss_scale / gradient_accumulation_steps``; reduces as the
        stage says (on boundaries, or every micro-step at stages 2-3). ``scale_wrt_gas=False``
        leaves the division to the caller (Hugging Face's Trainer divides by its own count, a
        short last window included). A plain ``loss.backward()`` reduces the same way, but
        neither divides nor scales."""
        _check_loss(loss)
        if self.monitors:  # summed on the device; read back once per step
            value = loss.detach().float().reshape(())
            self._window_loss = value if self._window_loss is None else self._window_loss + value
            self._window_backwards += 1
        divisor = self.batch.gradient_accumulation_steps if scale_wrt_gas else 1
        self._scaling_backward = True
        try:
            (loss * (self.loss_scale / divisor)).backward()
        finally:
            self._scaling_backward = False

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """For code written for DDP (and Hugging Face's accumulation): a context that changes
        nothing and never raises. Whether a backward reduces is the engine's decision, from the
        accumulation boundary: stages 0-1 reduce only there; stages 2-3 reduce every micro-step
        into the rank's shard, since no rank keeps the whole gradient."""
        return contextlib.nullcontext()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated since the last optimizer step (``step()`` on a
        boundary clears them itself). Local: no collective."""
        del set_to_none  # the engine's gradient buffers are zeroed, or released at stage 3, either way
        if self.window.has_gradients:  # else clean since the last step
            self._zero_grads()

    # -- backward, however it is called ----------------------------------------------------------

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        self._begin_backward()

    def _begin_backward(self) -> None:
        """Runs inside autograd when a backward first reaches the model (an output's gradient,
        or a parameter's if the loss used one directly), whoever called backward: arms the
        reducer and queues the end of the backward on the autograd engine (as FSDP2 does)."""
        if self.lifecycle.state.in_backward:
            return
        boundary = self.is_gradient_accumulation_boundary()
        if boundary and self.window.backwards and not self.reducer.reduces_every_micro_step:
            raise RuntimeError(
                "a second backward in the micro-step whose gradients were already reduced (stages 0-1 reduce once, "
                "at the accumulation boundary): call engine.step() after each backward, or add the losses and "
                "call backward once"
            )
        self._agree_on_training()
        self._open_window()
        self.reducer.pre_backward(boundary=boundary)
        self.gatherer.begin_backward()  # after: it tells the reducer which units get no gradient
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self.gatherer.end_backward()  # first: other ranks may need its drain rows to end their backward
        self.reducer.post_backward()
        self.window.backward_done(scaled=self._scaling_backward)  # still inside engine.backward if scaled

    def step(self) -> None:
        """Call after every micro-batch's backward; updates only on accumulation boundaries."""
        self.gatherer.check_usable()
        self._check_backwards()
        boundary = self.window.end_micro_step()
        self._train_row_sent = False
        if not boundary:
            return
        self.gatherer.read_call_row()  # before the step's collectives (stages 0-2: a row sent and not read yet)
        used, squares = self._agree_on_used_params_and_norm()
        self._global_grad_norm = math.sqrt(squares) / self.loss_scale
        self._step_applied = math.isfinite(squares)
        if not self._step_applied:
            self._skip_step()
        else:
            self._update(used, self._gradient_multiplier())
            if self.stage.shard_optimizer_state:
                self._gather_params()
            if self.loss_scaler is not None:
                self.loss_scaler.update(overflow=False)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self._zero_grads()
        self.global_step += 1
        self._window_opened = False
        if self.monitors:
            self._write_monitors()
        every = self.config.steps_per_print
        if self.comm.rank == 0 and every is not None and self.global_step % every == 0:
            logger.info(
                "step %d: lr %s, grad norm %.4g, loss scale %g, skipped steps %d",
                self.global_step, [f"{lr:.3g}" for lr in self.get_lr()], self._global_grad_norm or 0.0,
                self.loss_scale, self.skipped_steps,
            )

    def _write_monitors(self) -> None:
        """The step's events, DeepSpeed's names, against samples seen (`zero_engine.monitor`)."""
        samples = self.global_step * self.batch.train_batch_size
        events: list[Event] = [("Train/Samples/lr", self.get_lr()[0], samples)]
        if self._window_loss is not None:
            events.insert(0, ("Train/Samples/train_loss", self._window_loss.item() / self._window_backwards, samples))
        if self._global_grad_norm is not None:
            events.append(("Train/Samples/grad_norm", self._global_grad_norm, samples))
        if self.loss_scaler is not None:
            events.append(("Train/Samples/loss_scale", self.loss_scale, samples))
        for writer in self.monitors:
            writer.write(events)
        self._window_loss, self._window_backwards = None, 0

    def _agree_on_training(self) -> None:
        """A call row at the first backward of every micro-step, so that a collective call made
        on some ranks only (a save under ``if rank == 0:``, between steps or between a forward
        and its backward) meets another rank's row and is caught on every rank (stages 0-2;
        stage 3's passes send rows of their own). The row is read before the micro-step's
        first reduction, not here; a forward issues no collective at stages 0-2, so it needs
        no row of its own (``docs/benchmarks.md``: one cost 1-3% of a step on 2 CPU ranks)."""
        if not self._train_row_sent:
            self._train_row_sent = True
            self._agree_on_call(Call.TRAIN)

    def _agree_on_call(self, call: Call) -> None:
        self.gatherer.agree_on_call(call, self.window.micro_steps)

    def _check_backwards(self) -> None:
        if self.window.backwards == 0:
            raise RuntimeError(
                f"engine.step() without a backward since the last step() (micro-step {self.window.micro_steps}): "
                "call engine.backward(loss) (or loss.backward()) on the output of engine(...) first"
            )
        if self.loss_scaler is not None and self.window.unscaled_backwards:
            raise RuntimeError(
                "fp16 loss scaling is on, but a backward did not go through engine.backward(loss) (a plain "
                "loss.backward() applies no loss scale, so small gradients underflow): use engine.backward(loss)"
            )

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch is the last of its accumulation window: every
        ``gradient_accumulation_steps``-th, unless `set_gradient_accumulation_boundary` said."""
        return self.window.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Say whether the coming micro-step ends its window, as DeepSpeed's engine takes it
        (Hugging Face's Trainer says so for each one, and ends an epoch's short last window
        early). Holds until set again; None goes back to counting. Set it before the
        micro-step's backward (stages 0-1 decide there whether to reduce). Every rank must say
        the same."""
        self.window.set_boundary(is_boundary)

    @property
    def micro_steps(self) -> int:
        """Micro-steps (``step()`` calls) so far."""
        return self.window.micro_steps

    def was_step_applied(self) -> bool:
        """Whether the last boundary's ``step()`` updated the parameters (False after a step
        skipped for a non-finite gradient, e.g. an fp16 overflow, and before the first)."""
        return self._step_applied

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale; 1.0 without fp16."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def _to_compute_dtype(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.precision.compute_dtype) if tensor.is_floating_point() else tensor

    # -- the phases of step() --------------------------------------------------------------------

    def _agree_on_used_params_and_norm(self) -> tuple[list[bool], float]:
        """One small all-reduce: which parameters got a gradient on any rank, and the squared
        (still scaled) gradient norm summed over every rank's shard, so identical everywhere:
        non-finite on every rank when any rank's gradients overflowed. Packed on the device
        (the norm is computed there; the used-mask is kept on the host by the hooks) and read
        back to the host once, as Python values: the one host sync of a step."""
        squares = _sum_of_squares([self.reducer.grad_shard(unit) for unit in self.units], self.device)
        if self.comm.replica_rank:  # every shard is counted once: by its copy in the first shard group
            squares = torch.where(squares.isfinite(), 0.0, squares)
        # non_blocking: a pageable host-to-device copy need not stall the host (sync debug mode)
        packed = torch.cat([self.reducer.used_mask().to(self.device, non_blocking=True), squares.view(1)])
        self.comm.all_reduce_sum(packed).wait()
        *used, total = packed.tolist()
        return [count > 0 for count in used], total

    def _gradient_multiplier(self) -> float:
        """Unscale, then clip as ``torch.nn.utils.clip_grad_norm_`` does: by
        max_norm / (norm + 1e-6) when that is below 1."""
        multiplier = 1.0 / self.loss_scale
        max_norm = self.config.gradient_clipping
        if max_norm > 0 and self._global_grad_norm is not None:
            multiplier *= min(1.0, max_norm / (self._global_grad_norm + 1e-6))
        return multiplier

    def _update(self, used: list[bool], multiplier: float) -> None:
        """Each unit's optimizer shard steps on its fp32 gradient and publishes the result
        (`zero_engine.sharding.optimizer_shard.step_shards`), one unit at a time: a
        low-precision gradient's fp32 copy, and the temporaries of torch's foreach optimizers
        (AdamW's is an fp32 copy of every element it steps; foreach is the default on CUDA),
        then exist for one unit, never for the whole model."""
        shards = [unit.optim for unit in self.units]
        self.peak_step_grad_bytes = step_shards(self.optimizer, shards, used, multiplier)

    def _skip_step(self) -> None:
        """A non-finite gradient on some rank (fp16 overflow, or a NaN or inf loss or gradient
        at any precision): every rank leaves parameters, optimizer state and the schedule
        untouched. Logged at WARNING, except fp16's dynamic overflows, which are routine (the
        scale adapts)."""
        self.skipped_steps += 1
        if self.loss_scaler is None:
            if self.comm.rank == 0:
                logger.warning(
                    "step %d skipped: the gradient norm is not finite (a NaN or inf loss or gradient on some rank); "
                    "parameters unchanged (%d skipped so far, engine.skipped_steps)",
                    self.global_step, self.skipped_steps,
                )
            return
        scale = self.loss_scaler.scale
        self.loss_scaler.update(overflow=True)
        if self.comm.rank == 0:
            log = logger.info if self.loss_scaler.dynamic and scale > self.loss_scaler.min_scale else logger.warning
            log(
                "step %d skipped: fp16 gradient overflow; loss scale %g -> %g (%d skipped so far, engine.skipped_steps)",
                self.global_step, scale, self.loss_scaler.scale, self.skipped_steps,
            )

    def _gather_params(self) -> None:
        """Whole parameters get every rank's update; stage 3 units stay sharded until used."""
        pending = [self.comm.all_gather(unit.flat_param) for unit in self.units if not unit.sharded_params]
        for handle in pending:
            handle.wait()

    def _zero_grads(self) -> None:
        self.reducer.zero_grads()
        self.reducer.reset_used()
        for param in self.model_state.loose_params:
            param.grad = None

    def _open_window(self) -> None:
        """The communication report covers one optimizer step, from its first micro-batch."""
        if not self._window_opened:
            self.comm.reset_report()
            self._window_opened = True

    def compile(self, **options: Any) -> Engine:
        """``torch.compile(**options)`` each unit module's forward: stage 3's leaf units, the same
        modules at stages 0-2, or the whole model's forward when it has no such module. The
        engine's hooks run around the compiled forwards, never inside a graph; names, state
        dicts and checkpoints stay eager's. Call it once, before or between steps."""
        if self._compiled is not None:
            raise RuntimeError(
                "engine.compile() was called already; call engine.close() and build a new engine to change it"
            )
        self._compiled = WrappedForwards(self._leaf_unit_modules() or [self.module], compiled(options))
        return self

    def _leaf_unit_modules(self) -> list[nn.Module]:
        """Stage 3's unit modules holding no other (the same modules at stages 0-2): what is
        recomputed and compiled."""
        zero = self.config.zero_optimization
        return leaf_unit_modules(
            self.module, self._groups, zero.stage3_wrap_modules, zero.reduce_bucket_size,
            zero.stage3_param_persistence_threshold,
        )

    # -- module state and reports ----------------------------------------------------------------

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The complete module state on CPU, same keys as ``state_dict()`` (tied parameters'
        names share one tensor, as there), parameters as their fp32 masters. Collective when
        masters are sharded: call it on every rank.

        ``rank0_only=True`` gathers onto rank 0 alone, one unit at a time, so exporting never
        needs the full model on any other rank; the other ranks get an empty dict.
        """
        self.gatherer.check_usable()
        if any(unit.shard_master for unit in self.units):  # collective: every rank must be here
            self._agree_on_call(Call.FULL_STATE_DICT)
        return self.model_state.full_state_dict(rank0_only=rank0_only)

    def memory_report(self) -> dict[str, int]:
        """Bytes of model state this rank holds (see `zero_engine.memory.MemoryReport`)."""
        report = measure_memory(
            self.model_state.loose_params,
            self.units,
            self.optimizer,
            self.reducer,
            self.gatherer.peaks(),
            self.peak_step_grad_bytes,
            optimizer_on_host=self.offload.optimizer,
        )
        return report._asdict()

    def comm_report(self) -> dict[str, dict[str, int]]:
        """Bytes this rank sent and received per collective kind in the current optimizer step."""
        return self.comm.report()

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The L2 norm of the whole averaged, unscaled gradient at the last optimizer step
        (before clipping)."""
        return self._global_grad_norm

    def save_checkpoint(
        self, directory: str | Path, tag: str | None = None, client_state: Any = None, *, within_window: bool = False
    ) -> Path:
        """Save everything needed to resume, at any stage and world size (collective).

        ``tag`` defaults to ``global_step{N}``; ``client_state`` is anything
        ``torch.load(weights_only=True)`` can read back (tensors, numbers, strings, containers).
        A save inside an accumulation window is refused unless ``within_window=True``, which
        saves what the last boundary left (parameters, optimizer, schedule): the window's
        gradients so far stay in this run and are not saved, as a DDP checkpoint holds none (for
        loops that checkpoint between micro-batches, as Lightning's ModelCheckpoint can).
        """
        self.gatherer.check_usable()
        if self.window.in_window and not within_window:
            raise RuntimeError(
                f"save_checkpoint in the middle of a gradient-accumulation window (micro-step "
                f"{self.window.in_window} of {self.batch.gradient_accumulation_steps}): call it after "
                "engine.step() on a boundary"
            )
        self._agree_on_call(Call.SAVE_CHECKPOINT)
        counters = checkpoint.Counters(self.global_step, self.skipped_steps)
        tag = tag or f"global_step{self.global_step}"
        return checkpoint.save(self._resumable(), counters, directory, tag, client_state)

    def load_checkpoint(
        self,
        directory: str | Path,
        tag: str | None = None,
        *,
        strict: bool = True,
        load_optimizer_states: bool = True,
    ) -> Any:
        """Resume from ``directory`` (tag: the latest); returns the saved ``client_state``."""
        self.gatherer.check_usable()
        self._agree_on_call(Call.LOAD_CHECKPOINT)
        if self.offload.any:  # the last publish may still be reading the host masters this load overwrites
            offload.wait_for_host_copies(self.device)
        loaded = checkpoint.load(
            self._resumable(), directory, tag, strict=strict, load_optimizer_states=load_optimizer_states
        )
        self.global_step, self.skipped_steps = loaded.counters
        self.window.restart(self.global_step)
        return loaded.client_state

    def _resumable(self) -> checkpoint.Resumable:
        return checkpoint.Resumable(
            self.model_state, self.optimizer, self.lr_scheduler, self.loss_scaler, self.config, self.stage.level,
            self.device,
        )

    def close(self) -> None:
        """Remove the engine's hooks from the model's parameters and modules."""
        self.reducer.remove_hooks()
        self.gatherer.remove_hooks()
        if self._compiled is not None:
            self._compiled.remove()
        self.recompute.remove()
        self.lifecycle.remove_hooks()
        for writer in self.monitors:
            writer.close()
        self.monitors = []
        _WRAPPED.pop(self.module, None)


def _optimizer_groups(groups: list[ParamGroup], units: list[FlatUnit]) -> list[dict[str, Any]]:
    """The torch param groups over the units' optimizer targets (views of the fp32 masters:
    whole parameters at stage 0, this rank's pieces when optimizer state is sharded)."""
    per_group: list[list[torch.Tensor]] = [[] for _ in groups]
    for unit in units:
        for target in unit.optim.targets:
            per_group[unit.group_indices[target.piece.param_index]].append(target.tensor)
    return [dict(group.options, params=tensors) for group, tensors in zip(groups, per_group)]


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The squared L2 norm over all ``grads`` in float64, on ``device``: each tensor's norm in
    fp32 (no copy of fp32 gradients; the old ``grad.double().pow(2)`` made two per shard),
    computed where the tensor lives."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    by_place: dict[torch.device, list[torch.Tensor]] = {}
    for grad in grads:  # offloaded shards are summed where they live (the host), then moved as one number
        by_place.setdefault(grad.device, []).append(grad)
    for place, group in by_place.items():
        norms = torch.stack([torch.linalg.vector_norm(grad, dtype=torch.float32) for grad in group])
        squares = norms.double().pow(2).sum()
        total = total + (squares if place == device else squares.to(device, non_blocking=True))
    return total


# Models an engine has hooked (until its close()): a second engine on one would run both
# engines' hooks on every parameter.
_WRAPPED: weakref.WeakKeyDictionary[nn.Module, None] = weakref.WeakKeyDictionary()


def _check_not_wrapped(model: Any) -> None:
    if isinstance(model, Engine):
        raise TypeError("initialize(model, ...) got an Engine: pass the nn.Module (engine.module), or keep the engine")
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize(model, ...): model must be a torch.nn.Module, got {type(model).__name__}")
    if type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        raise TypeError(
            "initialize(model, ...) got a torch.compile'd model, whose parameters are all named '_orig_mod.*' and "
            "whose graph would hold the engine's hooks: pass the module itself (model._orig_mod), then call "
            "engine.compile(**the same options) to compile each unit with the hooks outside the graph"
        )
    if model in _WRAPPED:
        raise ValueError(
            "initialize: this model is already wrapped by an engine (its hooks and flat parameters are in place): "
            "call engine.close() on that engine first, or build a new model"
        )


def _check_loss(loss: Any) -> None:
    """``engine.backward`` takes the scalar loss tensor (a model's output dict is a common slip)."""
    if not torch.is_tensor(loss):
        hint = " (pass the loss in it, e.g. outputs['loss'])" if isinstance(loss, dict) else ""
        raise TypeError(f"engine.backward(loss): loss must be a scalar tensor, got {type(loss).__name__}{hint}")
    if loss.numel() != 1:
        raise ValueError(
            f"engine.backward(loss): loss must be a scalar tensor, got shape {tuple(loss.shape)} (reduce it first, "
            "e.g. loss.mean())"
        )


def _model_device(model: nn.Module) -> torch.device:
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _check_one_device(model: nn.Module) -> None:
    """Parameters and buffers (every one is broadcast on the data group: NCCL refuses a host
    tensor) on one device, meta aside; the error names a tensor on each device found."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    where = {}
    for name, tensor in tensors:
        if not tensor.is_meta:
            where.setdefault(str(tensor.device), name)
    if len(where) > 1:
        found = ", ".join(f"{name!r} on {device}" for device, name in sorted(where.items()))
        raise ValueError(f"the model's parameters and buffers are on several devices ({found}); move the model to one")


def _check_device(device: torch.device) -> None:
    """CUDA only: under torchrun each rank trains on its own GPU, ``cuda:LOCAL_RANK``."""
    if device.type != "cuda" or "LOCAL_RANK" not in os.environ:
        return
    expected = local_cuda_device()
    if device != expected:
        raise ValueError(
            f"the model is on {device}, but this rank's GPU is {expected} (torchrun's LOCAL_RANK): "
            f"move it there first, model.to({str(expected)!r})"
        )


def _check_scheduler_factory(factory: Any, config: ZeroEngineConfig) -> None:
    """``lr_scheduler=`` is a callable of the optimizer (the engine builds the optimizer over its
    shards, so a schedule made beforehand would drive another one), and not beside a config
    ``scheduler``."""
    if factory is None:
        return
    if hasattr(factory, "state_dict") and hasattr(factory, "step"):
        raise TypeError(
            "initialize(lr_scheduler=...): pass a function of the optimizer, e.g. lambda optimizer: "
            f"{type(factory).__name__}(optimizer, ...), not a {type(factory).__name__} built on another optimizer "
            "(the engine builds its own, over this rank's shards)"
        )
    if not callable(factory):
        raise TypeError(f"initialize(lr_scheduler=...): expected a function of the optimizer, got {type(factory).__name__}")
    if config.scheduler:
        raise ValueError(
            f"initialize(lr_scheduler=...) and the config's scheduler section ({config.scheduler.type}) both give a "
            "schedule: keep one"
        )


def _check_host_memory(model: nn.Module, config: ZeroEngineConfig, world_size: int) -> None:
    """With offload: the host state of every rank on this node must fit the node's available
    memory, checked before any of it is allocated."""
    if offload_plan(config.zero_optimization).any:
        num_params = sum(param.numel() for param in model.parameters() if param.requires_grad)
        needed = host_bytes_needed(config, num_params, world_size)
        offload.check_host_memory(needed, "zero_optimization.offload_optimizer / offload_param")


def _clipping_in_effect(config: ZeroEngineConfig) -> str:
    """The clipping a step applies, and whether the config chose it (left out, it is DeepSpeed's
    default, 1.0: a config written for no clipping must say 0)."""
    max_norm = config.gradient_clipping
    given = "" if "gradient_clipping" in config.model_fields_set else " (left out of the config: DeepSpeed's default)"
    if max_norm == 0:
        return f"gradient clipping: off (gradient_clipping = 0{given})"
    return f"gradient clipping: the global gradient norm to {max_norm:g} (gradient_clipping = {max_norm:g}{given})"


def _check_params(model: nn.Module, precision: Precision) -> None:
    _check_one_device(model)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if not param.is_floating_point():
            raise TypeError(f"parameter {name!r} is {param.dtype}: trainable parameters must be floating point")
        if not precision.mixed and param.dtype != torch.float32:
            raise NotImplementedError(
                f"parameter {name!r} is {param.dtype}: without fp16/bf16 enabled, trainable parameters must be "
                "float32 (enable bf16 or fp16 in the config to compute in low precision with fp32 masters)"
            )
