"""Weight sync to an inference server (issue 55): the memory a rank needs to hand a sharded
model's full weights out, one tensor at a time, against gathering the whole model first.

A Hugging Face ``LlamaForCausalLM`` (118M parameters by default: hidden 768, 12 layers, vocab
32000) under PEFT's LoRA (r=8 on q_proj and v_proj), at stage 3 on 2 CPU ranks, fp32:

    MALLOC_MMAP_THRESHOLD_=65536 torchrun --standalone --nproc_per_node=2 scripts/bench_weight_sync.py \
        [--layers 12] [--repeats 3] [--bucket-mib 64]

Cases, alternating in one job (each repeat runs every case once, in a rotating order; a barrier
before and after each): what a GRPO / PPO loop hands vLLM (``load_weights`` takes ``(name,
tensor)`` pairs; here the consumer takes each tensor and drops it, as a sender does once the
tensor is on the wire):

- ``stream``: ``engine.named_full_parameters(bucket_bytes=...)``, every entry;
- ``stream merged``: the same with ``merge_adapters=True`` (the merged base under the base
  model's names: what vLLM loads for a LoRA policy);
- ``gather first``: ``engine.full_state_dict()`` (the whole model on every rank), then its
  entries;
- ``gather first, merged``: the whole model gathered, loaded into a PEFT model of the same shape
  and merged with ``merge_and_unload()`` (what TRL does without a streaming path).

Each rank's resident high-water growth during the case (``VmHWM`` reset before it, above the
resident set before it), the median over repeats, and the median wall time. Run with
``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the resident set at once.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import zero_engine
from zero_engine.testing.process_memory import peak_resident_bytes, reset_peak_resident, resident_bytes

MiB = 2**20


def build(layers: int) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=12,
        num_key_value_heads=12, max_position_embeddings=128, tie_word_embeddings=False,
    )
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(LlamaForCausalLM(config), lora), config


def case_stream(engine: Any, bucket: int, merge: bool, shape: Any) -> int:
    count = 0
    for _, tensor in engine.named_full_parameters(bucket_bytes=bucket, merge_adapters=merge):
        count += tensor.numel()
        del tensor
    return count


def case_gather_first(engine: Any, bucket: int, merge: bool, shape: Any) -> int:
    state = engine.full_state_dict()
    if merge:
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        with torch.device("meta"):
            model = LlamaForCausalLM(shape)
        lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
        model = get_peft_model(model, lora)
        model.load_state_dict(state, assign=True)
        del state
        state = model.merge_and_unload().state_dict()
    count = sum(tensor.numel() for tensor in state.values())
    del state
    return count


CASES = {
    "stream": (case_stream, False),
    "stream merged": (case_stream, True),
    "gather first": (case_gather_first, False),
    "gather first, merged": (case_gather_first, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=64)
    options = parser.parse_args()
    torch.set_num_threads(1)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        raise SystemExit("run with MALLOC_MMAP_THRESHOLD_=65536 (see the docstring)")
    model, shape = build(options.layers)
    engine = zero_engine.initialize(model, {
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3},
    })
    rank, world = dist.get_rank(), dist.get_world_size()
    model_bytes = sum(p.numel() * 4 for p in engine.module.parameters() if p.requires_grad) + sum(
        unit.layout.unpadded_numel * 4 for unit in engine.frozen_units
    )
    names = list(CASES)
    growth: dict[str, list[int]] = {name: [] for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(options.repeats):
        for name in names[repeat % len(names):] + names[: repeat % len(names)]:
            run, merge = CASES[name]
            gc.collect()
            dist.barrier()
            before = resident_bytes()
            reset_peak_resident()
            start = time.perf_counter()
            run(engine, options.bucket_mib * MiB, merge, shape)
            seconds[name].append(time.perf_counter() - start)
            growth[name].append(peak_resident_bytes() - before)
            gc.collect()
            dist.barrier()
    rows = [(name, statistics.median(growth[name]), statistics.median(seconds[name])) for name in names]
    everything = [None] * world
    dist.all_gather_object(everything, rows)
    if rank == 0:
        print(f"model {model_bytes / MiB:.0f} MiB (fp32), {world} ranks, stage 3, bucket {options.bucket_mib} MiB, "
              f"{options.repeats} repeats")
        print("| case | rank | peak growth (MiB) | x model | median time (s) |")
        print("|---|---|---|---|---|")
        for each_rank, rank_rows in enumerate(everything):
            for name, grown, took in rank_rows:
                print(f"| {name} | {each_rank} | {grown / MiB:.0f} | {grown / model_bytes:.2f} | {took:.2f} |")
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
