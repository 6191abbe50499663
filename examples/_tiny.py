"""What the examples share: a tiny Llama built from a config and a word-level tokenizer over a
made-up vocabulary, so that every example runs anywhere in seconds, with nothing to download."""

from __future__ import annotations

import torch

WORDS = [f"w{i}" for i in range(60)]


def tiny_llama(dtype: torch.dtype = torch.float32):  # noqa: ANN201
    """A 2-layer Llama of hidden size 32 (the same code path as a pretrained one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
        eos_token_id=1, bos_token_id=2,
    )
    return LlamaForCausalLM(config).to(dtype)


def tokenizer():  # noqa: ANN201
    """A word-level tokenizer of ``WORDS`` (ids 4-63) with pad, eos, bos and unk (0-3)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{word: i + 4 for i, word in enumerate(WORDS)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def sentence(generator: torch.Generator, length: int) -> str:
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (length,), generator=generator))
