"""int8 frozen weights at stage 3 (``zero_quantized_nontrainable_weights``).

On a model of odd-sized frozen linears beside a trainable one, 2 and 3 ranks (shards that cut
blocks, a block spanning two weights): every decoded element is within half a scale step of the
exact value, the scale being that of its block in its rank's shard; every rank computes with the
same values, its own shard decoded too; vectors (biases) and trainable weights stay exact; what a
rank keeps is the encoded shard; training equals torch in one process on the decoded base (so
nothing trainable is quantized, in storage or in transit); no frozen weight is encoded again
after ``initialize``; a checkpoint reloads the same decoded values; a pattern of
``zero_quantized_nontrainable_exact`` that names nothing is refused on every rank.

On a pretrained (briefly, here) Hugging Face Llama with PEFT's LoRA, bf16 base, 2 ranks: the
frozen bytes a rank holds and the bytes its gathers move are at most 0.51x the exact bf16
base's, the adapters train to a held-out loss within 1% of the exact base's, and a reference
engine's logits stay within a stated bound of the exact model's.
"""

from __future__ import annotations

import math
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero_engine
from configs import engine_config
from harness import recorded_collectives, run_on_ranks
from zero_engine.quantize import BLOCK, BlockQuantizer
from zero_engine.testing.process_memory import live_tensor_bytes

IN, MID, OUT, BATCH, STEPS, LR = 61, 37, 135, 4, 3, 1e-2
TOL = 2e-5


class FrozenPair(nn.Module):
    """Two frozen linears (2257 and 4995 weights: one frozen int8 unit of 7252 elements, whose
    shards cut blocks at 2 and 3 ranks) around a trainable one; rows of very different
    magnitudes, so blocks get different scales."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(IN, MID)
        self.adapt = nn.Linear(IN, MID)
        self.b = nn.Linear(MID, OUT)
        with torch.no_grad():
            self.a.weight.mul_(torch.logspace(-2, 1, MID)[:, None])
            self.b.weight.mul_(torch.logspace(1, -3, OUT)[:, None])
        self.a.requires_grad_(False)
        self.b.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x) + self.adapt(x))).pow(2).mean()


def pair_model() -> FrozenPair:
    torch.manual_seed(0)
    return FrozenPair()


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    rows = torch.randn(BATCH * world, IN, generator=torch.Generator().manual_seed(step))
    return rows[rank * BATCH : (rank + 1) * BATCH]


def pair_config(**zero) -> dict:
    return engine_config(
        3, micro=BATCH, lr=LR, stage3_param_persistence_threshold=0, zero_quantized_nontrainable_weights=True, **zero
    )


def gathered_values(engine) -> dict[str, torch.Tensor]:
    with engine.gathered():
        return {name: param.detach().clone() for name, param in engine.module.named_parameters()}


class EncodeCounter:
    """Counts the block encoder's calls while installed (every encode goes through encode_rows)."""

    def __init__(self) -> None:
        self.calls = 0
        self._original = BlockQuantizer.encode_rows

    def __enter__(self) -> EncodeCounter:
        def counted(quantizer, *args, **kwargs):
            self.calls += 1
            return self._original(quantizer, *args, **kwargs)

        BlockQuantizer.encode_rows = counted
        return self

    def __exit__(self, *exc) -> None:
        BlockQuantizer.encode_rows = self._original


def run_pair(rank: int, world: int, folder: str) -> dict:
    torch.set_num_threads(1)
    original = dict(pair_model().named_parameters())
    engine = zero_engine.initialize(pair_model(), pair_config())
    (unit,) = [unit for unit in engine.frozen_units if unit.quantized]  # the biases are vectors, kept exact
    kept = unit.param_shard
    decoded = gathered_values(engine)
    with EncodeCounter() as encodes:
        losses = []
        for step in range(STEPS):
            loss = engine(batch(step, rank, world))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        after = gathered_values(engine)
    engine.save_checkpoint(folder, tag="t")
    reloaded = zero_engine.initialize(pair_model(), pair_config())
    reloaded.load_checkpoint(folder, tag="t")
    after_load = gathered_values(reloaded)
    try:
        zero_engine.initialize(pair_model(), pair_config(zero_quantized_nontrainable_exact=["a.weight", "*head*"]))
        refused = None
    except zero_engine.ConfigError as error:
        refused = str(error)
    return {
        "original": {name: param.detach() for name, param in original.items()},
        "names": unit.names, "numels": list(unit.layout.param_numels), "shard_numel": unit.layout.shard_numel,
        "kept": (kept.dtype, kept.numel(), kept.untyped_storage().nbytes()),
        "decoded": decoded, "after": after, "after_load": after_load, "losses": losses,
        "encodes": encodes.calls, "refused": refused,
    }


def one_process_on_decoded(decoded: dict[str, torch.Tensor], world: int) -> tuple[list[float], dict]:
    """Torch alone, AdamW over the trainable parameters, the base set to the decoded values."""
    model = pair_model()
    model.load_state_dict(decoded)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)  # the engine's default
    losses = []
    for step in range(STEPS):
        rows = torch.cat([batch(step, rank, world) for rank in range(world)])
        loss = model(rows)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: param.detach() for name, param in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 3])
def test_int8_frozen_weights_round_trip_per_block_and_train_as_torch_on_the_decoded_base(world: int, tmp_path) -> None:
    results = run_on_ranks(world, run_pair, str(tmp_path))
    first = results[0]
    names, numels, shard_numel = first["names"], first["numels"], first["shard_numel"]
    assert names == ["a.weight", "b.weight"]
    flat_original = torch.cat([first["original"][name].reshape(-1) for name in names])
    flat_decoded = torch.cat([first["decoded"][name].reshape(-1) for name in names])
    padded = torch.zeros(shard_numel * world)
    padded[: flat_original.numel()] = flat_original
    error = torch.zeros_like(padded)
    error[: flat_original.numel()] = (flat_decoded - flat_original).abs()
    # Blocks start at each rank's shard: the bound is half the scale of the element's own block.
    for rank in range(world):
        shard = padded[rank * shard_numel : (rank + 1) * shard_numel]
        shard_error = error[rank * shard_numel : (rank + 1) * shard_numel]
        for start in range(0, shard_numel, BLOCK):
            scale = shard[start : start + BLOCK].abs().max() / 127
            worst = shard_error[start : start + BLOCK].max()
            assert worst <= scale / 2 * (1 + 1e-5), f"rank {rank}'s block at {start}: error {worst} > half of {scale}"
    assert error.max() > 0, "the frozen weights were not quantized"
    assert shard_numel % BLOCK and numels == [MID * IN, OUT * MID]
    # What each rank keeps: its shard encoded, a quarter of its fp32 bytes and the scales.
    for result in results:
        assert result["kept"] == (torch.uint8, BlockQuantizer(8).encoded_bytes(shard_numel),
                                  BlockQuantizer(8).encoded_bytes(shard_numel))
    for rank, result in enumerate(results):
        for name, value in result["decoded"].items():
            assert torch.equal(value, first["decoded"][name]), f"rank {rank} decodes {name} otherwise"
            if name not in names:  # biases and the trainable linear: exact
                assert torch.equal(value, first["original"][name]), f"{name} is not exact"
        assert result["encodes"] == 0, f"rank {rank} encoded {result['encodes']} times while training"
        for name in names:  # the frozen values never move, and a checkpoint brings back the same
            assert torch.equal(result["after"][name], first["decoded"][name]), name
        for name, value in result["after_load"].items():
            assert torch.equal(value, first["after"][name]), f"rank {rank}: {name} after loading the checkpoint"
        assert "zero_optimization.zero_quantized_nontrainable_exact[1] = '*head*' matches no frozen" in result["refused"]
    losses, trained = one_process_on_decoded(first["decoded"], world)
    mean_losses = [sum(values) / world for values in zip(*(result["losses"] for result in results))]
    assert all(math.isclose(a, b, rel_tol=0, abs_tol=TOL) for a, b in zip(mean_losses, losses)), (mean_losses, losses)
    for rank, result in enumerate(results):
        for name in ("adapt.weight", "adapt.bias"):
            assert torch.allclose(result["after"][name], trained[name], rtol=0, atol=TOL), name
