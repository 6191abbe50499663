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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .config import CometConfig, CsvMonitorConfig, TensorBoardConfig, WandbConfig, ZeroEngineConfig
from .errors import ConfigError

Event = tuple[str, float, int]  # name, value, samples seen
# Sections that need a package: the module to import, the package to install.
_PACKAGES = {
    "tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
    "comet": ("comet_ml", "comet_ml"),
}

_COMET_START = ("project", "workspace", "api_key", "experiment_key", "online", "mode")  # comet_ml.start's


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
    def __init__(self, project: str | None, group: str | None, entity: str | None) -> None:
        self.wandb = _import("wandb")
        self.wandb.init(project=project, group=group, entity=entity)

    def write(self, events: list[Event]) -> None:
        for name, value, samples in events:
            self.wandb.log({name: value}, step=samples)

    def close(self) -> None:
        pass


class CometWriter:
    def __init__(self, options: dict[str, Any], experiment_name: str | None, samples_log_interval: int) -> None:
        comet_ml = _import("comet")
        self.experiment = comet_ml.start(**options)
        if experiment_name:
            self.experiment.set_name(experiment_name)
        self.interval = samples_log_interval
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


MonitorSection = TensorBoardConfig | CsvMonitorConfig | WandbConfig | CometConfig


@dataclass(frozen=True)
class Monitors:
    """The monitor sections switched on, by name, in the order their writers are made."""

    sections: tuple[tuple[str, MonitorSection], ...] = ()

    @classmethod
    def from_config(cls, config: ZeroEngineConfig) -> Monitors:
        """The sections on, each package checked here: at initialize, on every rank, a section
        switched on without its package fails (`ConfigError`)."""
        names = ("csv_monitor", "tensorboard", "wandb", "comet")
        sections = tuple(
            (name, section) for name in names if (section := getattr(config, name)) is not None and section.enabled
        )
        for name, _ in sections:
            if name in _PACKAGES:
                _import(name)
        return cls(sections)

    def writers(self) -> list[MonitorWriter]:
        """The sections' writers (call on rank 0 only)."""
        writers: list[MonitorWriter] = []
        for name, section in self.sections:
            if isinstance(section, (CsvMonitorConfig, TensorBoardConfig)):
                base = Path(section.output_path) if section.output_path else Path.home() / name
                writers.append((CsvWriter if name == "csv_monitor" else TensorBoardWriter)(base / section.job_name))
            elif isinstance(section, WandbConfig):
                writers.append(WandbWriter(section.project, section.group, section.team))
            else:
                options = {key: getattr(section, key) for key in _COMET_START if getattr(section, key) is not None}
                writers.append(CometWriter(options, section.experiment_name, section.samples_log_interval))
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
