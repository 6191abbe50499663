"""Where the training loop is in its gradient-accumulation window.

One object instead of counters spread over the engine: which micro-step this is (in all, and
within the window), whether it ends the window (every ``gradient_accumulation_steps``-th, or
as `set_boundary` says: Hugging Face's Trainer ends an epoch's short last window early), and
the backwards the micro-step has seen (how many, how many without the engine's loss scaling).
"""

from __future__ import annotations


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
