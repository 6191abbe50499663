"""DCP checkpoints (``torch.distributed.checkpoint``: FSDP2, torchtitan, transformers' FSDP/TP),
read and written in torchtitan's layout: the `formats` table's row ``dcp``.

The layout: a directory with DCP's ``.metadata`` and data files, of the state dict
``{"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optim,
options=StateDictOptions(flatten_optimizer_state_dict=True)), "lr_scheduler": ..., ...}`` as DCP
flattens it: ``model.<fqn>`` (each a tensor in chunks: FSDP2's are row blocks),
``optimizer.state.<fqn>.exp_avg`` / ``.exp_avg_sq`` / ``.step``, ``optimizer.param_groups.<fqn>.lr``
(bytes), and the other parts (``lr_scheduler``, ``train_state``, ``dataloader``).

- **Reading** (`read_dcp`): the parameters are pieces cut from the chunks (`dcp_layout.runs`),
  loaded lazily: a rank reads only the chunks covering the ranges it keeps (`DcpPieces`). The
  param groups' options are per parameter (``param_options``; the step maps them onto its
  groups); ``lr_scheduler`` is the schedule, ``train_state.step`` the step counter, the rest
  the ``client_state``.
- **Writing** (`save_dcp`): every rank writes its pieces as DCP chunks (each flat piece at most
  ``2 * ndim - 1`` rectangles, `dcp_layout.rectangles`) into ``__<rank>_0.distcp``, rank 0 the
  loose entries, the options, the schedule and the counter, then DCP's ``.metadata`` of all of
  them; beside them this engine's ``extra.pt``, each rank's generators and ``zero_engine.json``
  (every file's size and SHA-256, checked before a load here), staged and published atomically
  as this engine's own saves are (`own_format.save_staged`). FSDP2 loads it with ``dcp.load``;
  this engine resumes from it exactly (counters, scaler, generators, ``client_state``).
"""

from __future__ import annotations

import io
import json
import math
import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..sharding.optimizer_side.optimizer_shard import SavedPiece, saved_piece
from . import storage
from .dcp_layout import GROUPS, MODEL, STATE, option_key, rectangles, runs, state_key
from .dcp_metadata import METADATA, Chunk, Index, TensorEntry, metadata_bytes, read_blob, read_metadata
from .own_format import save_staged
from .payload import Counters, PieceIndex, Resumable, extra_payload, rank_payload
from .sources import Source
from .storage import DCP_MANIFEST, EXTRA, Checkpoint

NAME = "dcp"
FORMAT = "zero_engine-dcp/1"
_CACHED_CHUNKS = 32  # chunks kept loaded: a parameter's master and state, a few parameters back


def rng_file(rank: int) -> str:
    return f"rng{rank:05d}.pt"


def data_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def dcp_directory(directory: str | Path, tag: str | None) -> Path | None:
    """The DCP checkpoint's directory: ``directory/tag``, or with no tag ``directory`` itself
    or the tag ``latest`` names (a re-save's complete new copy while it moves into place);
    None when there is no ``.metadata`` there."""
    root = Path(directory)
    if tag is None and (root / METADATA).is_file():
        return root
    try:
        tag = storage.resolve_tag(root, tag)
    except (OSError, CheckpointError):
        return None
    path = storage.tag_path(root, tag)
    return path if (path / METADATA).is_file() else None


def finds_dcp(directory: Path, tag: str | None) -> bool:
    return dcp_directory(directory, tag) is not None


# -- reading -----------------------------------------------------------------------------------


def read_dcp(directory: Path, tag: str | None) -> Source:
    """The DCP checkpoint at ``directory``/``tag`` as the engine reads any checkpoint."""
    path = dcp_directory(directory, tag)
    if path is None:
        raise CheckpointError(f"{Path(directory) / (tag or '')}: no DCP checkpoint (.metadata) there")
    ours = _verified_manifest(path)
    index = read_metadata(path)
    params = {fqn[len(MODEL):]: {"shape": list(entry.shape), "aliases": [fqn[len(MODEL):]]}
              for fqn, entry in index.tensors.items() if fqn.startswith(MODEL)}
    manifest = {
        "format": NAME, "params": params, "excluded_frozen": [],
        "optimizer": ours.get("optimizer") if ours else None,  # DCP does not record the optimizer's type
        "world_size": ours.get("world_size") if ours else None,
    }
    rng: list[Any] = []
    if ours is not None:  # this engine's save: its own extra.pt and generators beside DCP's files
        extra = storage.read_file(path / EXTRA)
        rng = [storage.read_file(path / rng_file(rank)) for rank in range(ours.get("world_size") or 0)]
    else:
        extra = _foreign_extra(path, index)
    return Source(Checkpoint(path, manifest), DcpPieces(path, index, rng), extra, [], NAME)


def _verified_manifest(path: Path) -> dict[str, Any] | None:
    """This engine's ``zero_engine.json`` beside the DCP files, every file it lists checked
    against its size and SHA-256; None for a DCP checkpoint another program wrote."""
    file = path / DCP_MANIFEST
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{file}: corrupted ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{file}: format {manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                              f"expected {FORMAT!r} with a 'files' table")
    for name, expected in manifest["files"].items():
        target = path / name
        if "/" in name or not target.is_file():
            raise CheckpointError(f"{target}: listed in {DCP_MANIFEST} but missing")
        descriptor = os.open(target, os.O_RDONLY)
        try:
            storage.check_listed(target, descriptor, expected, DCP_MANIFEST)
        finally:
            os.close(descriptor)
    return manifest


def _foreign_extra(path: Path, index: Index) -> dict[str, Any]:
    """What loading restores beside the pieces, from a DCP checkpoint another program wrote:
    the options of each parameter's param group, the schedule, the step counter (torchtitan's
    ``train_state.step``); the other parts become the ``client_state``."""
    options: dict[str, dict[str, Any]] = {}
    parts: dict[str, Any] = {}
    for fqn in [*index.objects, *index.tensors]:
        if fqn.startswith((MODEL, STATE)):
            continue
        value = read_blob(path, index.objects[fqn]) if fqn in index.objects else _whole(path, index.tensors[fqn])
        named = option_key(fqn)
        if named is not None:
            options.setdefault(named[0], {})[named[1]] = value
        else:
            _place(parts, index.paths.get(fqn) or tuple(fqn.split(".")), value)
    parts = _as_lists(parts)
    train_state = parts.get("train_state")
    step = train_state.get("step", 0) if isinstance(train_state, dict) else 0
    distinct: list[dict[str, Any]] = []
    for group in options.values():
        if group not in distinct:
            distinct.append(group)
    return {
        "module": {}, "param_groups": distinct, "param_options": options, "lr_scheduler": parts.pop("lr_scheduler", None),
        "loss_scaler": None, "global_step": int(step), "skipped_steps": 0, "client_state": parts or None,
    }


def _place(tree: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _as_lists(tree: Any) -> Any:
    """Nested dicts back, those keyed 0..n-1 as lists (DCP flattens lists by index)."""
    if not isinstance(tree, dict):
        return tree
    tree = {key: _as_lists(value) for key, value in tree.items()}
    if tree and all(isinstance(key, int) for key in tree) and sorted(tree) == list(range(len(tree))):
        return [tree[i] for i in range(len(tree))]
    return tree


def _whole(path: Path, entry: TensorEntry) -> torch.Tensor:
    whole = torch.empty(entry.shape, dtype=entry.dtype, device="cpu")
    for chunk in entry.chunks:
        whole[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = read_blob(path, chunk)
    return whole


class DcpPieces(PieceIndex):
    """The saved pieces of each parameter, cut from DCP's chunks as they are asked for: a range
    reads the chunks that cover it alone (a few kept loaded: a load asks parameter by
    parameter, the master then each state). Each optimizer state is classed when the
    checkpoint is opened (with a load's other checks, before anything is restored): elementwise
    (its parameter's shape) or a scalar (Adam's step); any other shape is refused."""

    def __init__(self, directory: Path, index: Index, rng: list[Any]) -> None:
        super().__init__((), rng)
        self.directory, self.index = directory, index
        self.states: dict[str, dict[str, TensorEntry]] = {}  # elementwise, by parameter and key
        self.scalars: dict[str, dict[str, TensorEntry]] = {}
        for fqn, entry in index.tensors.items():
            named = state_key(fqn)
            param = index.tensors.get(MODEL + named[0]) if named is not None else None
            if param is None:
                continue
            if not entry.shape and (named[1] == "step" or param.shape):
                self.scalars.setdefault(named[0], {})[named[1]] = entry
            elif entry.shape == param.shape:
                self.states.setdefault(named[0], {})[named[1]] = entry
            else:
                raise CheckpointError(f"{directory}: optimizer state {fqn} has shape {list(entry.shape)}, its parameter "
                                      f"{list(param.shape)}: neither elementwise nor a scalar, not readable")
        self._loaded: OrderedDict[tuple[str, Chunk], torch.Tensor] = OrderedDict()
        self.pieces = _AllPieces(self)  # type: ignore[assignment]

    def covering(self, name: str, start: int, numel: int) -> list[SavedPiece]:
        model = self.index.tensors.get(MODEL + name)
        if model is None:
            return []
        shape = model.shape
        pieces: dict[tuple[int, int], SavedPiece] = {}
        scalars = {key: self._chunk(STATE + f"{name}.{key}", entry.chunks[0]).reshape(())
                   for key, entry in self.scalars.get(name, {}).items()}
        for key, entry in [(None, model), *self.states.get(name, {}).items()]:
            fqn = MODEL + name if key is None else STATE + f"{name}.{key}"
            for chunk in entry.chunks:
                for run in runs(shape, chunk.offsets, chunk.sizes):
                    if run.start < start + numel and start < run.start + run.numel:
                        values = self._chunk(fqn, chunk).reshape(-1)[run.within : run.within + run.numel]
                        piece = pieces.setdefault((run.start, run.numel), saved_piece(name, run.start, run.numel, None, {}))  # type: ignore[arg-type]
                        if key is None:
                            piece["master"] = values
                        else:
                            piece["state"][key] = values
        for piece in pieces.values():
            piece["state"].update(scalars)
        return list(pieces.values())

    def _chunk(self, fqn: str, chunk: Chunk) -> torch.Tensor:
        key = (fqn, chunk)
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key]
        tensor = read_blob(self.directory, chunk)
        if not torch.is_tensor(tensor) or tuple(tensor.shape) != chunk.sizes:
            raise CheckpointError(f"{self.directory / chunk.file}: {fqn}'s chunk at {list(chunk.offsets)} holds "
                                  f"{tuple(getattr(tensor, 'shape', ()))}, its metadata says {list(chunk.sizes)}")
        self._loaded[key] = tensor
        while len(self._loaded) > _CACHED_CHUNKS:
            self._loaded.popitem(last=False)
        return tensor


class _AllPieces(Mapping):
    """``PieceIndex.pieces`` of a DCP checkpoint: a parameter's pieces, read when asked for."""

    def __init__(self, index: DcpPieces) -> None:
        self.index = index

    def __getitem__(self, name: str) -> list[SavedPiece]:
        entry = self.index.index.tensors.get(MODEL + name)
        if entry is None:
            raise KeyError(name)
        return self.index.covering(name, 0, math.prod(entry.shape))

    def __iter__(self) -> Iterator[str]:
        return (fqn[len(MODEL):] for fqn in self.index.index.tensors if fqn.startswith(MODEL))

    def __len__(self) -> int:
        return sum(1 for _ in self)


# -- writing -----------------------------------------------------------------------------------


class _DataFile:
    """One rank's DCP data file: each item a ``torch.save`` of its own, back to back, and the
    record DCP's metadata needs of it. An item's key is ``<part>.<key in the part>`` (the part:
    ``model``, ``optimizer``, ``lr_scheduler``, ``train_state``), as DCP flattens a state dict of
    those parts; its path in the state dict follows from it."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.name = data_file(rank)
        self.path = directory / self.name
        self.handle = open(self.path, "wb")
        self.items: list[dict[str, Any]] = []
        self.seen: set[tuple[str, tuple[int, ...]]] = set()

    def tensor(self, fqn: str, shape: tuple[int, ...], offsets: tuple[int, ...], values: torch.Tensor) -> None:
        if (fqn, offsets) in self.seen:
            return
        self.seen.add((fqn, offsets))
        record = {"shape": list(shape), "dtype": str(values.dtype).removeprefix("torch."), "offsets": list(offsets),
                  "sizes": list(values.shape)}
        self._write(fqn, values.detach().to("cpu").contiguous().clone(), record)

    def value(self, fqn: str, value: Any) -> None:
        if (fqn, ()) in self.seen:
            return
        self.seen.add((fqn, ()))
        self._write(fqn, value, {})

    def _write(self, fqn: str, payload: Any, record: dict[str, Any]) -> None:
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        offset = self.handle.tell()
        self.handle.write(buffer.getbuffer())
        self.items.append({"fqn": fqn, "path": fqn.split(".", 1), "file": self.name, "offset": offset,
                           "length": self.handle.tell() - offset, **record})

    def close(self) -> dict[str, int | str]:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        return {"bytes": self.path.stat().st_size, "sha256": storage.sha256_of(self.path)}


def write_pieces(out: _DataFile, pieces: list[SavedPiece], params: dict[str, dict[str, Any]]) -> None:
    """Each piece's master under every name of its parameter, and its optimizer state, as DCP
    chunks (rectangles of the whole parameter); a scalar state (Adam's step) whole."""
    for piece in pieces:
        name, entry = piece["name"], params[piece["name"]]
        shape = tuple(entry["shape"])
        elementwise = {}
        for key, value in piece["state"].items():
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() == piece["numel"]:
                elementwise[key] = value
            elif torch.is_tensor(value):
                out.tensor(f"{STATE}{name}.{key}", tuple(value.shape), (0,) * value.dim(), value)
            else:
                out.value(f"{STATE}{name}.{key}", value)
        for rect in rectangles(shape, piece["start"], piece["numel"]):
            for alias in entry["aliases"]:
                out.tensor(MODEL + alias, shape, rect.offsets, piece["master"][rect.lo : rect.hi].reshape(rect.sizes))
            for key, value in elementwise.items():
                out.tensor(f"{STATE}{name}.{key}", shape, rect.offsets, value[rect.lo : rect.hi].reshape(rect.sizes))


def write_whole(out: _DataFile, loose: dict[str, torch.Tensor], options: dict[str, dict[str, Any]],
                scheduler: dict[str, Any] | None, global_step: int) -> None:
    """What one rank writes whole: the loose entries (buffers, frozen parameters kept whole),
    each parameter's param-group options, the schedule and torchtitan's step counter."""
    for name, tensor in loose.items():
        out.tensor(MODEL + name, tuple(tensor.shape), (0,) * tensor.dim(), tensor)
    for name, group in options.items():
        for option, value in group.items():
            out.value(f"{GROUPS}{name}.{option}", value)
    for key, value in (scheduler or {}).items():
        out.value(f"lr_scheduler.{key}", value)
    out.value("train_state.step", global_step)


def save_dcp(
    state: Resumable,
    counters: Counters,
    directory: str | Path,
    tag: str,
    client_state: Any = None,
    writer: storage.FileWriter = storage.FILES,
) -> Path:
    """Write ``state`` as a DCP checkpoint under ``directory``/``tag``; returns its path.
    Collective."""
    comm, model = state.model.comm, state.model
    with_frozen = not state.exclude_frozen
    root = Path(directory)

    def write(staging: Path) -> dict[str, Any]:
        payload = rank_payload(state)
        out = _DataFile(staging, comm.rank)
        try:
            params = {**model.saved_params(with_frozen=with_frozen)}
            write_pieces(out, payload["pieces"], params)
            if comm.rank == 0:
                scheduler = state.step.lr_scheduler
                write_whole(out, model.loose_state(with_frozen=with_frozen), state.step.options_by_name(),
                            scheduler.state_dict() if scheduler is not None else None, counters.global_step)
        finally:
            files = {out.name: out.close()}
        files[rng_file(comm.rank)] = writer.write_file(staging / rng_file(comm.rank), payload["rng"])
        if comm.rank == 0:
            extra = {**extra_payload(state, counters, client_state), "module": {}}  # the loose entries are DCP's
            files[EXTRA] = writer.write_file(staging / EXTRA, extra)
        return {"files": files, "items": out.items}

    def manifest(staging: Path, results: list[dict[str, Any]]) -> None:
        finish(staging, results, str(root / tag), writer, {
            "tag": tag, "global_step": counters.global_step, "stage": state.stage, "world_size": comm.mesh.world,
            "optimizer": type(state.optimizer).__name__ if state.optimizer is not None else None,
            "config": state.config.model_dump(mode="json"),
        })

    return save_staged(comm, root, tag, client_state, writer, write, manifest)


def finish(staging: Path, results: list[dict[str, Any]], checkpoint_id: str, writer: storage.FileWriter,
           fields: dict[str, Any]) -> None:
    """DCP's ``.metadata`` of every rank's written items, then ``zero_engine.json`` (``fields``
    and every file's size and SHA-256)."""
    items = _deduplicated([item for result in results for item in result["items"]])
    data = metadata_bytes(items, checkpoint_id)
    storage.write_bytes(staging / METADATA, data)
    files = {name: entry for result in results for name, entry in result["files"].items()}
    files[METADATA] = {"bytes": len(data), "sha256": storage.sha256_of(staging / METADATA)}
    writer.write_text(staging / DCP_MANIFEST, json.dumps({"format": FORMAT, **fields, "files": files}, indent=1))


def convert_to_dcp(source: Source, staging: Path, checkpoint_id: str) -> None:
    """Any checkpoint (`sources.Source`) written into ``staging`` as one DCP rank would (in one
    process: ``zero-engine convert --to dcp``)."""
    params, extra = source.checkpoint.manifest["params"], source.extra
    out = _DataFile(staging, 0)
    try:
        write_pieces(out, [piece for name in params for piece in source.index.pieces.get(name, ())], params)
        write_whole(out, extra["module"], _options_of(source), extra.get("lr_scheduler"), extra["global_step"])
    finally:
        files = {out.name: out.close()}
    files[EXTRA] = storage.write_file(staging / EXTRA, {**extra, "module": {}})
    finish(staging, [{"files": files, "items": out.items}], checkpoint_id, storage.FILES, {
        "tag": staging.name, "global_step": extra["global_step"], "world_size": 0,  # no rank's generators
        "optimizer": source.checkpoint.manifest.get("optimizer"),
    })


def _options_of(source: Source) -> dict[str, dict[str, Any]]:
    """Each trainable parameter's param-group options: as saved per parameter, or the one group's
    (a checkpoint of several groups does not say which parameter is in which)."""
    extra, params = source.extra, source.checkpoint.manifest["params"]
    if "param_options" in extra:
        return extra["param_options"]
    groups = extra.get("param_groups") or []
    if len(groups) > 1:
        raise CheckpointError(
            f"{source.checkpoint.path}: {len(groups)} optimizer param groups, and the checkpoint does not record which "
            "parameter is in which, which DCP's layout needs: resume it in the engine and save_checkpoint(format='dcp')"
        )
    return {name: dict(groups[0]) for name, entry in params.items() if groups and not entry.get("frozen")}


def _deduplicated(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per key and chunk (a scalar state every rank holding a piece wrote)."""
    seen, out = set(), []
    for item in items:
        key = (item["fqn"], tuple(item.get("offsets") or ()))
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out
