"""A model whose forward takes and returns nested structures: a dataclass batch, keyword
arguments, dict and tuple outputs between blocks, a non-tensor cache object passed through."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Batch:
    inputs: torch.Tensor
    extras: dict


class Cache:
    """Not a tensor and not a container the engine knows: must come back untouched."""

    def __init__(self) -> None:
        self.seen = 0


class Output(OrderedDict):
    """Like transformers' ModelOutput: a dict whose items are also attributes."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError as error:
            raise AttributeError(name) from error


class StructuredBlock(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, state: dict) -> dict:
        h = torch.tanh(self.linear(state["h"]))
        return {"h": h, "history": (*state["history"], h.mean()), "label": state["label"]}


class StructuredModel(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(StructuredBlock(width) for _ in range(depth))

    def forward(self, batch: Batch, *, cache: Cache, scale: float = 1.0) -> Output:
        state = {"h": batch.inputs * scale + batch.extras["shift"], "history": (), "label": "start"}
        for block in self.blocks:
            state = block(state)
        cache.seen += 1
        loss = state["h"].pow(2).mean() + sum(state["history"]) * 0.1
        return Output(loss=loss, hidden=(state["h"], [state["history"]]), cache=cache)


def structured_batch(step: int, rank: int, width: int = 16) -> tuple[Batch, Cache]:
    generator = torch.Generator().manual_seed(10 * step + rank)
    inputs = torch.randn(4, width, generator=generator)
    return Batch(inputs, {"shift": torch.randn(width, generator=generator), "name": "batch"}), Cache()
