"""Which primitive implements reduce-scatter and all-gather fastest on this backend.

    torchrun --standalone --nproc_per_node=2 scripts/bench_collectives.py

Times native collectives against the per-rank ``reduce``/``broadcast`` forms that
``zero_engine.comm`` uses on gloo, in one job, median of repeated calls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[2.5e5, 1e6, 4e6])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for size in args.sizes:
        n = int(size) // world * world
        flat = torch.randn(n)
        shards = list(flat.view(world, -1).unbind(0))
        out = torch.empty(n // world)

        def per_rank(op, key):
            works = [op(shard, **{key: r}, async_op=True) for r, shard in enumerate(shards)]
            for work in works:
                work.wait()

        candidates = {
            "all_reduce": lambda: dist.all_reduce(flat),
            "reduce_scatter (native)": lambda: _reduce_scatter(out, flat),
            "reduce_scatter (N x reduce)": lambda: per_rank(dist.reduce, "dst"),
            "all_gather (native)": lambda: _all_gather(flat, out),
            "all_gather (N x broadcast)": lambda: per_rank(dist.broadcast, "src"),
        }
        timings = {}
        for name, call in candidates.items():
            call()
            samples = []
            for _ in range(args.repeats):
                dist.barrier()
                start = time.perf_counter()
                call()
                samples.append(time.perf_counter() - start)
            timings[name] = statistics.median(samples) * 1e3
        rows.append((n, timings))
    if rank == 0:
        names = list(rows[0][1])
        print(f"{world} ranks, {dist.get_backend()}, ms per call (median of {args.repeats})")
        print("| elements | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for n, timings in rows:
            print(f"| {n:,} | " + " | ".join(f"{timings[k]:.1f}" for k in names) + " |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
