"""Where the training loop is in its gradient-accumulation window.

One object instead of counters spread over the engine: which micro-step this is (in all, and
within the window), whether it ends the window (every ``gradient_accumulation_steps``-th, or
as `set_boundary` says: Hugging Face's Trainer ends an epoch's short last window early), and
the backwards the micro-step has seen (how many, how many without the engine's loss scaling).
"""

from __future__ import annotations

from typing import Any

import torch

from .sharding.gathering.agreement import Call, split_forward_facts
from .sharding.transforms.seam import MODEL
from .sharding.transforms.ulysses import (
    SplitBatch, UlyssesAttention, gather_slices, sequence_log_probs, sequence_slice, whole_value,
)


class AccumulationWindow:
    def __init__(self, steps: int) -> None:
        self.steps = steps  # gradient_accumulation_steps
        self.micro_steps = 0  # every micro-step so far (ranks agree on it: it numbers their call rows)
        self.in_window = 0  # micro-steps finished since the last boundary
        self.said_boundary: bool | None = None  # set_boundary; None: counted
        self.backwards = 0  # backwards finished in this micro-step
        self.unscaled_backwards = 0  # in this window, not through engine.backward

    def is_boundary(self) -> bool:
        """Whether the current micro-step is the last of its window."""
        if self.said_boundary is not None:
            return self.said_boundary
        return (self.in_window + 1) % self.steps == 0

    def set_boundary(self, is_boundary: bool | None) -> None:
        self.said_boundary = is_boundary

    def backward_done(self, scaled: bool) -> None:
        self.backwards += 1
        self.unscaled_backwards += 0 if scaled else 1

    @property
    def has_gradients(self) -> bool:
        """Some backward ran since the last boundary."""
        return bool(self.in_window or self.backwards)

    def end_micro_step(self) -> bool:
        """``step()`` was called: count the micro-step; returns whether it ended the window
        (then the next one starts a new window)."""
        boundary = self.is_boundary()
        self.micro_steps += 1
        self.backwards = 0
        self.in_window = 0 if boundary else self.in_window + 1
        if boundary:
            self.unscaled_backwards = 0
        return boundary

    def restart(self, optimizer_steps: int) -> None:
        """After loading a checkpoint taken on a boundary after ``optimizer_steps`` steps."""
        self.micro_steps = optimizer_steps * self.steps
        self.in_window = 0
        self.backwards = 0
        self.unscaled_backwards = 0


class WindowView:
    """A mixin of `zero_engine.engine.Engine`: DeepSpeed's engine methods on the batch and the
    accumulation window, read from ``window`` and ``batch``, and which batches this rank reads
    (``comm``'s mesh)."""

    window: AccumulationWindow
    batch: Any  # zero_engine.config.BatchSizes
    comm: Any  # zero_engine.comm.Comm
    transforms: Any  # zero_engine.sharding.transforms.seam.ModuleTransforms
    calls: Any  # zero_engine.sharding.gathering.calls.CallGuard or PassCallGuard
    _split_forwards: int  # forwards of this micro-step split over the sequence group

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch is the last of its accumulation window: every
        ``gradient_accumulation_steps``-th, unless `set_gradient_accumulation_boundary` said."""
        return self.window.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Say whether the coming micro-step ends its window, as DeepSpeed's engine takes it
        (Hugging Face's Trainer says so for each one, and ends an epoch's short last window
        early). Holds until set again; None goes back to counting. Set it before the
        micro-step's backward (stages 0-1 decide there whether to reduce). Every rank must say
        the same."""
        self.window.set_boundary(is_boundary)

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples a rank's micro-batch holds (DeepSpeed's engine method: a data loader's batch size)."""
        return self.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches an optimizer step accumulates (DeepSpeed's engine method)."""
        return self.batch.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        """Samples an optimizer step takes over every data-parallel rank (DeepSpeed's engine method)."""
        return self.batch.train_batch_size

    @property
    def micro_steps(self) -> int:
        """Micro-steps (``step()`` calls) so far."""
        return self.window.micro_steps

    @property
    def data_parallel_rank(self) -> int:
        """Which micro-batches this rank reads: the ranks of a sequence group read the same ones
        (a sampler's ``rank``; its ``num_replicas`` is `data_parallel_world_size`)."""
        return self.comm.mesh.rank_in("batch", self.comm.rank)

    @property
    def data_parallel_world_size(self) -> int:
        """The ranks that read different micro-batches: the world size / ``sequence_parallel_size``."""
        return self.comm.mesh.batch

    def sequence_slice(self, tensor: torch.Tensor, dim: int = 1, pad_value: float = 0) -> torch.Tensor:
        """A plain PyTorch model's loop under ``sequence_parallel_size: k``: this rank's slice of a
        whole sequence's ``tensor`` along ``dim`` (ids, global positions, labels shifted before:
        pad them with -100), the sequence padded at its end to a multiple of ``k``; ``tensor``
        itself at ``k`` = 1. A Hugging Face model's batch is split by the engine instead. What it
        is given whole is fingerprinted into the next split forward's row: the ranks of a group
        are checked to have sliced the same micro-batch."""
        ulysses = self._ulysses()
        if ulysses is not None and ulysses.plain and torch.is_grad_enabled():
            ulysses.note_whole(tensor)
        return sequence_slice(self.comm.sequence_group, tensor, dim, pad_value)

    def sequence_gather(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Under ``sequence_parallel_size: k``: a split forward's output, the rank's slice along
        ``dim`` (a Hugging Face model's logits), gathered over the sequence group into the whole
        micro-batch's on every rank (the split's end padding cut; a plain model's loop cuts its
        own), without gradient: evaluation's metrics. Collective: it opens with a call row, so a
        rank that skips it makes every rank raise `DivergedRanksError`. ``tensor`` itself at
        ``k`` = 1."""
        ulysses = self._ulysses()
        if ulysses is None:
            return tensor
        self.calls.agree_at_once(Call.SEQUENCE_GATHER, self.window.micro_steps)
        if ulysses.plain:
            return gather_slices(self.comm.sequence_group, tensor.detach(), dim)
        return ulysses.whole_sequence(tensor, dim)

    def sequence_log_probs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Under ``sequence_parallel_size: k``: each sequence's summed log-probability of its
        targets, ``(batch,)``, the whole micro-batch's on every rank of the group, from this
        rank's slice of the logits (a split forward's) and of the targets (shifted before the
        split, sliced by `sequence_slice` with ``pad_value=-100``); its gradient is this rank's
        slice's, so a preference or RL loss of whole sequences (DPO's sigmoid of their
        differences) trains as in one process. Collective over the group (a sum); at ``k`` = 1
        the sums of the tensors given."""
        ulysses = self._ulysses()
        if ulysses is not None and ulysses.loop_sums_loss:  # collective: a rank that skips it meets this row
            self.calls.agree_at_once(Call.SEQUENCE_LOG_PROBS, self.window.micro_steps)
        return sequence_log_probs(self.comm.sequence_group, logits, targets)

    def sequence_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A plain PyTorch model's loop: ``loss``, this rank's slice's share of the micro-batch's
        loss (its tokens' summed loss over the micro-batch's valid tokens), made the whole
        micro-batch's in value on every rank of the sequence group, its gradient still the
        slice's (the group's gradients are summed). ``loss`` itself at ``k`` = 1.

        Collective: after a split training forward it opens with a call row, and the backward
        that follows sends one too, so that every rank raises `DivergedRanksError` instead of
        one waiting in the loss's sum until the timeout."""
        ulysses = self._ulysses()
        if ulysses is not None and ulysses.loop_sums_loss:
            self.calls.agree_at_once(Call.SEQUENCE_LOSS, self.window.micro_steps)
        return whole_value(self.comm.sequence_group, loss)

    def _agree_on_split_forward(self, batch: SplitBatch) -> None:
        """sequence_parallel_size: a split forward (training's, or evaluation's) exchanges over
        its sequence group, so each one sends a row of its own, read before its first exchange
        (at every stage): which split forward of the micro-step it is, and, compared within the sequence group, the
        micro-batch's shape and fingerprint. A collective call on some ranks only, an extra
        forward on one rank, or a group given different micro-batches then makes every rank
        raise `DivergedRanksError` at once, instead of one rank waiting in an exchange until
        the timeout (or the exchange joining halves of different sequences). The backward that
        follows sends its row before its first exchange too (`Engine._begin_backward`)."""
        self._split_forwards += 1
        leader = self.comm.mesh.group_of("sequence", self.comm.rank)[0]
        facts = split_forward_facts(self._split_forwards, leader, batch.batch, batch.tokens, batch.fingerprint)
        self.calls.agree_at_once(Call.SPLIT_FORWARD, self.window.micro_steps, facts)

    def _ulysses(self) -> UlyssesAttention | None:
        return next((t for t in self.transforms.of_order(MODEL) if isinstance(t, UlyssesAttention)), None)
