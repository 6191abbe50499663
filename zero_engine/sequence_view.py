"""The engine's calls for a training loop under ``sequence_parallel_size`` (a mixin of
`zero_engine.engine.Engine`): one-line delegates to the sequence loop beside the transform
(`zero_engine.transforms.sequence_loop`)."""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch

from .transforms.sequence_loop import SequenceLoop


class SequenceView:
    """``engine.sequence_slice``, ``sequence_gather``, ``sequence_log_probs``, ``sequence_loss``."""

    comm: Any  # zero_engine.comm.Comm
    transforms: Any  # zero_engine.transforms.seam.ModuleTransforms

    @cached_property
    def sequence_loop(self) -> SequenceLoop:
        return SequenceLoop(self.transforms, self.comm.sequence_group)

    def sequence_slice(self, tensor: torch.Tensor, dim: int = 1, pad_value: float = 0) -> torch.Tensor:
        """A plain PyTorch model's loop under ``sequence_parallel_size: k``: this rank's slice of a
        whole sequence's ``tensor`` along ``dim`` (ids, global positions, labels shifted before:
        pad them with -100), the sequence padded at its end to a multiple of ``k``; ``tensor``
        itself at ``k`` = 1. A Hugging Face model's batch is split by the engine instead. What it
        is given whole is fingerprinted into the next split forward's row: the ranks of a group
        are checked to have sliced the same micro-batch."""
        return self.sequence_loop.slice(tensor, dim, pad_value)

    def sequence_gather(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Under ``sequence_parallel_size: k``: a split forward's output, the rank's slice along
        ``dim`` (a Hugging Face model's logits), gathered over the sequence group into the whole
        micro-batch's on every rank (the split's end padding cut; a plain model's loop cuts its
        own), without gradient: evaluation's metrics. Collective: it opens with a call row, so a
        rank that skips it makes every rank raise `DivergedRanksError`. ``tensor`` itself at
        ``k`` = 1."""
        return self.sequence_loop.gather(tensor, dim)

    def sequence_log_probs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Under ``sequence_parallel_size: k``: each sequence's summed log-probability of its
        targets, ``(batch,)``, the whole micro-batch's on every rank of the group, from this
        rank's slice of the logits (a split forward's) and of the targets (shifted before the
        split, sliced by `sequence_slice` with ``pad_value=-100``); its gradient is this rank's
        slice's, so a preference or RL loss of whole sequences (DPO's sigmoid of their
        differences) trains as in one process. Collective over the group (a sum); at ``k`` = 1
        the sums of the tensors given."""
        return self.sequence_loop.log_probs(logits, targets)

    def sequence_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A plain PyTorch model's loop: ``loss``, this rank's slice's share of the micro-batch's
        loss (its tokens' summed loss over the micro-batch's valid tokens), made the whole
        micro-batch's in value on every rank of the sequence group, its gradient still the
        slice's (the group's gradients are summed). ``loss`` itself at ``k`` = 1.

        Collective: after a split training forward it opens with a call row, and the backward
        that follows sends one too, so that every rank raises `DivergedRanksError` instead of
        one waiting in the loss's sum until the timeout."""
        return self.sequence_loop.loss(loss)
