"""The main job: a small byte-level GPT trained on the standard library's source with the engine.

    torchrun --nproc_per_node=2 scripts/train.py --config configs/zero1.yaml

On two nodes, sharding inside each node and replicating across them (run once per node):

    torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        scripts/train.py --config configs/zero3_hybrid.yaml

Every ``steps_per_print`` optimizer steps the engine prints its progress line (loss, learning
rate, gradient norm, tokens/s) and this script the stage's per-rank memory; it ends with the
held-out loss against the unigram baseline. Also runs as a plain ``python``
process (world size 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zero_engine  # noqa: E402
from gpt import GPT, PRESETS, decay_groups  # noqa: E402
from stdlib_text import TextBatches, load_corpus  # noqa: E402
from zero_engine.devices import local_cuda_device  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "zero1.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="engine config (.yaml/.json)")
    parser.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="GPT size preset")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps at most")
    parser.add_argument("--time-budget", type=float, default=90.0,
                        help="stop training after this many seconds of wall time (0: no limit, --steps alone)")
    parser.add_argument("--eval-batches", type=int, default=8, help="held-out batches for the final loss")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--force-collectives", action="store_true",
        help="issue every collective at world size 1 too (comm.force_collectives: a first run on one GPU exercises NCCL)",
    )
    return parser.parse_args(argv)


def training_device() -> torch.device:
    """This rank's GPU (torchrun's LOCAL_RANK) when there is one, else the CPU."""
    return local_cuda_device() if torch.cuda.is_available() else torch.device("cpu")


def to_device(batch: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(tensor.to(device, non_blocking=True) for tensor in batch)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    torch.manual_seed(args.seed)
    device = training_device()
    model = GPT(PRESETS[args.model]).to(device)
    num_params = sum(p.numel() for p in model.parameters())  # before stage 3 shards them
    config = zero_engine.load_config(args.config)
    if args.force_collectives:
        config = config.model_copy(update={"comm": config.comm.model_copy(update={"force_collectives": True})})
    if config.optimizer.type.lower() == "muon":
        model.position.weight.use_muon = False  # a positional table is an embedding, whatever its name says
    engine = zero_engine.initialize(model, config, param_groups=decay_groups(model))
    rank, world = engine.comm.rank, engine.comm.world_size
    micro, accum = engine.batch.micro_batch_size, engine.batch.gradient_accumulation_steps
    data = TextBatches(load_corpus(), model.config.context)
    log = print if rank == 0 else (lambda *a, **k: None)
    if engine.comm.num_replicas > 1:  # hybrid sharding: every rank says which ranks it shards and replicates with
        line = (f"rank {rank} on node {os.environ.get('GROUP_RANK', '0')}: shard group {engine.comm.shard_group_ranks}, "
                f"replica group {engine.comm.replica_group_ranks}\n")
        sys.stdout.write(line)  # one write, newline included: the ranks share the launcher's stdout
        sys.stdout.flush()
    forced = ", collectives forced" if world == 1 and not engine.comm.world.skips_collectives else ""
    log(f"zero_engine stage {engine.stage.level} on {world} rank(s) ({engine.comm.backend}{forced}); "
        f"{num_params / 1e6:.2f}M parameters; global batch "
        f"{engine.batch.train_batch_size} x {model.config.context} tokens; unigram baseline "
        f"{data.unigram_loss():.3f} nats")

    started = time.perf_counter()
    step = 0
    while step < args.steps and (args.time_budget <= 0 or time.perf_counter() - started < args.time_budget):
        for m in range(accum):
            loss = engine(*to_device(data.rank_batch(step, m, rank, world, micro, accum), device))
            engine.backward(loss)
            engine.step()
        step += 1
        if step % engine.config.steps_per_print == 0:  # after the engine's own line (loss, lr, norm, tokens/s)
            memory = engine.memory_report()
            log(f"step {step:4d}  rank-0 MB: params {memory['parameters'] / 2**20:.1f}  "
                f"grads {memory['gradients'] / 2**20:.1f}  optimizer {memory['optimizer_states'] / 2**20:.1f}")

    sent = engine.comm_report()["total"]["sent"]  # the last optimizer step's
    engine.eval()
    with torch.no_grad():
        held_out = statistics.mean(
            engine(*to_device(data.rank_batch(10_000 + i, 0, rank, world, micro, 1), device)).item()
            for i in range(args.eval_batches)
        )
    engine.train()
    baseline = data.unigram_loss()
    log(f"done: {step} steps in {time.perf_counter() - started:.0f}s; held-out loss {held_out:.3f} nats "
        f"(unigram baseline {baseline:.3f}, {verdict(held_out, baseline, step, args)}); "
        f"rank 0 sent {sent / 2**20:.2f} MiB in the last step")
    engine.close()
    return {"steps": step, "held_out_loss": held_out, "baseline": baseline}


LEARNED_BY = 0.5  # nats below the unigram baseline: the model has learned more than byte frequencies


def verdict(held_out: float, baseline: float, steps: int, args: argparse.Namespace) -> str:
    """Whether the run learned, and the bar it was held to; when it did not, why it may not have."""
    if held_out < baseline - LEARNED_BY:
        return f"learned: more than {LEARNED_BY} nats below it"
    why = (f"{steps} steps fit the --time-budget of {args.time_budget:g} s of wall time (a loaded machine fits "
           "fewer: give it more, or --time-budget 0 --steps N for a number of steps)"
           if steps < args.steps else f"all {steps} --steps ran")
    return f"not yet {LEARNED_BY} nats below it, the bar for learned: {why}"


if __name__ == "__main__":
    main()
