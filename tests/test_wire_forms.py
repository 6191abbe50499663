"""Codecs keyed by wire form (STRUCTURE item 7): a test codec added to the gradient and the
gather tables (int8 in blocks of 64, not 2048) is chosen by name at 2 ranks with no other edit
and trains close to exact values; DeepSpeed's ZeRO++ keys still pick int8 and int4; a name not in
a table, or one contradicting the ZeRO++ keys, is a ConfigError at initialize."""

from __future__ import annotations

import pytest

import zero_engine
from harness import run_on_ranks
from models import make_model, train_engine


def _config(stage: int, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}


def _train(rank: int, world_size: int, stage: int, zero: dict) -> dict:
    from zero_engine.quantize import BlockQuantizer
    from zero_engine.sharding.shards import codec

    codec.GRAD_WIRE_FORMS["int8_block64"] = lambda meter: codec.QuantizedGrads(BlockQuantizer(8, 64), meter)
    codec.GATHER_WIRE_FORMS["int8_block64"] = lambda meter: codec.QuantizedGatherCodec(BlockQuantizer(8, 64), meter)
    engine = zero_engine.initialize(make_model(), _config(stage, **zero))
    losses, _ = train_engine(engine, rank, world_size, range(4), 2, 1)
    chosen = {
        part: (type(c).__name__, getattr(getattr(c, "quantizer", None), "block", None),
               getattr(getattr(c, "quantizer", None), "bits", None))
        for part, c in (("grads", engine.codecs.grads), ("gather", engine.codecs.gather))
    }
    return {"losses": [window[0] for window in losses], "chosen": chosen}


def _refused(rank: int, world_size: int, zero: dict) -> str:
    try:
        zero_engine.initialize(make_model(), _config(2, **zero))
    except zero_engine.ConfigError as err:
        return str(err)
    return "accepted"


def test_a_codec_added_to_its_table_is_chosen_by_name_at_2_ranks() -> None:
    exact = run_on_ranks(2, _train, 3, {})
    test = run_on_ranks(2, _train, 3, {"gradient_wire_format": "int8_block64", "weight_wire_format": "int8_block64"})
    deepspeed = run_on_ranks(2, _train, 3, {"zero_quantized_gradients": True, "zero_quantized_gradients_bits": 4})
    for rank in range(2):
        assert exact[rank]["chosen"] == {"grads": ("ExactGrads", None, None), "gather": ("IdentityCodec", None, None)}
        assert test[rank]["chosen"] == {"grads": ("QuantizedGrads", 64, 8), "gather": ("QuantizedGatherCodec", 64, 8)}
        assert deepspeed[rank]["chosen"]["grads"] == ("QuantizedGrads", 2048, 4)
        assert test[rank]["losses"] != exact[rank]["losses"]  # the values did travel encoded
        assert test[rank]["losses"] == pytest.approx(exact[rank]["losses"], rel=1e-2)


def test_a_wire_form_not_in_its_table_or_against_zero_plus_plus_is_refused() -> None:
    unknown, against = run_on_ranks(1, _refused, {"gradient_wire_format": "fp8"})[0], run_on_ranks(
        1, _refused, {"gradient_wire_format": "int8", "zero_quantized_gradients": True,
                      "zero_quantized_gradients_bits": 4})[0]
    assert unknown == "zero_optimization.gradient_wire_format = 'fp8' is not a wire form: the forms are " \
                      "['exact', 'int4', 'int8']", unknown
    assert "contradicts the ZeRO++ keys, which ask for 'int4'" in against, against
