"""A small mixture-of-experts language model whose experts get no tokens on some ranks.

Hash routing (expert = token id % 4) and batches that leave out one residue per rank and
micro-step make an expert idle on some ranks in some micro-steps and busy in others (and
sometimes idle on every rank). Two forms of the same function, as real MoE code writes it:

- ``"guard"``: the block calls every expert; an expert without tokens returns zeros without
  touching its weights (its parameters get no gradient on that rank);
- ``"skip"``: the block does not call an expert that has no tokens (Hugging Face's older
  Mixtral loop), so ranks run different modules.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, HIDDEN, SEQ, EXPERTS = 16, 8, 12, 6, 4


class Expert(nn.Module):
    def __init__(self, guard: bool) -> None:
        super().__init__()
        self.guard = guard
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.guard and x.shape[0] == 0:
            return x.new_zeros(0, DIM)
        return self.fc2(torch.tanh(self.fc1(x)))


class MoEBlock(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.experts = nn.ModuleList(Expert(guard=form == "guard") for _ in range(EXPERTS))

    def forward(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        flat, route = h.reshape(-1, DIM), tokens.reshape(-1) % EXPERTS
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            idx = (route == index).nonzero().squeeze(1)
            if self.form == "skip" and idx.numel() == 0:
                continue
            out = out.index_add(0, idx, expert(flat[idx]))
        return h + out.view_as(h)


class MoEModel(nn.Module):
    """Embedding, two MoE blocks, a head. ``checkpointing``: each block is recomputed in
    backward (non-reentrant, as Hugging Face's ``gradient_checkpointing_enable``)."""

    def __init__(self, form: str, checkpointing: bool = False) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MoEBlock(form) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            if self.checkpointing:
                h = checkpoint(block, h, tokens, use_reentrant=False)
            else:
                h = block(h, tokens)
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def make_moe(form: str, checkpointing: bool = False) -> MoEModel:
    torch.manual_seed(0)
    return MoEModel(form, checkpointing)


def moe_batch(step: int, micro: int, rank: int, micro_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch: tokens without one residue mod `EXPERTS` (which one, or
    none, changes with step, micro-step and rank), so that expert idles there."""
    generator = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    tokens = torch.randint(0, VOCAB, (micro_size, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (micro_size, SEQ), generator=generator)
    left_out = (step + 2 * micro + rank) % (EXPERTS + 1)  # EXPERTS: none left out
    if left_out < EXPERTS:
        tokens = torch.where(tokens % EXPERTS == left_out, (tokens + 1) % VOCAB, tokens)
    return tokens, targets


def global_moe_batch(step: int, world_size: int, micro_size: int, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's micro-batches of ``step``, concatenated."""
    parts = [moe_batch(step, micro, rank, micro_size) for micro in range(accum) for rank in range(world_size)]
    return torch.cat([tokens for tokens, _ in parts]), torch.cat([targets for _, targets in parts])


def train_moe_engine(engine: Any, rank: int, steps: range, micro_size: int, accum: int) -> list[float]:
    """Train on this rank's micro-batches of ``steps``; the loss of every micro-step."""
    losses = []
    for step in steps:
        for micro in range(accum):
            loss = engine(*moe_batch(step, micro, rank, micro_size))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def train_moe_reference(
    form: str, steps: int, world_size: int, micro_size: int, accum: int, lr: float
) -> dict[str, torch.Tensor]:
    """One process, plain SGD, the global batch of every step."""
    model = make_moe(form)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        model(*global_moe_batch(step, world_size, micro_size, accum)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


class SequenceAttention(nn.Module):
    """Causal self-attention of 4 heads over `DIM`, its core split over a sequence group."""

    def __init__(self) -> None:
        super().__init__()
        from zero_engine import SequenceParallelAttention

        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.core = SequenceParallelAttention(F.scaled_dot_product_attention)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = h.shape
        q, k, v = self.qkv(h).view(batch, tokens, 3, 4, DIM // 4).permute(2, 0, 3, 1, 4)
        attended = self.core(q, k, v, is_causal=True)
        return h + self.out(attended.transpose(1, 2).reshape(batch, tokens, DIM))


class SequenceMoEModel(nn.Module):
    """`MoEModel` with attention before each MoE block, for ``sequence_parallel_size``: the
    ranks of a sequence group route the tokens of their own slices, so an expert idles on some
    rank of a group (the GPU review's R1). Its forward takes a rank's slices (tokens, global
    positions, targets shifted before the split) and returns the slice's summed loss."""

    def __init__(self, form: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.position = nn.Embedding(VOCAB, DIM), nn.Embedding(4 * SEQ, DIM)
        self.attention = nn.ModuleList(SequenceAttention() for _ in range(2))
        self.blocks = nn.ModuleList(MoEBlock(form) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position(positions)
        for attention, block in zip(self.attention, self.blocks):
            h = block(attention(h), tokens)
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1), ignore_index=-100,
                               reduction="sum")


def sequence_moe_loss(engine: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A plain loop's split forward of `SequenceMoEModel` on a group's micro-batch: the
    micro-batch's mean loss on every rank of the group (`engine.sequence_loss`)."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    summed = engine(engine.sequence_slice(tokens), engine.sequence_slice(positions),
                    engine.sequence_slice(targets, pad_value=-100))
    return engine.sequence_loss(summed / targets.numel())
