"""Muon (``optimizer.type: Muon``): every stage and world size against torch's own Muon + AdamW
in one process, checkpoints across world sizes, and the whole-matrix work counted.

The reference is ``torch.optim.Muon`` on the parameters DeepSpeed's rule gives Muon plus
``torch.optim.AdamW`` on the rest, with its Newton-Schulz run in fp32 (the engine's default in
fp32 training; torch's bf16 iteration flips roundings with the order of a reduction). The model
is a tiny GPT whose shapes put partition boundaries inside matrices at every world size.
"""

from __future__ import annotations

import itertools
import math
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch
from torch import nn

import zero_engine
from harness import run_on_ranks
from zero_engine.muon import newton_schulz, takes_muon

HIDDEN, VOCAB, SEQ, LAYERS, MICRO = 48, 97, 8, 2, 2
LR, ADAM_LR, TOL = 0.02, 3e-3, 2e-5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.attn = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)  # a key bias has no gradient but noise, which AdamW would amplify
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn(self.norm(x)).chunk(3, dim=-1)
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(nn.functional.gelu(self.up(x)))


class TinyGPT(nn.Module):
    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        return nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.reshape(-1))


def make_gpt(layers: int = LAYERS) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(layers)


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (size, SEQ + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def muon_config(case: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": case.get("accum", 1),
        "gradient_clipping": case.get("clip", 0.0),
        "optimizer": {"type": "Muon", "params": {"lr": LR, "adam_lr": ADAM_LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": case["stage"]},
    }
    if case.get("offload"):
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if case.get("dtype") == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def train_engine(engine: Any, rank: int, world: int, steps: range, accum: int) -> list[float]:
    losses = []
    for step in steps:
        ids, labels = batch(step, MICRO * accum * world)
        for micro in range(accum):
            rows = slice((micro * world + rank) * MICRO, (micro * world + rank + 1) * MICRO)
            loss = engine(ids[rows], labels[rows])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


@contextmanager
def fp32_newton_schulz() -> Iterator[None]:
    """torch.optim.Muon with its iteration in fp32 (the one difference from torch's)."""
    from torch.optim import _muon

    original = _muon._zeropower_via_newtonschulz

    def in_fp32(grad: torch.Tensor, ns_coefficients: Any, ns_steps: int, eps: float) -> torch.Tensor:
        return newton_schulz(grad, steps=ns_steps, coefficients=ns_coefficients, eps=eps, dtype=torch.float32)

    _muon._zeropower_via_newtonschulz = in_fp32
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = original


def train_reference(steps: int, global_size: int, clip: float = 0.0) -> dict[str, torch.Tensor]:
    """One process: torch's Muon on DeepSpeed's matrices, torch's AdamW on the rest."""
    model = make_gpt()
    named = list(model.named_parameters())
    matrices = [p for n, p in named if takes_muon(n, p)]
    rest = [p for n, p in named if not takes_muon(n, p)]
    muon = torch.optim.Muon(matrices, lr=LR, weight_decay=0.01)
    adamw = torch.optim.AdamW(rest, lr=ADAM_LR, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.01)
    with fp32_newton_schulz():
        for step in range(steps):
            ids, labels = batch(step, global_size)
            model(ids, labels).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def parity_grid(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for case in cases:
        engine = zero_engine.initialize(make_gpt(), muon_config(case))
        train_engine(engine, rank, world, range(case["steps"]), case.get("accum", 1))
        orthogonalised = engine.optimizer.orthogonalisations
        results.append({"state": engine.full_state_dict(), "orthogonalised": orthogonalised})
        engine.close()
    return results


def check_parity(case: dict[str, Any], world: int, per_rank: list[dict[str, Any]]) -> None:
    reference = train_reference(case["steps"], MICRO * case.get("accum", 1) * world, case.get("clip", 0.0))
    matrices = sum(takes_muon(n, p) for n, p in make_gpt().named_parameters())
    # Newton-Schulz once per matrix per optimizer step, summed over the ranks
    assert sum(r["orthogonalised"] for r in per_rank) == matrices * case["steps"], case
    for rank, result in enumerate(per_rank):
        for name, expected in reference.items():
            diff = (result["state"][name].float() - expected).abs().max().item()
            assert diff <= case.get("tol", TOL), f"{case} world {world} rank {rank}: {name} differs by {diff}"


FAST = [
    {"stage": 0, "steps": 3},
    {"stage": 1, "steps": 3, "accum": 2},
    {"stage": 2, "steps": 3, "clip": 0.05},
    {"stage": 3, "steps": 3, "accum": 2, "clip": 0.05},
    {"stage": 2, "steps": 3, "offload": True},
]


def test_parity_at_three_ranks() -> None:
    per_rank = run_on_ranks(3, parity_grid, FAST)
    for index, case in enumerate(FAST):
        check_parity(case, 3, [r[index] for r in per_rank])
