"""LoRA through PEFT on a frozen bf16 base at ZeRO stage 3, with the engine's own loop.

    torchrun --standalone --nproc_per_node=2 examples/lora_peft.py [--out DIR]

Each rank reads its own part of the data (a DistributedSampler over the ranks, as with DDP), the
engine shards the base and the adapters' optimizer state, and at the end the adapters alone are
gathered (never the base) and written in PEFT's layout, which ``PeftModel.from_pretrained``
loads. A tiny Llama built from a config stands in for ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import zero_engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tiny import tiny_llama  # noqa: E402

CONFIG = {  # what a ds_config.json would hold
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "steps_per_print": 2,  # rank 0 prints a progress line every 2 optimizer steps
}


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="where the adapters go (default: a temporary directory)")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    from peft import LoraConfig, PeftModel, get_peft_model

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(tiny_llama(torch.bfloat16), lora)
    engine = zero_engine.initialize(model, CONFIG)  # joins torchrun's process group (gloo on CPUs)
    rank, world = engine.data_parallel_rank, engine.data_parallel_world_size  # the ranks that read their own data

    starts = torch.randint(0, 60, (64, 1), generator=torch.Generator().manual_seed(0))
    data = TensorDataset((starts + torch.arange(16)) % 60 + 4)  # counting sequences: a pattern to learn
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)  # each rank its part
    loader = DataLoader(data, batch_size=CONFIG["train_micro_batch_size_per_gpu"], sampler=sampler)
    loss = torch.zeros(())
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for (ids,) in loader:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()

    # The adapters in PEFT's layout: streamed alone onto rank 0 (collective: every rank iterates).
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    adapters = {name: tensor.cpu() for name, tensor in engine.named_full_parameters(names=trained, rank0_only=True)}
    out = Path(args.out or tempfile.mkdtemp(prefix="lora_"))
    if rank == 0:
        model.save_pretrained(out, state_dict=adapters)  # adapter_model.safetensors, adapter_config.json
        reloaded = PeftModel.from_pretrained(tiny_llama(torch.bfloat16), out)
        same = all(torch.equal(param.float(), adapters[name].float())
                   for name, param in reloaded.named_parameters() if name in adapters)
        print(f"adapters saved to {out}: {len(adapters)} tensors; PeftModel.from_pretrained loads them: {same}")
    engine.close()
    return loss.item()


if __name__ == "__main__":
    main()
