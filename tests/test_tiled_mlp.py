"""``tiled_mlp_tokens``: a Hugging Face Llama's MLPs a tile of tokens at a time give the loss,
gradients and parameters of the untiled model, at stages 0 and 3, with recomputation, with the
tiled loss and sequence parallelism, and with an MLP that is a stage 3 unit of its own on ranks
whose batches make other numbers of tiles; what they keep for backward is measured in
tests/test_activations.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from tiled_cases import LENGTH, MICRO, VOCAB, batch, llama

STEPS = 4  # optimizer steps of 2 micro-steps each; the bound, 2e-5, on the parameters after them


def train(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    results = []
    for case in cases:
        config = engine_config(case["stage"], micro=MICRO, lr=1e-3, clip=1.0, accum=2,
                               recompute_units=case.get("recompute"))
        config["tiled_mlp_tokens"] = case["tiles"]
        config["tiled_loss_tokens"] = case.get("loss_tiles", 0)
        config["sequence_parallel_size"] = k = case.get("k", 1)
        if case.get("mlp_unit"):  # each MLP a unit of its own: gathered around its tiles, not per tile
            config["zero_optimization"]["stage3_wrap_modules"] = ["LlamaDecoderLayer", "LlamaMLP"]
        engine = zero_engine.initialize(qwen3_moe() if case.get("moe") else llama(), config)
        length = case.get("lengths", (LENGTH, LENGTH))[rank]
        routed: list[int] = []  # a mixture of experts' router calls in the first forward: one per tile
        gates = [module.register_forward_hook(lambda *_: routed.append(1))
                 for name, module in engine.module.named_modules() if name.endswith("mlp.gate")]
        losses = []
        for step in range(2 * STEPS):
            out = engine(**batch(step, rank // k, length))  # a sequence group reads the same micro-batches
            for gate in gates if step == 0 else []:
                gate.remove()
            losses.append(out.loss.item())
            engine.backward(out.loss)
            engine.step()
        engine.eval()
        with torch.no_grad():
            evaluated = engine(**batch(99, rank // k)).logits
        engine.train()
        results.append({"losses": losses, "norm": engine.get_global_grad_norm(), "state": engine.full_state_dict(),
                        "eval": evaluated, "routed": len(routed)})
        engine.close()
    return results


CASES = [  # pairs: untiled, then tiled (a micro-batch is 128 tokens: 6 tiles of 24, 8 of 16)
    {"stage": 0, "tiles": 0}, {"stage": 0, "tiles": 24},
    {"stage": 3, "tiles": 0, "recompute": True}, {"stage": 3, "tiles": 16, "recompute": True},
    {"stage": 3, "tiles": 0, "k": 2}, {"stage": 3, "tiles": 16, "loss_tiles": 16, "k": 2},
    # 6 tiles on one rank, 4 on the other (80 tokens): no collective depends on the number
    {"stage": 3, "tiles": 0, "lengths": (64, 40), "mlp_unit": True},
    {"stage": 3, "tiles": 24, "lengths": (64, 40), "mlp_unit": True},
    # a mixture of experts' block tiled (Qwen3-MoE, its load-balancing loss on), with the split too
    {"stage": 0, "tiles": 0, "moe": True}, {"stage": 0, "tiles": 24, "moe": True},
    {"stage": 3, "tiles": 0, "moe": True, "k": 2, "recompute": True},
    {"stage": 3, "tiles": 16, "moe": True, "k": 2, "recompute": True},
]


def qwen3_moe() -> Any:
    """A tiny Qwen3-MoE (4 experts, 2 a token), its router's load-balancing loss in the loss."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB,
        max_position_embeddings=256, output_router_logits=True, router_aux_loss_coef=0.05,
        attn_implementation="sdpa",
    ))


def test_tiled_mlps_give_the_untiled_loss_gradients_and_parameters() -> None:
    per_rank = run_on_ranks(2, train, CASES, allow_numpy=True)
    for rank, results in enumerate(per_rank):
        for case, plain, tiled in zip(CASES[1::2], results[::2], results[1::2]):
            assert tiled["losses"] == pytest.approx(plain["losses"], abs=2e-6), (rank, case)
            assert tiled["norm"] == pytest.approx(plain["norm"], abs=2e-6), (rank, case)
            for name, value in plain["state"].items():
                assert (tiled["state"][name] - value).abs().max().item() <= 2e-5, (rank, case, name)
            assert (tiled["eval"] - plain["eval"]).abs().max().item() <= 2e-5  # evaluation as the model is
            if case.get("moe"):  # each layer's block routed a tile at a time: 128 tokens a rank (64 split)
                tokens = 2 * LENGTH // case.get("k", 1)
                assert plain["routed"] == 2 and tiled["routed"] == 2 * -(-tokens // case["tiles"]), (case, tiled)


def test_tiled_mlps_are_the_modules_named_mlp_until_close() -> None:
    from zero_engine.comm import Mesh
    from zero_engine.transforms.seam import ModuleTransforms, TransformTarget
    from zero_engine.transforms.tiled_mlp import TiledMLP

    model = llama()
    transforms = ModuleTransforms(TransformTarget(model, lambda: [], Mesh()))
    transforms.add(TiledMLP(8))
    assert all("forward" in vars(layer.mlp) for layer in model.model.layers)  # the instance's own
    assert not any("forward" in vars(module) for name, module in model.named_modules() if not name.endswith("mlp"))
    transforms.remove()
    assert not any("forward" in vars(module) for module in model.modules())


def test_a_model_without_an_mlp_or_with_a_block_that_returns_more_is_refused_by_name() -> None:
    from torch import nn

    config = engine_config(0, micro=1, lr=1e-3)
    config["tiled_mlp_tokens"] = 8
    with pytest.raises(NotImplementedError, match="tiled_mlp_tokens: Sequential has no module named 'mlp'"):
        zero_engine.initialize(nn.Sequential(nn.Linear(4, 4)), config)

    class Routed(nn.Module):  # a block returning its router's logits beside its hidden states
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(4, 4)])

        def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.experts[0](hidden), hidden.sum(-1)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = Routed()

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            return self.mlp(hidden)[0]

    engine = zero_engine.initialize(Block(), config)
    with pytest.raises(NotImplementedError, match=r"tiled_mlp_tokens: Routed \(a mixture of experts' block\) "
                                                  r"returns tuple, not its hidden states alone"):
        engine(torch.randn(1, 20, 4, requires_grad=True))
    engine.close()
