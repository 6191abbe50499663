"""What int8 (and int4) frozen weights cost in quality, per choice of what stays exact (issue 56).

A Hugging Face Llama (hidden 256, 4 layers, vocabulary 512, untied head) is pretrained in one
process on a Markov chain (each token followed by one of 4 tokens, drawn once: the best loss is
about ln 4 = 1.386, an untrained model's ln 512 = 6.24) until its held-out loss nears that
floor, then cast to bf16, the base a user would fine-tune. Each variant replaces the matrices it quantizes by their decoded values,
encoded as the engine encodes a shard (`zero_engine.quantize.BlockQuantizer`; blocks here
start at each parameter's first element, in the engine at each shard's: the same statistics),
and is scored on held-out sequences: its loss against the exact bf16 model's, and its logits'
largest and mean deviation from the exact ones, as fractions of their standard deviation.

    python scripts/quantized_frozen_quality.py [--steps 300] [--json out.json]

A toy model has none of the outlier channels of a real pretrained LLM (which make per-block
absmax scales coarse); the table says how int8 compares with int4 and what exact embeddings
and head buy here, not what a 7B model loses.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from zero_engine.quantize import BlockQuantizer

VOCAB, SEQ, SUCCESSORS = 512, 64, 4

VARIANTS = {  # name: (bits, block, name fragments kept exact)
    "int8, every matrix": (8, 2048, ()),
    "int8, embeddings and head exact": (8, 2048, ("embed_tokens", "lm_head")),
    "int4 (block 2048), every matrix": (4, 2048, ()),
    "int4 (block 64), every matrix": (4, 64, ()),
    "int4 (block 64), embeddings and head exact": (4, 64, ("embed_tokens", "lm_head")),
}


def chain_tokens(rows: int, seed: int) -> torch.Tensor:
    table = torch.randint(0, VOCAB, (VOCAB, SUCCESSORS), generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    ids = torch.empty(rows, SEQ, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (rows,), generator=generator)
    for t in range(1, SEQ):
        ids[:, t] = table[ids[:, t - 1], torch.randint(0, SUCCESSORS, (rows,), generator=generator)]
    return ids


def pretrained(steps: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=SEQ, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    for step in range(steps):
        ids = chain_tokens(16, 1000 + step)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 100 == 0:
            print(f"pretraining step {step}: loss {model(input_ids=ids, labels=ids).loss.item():.3f}", flush=True)
    return model.to(torch.bfloat16).eval()


def quantized_copy(model, bits: int, block: int, exact: tuple[str, ...]):
    """The model with every matrix of at least one block not named in ``exact`` decoded from
    its encoding; returns it and the fraction of the weights' bytes the encoding keeps."""
    import copy

    quantizer = BlockQuantizer(bits, block)
    copied = copy.deepcopy(model)
    stored, exact_bytes = 0, 0
    with torch.no_grad():
        for name, param in copied.named_parameters():
            exact_bytes += param.numel() * param.element_size()
            if param.dim() < 2 or param.numel() < 2048 or any(part in name for part in exact):
                stored += param.numel() * param.element_size()
                continue
            values = param.reshape(-1).float()
            encoded = torch.empty(quantizer.encoded_bytes(values.numel()), dtype=torch.uint8)
            quantizer.encode(values, encoded)
            param.copy_(quantizer.decode(encoded, values.numel()).view_as(param))
            stored += encoded.numel()
    return copied, stored / exact_bytes


def score(model, held_out: torch.Tensor, exact_logits: torch.Tensor | None) -> dict:
    with torch.no_grad():
        output = model(input_ids=held_out, labels=held_out)
    logits = output.logits.float()
    found = {"loss": output.loss.item()}
    if exact_logits is not None:
        spread = exact_logits.std().item()
        deviation = (logits - exact_logits).abs()
        found["max_dev"] = deviation.max().item() / spread
        found["mean_dev"] = deviation.mean().item() / spread
        found["argmax_agree"] = (logits.argmax(-1) == exact_logits.argmax(-1)).float().mean().item()
    return found, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    start = time.perf_counter()
    model = pretrained(args.steps)
    held_out = chain_tokens(32, 7)
    exact, exact_logits = score(model, held_out, None)
    rows = {"exact bf16": {**exact, "bytes": 1.0}}
    for name, (bits, block, keep) in VARIANTS.items():
        copied, fraction = quantized_copy(model, bits, block, keep)
        found, _ = score(copied, held_out, exact_logits)
        rows[name] = {**found, "bytes": fraction}
    print(f"\n{args.steps} pretraining steps, {time.perf_counter() - start:.0f} s; held-out loss floor ln 4 = 1.386\n")
    print("| weights | bytes vs bf16 | held-out loss | vs exact | largest logit deviation / std | mean "
          "| argmax agrees |")
    print("|---|---|---|---|---|---|---|")
    base = rows["exact bf16"]["loss"]
    for name, row in rows.items():
        if name == "exact bf16":
            print(f"| {name} | 1.000 | {row['loss']:.4f} | | | | |")
            continue
        print(
            f"| {name} | {row['bytes']:.3f} | {row['loss']:.4f} | {100 * (row['loss'] / base - 1):+.2f}% | "
            f"{row['max_dev']:.3f} | {row['mean_dev']:.4f} | {100 * row['argmax_agree']:.1f}% |"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
