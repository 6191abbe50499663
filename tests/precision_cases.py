"""The mixed-precision cases several test modules train (precision, hybrid sharding, offload,
CUDA): the engine's config per case, the grid run on each rank, its check against the policy
reference, and fp16 overflow on one rank with its check."""

from __future__ import annotations

import pytest
import torch

import zero_engine
from configs import engine_config
from models import decay_groups, make_model, micro_batch, train_engine, train_reference_policy

STEPS, MICRO, LR, STATIC_SCALE = 4, 2, 0.01, 256.0
# Adam's eps well above low-precision gradient noise: with the default 1e-8, an element whose
# gradient nearly cancels can flip sign between two equally valid roundings and move by 2 x lr,
# which says nothing about the engine. With 1e-3 the update is linear in such tiny gradients.
EPS = 1e-3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Max abs difference of the fp32 masters from the reference after STEPS steps, per dtype, and
# relative difference of the gradient norms. fp32: summation order only (as in the parity
# tests). bf16 keeps 8 significant bits: gradients summed across ranks in fp32 and rounded once
# differ from the reference's bf16 accumulation by ~2**-8 relative, and the compute copy is
# re-rounded every step; fp16 keeps 11 bits. Worst cases measured over the full grid (stages
# 0-2 x dtypes x accumulation {1, 4} x clipping {off, 1.0} at 1-4 ranks): fp32 1.2e-7 / 1.1e-7,
# bf16 2.9e-3 / 3.6e-3, fp16 3.1e-4 / 3.2e-4. Tolerances are about 3x those: for bf16 that is
# ~2.5 units in the last place of a master value near 1.
TOLERANCE = {"fp32": 2e-5, "bf16": 1e-2, "fp16": 1e-3}
NORM_TOLERANCE = {"fp32": 1e-5, "bf16": 1.5e-2, "fp16": 1e-3}
# Losses are compute-dtype numbers (fp16 spacing near 5 is 2**-8), so relative: 2 units in the
# last place of the loss's own dtype.
LOSS_TOLERANCE = {"fp32": 1e-6, "bf16": 2 * 2**-8, "fp16": 2 * 2**-11}


def precision_config(case: dict) -> dict:
    # Stage 3: embed, fc1 and fc2 become units of their own (size policy), nothing resident.
    return engine_config(
        case["stage"], micro=MICRO, lr=LR, accum=case["accum"], optimizer_params={"eps": EPS}, clip=case["clip"],
        dtype=case["dtype"], fp16={"loss_scale": STATIC_SCALE}, reduce_bucket_size=60,
        stage3_param_persistence_threshold=0, shard_group_size=case.get("shard_group_size"), **case.get("zero", {}),
    )


def precision_grid(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Train every case through the engine on this rank's share of each global batch."""
    results = []
    for case in cases:
        model = make_model()
        engine = zero_engine.initialize(model, precision_config(case), param_groups=decay_groups(model))
        windows, norms = train_engine(engine, rank, world_size, range(STEPS), MICRO, case["accum"])
        losses = [sum(window) / len(window) for window in windows]
        results.append({
            "losses": losses, "norms": norms, "state": engine.full_state_dict(),
            "skipped": engine.skipped_steps, "memory": engine.memory_report(),
        })
        engine.close()
    return results


def check_precision(case: dict, world_size: int, per_rank: list[dict]) -> None:
    dtype = DTYPES[case["dtype"]]
    scale = STATIC_SCALE if case["dtype"] == "fp16" else 1.0
    ref_losses, ref_state, ref_norms = train_reference_policy(
        STEPS, world_size, MICRO, case["accum"], dtype, case["clip"], scale, LR, EPS
    )
    tol = TOLERANCE[case["dtype"]]
    losses = [sum(r["losses"][s] for r in per_rank) / world_size for s in range(STEPS)]
    assert losses == pytest.approx(ref_losses, rel=LOSS_TOLERANCE[case["dtype"]]), case
    for rank, result in enumerate(per_rank):
        assert result["skipped"] == 0
        assert result["norms"] == pytest.approx(ref_norms, rel=NORM_TOLERANCE[case["dtype"]]), (case, rank)
        for name, ref in ref_state.items():
            got = result["state"][name]
            assert got.dtype == ref.dtype, f"{name}: full_state_dict must hold fp32 masters"
            diff = (got - ref).abs().max().item()
            assert diff <= tol, f"{case} rank {rank}: {name} differs by {diff} (tolerance {tol})"


def overflow_on_one_rank(rank: int, world_size: int, stage: int, poisoner: int = 1, zero: dict | None = None) -> dict:
    """Rank ``poisoner`` poisons one gradient element that rank 0 owns after the reduction, on
    step 1. ``zero``: more zero_optimization settings."""
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": LR / 10, "warmup_max_lr": LR,
                                                     "warmup_num_steps": 10, "warmup_type": "linear"}},
        "zero_optimization": {
            "stage": stage, "reduce_bucket_size": 10**6, "stage3_param_persistence_threshold": 0, **(zero or {}),
        },
    }
    model = make_model()
    engine = zero_engine.initialize(model, config, param_groups=decay_groups(model))
    unit = engine.units[0]
    target = next(  # a used parameter whose element 0 sits in rank 0's shard of unit 0
        param for param, offset in zip(unit.params, unit.layout.param_offsets)
        if offset < unit.layout.shard_numel and param is not model.unused
    )
    poison = {"armed": False}

    def inject(grad: torch.Tensor) -> torch.Tensor:
        if poison["armed"] and rank == poisoner:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    target.register_hook(inject)

    def train_step(step: int) -> None:
        engine.backward(engine(*micro_batch(step, 0, rank, world_size, MICRO, 1)))
        engine.step()

    train_step(0)
    before = {
        "state": engine.full_state_dict(),
        "optimizer": {id(t): {k: v.clone() for k, v in s.items()} for t, s in engine.optimizer.state.items()},
        "scale": engine.loss_scale,
        "lr": engine.get_lr(),
    }
    poison["armed"] = True
    train_step(1)
    poison["armed"] = False
    after_skip = {
        "state": engine.full_state_dict(),
        "optimizer": {id(t): {k: v.clone() for k, v in s.items()} for t, s in engine.optimizer.state.items()},
        "scale": engine.loss_scale,
        "lr": engine.get_lr(),
        "skipped": engine.skipped_steps,
    }
    train_step(2)
    return {
        "before": before,
        "after_skip": after_skip,
        "after_clean": {"state": engine.full_state_dict(), "lr": engine.get_lr(), "scale": engine.loss_scale},
    }


def check_skipped_everywhere(rank: int, result: dict) -> None:
    """The step with the overflow changed nothing but the loss scale; the next one trained."""
    before, skipped, clean = result["before"], result["after_skip"], result["after_clean"]
    assert skipped["skipped"] == 1, f"rank {rank} did not skip"
    for name, value in before["state"].items():
        assert torch.equal(skipped["state"][name], value), f"rank {rank}: {name} changed on a skipped step"
    assert skipped["optimizer"].keys() == before["optimizer"].keys()
    for key, state in before["optimizer"].items():
        for field, value in state.items():
            assert torch.equal(skipped["optimizer"][key][field], value), f"rank {rank}: optimizer {field} changed"
    assert skipped["scale"] == before["scale"] / 2 == 128.0
    assert skipped["lr"] == before["lr"], "the scheduler advanced on a skipped step"
    assert clean["lr"] != skipped["lr"], "the scheduler did not advance on the next clean step"
    assert clean["scale"] == 128.0
    assert any(not torch.equal(clean["state"][k], v) for k, v in skipped["state"].items()), "no update after"
