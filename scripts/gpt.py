"""A small GPT (byte-level), shared by the example training script and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    context: int = 128
    dim: int = 128
    num_layers: int = 4
    num_heads: int = 4


PRESETS = {
    "tiny": GPTConfig(dim=128, num_layers=4, num_heads=4),  # ~0.8M parameters: the README's main job
    "small": GPTConfig(dim=240, num_layers=5, num_heads=6),  # ~3.6M parameters
    "medium": GPTConfig(dim=512, num_layers=8, num_heads=8),  # ~25M parameters
    "large": GPTConfig(dim=768, num_layers=8, num_heads=12),  # ~57M parameters: scripts/big_model.py
    # 32 thin blocks, short sequences: per-parameter work (hooks, optimizer loops) weighs most
    "thin": GPTConfig(context=64, dim=96, num_layers=32, num_heads=4),  # ~3.6M parameters
    # GPT-2 medium's shape at a 512-token context: the "few hundred million" of a first GPU figure
    "gpt300m": GPTConfig(context=512, dim=1024, num_layers=24, num_heads=16),  # ~303M parameters
}


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.norm1 = nn.LayerNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.norm2 = nn.LayerNorm(config.dim)
        self.fc = nn.Linear(config.dim, 4 * config.dim)
        self.out = nn.Linear(4 * config.dim, config.dim)
        # the attention's core: zero_engine.SequenceParallelAttention wraps it under sequence_parallel_size
        self.core = F.scaled_dot_product_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=2)
        q, k, v = (t.view(batch, time, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = self.core(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, time, dim))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class GPT(nn.Module):
    """Token and position embeddings, pre-norm blocks, an output head tied to the embedding."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.position = nn.Embedding(config.context, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.head.weight = self.embed.weight
        self.apply(init_weights)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The mean loss over ``targets`` (the logits without); ``positions``: the tokens' own
        (a slice of a longer sequence), else 0, 1, ..."""
        if positions is None:
            positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialization for one module; also the ``param_init_fn`` of a GPT built on the
    meta device (there LayerNorm, whose constructor set nothing, takes its own defaults)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        module.reset_parameters()


def decay_groups(model: nn.Module, weight_decay: float | None = None) -> list[dict]:
    """Matrices and embeddings decay; biases and norms do not. ``None`` keeps the config's decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = {"params": [p for p in params if p.ndim >= 2]}
    if weight_decay is not None:
        decay["weight_decay"] = weight_decay
    return [decay, {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
