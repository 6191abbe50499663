"""int8 frozen weights on a small model, as a new user tries them (reliability review turn 6, item 5).

A 3.3M-parameter GPT-2 (vocab 16384, width 128, 6 layers) with a bf16 base under PEFT's LoRA
(r=8 on c_attn), stage 3, 2 CPU ranks, the default settings: what each rank holds of its frozen
weights with ``zero_quantized_nontrainable_weights`` against the exact base, as live tensor
storages (every storage behind a live tensor, measured apart from the engine) and as
``memory_report()["frozen_parameters"]``.

    torchrun --standalone --nproc_per_node=2 scripts/int8_small_model.py [--threshold N]

``--threshold`` sets ``stage3_param_persistence_threshold`` (DeepSpeed's default, 100,000, keeps
this model's smaller matrices whole in bf16 on every rank: they are not quantized).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zero_engine  # noqa: E402
from zero_engine.testing.process_memory import live_tensor_bytes  # noqa: E402


def lora_gpt2() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=16384, n_embd=128, n_layer=6, n_head=4, n_positions=128)
    model = GPT2LMHeadModel(config).to(torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True))


def held(int8: bool, threshold: int | None, rank: int) -> tuple[int, int, int]:
    """(live bytes the engine holds after a step, its frozen_parameters figure, the model's parameters)."""
    lora_gpt2()  # imports and kernels paged in before the baseline
    before = live_tensor_bytes()
    model = lora_gpt2()
    numel = sum(p.numel() for p in model.parameters())
    zero = {"stage": 3, "zero_quantized_nontrainable_weights": int8}
    if threshold is not None:
        zero["stage3_param_persistence_threshold"] = threshold
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "bf16": {"enabled": True}, "zero_optimization": zero}
    engine = zero_engine.initialize(model, config)
    ids = torch.randint(0, 16384, (2, 32), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    live = live_tensor_bytes() - before
    frozen = engine.memory_report()["frozen_parameters"]
    engine.close()
    return live, frozen, numel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threshold", type=int, help="stage3_param_persistence_threshold (default: DeepSpeed's)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    exact, int8 = held(False, args.threshold, rank), held(True, args.threshold, rank)
    if rank == 0:
        print(f"{exact[2] / 1e6:.2f}M parameters, {dist.get_world_size()} ranks, persistence threshold "
              f"{args.threshold if args.threshold is not None else 'default (100,000)'}; rank 0 holds:")
        print("| frozen weights | the engine's live tensor storages | memory_report frozen_parameters |")
        print("|---|---|---|")
        for name, (live, frozen, _) in (("exact bf16", exact), ("int8", int8)):
            print(f"| {name} | {live / 2**20:.2f} MiB | {frozen / 2**20:.2f} MiB |")
        print(f"| int8 / exact | {int8[0] / exact[0]:.3f}x | {int8[1] / exact[1]:.3f}x |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
