"""What a training loop may not do with an engine, caught before it trains wrong: train an
engine with nothing to train, change which parameters train after `initialize`, step without
a backward, or backward around fp16's loss scaling. Each check raises with the fix."""

from __future__ import annotations

from torch import nn

from .accumulation import AccumulationWindow


class LoopGuards:
    def __init__(self, model: nn.Module) -> None:
        # requires_grad as built: a change (PEFT's set_adapter, unfreezing a layer) would train wrong
        self._trainable_as_built = [(name, param, param.requires_grad) for name, param in model.named_parameters()]

    @staticmethod
    def check_trains(call: str, trains: bool) -> None:
        """An engine over a model without a trainable parameter (a reference or reward model)
        serves forwards only."""
        if not trains:
            raise RuntimeError(
                f"engine.{call}(): this engine has nothing to train: its model has no trainable parameter "
                "(requires_grad=True) in any param group, so it has no optimizer. Use it for forwards (under "
                "torch.no_grad() or engine.eval()), or unfreeze parameters before zero_engine.initialize"
            )

    def check_requires_grad_unchanged(self) -> None:
        """Which parameters train was decided at `initialize` (units, optimizer, reductions): a
        parameter whose ``requires_grad`` changed since would train wrong, silently."""
        changed = [
            f"{name!r} ({'frozen' if was else 'unfrozen'} after initialize)"
            for name, param, was in self._trainable_as_built
            if param.requires_grad != was
        ]
        if changed:
            raise RuntimeError(
                f"requires_grad changed after zero_engine.initialize for {len(changed)} parameter(s): "
                f"{', '.join(changed[:8])}{', ...' if len(changed) > 8 else ''}. The engine decided which parameters "
                "train when it was built (their units, optimizer state and reductions): set requires_grad before "
                "initialize (PEFT: call set_adapter or freeze layers first), or build a new engine "
                "(engine.close(unshard=True), then zero_engine.initialize again)"
            )

    @staticmethod
    def check_backwards(window: AccumulationWindow, loss_scaling: bool) -> None:
        """A step needs a backward since the last; under fp16 loss scaling, through engine.backward."""
        if window.backwards == 0:
            raise RuntimeError(
                f"engine.step() without a backward since the last step() (micro-step {window.micro_steps}): "
                "call engine.backward(loss) (or loss.backward()) on the output of engine(...) first"
            )
        if loss_scaling and window.unscaled_backwards:
            raise RuntimeError(
                "fp16 loss scaling is on, but a backward did not go through engine.backward(loss) (a plain "
                "loss.backward() applies no loss scale, so small gradients underflow): use engine.backward(loss)"
            )
