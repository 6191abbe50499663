"""The trained model in Hugging Face's layout, streamed: ``save_pretrained`` without ever holding
the whole model on one rank.

The layout is what ``transformers`` writes and ``from_pretrained`` reads: ``model.safetensors``,
or ``model-0000k-of-0000n.safetensors`` shards of at most ``max_shard_size`` bytes (a tensor
larger than that alone in its shard) with ``model.safetensors.index.json`` (``metadata.total_size``
and the ``weight_map``); names as ``model.state_dict()`` gives them, a tied tensor written once
(under the name Hugging Face keeps: not one of the model's ``_tied_weights_keys``), values the
fp32 masters (a frozen weight as stored: a bf16 base stays bf16) or cast to ``dtype``.

Streaming: the shards are planned first from the tensors' shapes alone, so every shard file's
header is known before any value is gathered (`safetensors_file`). Then the units are gathered
onto rank 0 one at a time, in the model's order, and each parameter goes straight into its
shard's file. So rank 0 holds one gathered unit and one tensor's cast copy at a time (less than
the unit plus ``max_shard_size`` that holding a shard's tensors would take), never the model.
Each shard file is put in place once complete; files of an earlier export into the same
directory that this one did not write are removed at the end.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError
from ..sharding.units.frozen_unit import FrozenUnit
from ..sharding.units.unit import FlatUnit
from .every_rank import on_every_rank
from .consolidate import excluded_frozen, trainable_only_message
from .payload import PieceIndex
from .safetensors_file import SafetensorsWriter, TensorSpec
from .state_dict import ModelState
from .formats import open_source
from .storage import write_atomically

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)\s*$", re.IGNORECASE)
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def parse_shard_size(value: int | float | str, what: str = "max_shard_size") -> int:
    """Bytes from ``5000000`` (or ``5e9``), ``"5GB"`` (10**9) or ``"5GiB"`` (2**30), as
    transformers reads them; at least one byte, whichever way it is written."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE.match(value) if isinstance(value, str) else None
        size = int(float(match.group(1)) * _UNITS[match.group(2).upper()]) if match else 0
    if size < 1:
        raise ValueError(f"{what} = {value!r}: give a positive number of bytes or a size such as '5GB'")
    return size


def parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """None (the fp32 masters), a floating torch dtype, or its name (``"bfloat16"``,
    ``"torch.float64"``, ``"bf16"``: any floating dtype, named as torch or as configs do)."""
    if value is None or isinstance(value, torch.dtype) and value.is_floating_point:
        return value
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        named = _DTYPES.get(name, getattr(torch, name, None))
        if isinstance(named, torch.dtype) and named.is_floating_point:
            return named
    raise ValueError(
        f"dtype = {value!r}: give None (fp32), a floating torch dtype, or its name ({sorted(_DTYPES)}, ...)"
    )


def plan_shards(entries: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """The entries cut in order into shards of at most ``max_bytes`` (a larger tensor alone)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards if shards[-1] else shards[:-1]


def shard_file(index: int, count: int) -> str:
    return WEIGHTS if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


class ShardWriter:
    """Takes the planned tensors in order, each straight into its shard's file (rank 0): a shard
    file is open while its tensors come and put in place after its last one."""

    def __init__(self, directory: Path, shards: list[list[TensorSpec]]) -> None:
        self.directory = directory
        self.shards = shards
        self._shard = 0
        self._file: SafetensorsWriter | None = None
        self.written: list[str] = []  # (the directory is made by the first write: a failure reaches every rank)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """The next planned tensor, written at once (cast to its planned dtype on the host)."""
        if self._file is None:
            if self._shard == len(self.shards):
                raise RuntimeError(f"export: {name!r} came after the last planned tensor")
            self.directory.mkdir(parents=True, exist_ok=True)
            file = self.directory / shard_file(self._shard, len(self.shards))
            self._file = SafetensorsWriter(file, self.shards[self._shard], {"format": "pt"})
        self._file.write(name, tensor)
        if self._file.complete:
            self.written.append(self._file.close().name)
            self._file = None
            self._shard += 1

    def abort(self) -> None:
        """Remove the shard file being written (the files already in place stay)."""
        if self._file is not None:
            self._file.abort()
            self._file = None

    def finish(self) -> None:
        """The index (when sharded), then the removal of what an earlier export left here."""
        if self._shard != len(self.shards):
            raise RuntimeError(f"export: {len(self.shards) - self._shard} shard(s) never completed")
        self.directory.mkdir(parents=True, exist_ok=True)  # a model without tensors: its config alone
        if len(self.shards) > 1:
            index = {
                "metadata": {"total_size": sum(entry.nbytes for shard in self.shards for entry in shard)},
                "weight_map": {entry.name: shard_file(i, len(self.shards)) for i, shard in enumerate(self.shards)
                               for entry in shard},
            }
            text = json.dumps(index, indent=2, sort_keys=True) + "\n"
            write_atomically(self.directory / INDEX, lambda staging: staging.write_text(text))
        keep = set(self.written) | ({INDEX} if len(self.shards) > 1 else set())
        for stale in [*self.directory.glob("model*.safetensors"), self.directory / INDEX]:
            if stale.name not in keep and stale.is_file():
                stale.unlink()


def written_name(aliases: list[str], tied_keys: Iterable[str]) -> str:
    """The name a tied tensor is written under: the first of its names that is not one of the
    model's ``_tied_weights_keys`` (Hugging Face drops those), else the first."""
    tied = set(tied_keys)
    return next((name for name in aliases if name not in tied), aliases[0])


def tied_weights_keys(module: nn.Module) -> list[str]:
    """Hugging Face's ``_tied_weights_keys`` (a list, or in transformers 5 a dict whose keys are
    the tied names), with the prefixes of nested models; empty for other models."""
    keys: list[str] = []
    for prefix, sub in module.named_modules():
        declared = getattr(sub, "_tied_weights_keys", None) or ()
        keys += [f"{prefix}.{key}" if prefix else str(key) for key in declared]
    return keys


def save_model_files(module: nn.Module, directory: Path) -> None:
    """``config.json`` (and ``generation_config.json`` where the model generates) for a
    transformers model, so ``from_pretrained`` finds them; nothing for other modules."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config.architectures = [type(module).__name__]
    config.save_pretrained(str(directory))
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(str(directory))


def loose_entries(
    state: dict[str, torch.Tensor], dtype: torch.dtype | None, skip: Callable[[str], bool]
) -> list[tuple[str, torch.Tensor, torch.dtype]]:
    """The state-dict entries outside the units, each tensor once (a tied one under its first name),
    floating ones cast to ``dtype`` when given."""
    seen: set[int] = set()
    found = []
    for name, tensor in state.items():
        if skip(name) or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        found.append((name, tensor, out))
    return found


def export_model(
    model: ModelState, directory: str | Path, max_shard_size: int | str = "5GB", dtype: torch.dtype | str | None = None
) -> Path:
    """The engine's model in Hugging Face's layout under ``directory`` (collective: every rank
    joins the gathers, rank 0 writes), streamed unit by unit (see the module's docstring)."""
    directory, max_bytes, out = Path(directory), parse_shard_size(max_shard_size), parse_dtype(dtype)
    comm, module = model.comm, model.module
    aliases: dict[int, list[str]] = defaultdict(list)
    for name, param in module.named_parameters(remove_duplicate=False):
        aliases[id(param)].append(name)
    tied = tied_weights_keys(module)
    units = model.units_in_model_order()  # as checkpoints list them: the CLI's export writes the same shards
    names = [[written_name(aliases[id(param)], tied) for param in unit.params] for unit in units]
    in_units = {alias for unit in units for param in unit.params for alias in aliases[id(param)]}
    loose = loose_entries(model.loose_state(), out, skip=in_units.__contains__)
    entries = [
        TensorSpec(name, out or _stored_dtype(unit), tuple(unit.global_shape(index)))
        for unit, unit_names in zip(units, names) for index, name in enumerate(unit_names)
    ] + [TensorSpec(name, dtype_out, tuple(tensor.shape)) for name, tensor, dtype_out in loose]
    writer = ShardWriter(directory, plan_shards(entries, max_bytes)) if comm.rank == 0 else None
    failure: list[Exception] = []  # rank 0 keeps joining the gathers after a write fails, then reports it

    def write(action: Callable[[], None]) -> None:
        if writer is not None and not failure:
            try:
                action()
            except Exception as err:  # noqa: BLE001 (reported on every rank below)
                failure.append(err)
    for unit, unit_names in zip(units, names):
        if unit.is_cut:  # parts on several ranks (experts owned per rank): each parameter gathered whole
            for index, name in enumerate(unit_names):
                whole = model.whole_value(unit, index)
                write(functools.partial(writer.add, name, whole) if writer is not None else lambda: None)
                del whole
            continue
        full = model.full_master(unit, rank0_only=True)  # rank 0 holds this one unit
        write(functools.partial(_add_unit, writer, unit, unit_names, full))
        del full
    write(lambda: [writer.add(name, tensor) for name, tensor, _ in loose])
    write(lambda: (writer.finish(), save_model_files(module, directory)))

    def report() -> None:
        if failure:
            if writer is not None:
                writer.abort()
            raise failure[0]

    on_every_rank(comm, f"save_pretrained to {directory}", report)
    return directory


def _stored_dtype(unit: FlatUnit | FrozenUnit) -> torch.dtype:
    """What a unit's parameters are written as without ``dtype``: the fp32 masters, or a frozen
    unit's stored dtype (a bf16 base stays bf16, as it was loaded and as stages 0-2 write it)."""
    return unit.dtype if unit.frozen else torch.float32


def _add_unit(writer: ShardWriter | None, unit: FlatUnit, names: list[str], full: torch.Tensor) -> None:
    assert writer is not None
    for index, name in enumerate(names):
        writer.add(name, unit.view_of(full, index))


def _saved_dtype(index: PieceIndex, name: str, entry: dict) -> torch.dtype:
    """fp32 (the masters), or a frozen parameter's stored dtype, as its pieces hold it."""
    pieces = index.pieces.get(name) if entry.get("frozen") else None
    return pieces[0]["master"].dtype if pieces else torch.float32


def export_checkpoint(
    checkpoint: str | Path, directory: str | Path, tag: str | None = None, max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
) -> Path:
    """A checkpoint directory's model in Hugging Face's layout, in one process: each parameter
    assembled from its pieces in turn (the rank files are memory-mapped), so what is held is one
    parameter and one shard, never the model. Weights only: the checkpoint holds no model config."""
    directory, max_bytes, out = Path(directory), parse_shard_size(max_shard_size), parse_dtype(dtype)
    opened, index, extra, _, _ = open_source(checkpoint, tag)
    left_out = excluded_frozen(opened.manifest)
    if left_out:  # a "model" without its base would load as one with random frozen weights
        raise CheckpointError(
            f"{opened.path}: {trainable_only_message(left_out)}. A Hugging Face model written from it would lack "
            "them: export from an engine built over the base (engine.save_pretrained, or "
            "named_full_parameters(merge_adapters=True) for a merged LoRA model), or consolidate the adapters "
            "to a state dict (zero-engine consolidate CHECKPOINT OUT.safetensors)"
        )
    params = opened.manifest["params"]
    aliases = {alias for entry in params.values() for alias in entry["aliases"]}
    loose = loose_entries(extra["module"], out, skip=aliases.__contains__)
    numels = {name: math.prod(entry["shape"]) for name, entry in params.items()}
    # Without the model, a tied tensor is written under its first name (the model's order puts
    # the owner first: GPT-2's embedding before its lm_head, as transformers keeps them).
    entries = [
        TensorSpec(written_name(entry["aliases"], ()), out or _saved_dtype(index, name, entry), tuple(entry["shape"]))
        for name, entry in params.items()
    ]
    entries += [TensorSpec(name, dtype_out, tuple(tensor.shape)) for name, tensor, dtype_out in loose]
    writer = ShardWriter(directory, plan_shards(entries, max_bytes))
    try:
        for (name, entry), planned in zip(params.items(), entries):
            values = index.assemble(name, 0, numels[name])
            if values is None:
                raise CheckpointError(f"parameter {name!r}: no saved values in {opened.path}")
            writer.add(planned.name, values.view(entry["shape"]))
            del values
        for name, tensor, _ in loose:
            writer.add(name, tensor)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return directory
