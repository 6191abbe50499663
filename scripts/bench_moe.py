"""What serving skipped experts costs at stage 3: bytes and step time, in ONE job.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/bench_moe.py

A mixture-of-experts model (hash routing: expert = token id % experts; a block skips an expert
that gets no tokens, as Hugging Face's older Mixtral loop does) trains at stage 3 on two kinds
of batch, one engine (a copy of the same model) each, their steps alternating:

- ``balanced``: every rank routes tokens to every expert, so all ranks run the same modules;
- ``skewed``: rank r's batch has no token for expert r (mod experts), so on every rank some
  expert is skipped while another rank runs it: the rank takes part in its gathers and
  contributes zeros to its reduce-scatter.

Reports each kind's median step time, their ratio, and the bytes each rank sent per step
(``comm_report()``, all-gathers and reduce-scatters apart). Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zero_engine


class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoEBlock(nn.Module):
    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        flat = self.norm(h).reshape(-1, h.shape[-1])
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            idx = (route == index).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue  # no tokens for this expert here: skip it
            out = out.index_add(0, idx, expert(flat[idx]))
        return h + out.view_as(h)


class MoEModel(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, experts: int) -> None:
        super().__init__()
        self.experts = experts
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(MoEBlock(dim, experts) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h, route = self.embed(tokens), tokens.reshape(-1) % self.experts
        for block in self.blocks:
            h = block(h, route)
        return F.cross_entropy(self.head(h).reshape(-1, self.head.out_features), targets.reshape(-1))


def batch(kind: str, step: int, rank: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=generator)
    targets = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=generator)
    if kind == "skewed":  # no token for expert ``rank % experts`` on this rank
        idle = rank % args.experts
        tokens = torch.where(tokens % args.experts == idle, (tokens + 1) % args.vocab, tokens)
    return tokens, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dim", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="bench_moe.json")
    args = parser.parse_args()

    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_wrap_modules": ["Expert", "MoEBlock"]},
    }
    engines = {}
    for kind in ("balanced", "skewed"):  # each its own engine: its prefetch follows its own routing
        torch.manual_seed(0)
        engines[kind] = zero_engine.initialize(MoEModel(args.vocab, args.dim, args.layers, args.experts), config)
    rank = engines["balanced"].comm.rank
    times: dict[str, list[float]] = {"balanced": [], "skewed": []}
    sent: dict[str, dict[str, int]] = {}
    for step in range(args.warmup + args.steps):
        for kind in ("balanced", "skewed") if step % 2 else ("skewed", "balanced"):
            engine = engines[kind]
            tokens, targets = batch(kind, step, rank, args)
            dist.barrier()
            started = time.perf_counter()
            engine.backward(engine(tokens, targets))
            engine.step()
            elapsed = time.perf_counter() - started
            if step >= args.warmup:
                times[kind].append(elapsed)
                report = engine.comm_report()
                sent[kind] = {key: report[key]["sent"] for key in ("all_gather", "reduce_scatter", "total")}
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    result = {
        "args": vars(args),
        "world_size": engines["balanced"].comm.world_size,
        "median_step_s": medians,
        "skewed_over_balanced": medians["skewed"] / medians["balanced"],
        "bytes_sent_per_step": sent,
    }
    if rank == 0:
        print(json.dumps(result, indent=2))
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=2)
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
