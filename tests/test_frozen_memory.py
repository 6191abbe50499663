"""Frozen weights at stage 3, in memory as the process holds it: each rank's resident growth over
the process before the model was built is at most the model's bytes / N x 1.15 + the largest
unit + a small constant, for a LoRA-shaped model with an fp32 base, with a bf16 base under
``bf16.enabled``, and for an engine without an optimizer (every weight frozen); with a bf16 base,
no fp32 tensor of a frozen weight's size is alive at any stage.

The model: 6 blocks of a frozen 1024 x 1024 linear with a rank-4 adapter beside it (25 MiB of
fp32 base, 48 KiB of adapters), so a base kept whole, or an fp32 copy of it, shows as megabytes.
Rank processes run with ``MALLOC_MMAP_THRESHOLD_=65536``: each tensor above 64 KiB is its own
mapping, returned to the kernel when freed.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from zero_engine.testing.process_memory import live_tensor_bytes, resident_bytes

MiB = 2**20
WIDTH, DEPTH, ADAPTER, BATCH = 1024, 6, 4, 2
SLACK = 4 * MiB  # page rounding, interpreter and autograd objects, activations, the adapters' optimizer state


class Adapted(nn.Module):
    def __init__(self, trainable: bool) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH, bias=False)
        self.base.requires_grad_(False)
        self.down = nn.Linear(WIDTH, ADAPTER, bias=False)
        self.up = nn.Linear(ADAPTER, WIDTH, bias=False)
        nn.init.zeros_(self.up.weight)
        self.down.requires_grad_(trainable)
        self.up.requires_grad_(trainable)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.base(x) + self.up(self.down(x)))


class Tower(nn.Module):
    def __init__(self, trainable: bool = True, depth: int = DEPTH) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Adapted(trainable) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


MODEL_NUMEL = DEPTH * (WIDTH * WIDTH + 2 * WIDTH * ADAPTER)
BASE_NUMEL = DEPTH * WIDTH * WIDTH


def _config(dtype: str) -> dict:
    return engine_config(3, micro=BATCH, lr=0.01, dtype=dtype, stage3_wrap_modules=["Adapted"])


CASES = {  # name: (base dtype, config dtype, trainable adapters)
    "lora_fp32": (torch.float32, "fp32", True),
    "lora_bf16": (torch.bfloat16, "bf16", True),
    "reference_fp32": (torch.float32, "fp32", False),
    "reference_bf16": (torch.bfloat16, "bf16", False),
    # a reference loaded in bf16 under a config without bf16: its units stay in bf16 (N27)
    "reference_bf16_fp32_config": (torch.bfloat16, "fp32", False),
}


def _build(base_dtype: torch.dtype, trainable: bool, depth: int = DEPTH) -> Tower:
    torch.manual_seed(0)
    model = Tower(trainable, depth)
    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.to(base_dtype)
    return model


def _fp32_frozen_sized() -> int:
    """Live fp32 tensors of at least one frozen weight's elements (a copy of one)."""
    return sum(
        1 for obj in gc.get_objects()
        if isinstance(obj, torch.Tensor) and obj.dtype == torch.float32 and obj.numel() >= WIDTH * WIDTH // 2
    )


def measure(rank: int, world: int, names: list[str]) -> dict[str, dict]:
    torch.set_num_threads(1)
    x = torch.randn(BATCH, WIDTH, dtype=torch.float32)
    for name in names:  # page in every code path and kernel (bf16 GEMM caches too) before any baseline
        base_dtype, dtype, trainable = CASES[name]
        engine = zero_engine.initialize(_build(base_dtype, trainable, depth=2), _config(dtype))
        if trainable:
            engine.backward(engine(x))
            engine.step()
        engine.close()
        del engine
    results = {}
    for name in names:
        base_dtype, dtype, trainable = CASES[name]
        gc.collect()
        before = resident_bytes()
        live_before = live_tensor_bytes()
        engine = zero_engine.initialize(_build(base_dtype, trainable), _config(dtype))
        fp32_copies = [_fp32_frozen_sized()]
        for _ in range(2):
            if trainable:
                loss = engine(x)
                engine.backward(loss)
                fp32_copies.append(_fp32_frozen_sized())
                engine.step()
                del loss
            else:
                with torch.no_grad():  # without mixed precision the caller casts the input to the model's dtype
                    engine(x.to(base_dtype) if dtype == "fp32" else x)
            fp32_copies.append(_fp32_frozen_sized())
        gc.collect()
        results[name] = {
            "growth": resident_bytes() - before,
            "live_growth": live_tensor_bytes() - live_before,
            "fp32_copies": fp32_copies,
            "report": engine.memory_report(),
        }
        engine.close()
        del engine
    return results


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_frozen_weights_at_stage3_hold_their_share_as_the_process_holds_memory(
    world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    names = ["lora_fp32", "lora_bf16", "reference_bf16", "reference_bf16_fp32_config"] if world == 2 else list(CASES)
    results = run_on_ranks(world, measure, names)
    for rank, per_case in enumerate(results):
        for name, result in per_case.items():
            base_dtype = CASES[name][0]
            size = torch.tensor([], dtype=base_dtype).element_size()
            model_bytes = MODEL_NUMEL * size if base_dtype == torch.bfloat16 else MODEL_NUMEL * 4
            largest_unit = (WIDTH * WIDTH) * size  # one block's base, gathered in its dtype
            bound = model_bytes / world * 1.15 + largest_unit + SLACK
            where = f"{name}, rank {rank} of {world}"
            assert result["growth"] <= bound, f"{where}: resident growth {result['growth'] / MiB:.1f} MiB > {bound / MiB:.1f}"
            assert result["live_growth"] <= model_bytes / world * 1.15 + largest_unit, where
            # The engine's own figure agrees with the tensors: the base's share, in its dtype.
            # A reference model's adapters are frozen too, and stay whole (below the persistence threshold).
            expected = BASE_NUMEL * size / world + (0 if CASES[name][2] else (MODEL_NUMEL - BASE_NUMEL) * size)
            frozen = result["report"]["frozen_parameters"]
            assert expected <= frozen <= expected + 64 * world * DEPTH, where
            if base_dtype == torch.bfloat16:
                assert result["fp32_copies"] == [0] * len(result["fp32_copies"]), f"{where}: an fp32 copy of a frozen weight"
