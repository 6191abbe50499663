"""Where training is: one state, shared by the engine, the reducer and the gatherer.

As FSDP2's ``TrainingState``: the engine, the gradient reducer and the stage 3 gatherer each
react to forward and backward, and each must know which pass is running. Rather than a flag in
each (a backward "armed" in the reducer, a forward depth in the gatherer, ...), they share one
`Lifecycle` and ask it.

The forward is tracked by hooks on the root module (prepended, so they run before and after
every other hook on it, whoever calls the model). A backward starts when its first gradient
reaches the model and ends in autograd's end-of-backward callback; the engine moves the state
there (`zero_engine.engine.Engine._begin_backward`).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle


class TrainingState(Enum):
    IDLE = "idle"  # between passes
    FORWARD = "forward"  # the model's forward is running (its outermost call)
    ACCUMULATING = "accumulating"  # a backward whose gradients only accumulate locally (stages 0-1 off boundaries)
    REDUCING = "reducing"  # a backward whose gradients are reduced as they arrive

    @property
    def in_backward(self) -> bool:
        return self in (TrainingState.ACCUMULATING, TrainingState.REDUCING)


class Lifecycle:
    """The training state, and how deep the root module's forward is nested."""

    def __init__(self) -> None:
        self.state = TrainingState.IDLE
        self.forward_depth = 0  # calls of the root module in progress
        self._handles: list[RemovableHandle] = []

    def track_forward(self, root: nn.Module) -> None:
        """Hooks on ``root`` that keep the state FORWARD while its outermost call runs (even
        one that raises: ``always_call``)."""
        self._handles = [
            root.register_forward_pre_hook(self._enter, prepend=True),
            root.register_forward_hook(self._exit, prepend=True, always_call=True),
        ]

    def _enter(self, module: nn.Module | None = None, args: Any = None) -> None:
        self.forward_depth += 1
        if self.state is TrainingState.IDLE:
            self.state = TrainingState.FORWARD

    def _exit(self, module: nn.Module | None = None, args: Any = None, output: Any = None) -> None:
        self.forward_depth = max(0, self.forward_depth - 1)
        if self.forward_depth == 0 and self.state is TrainingState.FORWARD:
            self.state = TrainingState.IDLE

    enter_forward = _enter  # for a method run as a forward of the root (`ParamGatherer.run_as_forward`)
    exit_forward = _exit

    def begin_backward(self, reducing: bool) -> None:
        self.state = TrainingState.REDUCING if reducing else TrainingState.ACCUMULATING

    def end_backward(self) -> None:
        self.state = TrainingState.IDLE

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
