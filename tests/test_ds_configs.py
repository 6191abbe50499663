"""DeepSpeed configs as 18 public projects write them (tests/data/ds_configs, sources in its
README): every file loads, and every key is honoured, named as having no effect, or refused
with what to use instead; never dropped in silence."""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import zero_engine
from zero_engine import ConfigError
from zero_engine.config import NO_EFFECT, ZeroEngineConfig, auto_keys, no_effect_settings
from zero_engine.config.deepspeed_compat import (
    DEPRECATED_OFFLOAD, DEPRECATED_ZERO_KEYS, FILLED_AT_INITIALIZE, STAGE3_SHORT_NAMES, _long_spelling,
)
from zero_engine.config.refusals import refused_settings as unbuilt_features
from zero_engine.values import as_count

CORPUS = sorted((Path(__file__).parent / "data" / "ds_configs").glob("*.json"))
# What the Hugging Face integration would fill "auto" with, by key (test values).
AUTO_VALUES: dict[str, Any] = {
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0, "enabled": False, "lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
    "weight_decay": 0.0, "warmup_min_lr": 0.0, "warmup_max_lr": 1e-4, "warmup_num_steps": 10,
    "total_num_steps": 100, "reduce_bucket_size": 4096, "stage3_prefetch_bucket_size": 3686,
    "stage3_param_persistence_threshold": 640, "sub_group_size": 10**9,
    "stage3_gather_16bit_weights_on_model_save": False,
}


def _filled(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _filled(v, k) for k, v in value.items()}
    return AUTO_VALUES[key] if value == "auto" else value


def _auto_keys(value: Any, prefix: str = "") -> list[str]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _auto_keys(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if value == "auto" else []


def _expected(key: str, value: Any) -> Any:
    """What a raw value becomes: counts as integers (a bucket of 0 as 1, as DeepSpeed flushes it
    at once); an integral real compares equal to its integer either way."""
    if key == "reduce_bucket_size":
        return max(1, as_count(value))
    return as_count(value) if isinstance(value, float) and value.is_integer() else value


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_a_public_deepspeed_config_loads_with_every_key_accounted_for(path: Path) -> None:
    raw = json.loads(path.read_text())
    auto = _auto_keys(raw)
    needs_trainer = [key for key in auto if _long_spelling(key) not in FILLED_AT_INITIALIZE]
    if needs_trainer:  # until the Hugging Face integration fills them: refused, every key named at once
        with pytest.raises(ConfigError) as info:
            zero_engine.load_config(path)
        assert "give values for " + ", ".join(needs_trainer) in str(info.value)
    elif auto:  # only batch and bucket sizes: they load, for initialize to fill
        assert sorted(auto_keys(zero_engine.load_config(path))) == sorted(_long_spelling(key) for key in auto)
    raw = _filled(raw)
    with pytest.warns() if _uses_deprecated(raw) else _no_warning():
        config = zero_engine.load_config(raw)
    _check_zero_keys(raw.get("zero_optimization", {}), config)
    for section in ("fp16", "bf16"):
        for key, value in raw.get(section, {}).items():
            assert getattr(getattr(config, section), key) == value, (section, key)
    for key, value in raw.items():
        if not isinstance(value, dict) and key in ZeroEngineConfig.model_fields:
            assert getattr(config, key) == _expected(key, value), key
    # Keys without effect are named at initialize; features not built are refused there.
    named = " ".join(no_effect_settings(config))
    for key in NO_EFFECT:
        *sections, name = key.split(".")
        where = raw
        for part in sections:
            where = where.get(part, {})
        if name in where and where[name] != _default(key):
            assert key in named, key
    refused = " ".join(unbuilt_features(config))
    zero = raw.get("zero_optimization", {})
    # cpu and nvme offload are built, for the optimizer side and for parameter shards
    assert "offload_optimizer.device" not in refused and "offload_param.device" not in refused
    assert ("pipeline_parallel_size" in refused) == ("pipeline" in raw)
    assert ("zero_hpz_partition_size" in refused) == ("zero_hpz_partition_size" in zero)


def _check_zero_keys(zero: dict[str, Any], config: ZeroEngineConfig) -> None:
    ours = config.zero_optimization
    for key, value in zero.items():
        if isinstance(value, dict) or key in DEPRECATED_OFFLOAD:
            continue
        name = DEPRECATED_ZERO_KEYS.get(key, f"stage3_{key}" if key in STAGE3_SHORT_NAMES else key)
        assert getattr(ours, name) == _expected(key, value), (key, name)


def _default(key: str) -> Any:
    *sections, name = key.split(".")
    model: Any = ZeroEngineConfig
    for part in sections:
        model = model.model_fields[part].default_factory
    return model.model_fields[name].default


def _uses_deprecated(raw: dict[str, Any]) -> bool:
    zero = raw.get("zero_optimization", {})
    return any(key in zero for key in (*DEPRECATED_ZERO_KEYS, *DEPRECATED_OFFLOAD))


@contextlib.contextmanager
def _no_warning() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        yield


# -- honoured keys do what DeepSpeed's do: one row per key, in one process ------------------------


def _linear_step(engine: Any) -> None:
    import torch

    engine.backward(engine(torch.ones(1, 4)).sum())
    engine.step()


def _update_norm(engine: Any) -> float:
    import torch

    before = [p.detach().clone() for p in engine.module.parameters()]
    _linear_step(engine)
    return torch.cat([(p.detach() - b).flatten() for p, b in zip(engine.module.parameters(), before)]).norm().item()


HONOURED: list[tuple[str, dict[str, Any], Any]] = [
    ("zero_optimization.stage", {"zero_optimization": {"stage": 2}}, lambda e: e.stage.level == 2),
    ("gradient_accumulation_steps", {"gradient_accumulation_steps": 3},
     lambda e: e.batch.gradient_accumulation_steps == 3 and not e.is_gradient_accumulation_boundary()),
    ("train_micro_batch_size_per_gpu", {"train_micro_batch_size_per_gpu": 5}, lambda e: e.batch.micro_batch_size == 5),
    ("gradient_clipping", {"gradient_clipping": 0.01}, lambda e: abs(_update_norm(e) - 0.01) < 1e-4),
    ("optimizer.type", {"optimizer": {"type": "SGD", "params": {"lr": 0.5}}},
     lambda e: type(e.optimizer).__name__ == "SGD" and e.get_lr() == [0.5]),
    ("optimizer.params.adam_w_mode", {"optimizer": {"type": "Adam", "params": {"lr": 0.1, "adam_w_mode": True}}},
     lambda e: type(e.optimizer).__name__ == "AdamW"),
    ("scheduler", {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.2, "warmup_num_steps": 4,
                                                                "warmup_type": "linear"}}},
     lambda e: e.get_lr() == [0.0] and (_linear_step(e), _linear_step(e), e.get_lr())[2] == [pytest.approx(0.05)]),
    ("fp16.initial_scale_power", {"fp16": {"enabled": True, "initial_scale_power": 5}}, lambda e: e.loss_scale == 32),
    ("fp16.loss_scale", {"fp16": {"enabled": True, "loss_scale": 64}}, lambda e: e.loss_scale == 64),
    ("bf16.enabled", {"bf16": {"enabled": True}}, lambda e: e.module.weight.dtype.is_floating_point
     and str(e.module.weight.dtype) == "torch.bfloat16"),
    ("communication_data_type", {"bf16": {"enabled": True}, "communication_data_type": "bf16"},
     lambda e: str(e.precision.reduce_dtype) == "torch.bfloat16"),
    ("zero_optimization.overlap_comm", {"zero_optimization": {"stage": 1, "overlap_comm": False}},
     lambda e: e.reducer.overlap is False),
    ("zero_optimization.reduce_bucket_size", {"zero_optimization": {"stage": 1, "reduce_bucket_size": 4}},
     lambda e: len(e.units) == 2),  # the 4x4 weight and the bias, each its own unit
    ("zero_optimization.stage3_prefetch_bucket_size", {"zero_optimization": {"stage": 3, "prefetch_bucket_size": 7}},
     lambda e: e.gatherer.prefetch.prefetch_numel == 7),
    ("zero_optimization.stage3_max_live_parameters", {"zero_optimization": {"stage": 3, "max_live_parameters": 9}},
     lambda e: e.gatherer.prefetch.max_live_numel == 9),
    ("zero_optimization.stage3_param_persistence_threshold",
     {"zero_optimization": {"stage": 3, "param_persistence_threshold": 5}},  # the bias (4) stays whole
     lambda e: [len(unit.params) for unit in e.gatherer.units] == [1]),
]


@pytest.mark.parametrize("key, config, probe", HONOURED, ids=[row[0] for row in HONOURED])
def test_an_honoured_key_changes_what_deepspeed_says(key: str, config: dict[str, Any], probe: Any) -> None:
    import torch

    torch.manual_seed(0)
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 1.0}}}
    engine = zero_engine.initialize(torch.nn.Linear(4, 4), {**base, **config})
    try:
        assert probe(engine), key
    finally:
        engine.close()


def test_steps_per_print_logs_as_deepspeed_prints(caplog: pytest.LogCaptureFixture) -> None:
    import torch

    engine = zero_engine.initialize(torch.nn.Linear(4, 4), {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 2})
    with caplog.at_level("INFO", logger="zero_engine"):
        for _ in range(4):
            _linear_step(engine)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 2", "step 4"], lines
    engine.close()
