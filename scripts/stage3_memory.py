"""Stage 3 memory as the process holds it, against stage 2 and FSDP2 (the measurement of
``tests/test_stage3_memory.py``, printed as a table):

    MALLOC_MMAP_THRESHOLD_=65536 torchrun --standalone --nproc_per_node=2 scripts/stage3_memory.py

8 blocks of two 1024x1024 linears (64 MiB fp32), batch 2, SGD. Per rank, in MiB: resident
set after a step above the level before the model was built ("steady"), a step's resident
high-water mark above that level, the growth over a forward and its peak, the storage behind
the tensors autograd saved in the forward, and the engine's own figures beside them.

    MALLOC_MMAP_THRESHOLD_=65536 torchrun --standalone --nproc_per_node=4 scripts/stage3_memory.py --start-up

Start-up instead: the resident peak and level from before the model is built to after
`initialize` returns, for a meta build, a meta build reading a safetensors file, an eager
build, and FSDP2's meta recipe (``fully_shard``, ``to_empty``, ``reset_parameters``).

    MALLOC_MMAP_THRESHOLD_=65536 torchrun --standalone --nproc_per_node=2 scripts/stage3_memory.py --low-precision

Stages 0 and 1 in bf16 (one Block per unit): the resident peaks of the backward and of the
optimizer step against the fp32 gradient copies the engine reports.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_stage3_memory import (  # noqa: E402
    SYSTEMS,
    measure,
    measure_low_precision_full_gradients,
    measure_start_up,
)
from tower import Tower  # noqa: E402

MiB = 2**20


def start_up_rows(rank: int, world: int) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(1)
        save_file(Tower().state_dict(), f"{tmp}/tower.safetensors")
        save_file(Tower(2).state_dict(), f"{tmp}/small.safetensors")
        results = measure_start_up(rank, world, f"{tmp}/tower.safetensors", f"{tmp}/small.safetensors")
    rows = ["| rank | start-up | peak | after |", "|---|---|---|---|"]
    rows += [f"| {rank} | {name} | {r['peak'] / MiB:.1f} | {r['after'] / MiB:.1f} |" for name, r in results.items()]
    return rows


def low_precision_rows(rank: int, world: int) -> list[str]:
    results = measure_low_precision_full_gradients(rank, world)
    rows = [
        "| rank | stage | backward peak | report: reduction copies | step peak | report: step copies |",
        "|---|---|---|---|---|---|",
    ]
    for stage, r in results.items():
        report = r["report"]
        copies = report["peak_gradients"] - report["gradients"]
        rows.append(
            f"| {rank} | {stage} bf16 | {r['backward_peak'] / MiB:.1f} | {copies / MiB:.1f} "
            f"| {r['optimizer_peak'] / MiB:.1f} | {report['peak_step_gradients'] / MiB:.1f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--start-up", action="store_true", help="measure building and initializing instead")
    parser.add_argument("--low-precision", action="store_true", help="measure stages 0-1 in bf16 instead")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.start_up or args.low_precision:
        rows = start_up_rows(rank, world) if args.start_up else low_precision_rows(rank, world)
        _print_in_rank_order(rows, rank, world)
        dist.destroy_process_group()
        return
    results = measure(rank, world, list(SYSTEMS))
    rows = [
        "| rank | system | steady | step high-water | forward growth | forward peak | saved after forward "
        "| report: persistent | report: gathered fwd/bwd |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        report = r["report"]
        keys = ("parameters", "gradients", "optimizer_states", "master_parameters", "buffers")
        persistent = f"{sum(report[k] for k in keys) / MiB:.1f}" if report else "n/a"
        gathered = (
            f"{report['peak_gathered_forward'] / MiB:.1f} / {report['peak_gathered_backward'] / MiB:.1f}"
            if report else "n/a"
        )
        rows.append(
            f"| {rank} | {name} | {r['steady'] / MiB:.1f} | {(r['steady'] + r['step_peak']) / MiB:.1f} "
            f"| {r['forward_growth'] / MiB:.1f} | {r['forward_peak'] / MiB:.1f} | {r['saved_after_forward'] / MiB:.1f} "
            f"| {persistent} | {gathered} |"
        )
    _print_in_rank_order(rows, rank, world)
    dist.destroy_process_group()


def _print_in_rank_order(rows: list[str], rank: int, world: int) -> None:
    """One table: rank 0 prints the header, every rank its rows, in turn."""
    for turn in range(world):
        if turn == rank:
            print("\n".join(rows if rank == 0 else rows[2:]), flush=True)
        dist.barrier()


if __name__ == "__main__":
    main()
