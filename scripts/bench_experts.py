"""Expert parallelism against plain stage 3 on a Hugging Face MoE, in ONE job.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/bench_experts.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 scripts/bench_experts.py

A Qwen3-MoE built from its config (16 experts, top-2, fused experts, eager attention) trains
under each system, one engine (a copy of the same model) each, their steps alternating on the
same batches:

- ``stage3``: today's stage 3 (``expert_parallel_size: 1``): every expert sharded over every
  rank, each gathered whole on every rank at every use;
- ``ep_stage3``: stage 3 with ``expert_parallel_size`` = the world: each rank owns its experts
  (dense parameters sharded over every rank, as before), tokens exchanged by all-to-all;
- ``ep_stage0``: the same owners at stage 0 (dense parameters whole).

Reports per system: the median step time and its ratio to ``stage3``'s; what the engine holds
(the live tensor storages of the process, from before the model was built to after initialize
and a first step, the model's own tensors freed where the engine shards them, the optimizer's
state made); each step's resident high-water
over the resident set before it (its median: gathered parameters, activations, exchange
buffers; from ``/proc``, large allocations mapped apart so that frees show); the bytes sent per
step by kind (``comm_report``: all-gathers, reduce-scatters, all-to-alls). JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
import torch.distributed as dist

import zero_engine
from zero_engine.testing.process_memory import (
    map_large_allocations, peak_resident_bytes, reset_peak_resident, resident_bytes,
)

SYSTEMS = {"stage3": (3, False), "ep_stage3": (3, True), "ep_stage0": (0, True)}


def model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
        moe_intermediate_size=args.expert_hidden, num_experts=args.experts, num_experts_per_tok=2,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=args.seq, attn_implementation="eager",
        experts_implementation="eager",
    )
    built = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in built.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0.0, 0.5)  # a router that spreads tokens (Qwen3-MoE's starts at zero)
    return built


def live_storage_bytes() -> int:
    """The bytes of every tensor storage alive in this process (each storage once, views and
    parameters aliasing a flat buffer included in it)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--expert-hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each system")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="bench_experts.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    map_large_allocations(1 << 20)
    engines, held = {}, {}
    first = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=torch.Generator().manual_seed(7))
    for name, (stage, owned) in SYSTEMS.items():
        world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
        config = {
            "train_micro_batch_size_per_gpu": args.micro_batch, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10**6,
            "zero_optimization": {"stage": stage}, "expert_parallel_size": world if owned else 1,
        }
        before = live_storage_bytes()  # before the model is built: what the engine keeps of it counts
        built = model(args)
        engines[name] = engine = zero_engine.initialize(built, config)
        del built
        engine.backward(engine(input_ids=first, labels=first).loss)  # the optimizer's state exists from here
        engine.step()
        held[name] = live_storage_bytes() - before
    rank = dist.get_rank()
    times: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    peaks: dict[str, list[int]] = {name: [] for name in SYSTEMS}
    sent: dict[str, dict[str, int]] = {}
    order = list(SYSTEMS)
    for step in range(args.warmup + args.steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=generator)
        for name in order[step % len(order):] + order[: step % len(order)]:  # each system first in turn
            engine = engines[name]
            gc.collect()
            dist.barrier()
            before = resident_bytes()
            reset_peak_resident()
            started = time.perf_counter()
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
            elapsed = time.perf_counter() - started
            peak = peak_resident_bytes() - before
            if step >= args.warmup:
                times[name].append(elapsed)
                peaks[name].append(peak)
                report = engine.comm_report()
                sent[name] = {key: report[key]["sent"] for key in ("all_gather", "reduce_scatter", "all_to_all", "total")}
    medians = {name: statistics.median(values) for name, values in times.items()}
    expert_bytes = 4 * sum(p.numel() for n, p in model(args).named_parameters() if "experts" in n)
    result = {
        "args": vars(args),
        "world_size": dist.get_world_size(),
        "all_experts_mib": expert_bytes / 2**20,
        "median_step_s": medians,
        "step_over_stage3": {name: medians[name] / medians["stage3"] for name in SYSTEMS},
        "held_after_first_step_mib": {name: held[name] / 2**20 for name in SYSTEMS},
        "median_step_peak_over_resident_mib": {name: statistics.median(peaks[name]) / 2**20 for name in SYSTEMS},
        "bytes_sent_per_step": sent,
    }
    gathered = torch.tensor([held[name] for name in SYSTEMS], dtype=torch.float64)
    dist.all_reduce(gathered, op=dist.ReduceOp.MAX)
    result["held_after_first_step_max_over_ranks_mib"] = {
        name: float(value) / 2**20 for name, value in zip(SYSTEMS, gathered)
    }
    if rank == 0:
        print(json.dumps(result, indent=2))
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=2)
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
