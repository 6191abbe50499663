"""Export to Hugging Face's layout: time and rank 0's resident high-water mark, streamed
(``engine.save_pretrained``) against the whole model gathered first and then written
(``full_state_dict(rank0_only=True)`` and safetensors' ``save_file``: what a loop does
without ``save_pretrained``), alternating in one job on the same trained engine:

    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 \\
        scripts/bench_export.py --stages 2 3 --repeats 5

A tower of ``--depth`` blocks of two ``--width`` square linears (36 x 2 x 1024^2: 302 MB of
fp32 masters), one Block per stage 3 unit, shards of ``--max-shard-size``. Per stage: the
median seconds of each and their ratio, and rank 0's peak growth over each call (MiB) beside
the largest unit and the model. ``MALLOC_MMAP_THRESHOLD_`` makes freed tensors leave the
resident set at once, so the peaks are what each call held.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import zero_engine
from zero_engine.testing.process_memory import peak_resident_bytes, reset_peak_resident, resident_bytes

MiB = 2**20


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(x)))


class Tower(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def whole_then_write(engine, directory: Path) -> None:
    """The model gathered onto rank 0, then one file written (tied names dropped as there are none)."""
    state = engine.full_state_dict(rank0_only=True)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(state, str(directory / "model.safetensors"))
    del state
    dist.barrier()


def measure(call) -> tuple[float, int]:
    dist.barrier()
    before = resident_bytes()
    reset_peak_resident()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start, peak_resident_bytes() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=36)
    parser.add_argument("--max-shard-size", default="50MB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = []
    for stage in args.stages:
        torch.manual_seed(0)
        model = Tower(args.width, args.depth)
        model_bytes = sum(p.numel() for p in model.parameters()) * 4
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine = zero_engine.initialize(model, config)
        engine.backward(engine(torch.randn(1, args.width)).sum())
        engine.step()
        engine.full_state_dict(rank0_only=True)  # the first call after a step settles the next forward's prefetches
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(engine.comm.all_gather_json(tmp)[0])  # rank 0's directory
            times: dict[str, list[float]] = {"streamed": [], "whole": []}
            peaks: dict[str, list[int]] = {"streamed": [], "whole": []}
            for _ in range(args.repeats):  # alternating, on the same engine
                for name, call in (
                    ("streamed", lambda: engine.save_pretrained(root / "streamed", max_shard_size=args.max_shard_size)),
                    ("whole", lambda: whole_then_write(engine, root / "whole")),
                ):
                    seconds, peak = measure(call)
                    times[name].append(seconds)
                    peaks[name].append(peak)
            dist.barrier()
        unit = 2 * (args.width**2 + args.width) * 4
        median = {name: statistics.median(values) for name, values in times.items()}
        rows.append(
            f"stage {stage}: streamed {median['streamed']:.2f} s, whole-then-write {median['whole']:.2f} s "
            f"(ratio {median['streamed'] / median['whole']:.2f}); rank 0 peak growth streamed "
            f"{max(peaks['streamed']) / MiB:.1f} MiB, whole-then-write {max(peaks['whole']) / MiB:.1f} MiB "
            f"(one unit {unit / MiB:.1f} MiB, model {model_bytes / MiB:.1f} MiB)"
        )
        engine.close()
    if rank == 0:
        print("\n".join(rows))
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
