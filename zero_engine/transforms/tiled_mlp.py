"""Tiled MLP (``tiled_mlp_tokens: n``): each MLP of a model computed ``n`` tokens at a time in
training, so that its intermediate activations (gate, up, their product: about ``4 f`` values a
token, ``f`` the MLP's width, three to four times the hidden size) exist for one tile, never for
the whole sequence (ALST's TiledMLP, arXiv 2506.13996).

The MLPs are the modules a model names ``mlp`` (Hugging Face's name in Llama, Mistral, Qwen,
Gemma, Phi, GPT-2, GPT-NeoX, Falcon...; a plain PyTorch model names its own so). In a training
forward (gradients on) an MLP's input is flattened to tokens x hidden and split into tiles; each
tile runs the MLP's own forward under torch's non-reentrant checkpoint, which keeps only the
tile's input (a view of the MLP's, kept anyway) and runs the tile again in backward. The tiles'
outputs are joined. Nothing else changes:

- gradients: each weight's gradient from every tile is summed by autograd before the weight's
  gradient is accumulated, once, as untiled (no reduction per tile: the engine's gradient hooks
  see one gradient per backward);
- stage 3: an MLP inside a unit is gathered with the unit; an MLP that is a unit of its own is
  gathered once around its forward and once before its backward, however many tiles it has
  (ranks whose batches have other lengths make other numbers of tiles, and no collective
  depends on that number: nothing to agree, nothing to hang on);
- evaluation (``eval()`` with ``no_grad``, ``generate``) runs the MLPs as they are.

A mixture of experts' block named so (a module with an ``experts`` module: Hugging Face's
Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek blocks) is tiled too, each tile given to it as one row of
``(1, tokens, hidden)``: its experts' intermediates, the largest activations of a long MoE
sequence, exist for one tile. Its router picks each token's experts from that token alone (top-k
per token), so a tile routes its tokens as the whole sequence does; the router's outputs that
Hugging Face records for the load-balancing loss (``output_router_logits``) are recorded per
call, a layer's tiles one after another, which its loss concatenates as it concatenates the
layers. A block that returns more than its hidden states raises at its first tiled call.

Refused at `initialize`, naming it: a model with no module named ``mlp``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .seam import MODEL, TransformTarget, WrappedForwards

MLP_NAME = "mlp"


class TiledMLP:
    """Each ``mlp`` module of the model in tiles of ``tokens`` tokens in training forwards."""

    ORDER = MODEL

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self._forwards: WrappedForwards | None = None

    def apply(self, target: TransformTarget) -> None:
        self._forwards = WrappedForwards(mlp_modules(target.model), self._tiled)

    def remove(self) -> None:
        if self._forwards is not None:
            self._forwards.remove()
            self._forwards = None

    def _tiled(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        module = getattr(forward, "__self__", None)
        experts = isinstance(getattr(module, "experts", None), nn.Module)  # a block that takes (batch, tokens, hidden)
        run = (lambda tile: _one_row(forward, tile, module)) if experts else forward

        def tiled(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled() or args or kwargs:  # evaluation, or an MLP with more inputs
                return forward(hidden, *args, **kwargs)
            tokens = hidden.reshape(-1, hidden.shape[-1])
            if tokens.shape[0] <= self.tokens:
                return forward(hidden)
            # One split (its backward joins the tiles' input gradients at once), one join.
            pieces = [checkpoint(run, tile, use_reentrant=False) for tile in tokens.split(self.tokens)]
            output = torch.cat(pieces)
            return output.view(*hidden.shape[:-1], output.shape[-1])

        return tiled


def mlp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules ``model`` names ``mlp``; `NotImplementedError` naming the model when there are
    none, or naming the block when one is a mixture of experts'."""
    found = [(name, module) for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == MLP_NAME]
    if not found:
        raise NotImplementedError(
            f"tiled_mlp_tokens: {type(model).__name__} has no module named '{MLP_NAME}' (Hugging Face's name for a "
            "decoder layer's MLP); name your model's MLP modules so to tile them"
        )
    return [module for _, module in found]


def _one_row(forward: Callable[..., Any], tile: torch.Tensor, module: Any) -> torch.Tensor:
    """A mixture of experts' block on one tile of tokens, as the one row of a batch it takes
    (``(batch, tokens, hidden)``, Hugging Face's blocks), its output back to tokens x hidden."""
    output = forward(tile[None])
    if not torch.is_tensor(output):
        raise NotImplementedError(
            f"tiled_mlp_tokens: {type(module).__name__} (a mixture of experts' block) returns "
            f"{type(output).__name__}, not its hidden states alone, so its tiles cannot be joined; leave "
            "tiled_mlp_tokens at 0 for this model"
        )
    return output.reshape(tile.shape[0], -1)
