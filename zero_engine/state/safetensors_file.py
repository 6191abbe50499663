"""One safetensors file written tensor by tensor, without numpy and without holding its tensors.

``safetensors.torch.save_file`` takes every tensor of the file at once (and needs numpy, which
the engine does not). Here the file's header comes first, from the planned names, dtypes and
shapes alone; each tensor's bytes follow as the tensor comes, so a writer holds one tensor at a
time. The format (safetensors' own, read by ``safe_open`` and ``from_pretrained``): an 8-byte
little-endian header length, the JSON header (``{name: {dtype, shape, data_offsets}}`` and
``__metadata__``), padded with spaces to 8 bytes, then the tensors' little-endian bytes in order.
The file is written to a staging name and put in place once its last tensor is in.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
}


class TensorSpec(NamedTuple):
    """A tensor as the file will hold it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def header_bytes(specs: Sequence[TensorSpec], metadata: dict[str, str] | None) -> bytes:
    """The length-prefixed, space-padded JSON header for ``specs`` stored back to back in order."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for spec in specs:
        if spec.dtype not in DTYPE_NAMES:
            raise ValueError(f"{spec.name!r}: safetensors has no dtype {spec.dtype}")
        header[spec.name] = {"dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class SafetensorsWriter:
    """Writes ``specs`` into ``out`` in order, one `write` per tensor; `close` puts the file in
    place once every tensor is in, `abort` removes the staging file."""

    def __init__(self, out: Path, specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("safetensors files are little-endian: writing them on this machine is not supported")
        self.out, self.specs = out, list(specs)
        self.staging = out.with_name(f".{out.name}.tmp")
        self._written = 0
        self._file = open(self.staging, "wb")  # noqa: SIM115 (open across writes, closed by close/abort)
        self._file.write(header_bytes(self.specs, metadata))

    @property
    def complete(self) -> bool:
        return self._written == len(self.specs)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor: it must be the next spec's (name and shape); converted to the
        spec's dtype on the host when it is not already that (one tensor's copy at most)."""
        spec = self.specs[self._written]
        if name != spec.name or tuple(tensor.shape) != spec.shape:
            raise RuntimeError(f"{self.out.name}: {name!r} {tuple(tensor.shape)} came where {spec.name!r} {spec.shape} belongs")
        data = tensor.detach().to("cpu", spec.dtype).contiguous()
        if data.numel():
            self._file.write((ctypes.c_char * spec.nbytes).from_address(data.data_ptr()))
        self._written += 1

    def close(self) -> Path:
        if not self.complete:
            raise RuntimeError(f"{self.out.name}: {len(self.specs) - self._written} tensor(s) never written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.staging, self.out)
        return self.out

    def abort(self) -> None:
        self._file.close()
        self.staging.unlink(missing_ok=True)
