"""What the sequence-parallel tests share: the tiny Llama they split (8 query heads over 2
key/value heads, so that k = 4 repeats key/value heads), its batches (packed, padded, prompts
without targets) and its run in one process, a plain GPT whose attention is wrapped
in `zero_engine.SequenceParallelAttention`, its targets and positions, and the check that a
split run trained as one process did."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero_engine
from tiny import llama

STEPS, MICRO, ACCUM, TOL = 4, 2, 2, 2e-5  # optimizer steps of the fast run's cases; the slow run's take the 10
GPT_VOCAB, HEADS, KV_HEADS, HEAD_DIM = 50, 6, 2, 4


def sequence_llama(attention: str = "sdpa", heads: int = 8, kv_heads: int = 2, window: int | None = None,
                   qwen3: bool = False, **extra: Any) -> Any:
    """`tiny.llama` four wide per head, 97 words, 128 positions (its twins by ``window`` and ``qwen3``)."""
    return llama(vocab=97, hidden=4 * heads, heads=heads, kv_heads=kv_heads, positions=128, attention=attention,
                 window=window, qwen3=qwen3, **extra)


def case_model(case: dict[str, Any]) -> Any:
    """The case's Llama: its attention, heads and twin."""
    return sequence_llama(case["attention"], case.get("heads", 8), window=case.get("window"), qwen3=case.get("qwen3", False))


def batches(length: int, data_ranks: int, steps_count: int = STEPS) -> list[list[torch.Tensor]]:
    """Per step, per data-parallel rank: micro-batches of token ids (labels = the ids, some -100)."""
    generator = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(steps_count):
        per_rank = []
        for _ in range(data_ranks):
            ids = torch.randint(0, 97, (ACCUM, MICRO, length), generator=generator)
            per_rank.append(ids)
        steps.append(per_rank)
    return steps


def prompt_labels(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[:, : ids.shape[1] // 3] = -100  # a prompt without targets: slices differ in valid tokens
    return labels


def case_inputs(case: dict[str, Any], ids: torch.Tensor, micro: int = 0) -> dict[str, torch.Tensor]:
    """A micro-batch's arguments: packed (two documents, ``position_ids`` restarting at 0), or
    padded (the first sample's last 3 tokens; ``"left"``: its first 5, labelled as collators
    label them, -100 on the pads alone, so the last pad's output is read: it predicts the first
    real token; ``"alternate"``: on every other micro-batch, so masks change between forwards),
    as the case says."""
    inputs = {"input_ids": ids, "labels": prompt_labels(ids)}
    length = ids.shape[1]
    if case.get("packed"):
        first = length // 2 + 1
        inputs["position_ids"] = torch.cat([torch.arange(first), torch.arange(length - first)])[None].expand_as(ids)
    padded = case.get("padded")
    if padded and not (padded == "alternate" and micro % 2):
        mask = torch.ones_like(ids)
        if padded == "left":
            mask[0, :5] = 0
            inputs["labels"] = ids.masked_fill(mask == 0, -100)
        else:
            mask[0, -3:] = 0
            inputs["labels"] = inputs["labels"].masked_fill(mask == 0, -100)
        inputs["attention_mask"] = mask
    return inputs


def reference(case: dict[str, Any]) -> dict[str, Any]:
    """One process, the whole global batch: the mean over data-parallel ranks of each rank's
    micro-batch loss (each over its valid tokens), as data parallelism averages them."""
    model = case_model(case)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    data_ranks = case["world"] // case["k"]
    losses, norms = [], []
    for step in batches(case["length"], data_ranks, case.get("steps", STEPS)):
        optimizer.zero_grad()
        step_losses = []
        for ids in step:
            for micro in range(ACCUM):
                loss = model(**case_inputs(case, ids[micro], micro), use_cache=False).loss
                (loss / (ACCUM * data_ranks)).backward()
                step_losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        losses.append(step_losses)
    return {"losses": losses, "norms": norms, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


class Attention(nn.Module):
    """Causal self-attention with fewer key/value heads than query heads; its core, SDPA, wrapped."""

    def __init__(self) -> None:
        super().__init__()
        dim = HEADS * HEAD_DIM
        self.query = nn.Linear(dim, dim)
        # no bias: a key bias has no gradient but rounding, which Adam would make a step of
        self.key_value = nn.Linear(dim, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.out = nn.Linear(dim, dim)
        self.core = zero_engine.SequenceParallelAttention(F.scaled_dot_product_attention)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        query = self.query(x).view(batch, tokens, HEADS, HEAD_DIM).transpose(1, 2)
        key, value = self.key_value(x).view(batch, tokens, 2 * KV_HEADS, HEAD_DIM).transpose(1, 2).chunk(2, dim=1)
        attended = self.core(query, key, value, is_causal=True, enable_gqa=True)
        return self.out(attended.transpose(1, 2).reshape(batch, tokens, dim))


class WrappedGPT(nn.Module):
    """A plain GPT whose attention calls `zero_engine.SequenceParallelAttention` (6 query, 2
    key/value heads); its forward returns the logits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        dim = HEADS * HEAD_DIM
        self.embed, self.position = nn.Embedding(GPT_VOCAB, dim), nn.Embedding(64, dim)
        self.blocks = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(dim), "attention": Attention(),
                                                   "mlp": nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                                        nn.Linear(2 * dim, dim))})
                                    for _ in range(2))
        self.head = nn.Linear(dim, GPT_VOCAB)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.position(positions)
        for block in self.blocks:
            x = x + block["attention"](block["norm"](x))
            x = x + block["mlp"](x)
        return self.head(x)


def next_tokens(ids: torch.Tensor) -> torch.Tensor:
    """Each token's next, shifted before any split; none on a prompt's first third, none at the end."""
    targets = F.pad(ids[:, 1:], (0, 1), value=-100)
    targets[:, : ids.shape[1] // 3] = -100
    return targets


def positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1]).expand_as(ids)


def assert_trains_as(expected: dict[str, Any], per_rank: list[dict[str, Any]], case: dict[str, Any],
                     steps: int, accum: int = ACCUM) -> None:
    """Each rank's losses (its data-parallel rank's micro-batches), gradient norms and every
    parameter against the one-process run ``expected``, within `TOL`."""
    for rank, result in enumerate(per_rank):
        data_rank = rank // case["k"]
        for step in range(steps):
            mine = expected["losses"][step][data_rank * accum : (data_rank + 1) * accum]
            assert result["losses"][step] == pytest.approx(mine, abs=TOL), (case, rank, step)
        assert result["norms"] == pytest.approx(expected["norms"], abs=TOL), (case, rank)
        for name, value in expected["state"].items():
            diff = (result["state"][name] - value).abs().max().item()
            assert diff <= TOL, f"{case}, rank {rank}: {name} differs by {diff}"
