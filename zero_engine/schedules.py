"""Learning-rate schedules: DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, or any
``torch.optim.lr_scheduler`` class by name. The engine steps the schedule once per optimizer
step (never per micro-step, never on a skipped fp16 step), as DeepSpeed's engine does.

The DeepSpeed schedules follow DeepSpeed 0.19.8 step for step, including where it starts: a
schedule's iteration ``i`` is -1 when it is made and grows by one at each applied optimizer
step, so optimizer step ``t`` (counting applied steps from 0) uses the rate of ``i = t - 1``.
At ``i = -1`` WarmupLR and WarmupDecayLR give ``warmup_min_lr`` and WarmupCosineLR gives 0:
the first two steps of a warm-up from 0 both use 0. From ``i = 0``:

- WarmupLR: ``min + (max - min) * g(i)`` during warm-up, then ``max``, where ``g`` is
  ``log(i + 1) / log(warmup_num_steps)`` (``warmup_type: log``) or ``i / warmup_num_steps``
  (``linear``); ``warmup_max_lr`` unset takes each group's learning rate.
- WarmupDecayLR: the same warm-up, then ``min + (max - min) * (total - i) / (total - warmup)``,
  down to ``min``.
- WarmupCosineLR: a ratio of each group's initial rate: warm-up from ``warmup_min_ratio`` to
  1, then ``cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2`` with
  ``p = min(1, (i - warmup + 1) / (total - warmup))``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from .errors import ConfigError, suggest
from .values import as_count, check_value_type, is_finite_number


class _DeepSpeedSchedule:
    """Common machinery: DeepSpeed's iteration counter (-1 before the first optimizer step)
    and per-group rates computed from it."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, warmup_num_steps: int, warmup_type: str, last_batch_iteration: int
    ) -> None:
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"scheduler.params.warmup_type = {warmup_type!r}: must be 'log' or 'linear'")
        self.optimizer = optimizer
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:  # as DeepSpeed: a schedule made mid-run leaves the rates until its step
            self._apply()

    def _warmup(self, i: int) -> float:
        if self.warmup_type == "log":
            return math.log(i + 1) / math.log(self.warmup_num_steps)
        return i / self.warmup_num_steps

    def rates(self, i: int) -> list[float]:
        raise NotImplementedError

    def _apply(self) -> None:
        for group, rate in zip(self.optimizer.param_groups, self.rates(self.last_batch_iteration)):
            group["lr"] = rate

    def step(self) -> None:
        self.last_batch_iteration += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply()


def _per_group(optimizer: torch.optim.Optimizer, value: float | list[float], name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"scheduler.params.{name}: {len(value)} values for {len(optimizer.param_groups)} groups")
        return [float(v) for v in value]
    return [float(value)] * len(optimizer.param_groups)


class WarmupLR(_DeepSpeedSchedule):
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if warmup_max_lr is None:  # DeepSpeed's default: each group's own rate
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)

    def gamma(self, i: int) -> float:
        return self._warmup(i) if i < self.warmup_num_steps else 1.0

    def rates(self, i: int) -> list[float]:
        if i < 0:  # before the first step (DeepSpeed warns and gives the minimum)
            return list(self.min_lrs)
        gamma = self.gamma(i)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def gamma(self, i: int) -> float:
        if i < self.warmup_num_steps:
            return self._warmup(i)
        return max(0.0, (self.total_num_steps - i) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_DeepSpeedSchedule):
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)

    def ratio(self, i: int) -> float:
        if i < 0:  # before the first step: DeepSpeed gives 0
            return 0.0
        if i < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup(i) * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (i - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def rates(self, i: int) -> list[float]:
        return [base * self.ratio(i) for base in self.base_lrs]


DEEPSPEED_SCHEDULES: dict[str, type] = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR)}
# Need a metric or are not step-based; the engine cannot drive them.
UNSUPPORTED = {"ReduceLROnPlateau", "LRScheduler"}


def scheduler_class(name: str) -> type:
    """A DeepSpeed schedule or a torch.optim.lr_scheduler class, case-insensitively."""
    known = dict(DEEPSPEED_SCHEDULES)
    known.update(
        {
            cls_name: cls
            for cls_name, cls in vars(torch.optim.lr_scheduler).items()
            if isinstance(cls, type) and issubclass(cls, LRScheduler) and cls_name not in UNSUPPORTED
        }
    )
    by_lower = {key.lower(): cls for key, cls in known.items()}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    extra = " (it needs a metric the engine does not have)" if name == "ReduceLROnPlateau" else ""
    raise ValueError(f"scheduler.type = {name!r} is not a supported schedule{extra}{suggest(name, sorted(known))}")


def build_scheduler(name: str, params: dict[str, Any], optimizer: torch.optim.Optimizer) -> Any:
    """The schedule ``scheduler.type`` names, with ``scheduler.params``, over ``optimizer``."""
    return scheduler_class(name)(optimizer, **params)


# ---------------------------------------------------------------------------------------------
# Checks: at load (kinds and ranges of the parameters) and at initialize (a dry run).

_COUNTS = {"warmup_num_steps", "total_num_steps"}
_ITERATIONS = {"last_batch_iteration"}  # -1 (not started) or an iteration reached
_RATES = {"warmup_min_lr", "warmup_max_lr"}  # a number, or one per param group
_RATIOS = {"warmup_min_ratio", "cos_min_ratio"}
DRY_RUN_STEPS = 1000


def check_schedule_param(path: str, key: str, value: Any, default: Any) -> Any:
    """One keyword of a schedule, of the kind its default has (DeepSpeed's by name); returns
    it, counts as integers."""
    if key in _COUNTS:
        count = as_count(value)
        if count is None or count < (1 if key == "total_num_steps" else 0):
            least = "a positive" if key == "total_num_steps" else "a non-negative"
            raise ValueError(f"{path} = {value!r}: must be {least} integer")
        return count
    if key in _ITERATIONS:
        iteration = as_count(value)
        if iteration is None or iteration < -1:
            raise ValueError(f"{path} = {value!r}: must be -1 (a new schedule) or the iteration to resume from")
        return iteration
    if key in _RATES:
        if value is None and key == "warmup_max_lr":  # DeepSpeed's WarmupLR: each group's own rate
            return value
        values = value if isinstance(value, (list, tuple)) else [value]
        if not values or not all(is_finite_number(v) and v >= 0 for v in values):
            raise ValueError(f"{path} = {value!r}: must be a non-negative number, or a list of them (one per group)")
        return value
    if key in _RATIOS:
        if not (is_finite_number(value) and 0 <= value <= 1):
            raise ValueError(f"{path} = {value!r}: must be a number in [0, 1]")
        return value
    if key == "warmup_type" and value not in ("log", "linear"):
        raise ValueError(f"{path} = {value!r}: must be 'log' or 'linear'")
    return check_value_type(path, value, default)


def check_schedule_params(name: str, params: dict[str, Any]) -> None:
    """What one keyword alone cannot say: a decay must end after its warm-up (else the rate is 0
    for ever, or alternates)."""
    if name in ("WarmupDecayLR", "WarmupCosineLR"):
        total, warmup = params["total_num_steps"], params.get("warmup_num_steps", 1000)
        if total <= warmup:
            raise ValueError(
                f"scheduler.params.total_num_steps = {total} must exceed warmup_num_steps = {warmup}"
                f"{'' if 'warmup_num_steps' in params else ' (the default)'}: the decay runs between them"
            )


def dry_run(name: str, params: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Run the schedule ahead on a stand-in optimizer with the same groups: a rate that is not a
    finite non-negative number, or an error from the schedule (``StepLR`` with ``step_size`` 0
    divides by zero at its first step), fails `initialize` naming the schedule, not step 1000."""
    stand_in = torch.optim.SGD([{"params": [torch.zeros(1, device="cpu")], "lr": g["lr"]} for g in optimizer.param_groups])
    label = f"scheduler {name} with params {params}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            schedule = build_scheduler(name, params, stand_in)
            for step in range(DRY_RUN_STEPS):
                _check_rates(label, step, [group["lr"] for group in stand_in.param_groups])
                stand_in.step()
                schedule.step()
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 (whatever the schedule raises, named with it)
        raise ConfigError(f"{label} fails when run: {type(err).__name__}: {err}") from None


def _check_rates(label: str, step: int, rates: list[Any]) -> None:
    for rate in rates:
        if not (is_finite_number(float(rate)) and rate >= 0):
            raise ConfigError(f"{label} gives a learning rate of {rate} at optimizer step {step}")
