"""What one rank allocates in a training step as the sequence is split over k = 1, 2 and 4 ranks,
and the longest sequence that fits a fixed budget against k and against tiling.

    torchrun --nproc_per_node=4 scripts/sequence_memory.py --lengths 2048 8192
    torchrun --nproc_per_node=4 scripts/sequence_memory.py --resident --hidden 256 --layers 4 --vocab 2048 \
        --lengths 2048
    torchrun --nproc_per_node=4 scripts/sequence_memory.py --budget-mb 64 --svg docs/figures/longest_sequence.svg

A small Hugging Face Llama (needs ``transformers``: the ``hf`` extra), stage 0, one sequence a
micro-batch, the same global sequence at every k; at each k the world is k-rank sequence groups
(4/k of them). The figure is the most bytes torch's CPU allocator held at once during a
forward and backward, after two warm-up steps (the profiler's memory records, the model states
allocated before: `zero_engine.testing.process_memory.step_allocations`), on each rank, and its
ratio to k = 1. Prints a markdown table on rank 0. With ``--resident``, the figure is instead
the growth of the process's resident high-water mark over a training step (forward, backward,
optimizer step; after two warm-up steps, the least of three), as the process holds it, every
large allocation its own mapping (`zero_engine.testing.process_memory.map_large_allocations`) so
that what is freed leaves the resident set.

With ``--budget-mb B`` it finds instead, for k = 1, 2, 4, untiled and with the loss and the MLPs
in tiles (``tiled_loss_tokens``, ``tiled_mlp_tokens``), all with ``recompute_units``, the
longest global sequence (a multiple of ``--grain`` tokens) whose step the busiest rank runs
within B MB: two measured lengths give the line the peak follows, and measured steps around
its crossing settle the answer (it fits; ``--grain`` more does not). ``--svg`` draws it.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import zero_engine
from zero_engine.testing.process_memory import map_large_allocations, step_allocations, step_resident_growth


def llama(hidden: int, layers: int, heads: int, vocab: int, length: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        intermediate_size=4 * hidden, vocab_size=vocab, max_position_embeddings=length,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--budget-mb", type=float, default=None, help="find the longest sequence within this")
    parser.add_argument("--grain", type=int, default=256, help="tokens between the lengths tried")
    parser.add_argument("--tiles", type=int, default=256, help="tokens per tile when tiled")
    parser.add_argument("--svg", default=None, help="draw the longest sequences here")
    parser.add_argument("--resident", action="store_true", help="resident high-water growth, not allocator peaks")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.resident:
        map_large_allocations(65536)
    dist.init_process_group("gloo")
    if args.budget_mb is not None:
        longest_within_budget(args)
        dist.destroy_process_group()
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for length in args.lengths:
        ids = torch.randint(0, args.vocab, (1, length), generator=torch.Generator().manual_seed(0))
        peaks = {}
        for k in (1, 2, 4):
            if world % k:
                continue
            config = {
                "train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": k, "steps_per_print": 10**9,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0},
            }
            engine = zero_engine.initialize(llama(args.hidden, args.layers, args.heads, args.vocab, length), config)
            measure = step_resident_growth if args.resident else lambda e, i: step_allocations(e, i)[1]
            mine = torch.tensor([measure(engine, ids)], dtype=torch.int64)
            engine.close()
            every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(every, mine)
            peaks[k] = [int(t.item()) for t in every]
        rows.append((length, peaks))
    if rank == 0:
        what = ("the resident high-water growth of one rank over a training step, MB" if args.resident else
                "the most MB one rank's allocator held in a forward and backward")
        print(f"Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocabulary {args.vocab}, "
              f"stage 0, {world} ranks (gloo, CPU); {what}")
        print()
        print("| global tokens | k = 1 | k = 2 (max over ranks) | ratio | k = 4 (max over ranks) | ratio |")
        print("|---|---|---|---|---|---|")
        for length, peaks in rows:
            base = max(peaks[1])
            cells = [f"{base / 1e6:.2f}"]
            for k in (2, 4):
                if k in peaks:
                    cells += [f"{max(peaks[k]) / 1e6:.2f}", f"{max(peaks[k]) / base:.2f}"]
            print(f"| {length} | " + " | ".join(cells) + " |")
    dist.destroy_process_group()


def busiest_peak(args: argparse.Namespace, length: int, k: int, tiles: int) -> int:
    """The most bytes the busiest rank's allocator held in a step at ``length`` global tokens."""
    config = {
        "train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": k, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 0, "recompute_units": True},
        "tiled_loss_tokens": tiles, "tiled_mlp_tokens": tiles,
    }
    ids = torch.randint(0, args.vocab, (1, length), generator=torch.Generator().manual_seed(0))
    engine = zero_engine.initialize(llama(args.hidden, args.layers, args.heads, args.vocab, length), config)
    peak = torch.tensor([step_allocations(engine, ids)[1]], dtype=torch.int64)
    engine.close()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def longest(args: argparse.Namespace, k: int, tiles: int, budget: int) -> tuple[int, int]:
    """The longest multiple of ``--grain`` tokens whose busiest rank's step stays within
    ``budget`` bytes, and that step's peak."""
    grain = args.grain
    low, high = 4 * grain, 8 * grain
    low_peak, high_peak = busiest_peak(args, low, k, tiles), busiest_peak(args, high, k, tiles)
    per_token = (high_peak - low_peak) / (high - low)
    guess = max(grain, int((low + (budget - low_peak) / per_token) // grain * grain))
    fits, fits_peak = 0, 0
    while True:  # from the line's guess, one grain at a time to the edge, measured
        peak = busiest_peak(args, guess, k, tiles)
        if peak <= budget:
            fits, fits_peak = guess, peak
            guess += grain
        elif fits or guess == grain:
            return fits, fits_peak
        else:
            guess -= grain


def longest_within_budget(args: argparse.Namespace) -> None:
    budget = int(args.budget_mb * 1e6)
    world = dist.get_world_size()
    found = {}
    for tiles in (0, args.tiles):
        for k in (1, 2, 4):
            if world % k == 0:
                found[tiles, k] = longest(args, k, tiles, budget)
    if dist.get_rank() != 0:
        return
    print(f"Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocabulary {args.vocab}, stage 0, "
          f"recompute_units, {world} ranks (gloo, CPU); the longest global sequence (a multiple of {args.grain}) "
          f"whose step's busiest rank allocates at most {args.budget_mb:g} MB")
    print()
    print("| k | untiled: tokens | / k = 1's | tiled: tokens | / k = 1's | tiled / untiled |")
    print("|---|---|---|---|---|---|")
    for k in (1, 2, 4):
        if (0, k) not in found:
            continue
        plain, tiled = found[0, k][0], found[args.tiles, k][0]
        print(f"| {k} | {plain} | {plain / found[0, 1][0]:.2f} | {tiled} | {tiled / found[args.tiles, 1][0]:.2f} "
              f"| {tiled / plain:.2f} |")
    if args.svg:
        draw(args, found)


def draw(args: argparse.Namespace, found: dict[tuple[int, int], tuple[int, int]]) -> None:
    """Tokens that fit against k, a line per tiling, as an SVG of a few elements."""
    ks = sorted({k for _, k in found})
    top = max(tokens for tokens, _ in found.values()) * 1.1
    width, height, left, bottom = 480, 300, 70, 40

    def x(k: int) -> float:
        return left + (width - left - 20) * ks.index(k) / max(1, len(ks) - 1)

    def y(tokens: float) -> float:
        return height - bottom - (height - bottom - 20) * tokens / top

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             'font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<line x1="{left}" y1="{y(0)}" x2="{width - 20}" y2="{y(0)}" stroke="black"/>',
             f'<line x1="{left}" y1="{y(0)}" x2="{left}" y2="20" stroke="black"/>']
    for k in ks:
        parts.append(f'<text x="{x(k)}" y="{y(0) + 16}" text-anchor="middle">k = {k}</text>')
    step = 10 ** (len(str(int(top))) - 1)
    while top / step < 4:  # four ticks at least
        step //= 2
    for tick in range(0, int(top), max(step, 1)):
        parts.append(f'<text x="{left - 6}" y="{y(tick) + 4}" text-anchor="end">{tick}</text>')
        parts.append(f'<line x1="{left}" y1="{y(tick)}" x2="{width - 20}" y2="{y(tick)}" stroke="#ddd"/>')
    for tiles, colour, name in ((0, "#d62728", "untiled"), (args.tiles, "#1f77b4", f"tiles of {args.tiles}")):
        points = " ".join(f"{x(k)},{y(found[tiles, k][0])}" for k in ks)
        parts.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for k in ks:
            parts.append(f'<circle cx="{x(k)}" cy="{y(found[tiles, k][0])}" r="3" fill="{colour}"/>')
        parts.append(f'<text x="{x(ks[-1]) - 4}" y="{y(found[tiles, ks[-1]][0]) - 8}" text-anchor="end" '
                     f'fill="{colour}">{name}</text>')
    parts.append(f'<text x="{left}" y="14">global tokens that fit {args.budget_mb:g} MB a rank</text></svg>')
    with open(args.svg, "w") as out:
        out.write("\n".join(parts) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
