"""What the tiled loss and tiled MLP tests share: a tiny Llama whose vocabulary makes the logits
the largest activation, and its batches (a prompt without targets on each row)."""

from __future__ import annotations

from typing import Any

import torch

import tiny

VOCAB, HIDDEN, LENGTH, MICRO = 512, 32, 64, 2


def llama() -> Any:
    """`tiny.llama` with 512 words (logits worth tiling) and 64 positions."""
    return tiny.llama(vocab=VOCAB, hidden=HIDDEN, positions=LENGTH, attention="sdpa")


def batch(step: int, rank: int, length: int = LENGTH) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (MICRO, length), generator=torch.Generator().manual_seed(100 * step + rank))
    labels = ids.clone()
    labels[:, : LENGTH // 4] = -100  # a prompt without targets
    return {"input_ids": ids, "labels": labels}
