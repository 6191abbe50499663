"""The engine as the module a framework's loop calls (where it would hold DDP), and the
optimizer and schedule as that loop sees them once the engine steps them itself."""

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

    def __getattr__(self, name: str) -> Any:
        """The wrapped model's own attributes where this module has none: a loop that takes this
        for the model unwrapped (Accelerate's ``unwrap_model`` knows DDP's and DeepSpeed's
        wrappers only; TRL's generation reads ``is_gradient_checkpointing`` and calls
        ``generate`` on what it returns) reaches the model's, its ``generate`` the engine's
        (gathered at stage 3, every rank as many forwards)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":  # not yet set (in __init__)
                raise
            return getattr(self.module, name)


class SteppedByEngine:
    """The optimizer or schedule as a framework's loop sees it: ``engine.step()`` already
    stepped them (the schedule only on applied steps), so ``step`` and ``zero_grad`` do
    nothing; everything else is the real object's."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)
