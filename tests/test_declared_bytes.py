"""STRUCTURE item 6: what each tier and each optimizer kind declares it holds
(`zero_engine.accounting`, `zero_engine.optimizer_kinds`), summed by `memory.declared_states`,
against what a 2-rank build holds (`memory_report()`, counted from the tensors themselves, and
held in turn against the storages behind every live tensor of the process): each kind of state,
the frozen parameters and each tier's bytes, for every tier of the optimizer side and of stage
3's parameter shards and every optimizer in the table.

The model divides evenly over 2 ranks (no padding) and every parameter gets a gradient, so the
two agree to the byte but for the optimizers' per-tensor scalars (step counters and the like),
which the formula leaves out and the test counts from the optimizer's state."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from torch import nn

import zero_engine
from configs import engine_config
from disk import DISK
from harness import run_on_ranks
from zero_engine.accounting import bytes_of
from zero_engine.memory import HELD_NOW, estimate_from_config
from zero_engine.testing.process_memory import live_tensor_bytes
from zero_engine.offload import Tier
from zero_engine.sharding.gathering.agreement import PassKind, make_row
from zero_engine.optimizer_kinds import OPTIMIZERS

KINDS = ("parameters", "gradients", "optimizer_states", "master_parameters")
COMPARED = ("parameters", "gradients", "optimizer_states", "master_parameters", "frozen_parameters", "host", "nvme")
OPTIMIZER_PARAMS = {"sgd": {"momentum": 0.9}, "rmsprop": {"momentum": 0.9, "centered": True},
                    "muon": {"adam_lr": 1e-3}}


class Model(nn.Module):
    """Two trainable matrices, a norm (vectors: a whole-matrix optimizer's partner takes them) and
    a frozen matrix; every size even."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(32, 32, bias=False).requires_grad_(False)
        self.up = nn.Linear(32, 64, bias=False)
        self.norm = nn.LayerNorm(64)
        self.down = nn.Linear(64, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(self.frozen(x)))).square().mean()


def _tier(device: str | None, directory: str) -> dict[str, Any] | None:
    return None if device is None else {"device": device, "nvme_path": directory}


def _config(case: dict[str, Any], directory: str) -> dict[str, Any]:
    return engine_config(
        case["stage"], micro=2, lr=1e-3, dtype=case.get("dtype", "fp32"), optimizer=case.get("optimizer", "AdamW"),
        optimizer_params=OPTIMIZER_PARAMS.get(case.get("optimizer", "adamw").lower()),
        stage3_param_persistence_threshold=0 if case["stage"] == 3 else None,
        offload_optimizer=_tier(case.get("optimizer_side"), directory),
        offload_param=_tier(case.get("param_shards"), directory),
    )


def _scalars(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's one-element state tensors (step counters, ASGD's eta and mu)."""
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if torch.is_tensor(value) and value.numel() == 1)


def held_and_declared(rank: int, world: int, cases: list[dict[str, Any]], directory: str) -> list[dict[str, Any]]:
    """Per case: the report between the second backward and its step (every kind of state held
    at once), its optimizer scalars, and the formula's report of the same model and config."""
    torch.set_num_threads(1)
    results = []
    for case in cases:
        model = Model()
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        matrices = sum(p.numel() for p in model.parameters() if p.requires_grad and p.ndim == 2)
        config = _config(case, directory)
        engine = zero_engine.initialize(model, config)
        x = torch.randn(2, 32, generator=torch.Generator().manual_seed(rank))
        for step in range(2):
            engine.backward(engine(x))
            if step == 0:
                engine.step()
        held = engine.memory_report()
        live = live_tensor_bytes() - x.untyped_storage().nbytes()  # the storages behind every live tensor
        scalars = _scalars(engine.optimizer)
        tier_buffers = engine.held.host_bytes  # what the tiers hold in host memory besides the states: NVMe's buffers
        engine.step()
        engine.close()
        counted: list[Any] = []
        declared = estimate_from_config(zero_engine.load_config(config), trainable, world, frozen_params=frozen,
                                        matrix_params=matrices, terms=counted)
        on_nvme = {kind: bytes_of(counted, tier=Tier.NVME, kind=kind) for kind in KINDS}
        on_nvme["frozen_parameters"] = bytes_of(counted, tier=Tier.NVME, part="frozen parameters")
        results.append({"held": {key: held[key] for key in COMPARED}, "scalars": scalars,
                        "declared": declared._asdict(), "tier_buffers": tier_buffers, "live": live, "held_now": sum(held[key] for key in HELD_NOW), "on_nvme": on_nvme})
    return results


TIER_CASES = [
    {"stage": 0}, {"stage": 1}, {"stage": 2}, {"stage": 3}, {"stage": 2, "dtype": "bf16"},
    {"stage": 3, "dtype": "bf16"},
    {"stage": 1, "optimizer_side": "cpu"}, {"stage": 2, "optimizer_side": "cpu", "dtype": "bf16"},
    {"stage": 3, "optimizer_side": "cpu"}, {"stage": 2, "optimizer_side": "nvme"},
    {"stage": 3, "optimizer_side": "nvme", "dtype": "bf16"},
    {"stage": 3, "param_shards": "cpu"}, {"stage": 3, "param_shards": "nvme"},
    {"stage": 3, "optimizer_side": "cpu", "param_shards": "cpu"},
    {"stage": 3, "optimizer_side": "cpu", "param_shards": "cpu", "dtype": "bf16"},
    {"stage": 3, "optimizer_side": "nvme", "param_shards": "nvme"},
]
OPTIMIZER_CASES = [{"stage": 2, "optimizer": name} for name in OPTIMIZERS] + [{"stage": 3, "optimizer": "Muon"}]
CASES = TIER_CASES + OPTIMIZER_CASES


@pytest.fixture(scope="module")
def two_ranks() -> list[list[dict[str, Any]]]:
    with tempfile.TemporaryDirectory(dir=DISK) as directory:
        return run_on_ranks(2, held_and_declared, CASES, directory, timeout=600)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[
    ",".join(f"{key}={value}" for key, value in case.items()) for case in CASES])
def test_declared_bytes_are_what_a_two_rank_build_holds(two_ranks: list[list[dict[str, Any]]], index: int) -> None:
    case = CASES[index]
    # Stage 3 keeps a host row of int64 per rank for its agreements, beside the model state.
    agreement = 8 * len(make_row(0, PassKind.FORWARD, [], 0)) * len(two_ranks) if case["stage"] == 3 else 0
    for rank, results in enumerate(two_ranks):
        result = results[index]
        # The report against the process: the storages behind every live tensor are what it
        # holds now, plus the tiers' own buffers (NVMe's) and stage 3's agreement rows.
        assert result["live"] == result["held_now"] + result["tier_buffers"] + agreement, (case, rank)
        held, declared = dict(result["held"]), result["declared"]
        held["optimizer_states"] -= result["scalars"]
        if case.get("optimizer_side") == "cpu":  # the scalars are in the host's optimizer state too
            held["host"] -= result["scalars"]
        if "nvme" not in (case.get("optimizer_side"), case.get("param_shards")):
            assert {key: held[key] for key in COMPARED} == {key: declared[key] for key in COMPARED}, (case, rank)
            continue
        # The report counts each kind as memory holds it now and what the swap files keep under
        # ``nvme`` alone (a master read ahead for the step is in memory, a gradient in the file):
        # the file's bytes exact, each kind's between what the formula leaves in memory and all of
        # it; the host holds, besides NVMe's buffers in flight (`Holdings.host_bytes`, which the
        # formula leaves out), what the formula's host holds and what is read in for the step.
        assert held["nvme"] == declared["nvme"], (case, rank)
        for kind in (*KINDS, "frozen_parameters"):
            assert declared[kind] - result["on_nvme"][kind] <= held[kind] <= declared[kind], (case, rank, kind)
        assert held["host"] - result["tier_buffers"] >= declared["host"], (case, rank)
