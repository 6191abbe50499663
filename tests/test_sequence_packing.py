"""Packed documents under ``sequence_parallel_size``: a micro-batch whose rows each hold several
documents (``position_ids`` restarting, the first label of each document -100, as Hugging Face's
``DataCollatorWithFlattening`` makes them) trains as the documents run separately, each alone
through the model: the loss (over the micro-batch's valid tokens), the gradient norm and every
parameter after the steps, at k = 1 (the engine's training forward with ``use_cache=False``, so
Hugging Face's own packed mask), 2, 3 and 4, ``sdpa`` and ``eager``, with rows padded at their
end too (an ``attention_mask`` with zeros: the split keeps documents apart there as well)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from sequence_cases import assert_trains_as, sequence_llama

STEPS, ACCUM, LENGTH = 3, 2, 17


def _documents(step: int, data_rank: int, micro: int) -> list[list[torch.Tensor]]:
    """Two rows of documents (token ids) of a micro-batch, the second row shorter (padded when
    packed) where the case pads."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * data_rank + micro)
    rows = []
    for lengths in ((5, 8, 4), (7, 6)):  # 17 and 13 tokens: the second row padded to 17
        rows.append([torch.randint(0, 97, (n,), generator=generator) for n in lengths])
    return rows


def _packed(rows: list[list[torch.Tensor]], padded: bool) -> dict[str, torch.Tensor]:
    """The rows packed: ids, restarting positions, labels -100 at each document's first token;
    a row shorter than the others padded at its end (``attention_mask`` zeros, labels -100,
    positions 0) when ``padded``, else filled with one more document."""
    ids, positions, labels, masks = [], [], [], []
    for docs in rows:
        length = sum(len(doc) for doc in docs)
        if length < LENGTH and not padded:
            docs = [*docs, torch.arange(LENGTH - length) % 97]
        row_ids = torch.cat(docs)
        row_labels = torch.cat([torch.cat([torch.tensor([-100]), doc[1:]]) for doc in docs])
        row_positions = torch.cat([torch.arange(len(doc)) for doc in docs])
        tail = LENGTH - len(row_ids)
        masks.append(torch.cat([torch.ones(len(row_ids), dtype=torch.long), torch.zeros(tail, dtype=torch.long)]))
        ids.append(torch.cat([row_ids, torch.zeros(tail, dtype=torch.long)]))
        labels.append(torch.cat([row_labels, torch.full((tail,), -100)]))
        positions.append(torch.cat([row_positions, torch.zeros(tail, dtype=torch.long)]))
    batch = {"input_ids": torch.stack(ids), "position_ids": torch.stack(positions), "labels": torch.stack(labels)}
    if padded:
        batch["attention_mask"] = torch.stack(masks)
    return batch


def _separate_loss(model: Any, rows: list[list[torch.Tensor]], padded: bool) -> torch.Tensor:
    """The micro-batch's loss with every document run alone: the sum of its token losses over
    the micro-batch's valid labels."""
    packed = _packed(rows, padded)
    docs = []
    for row, docs_of_row in enumerate(rows):
        length = sum(len(doc) for doc in docs_of_row)
        if length < LENGTH and not padded:
            docs_of_row = [*docs_of_row, packed["input_ids"][row, length:]]
        docs.extend(docs_of_row)
    total = sum(
        torch.nn.functional.cross_entropy(model(input_ids=doc[None]).logits[0, :-1], doc[1:], reduction="sum")
        for doc in docs if len(doc) > 1
    )
    return total / (packed["labels"] != -100).sum()


def _model(case: dict[str, Any]) -> Any:
    return sequence_llama(case["attention"], heads=12, window=case.get("window"))


def reference(case: dict[str, Any]) -> dict[str, Any]:
    model = _model(case)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    data_ranks = case["world"] // case["k"]
    losses, norms = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        step_losses = []
        for data_rank in range(data_ranks):
            for micro in range(ACCUM):
                loss = _separate_loss(model, _documents(step, data_rank, micro), case.get("padded", False))
                (loss / (ACCUM * data_ranks)).backward()
                step_losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        losses.append(step_losses)
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


def packed_training(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    results = []
    for case in cases:
        config = engine_config(case["stage"], micro=2, accum=ACCUM, lr=1e-3, clip=1.0,
                               optimizer_params={"weight_decay": 0.0})
        config["sequence_parallel_size"] = case["k"]
        engine = zero_engine.initialize(_model(case), config)
        losses, norms = [], []
        for step in range(STEPS):
            step_losses = []
            for micro in range(ACCUM):
                rows = _documents(step, engine.data_parallel_rank, micro)
                loss = engine(**_packed(rows, case.get("padded", False))).loss
                engine.backward(loss)
                engine.step()
                step_losses.append(loss.item())
            losses.append(step_losses)
            norms.append(engine.get_global_grad_norm())
        results.append({"losses": losses, "norms": norms, "state": engine.full_state_dict()})
        engine.close()
    return results


def _check(case: dict[str, Any], per_rank: list[dict[str, Any]]) -> None:
    assert_trains_as(reference(case), per_rank, case, STEPS, ACCUM)


# k = 1: Hugging Face's own packed mask (the engine's training forward passes use_cache=False).
# 17 tokens: k = 2, 3 and 4 pad the sequence; 12 query heads and 2 key/value heads (repeated at 3, 4).
GRIDS = {
    1: [{"world": 1, "k": 1, "stage": 0, "attention": "sdpa"}],
    2: [{"world": 2, "k": 2, "stage": 0, "attention": "sdpa", "padded": True},
        {"world": 2, "k": 2, "stage": 3, "attention": "eager"}],
    3: [{"world": 3, "k": 3, "stage": 3, "attention": "sdpa"},
        {"world": 3, "k": 3, "stage": 0, "attention": "eager", "padded": True, "window": 4}],
}
SLOW_GRIDS = {
    1: [{"world": 1, "k": 1, "stage": 3, "attention": "eager", "window": 3}],
    4: [{"world": 4, "k": 4, "stage": 3, "attention": "eager", "padded": True},
        # 2 data-parallel x 2 sequence ranks, accumulation and clipping (the 1e-2 case)
        {"world": 4, "k": 2, "stage": 2, "attention": "sdpa"}],
}


@pytest.mark.parametrize("world", sorted(GRIDS))
def test_packed_documents_train_as_the_documents_run_separately(world: int) -> None:
    per_rank = run_on_ranks(world, packed_training, GRIDS[world], allow_numpy=True, timeout=400)
    for index, case in enumerate(GRIDS[world]):
        _check(case, [result[index] for result in per_rank])


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(SLOW_GRIDS))
def test_packed_documents_train_as_the_documents_run_separately_slow(world: int) -> None:
    per_rank = run_on_ranks(world, packed_training, SLOW_GRIDS[world], allow_numpy=True, timeout=600)
    for index, case in enumerate(SLOW_GRIDS[world]):
        _check(case, [result[index] for result in per_rank])


def largest_allocation(rank: int, world_size: int, attention: str) -> int:
    """The largest single allocation of a split training step on one packed row of 2048 tokens
    (16 documents of 128), no padding."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    config = {**engine_config(0, micro=1, lr=1e-3), "sequence_parallel_size": world_size}
    engine = zero_engine.initialize(sequence_llama(attention, heads=12), config)
    ids = torch.randint(0, 97, (1, 2048), generator=torch.Generator().manual_seed(2))
    positions = (torch.arange(2048) % 128)[None]
    engine.backward(engine(input_ids=ids, position_ids=positions, labels=ids).loss)
    engine.step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.backward(engine(input_ids=ids, position_ids=positions, labels=ids).loss)
    engine.close()
    return max(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_row_makes_no_mask_of_its_whole_length(attention: str) -> None:
    """Packed without padding, each document attends alone: no allocation of tokens x tokens
    (the whole row's packed mask, 2048 x 2048, 4 MiB in bool, 16 MiB in eager's fp32) in the
    step; the largest is a document's own or a weight's gradient."""
    largest = max(run_on_ranks(2, largest_allocation, attention, allow_numpy=True, timeout=300))
    assert largest < 2048 * 2048, largest
