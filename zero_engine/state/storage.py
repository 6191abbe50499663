"""Checkpoint files on disk: names, atomic publication, verification and safe reading.

What a checkpoint holds is `zero_engine.state.checkpoint`'s (the format); this module is how its
files reach the disk and come back, whatever they hold:

- names: a tag is a plain name of a directory inside the checkpoint root, given or read from
  ``latest`` (`check_tag`, `open_checkpoint`), and the root is a directory (`check_root`);
- atomic publication: every rank writes into ``DIR/.tmp-TAG`` and fsyncs (`write_file`); rank 0
  writes the manifest, renames the directory into place, and only then replaces ``latest``
  (`publish`). A process killed at any point leaves the previous checkpoint and ``latest``
  untouched. Saving a tag again publishes the new copy complete as ``DIR/.next-TAG`` first,
  which the tag resolves to while it exists (`tag_path`); then the old copy is renamed away and
  the new one into place (`finish_publish`): a kill at any instant leaves the tag loadable;
- verification: the manifest is checked whole (its keys, their types, the files it must list)
  and every file against its size and SHA-256 before any is read, and read through the
  descriptor verification opened, so the bytes read are the bytes verified (`open_checkpoint`,
  `Checkpoint.read`);
- safe reading: ``torch.load(weights_only=True)`` (`read_file`): loading never runs code from a
  checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..errors import CheckpointError

FORMAT = "zero_engine/1"
MANIFEST, EXTRA, LATEST = "manifest.json", "extra.pt", "latest"
DCP_MANIFEST = "zero_engine.json"  # this engine's manifest beside a DCP checkpoint it wrote (`dcp_format`)


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def check_tag(tag: Any) -> None:
    if not _is_plain_name(tag) or tag == LATEST:
        raise ValueError(
            f"checkpoint tag {tag!r} must be a plain name (no '/' or '\\', not starting with '.', not 'latest')"
        )


def _is_plain_name(name: Any) -> bool:
    """A file or directory name of its own: no separator, not hidden, '.' or '..', not empty."""
    return isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and not name.startswith(".")


def check_root(root: Path) -> None:
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"{root}: is a file, not a checkpoint directory; give a directory (it is made if missing)")


def write_file(path: Path, payload: Any) -> dict[str, int | str]:
    try:
        with open(path, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
    except (OSError, RuntimeError) as err:  # torch.save reports a full disk as a RuntimeError
        raise OSError(f"{path}: writing failed: {err}") from err
    return {"bytes": path.stat().st_size, "sha256": sha256_of(path)}


def write_text(path: Path, text: str) -> None:
    _write_durably(path, "w", text)


def write_bytes(path: Path, data: bytes) -> None:
    _write_durably(path, "wb", data)


def _write_durably(path: Path, mode: str, data: str | bytes) -> None:
    """``data`` in ``path``, flushed to the disk before returning."""
    try:
        with open(path, mode) as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        raise OSError(f"{path}: writing failed: {err}") from err


def publish(root: Path, staging: Path, tag: str) -> None:
    """Move the finished checkpoint into place, then point ``latest`` at it, each atomically."""
    _fsync_dir(staging)
    final = root / tag
    if final.exists():  # re-saving a tag: the new copy is published whole before the old one moves
        os.rename(staging, pending_path(root, tag))
        _fsync_dir(root)
        finish_publish(root, tag)
    else:
        os.rename(staging, final)
    _fsync_dir(root)
    write_text(root / f".{LATEST}.tmp", tag)
    os.replace(root / f".{LATEST}.tmp", root / LATEST)
    _fsync_dir(root)


def pending_path(root: Path, tag: str) -> Path:
    """Where a complete new copy of an existing tag waits to replace it."""
    return root / f".next-{tag}"


def finish_publish(root: Path, tag: str) -> None:
    """Put a pending new copy of ``tag`` in place of the old one (retired, then deleted); a
    kill at any point leaves one of them where `tag_path` finds it."""
    pending, final, retired = pending_path(root, tag), root / tag, root / f".old-{tag}"
    shutil.rmtree(retired, ignore_errors=True)
    if not pending.exists():
        return
    if final.exists():
        os.rename(final, retired)
    os.rename(pending, final)
    _fsync_dir(root)
    shutil.rmtree(retired, ignore_errors=True)


class FileWriter:
    """Where a save writes its files: a local or shared file system, published atomically
    (`write_file`, `write_text`, `publish`, `finish_publish` above). The engine saves through
    its ``checkpoint_writer``; another storage, or a test that makes a write fail, passes an
    object with these four methods instead."""

    def write_file(self, path: Path, payload: Any) -> dict[str, int | str]:
        return write_file(path, payload)

    def write_text(self, path: Path, text: str) -> None:
        write_text(path, text)

    def publish(self, root: Path, staging: Path, tag: str) -> None:
        publish(root, staging, tag)

    def finish_publish(self, root: Path, tag: str) -> None:
        finish_publish(root, tag)


FILES = FileWriter()


def tag_path(root: Path, tag: str) -> Path:
    """The directory holding ``tag``: its pending new copy while a re-save is being moved into
    place (it exists only once complete), else ``root/tag``."""
    pending = pending_path(root, tag)
    return pending if (pending / MANIFEST).is_file() or (pending / DCP_MANIFEST).is_file() else root / tag


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def sha256_of(path: Path, descriptor: int | None = None) -> str:
    """The SHA-256 of the file at ``path``, or of the open file ``descriptor`` (``path`` then
    only names it)."""
    digest = hashlib.sha256()
    if descriptor is None:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()
    offset = 0
    while block := os.pread(descriptor, 1 << 20, offset):
        digest.update(block)
        offset += len(block)
    return digest.hexdigest()


class VerifiedFiles:
    """The files of one checkpoint directory, open since they were verified: a reader reads
    these very files (their inodes), whatever renames or deletions happen to their names
    meanwhile (a re-save of the tag moving its new copy into place, `finish_publish`)."""

    def __init__(self, directory: int) -> None:
        self.directory = directory  # the tag directory, open
        self.opened: dict[str, int] = {}  # file name -> its descriptor

    def open(self, name: str) -> int:
        descriptor = os.open(name, os.O_RDONLY, dir_fd=self.directory)
        self.opened[name] = descriptor
        return descriptor

    def close(self) -> None:
        for descriptor in [*self.opened.values(), self.directory]:
            try:
                os.close(descriptor)
            except OSError:
                pass
        self.opened.clear()
        self.directory = -1

    def __del__(self) -> None:
        if self.directory >= 0:
            self.close()


class Checkpoint(NamedTuple):
    path: Path
    manifest: dict[str, Any]
    files: VerifiedFiles | None = None  # open since verified (None: a translated DeepSpeed checkpoint)

    def read(self, name: str) -> Any:
        """A file of the checkpoint, read as verified (`read_file`): through the descriptor
        verification opened, never by its name again."""
        if self.files is None or name not in self.files.opened:
            return read_file(self.path / name)
        return read_file(_descriptor_path(self.files.opened[name]), shown=self.path / name)

    def close(self) -> None:
        """Let the verified files go (what was read from them stays mapped)."""
        if self.files is not None:
            self.files.close()


def _descriptor_path(descriptor: int) -> Path:
    """A path that opens the same file as ``descriptor`` (Linux's /proc/self/fd; /dev/fd elsewhere)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(folder):
            return Path(folder) / str(descriptor)
    raise OSError("no /proc/self/fd or /dev/fd here: cannot read a file by its descriptor")


def open_checkpoint(directory: str | Path, tag: str | None = None) -> Checkpoint:
    """Resolve ``tag`` (default: ``latest``), check the manifest and verify every file against
    it, keeping each open: `Checkpoint.read` reads exactly the bytes verified (reliability review
    D2: reopened by name, a file could be another copy's).

    A re-save of the tag may move the copy being read (its pending new copy into place, the old
    one aside and deleted: `finish_publish`) while it is verified: the directory is opened first
    and every file through it, so a verification reads one copy or fails on a file deleted
    under it; a failure while the tag's directory is no longer the one opened resolves again,
    so a reader polling a tag that is re-saved always finds a complete copy."""
    root = Path(directory)
    for attempt in range(_READ_ATTEMPTS):
        path = tag_path(root, resolve_tag(root, tag))
        opened: list[tuple[int, int]] = []  # the directory's identity, once open
        try:
            checkpoint = _verified(path, opened)
        except (FileNotFoundError, CheckpointError):
            if attempt == _READ_ATTEMPTS - 1 or not _moved(root, tag, path, opened):
                raise  # not a move: the copy itself is incomplete or corrupted
            continue
        if _moved(root, tag, path, opened):  # moved into place while verified: named where it is now
            now = tag_path(root, resolve_tag(root, tag))
            if opened[0] == _identity(now):
                checkpoint = checkpoint._replace(path=now)
        return checkpoint
    raise AssertionError("unreachable")


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


_READ_ATTEMPTS = 5  # a move takes two renames; each retry follows one


def _moved(root: Path, tag: str | None, path: Path, opened: list[tuple[int, int]]) -> bool:
    """Whether the tag's directory is not (or no longer) the one a failed verification read."""
    try:
        if tag_path(root, resolve_tag(root, tag)) != path:
            return True
    except (FileNotFoundError, CheckpointError):
        return True
    return not opened or opened[0] != _identity(path)


def _verified(path: Path, opened: list[tuple[int, int]]) -> Checkpoint:
    """The checkpoint in ``path``: its manifest checked, every file against it, read through
    the directory opened once (its identity appended to ``opened``)."""
    manifest_path = path / MANIFEST
    try:
        directory = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"{manifest_path}: missing; {path} is not a complete checkpoint") from None
    files = VerifiedFiles(directory)
    try:
        stat = os.fstat(directory)
        opened.append((stat.st_dev, stat.st_ino))
        manifest = _read_manifest(files, manifest_path, path)
        for name, expected in manifest["files"].items():
            file = path / name
            try:
                descriptor = files.open(name)
            except FileNotFoundError:
                raise CheckpointError(f"{file}: listed in the manifest but missing") from None
            check_listed(file, descriptor, expected)
    except BaseException:
        files.close()
        raise
    return Checkpoint(path, manifest, files)


def check_listed(file: Path, descriptor: int, expected: dict[str, Any], listing: str = "the manifest") -> None:
    """The open ``file`` against its size and SHA-256 as ``listing`` records them."""
    size = os.fstat(descriptor).st_size
    if size != expected["bytes"]:
        raise CheckpointError(f"{file}: {size} bytes, {listing} says {expected['bytes']} (truncated?)")
    if sha256_of(file, descriptor) != expected["sha256"]:
        raise CheckpointError(f"{file}: checksum does not match {listing} (corrupted)")


def _read_manifest(files: VerifiedFiles, manifest_path: Path, path: Path) -> dict[str, Any]:
    try:
        descriptor = os.open(MANIFEST, os.O_RDONLY, dir_fd=files.directory)
    except FileNotFoundError:
        raise FileNotFoundError(f"{manifest_path}: missing; {path} is not a complete checkpoint") from None
    with os.fdopen(descriptor, "r") as handle:
        text = handle.read()
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{manifest_path}: corrupted ({err})") from None
    _check_manifest(manifest, manifest_path)
    return manifest


def resolve_tag(root: Path, tag: str | None) -> str:
    """``tag``, or the one ``root/latest`` names, checked to be a directory name inside ``root``
    (this engine's checkpoints and DeepSpeed's write ``latest`` alike)."""
    check_root(root)
    if tag is None:
        pointer = root / LATEST
        if not pointer.is_file():
            raise FileNotFoundError(f"{pointer}: no 'latest' file; is {root} a checkpoint directory?")
        tag = pointer.read_text().strip()
        _check_read_tag(root, tag, f"{pointer} names tag")
    else:
        _check_read_tag(root, tag, "tag")
    return tag


def _check_read_tag(root: Path, tag: str, what: str) -> None:
    """A tag is a plain name, and it stays inside ``root`` once symbolic links are followed (a
    ``latest`` copied or edited by hand could point anywhere)."""
    if not _is_plain_name(tag) or tag == LATEST:
        raise CheckpointError(
            f"{what} {tag!r}: a tag is a plain name of a directory inside {root} (no '/', not starting with '.')"
        )
    for candidate in (root / tag, pending_path(root, tag)):
        if candidate.exists() and candidate.resolve().parent != root.resolve():
            raise CheckpointError(
                f"{what} {tag!r}: {candidate} leads outside {root} (to {candidate.resolve()}); a checkpoint's tags "
                "are directories inside it"
            )


# What manifest.json must hold, and of which type (json's): checked before any file is read.
_MANIFEST_KEYS: dict[str, type | tuple[type, ...]] = {
    "format": str, "world_size": int, "params": dict, "files": dict,
}


def _check_manifest(manifest: Any, path: Path) -> None:
    """Every key the reader uses, of its type, and the files the world size implies listed: all
    problems at once, before any tensor is read."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: malformed: a JSON object is expected, found {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    problems = [
        f"{key!r} is missing" if key not in manifest else f"{key!r} is {type(manifest[key]).__name__}, not {kind.__name__}"
        for key, kind in _MANIFEST_KEYS.items()
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool)
    ]
    if not problems:
        problems += _manifest_entry_problems(manifest)
    if problems:
        raise CheckpointError(f"{path}: malformed: " + "; ".join(problems))


def _manifest_entry_problems(manifest: dict[str, Any]) -> list[str]:
    problems = []
    ranks, files = manifest["world_size"], manifest["files"]  # one file per rank that wrote it
    if ranks < 1:
        problems.append(f"world_size is {ranks}")
    for name, entry in files.items():
        if not _is_plain_name(name):
            problems.append(f"files lists {name!r}, not a file of this directory")
        elif not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)):
            problems.append(f"files[{name!r}] is {entry!r}, not {{'bytes': int, 'sha256': str}}")
    expected = [rank_file(rank) for rank in range(max(ranks, 0))] + [EXTRA]
    unlisted = [name for name in expected if name not in files]
    if unlisted:
        problems.append(f"world_size {ranks} needs {', '.join(unlisted)} in files, which lists {sorted(files)}")
    for name, entry in manifest["params"].items():
        shape, aliases = (entry.get("shape"), entry.get("aliases")) if isinstance(entry, dict) else (None, None)
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(aliases, list) and all(isinstance(a, str) for a in aliases)):
            problems.append(f"params[{name!r}] is {entry!r}, not {{'shape': [int], 'aliases': [str]}}")
    return problems


def read_file(path: Path, shown: Path | None = None) -> Any:
    """A checkpoint file, read without running code from it; a refusal names the file
    (``shown``, where ``path`` opens it by its descriptor)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise refused_pickle(shown or path, err) from None


def refused_pickle(path: Path | str, err: pickle.UnpicklingError) -> CheckpointError:
    """The error for a file whose pickle would run code: the file, what it holds, what to do
    (never "load it with weights_only=False": nothing here runs code from a file)."""
    detail = next((line for line in str(err).splitlines() if "Unsupported global" in line), "")
    return CheckpointError(
        f"{path}: refused by torch.load(weights_only=True), which never runs code from a file "
        f"({detail.strip() or 'it holds Python objects besides tensors'}); save it again with tensors, numbers, "
        "strings and containers of them alone (a state dict, or safetensors), in a process that trusts it"
    )


def write_atomically(out: Path, write: Callable[[Path], Any]) -> Path:
    """``write`` a staging file beside ``out``, then put it in place: ``out`` is never half-written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.tmp")
    write(staging)
    os.replace(staging, out)
    return out
