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
from harness import run_on_ranks
from backward_cases import MICRO, backward_config, check_backwards_add_up, sgd_engine, two_backwards_per_micro_step
from models import make_model, micro_batch

STEPS = 3
WAYS = ("engine.backward", "loss.backward", "torch.autograd.backward")
CASES = [{"stage": stage, "bf16": bf16} for stage, bf16 in itertools.product((0, 1, 2, 3), (False, True))]


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
            engine = sgd_engine(backward_config(case["stage"], case["bf16"]))
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

    engine = sgd_engine(backward_config(2))
    out["step_without_backward"] = error_of(engine.step)
    engine.backward(engine(*micro_batch(0, 0, rank, world_size, MICRO, 1)))
    engine.step()
    out["step_twice"] = error_of(engine.step)
    engine.close()

    engine = sgd_engine(backward_config(1, fp16=True))
    engine(*micro_batch(0, 0, rank, world_size, MICRO, 1)).backward()
    out["fp16_plain_backward"] = error_of(engine.step)
    engine.close()

    engine = sgd_engine(backward_config(0))
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


def test_several_backwards_in_a_micro_step_add_up() -> None:
    for per_case in run_on_ranks(2, two_backwards_per_micro_step, SPLIT_CASES):
        check_backwards_add_up(SPLIT_CASES, per_case)


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
        engine = sgd_engine(backward_config(2))
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
