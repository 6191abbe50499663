"""The training-loop surface: forward, backward, step, state and reports.

The engine owns no offset arithmetic and no collective calls of its own: units (`FlatUnit`)
hold the flat buffers and masters, the `GradReducer` reduces gradients during backward, the
`OptimizerStep` (`zero_engine.step`) runs the optimizer step on accumulation boundaries, and
the stage (`Stage`) says what is sharded. The engine is the loop's surface: forward, backward
(however it is called), ``step()`` counting micro-steps into windows, checkpoints and reports.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .accumulation import AccumulationWindow, WindowView
from .comm import Comm
from .config import BatchSizes
from .engine_settings import EngineSettings
from .errors import ShardedParameterError
from .loop_guards import LoopGuards
from .model_access import ModelAccess
from .monitor import StepLog
from .param_groups import ParamGroup
from .precision import Precision
from .progress import Progress
from .sharding.building.build import BuildSettings, build_mechanism
from .sharding.building.deferred_init import DeferredInit
from .sharding.units.lifecycle import Lifecycle
from .sharding.units.unit_plan import UnitPlan
from .sharding.gathering.agreement import Call
from .stage import Stage
from .sequence_view import SequenceView
from .transforms.seam import COMPILE, LoopHooks, ModuleTransforms, TransformTarget
from .transforms.table import compiled, planned_transforms
from .state.gathered import GatheredParameters
from .state.state_dict import ModelState, cast_frozen
from .state.storage import FILES, FileWriter
from .step import NoOptimizerStep, OptimizerStep
from .step_view import StepView
from .tree import iter_tensors, map_tensors

logger = logging.getLogger("zero_engine")


class Engine(ModelAccess, StepView, WindowView, SequenceView):
    """A model wrapped for data-parallel training with ZeRO sharding: the training loop here,
    the model's state out and in (`zero_engine.model_access.ModelAccess`), the optimizer step's
    readings (`zero_engine.step_view.StepView`), the sequence loop's calls
    (`zero_engine.sequence_view.SequenceView`)."""

    def __init__(
        self,
        model: nn.Module,
        settings: EngineSettings,
        comm: Comm,
        stage: Stage,
        batch: BatchSizes,
        groups: list[ParamGroup],
        precision: Precision,
        plan: UnitPlan,
        build: BuildSettings,
        *,
        device: torch.device | None = None,
        deferred: DeferredInit | None = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        transforms: ModuleTransforms | None = None,
    ) -> None:
        self.module = model
        _WRAPPED[model] = None
        _LEFT_SHARDED.pop(model, None)
        # each parameter's dtype as given (the engine may keep it in the compute dtype): close(unshard=True)
        # gives the parameters back in it
        self._dtypes_as_given = {name: param.dtype for name, param in model.named_parameters(remove_duplicate=False)}
        self.settings = settings
        self.comm = comm
        self.stage = stage
        self.batch = batch
        self.precision = precision
        self.global_step = 0
        self.window = AccumulationWindow(batch.gradient_accumulation_steps)  # where the loop is in its window
        self._window_opened = False
        self._train_row_sent = False  # this micro-step's call row (`_agree_on_training`)
        self.loop_hooks = LoopHooks()  # what the loop tells the transforms, and asks them
        self._scaling_backward = False  # inside engine.backward
        self._open_gathered: list[GatheredParameters] = []  # engine.gathered() contexts open (no step inside one)
        _sync_from_rank0(comm, model, transforms.whole_sources() if transforms is not None else [])
        self.device = device or _model_device(model)  # where parameters, gradients and state live
        self.offload = build.offload  # what lives in host memory instead
        self.lifecycle = Lifecycle()  # where training is; the reducer and the gatherer share it
        self.lifecycle.track_forward(model)
        cast_frozen(model, precision.compute_dtype)  # before any unit takes their values: no fp32 copy, ever
        mechanism = build_mechanism(model, plan, comm, build, self.device, self.lifecycle, self._begin_backward, deferred)
        self.units, self.frozen_units, self.gatherer, self.reducer, self.calls, self.codecs, self.held = mechanism
        cast_frozen(model, precision.compute_dtype)  # those materialized from the meta device while building
        self.model_state = ModelState(model, self.units, comm, precision.compute_dtype, self.frozen_units)
        self.checkpoint_writer: FileWriter = FILES  # where save_checkpoint writes (another storage: its own writer)
        self.guards = LoopGuards(model)  # what the loop may not do (requires_grad as built, among others)
        # the table's transforms (converted before the plan by `initialize`), applied now; compiled
        # later (compile()); close() puts it all back
        self.transforms = transforms if transforms is not None else planned_transforms(settings.transforms)
        self.transforms.apply_planned(TransformTarget(
            model, plan.modules.leaf_modules, comm.mesh, rank=comm.rank, groups=comm.group, calls=self.calls,
            window=self.window, loop=self.loop_hooks,
        ))
        self.optimizer_step: OptimizerStep | NoOptimizerStep = NoOptimizerStep()  # nothing to train
        if self.units:
            self.optimizer_step = OptimizerStep(
                settings.step, stage, self.units, groups, comm, self.reducer, self.device, self.offload,
                self.held, lr_scheduler,
            )
        self.step_log = StepLog(settings.monitors.writers() if comm.rank == 0 else [])  # DeepSpeed's monitor sections
        self.progress = Progress(  # rank 0's line every steps_per_print steps
            settings.print_interval, settings.wall_clock_breakdown, batch.train_batch_size, comm.mesh.batch,
            self.device, printing=comm.rank == 0,
        )

    # -- construction --------------------------------------------------------------------------

    # -- the training loop -----------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward on the arguments (cast to the compute dtype under mixed
        precision), its units gathered around their use at stage 3; the output as the model
        gives it."""
        self.calls.check_usable()  # after ranks diverged, every call raises
        self._open_window()
        if self.lifecycle.state.in_backward:  # the last backward raised before autograd ran its end
            self.reducer.disarm()
        if self.precision.mixed:
            args, kwargs = map_tensors(self._to_compute_dtype, (args, kwargs))
        self.progress.add_inputs(args, kwargs)
        if self.held.step_read_ahead and torch.is_grad_enabled() and self.is_gradient_accumulation_boundary():
            self.optimizer_step.read_ahead(self.held.step_read_ahead)  # the step's first shards read during the pass
        try:
            with self.progress.timed("forward"):
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
        self.guards.check_trains("backward", bool(self.units))
        if not loss.requires_grad:  # before torch's "element 0 of tensors does not require grad"
            self.guards.check_requires_grad_unchanged()  # every parameter frozen since initialize: that, by name
            raise RuntimeError(
                "engine.backward(loss): the loss does not require a gradient: it was computed under "
                "torch.no_grad() or torch.inference_mode(), or from nothing trainable (call the engine with "
                "gradients enabled, after engine.train())"
            )
        self.step_log.add_loss(loss)  # with a monitor on: summed on the device, read back at the step
        self.progress.add_loss(loss)  # likewise, for the progress line
        divisor = self.batch.gradient_accumulation_steps if scale_wrt_gas else 1
        self._scaling_backward = True
        try:
            with self.progress.timed("backward"):
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
        self.guards.check_requires_grad_unchanged()
        boundary = self.is_gradient_accumulation_boundary()
        if boundary and self.window.backwards and not self.reducer.reduces_every_micro_step:
            raise RuntimeError(
                "a second backward in the micro-step whose gradients were already reduced (stages 0-1 reduce once, "
                "at the accumulation boundary): call engine.step() after each backward, or add the losses and "
                "call backward once"
            )
        if self.loop_hooks.exchanges_in_backward():  # before any reduction: the row is read first
            self.calls.agree_at_once(Call.TRAIN, self.window.micro_steps)
            self._train_row_sent = True
        else:
            self._agree_on_training()
        self._open_window()
        self.reducer.pre_backward(boundary=boundary)
        self.gatherer.begin_backward()  # after: it tells the reducer which units get no gradient
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self.gatherer.end_backward()  # first: other ranks may need its drain rows to end their backward
        self.reducer.post_backward()
        self.gatherer.propose_next_pass()  # last: no next-pass gather may launch before the step (Q1)
        self.window.backward_done(scaled=self._scaling_backward)  # still inside engine.backward if scaled

    def step(self) -> None:
        """Call after every micro-batch's backward; updates only on accumulation boundaries."""
        self.calls.check_usable()
        self.guards.check_trains("step", bool(self.units))
        self.guards.check_backwards(self.window, self.loss_scaler is not None)
        if self.is_gradient_accumulation_boundary():
            self._check_no_gathered("step() on an accumulation boundary")
            self.gatherer.check_resharded("step() on an accumulation boundary")
        boundary = self.window.end_micro_step()
        self._train_row_sent = False
        self.loop_hooks.micro_step_ended()
        if not boundary:
            return
        self.calls.read()  # before the step's collectives (stages 0-2: a row sent and not read yet)
        with self.progress.timed("step"):
            self.optimizer_step.run(self.global_step)
        self._zero_grads()
        self.global_step += 1
        self._window_opened = False
        samples = self.global_step * self.batch.train_batch_size
        scale = self.loss_scale if self.loss_scaler is not None else None
        self.step_log.write_step(samples, self.get_lr()[0], self.get_global_grad_norm(), scale)
        line = self.progress.after_step(
            self.global_step, self.get_lr(), self.get_global_grad_norm(), scale, self.skipped_steps
        )
        if line is not None:
            logger.info(line)

    # -- collective calls agreed on, the window's checks -----------------------------------------

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
        self.calls.agree(call, self.window.micro_steps)

    def _to_compute_dtype(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.precision.compute_dtype) if tensor.is_floating_point() else tensor

    def _zero_grads(self) -> None:
        self.reducer.zero_grads()
        self.reducer.reset_used()
        for param in self.model_state.loose_params:
            param.grad = None

    def _open_window(self) -> None:
        """The communication report covers one optimizer step, from its first micro-batch."""
        if not self._window_opened:
            self.comm.reset_report()
            self.held.reset_reports()
            self.codecs.meter.reset()
            self._window_opened = True

    def compile(self, **options: Any) -> Engine:
        """``torch.compile(**options)`` each unit module's forward: stage 3's leaf units, the same
        modules at stages 0-2, or the whole model's forward when it has no such module. The
        engine's hooks run around the compiled forwards, never inside a graph; names, state
        dicts and checkpoints stay eager's. Call it once, before or between steps.

        At stage 3, modes that capture CUDA graphs are refused: a graph replays fixed addresses,
        and stage 3 allocates each unit's storage anew at every gather, so the graphs would be
        recorded again every step (or fall back to eager) while their memory pools pile up."""
        if self.stage.shard_parameters:
            _refuse_cuda_graphs(options)
        if self.transforms.of_order(COMPILE):
            raise RuntimeError(
                "engine.compile() was called already; call engine.close() and build a new engine to change it"
            )
        self.transforms.add(compiled(options))
        return self

    # -- the module's mode, and letting it go -----------------------------------------------------

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def close(self, *, unshard: bool = False) -> None:
        """Remove the engine's hooks from the model's parameters and modules.

        At stage 3 each rank keeps only its shard of every sharded parameter (with
        ``expert_parallel_size``, at any stage, its own experts), so the model is not whole
        after ``close()``, and `zero_engine.initialize` refuses it; ``unshard=True``
        (collective: call it on every rank) first gathers the whole model and puts each
        parameter's values back into it, as given to `initialize` (fp32 masters in their
        dtype): every rank then holds the whole model, as FSDP's unshard leaves it. Below
        stage 3 the parameters are whole already and ``unshard`` changes nothing. A transform's
        first phase (modules it replaced before the plan) is undone once the parameters are
        whole again."""
        parts = self.stage.shard_parameters or any(unit.is_cut for unit in self.units)  # experts owned per rank too
        whole = self.full_state_dict() if unshard and parts else None
        self.reducer.remove_hooks()
        self.gatherer.remove_hooks()
        self.transforms.remove_forwards()
        self.lifecycle.remove_hooks()
        self.step_log.close()
        self.held.close()  # what the tiers opened (NVMe's files removed)
        _WRAPPED.pop(self.module, None)
        if whole is not None:
            with torch.no_grad():
                for name, param in self.module.named_parameters(remove_duplicate=False):
                    param.data = whole[name].to(device=self.device, dtype=self._dtypes_as_given[name])
        elif parts and (self.units or self.frozen_units):
            _LEFT_SHARDED[self.module] = None
            return  # the transforms' first phase stays: what it made holds the shards
        self.transforms.revert()  # the modules and parameters the first phase replaced, back with their values


# Models an engine has hooked (until its close()): a second engine on one would run both
# engines' hooks on every parameter.
_WRAPPED: weakref.WeakKeyDictionary[nn.Module, None] = weakref.WeakKeyDictionary()


# Models a stage 3 engine was closed on without unshard: each rank holds only its shards.
_LEFT_SHARDED: weakref.WeakKeyDictionary[nn.Module, None] = weakref.WeakKeyDictionary()


def is_wrapped(model: nn.Module) -> bool:
    """Whether an engine has hooked ``model`` and not been closed."""
    return model in _WRAPPED


def left_sharded(model: nn.Module) -> bool:
    """Whether a stage 3 engine was closed on ``model`` without putting the whole parameters back."""
    return model in _LEFT_SHARDED


# torch.compile's modes that capture CUDA graphs (torch._inductor.list_mode_options).
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _refuse_cuda_graphs(options: dict[str, Any]) -> None:
    """``engine.compile(**options)`` at stage 3: no CUDA-graph capture (see `Engine.compile`)."""
    mode = options.get("mode")
    if mode in _CUDA_GRAPH_MODES or (options.get("options") or {}).get("triton.cudagraphs"):
        asked = f"mode={mode!r}" if mode in _CUDA_GRAPH_MODES else "options={'triton.cudagraphs': True}"
        raise ValueError(
            f"engine.compile({asked}) at stage 3: CUDA graphs replay fixed addresses, and stage 3 allocates each "
            "unit's parameters anew at every gather, so they would be recorded again every step. Use mode='default' "
            "or 'max-autotune-no-cudagraphs'"
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


def _sync_from_rank0(comm: Comm, module: nn.Module, cut: list[tuple[nn.Parameter, torch.Tensor, int]]) -> None:
    """Every rank starts from rank 0's parameters and buffers (those on the meta device are
    initialized identically on every rank instead); a parameter a transform cut from a whole one
    (``cut``: an expert's weights) from rank 0's whole one, then its own part of it."""
    parts = {id(kept) for kept, _, _ in cut}
    tensors = [p.data for p in module.parameters() if id(p) not in parts] + list(module.buffers())
    comm.broadcast([t for t in tensors if not t.is_meta] + [whole for _, whole, _ in cut], src=0)
    with torch.no_grad():
        for kept, whole, start in cut:
            kept.copy_(whole[start : start + kept.shape[0]])
