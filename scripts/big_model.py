"""Train a GPT whose full training state does not fit in the memory each rank is given: built on
the meta device, stage 3, every rank under a hard limit on its private memory.

    MALLOC_MMAP_THRESHOLD_=65536 torchrun --standalone --nproc_per_node=4 scripts/big_model.py
    MALLOC_MMAP_THRESHOLD_=65536 torchrun --standalone --nproc_per_node=2 scripts/big_model.py --budget-mib 700

The "large" GPT has ~57M parameters: fp32 parameters + gradients + Adam's two moments are
16 bytes each, 870 MiB, more than the budget (450 MiB by default). Each rank sets
``RLIMIT_DATA`` (the kernel's cap on a process's private writable address space: heap,
anonymous maps, thread stacks, reserved or touched) to its size after imports and process group
set-up plus ``--budget-mib``; any allocation past it fails. That is stricter than a cap on the
resident set, which the script reports: each rank's resident peak (``VmHWM``) above its level
before the model was built, at start-up and over training. It first proves the limit binds
(allocating the full training state fails), then builds the model on ``torch.device("meta")``,
lets `zero_engine.initialize` materialize it unit by unit, and trains. ``--build eager`` builds
the model whole first instead, for comparison. ``MALLOC_MMAP_THRESHOLD_`` makes glibc return
freed tensors to the kernel at once, so the resident figures show what is live.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zero_engine  # noqa: E402
from gpt import GPT, PRESETS, decay_groups, init_weights  # noqa: E402
from stdlib_text import TextBatches, load_corpus  # noqa: E402
from zero_engine.testing.process_memory import (  # noqa: E402
    data_bytes,
    peak_resident_bytes,
    reset_peak_resident,
    resident_bytes,
)

MiB = 2**20
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "zero3_large.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="engine config (stage 3)")
    parser.add_argument("--model", default="large", choices=sorted(PRESETS), help="GPT size preset")
    parser.add_argument("--budget-mib", type=float, default=450.0, help="per-rank limit on private memory above the start")
    parser.add_argument("--build", default="meta", choices=("meta", "eager"), help="how the model is built")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    return parser.parse_args(argv)


def limit_heap(budget: int) -> int:
    """Cap this process's private writable memory at its current size plus ``budget``."""
    limit = data_bytes() + budget
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    return limit


def full_state_fails(num_params: int) -> bool:
    """Whether allocating fp32 parameters + gradients + Adam state (16 bytes each) fails."""
    try:
        state = torch.empty(4 * num_params, dtype=torch.float32)
    except RuntimeError:
        return True
    del state
    return False


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = PRESETS[args.model]
    data = TextBatches(load_corpus(), config.context)
    with torch.device("meta"):
        num_params = sum(p.numel() for p in GPT(config).parameters())
    dist.barrier()
    limit_heap(int(args.budget_mib * MiB))
    refused = full_state_fails(num_params)

    torch.manual_seed(0)
    before = resident_bytes()
    reset_peak_resident()
    started = time.perf_counter()
    if args.build == "meta":
        with torch.device("meta"):
            model = GPT(config)
    else:
        model = GPT(config)
    engine = zero_engine.initialize(model, args.config, param_groups=decay_groups(model), param_init_fn=init_weights)
    init_s = time.perf_counter() - started
    init_peak, after_init = peak_resident_bytes() - before, resident_bytes() - before
    micro, accum = engine.batch.micro_batch_size, engine.batch.gradient_accumulation_steps

    losses, step_times = [], []
    for step in range(args.steps):
        began = time.perf_counter()
        for m in range(accum):
            loss = engine(*data.rank_batch(step, m, rank, world, micro, accum))
            engine.backward(loss)
            engine.step()
        step_times.append(time.perf_counter() - began)
        losses.append(loss.item())
    train_peak = peak_resident_bytes() - before
    engine.close()

    line = (
        f"rank {rank}: limit {args.budget_mib:.0f} MiB above start; full fp32 training state "
        f"{16 * num_params / MiB:.0f} MiB ({'refused' if refused else 'ALLOWED: the limit does not bind'}); "
        f"{args.build} build + initialize {init_s:.1f}s, peak {init_peak / MiB:.0f} MiB, after {after_init / MiB:.0f} MiB; "
        f"training peak {train_peak / MiB:.0f} MiB; step {statistics.median(step_times):.1f}s; "
        f"losses {' '.join(f'{x:.3f}' for x in losses)}"
    )
    for turn in range(world):
        if turn == rank:
            if rank == 0:
                print(f"{args.model} GPT, {num_params / 1e6:.1f}M parameters, stage {engine.stage.level}, "
                      f"{world} ranks, global batch {engine.batch.train_batch_size} x {config.context} tokens")
            print(line, flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
