"""Backward however it is called: ``loss.backward()``, ``torch.autograd.backward`` and
``engine.backward(loss)`` reduce the same way at every stage (the end of backward is queued on
autograd's engine, not run by `Engine.backward`), and the misuses that used to train wrong in
silence fail with an error that says what to do.

Before: a plain ``loss.backward()`` left stage 0 replicas apart (0.078 after two steps) and
stages 2-3 with a zero gradient norm, learning nothing. Plain SGD (no momentum, no clipping)
makes any scale error show in the parameters.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from models import decay_groups, make_model, micro_batch

MICRO, STEPS = 2, 3
WAYS = ("engine.backward", "loss.backward", "torch.autograd.backward")
CASES = [{"stage": stage, "bf16": bf16} for stage, bf16 in itertools.product((0, 1, 2, 3), (False, True))]


def _config(
    stage: int, bf16: bool = False, fp16: bool = False, accum: int = 1, shard_group_size: int | None = None
) -> dict:
    return engine_config(
        stage, micro=MICRO, lr=0.5, accum=accum, optimizer="SGD", dtype="bf16" if bf16 else "fp16" if fp16 else "fp32",
        reduce_bucket_size=40, stage3_param_persistence_threshold=0, shard_group_size=shard_group_size,
    )


def _engine(config: dict) -> zero_engine.Engine:
    model = make_model()
    return zero_engine.initialize(model, config, param_groups=decay_groups(model))


def _backward(way: str, engine: zero_engine.Engine, loss: torch.Tensor) -> None:
    if way == "engine.backward":
        engine.backward(loss)
    elif way == "loss.backward":
        loss.backward()
    else:
        torch.autograd.backward([loss])  # as a library that runs backward itself


def each_way(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    results = []
    for case in cases:
        out = {}
        for way in WAYS:
            engine = _engine(_config(case["stage"], case["bf16"]))
            norms = []
            for step in range(STEPS):
                _backward(way, engine, engine(*micro_batch(step, 0, rank, world_size, MICRO, 1)))
                engine.step()
                norms.append(engine.get_global_grad_norm())
            out[way] = {"norms": norms, "state": engine.full_state_dict()}
            engine.close()
        results.append(out)
    return results


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])  # 3: padding; 2 ranks elsewhere
def test_plain_backward_trains_exactly_as_engine_backward(world_size: int) -> None:
    per_rank = run_on_ranks(world_size, each_way, CASES)
    initial = make_model().state_dict()
    for index, case in enumerate(CASES):
        reference = per_rank[0][index]["engine.backward"]
        assert all(norm > 1e-3 for norm in reference["norms"]), (case, reference["norms"])
        assert any(not torch.equal(reference["state"][k], initial[k].float()) for k in initial), case  # it learned
        for rank, results in enumerate(per_rank):
            for way in WAYS:
                result = results[index][way]
                assert result["norms"] == reference["norms"], (case, rank, way)
                for name, value in reference["state"].items():
                    assert torch.equal(result["state"][name], value), (case, rank, way, name)


def misuses(rank: int, world_size: int) -> dict[str, str]:
    out = {}

    def error_of(action) -> str:
        try:
            action()
        except RuntimeError as error:
            return str(error)
        return "no error"

    engine = _engine(_config(2))
    out["step_without_backward"] = error_of(engine.step)
    engine.backward(engine(*micro_batch(0, 0, rank, world_size, MICRO, 1)))
    engine.step()
    out["step_twice"] = error_of(engine.step)
    engine.close()

    engine = _engine(_config(1, fp16=True))
    engine(*micro_batch(0, 0, rank, world_size, MICRO, 1)).backward()
    out["fp16_plain_backward"] = error_of(engine.step)
    engine.close()

    engine = _engine(_config(0))
    tokens, targets = micro_batch(0, 0, rank, world_size, MICRO, 1)
    engine.backward(engine(tokens, targets))
    out["second_backward_at_boundary"] = error_of(lambda: engine.backward(engine(tokens, targets)))
    engine.close()
    return out


def test_misuses_fail_with_what_to_do() -> None:
    for out in run_on_ranks(2, misuses):
        assert out["step_without_backward"].startswith("engine.step() without a backward since the last step()")
        assert "micro-step 1" in out["step_twice"]
        assert "use engine.backward(loss)" in out["fp16_plain_backward"]
        assert "call engine.step() after each backward" in out["second_backward_at_boundary"]


SPLIT_CASES = [(0, 2), (1, 2), (2, 1), (3, 2)]  # (stage, accumulation steps)


def two_backwards_per_micro_step(rank: int, world_size: int, cases: list[tuple[int, ...]]) -> list[list[dict]]:
    """Each micro-batch's loss in one backward, or as two half-batch backwards: stages 2-3
    reduce each backward into the shard, stages 0-1 accumulate off the boundary (where two
    backwards are allowed there). A case is (stage, accumulation steps[, shard group size])."""
    results = []
    for stage, accum, *group in cases:
        states = []
        for split in (False, True):
            engine = _engine(_config(stage, accum=accum, shard_group_size=group[0] if group else None))
            for step in range(2):
                for micro in range(accum):
                    tokens, targets = micro_batch(step, micro, rank, world_size, MICRO, accum)
                    halves = [engine(tokens[i : i + 1], targets[i : i + 1]) / 2 for i in range(2)]
                    may_split = stage >= 2 or not engine.is_gradient_accumulation_boundary()
                    if split and may_split:
                        for half in halves:
                            engine.backward(half)
                    else:
                        engine.backward(halves[0] + halves[1])
                    engine.step()
            states.append(engine.full_state_dict())
            engine.close()
        results.append(states)
    return results


def test_several_backwards_in_a_micro_step_add_up() -> None:
    for per_case in run_on_ranks(2, two_backwards_per_micro_step, SPLIT_CASES):
        check_backwards_add_up(SPLIT_CASES, per_case)


def check_backwards_add_up(cases: list[tuple[int, ...]], per_case: list[list[dict]]) -> None:
    for (stage, *_), (joined, split) in zip(cases, per_case):
        for name, value in joined.items():
            torch.testing.assert_close(split[name], value, rtol=0, atol=1e-6, msg=f"stage {stage}: {name}")


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises the first time."""

    failed = False

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if not _FailOnce.failed:
            _FailOnce.failed = True
            raise RuntimeError("deliberate failure in backward")
        return grad


def backward_after_a_failed_one(rank: int, world_size: int) -> tuple[str, list[dict]]:
    """A backward that raises after reaching the engine (so its end is never run) leaves no
    armed state behind: the next forward and backward reduce as if it had never happened.
    (One that raises after some gradients arrived leaves those, as plain PyTorch does.)"""
    states = []
    message = ""
    for fail in (False, True):
        engine = _engine(_config(2))
        tokens, targets = micro_batch(0, 0, rank, world_size, MICRO, 1)
        if fail:  # fails after the backward reached (and armed) the engine, before any parameter's gradient
            _FailOnce.failed = False
            hook = engine.module.head.register_forward_hook(lambda module, args, out: _FailOnce.apply(out))
            try:
                engine.backward(engine(tokens, targets))
            except RuntimeError as error:
                message = str(error)
            hook.remove()
        engine.backward(engine(tokens, targets))
        engine.step()
        states.append(engine.full_state_dict())
        engine.close()
    return message, states


def test_a_backward_that_raised_leaves_nothing_armed() -> None:
    for message, (clean, after_failure) in run_on_ranks(2, backward_after_a_failed_one):
        assert "deliberate failure in backward" in message
        for name, value in clean.items():
            assert torch.equal(after_failure[name], value), name
