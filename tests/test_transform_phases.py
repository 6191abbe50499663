"""Transforms in two phases from one table (STRUCTURE item 3). A test transform added as a row
of the table, with no other edit, splits a linear layer in two in its first phase, before the
module plan: the plan holds its two halves as two parameters at stages 0 and 3 on 2 ranks, the
model trains as the unsplit one does, its forward phase sees every forward, and ``close()``
undoes both phases (the linear back, holding the trained values; no hook left)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import zero_engine
from harness import run_on_ranks

ROOT = Path(__file__).resolve().parent.parent


class Halves(nn.Module):
    """A linear layer as two, each computing half of its outputs."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        half = linear.out_features // 2
        self.a, self.b = nn.Linear(linear.in_features, half), nn.Linear(linear.in_features, linear.out_features - half)
        with torch.no_grad():
            for part, rows in ((self.a, slice(0, half)), (self.b, slice(half, None))):
                part.weight.copy_(linear.weight[rows])
                part.bias.copy_(linear.bias[rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(x)], dim=-1)


class SplitLinear:
    """First phase: ``model.fc`` replaced by its `Halves`; forward phase: a hook counting
    forwards. ``revert`` puts the linear back with the halves' values."""

    ORDER = 0  # a model transform

    def __init__(self) -> None:
        self.forwards = 0
        self._model: nn.Module | None = None
        self._linear: nn.Linear | None = None
        self._handle = None

    def convert(self, model: nn.Module) -> None:
        self._model, self._linear = model, model.fc
        model.fc = Halves(model.fc)

    def revert(self) -> None:
        halves = self._model.fc
        with torch.no_grad():
            self._linear.weight.copy_(torch.cat([halves.a.weight, halves.b.weight]))
            self._linear.bias.copy_(torch.cat([halves.a.bias, halves.b.bias]))
        self._model.fc = self._linear

    def apply(self, target) -> None:
        self._handle = target.model.fc.register_forward_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))

    def remove(self) -> None:
        self._handle.remove()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.fc, self.out = nn.Linear(6, 8), nn.Linear(8, 10), nn.Linear(10, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.out(torch.tanh(self.fc(torch.tanh(self.inp(x))))), y)


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _train(rank: int, world_size: int, stage: int, split: bool) -> dict:
    from zero_engine.transforms import table

    transform = SplitLinear()
    if split:
        table.TABLE.append(table.Row("test", lambda s: True, lambda s: transform))
    model = Net()
    engine = zero_engine.initialize(model, _config(stage))
    names = sorted(name for unit in engine.units for name in unit.names)
    losses = []
    for step in range(4):
        generator = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(2, 6, generator=generator), torch.randn(2, 1, generator=generator)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close(unshard=True)
    forwards = transform.forwards
    model(torch.zeros(1, 6), torch.zeros(1, 1))  # after close: no hook counts it
    return {"names": names, "losses": losses, "fc": type(model.fc).__name__, "forwards": (forwards, transform.forwards),
            "state": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("stage", [3, pytest.param(0, marks=pytest.mark.slow)])
def test_a_transform_that_splits_a_linear_before_the_plan_is_planned_as_two_parameters(stage: int) -> None:
    split = run_on_ranks(2, _train, stage, True)
    plain = run_on_ranks(2, _train, stage, False)
    for rank in range(2):
        names = split[rank]["names"]
        assert "fc.a.weight" in names and "fc.b.weight" in names and "fc.weight" not in names, names
        assert "fc.weight" in plain[rank]["names"]
        assert split[rank]["fc"] == "Linear"  # close() undid the first phase
        assert split[rank]["forwards"] == (4, 4)  # the forward phase saw each forward, and is gone
        for a, b in zip(split[rank]["losses"], plain[rank]["losses"]):
            assert abs(a - b) < 1e-6, (stage, split[rank]["losses"], plain[rank]["losses"])
        for name, value in plain[rank]["state"].items():
            torch.testing.assert_close(split[rank]["state"][name], value, rtol=1e-5, atol=1e-6)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.lstrip("."))
    return found


def test_the_engine_imports_the_table_and_the_seam_and_the_window_no_transform() -> None:
    engine = {m for m in _imports(ROOT / "zero_engine" / "engine.py") if m.startswith("transforms")}
    assert engine == {"transforms.seam", "transforms.table"}
    assert not {m for m in _imports(ROOT / "zero_engine" / "accumulation.py") if "transforms" in m}
    planted = ast.parse("from .transforms.ulysses import UlyssesAttention\n")
    assert {n.module for n in ast.walk(planted) if isinstance(n, ast.ImportFrom)} == {"transforms.ulysses"}
