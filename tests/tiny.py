"""The tiny models the tests share: one Hugging Face Llama (with its sliding-window and q/k-norm
twins), one mixture-of-experts causal LM of each family transformers fuses the experts of
(Qwen3-MoE, Mixtral), its LoRA adapters, and one hand-written GPT. Each builds from ``torch.manual_seed(0)``,
so two tests that ask for the same shape get the same weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def llama(
    *, vocab: int = 64, hidden: int = 32, ffn: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
    positions: int = 32, attention: str | None = None, window: int | None = None, qwen3: bool = False,
    tied: bool = False, **extra: Any,
) -> Any:
    """A tiny ``LlamaForCausalLM`` (untied head unless ``tied``); with ``window``, its Mistral twin (sliding-window
    attention of that width); with ``qwen3``, its Qwen3 twin (an RMSNorm on each head's queries
    and keys, heads of 4). ``attention`` picks the attention implementation (transformers' default
    when None); ``extra`` goes to the config."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(0)
    if window is not None:
        Config, Model, extra = MistralConfig, MistralForCausalLM, {**extra, "sliding_window": window}
    elif qwen3:
        Config, Model, extra = Qwen3Config, Qwen3ForCausalLM, {**extra, "head_dim": 4}
    else:
        Config, Model = LlamaConfig, LlamaForCausalLM
    if attention is not None:
        extra = {**extra, "attn_implementation": attention}
    config = Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions,
        tie_word_embeddings=tied, **extra,
    )
    return Model(config)


def moe(
    family: str = "qwen3_moe", *, experts: int = 8, top_k: int = 2, vocab: int = 64, hidden: int = 16, layers: int = 2,
    **extra: Any,
) -> Any:
    """A tiny mixture-of-experts causal LM with fused experts (``mlp.experts.gate_up_proj`` /
    ``down_proj``, 3-D): ``qwen3_moe`` (Qwen3-MoE: top-k renormalised), ``mixtral``, ``olmoe``
    or ``deepseek_v3`` (a dense first layer, a shared expert, group-limited routing), eager
    attention, every layer sparse, router weights drawn (Qwen3-MoE's start at zero, which
    would route every token alike)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        num_experts_per_tok=top_k, max_position_embeddings=64, attn_implementation="eager", **extra,
    )
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            intermediate_size=32, moe_intermediate_size=12, num_experts=experts, decoder_sparse_step=1,
            mlp_only_layers=[], norm_topk_prob=True, head_dim=8, **common,
        ))
    elif family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=12, num_local_experts=experts, head_dim=8, **common))
    elif family == "olmoe":
        from transformers import OlmoeConfig, OlmoeForCausalLM

        model = OlmoeForCausalLM(OlmoeConfig(
            intermediate_size=12, num_experts=experts, bos_token_id=None, eos_token_id=None, pad_token_id=None, **common,
        ))
    elif family == "deepseek_v3":  # a dense first layer, then MoE layers with a shared expert, group-limited routing
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        common["num_key_value_heads"] = 2
        model = DeepseekV3ForCausalLM(DeepseekV3Config(
            intermediate_size=32, moe_intermediate_size=12, n_routed_experts=experts, n_shared_experts=1,
            first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, **{**common, "num_hidden_layers": layers + 1},
        ))
    else:
        raise ValueError(f"no tiny MoE family {family!r}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0.0, 0.5)
    return model


def lora_config(*, random_init: bool = True, **options: Any) -> Any:
    """PEFT's LoRA of rank 4 on the queries and values; ``random_init`` starts the B matrices off
    zero (``init_lora_weights=False``), so the adapters change the outputs from the first step."""
    from peft import LoraConfig

    options = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **options}
    if random_init:
        options["init_lora_weights"] = False
    return LoraConfig(lora_dropout=0.0, **options)


def with_lora(model: nn.Module, **options: Any) -> Any:
    from peft import get_peft_model

    return get_peft_model(model, lora_config(**options))


GPT_HIDDEN, GPT_VOCAB, GPT_LAYERS = 48, 97, 2


class Block(nn.Module):  # the name stage3_wrap_modules asks for
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(GPT_HIDDEN)
        self.attn = nn.Linear(GPT_HIDDEN, 3 * GPT_HIDDEN, bias=False)  # a key bias has no gradient but noise, which AdamW would amplify
        self.proj = nn.Linear(GPT_HIDDEN, GPT_HIDDEN, bias=False)
        self.up = nn.Linear(GPT_HIDDEN, 4 * GPT_HIDDEN)
        self.down = nn.Linear(4 * GPT_HIDDEN, GPT_HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn(self.norm(x)).chunk(3, dim=-1)
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(nn.functional.gelu(self.up(x)))


class TinyGPT(nn.Module):
    """A GPT of plain torch modules whose shapes (48 wide, 97 words) put partition boundaries
    inside matrices at every world size; its forward returns the loss."""

    def __init__(self, layers: int = GPT_LAYERS) -> None:
        super().__init__()
        self.embed = nn.Embedding(GPT_VOCAB, GPT_HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(GPT_HIDDEN)
        self.lm_head = nn.Linear(GPT_HIDDEN, GPT_VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        return nn.functional.cross_entropy(logits.view(-1, GPT_VOCAB), labels.reshape(-1))


def make_gpt(layers: int = GPT_LAYERS) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(layers)
