"""The ranks of a sequence group, as users feed them: a group given different micro-batches
(other tokens, other lengths, other batch sizes), an extra training forward on one rank, and a
per-rank loader shared over its group (`zero_engine.SequenceGroupLoader`); what the split
refuses by name (a model that is not a causal LM, a plain model's heads that ``k`` does not
divide); on 2 gloo ranks, Hugging Face models and a plain one."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from sequence_cases import WrappedGPT, next_tokens, positions, sequence_llama

TIMEOUT_S = 60  # comm.timeout_s: each case below must raise long before it


def _config(stage: int, **more: Any) -> dict[str, Any]:
    return {**engine_config(stage, micro=2, lr=1e-3), "sequence_parallel_size": 2, "comm": {"timeout_s": TIMEOUT_S},
            **more}


def _ids(rank: int, how: str) -> torch.Tensor:
    """Rank 1's micro-batch differs from rank 0's as ``how`` says (the same shape, other tokens;
    a longer sequence; one sample more)."""
    generator = torch.Generator().manual_seed(10 + (rank if how == "content" else 0))
    batch, length = 2, 8
    if rank == 1 and how == "length":
        length = 12
    if rank == 1 and how == "batch":
        batch = 3
    return torch.randint(0, 97, (batch, length), generator=generator)


def _raised(run: Any) -> str:
    """``run()``'s DivergedRanksError, with the seconds it took to come."""
    start = time.monotonic()
    try:
        run()
    except zero_engine.DivergedRanksError as error:
        return f"{time.monotonic() - start:.1f} s: {error}"
    return "no error"


def hugging_face_batches(rank: int, stage: int, how: str) -> str:
    engine = zero_engine.initialize(sequence_llama(), _config(stage))
    ids = _ids(rank, how)

    def train() -> None:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    try:
        return _raised(train)
    finally:
        engine.close()


def plain_batches(rank: int, stage: int, how: str) -> str:
    """A plain model's loop slicing its micro-batch with engine.sequence_slice."""
    engine = zero_engine.initialize(WrappedGPT(), _config(stage))
    ids = _ids(rank, how) % 50

    def train() -> None:
        logits = engine(engine.sequence_slice(ids), engine.sequence_slice(positions(ids)))
        targets = engine.sequence_slice(next_tokens(ids), pad_value=-100)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        engine.backward(engine.sequence_loss(loss))
        engine.step()

    try:
        return _raised(train)
    finally:
        engine.close()


def extra_forward(rank: int, stage: int, plain: bool) -> str:
    """Rank 0 runs a second training forward in the micro-step (a metric in train mode, its
    output dropped) before the one it trains on; rank 1 does not."""
    engine = zero_engine.initialize(WrappedGPT() if plain else sequence_llama(), _config(stage))
    ids = _ids(0, "content") % 50

    def forward() -> Any:
        if plain:
            logits = engine(engine.sequence_slice(ids), engine.sequence_slice(positions(ids)))
            return engine.sequence_loss(logits.float().pow(2).mean())
        return engine(input_ids=ids, labels=ids).loss

    def train() -> None:
        if rank == 0:
            forward()
        engine.backward(forward())
        engine.step()

    try:
        return _raised(train)
    finally:
        engine.close()


class ThreeHeads(torch.nn.Module):
    """A plain model whose attention core is called with 3 query heads."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 24)
        self.core = zero_engine.SequenceParallelAttention(torch.nn.functional.scaled_dot_product_attention)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        heads = x.view(*ids.shape, 3, 8).transpose(1, 2)
        return self.core(heads, heads, heads, is_causal=True)


def refusals(rank: int) -> dict[str, str]:
    from transformers import BertConfig, BertForMaskedLM, LlamaForSequenceClassification

    found = {}
    bert = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, attn_implementation="sdpa"))
    classifier = LlamaForSequenceClassification(sequence_llama().config)
    for name, model in (("bert", bert), ("classifier", classifier)):
        try:
            zero_engine.initialize(model, _config(0))
        except NotImplementedError as error:
            found[name] = str(error)
    engine = zero_engine.initialize(ThreeHeads(), _config(0))
    ids = _ids(0, "content") % 50
    try:
        engine(engine.sequence_slice(ids))
    except NotImplementedError as error:
        found["heads"] = str(error)
    found["sliced"] = str(engine.sequence_slice(ids).shape[1])
    found["progress_ranks"] = str(engine.progress.data_ranks)  # tokens/s counts data-parallel ranks (N22)
    # its all-to-alls on a communicator of their own, though the group is the world (GPU review R1)
    found["own_group"] = str(engine.comm.sequence_group.group is not engine.comm.shard_group.group)
    engine.close()
    return found


def group_checks(rank: int, world_size: int) -> dict[str, Any]:
    """Every case in one spawn, each ending with both ranks raised at the same round (so the
    next starts clean); the stage 3 extra forward last (its ranks leave rounds unread)."""
    torch.set_num_threads(1)
    found: dict[str, Any] = {"refusals": refusals(rank)}
    for stage in (0, 3):
        for how in ("content", "length", "batch"):
            found[f"hf {how} {stage}"] = hugging_face_batches(rank, stage, how)
    found["plain content 0"] = plain_batches(rank, 0, "content")
    found["plain length 3"] = plain_batches(rank, 3, "length")
    found["extra hf 0"] = extra_forward(rank, 0, plain=False)
    found["extra plain 0"] = extra_forward(rank, 0, plain=True)
    found["extra hf 3"] = extra_forward(rank, 3, plain=False)
    return found


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_on_ranks(2, group_checks, allow_numpy=True, timeout=400)


def _message(result: str) -> str:
    seconds, _, message = result.partition(" s: ")
    assert message, result
    assert float(seconds) < TIMEOUT_S / 2, result
    return message


@pytest.mark.parametrize("how, shapes", [("content", "both 2 x 8 tokens, other tokens"),
                                         ("length", "rank 0: 2 x 8 tokens, rank 1: 2 x 12 tokens"),
                                         ("batch", "rank 0: 2 x 8 tokens, rank 1: 3 x 8 tokens")])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_group_given_different_micro_batches_raises_on_every_rank(two_ranks: list[dict[str, Any]], stage: int,
                                                                     how: str, shapes: str) -> None:
    for result in two_ranks:
        message = _message(result[f"hf {how} {stage}"])
        assert f"ranks 0 and 1 of sequence group [0, 1] were given different micro-batches ({shapes})" in message
        assert "num_replicas=engine.data_parallel_world_size" in message
        assert "zero_engine.SequenceGroupLoader(loader, engine)" in message


def test_a_plain_loop_that_slices_different_micro_batches_raises_on_every_rank(
        two_ranks: list[dict[str, Any]]) -> None:
    for result in two_ranks:
        assert "given different micro-batches (both 2 x 4 tokens, other tokens)" in _message(result["plain content 0"])
        # different lengths: different slices, refused before the exchange (stage 3)
        assert "(rank 0: 2 x 4 tokens, rank 1: 2 x 6 tokens)" in _message(result["plain length 3"])


@pytest.mark.parametrize("case", ["extra hf 0", "extra plain 0", "extra hf 3"])
def test_an_extra_training_forward_on_one_rank_raises_on_every_rank(two_ranks: list[dict[str, Any]],
                                                                    case: str) -> None:
    for rank, result in enumerate(two_ranks):
        message = _message(result[case])
        assert "ranks are in different calls" in message, (rank, message)
        assert "rank 0 is in its training forward number 2 of the micro-step" in message, (rank, message)
        assert "rank 1 is in training" in message, (rank, message)


def test_what_the_split_does_not_know_is_refused_by_name(two_ranks: list[dict[str, Any]]) -> None:
    for result in two_ranks:
        found = result["refusals"]
        assert "BertForMaskedLM is not a Hugging Face causal language model" in found["bert"]
        assert "LlamaForSequenceClassification is not a Hugging Face causal language model" in found["classifier"]
        assert ("core was called with 3 query heads (dim 1 of query, (batch, heads, tokens, "
                "head_dim)), which do not split over 2 ranks") in found["heads"]
        assert found["sliced"] == "4"
        assert found["own_group"] == "True"
        assert found["progress_ranks"] == "1"  # one data-parallel rank: the group reads one batch


# -- a per-rank loader shared over the group ---------------------------------------------------

SAMPLES, LENGTH = 8, 12


def _dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(0, 97, (LENGTH,), generator=generator)} for _ in range(SAMPLES)]


def _collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids = torch.stack([sample["input_ids"] for sample in samples])
    return {"input_ids": ids, "labels": ids.clone()}


def shared_loader(rank: int, world_size: int) -> dict[str, Any]:
    """The migration guide's first try, a sampler over the world, made right by the adapter:
    each rank's samples trained by its whole group, in group rank order."""
    from torch.utils.data import DataLoader, DistributedSampler

    torch.set_num_threads(1)
    config = {**engine_config(0, micro=2, accum=2, lr=1e-3, optimizer_params={"weight_decay": 0.0}),
              "sequence_parallel_size": world_size}
    engine = zero_engine.initialize(sequence_llama(), config)
    sampler = DistributedSampler(_dataset(), num_replicas=world_size, rank=rank, shuffle=False)
    loader = zero_engine.SequenceGroupLoader(DataLoader(_dataset(), batch_size=2, sampler=sampler,
                                                        collate_fn=_collate), engine)
    losses, seen = [], []
    for batch in loader:
        seen.append(batch["input_ids"][:, 0].tolist())
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    result = {"losses": losses, "seen": seen, "length": len(loader), "state": engine.full_state_dict()}
    engine.close()
    return result


def test_a_per_rank_loader_shared_over_the_group_trains_as_one_process_on_its_samples() -> None:
    per_rank = run_on_ranks(2, shared_loader, allow_numpy=True, timeout=300)
    data = _dataset()
    # rank r's sampler reads samples r, r + 2, ...; the group trains rank 0's batch, then rank 1's
    order = []
    for step in range(SAMPLES // 4):
        for source in range(2):
            order.append([data[i] for i in range(source + 4 * step, SAMPLES, 2)][:2])
    model = sequence_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    for index, samples in enumerate(order):
        loss = model(**_collate(samples), use_cache=False).loss
        (loss / 2).backward()
        losses.append(loss.item())
        if index % 2:
            optimizer.step()
            optimizer.zero_grad()
    for result in per_rank:
        assert result["length"] == len(order)
        assert result["seen"] == [_collate(samples)["input_ids"][:, 0].tolist() for samples in order]
        assert result["losses"] == pytest.approx(losses, abs=2e-5)
        for name, value in model.state_dict().items():
            assert (result["state"][name] - value).abs().max().item() <= 2e-5, name


# -- a mixture of experts under the split (the GPU review's R1) --------------------------------


def _moe_config(stage: int, wrap: list[str] | None = None) -> dict[str, Any]:
    zero: dict[str, Any] = {"reduce_bucket_size": 200}
    if wrap:
        zero.update(stage3_wrap_modules=wrap, stage3_param_persistence_threshold=0)
    config = engine_config(stage, micro=2, accum=2, lr=0.05, optimizer="SGD", **zero)
    return {**config, "sequence_parallel_size": 2, "comm": {"timeout_s": TIMEOUT_S}}


def experts_split(rank: int, world_size: int) -> dict[str, Any]:
    """`tests/moe.py`'s model with attention, its experts idle on one rank of the group in some
    micro-steps (each slice routes its own tokens): at stage 3 with the block one unit, at
    stage 2 with reductions after the backward; and the experts as units refused at stage 3."""
    from moe import SequenceMoEModel, moe_batch, sequence_moe_loss

    torch.set_num_threads(1)
    found: dict[str, Any] = {}
    for stage, wrap in ((3, ["SequenceAttention", "MoEBlock"]), (2, None)):
        engine = zero_engine.initialize(SequenceMoEModel("skip"), _moe_config(stage, wrap))
        losses = []
        for step in range(3):
            for micro in range(2):
                loss = sequence_moe_loss(engine, *moe_batch(step, micro, 0, 2))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        found[stage] = {"losses": losses, "state": engine.full_state_dict(),
                        "overlap": engine.reducer.overlap}
        engine.close()
    try:
        zero_engine.initialize(SequenceMoEModel("skip"), _moe_config(3, ["Expert", "MoEBlock"]))
    except NotImplementedError as error:
        found["refused"] = str(error)
    return found


def test_a_mixture_of_experts_under_the_split_trains_as_one_process() -> None:
    from moe import SequenceMoEModel, moe_batch

    per_rank = run_on_ranks(2, experts_split, allow_numpy=True, timeout=300)
    model = SequenceMoEModel("skip")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(3):
        for micro in range(2):
            tokens, targets = moe_batch(step, micro, 0, 2)
            loss = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), targets) / targets.numel()
            (loss / 2).backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    for found in per_rank:
        for stage in (3, 2):
            assert found[stage]["losses"] == pytest.approx(losses, abs=2e-5), stage
            for name, value in model.state_dict().items():
                assert (found[stage]["state"][name] - value).abs().max().item() <= 2e-5, (stage, name)
        assert found[2]["overlap"] is False  # an expert may get no gradient on a rank of the group
        assert ("the unit blocks.0.experts.0 (Expert) lies inside the mixture of experts' block blocks.0"
                in found["refused"])


def one_rank_gathers(rank: int, world_size: int) -> str:
    """After an evaluation forward, rank 0 gathers its logits whole and rank 1 goes on training."""
    engine = zero_engine.initialize(sequence_llama(), _config(0))
    ids = _ids(0, "content")
    with torch.no_grad():
        out = engine(input_ids=ids, labels=ids)

    def next_calls() -> None:
        if rank == 0:
            engine.sequence_gather(out.logits)
        engine.backward(engine(input_ids=ids, labels=ids).loss)

    try:
        return _raised(next_calls)
    finally:
        engine.close()


def test_a_gather_of_a_split_output_on_one_rank_raises_on_every_rank() -> None:
    for result in run_on_ranks(2, one_rank_gathers, allow_numpy=True, timeout=200):
        message = _message(result)
        assert "rank 0 is in sequence_gather()" in message, message
