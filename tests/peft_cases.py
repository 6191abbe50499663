"""PEFT's LoRA on the tiny Llama as the PEFT tests and the NVMe tests train it: the model (its base
in fp32 or bf16), its token batches and the engine config of a stage."""

from __future__ import annotations

from typing import Any

from configs import engine_config
from tiny import llama, with_lora

VOCAB, SEQ, MICRO, LR = 64, 8, 2, 5e-3


def lora_llama(dtype: Any = None) -> Any:
    model = llama(vocab=VOCAB, positions=SEQ)
    if dtype is not None:
        model = model.to(dtype)
    return with_lora(model)  # adapters in fp32 over a bf16 base (autocast_adapter_dtype)


def tokens(step: int, rank: int, world: int, micro: int = MICRO) -> Any:
    import torch

    rows = torch.randint(0, VOCAB, (micro * world, SEQ), generator=torch.Generator().manual_seed(step))
    return rows[rank * micro : (rank + 1) * micro]


def config(stage: int, dtype: str = "fp32", **zero: Any) -> dict:
    return engine_config(stage, micro=MICRO, lr=LR, dtype=dtype, stage3_param_persistence_threshold=0, **zero)
