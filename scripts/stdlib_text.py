"""Training text that needs no download: the Python standard library's own source files.

Byte-level tokens (vocabulary 256). Batches are a pure function of (step, split), the same on
every rank, and each rank takes its own rows, so a run is reproducible at any world size.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch


def load_corpus(max_bytes: int = 8_000_000) -> torch.Tensor:
    """Up to ``max_bytes`` of the standard library's ``.py`` files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(f"no Python sources found under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


class TextBatches:
    """Random windows of the corpus: the last 5% is held out for evaluation."""

    def __init__(self, corpus: torch.Tensor, context: int) -> None:
        split = int(len(corpus) * 0.95)
        self.splits = {"train": corpus[:split], "val": corpus[split:]}
        self.context = context

    def global_batch(self, step: int, size: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        data = self.splits[split]
        generator = torch.Generator().manual_seed(step * 2 + (split == "val"))
        starts = torch.randint(0, len(data) - self.context - 1, (size,), generator=generator)
        windows = torch.stack([data[s : s + self.context + 1] for s in starts.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]

    def rank_batch(self, step: int, micro: int, rank: int, world_size: int, micro_size: int, accum: int):
        """This rank's share of micro-step ``micro`` of optimizer step ``step``."""
        tokens, targets = self.global_batch(step, micro_size * accum * world_size)
        start = (micro * world_size + rank) * micro_size
        return tokens[start : start + micro_size], targets[start : start + micro_size]

    def unigram_loss(self) -> float:
        """Cross-entropy (nats) of predicting each byte from the training bytes' frequencies."""
        counts = torch.bincount(self.splits["train"].long(), minlength=256).double()
        probs = counts / counts.sum()
        probs = probs[probs > 0]
        return float(-(probs * probs.log()).sum()) if len(probs) else math.log(256)
