"""A raw config's ``"auto"`` filled from a training framework's own settings, and the values
that disagree with them refused, all in one error (as Hugging Face's integration does for its
TrainingArguments). Each integration lists its rules (`Rule`); this fills them on a copy of the
raw mapping, before it is validated. Also what the integrations share to take over the user's
own optimizer and schedule: the optimizer rebuilt over the engine's shards (`rebuilt_optimizer`)
and the schedule moved onto it (`rebind`)."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from .. import ConfigError
from ..comm import Mesh
from ..config import optimizer_options

AUTO = "auto"


class Rule(NamedTuple):
    path: str  # dotted key in the DeepSpeed config
    value: Any  # what the framework runs with
    source: str  # which of its settings give it, for the error
    when_absent: bool  # also set the key when the config leaves it out


class Authority(NamedTuple):
    """Who the values come from, as the error names it."""

    heading: str  # "values that disagree with {heading}"
    giver: str  # "..., but {giver} {source} = {value}"
    filled_from: str  # 'Set them to "auto" (filled from {filled_from})'


def fill(raw: dict[str, Any], rules: Iterable[Rule], origin: str, authority: Authority) -> dict[str, Any]:
    """A copy of ``raw`` with the rules' ``"auto"`` (and, where a rule says, absent keys)
    filled; a `ConfigError` listing every value that disagrees with its rule."""
    config = copy.deepcopy(raw)
    mismatches = []
    for rule in rules:
        *sections, key = rule.path.split(".")
        section = _section(config, sections, create=rule.when_absent)
        if section is None or (key not in section and not rule.when_absent):
            continue
        if key not in section or section[key] == AUTO:
            section[key] = rule.value
        elif not _same(section[key], rule.value):
            mismatches.append(f"{rule.path} = {section[key]!r}, but {authority.giver} {rule.source} = {rule.value!r}")
    if mismatches:
        raise ConfigError(
            f"{origin}: values that disagree with {authority.heading}:\n- " + "\n- ".join(mismatches)
            + f'\nSet them to "auto" (filled from {authority.filled_from}) or make the two agree.'
        )
    return config


def with_stand_ins(raw: dict[str, Any], stand_ins: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``raw`` with each of these paths that still says ``"auto"`` set to its stand-in:
    a valid value, so that everything else is validated before the framework knows the real one."""
    config = copy.deepcopy(raw)
    for path, value in stand_ins.items():
        *sections, key = path.split(".")
        section = _section(config, sections, create=False)
        if section is not None and section.get(key) == AUTO:
            section[key] = value
    return config


def _section(config: dict[str, Any], names: list[str], *, create: bool) -> dict[str, Any] | None:
    for name in names:
        if not isinstance(config.get(name), dict):
            if not create or name in config:
                return None
            config[name] = {}
        config = config[name]
    return config


def _same(given: Any, expected: Any) -> bool:
    if isinstance(given, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(given) == len(expected) and all(_same(a, b) for a, b in zip(given, expected))
    if isinstance(given, bool) or isinstance(expected, bool):
        return type(given) is type(expected) and given == expected
    return given == expected


def optimizer_section(cls: Any, options: dict[str, Any], described: str) -> dict[str, Any]:
    """The config's ``optimizer`` section for a framework's optimizer: a ``torch.optim`` class
    and its keyword options (the engine builds that optimizer anew over its shards), else a
    `ConfigError` saying what ``described`` built."""
    if not (inspect.isclass(cls) and cls.__module__.startswith("torch.optim")):
        name = f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', repr(cls))}"
        raise ConfigError(
            f"{described} builds {name}; the engine builds torch.optim optimizers over its shards: choose a torch "
            "one or give the config an optimizer section"
        )
    params = {key: list(value) if isinstance(value, tuple) else value for key, value in options.items()}
    return {"type": cls.__name__, "params": params}


def rebuilt_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The config section and the param groups to build ``optimizer`` anew over the engine's
    shards: its class, its defaults and every group's options (as they are now: a schedule may
    have set the learning rate already)."""
    cls = type(optimizer)
    accepted = optimizer_options(cls)
    section = optimizer_section(cls, {k: v for k, v in optimizer.defaults.items() if k in accepted},
                                f"configure_optimizers' {cls.__name__}")
    groups = [
        {"params": group["params"], **{k: v for k, v in group.items() if k in accepted}}
        for group in optimizer.param_groups
    ]
    return section, groups


def rebind(scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """``scheduler`` (built on the optimizer ``configure_optimizers`` returned) driving the
    engine's optimizer instead: same groups in the same order, the rates it set carried over."""
    old = scheduler.optimizer
    if len(old.param_groups) != len(optimizer.param_groups):
        raise ConfigError(
            f"the scheduler's optimizer has {len(old.param_groups)} param groups, the engine's "
            f"{len(optimizer.param_groups)}: cannot carry the schedule over"
        )
    for before, after in zip(old.param_groups, optimizer.param_groups):
        for key in ("lr", "initial_lr"):
            if key in before:
                after[key] = before[key]
    scheduler.optimizer = optimizer
    return scheduler


def _asked_sequence_parallel(raw: dict[str, Any]) -> int:
    """The raw config's ``sequence_parallel_size`` when an integer above 1, else 1 (the
    config's own check names a bad value)."""
    size = raw.get("sequence_parallel_size", 1)
    return size if isinstance(size, int) and size > 1 else 1


def sequence_parallel_size(raw: dict[str, Any], processes: int) -> int:
    """The config's ``sequence_parallel_size`` (1 unless an integer above 1), a `ConfigError`
    when it does not divide the framework's processes: the data-parallel ranks are processes / it."""
    size = _asked_sequence_parallel(raw)
    if processes % size:
        raise ConfigError(
            f"sequence_parallel_size = {size} does not divide the number of processes, {processes}: each sequence "
            f"group is {size} consecutive ranks"
        )
    return size


def shard_over_data_ranks(loader: Any, processes: int, rank: int, k: int, framework: str) -> Any:
    """An Accelerate-prepared loader (``BatchSamplerShard``: each rank its share of each batch
    of indices) sharded over the data-parallel ranks instead of every rank, so that the ``k``
    ranks of a sequence group read the same batches (rank // k of world / k), as Accelerate's
    own loader does under its parallelism config, and as it reads them at ``k = 1`` on world /
    k ranks (one data-parallel rank: the last batch short, not padded). Other loaders (iterable
    datasets, dispatched batches) are refused by name."""
    if k == 1:
        return loader
    shard = getattr(loader, "batch_sampler", None)
    if not (hasattr(shard, "num_processes") and hasattr(shard, "process_index")):
        raise NotImplementedError(
            f"sequence_parallel_size = {k} through {framework}: the training loader ({type(loader).__name__}) does "
            "not shard a map-style dataset's batches over ranks (an iterable dataset, or dispatched batches), so the "
            "ranks of a sequence group cannot be given the same batches; use a map-style dataset"
        )
    shard.process_index, shard.num_processes = data_parallel_place(processes, rank, k)
    if shard.num_processes == 1:  # one data-parallel rank: as Accelerate's own loader of one process, no padding
        shard.even_batches = False  # of the last batch with samples from the start
    return loader


def data_parallel_place(processes: int, rank: int, k: int) -> tuple[int, int]:
    """Which data-parallel rank global ``rank`` is under ``sequence_parallel_size: k``, and of
    how many."""
    mesh = Mesh.for_world(processes, processes, sequence=k)  # the shard group size does not matter here
    return mesh.rank_in("batch", rank), mesh.batch


LOADER_REASON = "its data loader would give each rank of a sequence group a different batch"


def refuse_sequence_parallel(raw: dict[str, Any], framework: str, reason: str = LOADER_REASON) -> None:
    """``sequence_parallel_size`` above 1 where the framework cannot honour it yet (by default:
    its data loader does not know that the ranks of a sequence group read the same
    micro-batches): refused by name, never trained otherwise."""
    size = _asked_sequence_parallel(raw)
    if size > 1:
        raise NotImplementedError(
            f"sequence_parallel_size = {size} through {framework} is not wired yet: {reason}. Use Hugging Face's "
            "Trainer (ZeroEngineTrainer, TRL's SFTTrainer on it), zero_engine's Accelerator, or zero_engine.initialize "
            "in your own loop (each rank reads the micro-batches of engine.data_parallel_rank of "
            "engine.data_parallel_world_size)"
        )
