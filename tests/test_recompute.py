"""``zero_optimization.recompute_units``: each unit recomputed in backward. At stages 0-3 on 2
ranks: the same losses and weights as without; activation memory as the process holds it
(autograd's saved-tensor storage after forward, the resident growth of forward and the step's
resident high-water mark) against without; at stage 3 the same gathers per step (the backward's
gather serves the recomputation: a second one would double the all-gather bytes)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from models import BlockStack
from zero_engine.testing.process_memory import (
    SavedTensorMeter,
    peak_resident_bytes,
    reset_peak_resident,
    resident_bytes,
)

WIDTH, DEPTH, BATCH = 64, 6, 1024  # a block's activations: ~2.3 MB, its input 256 KB


def _measured(engine: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    gc.collect()
    start = resident_bytes()
    reset_peak_resident()
    with SavedTensorMeter() as saved:
        loss = engine(x, y)
    forward_growth = resident_bytes() - start
    saved_bytes = saved.bytes_held()
    engine.backward(loss)
    step_peak = peak_resident_bytes() - start
    engine.step()
    gathered = engine.comm_report()["all_gather"]["received"]
    return {"loss": loss.item(), "saved": saved_bytes, "forward_growth": forward_growth, "step_peak": step_peak,
            "gathered": gathered}


def recompute_runs(rank: int, world_size: int, stages: list[int]) -> dict[str, Any]:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, 1, generator=generator))
               for _ in range(2)]
    results = {}
    for stage in stages:
        for recompute in (False, True):
            torch.manual_seed(0)
            config = engine_config(stage, micro=BATCH, lr=0.01, stage3_wrap_modules=["Block"],
                                   stage3_param_persistence_threshold=0, recompute_units=recompute)
            engine = zero_engine.initialize(BlockStack(WIDTH, DEPTH), config)
            steps = [_measured(engine, x, y) for x, y in batches]
            results[(stage, recompute)] = {"steps": steps, "state": engine.full_state_dict()}
            engine.close()
    return results


@pytest.mark.parametrize("stages", [[3], pytest.param([0, 1, 2], marks=pytest.mark.slow)])
def test_recomputed_units_train_the_same_with_less_activation_memory_and_no_extra_gathers(
    monkeypatch: Any, stages: list[int]
) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # each tensor its own mapping, returned when freed
    for rank_results in run_on_ranks(2, recompute_runs, stages):
        for stage in stages:
            kept, recomputed = rank_results[(stage, False)], rank_results[(stage, True)]
            assert [s["loss"] for s in recomputed["steps"]] == [s["loss"] for s in kept["steps"]], stage
            for key, value in kept["state"].items():
                assert torch.allclose(recomputed["state"][key], value, rtol=0, atol=1e-6), (stage, key)
            last_kept, last_recomputed = kept["steps"][-1], recomputed["steps"][-1]  # the first one warmed up
            # Autograd keeps each block's fc1 input, GELU input and fc2 input (2.3 MB a block)
            # without; with, only what lies outside the blocks (the head's input).
            figures = (stage, last_recomputed, last_kept)
            assert last_recomputed["saved"] < 0.2 * last_kept["saved"], figures
            assert last_recomputed["forward_growth"] < 0.5 * last_kept["forward_growth"], figures
            assert last_recomputed["step_peak"] < 0.75 * last_kept["step_peak"], figures
            assert last_recomputed["gathered"] == last_kept["gathered"], stage  # stage 3: gathers unchanged
            if stage == 3:
                assert last_kept["gathered"] > 0
