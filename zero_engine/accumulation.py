"""Where the training loop is in its gradient-accumulation window.

One object instead of counters spread over the engine: which micro-step this is (in all, and
within the window), whether it ends the window (every ``gradient_accumulation_steps``-th, or
as `set_boundary` says: Hugging Face's Trainer ends an epoch's short last window early), and
the backwards the micro-step has seen (how many, how many without the engine's loss scaling).
"""

from __future__ import annotations

from typing import Any


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

