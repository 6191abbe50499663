"""How values travel in collectives: the one seam where a gather or a reduction may change form.

Gathers. Every all-gather of a unit's compute values goes through `FlatUnit.gather` (stage 3's
gathers in forward and backward, the gather of updated parameters after a step at stages 1-2),
which asks the unit's codec to launch it. A codec starts the collective from the rank's own
shard and returns a `Gathering`: the collective in flight and what completes it once it is done.
`IdentityCodec` moves the values as they are. `QuantizedGatherCodec` (ZeRO++'s qwZ,
``zero_optimization.zero_quantized_weights``) all-gathers each shard encoded blockwise in int8
(`zero_engine.quantize`) and decodes the others' shards into the unit's buffer; the rank's own
shard stays exact. Exported masters are gathered exactly, outside any codec
(`FlatUnit.gather_masters`).

Reductions. Every gradient reduce-scatter of stages 1-3 goes through the reducer's `GradCodec`.
`ExactGrads` is `Comm`'s own reduce-scatter. `QuantizedGrads` (qgZ,
``zero_optimization.zero_quantized_gradients``) quantizes where ranks of different nodes meet:

- one shard group (no hybrid sharding): an all-to-all in which each rank sends each owner its
  slice of the gradients, encoded; the owner decodes them and sums them in fp32 with its own
  slice, kept exact. Each element is quantized once, on one hop, and every rank sends
  ``(N-1)/N`` of the encoded buffer: the volume of a ring reduce-scatter at a quarter of the
  bytes (int8, fp32 gradients). A ring or tree reduction of quantized values would quantize
  the partial sums again at every hop (error growing with the ranks); gathering everyone's
  encoded buffer and summing locally sends ``N - 1`` times more. NCCL runs the all-to-all as
  grouped send/receive, gloo natively, so it is the choice on both.
- hybrid sharding: inside the group (a node) the reduce-scatter stays exact; across groups the
  shard's all-reduce becomes an all-gather of each replica's encoded shard, summed in replica
  order by every replica from the decoded copies (its own too), so the replicas keep identical
  gradients and masters. That sends ``(R-1)`` encoded shards against the ring all-reduce's
  ``2 (R-1)/R`` exact ones, fewer bytes while ``R`` is below 8 (int8 of fp32) or 16 (int4):
  at more replicas the exact all-reduce is used, as it then moves fewer bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from ...comm import Comm, GroupComm
from ...comm.handles import DONE, CollectiveKind, Finishing, Pending, TwoPhase, used_on_current_stream
from ...devices import tensor_bytes
from ...quantize import BlockQuantizer, BufferMeter


# A unit's all-gather in flight and what completes it after the wait (decoding): the same
# object as a finishing reduction.
Gathering = Finishing


class GatherCodec(Protocol):
    def launch(self, comm: Comm, flat: torch.Tensor) -> Gathering:
        """Start filling every shard of ``flat`` with its owner's values (this rank's shard of
        ``flat`` holds its own already)."""
        ...


class IdentityCodec:
    """The values as they are, in the buffer's dtype."""

    def launch(self, comm: Comm, flat: torch.Tensor) -> Gathering:
        return Gathering(comm.all_gather(flat))


IDENTITY = IdentityCodec()


class QuantizedGatherCodec:
    """qwZ: each shard travels encoded (`BlockQuantizer`); the others' shards are decoded into
    ``flat``, the rank's own is left exact. The encoded buffer lives until the decode."""

    def __init__(self, quantizer: BlockQuantizer, meter: BufferMeter) -> None:
        self.quantizer, self.meter = quantizer, meter

    def launch(self, comm: Comm, flat: torch.Tensor) -> Gathering:
        num_shards, own = comm.num_shards, comm.shard_rank
        if num_shards == 1:  # the shard is the whole unit
            return Gathering(DONE)
        shards = flat.view(num_shards, -1)
        numel = shards.shape[1]
        size = self.quantizer.encoded_bytes(numel)
        encoded = self.meter.hold(torch.empty(num_shards * size, dtype=torch.uint8, device=flat.device))
        segments = encoded.view(num_shards, size)
        self.quantizer.encode(shards[own], segments[own])
        pending = comm.all_gather(encoded)

        def decode_others() -> None:  # every shard in one decode, then the own one put back exact
            exact = shards[own].clone()
            self.quantizer.decode_rows_into(segments, numel, shards)
            shards[own].copy_(exact)

        return Gathering(pending, decode_others)


Reduction = Pending | Finishing | TwoPhase


class GradCodec(Protocol):
    def reduce_scatter(self, comm: Comm, flat: torch.Tensor) -> Reduction:
        """Sum ``flat`` over every rank into this rank's shard of it (`Comm.reduce_scatter_sum`)."""
        ...

    def reduce_scatter_in_group(self, comm: Comm, flat: torch.Tensor) -> Reduction:
        """Sum ``flat`` over the shard group into this rank's shard of it."""
        ...

    def all_reduce_across_groups(self, comm: Comm, shard: torch.Tensor) -> Reduction:
        """Sum a shard over its replicas in the other shard groups."""
        ...


class ExactGrads:
    """Gradients in their reduction dtype, as they are."""

    def reduce_scatter(self, comm: Comm, flat: torch.Tensor) -> Reduction:
        return comm.reduce_scatter_sum(flat)

    def reduce_scatter_in_group(self, comm: Comm, flat: torch.Tensor) -> Reduction:
        return comm.reduce_scatter_in_group(flat)

    def all_reduce_across_groups(self, comm: Comm, shard: torch.Tensor) -> Reduction:
        return comm.all_reduce_across_groups(shard)


EXACT_GRADS = ExactGrads()


class QuantizedGrads:
    """qgZ: the hops between nodes carry encoded gradients, summed in fp32 after decoding
    (module docstring: which collective, and why)."""

    def __init__(self, quantizer: BlockQuantizer, meter: BufferMeter) -> None:
        self.quantizer, self.meter = quantizer, meter

    def reduce_scatter(self, comm: Comm, flat: torch.Tensor) -> Reduction:
        inside = self.reduce_scatter_in_group(comm, flat)
        if comm.num_replicas == 1:
            return inside
        shard = comm.shard_group.own_shard(flat)
        return TwoPhase(inside, lambda: self.all_reduce_across_groups(comm, shard), comm.second_phases, flat.device)

    def reduce_scatter_in_group(self, comm: Comm, flat: torch.Tensor) -> Reduction:
        if comm.num_replicas > 1:  # a node's own ranks: exact; the hop across groups is quantized
            return comm.reduce_scatter_in_group(flat)
        return self._all_to_all_reduce(comm.reduce_group, flat)

    def _all_to_all_reduce(self, group: GroupComm, flat: torch.Tensor) -> Reduction:
        num_shards, own = group.world_size, group.rank
        if num_shards == 1:
            return DONE
        slices = flat.view(num_shards, -1)
        numel = slices.shape[1]
        size = self.quantizer.encoded_bytes(numel)
        send = self.meter.hold(torch.empty(num_shards * size, dtype=torch.uint8, device=flat.device))
        received = self.meter.hold(torch.empty_like(send))
        # Every slice in one encode (the own one too, sent to itself and not read: one call
        # costs less than a call per destination, GPU review P3).
        self.quantizer.encode_rows(slices, send.view(num_shards, size))
        pending = group.all_to_all(send, received)

        def sum_into_own_slice() -> None:  # every slice in one decode, the own one exact, summed in rank order
            decoded = self.quantizer.decode_rows(received.view(num_shards, size), numel)
            decoded[own] = slices[own]
            slices[own].copy_(decoded.sum(dim=0))

        return Finishing(pending, sum_into_own_slice)

    def all_reduce_across_groups(self, comm: Comm, shard: torch.Tensor) -> Reduction:
        group = comm.replica_group
        replicas, own = group.world_size, group.rank
        size = self.quantizer.encoded_bytes(shard.numel())
        if not encoded_all_reduce_is_smaller(replicas, tensor_bytes(shard), size):
            return comm.all_reduce_across_groups(shard)
        encoded = self.meter.hold(torch.empty(replicas * size, dtype=torch.uint8, device=shard.device))
        segments = encoded.view(replicas, size)
        self.quantizer.encode(shard, segments[own])
        pending = group.all_gather(encoded, kind=CollectiveKind.ALL_REDUCE)

        def sum_in_replica_order() -> None:  # the same fp32 sums on every replica
            used_on_current_stream(encoded)  # made on the second phases' stream (NCCL)
            shard.copy_(self.quantizer.decode_rows(segments, shard.numel()).sum(dim=0))

        return Finishing(pending, sum_in_replica_order)


def encoded_all_reduce_is_smaller(replicas: int, exact_bytes: int, encoded_bytes: int) -> bool:
    """Whether an all-gather of the ``replicas`` encoded shards (each rank sends ``R - 1`` of
    them) moves fewer bytes than a ring all-reduce of the exact shard (``2 (R-1)/R`` of it)."""
    return replicas > 1 and (replicas - 1) * encoded_bytes < 2 * (replicas - 1) * exact_bytes / replicas


class Codecs(NamedTuple):
    """The engine's codecs, and the meter of their encoded buffers (``memory_report``)."""

    gather: GatherCodec
    grads: GradCodec
    meter: BufferMeter


# How values travel, by wire form: one table for stage 3's parameter gathers, one for gradient
# reduce-scatters. A new form (fp8) is a row here; the config names it
# (``zero_optimization.weight_wire_format`` / ``gradient_wire_format``, or DeepSpeed's ZeRO++ keys).
GATHER_WIRE_FORMS: dict[str, Callable[[BufferMeter], GatherCodec]] = {
    "exact": lambda meter: IDENTITY,
    "int8": lambda meter: QuantizedGatherCodec(BlockQuantizer(8), meter),
}
GRAD_WIRE_FORMS: dict[str, Callable[[BufferMeter], GradCodec]] = {
    "exact": lambda meter: EXACT_GRADS,
    "int8": lambda meter: QuantizedGrads(BlockQuantizer(8), meter),
    "int4": lambda meter: QuantizedGrads(BlockQuantizer(4), meter),
}


def wire_form(key: str, asked: str | None, deepspeed_form: str, table: dict[str, Any]) -> str:
    """The wire form ``key`` names (None: what DeepSpeed's keys say, ``deepspeed_form``),
    checked against ``table``: a `ValueError` naming the key, the forms known, or the DeepSpeed
    key it contradicts."""
    if asked is None:
        return deepspeed_form
    if asked not in table:
        raise ValueError(f"zero_optimization.{key} = {asked!r} is not a wire form: the forms are {sorted(table)}")
    if deepspeed_form != "exact" and asked != deepspeed_form:
        raise ValueError(f"zero_optimization.{key} = {asked!r} contradicts the ZeRO++ keys, which ask for "
                         f"{deepspeed_form!r}: give one of them")
    return asked


def asked_wire_forms(
    weights: str | None, grads: str | None, quantized_weights: bool, quantized_grads: bool, grad_bits: int
) -> tuple[str, str]:
    """The wire forms of the parameter gathers and the gradient reductions the config asks for:
    its own keys (``weight_wire_format``, ``gradient_wire_format``) or DeepSpeed's ZeRO++ ones
    (``zero_quantized_weights``; ``zero_quantized_gradients`` and its bits)."""
    return (
        wire_form("weight_wire_format", weights, "int8" if quantized_weights else "exact", GATHER_WIRE_FORMS),
        wire_form("gradient_wire_format", grads, f"int{grad_bits}" if quantized_grads else "exact", GRAD_WIRE_FORMS),
    )


def choose_codecs(weights: str = "exact", grads: str = "exact") -> Codecs:
    """The codecs of the wire forms named (`GATHER_WIRE_FORMS`, `GRAD_WIRE_FORMS`), sharing one
    meter of their encoded buffers."""
    meter = BufferMeter()
    return Codecs(GATHER_WIRE_FORMS[weights](meter), GRAD_WIRE_FORMS[grads](meter), meter)
