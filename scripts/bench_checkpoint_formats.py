"""Checkpoint save and load, this engine's format against DCP's (torchtitan's layout): seconds
and each rank's resident high-water growth over each call, alternating in one job on the same
trained engine:

    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 \\
        scripts/bench_checkpoint_formats.py --stages 1 3 --repeats 5

A tower of ``--depth`` blocks of two ``--width`` square linears (24 x 2 x 1024^2: 201 MB of
fp32 masters, 604 MB with AdamW's moments), one Block per stage 3 unit. Per stage: the median
seconds of each and their ratio, and the largest peak growth on any rank (MiB) beside this
rank's share of the checkpoint.
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
from torch import nn

import zero_engine
from bench_export import Block  # the same tower's block (scripts/ is on the path of a script run from it)
from zero_engine.testing.process_memory import peak_resident_bytes, reset_peak_resident, resident_bytes

MiB = 2**20


def tower(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width) for _ in range(depth)))


def measure(call) -> tuple[float, int]:
    dist.barrier()
    before = resident_bytes()
    reset_peak_resident()
    start = time.perf_counter()
    call()
    dist.barrier()
    seconds, growth = time.perf_counter() - start, peak_resident_bytes() - before
    return seconds, max(dist_all(growth))


def dist_all(value: int) -> list[int]:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for stage in args.stages:
        model = tower(args.width, args.depth)
        state_bytes = sum(p.numel() for p in model.parameters()) * 12  # fp32 masters and two moments
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine = zero_engine.initialize(model, config)
        engine.backward(engine(torch.randn(1, args.width)).sum())
        engine.step()
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(engine.comm.all_gather_json(tmp)[0])  # rank 0's directory
            calls = {
                "save own": lambda: engine.save_checkpoint(root, tag="own"),
                "save dcp": lambda: engine.save_checkpoint(root, tag="dcp", format="dcp"),
                "load own": lambda: engine.load_checkpoint(root, tag="own"),
                "load dcp": lambda: engine.load_checkpoint(root, tag="dcp"),
            }
            times: dict[str, list[float]] = {name: [] for name in calls}
            peaks: dict[str, list[int]] = {name: [] for name in calls}
            for _ in range(args.repeats):  # alternating, on the same engine
                for name, call in calls.items():
                    seconds, peak = measure(call)
                    times[name].append(seconds)
                    peaks[name].append(peak)
        median = {name: statistics.median(values) for name, values in times.items()}
        line = [f"stage {stage}, {world} ranks (a rank's share of the checkpoint {state_bytes / world / MiB:.0f} MiB):"]
        for verb in ("save", "load"):
            own, dcp = median[f"{verb} own"], median[f"{verb} dcp"]
            line.append(
                f"  {verb}: own {own:.2f} s, dcp {dcp:.2f} s (dcp/own {dcp / own:.2f}); peak growth own "
                f"{max(peaks[f'{verb} own']) / MiB:.0f} MiB, dcp {max(peaks[f'{verb} dcp']) / MiB:.0f} MiB"
            )
        rows.append("\n".join(line))
        engine.close()
    if rank == 0:
        print("\n".join(rows))
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
