"""Stage 3 memory as the process holds it, against stage 2 and FSDP2 (the measurement of
``tests/test_stage3_memory.py``, printed as a table):

    MALLOC_MMAP_THRESHOLD_=65536 torchrun --standalone --nproc_per_node=2 scripts/stage3_memory.py

8 blocks of two 1024x1024 linears (64 MiB fp32), batch 2, SGD. Per rank, in MiB: resident
set after a step above the level before the model was built ("steady"), a step's resident
high-water mark above that level, the growth over a forward and its peak, the storage behind
the tensors autograd saved in the forward, and the engine's own figures beside them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_stage3_memory import SYSTEMS, measure  # noqa: E402

MiB = 2**20


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
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
    for turn in range(world):
        if turn == rank:
            print("\n".join(rows if rank == 0 else rows[2:]), flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
