"""``sequence_parallel_size`` on a plain PyTorch model: its attention core wrapped in
`zero_engine.SequenceParallelAttention`, its loop splitting the batch with ``engine.sequence_slice``
and making the loss the micro-batch's with ``engine.sequence_loss``; against the same model
trained in one process on the same global batches, in real processes on gloo."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from sequence_cases import GPT_VOCAB as VOCAB
from sequence_cases import WrappedGPT, next_tokens, positions

STEPS, MICRO, ACCUM = 3, 2, 2
TOL = 2e-5


def _batches(length: int, data_ranks: int) -> list[torch.Tensor]:
    """Per step: token ids of every data-parallel rank's micro-batches, (ranks, ACCUM, MICRO, length)."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (data_ranks, ACCUM, MICRO, length), generator=generator) for _ in range(STEPS)]


def reference(case: dict[str, Any]) -> dict[str, Any]:
    model = WrappedGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    data_ranks = case["world"] // case["k"]
    losses = []
    for step in _batches(case["length"], data_ranks):
        optimizer.zero_grad()
        step_losses = []
        for rank_ids in step:
            for ids in rank_ids:
                logits = model(ids, positions(ids))
                if case.get("pairs"):  # a preference loss of whole sequences: row 0 preferred to row 1
                    targets = next_tokens(ids)
                    token = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
                    loss = _preference(((targets != -100) * token).sum(1))
                else:
                    loss = F.cross_entropy(logits.flatten(0, 1), next_tokens(ids).flatten(), ignore_index=-100)
                (loss / (ACCUM * data_ranks)).backward()
                step_losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(step_losses)
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _preference(log_probs: torch.Tensor) -> torch.Tensor:
    """DPO's sigmoid loss without a reference: row 0 preferred to row 1 (each a sequence's summed
    log-probability), a nonlinearity of whole sequences that a slice's sum cannot give."""
    return -F.logsigmoid(0.5 * (log_probs[0] - log_probs[1]))


def train(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    results = []
    for case in cases:
        config = engine_config(case["stage"], micro=MICRO, accum=ACCUM, lr=1e-3, clip=1.0,
                               optimizer_params={"weight_decay": 0.0})
        config["sequence_parallel_size"] = case["k"]
        engine = zero_engine.initialize(WrappedGPT(), config)
        losses = []
        for step in _batches(case["length"], engine.data_parallel_world_size):
            step_losses = []
            for ids in step[engine.data_parallel_rank]:
                targets = next_tokens(ids)
                mine = engine.sequence_slice(targets, pad_value=-100)
                logits = engine(engine.sequence_slice(ids), engine.sequence_slice(positions(ids)))
                if case.get("pairs"):  # each sequence's log-probability, whole on every rank of the group
                    loss = _preference(engine.sequence_log_probs(logits, mine))
                else:
                    summed = F.cross_entropy(logits.flatten(0, 1), mine.flatten(), ignore_index=-100, reduction="sum")
                    loss = engine.sequence_loss(summed / (targets != -100).sum())
                engine.backward(loss)
                engine.step()
                step_losses.append(loss.item())
            losses.append(step_losses)
        ids = _batches(case["length"], 1)[0][0, 0]
        engine.eval()
        with torch.no_grad():  # evaluation: the whole sequence, the core as it is
            evaluated = engine(ids, positions(ids))
        results.append({"losses": losses, "state": engine.full_state_dict(), "eval": evaluated,
                        "slice": tuple(engine.sequence_slice(ids).shape)})
        engine.close()
    if world == 2:  # refused on every rank, at initialize
        results.append(refusals())
    return results


def refusals() -> dict[str, str]:
    """Sequence mixers that are not attention, in a plain model and by a Hugging Face-style name."""
    found = {}

    class MambaMixer(nn.Module):  # the name of transformers' state-space layer
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

    for name, model in (("conv", nn.Sequential(nn.Conv1d(4, 4, 3))), ("mamba", nn.ModuleDict({"mixer": MambaMixer()}))):
        try:
            zero_engine.initialize(model, {**engine_config(0, micro=1, lr=1e-3), "sequence_parallel_size": 2})
        except NotImplementedError as err:
            found[name] = str(err)
    return found


GRIDS = {  # a length k does not divide; key/value heads fewer than k (k = 3: repeated; the slow run)
    2: [{"world": 2, "k": 2, "stage": 0, "length": 15}, {"world": 2, "k": 2, "stage": 3, "length": 16},
        # each sequence's log-probability through a nonlinearity (engine.sequence_log_probs)
        {"world": 2, "k": 2, "stage": 3, "length": 15, "pairs": True}],
    3: [{"world": 3, "k": 3, "stage": 3, "length": 17}],
}


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_plain_models_wrapped_attention_matches_one_process(world: int) -> None:
    per_rank = run_on_ranks(world, train, GRIDS[world], allow_numpy=True, timeout=300)
    for index, case in enumerate(GRIDS[world]):
        expected = reference(case)
        k = case["k"]
        for rank, results in enumerate(per_rank):
            result, data_rank = results[index], rank // k
            for step in range(STEPS):
                mine = expected["losses"][step][data_rank * ACCUM : (data_rank + 1) * ACCUM]
                assert result["losses"][step] == pytest.approx(mine, abs=TOL), (case, rank, step)
            for name, value in expected["state"].items():
                assert (result["state"][name] - value).abs().max().item() <= TOL, (case, rank, name)
            assert result["slice"] == (MICRO, -(-case["length"] // k))  # padded to a multiple of k, then split
            model = WrappedGPT()
            model.load_state_dict(result["state"])
            ids = _batches(case["length"], 1)[0][0, 0]
            with torch.no_grad():
                assert torch.allclose(result["eval"], model(ids, positions(ids)), atol=1e-5)
    for found in (results[-1] for results in per_rank if world == 2):
        assert "blocks" not in found["conv"] and "0 (Conv1d) mixes tokens along the sequence" in found["conv"]
        assert "mixer (MambaMixer) mixes tokens along the sequence other than by attention" in found["mamba"]


def one_rank_skips_the_loss(rank: int, world: int, stages: list[int]) -> list[str]:
    """Rank 1 backwards its slice's loss without ``engine.sequence_loss`` while rank 0 calls it:
    every rank raises `DivergedRanksError` at once, instead of rank 0 waiting in the loss's sum
    until the timeout."""
    import time

    torch.set_num_threads(1)
    outcomes = []
    for stage in stages:
        config = engine_config(stage, micro=MICRO, lr=1e-3)
        config.update(sequence_parallel_size=2, comm={"timeout_s": 60})
        engine = zero_engine.initialize(WrappedGPT(), config)
        ids = _batches(15, 1)[0][0, 0]
        targets = next_tokens(ids)
        start = time.monotonic()
        try:
            for _ in range(2):  # a first micro-step in step, then the skip
                logits = engine(engine.sequence_slice(ids), engine.sequence_slice(positions(ids)))
                mine = engine.sequence_slice(targets, pad_value=-100)
                loss = F.cross_entropy(logits.flatten(0, 1), mine.flatten(), ignore_index=-100, reduction="sum")
                loss = loss / (targets != -100).sum()
                if rank == 0 or engine.global_step == 0:
                    loss = engine.sequence_loss(loss)
                engine.backward(loss)
                engine.step()
            outcomes.append("no error")
        except zero_engine.DivergedRanksError as err:
            outcomes.append(f"{time.monotonic() - start:.1f} s: {err}")
        finally:
            engine.close()
    return outcomes


def test_a_loss_summed_on_some_ranks_only_raises_on_every_rank() -> None:
    stages = [0, 3]
    for rank, outcomes in enumerate(run_on_ranks(2, one_rank_skips_the_loss, stages, timeout=300)):
        for stage, outcome in zip(stages, outcomes):
            seconds, message = outcome.split(" s: ", 1)
            assert float(seconds) < 20, (rank, stage, outcome)
            assert "sequence_loss()" in message, (rank, stage, message)
