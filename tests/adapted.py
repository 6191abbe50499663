"""A small model with what fine-tuning brings: an input embedding tied to the output head, and
layers of a frozen base linear beside a trainable one (``stage3_wrap_modules=["Layer"]`` makes
each layer a unit module: a trainable and a frozen unit at stage 3), and a buffer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM = 16, 8


class Layer(nn.Module):
    """A frozen base linear and a trainable one beside it (a unit module: one trainable and one
    frozen unit at stage 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(DIM, DIM)
        self.base.requires_grad_(False)
        self.adapt = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(h) + self.adapt(h))


class TiedAdapted(nn.Module):
    """An embedding tied to the output head around two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h * self.scale.to(h.dtype)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids.roll(1, dims=1).reshape(-1))


def make_model() -> TiedAdapted:
    torch.manual_seed(0)
    return TiedAdapted()
