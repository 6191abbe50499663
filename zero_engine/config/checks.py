"""Checks of the optimizer and scheduler sections: the class by name, its keywords by
signature, its numbers by range (the scheduler's also by a dry run at `initialize`)."""

from __future__ import annotations

import inspect
import math
from typing import Any, Protocol

import torch

from ..errors import suggest
from ..muon import MuonWithAdamW, check_choices
from ..optimizer_kinds import table_classes
from ..schedules import check_schedule_param, check_schedule_params, scheduler_class
from ..values import check_value_type


class _Section(Protocol):
    """What the checks read of the optimizer and scheduler sections (which call them from their
    validators)."""

    type: str
    params: dict[str, Any]


_ENGINE_OWNED_OPTIMIZER_ARGS = {"params", "self"}
_NON_NEGATIVE = {
    "lr", "muon_lr", "adam_lr", "weight_decay", "momentum", "dampening", "lr_decay", "alpha", "lambd", "momentum_decay",
}
_POSITIVE = {"eps", "ns_eps"}
# Switches whose default is None (the implementation picks): true, false or null.
_OPTIONAL_FLAGS = {"foreach", "fused", "capturable", "differentiable", "maximize"}


def optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """Every torch.optim optimizer, by lower-case class name, and those the optimizer table
    names itself (`zero_engine.optimizer_kinds`): ``muon`` is DeepSpeed's meaning of the name
    (Muon for the matrices, AdamW for the rest: `zero_engine.muon`)."""
    classes = {
        name.lower(): cls
        for name, cls in vars(torch.optim).items()
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer
    }
    return {**classes, **table_classes()}


# DeepSpeed's own optimizers, and the nearest torch.optim one to use instead.
DEEPSPEED_OPTIMIZERS = {
    "lamb": "LAMB's layer-wise trust ratio is not in torch.optim; the nearest is AdamW (lower the learning rate)",
    "onebitadam": "1-bit Adam compresses its communication, which is not built; AdamW is the same update",
    "zerooneadam": "0/1 Adam compresses its communication, which is not built; AdamW is the same update",
    "onebitlamb": "1-bit LAMB is not built; the nearest is AdamW",
    "lion": "Lion is not in torch.optim; the nearest is AdamW",
    "muadam": "MuAdam (muP) is not built; use AdamW with per-group learning rates (param_groups)",
    "muadamw": "MuAdamW (muP) is not built; use AdamW with per-group learning rates (param_groups)",
    "musgd": "MuSGD (muP) is not built; use SGD with per-group learning rates (param_groups)",
}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    classes = optimizer_classes()
    try:
        return classes[name.lower()]
    except KeyError:
        if name.lower() in DEEPSPEED_OPTIMIZERS:
            raise ValueError(f"optimizer.type = {name!r} is DeepSpeed's own: {DEEPSPEED_OPTIMIZERS[name.lower()]}") from None
        known = sorted(cls.__name__ for cls in classes.values())
        raise ValueError(f"optimizer.type = {name!r} is not a torch.optim optimizer{suggest(name, known)}") from None


def optimizer_options(cls: type[torch.optim.Optimizer]) -> frozenset[str]:
    """The keywords an optimizer class takes besides its parameters: what a param group may set."""
    return frozenset(inspect.signature(cls.__init__).parameters) - {"self", "params"}


def check_optimizer(section: _Section) -> None:
    cls = optimizer_class(section.type)
    signature = inspect.signature(cls.__init__).parameters
    accepted = [k for k in signature if k not in _ENGINE_OWNED_OPTIMIZER_ARGS]
    for key, value in section.params.items():
        path = f"optimizer.params.{key}"
        if key not in accepted:
            raise ValueError(
                f"{path} = {value!r}: {cls.__name__} takes no keyword {key!r}{suggest(key, accepted)}"
            )
        default = signature[key].default
        if isinstance(default, int) and not isinstance(default, bool):
            default = float(default)  # an optimizer's numbers are real (momentum=0 takes 0.9)
        section.params[key] = check_value_type(path, value, default, flag=key in _OPTIONAL_FLAGS)
        if key in _NON_NEGATIVE | _POSITIVE:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{path} = {value!r}: must be a finite number")
            if value < 0 or (key in _POSITIVE and value == 0):
                raise ValueError(f"{path} = {value!r}: must be {'positive' if key in _POSITIVE else 'non-negative'}")
        if key == "betas":
            if not (
                isinstance(value, (list, tuple))
                and len(value) == 2
                and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value)
            ):
                raise ValueError(f"{path} = {value!r}: must be two numbers in [0, 1)")
    if cls is MuonWithAdamW:
        params = section.params
        momentum = params.get("momentum", 0.95)
        if not 0 <= momentum < 1:  # an average of past updates (buffer.lerp_(grad, 1 - momentum)): above 1 it grows
            raise ValueError(
                f"optimizer.params.momentum = {momentum!r}: Muon's momentum must be in [0, 1) (the weight of the past "
                "updates in its running average, as torch's and DeepSpeed's Muon take it)"
            )
        check_choices(params.get("ns_method", "standard"), params.get("ns_dtype", "fp32"), params.get("adjust_lr_fn"))
        coefficients = params.get("ns_coefficients", (1, 1, 1))
        if not (isinstance(coefficients, (list, tuple)) and len(coefficients) == 3
                and all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in coefficients)):
            raise ValueError(f"optimizer.params.ns_coefficients = {coefficients!r}: must be three numbers")


def check_scheduler(section: _Section) -> None:
    """The scheduler exists and takes these keywords (the optimizer is supplied by the engine),
    each of the right kind and range; counts written as ``1e4`` (a string in YAML) become
    integers. `zero_engine.schedules.dry_run` then runs it at `initialize`."""
    cls = scheduler_class(section.type)
    signature = inspect.signature(cls.__init__).parameters
    accepted = [k for k in signature if k not in ("self", "optimizer")]
    for key in accepted:
        if signature[key].default is inspect.Parameter.empty and key not in section.params:
            raise ValueError(f"scheduler.params.{key}: required by {cls.__name__}")
    for key, value in section.params.items():
        path = f"scheduler.params.{key}"
        if key not in accepted:
            raise ValueError(f"{path} = {value!r}: {cls.__name__} takes no keyword {key!r}{suggest(key, accepted)}")
        section.params[key] = check_schedule_param(path, key, value, signature[key].default)
    check_schedule_params(cls.__name__, section.params)
