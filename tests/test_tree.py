"""Tensors inside nested inputs and outputs: found, mapped, containers keep their types."""

from __future__ import annotations

from collections import namedtuple

import torch

from structured import Batch, Cache, Output
from zero_engine.tree import iter_tensors, map_tensors

Pair = namedtuple("Pair", "first second")


def test_map_reaches_every_tensor_and_keeps_types_and_other_values() -> None:
    cache = Cache()
    value = (
        Batch(torch.ones(2), {"shift": torch.zeros(3), "name": "batch"}),
        Output(loss=torch.tensor(1.0), hidden=[Pair(torch.ones(1), None)], cache=cache),
        "text",
    )
    doubled = map_tensors(lambda t: t * 2, value)
    assert isinstance(doubled, tuple) and doubled[2] == "text"
    batch, output = doubled[0], doubled[1]
    assert isinstance(batch, Batch) and torch.equal(batch.inputs, torch.full((2,), 2.0))
    assert batch.extras["name"] == "batch" and torch.equal(batch.extras["shift"], torch.zeros(3))
    assert isinstance(output, Output) and output.cache is cache and output.loss.item() == 2.0
    assert isinstance(output.hidden[0], Pair) and output.hidden[0].first.item() == 2.0
    assert value[0].inputs.sum().item() == 2.0, "the input structure was changed in place"
    assert len(list(iter_tensors(value))) == 4
