"""Hugging Face's "auto" where plain initialize can fill it: the batch triple from the world
size and the other two, the bucket sizes from the model's hidden size (h*h, 0.9*h*h, 10*h);
what it cannot fill fails naming every key. ``steps_per_print: inf`` (Accelerate's) is
"never"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import zero_engine
from harness import run_on_ranks
from models import make_model, micro_batch
from zero_engine import ConfigError
from zero_engine.cli import main as cli_main

HIDDEN = 7  # TrapModel's width


class _HFConfig:
    hidden_size = HIDDEN


def _hf_like_model() -> nn.Module:
    model = make_model()
    model.config = _HFConfig()  # what a transformers PreTrainedModel carries
    return model


AUTO_CONFIG = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "zero_optimization": {
        "stage": 3, "reduce_bucket_size": "auto", "prefetch_bucket_size": "auto",  # DeepSpeed's short spelling
        "stage3_param_persistence_threshold": "auto",
    },
}


def filled_on_ranks(rank: int, world_size: int) -> dict:
    engine = zero_engine.initialize(_hf_like_model(), AUTO_CONFIG)
    zero = engine.config.zero_optimization
    engine.backward(engine(*micro_batch(0, 0, rank, world_size, 2, 3)))  # it trains
    engine.step()
    result = {
        "batch": tuple(engine.batch), "buckets": (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size,
                                                  zero.stage3_param_persistence_threshold),
    }
    engine.close()
    return result


def test_batch_and_bucket_sizes_are_filled_for_the_world_size_and_the_model() -> None:
    for result in run_on_ranks(2, filled_on_ranks):
        assert result["batch"] == (2 * 3 * 2, 2, 3)  # train_batch_size = micro x accumulation x world size
        assert result["buckets"] == (HIDDEN * HIDDEN, int(0.9 * HIDDEN * HIDDEN), 10 * HIDDEN)


def test_what_initialize_cannot_fill_is_named_all_at_once() -> None:
    config = {
        "train_batch_size": "auto", "gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
    }
    with pytest.raises(ConfigError) as info:
        zero_engine.initialize(make_model(), config)  # no config.hidden_size
    message = str(info.value)
    assert "train_batch_size and gradient_accumulation_steps (the world size and one batch key give only one" in message
    assert "zero_optimization.reduce_bucket_size (the model has no config.hidden_size" in message


def test_validate_says_which_auto_keys_initialize_fills(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": "auto", "train_batch_size": 8, '
                    '"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}}')
    assert cli_main(["validate", str(path)]) == 0
    err = capsys.readouterr().err
    assert "train_micro_batch_size_per_gpu is 'auto': initialize fills it" in err
    assert "zero_optimization.stage3_prefetch_bucket_size is 'auto'" in err


@pytest.mark.parametrize("never", [float("inf"), "inf", "Infinity", None])
def test_steps_per_print_infinity_means_never(never, caplog: pytest.LogCaptureFixture) -> None:
    engine = zero_engine.initialize(nn.Linear(4, 4), {"train_micro_batch_size_per_gpu": 1, "steps_per_print": never})
    assert engine.config.steps_per_print is None
    with caplog.at_level("INFO", logger="zero_engine"):
        for _ in range(3):
            engine.backward(engine(torch.ones(1, 4)).sum())
            engine.step()
    assert not [r for r in caplog.records if r.getMessage().startswith("step ")]
    engine.close()
