"""One optimizer table (STRUCTURE item 7, optimizers): a fake whole-matrix optimizer added as a
row of `zero_engine.optimizer_kinds.OPTIMIZERS` (its class, layout, state bytes and which
parameters it takes: every matrix, embeddings included, unlike Muon's rule) is found by
``optimizer.type``, validated, planned and stepped through the matrix exchange at 2 ranks,
stages 1 and 3, with no other edit, equal to the same optimizer over whole parameters in one
process."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zero_engine
from harness import run_on_ranks
from models import global_batch, make_model, train_engine

STEPS, MICRO = 3, 2


class NormalisedMomentum(zero_engine.muon.MuonWithAdamW):
    """Muon's split, its whole-matrix part the update over its Frobenius norm (needs the whole matrix)."""

    def orthogonalise_matrix(self, update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        self.orthogonalisations += 1
        return update / (update.norm() + 1e-7)


def _register() -> None:
    from zero_engine.optimizer_kinds import OPTIMIZERS, WHOLE_MATRIX, OptimizerKind

    OPTIMIZERS["normalisedmomentum"] = OptimizerKind(
        WHOLE_MATRIX, lambda p: 4, lambda p: 8, cls=NormalisedMomentum, takes=lambda name, p: p.dim() >= 2,
    )


OPTIONS = {"lr": 0.02, "momentum": 0.9}


def _engine_run(rank: int, world_size: int, stage: int) -> dict:
    _register()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "optimizer": {"type": "NormalisedMomentum", "params": OPTIONS},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine = zero_engine.initialize(make_model(), config)
    losses, _ = train_engine(engine, rank, world_size, range(STEPS), MICRO, 1)
    return {"losses": [w[0] for w in losses], "state": engine.full_state_dict(),
            "orthogonalised": engine.optimizer.orthogonalisations, "type": type(engine.optimizer).__name__}


def _reference(world_size: int) -> tuple[list[float], dict]:
    model = make_model()
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = NormalisedMomentum([{"params": matrices, "use_muon": True}, {"params": rest, "use_muon": False}],
                                   **OPTIONS)
    losses = []
    for step in range(STEPS):
        loss = model(*global_batch(step, MICRO * world_size))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_a_whole_matrix_optimizer_added_to_the_table_trains_as_in_one_process(stage: int) -> None:
    per_rank = run_on_ranks(2, _engine_run, stage)
    losses, state = _reference(2)
    # embed (tied to head), fc1, fc2: each matrix once a step, on one rank ('unused' gets no gradient)
    assert sum(r["orthogonalised"] for r in per_rank) == STEPS * 3
    for rank, found in enumerate(per_rank):
        assert found["type"] == "NormalisedMomentum"
        mean = [sum(r["losses"][s] for r in per_rank) / 2 for s in range(STEPS)]
        assert mean == pytest.approx(losses, abs=1e-5), (stage, mean, losses)
        for name, value in state.items():
            torch.testing.assert_close(found["state"][name], value, rtol=0, atol=2e-6, msg=f"{stage} {rank} {name}")
