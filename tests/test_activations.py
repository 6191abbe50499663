"""`zero_engine.activations`: the activation bytes `zero-engine estimate` prints, against what
torch allocates in a real step of a Hugging Face Llama through the engine (the profiler's
memory records: every allocation and free of the CPU allocator, in order), with and without
``recompute_units``, in fp32 and bf16, on 2 ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from tiny import llama
from zero_engine.activations import DecoderShape, activation_bytes
from zero_engine.testing.process_memory import step_allocations

SHAPE = DecoderShape(hidden=128, layers=3, heads=4, kv_heads=2, ffn=352, vocab=1000)
MICRO, SEQ = 2, 256


def _llama() -> Any:
    return llama(vocab=SHAPE.vocab, hidden=SHAPE.hidden, ffn=SHAPE.ffn, layers=SHAPE.layers, heads=SHAPE.heads,
                 kv_heads=SHAPE.kv_heads, positions=SEQ, attention="sdpa")


def measured_steps(rank: int, world_size: int, cases: list[tuple[int, str, bool, int, int]]) -> dict[Any, Any]:
    torch.set_num_threads(1)
    ids = torch.randint(0, SHAPE.vocab, (MICRO, SEQ), generator=torch.Generator().manual_seed(rank))
    results = {}
    for case in cases:
        stage, dtype, recompute, loss_tiles, mlp_tiles = case
        torch.manual_seed(0)
        config = engine_config(stage, micro=MICRO, lr=1e-3, dtype=dtype, recompute_units=recompute)
        config["tiled_loss_tokens"], config["tiled_mlp_tokens"] = loss_tiles, mlp_tiles
        engine = zero_engine.initialize(_llama(), config)
        results[case] = step_allocations(engine, ids)
        engine.close()
    return results


# Activations do not depend on the stage; stage 3 adds its gathered units, which memory_report() counts.
# Cases: stage, dtype, recompute_units, tiled_loss_tokens, tiled_mlp_tokens. The tiled loss and
# MLPs: tiles of 64 tokens (the micro-batch is 512), with and without recomputation.
CASES = [
    (stage, dtype, recompute, 0, 0) for stage in (1, 2) for dtype in ("fp32", "bf16") for recompute in (False, True)
]
CASES += [(1, "fp32", False, 64, 0), (2, "bf16", True, 64, 0), (1, "fp32", False, 0, 64), (2, "bf16", True, 64, 64)]


def test_the_estimate_is_what_a_step_allocates():
    """After the forward, the activations kept and the logits; at most, the step's peak: each
    within 1% of the allocator's count, on every rank. With recomputation the model's key/value
    cache is off in training (before, it kept every layer's keys and values: 14% more here).
    With the tiled loss, no logits and one tile's loss at a time; with tiled MLPs, no MLP
    intermediates kept and one tile's in a layer's backward."""
    results = run_on_ranks(2, measured_steps, CASES, allow_numpy=True, timeout=400)
    for case in CASES:
        stage, dtype, recompute, loss_tiles, mlp_tiles = case
        c = 2 if dtype == "bf16" else 4
        expected = activation_bytes(SHAPE, MICRO, SEQ, c, recompute, loss_tiles, mlp_tiles)
        # tiled: each tile's checkpoint keeps a few small tensors (64 KiB in all here), and where in
        # the tiles' backward the peak falls moves it by up to 2%
        tolerance = {"rel": 0.02, "abs": 64 * 1024} if loss_tiles or mlp_tiles else {"rel": 0.01}
        for rank_results in results:
            after_forward, peak = rank_results[case]
            assert after_forward == pytest.approx(expected.kept + expected.logits, **tolerance), case
            assert peak == pytest.approx(expected.peak, **tolerance), case
        untiled = activation_bytes(SHAPE, MICRO, SEQ, c, recompute)
        if loss_tiles:  # what tiling saves: the logits are gone, and the peak is below the untiled one's
            assert expected.logits == 0 and expected.peak < untiled.peak
        if mlp_tiles:  # and the MLPs' intermediates: in what the layers keep, or in a recomputed layer
            mlp_untiled = activation_bytes(SHAPE, MICRO, SEQ, c, recompute, loss_tiles)
            assert expected.peak < mlp_untiled.peak and (recompute or expected.kept < mlp_untiled.kept)


def test_a_decoders_parameters_counted_from_its_shape():
    model = _llama()
    assert SHAPE.num_params == sum(p.numel() for p in model.parameters())
    assert DecoderShape.from_hf_config(model.config.to_dict()) == SHAPE
    tied = SHAPE._replace(tied=True)
    assert tied.num_params == SHAPE.num_params - SHAPE.vocab * SHAPE.hidden


def test_a_config_that_is_not_a_decoders_is_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 64, "vocab_size": 10}')
    with pytest.raises(ValueError, match=r"config.json has no integer num_hidden_layers, num_attention_heads"):
        DecoderShape.from_file(path)


def test_estimate_prints_a_decoders_activations_with_and_without_recompute(tmp_path, capsys):
    from zero_engine.cli import main

    config = tmp_path / "ds.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true}, '
                      '"zero_optimization": {"stage": 3, "recompute_units": true}}')
    model_config = tmp_path / "config.json"
    model_config.write_text(_llama().config.to_json_string())
    assert main(["estimate", str(config), "--model-config", str(model_config), "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert f"{SHAPE.num_params:,} trainable" in out  # --params from the model's shape
    for recompute, line in zip((False, True), [line for line in out.splitlines() if "kept for backward" in line]):
        counted = activation_bytes(SHAPE, 2, 4096, 2, recompute)
        assert f"{counted.kept / 2**30:8.3f} GiB" in line and f"{counted.peak / 2**30:8.3f} GiB" in line
        assert line.endswith("<- this config") == recompute
    assert main(["estimate", str(config), "--params", "1e9", "--seq-len", "4096"]) == 1
    assert "--seq-len counts activations of the model that --model-config describes" in capsys.readouterr().err
    tiled = tmp_path / "tiled.json"  # the loss in tiles of 512 tokens: one tile's part, not the logits'
    tiled.write_text(config.read_text()[:-1] + ', "tiled_loss_tokens": 512}')
    assert main(["estimate", str(tiled), "--model-config", str(model_config), "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    counted, whole = activation_bytes(SHAPE, 2, 4096, 2, True, 512), activation_bytes(SHAPE, 2, 4096, 2, True)
    assert f"step peak {counted.peak / 2**30:8.3f} GiB  <- this config" in out
    assert f"one tile of 512 tokens (tiled_loss_tokens): {counted.loss / 2**30:.3f} GiB" in out
    assert f"would take {whole.loss / 2**30:.3f} GiB" in out and counted.peak < whole.peak
    mlp = tmp_path / "mlp.json"  # and the MLPs in tiles of 1024 tokens
    mlp.write_text(tiled.read_text()[:-1] + ', "tiled_mlp_tokens": 1024}')
    assert main(["estimate", str(mlp), "--model-config", str(model_config), "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    both = activation_bytes(SHAPE, 2, 4096, 2, True, 512, 1024)
    assert f"step peak {both.peak / 2**30:8.3f} GiB  <- this config" in out and both.peak < counted.peak
    assert (f"the MLPs in tiles of 1024 tokens (tiled_mlp_tokens): step peak {both.peak / 2**30:.3f} GiB; "
            f"untiled MLPs {counted.peak / 2**30:.3f} GiB") in out
    assert main(["estimate", str(config), "--model-config", str(model_config)]) == 1
    assert "give the sequence length, --seq-len S" in capsys.readouterr().err


def test_training_forwards_build_no_cache_until_removed():
    """A Hugging Face model's training forward gets use_cache=False (with or without
    recompute_units, through a PEFT wrapper too): no cache is built, and Hugging Face keeps
    packed documents apart (``tests/test_sequence_packing.py``); evaluation keeps its cache."""
    from peft import LoraConfig, get_peft_model

    from zero_engine.comm import Mesh
    from zero_engine.transforms.no_cache import NoCacheInTraining
    from zero_engine.transforms.seam import ModuleTransforms, TransformTarget

    for model in (_llama(), get_peft_model(_llama(), LoraConfig(r=2, target_modules=["q_proj"]))):
        ids = torch.randint(0, SHAPE.vocab, (1, 8))
        assert model(input_ids=ids).past_key_values is not None  # the model's own default
        forwards = ModuleTransforms(TransformTarget(model, lambda: [], Mesh()))
        forwards.add(NoCacheInTraining())
        assert model(input_ids=ids).past_key_values is None
        assert model(input_ids=ids, use_cache=True).past_key_values is not None  # the caller's word holds
        with torch.no_grad():
            assert model(input_ids=ids).past_key_values is not None  # generation keeps its cache
        forwards.remove()
        assert model(input_ids=ids).past_key_values is not None
    engine = zero_engine.initialize(_llama(), engine_config(0, micro=1, lr=1e-3))  # the engine adds it, unasked
    assert engine(input_ids=ids).past_key_values is None
    engine.close()
