"""Every DeepSpeed key loads, and a key left out takes DeepSpeed 0.19.8's default, unless
`DEFAULTS_THAT_DIFFER` says why not. DeepSpeed's keys and defaults were recorded from
DeepSpeed itself (``tests/data/deepspeed_defaults.json``, by scripts/record_deepspeed_traces.py):
a default changed here, or a new DeepSpeed key, shows as a failure, not as a silent difference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
from pydantic import BaseModel

import zero_engine
from zero_engine.config import ZeroEngineConfig
from zero_engine.config.deepspeed_compat import DEFAULTS_THAT_DIFFER, SAME_DEFAULT_OTHER_MEANING

RECORDED = json.loads((Path(__file__).resolve().parent / "data" / "deepspeed_defaults.json").read_text())
DEFAULTS: dict[str, Any] = RECORDED["defaults"]
ADAM_KEYS = {path: value for path, value in DEFAULTS.items() if path.endswith(" (Adam, AdamW)")}
# DeepSpeed's own spellings that translate to another key here (tests/test_config.py checks each).
OTHER_SPELLINGS = {"bfloat16", "zero_optimization.stage3_gather_fp16_weights_on_model_save",
                   "zero_optimization.cpu_offload", "zero_optimization.cpu_offload_param",
                   "zero_optimization.cpu_offload_use_pin_memory"}


def _field(path: str) -> Any:
    """The pydantic field at a key path (through optional sections)."""
    model: type[BaseModel] = ZeroEngineConfig
    *sections, key = path.split(".")
    for name in sections:
        annotation = model.model_fields[name].annotation
        members = get_args(annotation) or (annotation,)
        model = next(c for c in members if isinstance(c, type) and issubclass(c, BaseModel))
    return model.model_fields[key]


def _nested(path: str, value: Any) -> dict[str, Any]:
    config: dict[str, Any] = {}
    target = config
    *sections, key = path.split(".")
    for name in sections:
        target = target.setdefault(name, {})
    target[key] = value
    return config


def test_the_recording_is_deepspeed_0_19_8() -> None:
    assert RECORDED["deepspeed"] == "0.19.8"


def test_every_top_level_key_deepspeed_reads_is_a_key_here() -> None:
    """DeepSpeed ignores a top-level key it does not read (a typo included); we refuse unknown keys
    but accept every key DeepSpeed reads."""
    ours = set(ZeroEngineConfig.model_fields)
    assert set(RECORDED["top_level_keys"]) - ours == {"bfloat16"} & set(RECORDED["top_level_keys"])
    assert zero_engine.load_config({"bfloat16": {"enabled": True}}).bf16.enabled


# Keys whose DeepSpeed default a config file can hold (not "unset", not one of DeepSpeed's objects).
WRITABLE = sorted(path for path, value in DEFAULTS.items() if value is not None and path not in ADAM_KEYS
                  and not path.endswith("leaf_module"))


@pytest.mark.parametrize("path", WRITABLE)
def test_each_deepspeed_key_loads_with_deepspeed_default(path: str) -> None:
    value = DEFAULTS[path]
    config = zero_engine.load_config(_nested(path, value))
    if path in OTHER_SPELLINGS:
        return
    loaded: Any = config
    for name in path.split("."):
        loaded = getattr(loaded, name)
    assert loaded == value


@pytest.mark.parametrize("path", sorted(set(DEFAULTS) - set(ADAM_KEYS) - OTHER_SPELLINGS))
def test_a_key_left_out_takes_deepspeed_default(path: str) -> None:
    ours = _field(path).get_default(call_default_factory=True)
    ours = getattr(ours, "model_dump", lambda: ours)()
    theirs = DEFAULTS[path]
    if path in DEFAULTS_THAT_DIFFER:
        assert ours != theirs or path in SAME_DEFAULT_OTHER_MEANING, f"{path}: listed as differing, but it is the same"
    else:
        assert ours == theirs, f"{path}: ours {ours!r}, DeepSpeed's {theirs!r}: match it, or say why in the table"


def test_every_listed_difference_is_a_deepspeed_key() -> None:
    assert set(DEFAULTS_THAT_DIFFER) <= set(DEFAULTS)


def test_adam_and_adamw_take_deepspeed_fused_adam_defaults() -> None:
    """``{"type": "AdamW", "params": {"lr": ...}}`` is DeepSpeed's fused Adam in AdamW mode: no
    weight decay unless given (torch's AdamW decays by 0.01), torch's betas and eps."""
    for kind in ("Adam", "AdamW"):
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": kind, "params": {"lr": 0.1}}}
        engine = zero_engine.initialize(torch.nn.Linear(2, 2), config)
        assert type(engine.optimizer) is torch.optim.AdamW, kind  # DeepSpeed's Adam decays as AdamW
        group = engine.optimizer.param_groups[0]
        for path, value in ADAM_KEYS.items():
            key = path.split(".")[2].split(" ")[0]
            expected = 0.1 if key == "lr" else tuple(value) if isinstance(value, list) else value
            assert group[key] == expected, (kind, key)
        engine.close()


def test_gradient_clipping_left_out_clips_at_one_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed 0.19.8 clips at 1.0 unless told (``GRADIENT_CLIPPING_DEFAULT``); initialize says
    which clipping is in effect and where it came from."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 1.0}}}
    results = {}
    for name, extra in (("left out", {}), ("off", {"gradient_clipping": 0.0})):
        replica = torch.nn.Linear(4, 4)
        replica.load_state_dict(model.state_dict())
        with caplog.at_level("INFO", logger="zero_engine"):
            caplog.clear()
            engine = zero_engine.initialize(replica, {**base, **extra})
        messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gradient clipping")]
        before = torch.cat([p.detach().flatten() for p in replica.parameters()])
        engine.backward(engine(torch.full((1, 4), 10.0)).pow(2).sum())
        engine.step()
        after = torch.cat([p.detach().flatten() for p in replica.parameters()])
        results[name] = (messages, engine.get_global_grad_norm(), (after - before).norm().item())
        engine.close()
    messages, norm, update = results["left out"]
    assert messages == ["gradient clipping: the global gradient norm to 1 (gradient_clipping = 1 (left out of the "
                        "config: DeepSpeed's default))"]
    assert norm > 10 and update == pytest.approx(1.0, rel=1e-5)  # SGD with lr 1: the clipped gradient's norm
    messages, norm, update = results["off"]
    assert messages == ["gradient clipping: off (gradient_clipping = 0)"]
    assert update > 10
