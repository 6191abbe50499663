"""DCP's ``.metadata`` file, read without running code from it and written as DCP writes it.

``torch.distributed.checkpoint`` pickles its index of a checkpoint (what each key is: a tensor of
a shape and dtype in chunks, or bytes; where each chunk lies in which file) and reads it back
with a plain ``pickle.load``, which runs whatever the file names. Here an unpickler accepts
exactly DCP's record classes, each as an inert stand-in holding its fields (never DCP's class),
torch's sizes and dtypes, and a path as a string; any other name is refused with the file and
the name. Reading imports nothing of ``torch.distributed``.

Writing (`metadata_bytes`) pickles DCP's own classes, so that ``dcp.load``, ``dcp_to_torch_save``
and torchtitan read what this engine wrote; only the writer imports them.
"""

from __future__ import annotations

import io
import pickle
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

import torch

from ..errors import CheckpointError

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint.metadata"
_RECORDS = {
    (_DCP, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta",
    )
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class _Record:
    """One of DCP's records, as the fields it was pickled with (built, never called)."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and all(isinstance(s, (dict, type(None))) for s in state):
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:  # TensorProperties pickles a tuple: (dtype, layout, requires_grad, memory format, pin_memory)
            self.__dict__["fields"] = state


class _EnumValue(int):
    """DCP's memory-format enum, as its int."""


def _layout(name: str) -> str:
    return name


def _path(*parts: str) -> str:
    return str(PurePath(*parts))


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _RECORDS:
            return type(name, (_Record,), {})
        if (module, name) == (_DCP, "_MEM_FORMAT_ENCODING"):
            return _EnumValue
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "pathlib" and name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
            return _path
        raise pickle.UnpicklingError(f"{module}.{name}")


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # the file holding it, in the checkpoint's directory
    offset: int  # where its bytes start there
    length: int


@dataclass(frozen=True)
class TensorEntry:
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class Index:
    """What a DCP checkpoint holds: each tensor key's shape, dtype and chunks; each bytes key's
    place; the path of each flattened key in the saved state dict (``planner_data``)."""

    tensors: dict[str, TensorEntry]
    objects: dict[str, Chunk]  # bytes entries (offsets and sizes empty)
    paths: dict[str, tuple[Any, ...]]


def read_metadata(directory: Path) -> Index:
    """The index of the DCP checkpoint in ``directory``; a refusal or damage names the file."""
    path = directory / METADATA
    try:
        with open(path, "rb") as handle:
            metadata = _Unpickler(handle).load()
        return _index(metadata)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path}: refused: it names {err}, which is none of DCP's metadata records, a torch size or dtype; "
            "nothing from it was run"
        ) from None
    except (EOFError, AttributeError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: not a DCP metadata file this engine reads ({type(err).__name__}: {err})") from None


def _index(metadata: Any) -> Index:
    places: dict[tuple[str, tuple[int, ...]], _Record] = {}
    for key, info in metadata.storage_data.items():
        if getattr(info, "transform_descriptors", None):
            raise ValueError(f"{key.fqn} is stored through transforms {list(info.transform_descriptors)} "
                             "(compression, an extension): not read here")
        places[(key.fqn, tuple(getattr(key, "offset", None) or ()))] = info  # None fields are not pickled
    tensors, objects = {}, {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if type(entry).__name__ == "BytesStorageMetadata":
            objects[fqn] = _chunk(places[(fqn, ())], (), ())
            continue
        fields = entry.properties.__dict__
        dtype = fields["fields"][0] if "fields" in fields else fields["dtype"]
        chunks = tuple(_chunk(places[(fqn, tuple(c.offsets))], tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
        tensors[fqn] = TensorEntry(tuple(entry.size), dtype, chunks)
    paths = {fqn: tuple(path) for fqn, path in (getattr(metadata, "planner_data", None) or {}).items()}
    return Index(tensors, objects, paths)


def _chunk(info: Any, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Chunk:
    if not _plain_file(info.relative_path):
        raise ValueError(f"a chunk's file {info.relative_path!r} is not a file of the checkpoint's directory")
    return Chunk(offsets, sizes, info.relative_path, int(info.offset), int(info.length))


def _plain_file(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


def read_blob(directory: Path, chunk: Chunk) -> Any:
    """One saved item: a tensor (torch.save'd) or an object's bytes, read with
    ``weights_only=True``."""
    path = directory / chunk.file
    try:
        with open(path, "rb") as handle:
            handle.seek(chunk.offset)
            data = handle.read(chunk.length)
        if len(data) != chunk.length:
            raise EOFError(f"{len(data)} of {chunk.length} bytes at offset {chunk.offset}")
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path}: an item refused by torch.load(weights_only=True) ({err}); nothing was run") from None
    except (OSError, EOFError, RuntimeError) as err:
        raise CheckpointError(f"{path}: unreadable or truncated ({err})") from None


# -- writing -----------------------------------------------------------------------------------


def metadata_bytes(items: list[dict[str, Any]], checkpoint_id: str) -> bytes:
    """The ``.metadata`` DCP writes, for ``items`` (each rank's written records: ``fqn``,
    ``path`` in the state dict, ``file``, ``offset``, ``length``, and for a tensor its ``shape``,
    ``dtype``, ``offsets``, ``sizes``); returns its bytes (the caller writes them)."""
    from torch.distributed.checkpoint import metadata as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    entries: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple[Any, ...]] = {}
    for item in items:
        fqn = item["fqn"]
        planner[fqn] = tuple(item["path"])
        if item.get("shape") is None:
            entries[fqn] = dcp.BytesStorageMetadata()
            storage[dcp.MetadataIndex(fqn)] = _StorageInfo(item["file"], item["offset"], item["length"])
            continue
        entry = entries.setdefault(fqn, dcp.TensorStorageMetadata(
            dcp.TensorProperties(dtype=getattr(torch, item["dtype"])), torch.Size(item["shape"]), []))
        offsets = torch.Size(item["offsets"])
        storage[dcp.MetadataIndex(fqn, offsets, len(entry.chunks))] = _StorageInfo(item["file"], item["offset"], item["length"])
        entry.chunks.append(dcp.ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(item["sizes"])))
    metadata = dcp.Metadata(
        state_dict_metadata=entries, planner_data=planner, storage_data=storage,
        storage_meta=dcp.StorageMeta(checkpoint_id=checkpoint_id, save_id=str(uuid.uuid4()), modules=[]), version="1.0.0",
    )
    return pickle.dumps(metadata)
