"""``tiled_loss_tokens``: a Hugging Face Llama's training loss a tile of tokens at a time gives the
loss, gradients and parameters of the untiled model, at stages 0 and 3 and with sequence
parallelism, and no allocation the size of the whole sequence's logits is ever made."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from tiled_cases import LENGTH, MICRO, VOCAB, batch, llama

STEPS = 3


def _refused(logits: Any) -> bool:
    """Whether the logits a forward returned are a stand-in whose use raises, saying why (a
    tiled training forward computes none)."""
    try:
        logits[:, -1].argmax(-1)
    except RuntimeError as error:
        assert "logits are not computed in training forwards with tiled_loss_tokens" in str(error)
        assert "Set tiled_loss_tokens: 0 to get them" in str(error)
        return True
    return False


def train(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    results = []
    for case in cases:
        config = engine_config(case["stage"], micro=MICRO, lr=1e-3, clip=1.0)
        config["tiled_loss_tokens"] = case["tiles"]
        config["sequence_parallel_size"] = case.get("k", 1)
        if case.get("head_unit"):  # the output head a unit of its own: each tile's call gathers it
            config["zero_optimization"]["stage3_wrap_modules"] = ["LlamaDecoderLayer", "Linear"]
        engine = zero_engine.initialize(llama(), config)
        group = rank // case.get("k", 1)  # the ranks of a sequence group read the same micro-batches
        length = case.get("lengths", (LENGTH, LENGTH))[rank]
        losses, logits = [], []
        for step in range(STEPS):
            out = engine(**batch(step, group, length))
            losses.append(out.loss.item())
            logits.append(_refused(out.logits))
            engine.backward(out.loss)
            engine.step()
        engine.eval()
        with torch.no_grad():  # split too at k = 2: the logits gathered whole
            evaluated = engine(**batch(99, group))
            evaluated.logits = engine.sequence_gather(evaluated.logits)
        engine.train()
        results.append({
            "losses": losses, "norm": engine.get_global_grad_norm(), "state": engine.full_state_dict(),
            "no_logits": all(logits), "eval_logits": tuple(evaluated.logits.shape),
        })
        engine.close()
    return results


CASES = [
    {"stage": 0, "tiles": 0}, {"stage": 0, "tiles": 24},
    {"stage": 3, "tiles": 0}, {"stage": 3, "tiles": 24},
    {"stage": 3, "tiles": 0, "k": 2}, {"stage": 3, "tiles": 16, "k": 2},
    # ranks with batches of other lengths: 6 tiles on one, 4 on the other, the output head a
    # stage 3 unit of its own (gathered once a pass, whatever the number of its calls)
    {"stage": 3, "tiles": 0, "lengths": (64, 40), "head_unit": True},
    {"stage": 3, "tiles": 24, "lengths": (64, 40), "head_unit": True},
]


def test_tiles_give_the_untiled_loss_gradients_and_parameters() -> None:
    per_rank = run_on_ranks(2, train, CASES, allow_numpy=True)
    for rank, results in enumerate(per_rank):
        for plain, tiled in zip(results[::2], results[1::2]):
            # a tiled training forward returns no logits, but a stand-in that says why when used
            assert tiled["no_logits"] and not plain["no_logits"], rank
            assert tiled["eval_logits"] == (MICRO, LENGTH, VOCAB)  # evaluation runs the model as it is
            assert tiled["losses"] == pytest.approx(plain["losses"], abs=2e-6), rank
            assert tiled["norm"] == pytest.approx(plain["norm"], abs=2e-6), rank
            for name, value in plain["state"].items():
                assert (tiled["state"][name] - value).abs().max().item() <= 2e-6, name


def largest_allocations(rank: int, world: int, tiles: tuple[int, ...]) -> list[int]:
    """The largest single allocation of a training step's forward and backward, per tiling."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    largest = []
    for tokens in tiles:
        config = engine_config(0, micro=MICRO, lr=1e-3)
        config["tiled_loss_tokens"] = tokens
        engine = zero_engine.initialize(llama(), config)
        engine.backward(engine(**batch(0, rank)).loss)
        engine.step()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            engine.backward(engine(**batch(1, rank)).loss)
        engine.close()
        largest.append(max(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"))
    return largest


def test_no_allocation_holds_the_whole_sequences_logits() -> None:
    plain, tiled = run_on_ranks(1, largest_allocations, (0, 16), allow_numpy=True)[0]
    whole_logits = MICRO * LENGTH * VOCAB * 4
    assert plain >= whole_logits  # the check can see them: untiled, they are made
    # tiled, the largest is a parameter's gradient (the embedding's, a quarter of the logits here)
    assert tiled <= whole_logits / 4, (tiled, whole_logits)
