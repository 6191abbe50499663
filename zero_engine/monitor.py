"""DeepSpeed's monitor sections (``csv_monitor``, ``tensorboard``, ``wandb``, ``comet``): the
training events, with DeepSpeed's names, written on rank 0 at every optimizer step.

Events are ``(name, value, samples seen)``, as DeepSpeed writes them: ``Train/Samples/train_loss``
(rank 0's mean loss over the window, as given to ``engine.backward``), ``Train/Samples/lr``
(the first param group's), ``Train/Samples/loss_scale`` (fp16), and ``Train/Samples/grad_norm``
(the global gradient norm, which Hugging Face users see in their logs). Samples seen are
optimizer steps x ``train_batch_size``. The loss's value is read back once per step, only
when a monitor is on.

The files land where DeepSpeed puts them: ``output_path/job_name/`` (an empty ``output_path``:
``~/tensorboard`` or ``~/csv_monitor``); CSV files are named after the event with ``/`` as
``_``, with a ``step,<event>`` header. wandb and comet are used when their package is installed;
switched on without it, `initialize` fails naming the section and the package.
"""

from __future__ import annotations

import csv
import importlib
from pathlib import Path
from typing import Any, Protocol

from .config import ZeroEngineConfig
from .errors import ConfigError

Event = tuple[str, float, int]  # name, value, samples seen
# Sections that need a package: the module to import, the package to install.
_PACKAGES = {
    "tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
    "comet": ("comet_ml", "comet_ml"),
}


class MonitorWriter(Protocol):
    def write(self, events: list[Event]) -> None: ...

    def close(self) -> None: ...


class CsvWriter:
    """One CSV file per event, rows appended as they come."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def write(self, events: list[Event]) -> None:
        for name, value, samples in events:
            path = self.directory / (name.replace("/", "_") + ".csv")
            new = not path.exists()
            with path.open("a", newline="") as handle:
                rows = csv.writer(handle)
                if new:
                    rows.writerow(["step", name])
                rows.writerow([samples, value])

    def close(self) -> None:
        pass


class TensorBoardWriter:
    def __init__(self, directory: Path) -> None:
        writer = _import("tensorboard")
        self.writer = writer.SummaryWriter(log_dir=str(directory))

    def write(self, events: list[Event]) -> None:
        for name, value, samples in events:
            self.writer.add_scalar(name, value, samples)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    def __init__(self, section: Any) -> None:
        self.wandb = _import("wandb")
        self.wandb.init(project=section.project, group=section.group, entity=section.team)

    def write(self, events: list[Event]) -> None:
        for name, value, samples in events:
            self.wandb.log({name: value}, step=samples)

    def close(self) -> None:
        pass


class CometWriter:
    def __init__(self, section: Any) -> None:
        comet_ml = _import("comet")
        options = {
            key: getattr(section, key)
            for key in ("project", "workspace", "api_key", "experiment_key", "online", "mode")
            if getattr(section, key) is not None
        }
        self.experiment = comet_ml.start(**options)
        if section.experiment_name:
            self.experiment.set_name(section.experiment_name)
        self.interval = section.samples_log_interval
        self._next = 0

    def write(self, events: list[Event]) -> None:
        samples = events[0][2] if events else 0
        if samples < self._next:
            return
        self._next = samples + self.interval
        for name, value, step in events:
            self.experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        self.experiment.end()


def check_monitor_packages(config: ZeroEngineConfig) -> None:
    """Fail at initialize, on every rank, when a monitor is on and its package is missing."""
    for section in _PACKAGES:
        value = getattr(config, section)
        if value is not None and value.enabled:
            _import(section)


def build_monitors(config: ZeroEngineConfig) -> list[MonitorWriter]:
    """The writers the config switches on (call on rank 0 only)."""
    writers: list[MonitorWriter] = []
    for section, default_base, make in (
        ("csv_monitor", "csv_monitor", CsvWriter), ("tensorboard", "tensorboard", TensorBoardWriter),
    ):
        value = getattr(config, section)
        if value is not None and value.enabled:
            base = Path(value.output_path) if value.output_path else Path.home() / default_base
            writers.append(make(base / value.job_name))
    if config.wandb is not None and config.wandb.enabled:
        writers.append(WandbWriter(config.wandb))
    if config.comet is not None and config.comet.enabled:
        writers.append(CometWriter(config.comet))
    return writers


class StepLog:
    """A step's events for the monitor writers (rank 0; none elsewhere): the losses given to
    backward over the window, summed on the device and read back once, at the step."""

    def __init__(self, writers: list[MonitorWriter]) -> None:
        self.writers = writers
        self._loss: Any = None  # the window's summed loss, a device tensor
        self._backwards = 0

    def add_loss(self, loss: Any) -> None:
        if self.writers:
            value = loss.detach().float().reshape(())
            self._loss = value if self._loss is None else self._loss + value
            self._backwards += 1

    def write_step(self, samples: int, lr: float, grad_norm: float | None, loss_scale: float | None) -> None:
        """The step's events, DeepSpeed's names, against ``samples`` seen."""
        if not self.writers:
            return
        events: list[Event] = [("Train/Samples/lr", lr, samples)]
        if self._loss is not None:
            events.insert(0, ("Train/Samples/train_loss", self._loss.item() / self._backwards, samples))
        if grad_norm is not None:
            events.append(("Train/Samples/grad_norm", grad_norm, samples))
        if loss_scale is not None:
            events.append(("Train/Samples/loss_scale", loss_scale, samples))
        for writer in self.writers:
            writer.write(events)
        self._loss, self._backwards = None, 0

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []


def _import(section: str) -> Any:
    """The module the ``section`` writes through; a `ConfigError` naming the package if missing."""
    module, package = _PACKAGES[section]
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(
            f"{section}.enabled = true needs the {package} package, which does not import ({err}): pip install "
            f"{package}, or switch {section} off"
        ) from None
