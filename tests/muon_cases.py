"""What the Muon tests and the tests that train the tiny GPT under Muon share: its batches, the
config of a case, an engine's training over them, and the reference in one process (torch's Muon
with its iteration in fp32 on the parameters DeepSpeed's rule gives Muon, AdamW on the rest)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from tiny import GPT_VOCAB as VOCAB
from tiny import make_gpt
from zero_engine.muon import newton_schulz

SEQ, MICRO, STEPS = 8, 2, 20
LR, ADAM_LR = 0.02, 3e-3


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (size, SEQ + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def train_engine(engine: Any, rank: int, world: int, steps: range, accum: int, device: str = "cpu") -> list[float]:
    """This rank's micro-batches of each global batch, on ``device``; the losses."""
    losses = []
    for step in steps:
        ids, labels = batch(step, MICRO * accum * world)
        for micro in range(accum):
            rows = slice((micro * world + rank) * MICRO, (micro * world + rank + 1) * MICRO)
            loss = engine(ids[rows].to(device), labels[rows].to(device))
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


def deepspeed_rule(name: str, param: torch.Tensor) -> bool:
    """Which parameters DeepSpeed 0.19.8 gives Muon (``set_optimizer_flags``), written out here
    so that the engine's rule is checked against it rather than against itself."""
    return param.ndim >= 2 and "embed" not in name.lower() and "lm_head" not in name.lower()


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


def train_reference(
    steps: int, global_size: int, clip: float = 0.0, frozen: tuple[str, ...] = (), device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """One process: torch's Muon on DeepSpeed's matrices, torch's AdamW on the rest."""
    model = make_gpt().to(device)
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if deepspeed_rule(n, p)]
    rest = [p for n, p in named if not deepspeed_rule(n, p)]
    muon = torch.optim.Muon(matrices, lr=LR, weight_decay=0.01)
    adamw = torch.optim.AdamW(rest, lr=ADAM_LR, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.01)
    with fp32_newton_schulz():
        for step in range(steps):
            ids, labels = batch(step, global_size)
            model(ids.to(device), labels.to(device)).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
    return {name: p.detach().cpu() for name, p in model.named_parameters()}
