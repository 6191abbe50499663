"""Blockwise symmetric integer quantization of values in transit (ZeRO++'s qwZ and qgZ).

A run of ``numel`` values is cut into blocks of at most ``block`` elements. Each block travels
as one fp32 scale (its largest magnitude over ``qmax``) and one signed integer per element,
rounded to nearest: int8 (``qmax`` 127) or int4 (``qmax`` 7, two to a byte). An element's error
is at most half its block's scale: ``absmax / 254`` in int8, ``absmax / 14`` in int4.

The encoded form is one byte buffer, ``[integers | padding to 4 bytes | scales]``, whose length
depends on ``numel`` alone (`BlockQuantizer.encoded_bytes`): a collective moves many such
segments side by side in one uint8 tensor and each receiver finds its segments without a
header. The segments of one collective are encoded and decoded together, as the rows of one
tensor (`encode_rows`, `decode_rows`): a fixed number of kernels whatever the number of ranks
(GPU review P3: one encode per destination launched O(ranks) small kernels per bucket). Nothing
here communicates; the codecs in `zero_engine.sharding.shards.codec` do.
"""

from __future__ import annotations

import threading
import weakref

import torch

BLOCK = 2048  # elements per scale: DeepSpeed's ZeRO++ default group size for qwZ
# Elements `BlockQuantizer.decode_rows_into` widens to fp32 at a time (`encode_rows`: `encode_chunk`):
# 4 MiB on a CPU, where it runs on one thread and a small buffer stays in cache; 64 MiB elsewhere,
# where each call is a kernel launch and a 7B model's unit (25M elements a shard at 8 ranks) should
# take a few.
DECODE_CHUNK_CPU = 1 << 20
DECODE_CHUNK_ACCELERATOR = 1 << 24


class BlockQuantizer:
    """Encode and decode runs of values as ``bits``-bit integers with one scale per block."""

    def __init__(self, bits: int = 8, block: int = BLOCK) -> None:
        if bits not in (4, 8):
            raise ValueError(f"quantization to {bits} bits: only 8 and 4 are built")
        if block < 2 or block % 2:
            raise ValueError(f"block of {block} elements: must be even and at least 2")
        self.bits, self.block = bits, block
        self.qmax = 2 ** (bits - 1) - 1

    def _sizes(self, numel: int) -> tuple[int, int, int]:
        """(blocks, payload bytes, payload bytes padded to a multiple of 4) for ``numel`` values."""
        blocks = -(-numel // self.block)
        payload = numel if self.bits == 8 else (numel + 1) // 2
        return blocks, payload, -(-payload // 4) * 4

    def encoded_bytes(self, numel: int) -> int:
        """Bytes of the encoded form of ``numel`` values (a multiple of 4)."""
        blocks, _, padded = self._sizes(numel)
        return padded + 4 * blocks

    def encode(self, values: torch.Tensor, out: torch.Tensor, numel: int | None = None) -> None:
        """Write the encoded form of ``values`` (1-D, floating) into ``out`` (uint8,
        `encoded_bytes` long). ``numel``: the run's length when longer than ``values`` (the
        missing tail counts as zeros: a last shard shorter than the others)."""
        self.encode_rows(values.view(1, -1), out.view(1, -1), numel)

    def encode_rows(self, values: torch.Tensor, out: torch.Tensor, numel: int | None = None) -> None:
        """`encode` each row of ``values`` (2-D, floating) into the same row of ``out`` (uint8,
        ``encoded_bytes(numel)`` per row), all rows at once, a span of whole blocks at a time:
        the fp32 work of one pass is at most `encode_chunk` elements (or one block per row), so
        encoding a large unit never widens all of it at once (int8 frozen weights widened whole
        at `initialize` peaked at 2.2x a LoRA Llama's bytes on an H100, 2.5x on a CPU; now 1.59x
        and 1.04x). Blocks are independent: the bytes are the same."""
        rows, given = values.shape
        numel = given if numel is None else numel
        blocks, _, padded = self._sizes(numel)
        scales = out[:, padded : padded + 4 * blocks].view(torch.float32)
        span = max(1, encode_chunk(values.device) // (max(rows, 1) * self.block)) * self.block
        for start in range(0, numel, span):
            end = min(numel, start + span)
            if self.bits == 8:
                integers = out[:, start:end]
            else:  # two to a byte; a span starts at a block boundary, which is even
                integers = out[:, start // 2 : (end + 1) // 2]
            self._encode_span(values[:, start : min(end, given)], end - start, integers,
                              scales[:, start // self.block : -(-end // self.block)])

    def _encode_span(self, values: torch.Tensor, numel: int, integers: torch.Tensor, scales: torch.Tensor) -> None:
        """Encode rows of ``numel`` values starting at a block boundary (``values`` may be
        shorter: the missing tail counts as zeros) into their integers and their blocks' scales."""
        rows, given = values.shape
        blocks = -(-numel // self.block)
        x = torch.zeros(rows, blocks * self.block, dtype=torch.float32, device=values.device)
        x[:, :given] = values
        x = x.view(rows, blocks, self.block)
        # Times the reciprocal, not divided by qmax: CUDA divides by a scalar that way, the CPU
        # exactly, so ranks on either would disagree by an ulp of a scale (seen on an H200);
        # a multiplication rounds alike on both.
        found = x.abs().amax(dim=2).mul_(1.0 / self.qmax)
        found = torch.where(found > 0, found, torch.ones_like(found))  # an all-zero block decodes to zeros
        q = x.div_(found[..., None]).round_().clamp_(-self.qmax, self.qmax).to(torch.int8).view(rows, -1)[:, :numel]
        if self.bits == 4:
            q = _pack_nibbles(q)
        integers.copy_(q.view(torch.uint8))
        scales.copy_(found)

    def decode(self, encoded: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``numel`` values (fp32) of an encoded run; written into ``out`` (any floating
        dtype, ``numel`` long or shorter: the tail is dropped) when given."""
        values = self.decode_rows(encoded.view(1, -1), numel)[0]
        if out is not None:
            out.copy_(values[: out.numel()])
        return values

    def decode_rows(self, encoded: torch.Tensor, numel: int) -> torch.Tensor:
        """`decode` each row of ``encoded`` (uint8, ``encoded_bytes(numel)`` per row): the
        values as rows of fp32, all at once."""
        rows = encoded.shape[0]
        blocks, payload, padded = self._sizes(numel)
        scales = encoded[:, padded : padded + 4 * blocks].view(torch.float32)
        q = encoded[:, :payload]
        q = _unpack_nibbles(q, numel) if self.bits == 4 else q.view(torch.int8)
        values = torch.zeros(rows, blocks * self.block, dtype=torch.float32, device=encoded.device)
        values[:, :numel] = q
        return values.view(rows, blocks, self.block).mul_(scales[..., None]).view(rows, -1)[:, :numel]


    def decode_rows_into(self, encoded: torch.Tensor, numel: int, out: torch.Tensor) -> None:
        """`decode_rows` into ``out`` (rows of ``numel``, any floating dtype), the same values,
        without an fp32 copy of the rows: in int8 the integers are widened into a small fp32
        buffer (at most `decode_chunk` elements, and no more than the rows hold: several short
        rows, or blocks of a long one, at a time), scaled there and written into ``out``.
        Gathers decode this way (an int8 frozen unit's whole buffer at every use, qwZ's shards
        of the others): a quarter of `decode_rows`' time on a CPU, and a fixed number of calls
        per `decode_chunk` elements whatever the number of rows."""
        if self.bits != 8:
            out.copy_(self.decode_rows(encoded, numel))
            return
        rows = encoded.shape[0]
        blocks, _, padded = self._sizes(numel)
        scales = encoded[:, padded : padded + 4 * blocks].view(torch.float32)
        q = encoded[:, :numel].view(torch.int8)
        chunk = min(decode_chunk(encoded.device), rows * numel)
        # Made for this call, on the current stream, and let go after it: nothing is held between
        # gathers (a buffer kept per quantizer was 4 MiB beside a small model's int8 shards,
        # reliability review item 5), and a decode under another stream cannot reuse it while a
        # decode queued on the compute stream still reads it (GPU review Q8).
        scratch = torch.empty(max(chunk, 1), dtype=torch.float32, device=encoded.device)
        if numel <= chunk:  # whole rows, several at a time
            step = chunk // max(numel, 1)
            for first in range(0, rows, step):
                last = min(rows, first + step)
                self._decode_span(q[first:last], scales[first:last], out[first:last], scratch)
            return
        span = chunk // self.block * self.block  # blocks of one row at a time
        for row in range(rows):
            for start in range(0, numel, span):
                end = min(numel, start + span)
                first_block = start // self.block
                self._decode_span(
                    q[row : row + 1, start:end], scales[row : row + 1, first_block:], out[row : row + 1, start:end],
                    scratch,
                )

    def _decode_span(self, q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> None:
        """Rows of integers starting at a block boundary, their blocks' scales from the first."""
        rows, numel = q.shape
        values = scratch[: rows * numel].view(rows, numel)
        values.copy_(q)
        whole = numel // self.block
        if whole:
            values[:, : whole * self.block].view(rows, whole, self.block).mul_(scales[:, :whole, None])
        if whole * self.block < numel:
            values[:, whole * self.block :].mul_(scales[:, whole : whole + 1])
        out.copy_(values)


def decode_chunk(device: torch.device) -> int:
    """How many elements a decode widens to fp32 at a time on ``device``."""
    return DECODE_CHUNK_CPU if device.type == "cpu" else DECODE_CHUNK_ACCELERATOR


def encode_chunk(device: torch.device) -> int:
    """How many elements an encode widens to fp32 at a time on ``device``: a quarter of a
    decode's on an accelerator, as an encode holds 9 bytes an element (the fp32 values, their
    absolute values, the integers) where a decode holds 4, and runs at `initialize` beside the
    whole model (int8 frozen weights) rather than at every gather."""
    return DECODE_CHUNK_CPU if device.type == "cpu" else DECODE_CHUNK_ACCELERATOR // 4


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Rows of int8 values in [-7, 7] as unsigned nibbles (offset 8), two to a byte, low one first."""
    shifted = (q.to(torch.int16) + 8).to(torch.uint8)
    if shifted.shape[1] % 2:
        shifted = torch.cat([shifted, shifted.new_full((shifted.shape[0], 1), 8)], dim=1)
    pairs = shifted.view(shifted.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=2).view(packed.shape[0], -1)[:, :numel]


class BufferMeter:
    """Bytes of encoded buffers alive now and at most since `reset` (for ``memory_report``).
    A buffer counts until its tensor is freed, however the collective that used it ended.
    Counted under a lock: hybrid second phases encode on a thread of their own on gloo
    (`zero_engine.comm.handles.SecondPhaseThread`)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()

    def hold(self, buffer: torch.Tensor) -> torch.Tensor:
        nbytes = buffer.untyped_storage().nbytes()
        with self._lock:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(buffer, self._release, nbytes)
        return buffer

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes

    def reset(self) -> None:
        with self._lock:
            self.peak = self.live
