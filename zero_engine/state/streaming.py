"""``engine.named_full_parameters()``: the whole model, one full tensor at a time, as an inference
server's weight sync takes it (vLLM's ``load_weights`` in GRPO / PPO), never the model at once.

Every entry of ``module.state_dict()`` is yielded in its order, as `ModelState.full_state_dict`
has it (parameters as their fp32 masters, frozen weights as stored, buffers), but on the
engine's device and one *bucket* at a time: consecutive sharded entries of one dtype up to
``bucket_bytes``, each rank packing the elements it keeps of them into its piece of one
buffer (pieces of their own sizes: a broadcast from each owner, or point to point onto rank 0;
an all-gather would pad every piece to the largest, and a parameter often lies in one rank's
shard), then each entry unpacked into its own tensor as its turn comes. Entries every rank
holds whole (stage 0's masters, loose parameters, buffers) need no collective. So a rank holds
at most one gathered bucket and the tensor it is yielding; a tensor larger than the bucket is a
bucket of its own, and the buffer it was gathered into is the tensor yielded.

With ``merge_adapters`` a PEFT LoRA model leaves as its merged base (`zero_engine.state.adapters`),
every adapter held whole once for the whole stream (they are a small part of the model).

A call row goes before each bucket's gather and one at the end, however the stream ends
(`_rows`): a rank that stops early or streams alone raises `DivergedRanksError` on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import offload
from ..comm import Comm
from ..errors import DivergedRanksError
from ..sharding.gathering.agreement import Call
from .adapters import AdapterMerge

if TYPE_CHECKING:
    from ..sharding.units.frozen_unit import FrozenUnit
    from ..sharding.units.unit import FlatUnit
    from .state_dict import ModelState


@dataclass
class Entry:
    """One state-dict entry: whole on every rank (``whole``), or a parameter sharded by its unit."""

    name: str
    whole: torch.Tensor | None = None
    unit: FlatUnit | FrozenUnit | None = None
    index: int = 0
    cut: bool = False  # parts on several ranks (an expert's weights): gathered whole alone (`ModelState.whole_value`)

    @property
    def dtype(self) -> torch.dtype:
        if self.whole is not None:
            return self.whole.dtype
        return torch.float32 if self.unit.optimizer_shard is not None else self.unit.dtype

    @property
    def numel(self) -> int:
        return self.whole.numel() if self.whole is not None else self.unit.layout.param_numels[self.index]

    def pieces(self, rank: int) -> tuple[int, int, int]:
        """What rank ``rank`` keeps of this parameter: (offset in the parameter, offset in that
        rank's shard, length; 0 when nothing)."""
        layout = self.unit.layout
        offset, numel = layout.param_offsets[self.index], layout.param_numels[self.index]
        start, end = layout.shard_range(rank)
        lo, hi = max(offset, start), min(offset + numel, end)
        return (lo - offset, lo - start, hi - lo) if lo < hi else (0, 0, 0)


def entries(model_state: ModelState) -> list[Entry]:
    """Every ``state_dict()`` entry, in its order, with where its full values come from."""
    placed = model_state.placement()
    by_name = dict(model_state.module.named_parameters(remove_duplicate=False))
    found = []
    for name, tensor in model_state.module.state_dict(keep_vars=True).items():
        param = by_name.get(name)
        if param is None:
            found.append(Entry(name, whole=tensor.detach()))
        elif param in placed:
            unit, index = placed[param]
            whole = model_state.whole_master(unit)  # stage 0's masters, stages 1-2's in fp32: no collective
            if unit.is_cut:
                found.append(Entry(name, unit=unit, index=index, cut=True))
            elif whole is not None:
                found.append(Entry(name, whole=unit.view_of(whole, index)))
            else:
                found.append(Entry(name, unit=unit, index=index))
        else:  # loose: a frozen parameter below stage 3, or one left out of every param group
            found.append(Entry(name, whole=model_state.loose_masters.get(param, param).detach()))
    return found


def stream(
    model_state: ModelState,
    comm: Comm,
    device: torch.device,
    *,
    bucket_bytes: int,
    dtype: torch.dtype | None,
    rank0_only: bool,
    merge: AdapterMerge | None,
    gathered: Callable[[list[nn.Parameter]], Any],
    agree: Callable[[Call, int], None],
    wanted: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """See the module's docstring; ``gathered`` is `Engine.gathered` (for the adapters of a
    merge, held once for the whole stream); ``agree`` sends a call row (`_rows`); ``wanted``:
    the state-dict names to stream (the others are neither gathered nor yielded)."""
    if merge is None:
        yield from _rows(_entries_out(model_state, comm, device, bucket_bytes, dtype, rank0_only, None, wanted), agree)
        return
    with gathered(merge.adapter_params_of_all()):  # every adapter whole once, not once per LoRA layer (Q3)
        yield from _rows(_entries_out(model_state, comm, device, bucket_bytes, dtype, rank0_only, merge, wanted), agree)


def _rows(
    entries: Iterator[tuple[str, torch.Tensor] | int], agree: Callable[[Call, int], None]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The entries, with a call row before each bucket's gather (its number) and one at the end
    (how many buckets were gathered), however the stream ends: a rank that stops iterating early
    (a ``break``, an exception in the consumer: the generator is closed) or streams alone sends
    rows that differ from the others', so every rank raises `DivergedRanksError` at once instead
    of waiting in the next gather until the timeout (reliability review D4)."""
    buckets, diverged = 0, False
    try:
        for item in entries:
            if isinstance(item, int):  # a bucket's gather comes next
                try:
                    agree(Call.FULL_PARAMETERS_BUCKET, item)
                except DivergedRanksError:
                    diverged = True
                    raise
                buckets = item + 1
                continue
            yield item
    finally:
        if not diverged:
            agree(Call.FULL_PARAMETERS_END, buckets)


def _entries_out(
    model_state: ModelState,
    comm: Comm,
    device: torch.device,
    bucket_bytes: int,
    dtype: torch.dtype | None,
    rank0_only: bool,
    merge: AdapterMerge | None,
    wanted: Callable[[str], bool] | None,
) -> Iterator[tuple[str, torch.Tensor] | int]:
    """Every entry as it leaves, and before each bucket's gather the bucket's number."""
    keep = not rank0_only or comm.rank == 0
    bucket: list[Entry] = []
    gathered_buckets = 0

    def emit(entry: Entry, values: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if merge is None:
            if keep:
                yield entry.name, _cast(values, dtype)
            return
        name = merge.rename(entry.name)
        if name is None:
            return
        layer = merge.layer_of(entry.name)
        if layer is not None and keep:
            values = merge.merged(layer, values)
        if keep:
            yield name, _cast(values, dtype)

    def flush() -> Iterator[tuple[str, torch.Tensor] | int]:
        nonlocal gathered_buckets
        if bucket:
            yield gathered_buckets
            gathered_buckets += 1
            for entry, values in _gather_bucket(bucket, comm, device, rank0_only):
                yield from emit(entry, values)
            bucket.clear()

    for entry in entries(model_state):
        if wanted is not None and not wanted(entry.name):
            continue
        if entry.cut:  # a bucket of its own, gathered on every rank (`ModelState.whole_value`)
            yield from flush()
            yield gathered_buckets
            gathered_buckets += 1
            yield from emit(entry, model_state.whole_value(entry.unit, entry.index))
            continue
        if entry.whole is not None:
            yield from flush()
            yield from emit(entry, entry.whole.detach().to(device, copy=True) if keep else entry.whole)
            continue
        size = sum(e.numel for e in bucket) + entry.numel
        itemsize = torch.empty(0, dtype=entry.dtype).element_size()
        if bucket and (bucket[0].dtype != entry.dtype or size * itemsize > bucket_bytes):
            yield from flush()
        bucket.append(entry)
    yield from flush()


def _cast(values: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return values if dtype is None or not values.is_floating_point() else values.to(dtype)


def _gather_bucket(
    bucket: list[Entry], comm: Comm, device: torch.device, rank0_only: bool
) -> Iterator[tuple[Entry, torch.Tensor | None]]:
    """One gather for the bucket's sharded entries (every unit of one job shards over the same
    group): each rank packs the elements it keeps of them, in order, into its piece of one
    buffer, pieces of their own sizes (no padding: a parameter often lies in one or two ranks'
    shards), then each entry is unpacked as its turn comes (None on ranks other than 0 with
    ``rank0_only``). A bucket of one entry needs no unpacking: its pieces in rank order are the
    parameter's elements in order, so the buffer is the tensor yielded."""
    unit = bucket[0].unit
    ranks = unit.layout.num_shards  # the shard group's size
    sizes = [sum(entry.pieces(rank)[2] for entry in bucket) for rank in range(ranks)]
    starts = [sum(sizes[:rank]) for rank in range(ranks)]
    keep = not rank0_only or comm.rank == 0
    flat = torch.empty(sum(sizes) if keep else sizes[unit.rank], dtype=bucket[0].dtype, device=device)
    pieces = [
        flat[starts[rank] : starts[rank] + sizes[rank]] if keep else (flat if rank == unit.rank else None)
        for rank in range(ranks)
    ]
    own, at = pieces[unit.rank], 0
    for entry in bucket:
        _, shard_offset, numel = entry.pieces(entry.unit.rank)
        if numel:
            with _kept_values(entry.unit) as kept:  # from pinned host memory, no host sync (GPU review Q2)
                offload.copy_across(own[at : at + numel], kept[shard_offset : shard_offset + numel])
            at += numel
    comm.gather_pieces(pieces, onto=0 if rank0_only else None).wait()
    del pieces, own
    if len(bucket) == 1:
        entry = bucket[0]
        yield entry, flat.view(entry.unit.shapes[entry.index]) if keep else None
        return
    offsets = list(starts)  # where each rank's next piece starts in ``flat``
    for entry in bucket:
        values = torch.empty(entry.numel, dtype=entry.dtype, device=device) if keep else None
        for rank in range(ranks):
            param_offset, _, numel = entry.pieces(rank)
            if numel and keep:
                values[param_offset : param_offset + numel] = flat[offsets[rank] : offsets[rank] + numel]
            offsets[rank] += numel
        yield entry, values.view(entry.unit.shapes[entry.index]) if keep else None
        values = None  # the consumer may have let it go: not held while the next is made


@contextmanager
def _kept_values(unit: FlatUnit | FrozenUnit) -> Iterator[torch.Tensor]:
    """What this rank keeps of a unit, over its shard range: a trainable unit's fp32 master (made
    resident for the read), a frozen unit's shard."""
    if unit.optimizer_shard is None:
        yield unit.shard_values()  # decoded when kept in int8
        return
    with unit.optimizer_shard.resident() as master:
        yield master
