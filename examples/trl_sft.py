"""TRL's SFTTrainer with a LoRA ``peft_config`` on the engine at ZeRO stage 3, configured as for
DeepSpeed (``"auto"`` values filled from the trainer's arguments).

    torchrun --standalone --nproc_per_node=2 examples/trl_sft.py [--out DIR]

The only change from a DeepSpeed run: ``ZeroEngineTrainer`` in front of ``SFTTrainer``, and the
config passed as ``zero_config=`` (not ``TrainingArguments(deepspeed=...)``). A tiny Llama and a
word-level tokenizer stand in for ``from_pretrained``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tiny import sentence, tiny_llama, tokenizer  # noqa: E402

ZERO_CONFIG = {  # a DeepSpeed config as Hugging Face's examples write it
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="the trainer's output directory (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from zero_engine.integrations.transformers import ZeroEngineTrainer

    class ZeroSFTTrainer(ZeroEngineTrainer, SFTTrainer):
        """SFTTrainer on the engine: the documented pattern."""

    generator = torch.Generator().manual_seed(0)
    data = Dataset.from_dict({"text": [sentence(generator, 10) for _ in range(8 * args.steps)]})
    out = args.out or tempfile.mkdtemp(prefix="sft_")
    trainer = ZeroSFTTrainer(
        model=tiny_llama(),
        args=SFTConfig(
            output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=3e-3,
            max_steps=args.steps, logging_steps=2, save_strategy="no", report_to=[], seed=0, use_cpu=True,
            bf16=False,  # TRL's configs default to bf16=True, on CPUs too: the config's "auto" follows this
            max_length=16, dataloader_num_workers=0, disable_tqdm=True,
        ),
        train_dataset=data,
        processing_class=tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
        zero_config=ZERO_CONFIG,
    )
    trainer.train()
    trainer.save_model(out)  # every rank calls it; rank 0 writes adapter_model.safetensors and its config
    if trainer.is_world_process_zero():
        print(f"adapters saved to {out}: {sorted(path.name for path in Path(out).glob('adapter_*'))}")
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    trainer.zero_engine.close()
    return losses[-1]


if __name__ == "__main__":
    main()
