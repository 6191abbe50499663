"""Small models with the traps that break sharded data parallelism, and a reference trainer."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, HIDDEN, SEQ = 13, 7, 11, 5


class TrapModel(nn.Module):
    """Tied input/output embeddings, a frozen layer, a parameter never used in forward,
    a buffer, and parameter sizes that divide by no world size above 1. ``mlp_calls=2`` runs
    the norm/fc1/fc2 block twice in one forward (a module called twice)."""

    def __init__(self, mlp_calls: int = 1) -> None:
        super().__init__()
        self.mlp_calls = mlp_calls
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.unused = nn.Parameter(torch.randn(1, 5))  # 2-D: in the decaying group
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("temperature", torch.tensor(1.5))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, skip_mlp: bool = False) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.frozen(h)
        for _ in range(0 if skip_mlp else self.mlp_calls):  # skipping leaves norm/fc1/fc2 without gradients
            h = h + self.fc2(torch.tanh(self.fc1(self.norm(h))))
        logits = self.head(h) / self.temperature
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def init_trap_model(module: nn.Module) -> None:
    """``param_init_fn`` for a `TrapModel` built on the meta device: the root's own tensors as
    its constructor sets them, every other module by its ``reset_parameters()``."""
    if isinstance(module, TrapModel):
        nn.init.normal_(module.unused)
        module.temperature.fill_(1.5)
    else:
        module.reset_parameters()


class DeepModel(nn.Module):
    """Eight equal layers: enough buckets (or stage 3 units) for bounded memory to show.
    ``skip`` leaves one layer out (a rank that diverges); ``fail_at`` raises inside one.
    ``checkpointing`` ("reentrant" or "non_reentrant") recomputes every layer in backward,
    wrapped around the layer's call as Hugging Face's ``gradient_checkpointing_enable`` does."""

    def __init__(self, width: int = 16, depth: int = 8, checkpointing: str | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor, skip: int = -1, fail_at: int = -1) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            if index == fail_at:
                raise ValueError(f"failing inside layer {index} on purpose")
            if index == skip:
                continue
            if self.checkpointing and index > 0:  # reentrant needs an input that requires grad
                reentrant = self.checkpointing == "reentrant"
                x = torch.tanh(checkpoint(layer.__call__, x, use_reentrant=reentrant))
            else:
                x = torch.tanh(layer(x))
        return x.pow(2).mean()


def make_model(seed: int = 0, **options: Any) -> TrapModel:
    torch.manual_seed(seed)
    return TrapModel(**options)


def decay_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict[str, Any]]:
    """Matrices decay, vectors (biases, norms) do not: the usual two groups."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (size, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (size, SEQ), generator=generator)
    return tokens, targets


def micro_batch(step: int, micro: int, rank: int, world_size: int, micro_size: int, accum: int):
    """Rank ``rank``'s ``micro``-th slice of the global batch of ``step``."""
    tokens, targets = global_batch(step, micro_size * accum * world_size)
    start = (micro * world_size + rank) * micro_size
    return tokens[start : start + micro_size], targets[start : start + micro_size]


EVAL_BATCH = global_batch(-1, 6)


def train_engine(
    engine: Any, rank: int, world_size: int, steps: range, micro_size: int, accum: int,
    eval_losses: list[float] | None = None, device: torch.device | None = None,
) -> tuple[list[list[float]], list[float | None]]:
    """Train ``engine`` on this rank's share of each global batch (moved to ``device``): the
    losses of every micro-step, grouped per optimizer step, and the gradient norm of every
    step. With ``eval_losses``, evaluates `EVAL_BATCH` after every step (eval mode, no_grad)."""
    losses, norms = [], []
    for step in steps:
        window = []
        for micro in range(accum):
            batch = micro_batch(step, micro, rank, world_size, micro_size, accum)
            loss = engine(*(tensor.to(device) for tensor in batch) if device else batch)
            engine.backward(loss)
            engine.step()
            window.append(loss.item())
        losses.append(window)
        norms.append(engine.get_global_grad_norm())
        if eval_losses is not None:
            eval_losses.append(_evaluate(engine))
    return losses, norms


def _evaluate(model: Any) -> float:
    model.eval()
    with torch.no_grad():
        loss = model(*EVAL_BATCH).item()
    model.train()
    return loss


def train_reference(
    steps: int, global_size: int, optimizer: str = "AdamW", lr: float = 0.05, clip: float = 0.0,
    eval_losses: list[float] | None = None, initial: dict[str, torch.Tensor] | None = None, **options: Any,
) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """One process, torch.optim, the full global batch: (losses, final state, grad norms).
    ``eval_losses`` as in `train_engine`; ``initial`` replaces the seeded initial state;
    ``options`` go to the model."""
    model = make_model(**options)
    if initial is not None:
        model.load_state_dict(initial)
    cls = getattr(torch.optim, optimizer)
    opt = cls(decay_groups(model), lr=lr)
    losses, norms = [], []
    for step in range(steps):
        loss = model(*global_batch(step, global_size))
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if eval_losses is not None:
            eval_losses.append(_evaluate(model))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def train_reference_policy(
    steps: int,
    world_size: int,
    micro_size: int,
    accum: int,
    dtype: torch.dtype,
    clip: float = 0.0,
    loss_scale: float = 1.0,
    lr: float = 0.01,
    eps: float = 1e-8,
) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """One process, the engine's precision policy done by hand: a compute copy in ``dtype``,
    fp32 masters updated by torch.optim, the loss scaled by ``loss_scale`` and unscaled before
    clipping. Each (micro-step, rank) chunk runs separately, as on the ranks, so the low-
    precision gradients are the same chunks the engine sums."""
    master = make_model()
    compute = make_model().to(dtype)
    opt = torch.optim.AdamW(decay_groups(master), lr=lr, eps=eps)
    masters = [p for p in master.parameters() if p.requires_grad]
    losses, norms = [], []
    for step in range(steps):
        window = []
        for micro in range(accum):
            for rank in range(world_size):
                loss = compute(*micro_batch(step, micro, rank, world_size, micro_size, accum))
                (loss * (loss_scale / (accum * world_size))).backward()
                window.append(loss.item())
        for m, c in zip(master.parameters(), compute.parameters()):
            if m.requires_grad and c.grad is not None:
                m.grad = c.grad.float() / loss_scale
        grads = [p for p in masters if p.grad is not None]
        total = torch.nn.utils.clip_grad_norm_(grads, clip if clip > 0 else float("inf"))
        norms.append(total.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        compute.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, c in zip(master.parameters(), compute.parameters()):
                c.copy_(m)
        losses.append(sum(window) / len(window))
    return losses, {k: v.detach().clone() for k, v in master.state_dict().items()}, norms


class Block(nn.Module):
    """A residual MLP block (4x wide inside): a unit with activations worth recomputing."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class BlockStack(nn.Module):
    """``depth`` `Block`s and a linear head, trained on mean squared error."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x), y)
