"""DeepSpeed's own runs, replayed: the same config trains here as DeepSpeed 0.19.8 trains it.

`scripts/record_deepspeed_traces.py` ran each config of its grid under DeepSpeed (CPU, gloo,
2 ranks) and recorded the learning rate of every optimizer step and the global loss; the
traces and the versions that made them are in ``tests/data/deepspeed_traces/``. This test
trains the same model, from the same initial values, on the same batches, through zero_engine
with the same config file, and compares step by step: the learning rates exactly, the losses
within 2e-5 in fp32 (the two engines sum gradients in different orders) and within the
rounding of the compute dtype in bf16 and fp16 (DeepSpeed also reduces gradients in that dtype;
we reduce in fp32, see docs/config.md). DeepSpeed itself is not imported.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

import zero_engine
from harness import run_on_ranks
from repo_scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
TRACES = sorted((ROOT / "tests" / "data" / "deepspeed_traces").glob("*.json"))
# The loss is a mean over 2 ranks x 2 x 8 tokens; 16-bit compute rounds each logit to 8 (bf16) or
# 11 (fp16) bits, and DeepSpeed sums 16-bit gradients where we sum fp32 ones.
TOLERANCE = {"fp32": 2e-5, "fp16": 1e-4, "bf16": 1e-3}


def _recorder() -> Any:
    return load_script("record_deepspeed_traces")


RECORDER = _recorder()


def _precision(config: dict[str, Any]) -> str:
    for dtype in ("bf16", "fp16"):
        if config.get(dtype, {}).get("enabled"):
            return dtype
    return "fp32"


def _train(engine: Any, steps: range, rank: int, world_size: int, accum: int) -> tuple[list[float], list[float]]:
    lrs, losses = [], []
    for step in steps:
        lrs.append(engine.get_lr()[0])
        window = 0.0
        for micro_step in range(accum):
            inputs, targets = RECORDER.inputs_and_targets(RECORDER.batch(step, micro_step, rank, world_size))
            loss = RECORDER.loss_of(engine(inputs), targets)
            engine.backward(loss)
            engine.step()
            window += loss.item() / accum
        losses.append(window)
    return lrs, losses


def replay(rank: int, world_size: int, traces: list[dict[str, Any]], directory: str) -> list[dict[str, Any]]:
    """Each trace's config through zero_engine: this rank's learning rates and window losses."""
    results = []
    for trace in traces:
        config, resume = trace["config"], trace["resume_at"]
        accum = config["gradient_accumulation_steps"]
        engine = zero_engine.initialize(RECORDER.make_model(), config)
        lrs, losses = _train(engine, range(resume or RECORDER.STEPS), rank, world_size, accum)
        if resume is not None:
            path = Path(directory) / trace["name"]
            engine.save_checkpoint(path)
            engine.close()
            engine = zero_engine.initialize(RECORDER.make_model(), config)
            engine.load_checkpoint(path)
            more_lrs, more_losses = _train(engine, range(resume, RECORDER.STEPS), rank, world_size, accum)
            lrs, losses = lrs + more_lrs, losses + more_losses
        results.append({"lrs": lrs, "losses": losses, "skipped_steps": engine.skipped_steps})
        engine.close()
    return results


def test_the_recorded_traces_cover_the_grid() -> None:
    """Every config of the recorder's grid has its trace, made by the DeepSpeed version we follow."""
    names = {trace.stem for trace in TRACES}
    assert names == {case["name"] for case in RECORDER.GRID}
    for path in TRACES:
        made_by = json.loads(path.read_text())["made_by"]
        assert made_by["deepspeed"] == "0.19.8" and made_by["accelerator"] == "cpu", path.name


def test_deepspeed_configs_train_as_deepspeed_trains_them() -> None:
    traces = [json.loads(path.read_text()) for path in TRACES]
    with tempfile.TemporaryDirectory() as directory:
        per_rank = run_on_ranks(RECORDER.WORLD_SIZE, replay, traces, directory, timeout=300)
    failures = []
    for index, trace in enumerate(traces):
        ranks = [results[index] for results in per_rank]
        lrs = ranks[0]["lrs"]
        losses = [sum(rank["losses"][step] for rank in ranks) / len(ranks) for step in range(RECORDER.STEPS)]
        tolerance = TOLERANCE[_precision(trace["config"])]
        if lrs != pytest.approx(trace["lrs"], rel=1e-12, abs=1e-15):
            failures.append(f"{trace['name']}: learning rates {lrs}, DeepSpeed's {trace['lrs']}")
        worst = max(abs(ours - theirs) for ours, theirs in zip(losses, trace["losses"]))
        if worst > tolerance:
            failures.append(f"{trace['name']}: losses {losses}, DeepSpeed's {trace['losses']}: {worst:.3g} apart")
        if ranks[0]["skipped_steps"] != trace["skipped_steps"]:
            skipped = ranks[0]["skipped_steps"]
            failures.append(f"{trace['name']}: skipped steps {skipped}, DeepSpeed's {trace['skipped_steps']}")
    assert not failures, "\n".join(failures)


def test_the_same_init_and_batches_as_the_recording() -> None:
    """The replay starts where DeepSpeed started: the recorder's model and batches are
    deterministic (a changed seed or model would make every comparison meaningless)."""
    first, second = RECORDER.make_model(), RECORDER.make_model()
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(RECORDER.batch(2, 1, 1, 2), RECORDER.batch(2, 1, 1, 2))
    trace = json.loads((ROOT / "tests/data/deepspeed_traces/stage1_warmup_linear_no_clipping.json").read_text())
    inputs, targets = RECORDER.inputs_and_targets(RECORDER.batch(0, 0, 0, 2))
    with torch.no_grad():
        rank0 = RECORDER.loss_of(first(inputs), targets).item()
        inputs, targets = RECORDER.inputs_and_targets(RECORDER.batch(0, 0, 1, 2))
        rank1 = RECORDER.loss_of(first(inputs), targets).item()
    assert (rank0 + rank1) / 2 == pytest.approx(trace["losses"][0], abs=1e-6)
