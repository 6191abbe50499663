"""A training loop's calls under ``sequence_parallel_size``, beside the transform they serve
(`ulysses.UlyssesAttention`): a plain PyTorch model's loop slices its batch and sums its loss,
any loop gathers a split forward's outputs or sums whole sequences' log-probabilities. The
engine's public methods of the same names delegate here (`zero_engine.sequence_view`).

Each is collective over the sequence group where it exchanges, and sends a call row first
after a split forward, so that a rank that skips it makes every rank raise `DivergedRanksError`
instead of one waiting in the exchange until the timeout. At ``k`` = 1 each gives its input
back (or its plain sums).
"""

from __future__ import annotations

import torch

from ..comm import GroupComm
from ..sharding.gathering.agreement import Call
from .seam import MODEL, ModuleTransforms
from .ulysses import UlyssesAttention, gather_slices, sequence_log_probs, sequence_slice, whole_value


class SequenceLoop:
    """The sequence loop's calls over ``group`` (the sequence group), the split forwards'
    transform found among ``transforms`` (none below ``k`` = 2)."""

    def __init__(self, transforms: ModuleTransforms, group: GroupComm) -> None:
        self._transforms = transforms
        self._group = group

    def _ulysses(self) -> UlyssesAttention | None:
        return next((t for t in self._transforms.of_order(MODEL) if isinstance(t, UlyssesAttention)), None)

    def slice(self, tensor: torch.Tensor, dim: int = 1, pad_value: float = 0) -> torch.Tensor:
        """This rank's slice of a whole sequence's ``tensor`` along ``dim``; what it is given
        whole is fingerprinted into the next split forward's row (`UlyssesAttention.note_whole`)."""
        ulysses = self._ulysses()
        if ulysses is not None and ulysses.plain and torch.is_grad_enabled():
            ulysses.note_whole(tensor)
        return sequence_slice(self._group, tensor, dim, pad_value)

    def gather(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """A split forward's output gathered over the group into the whole micro-batch's."""
        ulysses = self._ulysses()
        if ulysses is None:
            return tensor
        ulysses.agree(Call.SEQUENCE_GATHER)
        if ulysses.plain:
            return gather_slices(self._group, tensor.detach(), dim)
        return ulysses.whole_sequence(tensor, dim)

    def log_probs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each sequence's summed log-probability of its targets, the group's sum."""
        ulysses = self._ulysses()
        if ulysses is not None and ulysses.loop_sums_loss:  # collective: a rank that skips it meets this row
            ulysses.agree(Call.SEQUENCE_LOG_PROBS)
        return sequence_log_probs(self._group, logits, targets)

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A plain model's slice's share of the loss made the micro-batch's in value."""
        ulysses = self._ulysses()
        if ulysses is not None and ulysses.loop_sums_loss:
            ulysses.agree(Call.SEQUENCE_LOSS)
        return whole_value(self._group, loss)
