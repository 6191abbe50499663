"""The 1024-wide tower of residual blocks that memory is measured on (stage 3's resident set,
low-precision gradient copies, CUDA's allocator): no parameters of its own, one unit per
`Block` with ``stage3_wrap_modules: [Block]`` or a ``reduce_bucket_size`` of `BLOCK_NUMEL`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, DEPTH, BATCH = 1024, 8, 2
BLOCK_NUMEL = 2 * (WIDTH * WIDTH + WIDTH)  # one Block's parameters


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(x)))


class Tower(nn.Module):
    """No parameters of its own: the root unit is empty, as in the issue's measurement."""

    def __init__(self, depth: int = DEPTH) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()
