"""Muon against AdamW at every stage, side by side in ONE job.

    torchrun --nproc_per_node=2 scripts/bench_muon.py --model small --steps 20

For each stage two engines train their own copy of the same GPT on the same batches (AdamW, and
Muon with AdamW on the rest: ``configs/zero2_muon.yaml``'s optimizer), their steps alternating
(in a rotating order) so that the machine's noise hits both alike; the table gives each one's
median step time (forward, backward and step) and the ratio of the medians. It also reports,
per rank, the Newton-Schulz work each did (the matrices it was given, by the replaceable
orthogonaliser, timed) and the busiest rank's share against the mean, and the bytes Muon's
exchanges sent (``comm_report``'s ``matrix_exchange``) against the Muon parameters' bytes.
Writes JSON next to a markdown table (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zero_engine  # noqa: E402
from gpt import GPT, PRESETS, decay_groups  # noqa: E402
from stdlib_text import TextBatches, load_corpus  # noqa: E402
from zero_engine.muon import takes_muon  # noqa: E402
from zero_engine.sharding.optimizer_side.compute_layout import matrix_cost  # noqa: E402

OPTIMIZERS = {
    "AdamW": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "Muon": {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
}


def build(optimizer: str, stage: int, preset: str, micro: int) -> Any:
    torch.manual_seed(0)
    model = GPT(PRESETS[preset])
    model.position.weight.use_muon = False  # a positional table is an embedding
    config = {
        "train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0, "steps_per_print": 10**9,
        "optimizer": OPTIMIZERS[optimizer], "zero_optimization": {"stage": stage},
    }
    return zero_engine.initialize(model, config, param_groups=decay_groups(model))


def timed_orthogonaliser(engine: Any, record: list[tuple[int, float]]) -> None:
    """Wrap the engine's orthogonaliser: each call's matrix cost and seconds."""
    original = engine.optimizer.orthogonaliser

    def timed(update: torch.Tensor, **options: Any) -> torch.Tensor:
        started = time.perf_counter()
        result = original(update, **options)
        record.append((matrix_cost(tuple(update.shape)), time.perf_counter() - started))
        return result

    engine.optimizer.orthogonaliser = timed


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = TextBatches(load_corpus(), PRESETS[args.model].context)
    rows = []
    for stage in args.stages:
        engines = {name: build(name, stage, args.model, args.micro) for name in OPTIMIZERS}
        work: list[tuple[int, float]] = []
        timed_orthogonaliser(engines["Muon"], work)
        times: dict[str, list[float]] = {name: [] for name in engines}
        exchanged = 0
        for step in range(args.warmup + args.steps):
            order = list(engines) if step % 2 == 0 else list(reversed(engines))
            for name in order:
                engine = engines[name]
                dist.barrier()
                started = time.perf_counter()
                engine.backward(engine(*data.rank_batch(step, 0, rank, world, args.micro, 1)))
                engine.step()
                dist.barrier()
                if step >= args.warmup:
                    times[name].append(time.perf_counter() - started)
                if name == "Muon":
                    exchanged += engine.comm_report()["matrix_exchange"]["sent"]
            if step + 1 == args.warmup:
                work.clear()
        model = GPT(PRESETS[args.model])
        muon_bytes = 4 * sum(p.numel() for n, p in model.named_parameters() if takes_muon(n, p) and "position" not in n)
        loads = [None] * world
        dist.all_gather_object(loads, [sum(c for c, _ in work), sum(s for _, s in work)])
        costs, seconds = [load[0] for load in loads], [load[1] for load in loads]
        medians = {name: statistics.median(values) for name, values in times.items()}
        rows.append({
            "stage": stage,
            "adamw_ms": 1000 * medians["AdamW"], "muon_ms": 1000 * medians["Muon"],
            "ratio": medians["Muon"] / medians["AdamW"],
            "busiest_share_cost": max(costs) / statistics.mean(costs),
            "busiest_share_seconds": max(seconds) / statistics.mean(seconds),
            "exchange_bytes_per_step_rank0": exchanged / (args.warmup + args.steps),
            "muon_param_bytes": muon_bytes,
        })
        for engine in engines.values():
            engine.close()
    dist.destroy_process_group()
    return {"model": args.model, "ranks": world, "steps": args.steps, "rows": rows} if rank == 0 else {}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"GPT `{result['model']}`, {result['ranks']} ranks (gloo, CPU), median of {result['steps']} alternating steps",
        "",
        "| stage | AdamW step ms | Muon step ms | Muon / AdamW | busiest rank's Newton-Schulz share (cost / time) "
        "| exchange bytes per step, rank 0 / Muon parameter bytes |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['stage']} | {row['adamw_ms']:.1f} | {row['muon_ms']:.1f} | {row['ratio']:.2f} | "
            f"{row['busiest_share_cost']:.2f} / {row['busiest_share_seconds']:.2f} | "
            f"{row['exchange_bytes_per_step_rank0'] / row['muon_param_bytes']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=sorted(PRESETS))
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--out", default=None, help="write the JSON here (and the table beside it, .md)")
    args = parser.parse_args()
    result = run(args)
    if result:
        table = markdown(result)
        print(table)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
            Path(args.out).with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
