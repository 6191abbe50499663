"""What one rank allocates in a training step as the sequence is split over k = 1, 2 and 4 ranks.

    torchrun --nproc_per_node=4 scripts/sequence_memory.py --lengths 2048 8192

A small Hugging Face Llama (needs ``transformers``: the ``hf`` extra), stage 0, one sequence a
micro-batch, the same global sequence at every k; at each k the world is k-rank sequence groups
(4/k of them). The figure is the most bytes torch's CPU allocator held at once during a
forward and backward, after two warm-up steps (the profiler's memory records, the model states
allocated before: `zero_engine.testing.process_memory.step_allocations`), on each rank, and its
ratio to k = 1. Prints a markdown table on rank 0.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import zero_engine
from zero_engine.testing.process_memory import step_allocations


def llama(hidden: int, layers: int, heads: int, vocab: int, length: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        intermediate_size=4 * hidden, vocab_size=vocab, max_position_embeddings=length,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for length in args.lengths:
        ids = torch.randint(0, args.vocab, (1, length), generator=torch.Generator().manual_seed(0))
        peaks = {}
        for k in (1, 2, 4):
            if world % k:
                continue
            config = {
                "train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": k, "steps_per_print": 10**9,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0},
            }
            engine = zero_engine.initialize(llama(args.hidden, args.layers, args.heads, args.vocab, length), config)
            mine = torch.tensor([step_allocations(engine, ids)[1]], dtype=torch.int64)
            engine.close()
            every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(every, mine)
            peaks[k] = [int(t.item()) for t in every]
        rows.append((length, peaks))
    if rank == 0:
        print(f"Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocabulary {args.vocab}, "
              f"stage 0, {world} ranks (gloo, CPU); the most MB one rank's allocator held in a forward and backward")
        print()
        print("| global tokens | k = 1 | k = 2 (max over ranks) | ratio | k = 4 (max over ranks) | ratio |")
        print("|---|---|---|---|---|---|")
        for length, peaks in rows:
            base = max(peaks[1])
            cells = [f"{base / 1e6:.2f}"]
            for k in (2, 4):
                if k in peaks:
                    cells += [f"{max(peaks[k]) / 1e6:.2f}", f"{max(peaks[k]) / base:.2f}"]
            print(f"| {length} | " + " | ".join(cells) + " |")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
