"""Frozen weights kept and gathered in int8 (DeepSpeed's ``zero_quantized_nontrainable_weights``).

A frozen weight never changes, so it is quantized once, at ``initialize``, and never again: each
rank encodes its shard of a frozen unit with the block codec (`zero_engine.quantize`: int8, one
fp32 scale per block of 2048 elements; blocks start at the shard's first element, so a block
never spans two ranks) and keeps only that, about half a bf16 shard's bytes. A gather moves the
encoded shards (half the bytes again) and every rank decodes every shard, its own included, into
the full buffer in the unit's dtype: all ranks compute with the same values, which is what the
shards say, not the exact weights (the exact base is not kept anywhere, as in DeepSpeed).

What is quantized is decided per parameter (`FrozenQuantization`): frozen floating-point
matrices of at least ``zero_quantized_nontrainable_min_numel`` elements that the user did not
name in ``zero_quantized_nontrainable_exact``. Vectors (norms, biases) stay exact: a scale per
block of a norm's gains costs its precision for a negligible saving. The plan puts the quantized
parameters of a unit module in a unit of their own (`zero_engine.sharding.units.unit_plan`).

With ``frozen_weights: replicate`` each rank keeps the whole unit encoded (a unit of one shard)
and its gather is a decode, with no collective: half a bf16 base's memory and no traffic, the
gatherer decoding around each use and freeing after it, as it frees a gathered shard.

Writes (loading a checkpoint or ``weights=``, ``gathered()``'s write-back) go to a decoded copy
of the shard, encoded again at the next read (a gather, or a read of the values for a state
dict, an export or a checkpoint): a load of every parameter of a unit encodes the shard once, so
a block that two parameters share is quantized from its final values only, and what is read
back is always what a forward computes with.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...comm import Comm
from ...comm.handles import DONE, CollectiveKind
from ...config import ZeroOptimizationConfig
from ...errors import ConfigError
from ...quantize import BlockQuantizer, BufferMeter
from ..shards.codec import Gathering
from ..shards.param_shard import EncodedShard
from .frozen_unit import FrozenUnit

EXACT_KEY = "zero_optimization.zero_quantized_nontrainable_exact"


@dataclass(frozen=True)
class FrozenQuantization:
    """Which frozen parameters are kept in int8 (none when not ``enabled``), and whether each
    rank keeps them whole (``replicated``: ``frozen_weights: replicate``) or its shard."""

    enabled: bool = False
    min_numel: int = 2048
    exact: Sequence[str] = field(default_factory=tuple)  # fnmatch patterns of names kept exact
    replicated: bool = False

    @classmethod
    def from_config(cls, zero: ZeroOptimizationConfig, shards_parameters: bool) -> FrozenQuantization:
        """``zero_quantized_nontrainable_weights`` where stage 3 holds frozen weights in units
        (``shards_parameters``); below stage 3 they stay whole and exact (said at initialize)."""
        return cls(
            zero.zero_quantized_nontrainable_weights and shards_parameters, zero.zero_quantized_nontrainable_min_numel,
            tuple(zero.zero_quantized_nontrainable_exact), zero.frozen_weights == "replicate",
        )

    def applies(self, name: str, param: nn.Parameter) -> bool:
        return (
            self.enabled
            and not param.requires_grad
            and param.is_floating_point()
            and param.dim() >= 2
            and param.numel() >= self.min_numel
            and not any(fnmatch.fnmatchcase(name, pattern) for pattern in self.exact)
        )

    def check_patterns(self, frozen_names: Sequence[str]) -> None:
        """Refuse a pattern of ``zero_quantized_nontrainable_exact`` that names no frozen
        parameter (a misspelt name would otherwise quantize what the user meant to keep)."""
        if not self.enabled:
            return
        for index, pattern in enumerate(self.exact):
            if not any(fnmatch.fnmatchcase(name, pattern) for name in frozen_names):
                raise ConfigError(
                    f"{EXACT_KEY}[{index}] = {pattern!r} matches no frozen parameter (names look like "
                    f"{list(frozen_names)[:3]!r})"
                )


NO_QUANTIZATION = FrozenQuantization()


class QuantizedFrozenUnit(FrozenUnit):
    """A `FrozenUnit` whose shard is kept encoded (``param_shard``: uint8) and gathered so.
    ``replicated``: every rank keeps the whole unit (a shard of one), and "gathering" it is
    decoding it, with no collective (``frozen_weights: replicate``)."""

    quantized = True

    def __init__(
        self, *args: Any, quantizer: BlockQuantizer, meter: BufferMeter, replicated: bool = False, **kwargs: Any
    ) -> None:
        self.quantizer = quantizer
        self.meter = meter  # the encoded gather buffers, for memory_report's quantized peak
        self.replicated = replicated
        super().__init__(*args, **kwargs)

    shard: EncodedShard

    def _keep(self, values: torch.Tensor) -> None:
        """The shard encoded (`EncodedShard`), its bytes kept where the tier says. Its values
        read back as a gather decodes them, a staged write encoded first: a load or a write reads
        back as the next forward computes with it, never the exact values it was given
        (reliability review D13)."""
        self.shard = EncodedShard(values, self.shards, self.quantizer, self.dtype)

    @property
    def param_shard(self) -> torch.Tensor:
        """What this rank keeps: its shard, encoded (any staged write encoded first)."""
        return self.shard.encoded()

    def keep(self, kept: torch.Tensor) -> None:
        self.shard.replace_encoded(kept)

    def _fill_own_shard(self) -> None:
        """Nothing: the gather decodes the own shard too, so every rank holds the same values."""

    def gather(self, comm: Comm) -> Gathering:
        """All-gather the encoded shards (counted as ``all_gather_frozen``) and decode every one
        into the full buffer once they are in."""
        numel = self.layout.shard_numel
        if self.replicated:  # the whole unit is here: decoding is the gather
            kept = self.shard.encoded()
            return Gathering(
                DONE, lambda: self.quantizer.decode_rows_into(kept.view(1, -1), numel, self.flat_param[None])
            )
        num_shards, own = comm.num_shards, comm.shard_rank
        encoded_numel = self.quantizer.encoded_bytes(numel)
        encoded = self.meter.hold(torch.empty(num_shards * encoded_numel, dtype=torch.uint8, device=self.device))
        segments = encoded.view(num_shards, -1)
        self.shard.fill_encoded(segments[own])
        pending = comm.all_gather(encoded, kind=CollectiveKind.ALL_GATHER_FROZEN) if num_shards > 1 else DONE

        def decode_every_shard() -> None:
            self.quantizer.decode_rows_into(segments, numel, self.flat_param.view(num_shards, numel))

        return Gathering(pending, decode_every_shard)
