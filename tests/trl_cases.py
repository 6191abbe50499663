"""TRL's trainers as the TRL tests build them: a word-level tokenizer over 60 words, the tiny
Llama with its special tokens, LoRA on the queries and values, SFT and preference datasets of
random sentences, and the trainer of each kind, plain TRL or TRL on the engine (the documented
``class ZeroSFTTrainer(ZeroEngineTrainer, SFTTrainer)``)."""

from __future__ import annotations

from typing import Any

from tiny import llama, lora_config

STEPS, SAVE_AT = 6, 3
WORDS = [f"w{i}" for i in range(60)]


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{word: i + 4 for i, word in enumerate(WORDS)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def base_model() -> Any:
    return llama(positions=64, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def lora() -> Any:
    return lora_config()


def datasets(kind: str) -> Any:
    import torch
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)

    def sentence(n: int) -> str:
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=generator))

    rows = 2 * 2 * STEPS  # 2 ranks, 2 per micro-batch, one epoch of STEPS steps
    if kind == "sft":
        return Dataset.from_dict({"text": [sentence(10) for _ in range(rows)]})
    return Dataset.from_dict({
        "prompt": [sentence(4) for _ in range(rows)],
        "chosen": [sentence(5) for _ in range(rows)],
        "rejected": [sentence(5) for _ in range(rows)],
    })


def trainer(kind: str, engine: bool, directory: str, zero_config: dict[str, Any] | None = None) -> Any:
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from zero_engine.integrations.transformers import ZeroEngineTrainer

    options = dict(
        output_dir=directory, per_device_train_batch_size=2, gradient_accumulation_steps=1, learning_rate=3e-3,
        num_train_epochs=1, logging_steps=1, save_strategy="steps", save_steps=SAVE_AT, report_to=[], seed=0,
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, bf16=False,
    )
    if kind == "sft":
        args, cls = SFTConfig(max_length=16, **options), SFTTrainer
    else:
        args, cls = DPOConfig(**options), DPOTrainer
    arguments = dict(model=base_model(), args=args, train_dataset=datasets(kind), processing_class=tokenizer(),
                     peft_config=lora())
    if not engine:
        return cls(**arguments)
    zero = type(f"Zero{cls.__name__}", (ZeroEngineTrainer, cls), {})  # the documented pattern
    zero_config = zero_config or {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    return zero(**arguments, zero_config=zero_config)
