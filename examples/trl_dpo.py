"""TRL's DPOTrainer with LoRA on the engine at ZeRO stage 3: the reference is the policy with its
adapters disabled (what TRL does when ``ref_model`` is None), so no second model is held.

    torchrun --standalone --nproc_per_node=2 examples/trl_dpo.py [--out DIR]

As in ``trl_sft.py``: ``ZeroEngineTrainer`` in front of ``DPOTrainer`` and the DeepSpeed-style
config as ``zero_config=``. A tiny Llama and a word-level tokenizer stand in for ``from_pretrained``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tiny import sentence, tiny_llama, tokenizer  # noqa: E402
from trl_sft import ZERO_CONFIG  # noqa: E402  the same DeepSpeed-style config


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="the trainer's output directory (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    from datasets import Dataset
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    from zero_engine.integrations.transformers import ZeroEngineTrainer

    class ZeroDPOTrainer(ZeroEngineTrainer, DPOTrainer):
        """DPOTrainer on the engine: the documented pattern."""

    generator = torch.Generator().manual_seed(0)
    rows = 8 * args.steps
    data = Dataset.from_dict({
        "prompt": [sentence(generator, 4) for _ in range(rows)],
        "chosen": [sentence(generator, 5) for _ in range(rows)],
        "rejected": [sentence(generator, 5) for _ in range(rows)],
    })
    out = args.out or tempfile.mkdtemp(prefix="dpo_")
    trainer = ZeroDPOTrainer(
        model=tiny_llama(),
        args=DPOConfig(
            output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=3e-3,
            max_steps=args.steps, logging_steps=2, save_strategy="no", report_to=[], seed=0, use_cpu=True,
            bf16=False, dataloader_num_workers=0, disable_tqdm=True,
        ),
        train_dataset=data,
        processing_class=tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
        zero_config=ZERO_CONFIG,
    )
    trainer.train()
    trainer.save_model(out)
    if trainer.is_world_process_zero():
        print(f"adapters saved to {out}: {sorted(path.name for path in Path(out).glob('adapter_*'))}")
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    trainer.zero_engine.close()
    return losses[-1]


if __name__ == "__main__":
    main()
