"""Mixed precision, clipping, accumulation and schedules at every stage, against a
single-process reference that applies the same policy."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

import zero_engine
from harness import run_on_ranks
from models import make_model, micro_batch
from precision_cases import LR, MICRO, check_precision, check_skipped_everywhere, overflow_on_one_rank, precision_grid
from zero_engine.memory import HELD_NOW, formula_bytes
from zero_engine.stage import stage_for
from zero_engine.testing.process_memory import live_tensor_bytes
from zero_engine.precision import LossScaler
from zero_engine.sharding.gathering.agreement import PassKind, make_row

FULL_GRID = [
    {"stage": s, "dtype": d, "accum": a, "clip": c}
    for s, d, a, c in itertools.product((0, 1, 2, 3), ("fp32", "bf16", "fp16"), (1, 4), (0.0, 1.0))
]
# Every stage and every dtype at least once, with and without accumulation and clipping.
CI_GRID = [
    {"stage": 0, "dtype": "bf16", "accum": 4, "clip": 1.0},
    {"stage": 0, "dtype": "fp16", "accum": 1, "clip": 0.0},
    {"stage": 1, "dtype": "fp16", "accum": 4, "clip": 1.0},
    {"stage": 1, "dtype": "bf16", "accum": 1, "clip": 0.0},
    {"stage": 2, "dtype": "bf16", "accum": 4, "clip": 1.0},
    {"stage": 2, "dtype": "fp16", "accum": 1, "clip": 1.0},
    {"stage": 2, "dtype": "fp32", "accum": 4, "clip": 1.0},
    {"stage": 3, "dtype": "bf16", "accum": 4, "clip": 1.0},
    {"stage": 3, "dtype": "fp16", "accum": 1, "clip": 1.0},
]


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])  # 3: padding
def test_mixed_precision_matches_the_policy_reference(world_size: int) -> None:
    per_rank = run_on_ranks(world_size, precision_grid, CI_GRID)
    for index, case in enumerate(CI_GRID):
        check_precision(case, world_size, [r[index] for r in per_rank])


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_full_precision_grid(world_size: int) -> None:
    per_rank = run_on_ranks(world_size, precision_grid, FULL_GRID, timeout=900)
    for index, case in enumerate(FULL_GRID):
        check_precision(case, world_size, [r[index] for r in per_rank])


# -- fp16 overflow on one rank -------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3])
def test_fp16_overflow_on_one_rank_skips_everywhere(stage: int) -> None:
    for rank, result in enumerate(run_on_ranks(2, overflow_on_one_rank, stage)):
        check_skipped_everywhere(rank, result)


# -- one process: scaler, schedules, memory, low-precision models ------------------------------------


def test_dynamic_loss_scale_follows_deepspeed() -> None:
    """Step for step as DeepSpeed 0.19.8's own DynamicLossScaler went through the same overflow
    patterns (recorded by scripts/make_deepspeed_checkpoints.py): when the scale halves, when
    hysteresis is spent and refilled, and on which clean step it doubles."""
    recorded = json.loads((Path(__file__).parent / "data" / "deepspeed_loss_scale.json").read_text())
    assert recorded["deepspeed"] == "0.19.8"
    for case in recorded["cases"]:
        scaler = LossScaler(
            initial_scale_power=int(math.log2(case["init_scale"])), window=case["scale_window"],
            hysteresis=case["delayed_shift"], min_scale=case["min_scale"],
            consecutive_hysteresis=case["consecutive_hysteresis"],
        )
        ours = []
        for overflow in case["overflows"]:
            scaler.update(overflow)
            ours.append({"scale": scaler.scale, "hysteresis": scaler.remaining_hysteresis})
        assert ours == case["after"], case
    scaler = LossScaler(initial_scale_power=2, min_scale=2.0)
    for _ in range(5):
        scaler.update(overflow=True)
    assert scaler.scale == 2.0, "never below min_loss_scale"
    static = LossScaler(static_scale=128.0)
    static.update(overflow=True)
    assert static.scale == 128.0


def _lrs_over(config_scheduler: dict, steps: int, accum: int = 1, lr: float = 0.1) -> list[float]:
    engine = zero_engine.initialize(make_model(), {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accum,
        "optimizer": {"type": "SGD", "params": {"lr": lr}},
        "scheduler": config_scheduler,
        "zero_optimization": {"stage": 1},
    })
    rates = []
    for step in range(steps):
        rates.append(engine.get_lr()[0])
        for micro in range(accum):
            engine.backward(engine(*micro_batch(step, micro, 0, 1, MICRO, accum)))
            engine.step()
    return rates


def _warmup(i: int, warmup: int, kind: str) -> float:
    warmup = max(2, warmup)
    return math.log(i + 1) / math.log(warmup) if kind == "log" else i / warmup


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_schedules_follow_their_formulas(kind: str) -> None:
    """DeepSpeed 0.19.8's formulas and its count: optimizer step t uses iteration i = t - 1, and
    i = -1 (before the first step) gives the minimum (WarmupLR, WarmupDecayLR) or 0 (cosine)."""
    lo, hi, warm, total = 0.01, 0.1, 5, 20
    params = {"warmup_min_lr": lo, "warmup_max_lr": hi, "warmup_num_steps": warm, "warmup_type": kind}
    rates = _lrs_over({"type": "WarmupLR", "params": params}, 20, accum=2)
    gamma = {-1: 0.0, **{i: _warmup(i, warm, kind) if i < warm else 1.0 for i in range(19)}}
    assert rates == pytest.approx([lo + (hi - lo) * gamma[t - 1] for t in range(20)])

    rates = _lrs_over({"type": "WarmupDecayLR", "params": {**params, "total_num_steps": total}}, 20)
    decay = {i: max(0.0, (total - i) / (total - warm)) for i in range(19)}
    gamma = {-1: 0.0, **{i: _warmup(i, warm, kind) if i < warm else decay[i] for i in range(19)}}
    assert rates == pytest.approx([lo + (hi - lo) * gamma[t - 1] for t in range(20)])

    cosine = {"total_num_steps": total, "warmup_num_steps": warm, "warmup_min_ratio": 0.1,
              "cos_min_ratio": 0.05, "warmup_type": kind}
    rates = _lrs_over({"type": "WarmupCosineLR", "params": cosine}, 25, lr=0.2)

    def ratio(i: int) -> float:
        if i < 0:
            return 0.0
        if i < warm:
            return 0.1 + _warmup(i, warm, kind) * 0.9
        progress = min(1.0, (i - warm + 1) / (total - warm))  # stays at the floor past the end
        return 0.05 + 0.95 * (1 + math.cos(math.pi * progress)) / 2

    assert rates == pytest.approx([0.2 * ratio(t - 1) for t in range(25)])
    assert rates[-1] == pytest.approx(0.2 * 0.05)


def test_warmup_lr_rises_to_each_group_rate_when_its_maximum_is_left_out() -> None:
    """DeepSpeed's WarmupLR without warmup_max_lr warms up to the optimizer's own rate."""
    rates = _lrs_over({"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_type": "linear"}}, 4, lr=0.3)
    assert rates == pytest.approx([0.0, 0.0, 0.15, 0.3])


def test_torch_schedulers_step_once_per_optimizer_step() -> None:
    rates = _lrs_over({"type": "StepLR", "params": {"step_size": 3, "gamma": 0.5}}, 20, accum=3)
    assert rates == pytest.approx([0.1 * 0.5 ** (t // 3) for t in range(20)])


def test_scheduler_config_errors() -> None:
    with pytest.raises(zero_engine.ConfigError, match="scheduler.params.total_num_steps: required by WarmupDecayLR"):
        zero_engine.load_config({"scheduler": {"type": "WarmupDecayLR"}})
    with pytest.raises(zero_engine.ConfigError, match="ReduceLROnPlateau.*needs a metric"):
        zero_engine.load_config({"scheduler": {"type": "ReduceLROnPlateau"}})
    with pytest.raises(zero_engine.ConfigError, match="communication_data_type = 'bf16'.*needs bf16.enabled"):
        zero_engine.load_config({"communication_data_type": "bf16"})


def test_a_bf16_model_still_gets_fp32_masters() -> None:
    model = make_model().to(torch.bfloat16)
    values = {k: v.float() for k, v in model.state_dict().items()}
    engine = zero_engine.initialize(model, {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}})
    state = engine.full_state_dict()
    assert all(state[k].dtype == torch.float32 for k, _ in model.named_parameters())
    assert all(torch.equal(state[k], values[k]) for k in values if k != "temperature")
    assert all(unit.optimizer_shard.master.dtype == torch.float32 for unit in engine.units)
    engine.backward(engine(*micro_batch(0, 0, 0, 1, MICRO, 1)))
    engine.step()
    assert engine.module.fc1.weight.dtype == torch.bfloat16


ROW_BYTES = 8 * len(make_row(0, PassKind.FORWARD, [], 0))  # one rank's row of a stage 3 agreement


def mixed_memory(rank: int, world_size: int) -> list[dict]:
    results = []
    for stage in (0, 1, 2, 3):
        engine = model = None  # the last engine's tensors (and its model's views) must not count in the baseline
        baseline = live_tensor_bytes()
        torch.manual_seed(0)
        from models import DeepModel

        model = DeepModel()
        psi = sum(p.numel() for p in model.parameters())  # before stage 3 empties them
        engine = zero_engine.initialize(model, {
            "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "stage3_wrap_modules": ["Linear"],
                                  "stage3_param_persistence_threshold": 0},
        })
        for _ in range(2):  # torch.optim creates its state at the first step
            engine.backward(engine(torch.randn(4, 16)))
            memory = engine.memory_report()
            live = live_tensor_bytes() - baseline
            engine.step()
        largest = max(unit.layout.padded_numel for unit in engine.units)
        results.append({"stage": stage, "memory": memory, "live": live, "psi": psi, "units": len(engine.units),
                        "largest_unit": largest,
                        "tensors": len(engine.optimizer.state), "comm": engine.comm_report()})
        engine.close()
    return results


def test_mixed_precision_memory_follows_the_zero_paper() -> None:
    n = 2
    for result in run_on_ranks(n, mixed_memory)[0]:
        stage, memory, psi, units = result["stage"], result["memory"], result["psi"], result["units"]
        formula = formula_bytes(psi, stage_for(stage), n, param_bytes=2, grad_bytes=2, optimizer_bytes=8, master_bytes=4)
        padding = 4 * n * units  # at most n-1 padding elements per unit, 4 bytes at most each
        assert abs(memory["parameters"] - formula.parameters) <= padding, stage
        assert abs(memory["gradients"] - formula.gradients) <= padding, stage
        assert abs(memory["master_parameters"] - formula.master_parameters) <= padding, stage
        counters = 4 * result["tensors"]  # Adam's per-tensor step counters
        assert abs(memory["optimizer_states"] - counters - formula.optimizer_states) <= 2 * padding, stage
        # ...and the report is what the process holds: the storages behind every live tensor.
        # At most one reduced fp32 copy or bucket may still be held by its completed gloo work
        # (gloo's worker drops its reference after wait() returns: seen once at stage 1 in a
        # loaded full run). Stage 3 also holds the agreement proposed for the next pass (one
        # row of int64 per rank).
        held = sum(memory[key] for key in HELD_NOW)
        extra = 4 * result["largest_unit"] + (ROW_BYTES * n if stage == 3 else 0)
        assert 0 <= result["live"] - held <= extra, (stage, result["live"], memory)
        if stage >= 1:  # the all-gather moves bf16 compute copies: half the fp32 bytes (twice at stage 3)
            gathers = 2 if stage == 3 else 1
            assert abs(result["comm"]["all_gather"]["sent"] - gathers * (n - 1) / n * 2 * psi) <= gathers * padding
