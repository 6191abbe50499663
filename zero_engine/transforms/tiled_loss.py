"""Tiled loss (``tiled_loss_tokens: n``): a Hugging Face causal language model's training loss
computed ``n`` tokens at a time, so the logits of the whole sequence (vocabulary x tokens, in
fp32 for the loss: at 32K tokens and a 128K vocabulary, 16 GiB) never exist at once.

On a training forward with labels, the model's output head returns its input (the hidden
states, hidden x tokens) and the model's loss function is ours: for each tile of tokens, under
torch's checkpoint, the head's logits of the tile and their cross-entropy summed; the logits
of a tile are freed before the next and computed again, one tile at a time, in backward. The
sum is divided as Hugging Face's loss divides it (by ``num_items_in_batch`` when given: the
Trainer's count, sequence parallelism's; else by the valid tokens), so the loss is the same
number. The head is called as the module it is (at stage 3 its parameters are gathered around
each pass, however many tiles call it: ranks whose batches have other lengths make other
numbers of calls, and no collective depends on that count). Such a forward returns no logits
(``output.logits`` is a `LogitsNotComputed`, whose every use raises saying why and what to do):
the loss is all a training step needs. Evaluation (``eval()``,
``no_grad``, no labels) runs the model as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

from .seam import MODEL, TransformTarget


class TiledLoss:
    """The loss of a Hugging Face causal language model in tiles of ``tokens`` tokens."""

    ORDER = MODEL

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.tiling = False  # this forward's loss is tiled (a training forward with labels)
        self._inside = False  # the head called by a tile, not by the model
        self._head: nn.Module | None = None
        self._model: Any = None
        self._handles: list[RemovableHandle] = []
        self._had_loss_function = False
        self._loss_function: Any = None
        self._head_forward: Any = None

    def apply(self, target: TransformTarget) -> None:
        model = target.model
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None or not hasattr(model, "loss_function"):
            raise NotImplementedError(
                f"tiled_loss_tokens: {type(model).__name__} is not a Hugging Face causal language model with an "
                "output head (get_output_embeddings) and a loss_function; the tiled loss computes that head's "
                "logits a tile at a time"
            )
        self._model, self._head = model, head
        self._had_loss_function = "_loss_function" in vars(model)
        self._loss_function = model.loss_function
        model.loss_function = self._loss
        self._handles = [
            model.register_forward_pre_hook(self._decide, with_kwargs=True),
            model.register_forward_hook(self._no_logits, always_call=True),
        ]
        self._head_forward = vars(head).get("forward")  # an instance's own forward, if it had one
        original = head.forward

        def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            """The model's own call of its head, in a tiled forward, returns the hidden states
            (no logits); a tile's call computes them."""
            if self.tiling and not self._inside:
                return hidden
            return original(hidden, *args, **kwargs)

        head.forward = forward

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._head is not None:
            if self._head_forward is not None:
                self._head.forward = self._head_forward
            else:
                del self._head.forward
            self._head = None
        if self._model is not None:
            if self._had_loss_function:
                self._model.loss_function = self._loss_function
            else:
                del self._model._loss_function
            self._model = None

    def _decide(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.tiling = module.training and torch.is_grad_enabled() and kwargs.get("labels") is not None

    def _no_logits(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.tiling and hasattr(output, "logits"):
            output.logits = LogitsNotComputed(self.tokens)
            self.tiling = False
            return output
        self.tiling = False
        return None

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
              num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
              shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if not self.tiling:
            return self._loss_function(
                logits=logits, labels=labels, vocab_size=vocab_size, num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index, shift_labels=shift_labels, **kwargs,
            )
        hidden = logits  # what the head passed through
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        hidden = hidden.reshape(-1, hidden.shape[-1])
        targets = shift_labels.reshape(-1).to(hidden.device)
        total = hidden.new_zeros((), dtype=torch.float32)
        for tile in range(-(-hidden.shape[0] // self.tokens)):
            piece = slice(tile * self.tokens, (tile + 1) * self.tokens)
            total = total + checkpoint(
                self._tile_loss, hidden[piece], targets[piece], ignore_index, use_reentrant=False
            )
        if num_items_in_batch is None:
            return total / (targets != ignore_index).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch

    def _tile_loss(self, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """One tile's summed cross-entropy, its logits computed by the head module here and
        freed on return (recomputed in backward)."""
        assert self._head is not None
        self._inside = True
        try:
            logits = self._head(hidden)
        finally:
            self._inside = False
        return nn.functional.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


class LogitsNotComputed:
    """What a tiled training forward returns in place of the logits, which it never computes:
    any use (an attribute, an index, a torch function) raises a `RuntimeError` that says why and
    how to get them, instead of a ``None`` failing later in the caller's own code."""

    def __init__(self, tokens: int) -> None:
        object.__setattr__(self, "_message", (
            f"logits are not computed in training forwards with tiled_loss_tokens = {tokens}: the loss is, a tile "
            "at a time, and the whole logits never exist. Set tiled_loss_tokens: 0 to get them, or call the model "
            "without labels (or under torch.no_grad()) for logits without the tiled loss"
        ))

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(object.__getattribute__(self, "_message"))

    def __getattr__(self, name: str) -> Any:
        self._refuse()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        instance = next(arg for arg in (*args, *(kwargs or {}).values()) if isinstance(arg, cls))
        instance._refuse()

    __getitem__ = __len__ = __iter__ = __bool__ = __float__ = __array__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __matmul__ = _refuse

    def __repr__(self) -> str:
        return "LogitsNotComputed(tiled_loss_tokens)"
