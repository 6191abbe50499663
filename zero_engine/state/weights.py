"""Pretrained weights read range by range: each rank reads only the elements it keeps.

``initialize(..., weights=SOURCE)`` takes a ``.safetensors`` file, a Hugging Face model
directory (``model.safetensors``, sharded ``model.safetensors.index.json``, or
``pytorch_model.bin``), a torch state dict file, a ``save_checkpoint`` directory (or one tag of
it), or an in-memory state dict. Every source answers one question, `WeightsFile.read`: elements
``[start, start + numel)`` of the flattened tensor ``name``. Safetensors files are read range by
range with ``pread`` (`SafetensorsFile`), torch files are memory-mapped, checkpoints assemble
the range from their saved pieces; so at stage 3 no rank reads more than its shards and
whatever stays whole everywhere (buffers, frozen parameters). Safetensors is the format for
models near a rank's memory: a memory-mapped torch file keeps the pages around each read
resident until it is closed.

Names are ``model.state_dict()``'s. A tied parameter is satisfied by any of its names (Hugging
Face files store ``lm_head.weight`` once, or not at all when tied to the embedding). Missing,
unexpected and re-shaped names fail at `initialize`, listed as `load_checkpoint` lists them.
"""

from __future__ import annotations

import json
import pickle
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..sharding.units.unit import FlatUnit
from .checkpoint import misfit_message
from .formats import finds_any, open_source
from .storage import LATEST, refused_pickle
from .safetensors_reader import SafetensorsFile
from .state_dict import ModelState


class WeightsFile:
    """Named tensors to read element ranges from; counts the bytes it read (for tests)."""

    def __init__(self, label: str, shapes: dict[str, list[int]]) -> None:
        self.label = label
        self.shapes = shapes
        self.bytes_read = 0

    def read(self, name: str, start: int, numel: int) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the flattened tensor ``name``, as stored."""
        values = self._read(name, start, numel)
        self.bytes_read += values.numel() * values.element_size()
        return values

    def _read(self, name: str, start: int, numel: int) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        """Release open files (safetensors handles, memory maps)."""


WeightsSource = str | Path | Mapping[str, torch.Tensor] | WeightsFile


class StateDictWeights(WeightsFile):
    """A state dict in memory, or a torch file memory-mapped (read with ``weights_only``)."""

    def __init__(self, label: str, tensors: Mapping[str, Any]) -> None:
        bad = sorted(name for name, value in tensors.items() if not torch.is_tensor(value))
        if bad:
            raise CheckpointError(f"{label}: not a state dict of tensors (entries {bad[:5]} are not tensors)")
        super().__init__(label, {name: list(value.shape) for name, value in tensors.items()})
        self.tensors = tensors

    @classmethod
    def from_file(cls, path: Path) -> StateDictWeights:
        try:
            try:
                tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
                tensors = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise refused_pickle(f"weights: {path}", err) from None
        if not isinstance(tensors, Mapping):
            raise CheckpointError(f"{path}: holds a {type(tensors).__name__}, not a state dict")
        return cls(str(path), tensors)

    def _read(self, name: str, start: int, numel: int) -> torch.Tensor:
        return self.tensors[name].reshape(-1)[start : start + numel]

    def close(self) -> None:
        self.tensors = {}


class SafetensorsWeights(WeightsFile):
    """One or several ``.safetensors`` files (`SafetensorsFile`: exact ranges, no memory map)."""

    def __init__(self, label: str, file_of: dict[str, SafetensorsFile]) -> None:
        self._file_of = file_of
        for name, file in file_of.items():
            if name not in file.entries:
                self.close()
                raise CheckpointError(f"{label}: the index lists {name!r} in {file.path.name}, which does not hold it")
        super().__init__(label, {name: file.shape(name) for name, file in file_of.items()})

    @classmethod
    def from_file(cls, path: Path) -> SafetensorsWeights:
        file = SafetensorsFile(path)
        return cls(str(path), dict.fromkeys(file.entries, file))

    @classmethod
    def from_index(cls, index: Path) -> SafetensorsWeights:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index}: not a safetensors index ({err!r})") from None
        missing = sorted({file for file in weight_map.values() if not (index.parent / file).is_file()})
        if missing:
            raise CheckpointError(f"{index}: lists shard files that are missing: {missing}")
        files = {file: SafetensorsFile(index.parent / file) for file in set(weight_map.values())}
        return cls(str(index), {name: files[file] for name, file in weight_map.items()})

    def _read(self, name: str, start: int, numel: int) -> torch.Tensor:
        return self._file_of[name].read(name, start, numel)

    def close(self) -> None:
        for file in set(self._file_of.values()):
            file.close()


class CheckpointWeights(WeightsFile):
    """The model in a ``save_checkpoint`` directory (this engine's, or DeepSpeed's): parameters
    from their saved pieces."""

    def __init__(self, directory: Path, tag: str | None) -> None:
        checkpoint, self._index, extra, _, _ = open_source(directory, tag)
        self._module = extra["module"]
        self._canonical = {}
        shapes = {}
        for name, entry in checkpoint.manifest["params"].items():
            for alias in entry["aliases"]:
                self._canonical[alias] = name
                shapes[alias] = entry["shape"]
        shapes.update({name: list(value.shape) for name, value in self._module.items()})
        super().__init__(str(checkpoint.path), shapes)

    def _read(self, name: str, start: int, numel: int) -> torch.Tensor:
        if name in self._canonical:
            values = self._index.assemble(self._canonical[name], start, numel)
            if values is None:
                raise CheckpointError(f"{self.label}: parameter {name!r} has no saved values")
            return values
        return self._module[name].reshape(-1)[start : start + numel]


def open_weights(source: WeightsSource) -> WeightsFile:
    """The `WeightsFile` for any accepted ``weights=`` source (one already open is used as is:
    a reader for another format subclasses `WeightsFile`)."""
    if isinstance(source, WeightsFile):
        return source
    if isinstance(source, Mapping):
        return StateDictWeights("weights (state dict)", source)
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"weights: {path} does not exist")
    if path.is_dir():
        if (path / LATEST).is_file():
            return CheckpointWeights(path, None)
        if finds_any(path.parent, path.name):
            return CheckpointWeights(path.parent, path.name)  # one tag's directory
        if (path / "model.safetensors.index.json").is_file():
            return SafetensorsWeights.from_index(path / "model.safetensors.index.json")
        if (path / "model.safetensors").is_file():
            return SafetensorsWeights.from_file(path / "model.safetensors")
        if (path / "pytorch_model.bin").is_file():
            return StateDictWeights.from_file(path / "pytorch_model.bin")
        raise FileNotFoundError(
            f"weights: {path} holds no model.safetensors, model.safetensors.index.json, pytorch_model.bin, "
            "nor a checkpoint ('latest' or manifest.json)"
        )
    if path.suffix == ".safetensors":
        return SafetensorsWeights.from_file(path)
    return StateDictWeights.from_file(path)


def match_weights(model: nn.Module, weights: WeightsFile) -> dict[int, str]:
    """For every tensor of ``model.state_dict()``, the name the file holds it under (any alias
    of a tied parameter), by ``id`` of the tensor. Raises listing every misfit at once."""
    aliases: dict[int, list[str]] = defaultdict(list)
    tensors = model.state_dict(keep_vars=True)
    for name, tensor in tensors.items():
        aliases[id(tensor)].append(name)
    found: dict[int, str] = {}
    missing, reshaped = [], []
    for key, names in aliases.items():
        present = [name for name in names if name in weights.shapes]
        if not present:
            missing.append(names[0])
            continue
        found[key] = present[0]
        expected = list(tensors[names[0]].shape)
        reshaped += [f"{n} (file {weights.shapes[n]}, model {expected})" for n in present if weights.shapes[n] != expected]
    unexpected = sorted(set(weights.shapes) - set(tensors))
    message = misfit_message(weights.label, sorted(missing), unexpected, sorted(reshaped))
    if message:
        raise CheckpointError(message)
    return found


def load_weights(model: ModelState, weights: WeightsFile, file_names: dict[int, str]) -> None:
    """Copy the file's values into the model: each unit's kept range of each parameter, in
    fp32 (the masters' dtype), and the whole of what stays outside units."""

    def file_values(unit: FlatUnit, index: int, start: int, numel: int) -> torch.Tensor:
        dtype = unit.dtype if unit.frozen else torch.float32  # a frozen unit keeps its own dtype
        start = unit.global_start(index, start)  # in the whole parameter, as the file holds it
        return weights.read(file_names[id(unit.params[index])], start, numel).to(unit.device, dtype)

    model.load_kept(file_values)
    in_units = {id(param) for unit in model.all_units for param in unit.params}
    with torch.no_grad():
        loose = {
            name: weights.read(file_names[id(tensor)], 0, tensor.numel()).view(tensor.shape)
            for name, tensor in model.module.state_dict(keep_vars=True).items()
            if id(tensor) not in in_units
        }
    model.load_loose_state(loose)
