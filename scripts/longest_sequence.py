"""The longest sequence one device trains, plain against tiled (issue 67's figure on a GPU).

    python scripts/longest_sequence.py --device cuda                 # a 0.2B Llama from config, 16 GiB
    python scripts/longest_sequence.py --device cuda --hidden 2048 --layers 16 --intermediate 8192 --budget-gib 0
    python scripts/longest_sequence.py --device cpu --hidden 64 --layers 2 --heads 4 --kv-heads 2 \\
        --intermediate 0 --vocab 512 --start 128 --max-tokens 512 --grain 64 --tiles 64   # the plumbing

A Llama built from ``LlamaConfig`` on the device (bf16, no weights read), one process (k = 1,
stage 3, AdamW, clipping at 1), one sequence a micro-batch, every unit recomputed in its backward
(``recompute_units``); *plain* computes the MLPs and the loss whole, *tiled* in tiles of
``--tiles`` tokens (``tiled_mlp_tokens``, ``tiled_loss_tokens``). The budget is ``--budget-gib``
of the device's memory (the caching allocator held to it by its memory fraction: a search of
the whole of an H200 at quadratic attention cost would not fit the device time) or all of it.

For each, a training step (forward, backward, step) at ``--start`` tokens and twice that gives
the line the peak (``torch.cuda.max_memory_allocated``) follows, linear in the tokens with flash
attention; from its crossing of the budget, lengths are tried to the edge (steps of 1, 2, 4...
grains, then halving): the longest whose step ran without running out of memory, its peak and
step time (the median of ``--steps`` more steps). Each try builds a fresh engine (one whose step
ran out of memory is not trusted again). No longer length is tried after ``--seconds`` (half of
them for plain), nor beyond ``--max-tokens``; the table says which stopped a search. Then tiled
at plain's longest: the time tiling costs where both fit. Prints a markdown table and one JSON
line.

On a CPU nothing runs out of memory: each search climbs to ``--max-tokens`` (the dry run of
``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

import torch

import zero_engine


def llama(args: argparse.Namespace, device: torch.device, length: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate or 4 * args.hidden,
        vocab_size=args.vocab, max_position_embeddings=max(length, 2048), tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(torch.bfloat16)


def engine_config(tiles: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9, "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
        "zero_optimization": {"stage": 3, "recompute_units": True},
        "tiled_mlp_tokens": tiles, "tiled_loss_tokens": tiles,
    }


def out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def try_length(args: argparse.Namespace, device: torch.device, tiles: int, length: int, steps: int) -> dict | None:
    """One fresh engine at ``length`` tokens: None if a step ran out of memory, else the peak
    allocated bytes of its first step and the median of ``steps`` more steps' times (s)."""
    engine = None
    try:
        engine = zero_engine.initialize(llama(args, device, length), engine_config(tiles))
        ids = torch.randint(0, args.vocab, (1, length), generator=torch.Generator().manual_seed(length)).to(device)
        reset_peak(device)
        times = []
        for _ in range(1 + steps):
            start = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            synchronize(device)
            times.append(time.perf_counter() - start)
        return {"tokens": length, "peak_bytes": peak_bytes(device), "step_s": statistics.median(times[1:] or times),
                "loss": loss.item()}
    except Exception as error:  # noqa: BLE001 (out of memory is the answer; anything else is raised)
        if not out_of_memory(error):
            raise
        return None
    finally:
        if engine is not None:
            try:
                engine.close()
            except Exception:  # noqa: BLE001 (an engine whose step ran out of memory may not close cleanly)
                pass
        del engine
        gc.collect()
        empty_cache(device)


def longest(args: argparse.Namespace, device: torch.device, tiles: int, deadline: float) -> dict:
    """The longest multiple of ``--grain`` tokens whose step ran: the peak measured at ``--start``
    and twice that gives the line it follows (flash attention: linear in the tokens); from its
    crossing of the budget, steps of 1, 2, 4... grains up (or down) until the edge is passed, then
    halving between the two sides. Past ``deadline`` (time.monotonic) or ``--max-tokens`` no
    longer length is tried: the answer says which stopped it."""
    def run(length: int) -> dict | None:
        found = try_length(args, device, tiles, length, 0)
        print(f"  tiles {tiles or 'none'}: {length} tokens {'ran' if found else 'out of memory'}", flush=True)
        return found

    first, second = run(args.start), run(2 * args.start)
    if first is None or second is None:
        raise SystemExit(f"--start {args.start} tokens (or twice that) does not fit (tiles {tiles}): start lower")
    grain = args.grain
    per_token = max(1.0, (second["peak_bytes"] - first["peak_bytes"]) / args.start)
    room = budget_bytes(device, args) - first["peak_bytes"]
    guess = max(int((args.start + room / per_token) // grain * grain), 2 * args.start + grain)
    guess = min(guess, args.max_tokens // grain * grain)  # where nothing runs out (a CPU): the most asked
    fits, fails, stopped = second, None, ""  # the longest step that ran; the shortest length that did not

    def attempt(length: int) -> bool | None:
        """Whether ``length`` ran; None where it may not be tried (``stopped`` says why)."""
        nonlocal fits, fails, stopped
        if length > args.max_tokens:
            stopped = "--max-tokens"
        elif time.monotonic() > deadline:
            stopped = "the time limit"
        if stopped:
            return None
        found = run(length)
        if found is None:
            fails = length if fails is None else min(fails, length)
        elif found["tokens"] > fits["tokens"]:
            fits = found
        return found is not None

    length, step, upward = guess, grain, None
    while length > fits["tokens"]:  # bracket the edge from the guess
        ran = attempt(length)
        if ran is None:
            break
        upward = ran if upward is None else upward
        if ran != upward:
            break
        length, step = (length + step if upward else length - step), 2 * step
    while not stopped and fails is not None and fails - fits["tokens"] > grain:  # halve the bracket
        if attempt((fits["tokens"] + fails) // 2 // grain * grain) is None:
            break
    if args.steps:
        fits = try_length(args, device, tiles, fits["tokens"], args.steps) or fits
    return {**fits, "stopped_by": stopped}


# -- the device's own calls (CUDA; nothing on a CPU) ----------------------------------------------

def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def budget_bytes(device: torch.device, args: argparse.Namespace) -> int:
    """The bytes a step may allocate: ``--budget-gib`` (held to it by the caching allocator's
    memory fraction) or the device's memory; on a CPU the budget of the dry run alone."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if args.budget_gib:
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_gib * 2**30 / total), device)
            return int(args.budget_gib * 2**30)
        return total
    return int((args.budget_gib or 1) * 2**30)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=4096, help="0: 4 x hidden")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--budget-gib", type=float, default=16.0, help="0: the device's whole memory")
    parser.add_argument("--tiles", type=int, default=4096, help="tokens per tile when tiled")
    parser.add_argument("--start", type=int, default=4096, help="the first length measured (then twice it)")
    parser.add_argument("--max-tokens", type=int, default=1 << 20, help="no longer length is tried")
    parser.add_argument("--grain", type=int, default=4096, help="the answer's precision in tokens")
    parser.add_argument("--steps", type=int, default=1, help="timed steps at each longest length (0: none)")
    parser.add_argument("--seconds", type=float, default=300, help="no longer length is tried after this")
    args = parser.parse_args()
    began = time.monotonic()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    budget = budget_bytes(device, args)
    probe = llama(args, torch.device("meta"), args.start)
    params = sum(p.numel() for p in probe.parameters())
    del probe
    print(f"Llama from config: hidden {args.hidden}, {args.layers} layers, {args.heads} heads ({args.kv_heads} "
          f"key/value), MLP {args.intermediate or 4 * args.hidden}, vocabulary {args.vocab}: {params / 1e9:.3f}B "
          f"parameters, bf16, stage 3 on one {args.device} device, within {budget / 2**30:.1f} GiB", flush=True)
    plain = longest(args, device, 0, began + args.seconds / 2)
    tiled = longest(args, device, args.tiles, began + args.seconds)
    tiled_there = try_length(args, device, args.tiles, plain["tokens"], max(args.steps, 1))
    print()
    print(f"| compute | longest sequence (tokens) | peak allocated (GiB) | its step (s) | a step at {plain['tokens']} "
          "tokens (s) |")
    print("|---|---|---|---|---|")
    for name, row, there in (("plain", plain, plain), (f"tiled ({args.tiles} tokens a tile)", tiled, tiled_there)):
        stopped = f" (stopped by {row['stopped_by']})" if row["stopped_by"] else ""
        at_plain = f"{there['step_s']:.2f}" if there else "out of memory"
        print(f"| {name} | {row['tokens']}{stopped} | {row['peak_bytes'] / 2**30:.2f} | {row['step_s']:.2f} | "
              f"{at_plain} |")
    print(f"tiled / plain: {tiled['tokens'] / plain['tokens']:.2f}x the tokens")
    print(json.dumps({"device": device_name(device), "params": params, "budget_bytes": budget, "plain": plain,
                      "tiled": tiled, "tiled_at_plain_longest": tiled_there}))


if __name__ == "__main__":
    main()
