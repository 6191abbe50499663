"""The engine surface that framework loops drive (Hugging Face's Trainer, Lightning), with
DeepSpeed's names: ``backward(loss, scale_wrt_gas=False)``, `set_gradient_accumulation_boundary`
for an epoch's short last window, ``no_sync()``, ``zero_grad()``, ``initialize(lr_scheduler=)``
and ``was_step_applied()``.

The multi-rank test trains as the Trainer does: it divides each micro-step's loss by the size
of its window itself, and ends the second window after 2 of the config's 4 micro-steps; the
reference is one process stepping on each window's whole batch.
"""

from __future__ import annotations

import pytest
import torch

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from models import decay_groups, global_batch, make_model, micro_batch, train_engine

MICRO, GAS, LR, CLIP = 2, 4, 0.05, 0.5
WINDOWS = [4, 2, 4]  # micro-steps per window: the second ends early, as an epoch's last does
WARMUP = 3


def _warmup(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP))


def trainer_like(rank: int, world_size: int, stages: list[int]) -> list[dict]:
    results = []
    for stage in stages:
        model = make_model()
        config = engine_config(
            stage, micro=MICRO, lr=LR, accum=GAS, clip=CLIP, reduce_bucket_size=40, stage3_param_persistence_threshold=0
        )
        engine = zero_engine.initialize(model, config, param_groups=decay_groups(model), lr_scheduler=_warmup)
        losses, lrs, norms, applied = [], [], [], []
        for step, size in enumerate(WINDOWS):
            window = []
            for micro in range(size):
                engine.set_gradient_accumulation_boundary(micro == size - 1)
                with engine.no_sync():
                    loss = engine(*micro_batch(step, micro, rank, world_size, MICRO, size))
                    engine.backward(loss / size, scale_wrt_gas=False)
                engine.step()
                window.append(loss.item())
            losses.append(sum(window) / size)
            lrs.append(engine.get_lr())
            norms.append(engine.get_global_grad_norm())
            applied.append(engine.was_step_applied())
        results.append({
            "losses": losses, "lrs": lrs, "norms": norms, "applied": applied, "global_step": engine.global_step,
            "state": engine.full_state_dict(),
        })
        engine.close()
    return results


def _reference(world_size: int) -> dict:
    model = make_model()
    optimizer = torch.optim.AdamW(decay_groups(model), lr=LR)
    schedule = _warmup(optimizer)
    losses, lrs, norms = [], [], []
    for step, size in enumerate(WINDOWS):
        loss = model(*global_batch(step, MICRO * size * world_size))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], CLIP).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        losses.append(loss.item())
        lrs.append([group["lr"] for group in optimizer.param_groups])
    return {"losses": losses, "lrs": lrs, "norms": norms, "state": model.state_dict()}


def test_a_trainer_loop_with_a_short_last_window_matches_one_process() -> None:
    stages = [0, 1, 2, 3]
    per_rank = run_on_ranks(2, trainer_like, stages)
    ref = _reference(2)
    for index, stage in enumerate(stages):
        results = [r[index] for r in per_rank]
        losses = [sum(r["losses"][w] for r in results) / 2 for w in range(len(WINDOWS))]
        assert losses == pytest.approx(ref["losses"], abs=2e-5), stage
        for result in results:
            assert result["applied"] == [True] * len(WINDOWS) and result["global_step"] == len(WINDOWS), stage
            assert result["lrs"] == ref["lrs"], stage  # the schedule steps once per window
            assert result["norms"] == pytest.approx(ref["norms"], abs=1e-4), stage
            for name, value in ref["state"].items():
                diff = (result["state"][name] - value).abs().max().item()
                assert diff <= 2e-5, f"stage {stage}: {name} differs by {diff}"


# -- one process ---------------------------------------------------------------------------------


def _engine(stage: int = 1, **options):
    model = make_model()
    config = engine_config(stage, micro=MICRO, lr=LR, accum=2, **options)
    return zero_engine.initialize(model, config, param_groups=decay_groups(model))


def test_a_skipped_step_is_not_applied_and_does_not_advance_the_schedule() -> None:
    model = make_model()
    engine = zero_engine.initialize(
        model, engine_config(2, micro=MICRO, lr=LR, accum=1), param_groups=decay_groups(model), lr_scheduler=_warmup
    )
    assert not engine.was_step_applied()
    train_engine(engine, 0, 1, range(1), MICRO, 1)
    assert engine.was_step_applied()
    lr = engine.get_lr()
    engine.backward(engine(*micro_batch(1, 0, 0, 1, MICRO, 1)) * float("nan"))
    engine.step()
    assert not engine.was_step_applied() and engine.skipped_steps == 1
    assert engine.get_lr() == lr
    engine.close()


def test_zero_grad_drops_the_window_so_far() -> None:
    """Two micro-steps whose first one was dropped give the one-micro-step window's update."""
    dropped, single = _engine(1), _engine(1)
    batch = micro_batch(0, 1, 0, 1, MICRO, 2)
    dropped.backward(dropped(*micro_batch(0, 0, 0, 1, MICRO, 2)))
    dropped.step()
    dropped.zero_grad()
    single.set_gradient_accumulation_boundary(True)  # the same window without the dropped micro-step
    dropped.backward(dropped(*batch))
    dropped.step()
    single.backward(single(*batch))
    single.step()
    for name, value in single.full_state_dict().items():
        assert torch.equal(dropped.full_state_dict()[name], value), name
    dropped.close()
    single.close()


def test_a_boundary_said_holds_until_said_again() -> None:
    engine = _engine(0)
    assert not engine.is_gradient_accumulation_boundary()  # micro-step 1 of 2
    engine.set_gradient_accumulation_boundary(True)
    for _ in range(2):
        assert engine.is_gradient_accumulation_boundary()
        engine.backward(engine(*micro_batch(0, 0, 0, 1, MICRO, 2)))
        engine.step()
    assert engine.global_step == 2
    engine.set_gradient_accumulation_boundary(None)  # back to counting, from a fresh window
    assert not engine.is_gradient_accumulation_boundary()
    engine.close()


def test_lr_scheduler_must_be_a_function_of_the_engines_optimizer() -> None:
    model = make_model()
    other = torch.optim.AdamW(model.parameters(), lr=LR)
    with pytest.raises(TypeError, match=r"pass a function of the optimizer, e.g. lambda optimizer: LambdaLR"):
        zero_engine.initialize(model, engine_config(1, micro=MICRO, lr=LR), lr_scheduler=_warmup(other))
    config = engine_config(1, micro=MICRO, lr=LR)
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
    with pytest.raises(ValueError, match=r"and the config's scheduler section \(WarmupLR\) both give a schedule"):
        zero_engine.initialize(make_model(), config, lr_scheduler=_warmup)


def test_the_batch_sizes_are_read_as_deepspeeds_engine_gives_them() -> None:
    """For a data loader built as DeepSpeed's ``training_data=`` built it (the migration guide)."""
    engine = zero_engine.initialize(torch.nn.Linear(2, 1), {"train_micro_batch_size_per_gpu": 3,
                                                            "gradient_accumulation_steps": 2})
    assert (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
            engine.train_batch_size()) == (3, 2, 6)
    engine.close()
