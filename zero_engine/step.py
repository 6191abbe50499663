"""One optimizer step on an accumulation boundary, from reduced gradients to updated parameters.

`OptimizerStep` owns everything a step touches besides the reduction of gradients (the
reducer's) and the training loop's counters (the engine's): the torch optimizer over the units'
optimizer shards, the learning-rate schedule, fp16's loss scaler, and the step's phases (`run`):

1. agree on which parameters some rank used and on the squared gradient norm, in one small
   all-reduce read back once (non-finite on every rank when any rank overflowed);
2. a non-finite norm skips the step on every rank (parameters, optimizer state and schedule
   untouched; the fp16 scale drops);
3. otherwise unscale and clip (one multiplier), update this rank's masters one unit at a time
   (`zero_engine.sharding.optimizer_side.optimizer_shard.step_shards`), and all-gather the updated
   parameters where optimizer state is sharded (stage 3 units stay sharded until used);
4. the schedule and the loss scaler advance on applied steps only.

A held resource's failure on some rank (`zero_engine.sharding.tiers.held`: NVMe offload's
swap file, a read or write on a full disk) is agreed too: the count of failed ranks rides in
phase 1's all-reduce (a write behind the last step, or this window's gradient), and one
control-group round follows phase 3's update (its reads), so every rank raises the resource's
error (`SwapError`) at the same step instead of the others waiting in a collective until the
timeout.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from . import devices
from .comm import Comm
from .config import OptimizerConfig, SchedulerConfig
from .offload import OffloadPlan
from .matrix_step import matrix_params, plan_exchanges, split_groups
from .optim import ComputeLayout, build_optimizer, optimizer_kind
from .param_groups import ParamGroup
from .precision import LossScaler, LossScaling
from .schedules import build_scheduler, dry_run
from .errors import CheckpointError
from .sharding.tiers.held import Holdings
from .sharding.optimizer_side.optimizer_shard import SavedPiece, SavedPieces, step_shards
from .sharding.reduction.reducer import GradReducer
from .stage import Stage
from .sharding.units.unit import FlatUnit

logger = logging.getLogger("zero_engine")


@dataclass(frozen=True)
class StepSettings:
    """What the optimizer step reads of the config, derived once with the engine's other
    settings (`zero_engine.engine_settings`): the optimizer, its schedule, the clipping, and
    fp16's loss scaling."""

    optimizer: OptimizerConfig
    scheduler: SchedulerConfig | None
    gradient_clipping: float  # max global norm; 0: off
    loss_scaling: LossScaling | None  # fp16's; None: a scale of 1, never skipping


class StepResult(NamedTuple):
    applied: bool  # False: skipped for a non-finite gradient norm
    grad_norm: float  # the global norm of the averaged, unscaled gradient, before clipping


class OptimizerStep:
    """The optimizer, its schedule and loss scaler, and the phases of a step."""

    def __init__(
        self,
        settings: StepSettings,
        stage: Stage,
        units: list[FlatUnit],
        groups: list[ParamGroup],
        comm: Comm,
        reducer: GradReducer,
        device: torch.device,
        offload: OffloadPlan,
        held: Holdings | None = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    ) -> None:
        self.settings = settings
        self.stage = stage
        self.units = units
        self.comm = comm
        self.reducer = reducer
        self.device = device
        # what the tiers hold (NVMe's swap spaces): the failures the step agrees on
        self.held = held if held is not None else Holdings()
        kind = optimizer_kind(settings.optimizer.type)  # the plan gave each parameter its compute layout
        matrices = matrix_params(units) if kind is not None and kind.layout is ComputeLayout.WHOLE_MATRIX else None
        torch_groups = _optimizer_groups(groups, units) if matrices is None else split_groups(groups, units, matrices)
        self.optimizer = build_optimizer(settings.optimizer, stage, torch_groups, on_host=offload.optimizer)
        # each torch group's parameters by name (a checkpoint that keeps options per parameter: DCP's)
        self.group_names = [g.names for g in groups] if matrices is None else _names_by_group(torch_groups, units)
        for unit in units:
            unit.optimizer_shard.bind_optimizer(self.optimizer)
        if matrices is not None:  # each unit's matrices finish through its exchange (`compute_layout`)
            self.optimizer.defer_orthogonalisation = plan_exchanges(
                units, matrices, self.optimizer.param_groups, comm, stage
            ) > 0
        self.lr_scheduler: Any = None
        if settings.scheduler:
            schedule = settings.scheduler.type, settings.scheduler.params
            dry_run(*schedule, self.optimizer)
            self.lr_scheduler = build_scheduler(*schedule, self.optimizer)
        if lr_scheduler is not None:
            self.lr_scheduler = lr_scheduler(self.optimizer)
        self.loss_scaler = LossScaler(*settings.loss_scaling) if settings.loss_scaling else None
        self.skipped_steps = 0
        self.grad_norm: float | None = None  # the last step's
        self.applied = False  # whether the last step updated the parameters
        self.peak_grad_bytes = 0  # fp32 copies of low-precision gradients alive at once in the last step
        self.peak_matrix_bytes = 0  # a whole-matrix optimizer's exchange buffers alive at once in the last step

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def run(self, step_number: int) -> StepResult:
        """The step's phases (see the module's docstring); ``step_number`` names it in logs."""
        used, squares = self._agree_on_used_params_and_norm(step_number)
        self.grad_norm = math.sqrt(squares) / self.loss_scale
        self.applied = math.isfinite(squares)
        if not self.applied:
            self._skip(step_number)
            return StepResult(False, self.grad_norm)
        self._update(used, self._gradient_multiplier(), step_number)
        if self.stage.shard_optimizer_state:
            self._gather_params()
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return StepResult(True, self.grad_norm)

    def read_ahead(self, count: int) -> None:
        """Start bringing in the masters (and state) of the first ``count`` shards the step
        will update, while the forward and backward run (offload to NVMe: at most
        ``buffer_count - 1`` of them, so one slot stays free for any other shard's use)."""
        for unit in self.units[:count]:
            unit.optimizer_shard.master_kind.prefetch(wait_for_slot=True)

    def _agree_on_used_params_and_norm(self, step_number: int) -> tuple[list[bool], float]:
        """One small all-reduce: which parameters got a gradient on any rank, and the squared
        (still scaled) gradient norm summed over every rank's shard, so identical everywhere:
        non-finite on every rank when any rank's gradients overflowed. Packed on the device
        (the norm is computed there; the used-mask is kept on the host by the hooks) and read
        back to the host once, as Python values: the one host sync of a step. With held
        resources (NVMe offload), one number more: the ranks where one failed (`_check_held`)."""
        norms: list[torch.Tensor] = []  # none where this rank's resources failed: every rank raises below
        with self._failures_agreed():
            norms = [self._shard_norm(unit) for unit in self.units]
        squares = _sum_of_squares(norms, self.device)
        if self.comm.replica_rank:  # every shard is counted once: by its copy in the first shard group
            squares = torch.where(squares.isfinite(), 0.0, squares)
        # non_blocking: a pageable host-to-device copy need not stall the host (sync debug mode)
        packed = torch.cat([self.reducer.used_mask().to(self.device, non_blocking=True), squares.view(1),
                            *self._failure_flag()])
        self.comm.all_reduce_sum(packed).wait()
        *used, total = devices.host_values(packed)
        if self.held:
            total, failed = used.pop(), total
            self._check_held(failed, step_number, "before its update: nothing of it was applied")
        return [count > 0 for count in used], total

    def _shard_norm(self, unit: FlatUnit) -> torch.Tensor:
        """The fp32 norm of this rank's shard of ``unit``'s step gradient, where it lives (on
        NVMe: taken as it was written, not read again)."""
        kept = unit.optimizer_shard.grad.kept_norm()
        if kept is not None:
            return kept
        return torch.linalg.vector_norm(self.reducer.grad_shard(unit), dtype=torch.float32)

    def _gradient_multiplier(self) -> float:
        """Unscale, then clip as ``torch.nn.utils.clip_grad_norm_`` does: by
        max_norm / (norm + 1e-6) when that is below 1."""
        multiplier = 1.0 / self.loss_scale
        max_norm = self.settings.gradient_clipping
        if max_norm > 0 and self.grad_norm is not None:
            multiplier *= min(1.0, max_norm / (self.grad_norm + 1e-6))
        return multiplier

    def _update(self, used: list[bool], multiplier: float, step_number: int) -> None:
        """Each unit's optimizer shard steps on its fp32 gradient and publishes the result, one
        unit at a time: a low-precision gradient's fp32 copy, and the temporaries of torch's
        foreach optimizers (AdamW's is an fp32 copy of every element it steps; foreach is the
        default on CUDA), then exist for one unit, never for the whole model. With NVMe
        offload, the ranks then agree on whether every read and write so far went through."""
        shards = [unit.optimizer_shard for unit in self.units]
        with self._failures_agreed():
            self.peak_grad_bytes, self.peak_matrix_bytes = step_shards(
                self.optimizer, shards, used, multiplier, lambda: self.held.failure() is not None,
                windowed=not self.held,
            )
        if self.held:  # control traffic: the control group, off the data group (NCCL on GPUs)
            failed = sum(row for row in self.comm.each_rank(int(self.held.failure() is not None)).values())
            self._check_held(failed, step_number, "in its update (partly applied)")

    # -- a held resource that failed on some rank (a swap file's disk) ends the step on every rank --

    @contextlib.contextmanager
    def _failures_agreed(self) -> Iterator[None]:
        """A held resource's failure raised inside is left to the ranks' agreement that follows
        (this rank goes on to it, not into the next collective alone); any other error raises."""
        try:
            yield
        except OSError:
            if self.held.failure() is None:
                raise

    def _failure_flag(self) -> list[torch.Tensor]:
        """Whether this rank's held resources failed, as the one number ranks sum (none held: none)."""
        if not self.held:
            return []
        failed = float(self.held.failure() is not None)
        return [torch.tensor([failed], dtype=torch.float64, device=devices.HOST).to(self.device, non_blocking=True)]

    def _check_held(self, failed: float | int, step_number: int, when: str) -> None:
        """Raise the failed resource's error on every rank when ``failed`` (ranks, summed) is not 0."""
        if failed:
            ranks = f"{int(failed)} of {self.comm.mesh.world} ranks"
            raise self.held.agreed_error(self.held.failure_message(ranks, f" at step {step_number}, {when}"))

    def _skip(self, step_number: int) -> None:
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
                    step_number, self.skipped_steps,
                )
            return
        scale = self.loss_scaler.scale
        self.loss_scaler.update(overflow=True)
        if self.comm.rank == 0:
            log = logger.info if self.loss_scaler.dynamic and scale > self.loss_scaler.min_scale else logger.warning
            log(
                "step %d skipped: fp16 gradient overflow; loss scale %g -> %g (%d skipped so far, engine.skipped_steps)",
                step_number, scale, self.loss_scaler.scale, self.skipped_steps,
            )

    def _gather_params(self) -> None:
        """Whole parameters get every rank's update; stage 3 units stay sharded until used."""
        gatherings = [unit.gather(unit.sharded_over(self.comm)) for unit in self.units if not unit.sharded_params]
        for gathering in gatherings:
            gathering.wait()


    # -- saved and restored with a checkpoint (the pieces: each shard's own, `OptimizerShard`) --

    def state_pieces(self) -> list[SavedPiece]:
        """Every unit's shard with the optimizer state covering it, as a rank file holds them."""
        return [piece for unit in self.units for piece in unit.optimizer_shard.state_pieces()]

    def extra_state(self) -> dict[str, Any]:
        """What ``extra.pt`` holds of the step: the param groups' options, the schedule, the scaler."""
        return {
            "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups],
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
        }

    def options_by_name(self) -> dict[str, dict[str, Any]]:
        """Each trainable parameter's param-group options (what DCP's layout saves per parameter)."""
        return {
            name: {k: v for k, v in group.items() if k != "params"}
            for group, names in zip(self.optimizer.param_groups, self.group_names) for name in names
        }

    def _saved_group_options(self, extra: dict[str, Any]) -> list[dict[str, Any] | None]:
        """The saved options of each of this optimizer's groups: the checkpoint's groups in
        order, or (options saved per parameter) those of the group's parameters, which must
        agree; None where none of a group's parameters has any."""
        by_name = extra.get("param_options")
        if by_name is None:
            return list(extra["param_groups"])
        saved: list[dict[str, Any] | None] = []
        ours = set(self.optimizer.defaults) - IMPLEMENTATION_OPTIONS
        for index, names in enumerate(self.group_names):
            found = [(name, by_name[name]) for name in names if name in by_name]
            for name, options in found[1:]:
                differing = sorted(k for k in {**options, **found[0][1]} if options.get(k) != found[0][1].get(k)
                                   and k not in IMPLEMENTATION_OPTIONS)
                if differing:
                    raise CheckpointError(
                        f"param group {index}: the checkpoint gives {found[0][0]} and {name} different options "
                        f"({', '.join(differing)}): pass param_groups as the saved run grouped them, or load with "
                        "load_optimizer_states=False"
                    )
            foreign = sorted(set(found[0][1]) - ours - IMPLEMENTATION_OPTIONS - {"initial_lr"}) if found else []
            if foreign:
                raise CheckpointError(
                    f"{found[0][0]}: the checkpoint's optimizer options {', '.join(foreign)} are not "
                    f"{type(self.optimizer).__name__}'s: saved with another optimizer; use the same optimizer.type, "
                    "or load with load_optimizer_states=False"
                )
            saved.append(found[0][1] if found else None)
        return saved

    def check_loadable(self, extra: dict[str, Any]) -> None:
        """Raise `CheckpointError` if `load_state` could not restore ``extra``'s optimizer state
        (checked with every other check of a load, before anything is restored)."""
        groups = extra["param_groups"]
        if "param_options" in extra:  # options per parameter (DCP's layout)
            if not extra["param_options"]:
                raise CheckpointError("the checkpoint holds no optimizer state (no optimizer.param_groups entries): "
                                      "load it with load_optimizer_states=False")
            self._saved_group_options(extra)
            return
        if not groups:
            raise CheckpointError(
                "the checkpoint was saved by an engine without an optimizer (a model with nothing to train: no "
                "optimizer state): load it with load_optimizer_states=False"
            )
        if len(groups) != len(self.optimizer.param_groups):
            raise CheckpointError(
                f"the checkpoint has {len(groups)} optimizer param groups, the engine {len(self.optimizer.param_groups)}:"
                " pass the same param_groups, or load with load_optimizer_states=False"
            )

    def load_state(self, saved: SavedPieces, extra: dict[str, Any], fitting: set[str]) -> None:
        """Group options, the state of every piece whose parameter fits the checkpoint (``fitting``),
        the schedule's position and the loss scaler (`check_loadable` said they fit)."""
        for group, options in zip(self.optimizer.param_groups, self._saved_group_options(extra)):
            # how to compute is this run's choice
            group.update({key: value for key, value in (options or {}).items() if key not in IMPLEMENTATION_OPTIONS})
        self.optimizer.state.clear()
        for unit in self.units:
            unit.optimizer_shard.load_state(saved, fitting)
        if self.lr_scheduler is not None and extra["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        if self.loss_scaler is not None and extra["loss_scaler"] is not None:
            # a field the checkpoint lacks (DeepSpeed's fp16 wrapper saves no hysteresis) stays this run's
            self.loss_scaler.load_state_dict({**self.loss_scaler.state_dict(), **extra["loss_scaler"]})


# Param-group options that choose torch's implementation, not the math: kept from the resuming
# run (offload picks the fused CPU kernel; a run without offload keeps torch's default).
IMPLEMENTATION_OPTIONS = frozenset({"foreach", "fused", "capturable", "differentiable"})


def _optimizer_groups(groups: list[ParamGroup], units: list[FlatUnit]) -> list[dict[str, Any]]:
    """The torch param groups over the units' optimizer targets (views of the fp32 masters:
    whole parameters at stage 0, this rank's pieces when optimizer state is sharded)."""
    per_group: list[list[torch.Tensor]] = [[] for _ in groups]
    for unit in units:
        for target in unit.optimizer_shard.targets:
            per_group[unit.group_indices[target.piece.param_index]].append(target.tensor)
    return [dict(group.options, params=tensors) for group, tensors in zip(groups, per_group)]


def _names_by_group(torch_groups: list[dict[str, Any]], units: list[FlatUnit]) -> list[list[str]]:
    """The names of each torch group's optimizer targets on this rank (a whole-matrix
    optimizer's groups are not the user's)."""
    name_of = {id(target.tensor): target.name for unit in units for target in unit.optimizer_shard.targets}
    return [list(dict.fromkeys(name_of[id(t)] for t in group["params"] if id(t) in name_of)) for group in torch_groups]


def _sum_of_squares(norms: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The squared L2 norm over every shard, in float64, on ``device``, from each shard's fp32
    norm (no copy of an fp32 gradient; the old ``grad.double().pow(2)`` made two per shard),
    summed where the norms were taken (the host, offloaded), then moved as one number."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    by_place: dict[torch.device, list[torch.Tensor]] = {}
    for norm in norms:
        by_place.setdefault(norm.device, []).append(norm)
    for place, group in by_place.items():
        squares = torch.stack(group).double().pow(2).sum()
        total = total + (squares if place == device else squares.to(device, non_blocking=True))
    return total


class NoOptimizerStep:
    """An engine whose model has no trainable parameter (a reference or reward model): no
    optimizer, schedule or loss scaler is built, whatever the config's sections say, and
    nothing steps (the engine refuses ``backward`` and ``step`` first)."""

    optimizer = None
    lr_scheduler = None
    loss_scaler = None
    grad_norm = None
    applied = False
    peak_grad_bytes = 0
    peak_matrix_bytes = 0
    loss_scale = 1.0

    def __init__(self) -> None:
        self.skipped_steps = 0

    def run(self, step_number: int) -> StepResult:
        raise RuntimeError("an engine without trainable parameters has no optimizer step")

    def state_pieces(self) -> list[SavedPiece]:
        return []

    def extra_state(self) -> dict[str, Any]:
        return {"param_groups": [], "lr_scheduler": None, "loss_scaler": None}

    def options_by_name(self) -> dict[str, dict[str, Any]]:
        return {}

    def check_loadable(self, extra: dict[str, Any]) -> None:
        """Any checkpoint's optimizer state is left (nothing here to restore it into)."""

    def load_state(self, saved: SavedPieces, extra: dict[str, Any], fitting: set[str]) -> None:
        """Nothing to restore: no optimizer, schedule or scaler."""
