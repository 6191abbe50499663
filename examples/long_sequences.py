"""Ulysses sequence parallelism at ZeRO stage 3, with the engine's own loop: each sequence split
over 2 ranks by config alone.

    torchrun --standalone --nproc_per_node=2 examples/long_sequences.py [--out DIR]

The checkpoint goes to ``--out`` (default: ``zero_engine_long_sequences`` in the system's temporary
directory, one path for every rank: a checkpoint is written by every rank into one directory).

``sequence_parallel_size: 2`` makes the 2 ranks one sequence group: both read the same
micro-batches (the sampler is given the engine's data-parallel rank and size, here 0 of 1), the
engine hands each rank half of every sequence and exchanges the attention's heads between them,
and the loss each rank gets back is the whole micro-batch's. A tiny Llama built from a config
stands in for ``AutoModelForCausalLM.from_pretrained``; a 2-layer model keeps it quick on CPUs.
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
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
    "sequence_parallel_size": 2,  # the world size must be a multiple of it
    "zero_optimization": {"stage": 3, "recompute_units": True},
    "steps_per_print": 2,
}
SEQUENCE = 48  # tokens per sample: 24 on each rank


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "zero_engine_long_sequences"),
                        help="where the checkpoint goes, the same directory on every rank")
    args = parser.parse_args(argv)
    engine = zero_engine.initialize(tiny_llama(), CONFIG)
    tokens = torch.randint(4, 64, (32, SEQUENCE), generator=torch.Generator().manual_seed(0))
    # The ranks of a sequence group read the same samples: the sampler counts data-parallel ranks.
    sampler = DistributedSampler(
        TensorDataset(tokens), num_replicas=engine.data_parallel_world_size, rank=engine.data_parallel_rank,
        shuffle=True, seed=0,
    )
    loader = DataLoader(TensorDataset(tokens), batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler)
    loss = torch.tensor(float("nan"))
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for (ids,) in loader:
            loss = engine(input_ids=ids, labels=ids).loss  # the micro-batch's loss, on every rank of the group
            engine.backward(loss)
            engine.step()
    engine.save_checkpoint(args.out)
    engine.close()
    if engine.comm.rank == 0:
        print(f"loss {loss.item():.4f}; checkpoint in {args.out}")
    return loss.item()


if __name__ == "__main__":
    main()
