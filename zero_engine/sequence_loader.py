"""Any per-rank data loader made right for ``sequence_parallel_size``.

The ranks of a sequence group split one micro-batch between them, so they must read the same
micro-batches; a loader sharded over every rank (a ``DistributedSampler`` left at the world
size) gives each its own. `SequenceGroupLoader` shares them instead, as DeepSpeed's
``UlyssesSPDataLoaderAdapter`` does: at each step every rank reads its own loader's next batch,
the group's ranks exchange them, and each rank yields the group's ``k`` batches in the group's
rank order, whole (the engine splits each one). No sample is dropped or read twice: a loader
sharded over ``world`` ranks trains on every one of its samples, ``k`` times the steps per
epoch, each optimizer step's data the same as at ``k = 1`` over the same samples.

The exchange: each rank's batch layout (its tensors' shapes and dtypes, in the order
`zero_engine.tree.iter_tensors` visits them) over the control group, then each rank's tensors
broadcast from it over the sequence group, on the engine's device. A batch is a tensor or any
nesting of dicts, lists, tuples and dataclasses the engine takes (a Hugging Face collator's
dict); its other values are this rank's own (the layout must match within the group). When one
rank's loader ends, every rank's does, at the same step.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .tree import iter_tensors, map_tensors


class SequenceGroupLoader:
    """``loader`` (any iterable of batches, one per rank) with each batch shared over its sequence
    group: every rank yields the group's ``k`` batches in turn. At ``k = 1``, ``loader`` as it is."""

    def __init__(self, loader: Iterable[Any], engine: Any) -> None:
        self.loader = loader
        self.engine = engine

    @property
    def _k(self) -> int:
        return self.engine.comm.mesh.size("sequence")

    def __len__(self) -> int:
        return len(self.loader) * self._k  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if self._k == 1:
            yield from self.loader
            return
        batches = iter(self.loader)
        while True:
            shared = share_over_group(self.engine, next(batches, None))
            if shared is None:
                return
            yield from shared


def share_over_group(engine: Any, batch: Any) -> list[Any] | None:
    """Every batch of this rank's sequence group, in group rank order (collective over every
    rank: each calls it once per step); None once some rank's loader has ended (``batch`` None)."""
    comm = engine.comm
    k = comm.mesh.size("sequence")
    leader = comm.mesh.group_of("sequence", comm.rank)[0]
    mine = [] if batch is None else list(iter_tensors(batch))
    layout = None if batch is None else [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in mine]
    layouts = comm.all_gather_json(layout)
    if any(entry is None for entry in layouts):
        return None
    group = layouts[leader : leader + k]
    if any(len(entry) != len(layout) for entry in group):
        raise ValueError(
            f"SequenceGroupLoader: the ranks of sequence group {list(range(leader, leader + k))} gave batches of "
            f"different layouts ({[len(entry) for entry in group]} tensors): every rank's loader must collate alike"
        )
    shared = []
    for source, entry in enumerate(group):
        if leader + source == comm.rank:
            tensors = [t.to(engine.device).contiguous() for t in mine]
        else:
            tensors = [torch.empty(shape, dtype=getattr(torch, dtype), device=engine.device) for shape, dtype in entry]
        comm.sequence_group.broadcast(tensors, src=source)
        received = iter(tensors)
        shared.append(map_tensors(lambda _: next(received), batch))
    return shared


def share_leaders_rows(
    engine: Any, rows: list[list[int]], values: list[list[float]] | None = None
) -> tuple[list[list[int]], list[list[float]] | None]:
    """The sequence group's first rank's ``rows`` (lists of token ids of any lengths, as many on
    every rank of the group) and ``values`` (one float per id, or None), on every rank of the
    group: what a per-rank sampling step (TRL's completions) made on each rank made the same
    (collective over every rank: each calls it once per generation)."""
    comm = engine.comm
    leader = comm.mesh.group_of("sequence", comm.rank)[0]
    lengths, with_values = comm.all_gather_json([[len(row) for row in rows], values is not None])[leader]
    if len(lengths) != len(rows):
        raise ValueError(
            f"rank {comm.rank} made {len(rows)} rows where the first rank of its sequence group ({leader}) made "
            f"{len(lengths)}: the ranks of a sequence group must be given the same prompts"
        )
    mine = comm.rank == leader
    ids = torch.tensor([t for row in rows for t in row] if mine else [0] * sum(lengths), dtype=torch.int64)
    shared = [ids.to(engine.device)]
    if with_values:
        flat = [v for row in values for v in row] if mine and values is not None else [0.0] * sum(lengths)
        shared.append(torch.tensor(flat, dtype=torch.float64, device=engine.device))
    comm.sequence_group.broadcast(shared, src=0)
    split = [part.cpu().split(lengths) for part in shared]
    return [row.tolist() for row in split[0]], [row.tolist() for row in split[1]] if with_values else None


def share_leaders_rng(engine: Any) -> None:
    """Every rank of the sequence group continues from its first rank's random state (torch's
    host generator, this rank's GPU's on CUDA, Python's ``random``): what a trainer draws
    outside the model for the group's one batch (TRL's shuffle of a generation batch, its
    sampling, a reward that draws) drawn alike on the group's ranks, as one rank draws it
    (collective over the sequence group: one broadcast)."""
    version, words, gauss = random.getstate()  # Mersenne Twister: 625 words below 2**32, a cached gauss
    python_state = [torch.tensor(words, dtype=torch.int64),
                    torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64)]
    states = [torch.get_rng_state(), *python_state, *_device_rng_states(engine.device)]
    moved = [state.to(engine.device) for state in states]
    engine.comm.sequence_group.broadcast(moved, src=0)
    host, words_moved, gauss_moved, *device = [state.cpu() for state in moved]
    torch.set_rng_state(host)
    _set_device_rng_states(engine.device, device)
    cached = float(gauss_moved[1]) if gauss_moved[0] else None
    random.setstate((version, tuple(int(word) for word in words_moved.tolist()), cached))


def _device_rng_states(device: torch.device) -> list[torch.Tensor]:
    """CUDA only: this rank's GPU generator state."""
    return [torch.cuda.get_rng_state(device)] if device.type == "cuda" else []


def _set_device_rng_states(device: torch.device, states: list[torch.Tensor]) -> None:
    """CUDA only: this rank's GPU generator state set."""
    if device.type == "cuda" and states:
        torch.cuda.set_rng_state(states[0], device)
