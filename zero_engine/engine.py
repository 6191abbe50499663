"""The training-loop surface: forward, backward, step, and reports.

The engine owns no offset arithmetic and no collective calls of its own: units (`FlatUnit`)
hold the flat buffers, the `GradReducer` reduces gradients during backward, and the stage
(`Stage`) says what is sharded. ``step()`` runs in four phases on accumulation boundaries:
agree on which parameters were used and on the gradient norm, clip, update this rank's part,
and gather the updated parameters when the optimizer state is sharded.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from . import checkpoint
from .comm import Comm, connect
from .config import BatchSizes, ZeroEngineConfig, load_config
from .features import refuse_unbuilt_features
from .flat_param import FlatUnit
from .layout import plan_units
from .memory import MemoryReport, measure_memory
from .optim import build_optimizer, check_optimizer_for_stage
from .param_groups import ParamGroup, resolve_param_groups
from .stages import Stage, build_reducer, stage_for


class OptimizerTarget(NamedTuple):
    """A tensor the optimizer steps: a whole parameter (stage 0) or this rank's piece of one."""

    tensor: torch.Tensor
    grad: torch.Tensor  # the gradient view it reads
    param_index: int  # across all units, as in the reducer's used-mask
    name: str  # the parameter's name
    param_offset: int  # where the tensor starts in the flattened parameter


def initialize(
    model: nn.Module,
    config: str | Path | dict[str, Any] | ZeroEngineConfig,
    *,
    param_groups: Iterable[Any] | None = None,
) -> Engine:
    """Wrap ``model`` for ZeRO training as ``config`` (path, dict or `ZeroEngineConfig`) says.

    Starts a process group from torchrun's environment if none exists (world size 1 without
    one), broadcasts rank 0's parameters and buffers, and checks everything that could fail
    later: unbuilt features, the optimizer for the stage, the batch arithmetic.
    """
    config = load_config(config)
    refuse_unbuilt_features(config)
    stage = stage_for(config.zero_optimization.stage)
    optimizer_cls = check_optimizer_for_stage(config.optimizer, stage.level)
    groups = resolve_param_groups(model, param_groups, optimizer_cls)
    _check_params(model)
    comm = connect(config.comm, _model_device(model))
    batch = config.batch_sizes(comm.world_size)
    return Engine(model, config, comm, stage, batch, groups)


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
    ) -> None:
        self.module = model
        self.config = config
        self.comm = comm
        self.stage = stage
        self.batch = batch
        self.global_step = 0
        self.micro_steps = 0
        self._window_opened = False
        self._global_grad_norm: float | None = None
        zero = config.zero_optimization
        self.units = _build_units(model, groups, comm, zero.reduce_bucket_size, not stage.streams_gradients(zero))
        self._sync_from_rank0()
        self.reducer = build_reducer(stage, self.units, comm, zero)
        self.optimizer_targets, optimizer_groups = self._plan_optimizer_targets(groups)
        self.optimizer = build_optimizer(config.optimizer, stage.level, optimizer_groups)

    # -- construction --------------------------------------------------------------------------

    def _plan_optimizer_targets(self, groups: list[ParamGroup]) -> tuple[list[OptimizerTarget], list[dict[str, Any]]]:
        """What the optimizer steps: whole parameters (stage 0) or this rank's pieces."""
        targets: list[OptimizerTarget] = []
        per_group: list[list[torch.Tensor]] = [[] for _ in groups]
        first_index = 0
        for unit in self.units:
            if self.stage.shard_optimizer_state:
                for segment in unit.segments():
                    piece = segment.piece
                    targets.append(OptimizerTarget(
                        segment.tensor, segment.grad, first_index + piece.param_index, segment.name, piece.param_offset
                    ))
                    per_group[unit.group_index].append(segment.tensor)
            else:
                for index, param in enumerate(unit.params):
                    targets.append(OptimizerTarget(param, unit.grad_view(index), first_index + index, unit.names[index], 0))
                    per_group[unit.group_index].append(param)
            first_index += len(unit.params)
        return targets, [dict(group.options, params=tensors) for group, tensors in zip(groups, per_group)]

    def _sync_from_rank0(self) -> None:
        """Every rank starts from rank 0's parameters and buffers."""
        in_units = {param for unit in self.units for param in unit.params}
        tensors = [unit.flat_param for unit in self.units]
        tensors += [p.data for p in self.module.parameters() if p not in in_units]
        tensors += list(self.module.buffers())
        self.comm.broadcast(tensors, src=0)

    # -- the training loop -----------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._open_window()
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss / gradient_accumulation_steps``; reduces on boundaries."""
        self._open_window()
        self.reducer.pre_backward(boundary=self.is_gradient_accumulation_boundary())
        (loss / self.batch.gradient_accumulation_steps).backward()
        self.reducer.post_backward()

    def step(self) -> None:
        """Call after every micro-batch; updates only on accumulation boundaries."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        used, norm = self._agree_on_used_params_and_norm()
        self._global_grad_norm = norm
        self._clip_gradients(norm)
        self._update(used)
        if self.stage.shard_optimizer_state:
            self._gather_params()
        self._zero_grads()
        self.global_step += 1
        self._window_opened = False

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch is the last of its accumulation window."""
        return (self.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0

    # -- the phases of step() --------------------------------------------------------------------

    def _agree_on_used_params_and_norm(self) -> tuple[torch.Tensor, float]:
        """One small all-reduce: which parameters got a gradient on any rank, and the squared
        gradient norm summed over every rank's shard (identical on every rank)."""
        squares = sum(
            (unit.sharded_grad.double().pow(2).sum() for unit in self.units), torch.zeros((), dtype=torch.float64)
        )
        packed = torch.cat([self.reducer.used.double(), squares.view(1)])
        self.comm.all_reduce_sum(packed).wait()
        return packed[:-1] > 0, packed[-1].sqrt().item()

    def _clip_gradients(self, norm: float) -> None:
        """As ``torch.nn.utils.clip_grad_norm_``: scale by max_norm / (norm + 1e-6) when below 1."""
        max_norm = self.config.gradient_clipping
        if max_norm <= 0:
            return
        coefficient = max_norm / (norm + 1e-6)
        if coefficient < 1.0:
            for unit in self.units:
                self.reducer.kept_grad(unit).mul_(coefficient)

    def _update(self, used: torch.Tensor) -> None:
        """Step the optimizer; a parameter no rank used keeps its values and its state."""
        for target in self.optimizer_targets:
            target.tensor.grad = target.grad if used[target.param_index] else None
        self.optimizer.step()
        for target in self.optimizer_targets:
            target.tensor.grad = target.grad

    def _gather_params(self) -> None:
        pending = [self.comm.all_gather(unit.flat_param) for unit in self.units]
        for handle in pending:
            handle.wait()

    def _zero_grads(self) -> None:
        self.reducer.zero_grads()
        self.reducer.reset_used()
        in_units = {param for unit in self.units for param in unit.params}
        for param in self.module.parameters():
            if param not in in_units:
                param.grad = None

    def _open_window(self) -> None:
        """The communication report covers one optimizer step, from its first micro-batch."""
        if not self._window_opened:
            self.comm.reset_report()
            self._window_opened = True

    # -- module state and reports ----------------------------------------------------------------

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The complete module state on CPU (parameters in fp32), same keys as ``state_dict()``."""
        param_names = {name for name, _ in self.module.named_parameters(remove_duplicate=False)}
        return {
            name: tensor.detach().to("cpu", torch.float32 if name in param_names else tensor.dtype, copy=True)
            for name, tensor in self.module.state_dict().items()
        }

    def memory_report(self) -> dict[str, int]:
        """Bytes of model state this rank holds (see `zero_engine.memory.MemoryReport`)."""
        return measure_memory(self.module, self.units, self.optimizer, self.reducer)._asdict()

    def comm_report(self) -> dict[str, dict[str, int]]:
        """Bytes this rank sent and received per collective kind in the current optimizer step."""
        return self.comm.report()

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The L2 norm of the whole averaged gradient at the last optimizer step."""
        return self._global_grad_norm

    def save_checkpoint(self, directory: str | Path, tag: str | None = None, client_state: Any = None) -> Path:
        """Save everything needed to resume, at any stage and world size (collective).

        ``tag`` defaults to ``global_step{N}``; ``client_state`` is anything
        ``torch.load(weights_only=True)`` can read back (tensors, numbers, strings, containers).
        """
        return checkpoint.save(self, directory, tag, client_state)

    def load_checkpoint(
        self,
        directory: str | Path,
        tag: str | None = None,
        *,
        strict: bool = True,
        load_optimizer_states: bool = True,
    ) -> Any:
        """Resume from ``directory`` (tag: the latest); returns the saved ``client_state``."""
        return checkpoint.load(
            self, directory, tag, strict=strict, load_optimizer_states=load_optimizer_states
        )

    def close(self) -> None:
        """Remove the engine's gradient hooks from the model's parameters."""
        self.reducer.remove_hooks()


def _build_units(
    model: nn.Module, groups: list[ParamGroup], comm: Comm, max_unit_numel: int, full_grads: bool
) -> list[FlatUnit]:
    """Flat units per param group, listed in expected gradient-arrival order (reverse
    registration, as backward produces them) so the reducer launches them as they fill."""
    position = {param: index for index, param in enumerate(model.parameters())}
    keyed: list[tuple[int, FlatUnit]] = []
    for group_index, group in enumerate(groups):
        pairs = sorted(zip(group.names, group.params), key=lambda pair: position[pair[1]], reverse=True)
        for indices in plan_units([param.numel() for _, param in pairs], max_unit_numel):
            params, names = [pairs[i][1] for i in indices], [pairs[i][0] for i in indices]
            unit = FlatUnit(params, names, group_index, comm.rank, comm.world_size, full_grads=full_grads)
            keyed.append((min(position[p] for p in unit.params), unit))
    keyed.sort(key=lambda item: item[0], reverse=True)
    return [unit for _, unit in keyed]


def _model_device(model: nn.Module) -> torch.device:
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _check_params(model: nn.Module) -> None:
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are on several devices {sorted(map(str, devices))}; move it to one")
    for name, param in model.named_parameters():
        if param.requires_grad and param.dtype != torch.float32:
            raise NotImplementedError(
                f"parameter {name!r} is {param.dtype}: trainable parameters must be float32 "
                "(bf16/fp16 compute comes through the fp16/bf16 config sections)"
            )
