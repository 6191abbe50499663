"""The engine as the module a framework's loop calls (where it would hold DDP)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .. import Engine


class EngineModel(nn.Module):
    """An ``nn.Module`` whose forward is the engine's, for loops that call their model (Hugging
    Face's Trainer) or route a method through its forward (Lightning's strategies). The wrapped
    model stays ``self.module``, with the same parameter names."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.module = engine.module
        self.engine = engine

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)

    def no_sync(self) -> Any:
        return self.engine.no_sync()

    def _get_name(self) -> str:  # Hugging Face's Trainer picks the label smoother's shift by the class name
        return self.module._get_name()
