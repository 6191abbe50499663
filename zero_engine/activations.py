"""Activation memory of a decoder transformer's training step, per rank: what the forward keeps
for the backward, and the step's peak, with and without ``recompute_units``.

ZeRO shards model states, never activations: at long sequences they are most of a rank's
memory, so `zero-engine estimate` counts them beside the formula's states. The counts are
those of a Llama-style decoder (RMSNorm, gated MLP, rotary positions, SDPA attention, no
dropout; Llama, Mistral, Qwen2 and most 2024-2026 decoders) as Hugging Face's implementation
keeps them, per token, with ``c`` the compute dtype's bytes (4 in fp32, 2 in bf16/fp16):

- a layer keeps ``c (6h + 2k + 4f) + 4 (2h + a + 2)`` bytes: its linears' and norms' inputs,
  the attention's q, k, v and output, the gate's halves; the two norms' fp32 upcasts, the
  attention's fp32 log-sum-exp per head and the norms' reciprocal roots (h hidden, k the
  key/value width, f the MLP's width, a heads);
- outside the layers: the final norm and the head's input ``(4 + 2c) h``, the rotary tables
  ``c h/a``, the loss's fp32 log-softmax ``4 V`` and 20 bytes of token ids and norms;
- with ``recompute_units`` a layer keeps only its input (``c h``), and the backward recomputes
  one layer at a time;
- the returned logits (``c V``) stay alive through the step; the loss's backward holds two fp32
  gradients of the logits (``8 V``), a recomputed layer its activations less the freed
  log-softmax plus two hidden-sized gradients: the peak adds the larger;
- with ``tiled_loss_tokens: n`` no logits are returned and no log-softmax kept: the loss's part
  is one tile's, about ``12 n V`` bytes at once (three fp32-sized copies of its logits in the
  tile's backward), whatever the sequence's length, beside the gradients the loss's backward
  makes for the head's weight (``c V h``) and for its input (``c h`` per token); a recomputed
  layer comes after, the head's weight gradient still alive, the head's input gone (the tiles'
  checkpoints let it go, and the output holds a stand-in in place of the logits);
- with ``tiled_mlp_tokens: m`` a layer keeps no MLP intermediates (``4 c f`` a token less:
  each tile keeps its input, a view of the MLP's, and the CPU generator's state, 5,056 bytes, to
  recompute it); one tile's MLP backward holds about ``8 c f`` bytes a token of it (its
  recomputed intermediates and their gradients), counted where a layer's backward is.

Within 2% of the allocator's count (1% untiled).

Checked in tests/test_activations.py against torch's own allocation events (the profiler's
memory records) around a real step of a Hugging Face Llama through the engine. Other layer
shapes differ by a few tensors per layer: GPT-2's LayerNorm, GELU MLP and dropout masks keep
more. Attention implementations that materialise the score matrix (``eager``) add
``c a s`` per token per layer; not counted here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple


class DecoderShape(NamedTuple):
    """The sizes that set a decoder's activations (and, with ``tied``, its parameter count)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False

    @property
    def kv_width(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    @property
    def num_params(self) -> int:
        """Parameters of a Llama-style decoder of this shape (embeddings, head unless tied, norms)."""
        h = self.hidden
        attention = h * (h + 2 * self.kv_width) + h * h
        layer = attention + 3 * h * self.ffn + 2 * h
        return self.vocab * h * (1 if self.tied else 2) + self.layers * layer + h

    @property
    def matrix_params(self) -> int:
        """Of `num_params`, the layers' weight matrices (what Muon takes; embeddings, head and
        norms go to its AdamW)."""
        h = self.hidden
        return self.layers * (h * (h + 2 * self.kv_width) + h * h + 3 * h * self.ffn)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], where: str = "the model config") -> "DecoderShape":
        """From a Hugging Face ``config.json``'s keys (``hidden_size``, ``num_hidden_layers``,
        ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``,
        ``tie_word_embeddings``); a multimodal config's ``text_config`` is read when present."""
        config = config.get("text_config") or config
        missing = [key for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
                   if not isinstance(config.get(key), int)]
        if missing:
            raise ValueError(f"{where} has no integer {', '.join(missing)}: not a decoder's config.json")
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        return cls(
            hidden=hidden,
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            ffn=config.get("intermediate_size") or 4 * hidden,
            vocab=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "DecoderShape":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read the model config {path}: {err}") from err
        if not isinstance(data, dict):
            raise ValueError(f"{path} is not a JSON object: not a config.json")
        return cls.from_hf_config(data, str(path))


class Activations(NamedTuple):
    """Bytes on one rank for one micro-batch."""

    kept: int  # what the forward keeps for the backward (recompute: the layers' inputs)
    logits: int  # the logits the forward returns, alive through the backward
    peak: int  # the most alive at once during forward and backward, model states aside
    loss: int  # of the peak, the loss's: the logits, their fp32 log-softmax and its two gradients


# What torch's checkpoint keeps per call to replay the same random numbers: the CPU generator's state.
CHECKPOINT_RNG_BYTES = 5056


def layer_bytes_per_token(shape: DecoderShape, compute_bytes: int, tiled_mlp: bool = False) -> int:
    """What one layer keeps for its backward, per token (see the module's docstring)."""
    c, h = compute_bytes, shape.hidden
    mlp = 0 if tiled_mlp else 4 * shape.ffn
    return c * (6 * h + 2 * shape.kv_width + mlp) + 4 * (2 * h + shape.heads + 2)


def activation_bytes(shape: DecoderShape, micro_batch: int, seq_len: int, compute_bytes: int,
                     recompute: bool, tiled_loss_tokens: int = 0, tiled_mlp_tokens: int = 0) -> Activations:
    """Activations of one micro-batch of ``micro_batch`` sequences of ``seq_len`` tokens (the
    loss ``tiled_loss_tokens`` and each MLP ``tiled_mlp_tokens`` at a time when given)."""
    c, h, vocab = compute_bytes, shape.hidden, shape.vocab
    tokens = micro_batch * seq_len
    mlp_tiled = 0 < tiled_mlp_tokens < tokens  # one tile is the MLP as it is
    layer = layer_bytes_per_token(shape, c, mlp_tiled)
    # a tile's MLP backward, where a layer's backward is; the tiles' kept generator states
    mlp_tile = 8 * c * shape.ffn * tiled_mlp_tokens if mlp_tiled else 0
    mlp_states = shape.layers * -(-tokens // tiled_mlp_tokens) * CHECKPOINT_RNG_BYTES if mlp_tiled else 0
    outside = (4 + 2 * c) * h + c * (h // shape.heads) + 20
    layers_kept = shape.layers * (c * h if recompute else layer)
    if tiled_loss_tokens:
        kept = tokens * (layers_kept + outside) + mlp_states
        tile = min(tiled_loss_tokens, tokens) * 12 * vocab
        head_gradient = c * vocab * h
        loss_backward = tile + head_gradient + tokens * c * h
        recomputed = tokens * (layer + c * h) + head_gradient if recompute else 0  # after the tiles
        working = max(loss_backward, recomputed + mlp_tile)
        return Activations(kept=kept, logits=0, peak=kept + working, loss=tile)
    kept = tokens * (layers_kept + outside + 4 * vocab) + mlp_states
    logits = tokens * c * vocab
    working = tokens * 8 * vocab  # the loss's backward: two fp32 gradients of the logits
    if recompute:  # a layer recomputed, once the loss's log-softmax is gone
        working = max(working, tokens * (layer - 4 * vocab + 2 * c * h) + mlp_tile)
    loss = logits + tokens * 12 * vocab
    return Activations(kept=kept, logits=logits, peak=kept + logits + working, loss=loss)
