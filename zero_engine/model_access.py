"""The model's weights and state, out of the engine and back in: the engine's methods that are
not the training loop (`zero_engine.engine`). The full state dict, parameters gathered for a
while (`zero_engine.state.gathered`), the model streamed one bucket at a time
(`zero_engine.state.streaming`), Hugging Face's layout, checkpoints, and the memory and
communication reports. Each is collective where the state is sharded, and starts with a call
row (`Call`), so a call made on some ranks only raises on every rank instead of hanging."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import offload
from .memory import measure_memory
from .values import check_switch
from .sharding.gathering.agreement import Call
from .state import checkpoint, export, formats, streaming
from .state.adapters import AdapterMerge
from .state.gathered import GatheredParameters

if TYPE_CHECKING:
    from .accumulation import AccumulationWindow
    from .comm import Comm
    from .config import BatchSizes, ZeroEngineConfig
    from .engine_settings import EngineSettings
    from .offload import OffloadPlan
    from .sharding.gathering.calls import CallGuard, PassCallGuard
    from .sharding.shards.codec import Codecs
    from .sharding.tiers.held import Holdings
    from .sharding.units.frozen_unit import FrozenUnit
    from .sharding.gathering.gatherer import NoGather
    from .sharding.reduction.reducer import GradReducer
    from .sharding.units.unit import FlatUnit
    from .stage import Stage
    from .state.state_dict import ModelState
    from .state.storage import FileWriter
    from .step import NoOptimizerStep, OptimizerStep


class ModelAccess:
    """A mixin of `zero_engine.engine.Engine`: what it reads and writes of the model's state.
    The attributes below are the engine's."""

    module: nn.Module
    model_state: ModelState
    units: list[FlatUnit]
    frozen_units: list[FrozenUnit]
    comm: Comm
    calls: CallGuard | PassCallGuard
    gatherer: NoGather
    reducer: GradReducer
    codecs: Codecs
    optimizer_step: OptimizerStep | NoOptimizerStep
    optimizer: torch.optim.Optimizer | None
    window: AccumulationWindow
    batch: BatchSizes
    settings: EngineSettings
    stage: Stage
    device: torch.device
    offload: OffloadPlan
    held: Holdings
    checkpoint_writer: FileWriter
    global_step: int
    skipped_steps: int
    _open_gathered: list[GatheredParameters]
    _agree_on_call: Callable[[Call], None]

    @property
    def config(self) -> ZeroEngineConfig:
        """The resolved config (``stage: auto`` settled, ``"auto"`` values filled), as each
        checkpoint's manifest records it."""
        return self.settings.config

    def gathered(
        self, params: nn.Parameter | str | Any = None, *, modifier_rank: int | None = None
    ) -> GatheredParameters:
        """A context inside which ``params`` (parameters or their names; all when None) are
        whole on every rank, in the module, for any code to read (collective: enter and leave it
        on every rank). With ``modifier_rank=r`` what rank ``r`` wrote into them is kept: written
        at exit into every rank's copy, shard and fp32 master (the optimizer state is left as it
        is), as DeepSpeed's ``GatheredParameters(params, modifier_rank=r)``; without it a write
        raises at exit on every rank. Nested and overlapping contexts are safe (a unit is
        released by the outermost exit). No optimizer step inside (it writes the shards).
        ``as`` gives the parameters, each once (`zero_engine.state.gathered`)."""
        self.calls.check_usable()
        return GatheredParameters(
            self.model_state, self.gatherer, self.comm, params, modifier_rank,
            lambda: self._agree_on_call(Call.GATHERED), self._open_gathered,
        )

    def named_full_parameters(
        self,
        *,
        bucket_bytes: int | str = "256MiB",
        dtype: torch.dtype | str | None = None,
        merge_adapters: bool = False,
        rank0_only: bool = False,
        names: Callable[[str], bool] | Iterable[str] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every ``state_dict()`` entry as ``(name, full tensor)`` on the engine's device, in
        its order, values as `full_state_dict` has them (fp32 masters, frozen weights as stored,
        buffers) or cast to ``dtype``: for an inference server's weight sync, never the whole
        model at once (each rank holds one gathered bucket of at most ``bucket_bytes`` and the
        tensor it yields). ``merge_adapters=True``: a PEFT LoRA model's merged base under the base
        model's names (what ``merge_and_unload()`` gives), merged layer by layer. Collective:
        iterate it to its end on every rank; with ``rank0_only`` only rank 0 gets tensors.
        ``names``: which state-dict names to stream (a collection of names, or a predicate on
        a name: say, a PEFT model's adapters); the others are not gathered
        (`zero_engine.state.streaming`). A rank that stops iterating early, or streams alone,
        makes every rank raise `DivergedRanksError` at its next collective row."""
        self.calls.check_usable()
        check_switch(rank0_only, "engine.named_full_parameters(rank0_only)")
        check_switch(merge_adapters, "engine.named_full_parameters(merge_adapters)")
        size = export.parse_shard_size(bucket_bytes, "bucket_bytes")
        cast = export.parse_dtype(dtype)  # bad arguments raise here, before any collective
        wanted = _wanted_names(names, self.module)
        merge = AdapterMerge(self.module) if merge_adapters else None
        return self._stream(size, cast, merge, rank0_only, wanted)

    def _stream(
        self, size: int, dtype: torch.dtype | None, merge: AdapterMerge | None, rank0_only: bool,
        names: Callable[[str], bool] | None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        self._agree_on_call(Call.FULL_PARAMETERS)
        yield from streaming.stream(
            self.model_state, self.comm, self.device, bucket_bytes=size, dtype=dtype, rank0_only=rank0_only,
            merge=merge, gathered=self.gathered, agree=self.calls.agree, wanted=names,
        )

    def _check_no_gathered(self, call: str) -> None:
        if self._open_gathered:
            raise RuntimeError(
                f"engine.{call} inside engine.gathered(): the step and checkpoint loads write the shards the context "
                "holds gathered; leave the context first"
            )

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The complete module state on CPU, same keys as ``state_dict()`` (tied parameters'
        names share one tensor, as there), parameters as their fp32 masters. Collective when
        masters are sharded: call it on every rank.

        ``rank0_only=True`` gathers onto rank 0 alone, one unit at a time, so exporting never
        needs the full model on any other rank; the other ranks get an empty dict.
        """
        self.calls.check_usable()
        check_switch(rank0_only, "engine.full_state_dict(rank0_only)")
        if any(unit.shard_master for unit in [*self.units, *self.frozen_units]):  # collective: every rank must be here
            self._agree_on_call(Call.FULL_STATE_DICT)
        return self.model_state.full_state_dict(rank0_only=rank0_only)

    def memory_report(self) -> dict[str, int]:
        """Bytes of model state this rank holds (see `zero_engine.memory.MemoryReport`)."""
        report = measure_memory(
            self.model_state.loose_params,
            self.units,
            self.frozen_units,
            self.optimizer,
            self.reducer,
            self.gatherer.peaks(),
            self.optimizer_step.peak_grad_bytes,
            optimizer_on_host=self.offload.optimizer,
            peak_encoded_bytes=self.codecs.meter.peak,
        )
        return report._replace(  # the host buffers of what the tiers hold (NVMe's: gradients cross and are read in)
            host=report.host + self.held.host_bytes, peak_matrix_exchange=self.optimizer_step.peak_matrix_bytes
        )._asdict()

    def comm_report(self) -> dict[str, dict[str, int]]:
        """Bytes this rank sent and received per collective kind in the current optimizer step;
        with ``device: nvme`` offload also its swap files' bytes (``"nvme"``: read, written, and
        the written bytes as terabytes per 1,000 such steps, what wears an SSD)."""
        report: dict[str, dict[str, Any]] = dict(self.comm.report())
        report.update(self.held.reports())  # what the tiers hold moved: NVMe's swap files
        return report

    def save_checkpoint(
        self,
        directory: str | Path,
        tag: str | None = None,
        client_state: Any = None,
        *,
        within_window: bool = False,
        exclude_frozen_parameters: bool = False,
        format: str | None = None,
    ) -> Path:
        """Save everything needed to resume, at any stage and world size (collective).

        ``tag`` defaults to ``global_step{N}``; ``client_state`` is anything
        ``torch.load(weights_only=True)`` can read back (tensors, numbers, strings, containers).
        A save inside an accumulation window is refused unless ``within_window=True``, which
        saves what the last boundary left (parameters, optimizer, schedule): the window's
        gradients so far stay in this run and are not saved, as a DDP checkpoint holds none (for
        loops that checkpoint between micro-batches, as Lightning's ModelCheckpoint can).

        ``exclude_frozen_parameters=True`` (DeepSpeed's keyword) saves the trainable state only: a
        LoRA run's checkpoint then holds its adapters, not the base. Resuming it takes the frozen
        weights from the model as built, or from ``weights=`` at `initialize`.

        ``format``: the checkpoint format to write (`zero_engine.state.formats`; default the
        ``checkpoint_format`` key's, this engine's own unless set). `load_checkpoint` finds any
        registered format by its files.
        """
        self.calls.check_usable()
        written = formats.writing(format or self.settings.checkpoint_format)  # a wrong name: before any collective
        if self.window.in_window and not within_window:
            raise RuntimeError(
                f"save_checkpoint in the middle of a gradient-accumulation window (micro-step "
                f"{self.window.in_window} of {self.batch.gradient_accumulation_steps}): call it after "
                "engine.step() on a boundary"
            )
        self._agree_on_call(Call.SAVE_CHECKPOINT)
        counters = checkpoint.Counters(self.global_step, self.skipped_steps)
        tag = tag or f"global_step{self.global_step}"
        return written.save(
            self._resumable(exclude_frozen_parameters), counters, Path(directory), tag, client_state,
            self.checkpoint_writer,
        )

    def load_checkpoint(
        self,
        directory: str | Path,
        tag: str | None = None,
        *,
        strict: bool = True,
        load_optimizer_states: bool = True,
    ) -> Any:
        """Resume from ``directory`` (tag: the latest); returns the saved ``client_state``."""
        self.calls.check_usable()
        self._check_no_gathered("load_checkpoint()")
        self._agree_on_call(Call.LOAD_CHECKPOINT)
        if self.offload.any:  # the last publish may still be reading the host masters this load overwrites
            offload.wait_for_host_copies(self.device)
        loaded = checkpoint.load(
            self._resumable(), directory, tag, strict=strict, load_optimizer_states=load_optimizer_states
        )
        self.global_step, self.skipped_steps = loaded.counters
        self.window.restart(self.global_step)
        return loaded.client_state

    def save_pretrained(
        self, directory: str | Path, *, max_shard_size: int | str = "5GB", dtype: torch.dtype | str | None = None
    ) -> Path:
        """The model in Hugging Face's layout (collective; rank 0 writes): ``model.safetensors``
        or shards of at most ``max_shard_size`` with ``model.safetensors.index.json``, names as
        ``module.state_dict()`` gives them (a tied tensor once), values the fp32 masters (frozen
        weights as stored: a bf16 base stays bf16) or cast to ``dtype``; ``config.json`` too for
        a transformers model. Streamed unit by unit: rank 0 holds one gathered unit and one shard
        at a time, never the model (`state.export`).
        Returns on every rank once the files are complete; training goes on unchanged."""
        self.calls.check_usable()
        export.parse_shard_size(max_shard_size), export.parse_dtype(dtype)  # bad arguments raise before any collective
        self._agree_on_call(Call.SAVE_PRETRAINED)
        return export.export_model(self.model_state, directory, max_shard_size, dtype)

    def _resumable(self, exclude_frozen: bool = False) -> checkpoint.Resumable:
        return checkpoint.Resumable(
            self.model_state, self.optimizer_step, self.settings.config, self.stage.level, self.device, exclude_frozen
        )


def _wanted_names(
    names: Callable[[str], bool] | Iterable[str] | None, module: nn.Module
) -> Callable[[str], bool] | None:
    """``named_full_parameters(names=...)`` as a predicate: a callable as it is; a name or a
    collection of names, each of which must be a ``state_dict()`` entry (a name that matches
    nothing is a slip, refused before any collective: reliability review D9)."""
    if names is None or callable(names):
        return names
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, Iterable):
        raise TypeError(
            f"named_full_parameters(names={names!r}): a collection of state_dict names, or a predicate on a name, "
            f"not {type(names).__name__}"
        )
    chosen = set(names)
    unknown = sorted(chosen - set(module.state_dict()))
    if unknown:
        raise KeyError(
            f"named_full_parameters(names=...): {unknown[:5]}{' ...' if len(unknown) > 5 else ''} "
            f"{'is not a state_dict entry' if len(unknown) == 1 else 'are not state_dict entries'} of the model "
            "(names as module.state_dict() gives them)"
        )
    return chosen.__contains__
