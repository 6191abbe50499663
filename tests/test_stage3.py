"""Stage 3 against one process: the same losses, evaluation losses and final parameters.

The model's traps at stage 3: the tied embedding/head weight is owned by the embedding's unit
and used by the head's, the frozen layer is wrapped but has nothing to shard, one parameter is
never used, sizes divide by no world size, two param groups split every unit, and with
``mlp_calls=2`` the norm/fc1/fc2 units run twice in one forward. Every step is followed by an
evaluation forward (eval mode, no_grad), which gathers and frees outside any backward.
"""

from __future__ import annotations

import pytest
import torch

import zero_engine
from harness import run_on_ranks
from models import decay_groups, make_model, train_engine, train_reference

STEPS, MICRO, LR, TOL = 4, 2, 0.05, 2e-5
WRAP_LEAVES = ["Embedding", "Linear", "LayerNorm"]


def stage3_config(case: dict) -> dict:
    zero = {
        "stage": 3,
        "reduce_bucket_size": case.get("bucket", 40),
        "stage3_param_persistence_threshold": case.get("persist", 0),
    }
    if case.get("wrap"):
        zero["stage3_wrap_modules"] = case["wrap"]
    for key in ("stage3_prefetch_bucket_size", "stage3_max_live_parameters"):
        if key in case:
            zero[key] = case[key]
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": case["accum"],
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "gradient_clipping": case.get("clip", 0.0),
        "zero_optimization": zero,
    }


def train_grid(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    results = []
    for case in cases:
        model = make_model(mlp_calls=case.get("mlp_calls", 1))
        engine = zero_engine.initialize(model, stage3_config(case), param_groups=decay_groups(model))
        eval_losses: list[float] = []
        losses, norms = train_engine(engine, rank, world_size, range(STEPS), MICRO, case["accum"], eval_losses)
        results.append({
            "losses": losses,
            "norms": norms,
            "eval": eval_losses,
            "state": engine.full_state_dict(),
            "units": [unit.label for unit in engine.gatherer.units],
        })
        engine.close()
    return results


GRID = [
    {"accum": 1, "wrap": WRAP_LEAVES},
    {"accum": 3, "wrap": WRAP_LEAVES, "mlp_calls": 2},
    {"accum": 3, "wrap": ["Linear"], "persist": 8},  # biases and norm stay resident
    {"accum": 1, "bucket": 40, "mlp_calls": 2, "clip": 0.05},  # size policy: units by parameter count
    {"accum": 2, "bucket": 10**6},  # one root unit holds everything
    {"accum": 1, "wrap": WRAP_LEAVES, "stage3_prefetch_bucket_size": 1, "stage3_max_live_parameters": 1},
]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_stage3_matches_single_process(world_size: int) -> None:
    per_rank = run_on_ranks(world_size, train_grid, GRID)
    for index, case in enumerate(GRID):
        results = [rank_results[index] for rank_results in per_rank]
        ref_eval: list[float] = []
        ref_losses, ref_state, ref_norms = train_reference(
            STEPS, MICRO * case["accum"] * world_size, "AdamW", LR, case.get("clip", 0.0), ref_eval,
            mlp_calls=case.get("mlp_calls", 1),
        )
        for step in range(STEPS):
            window = [loss for r in results for loss in r["losses"][step]]
            assert sum(window) / len(window) == pytest.approx(ref_losses[step], abs=TOL), (case, step)
        for rank, result in enumerate(results):
            assert result["eval"] == pytest.approx(ref_eval, abs=TOL), (case, rank)
            assert result["norms"] == pytest.approx(ref_norms, abs=1e-4), (case, rank)
            assert result["state"].keys() == ref_state.keys()
            for name, ref in ref_state.items():
                diff = (result["state"][name] - ref).abs().max().item()
                assert diff <= TOL, f"{case} rank {rank}: {name} differs by {diff}"
        assert torch.equal(results[0]["state"]["unused"], make_model().unused.detach())
    # The unit policies did what the grid says they do.
    assert per_rank[0][0]["units"] == ["<root>", "embed", "norm", "fc1", "fc2"]
    assert per_rank[0][2]["units"] == ["<root>", "fc1", "fc2"]  # biases resident, embed in the root
    assert per_rank[0][3]["units"] == ["<root>", "embed", "fc1", "fc2"]
    assert per_rank[0][4]["units"] == ["<root>"]
