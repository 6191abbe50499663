"""Config loading and validation: one process, no ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

import zero_engine
from disk import DISK
from zero_engine import ConfigError, load_config
from zero_engine.cli import main as cli_main
from zero_engine.config import auto_keys, no_effect_settings, resolve_batch_sizes

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*"))

EXAMPLE = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "adamw", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "zero_optimization": {"stage": 1, "reduce_bucket_size": "5e8"},
    "comm": {"backend": "gloo", "timeout_s": 60},
}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = load_config(path)
    if path.stem.startswith("zero"):  # zeroN*.yaml trains at stage N
        assert config.zero_optimization.stage == int(path.stem[4]), path
    if "nvme" not in path.stem:
        assert cli_main(["validate", str(path)]) == 0
        return
    # its nvme_path is a placeholder to edit (/local_nvme): validate refuses it as initialize does
    assert not Path("/local_nvme").exists()
    assert cli_main(["validate", str(path)]) == 1
    assert "nvme_path = '/local_nvme': no such directory" in capsys.readouterr().err


def test_shipped_stage_configs_differ_only_in_stage() -> None:
    """zero0-zero3.yaml: the stage, and at stage 3 the unit keys that stages 0-2 never read."""
    dumps = []
    for stage in range(4):
        config = load_config(Path(__file__).parent.parent / "configs" / f"zero{stage}.yaml").model_dump()
        assert config["zero_optimization"].pop("stage") == stage
        dumps.append(config)
    stage3_only = {key for key in dumps[3]["zero_optimization"] if key.startswith("stage3_")}
    for config in dumps:
        for key in stage3_only:
            config["zero_optimization"].pop(key)
    assert dumps[0] == dumps[1] == dumps[2] == dumps[3]


def test_yaml_json_and_dict_give_equal_models(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(EXAMPLE))
    (tmp_path / "c.json").write_text(json.dumps(EXAMPLE))
    from_dict = load_config(EXAMPLE)
    assert load_config(tmp_path / "c.yaml") == from_dict
    assert load_config(str(tmp_path / "c.json")) == from_dict
    assert load_config(from_dict) is from_dict
    assert from_dict.zero_optimization.reduce_bucket_size == 500_000_000


def _error(source) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source)
    return str(info.value)


@pytest.mark.parametrize(
    "patch, expected",
    [
        ({"zero_optimisation": {"stage": 1}}, "zero_optimisation: unknown key; did you mean 'zero_optimization'?"),
        ({"zero_optimization": {"stag": 1}}, "zero_optimization.stag: unknown key; did you mean 'stage'?"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage = 4"),
        ({"optimizer": {"type": "adamw", "params": {"lr": -1}}}, "optimizer.params.lr = -1: must be non-negative"),
        ({"optimizer": {"type": "adamw", "params": {"lr": "fast"}}}, "optimizer.params.lr = 'fast': must be a finite"),
        ({"optimizer": {"type": "adamw", "params": {"lr": 1e-3, "weight_decy": 0.1}}},
         "optimizer.params.weight_decy = 0.1: AdamW takes no keyword 'weight_decy'; did you mean 'weight_decay'?"),
        ({"optimizer": {"type": "adamm"}}, "optimizer.type = 'adamm' is not a torch.optim optimizer; did you mean"),
        ({"optimizer": {"type": "sgd", "params": {"lr": 0.1, "betas": [0.9, 0.99]}}}, "SGD takes no keyword 'betas'"),
        ({"optimizer": {"type": "adam", "params": {"betas": [0.9, 1.5]}}}, "optimizer.params.betas = [0.9, 1.5]"),
        ({"gradient_clipping": -1}, "gradient_clipping = -1"),
        ({"train_batch_size": 0}, "train_batch_size = 0"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled are both true"),
        ({"comm": {"backend": "mpi"}}, "comm.backend = 'mpi'"),
        ({"comm": {"timeout_s": 0}}, "comm.timeout_s = 0"),
    ],
)
def test_bad_input_names_key_and_value(patch: dict, expected: str) -> None:
    assert expected in _error({**EXAMPLE, **patch})


def test_every_error_is_reported_at_once() -> None:
    message = _error({"zero_optimisation": {}, "gradient_clipping": -1, "steps_per_print": 0})
    assert "3 invalid setting(s)" in message
    assert "zero_optimisation" in message and "gradient_clipping" in message and "steps_per_print" in message


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    assert "no such config file" in _error(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("zero_optimization: [unclosed\n")
    assert f"{bad}: not valid YAML" in _error(bad)
    (tmp_path / "c.toml").write_text("")
    assert "unknown config suffix '.toml'" in _error(tmp_path / "c.toml")
    (tmp_path / "list.json").write_text("[1, 2]")
    assert "expected a mapping" in _error(tmp_path / "list.json")
    assert isinstance(ConfigError("x"), ValueError)


@pytest.mark.parametrize(
    "given, world, expected",
    [
        ((None, None, None), 4, (4, 1, 1)),
        ((64, None, None), 4, (64, 16, 1)),
        ((64, 4, None), 4, (64, 4, 4)),
        ((64, None, 2), 4, (64, 8, 2)),
        ((None, 3, 5), 3, (45, 3, 5)),
        ((24, 2, 4), 3, (24, 2, 4)),
    ],
)
def test_batch_arithmetic_fills_the_third(given, world, expected) -> None:
    assert tuple(resolve_batch_sizes(*given, world)) == expected


@pytest.mark.parametrize(
    "given, world, expected",
    [
        ((64, 4, 4), 3, "train_batch_size = 64 but train_micro_batch_size_per_gpu (4) x gradient_accumulation_steps"
                        " (4) x world size (3) = 48"),
        ((10, 4, None), 2, "train_batch_size = 10 is not divisible by train_micro_batch_size_per_gpu (4) x world"),
        ((10, None, 3), 2, "is not divisible by gradient_accumulation_steps (3) x world size (2) = 6"),
    ],
)
def test_inconsistent_batch_sizes_show_the_arithmetic(given, world, expected) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        resolve_batch_sizes(*given, world)
    assert expected in str(info.value)


def test_cli_validate_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimisation": {"stage": 1}}))
    assert cli_main(["validate", str(bad)]) == 1
    assert "did you mean 'zero_optimization'" in capsys.readouterr().err
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"train_batch_size": 32, "gradient_accumulation_steps": 2}))
    assert cli_main(["validate", str(good), "--world-size", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["train_micro_batch_size_per_gpu"] == 4


def test_public_surface() -> None:
    for name in ("initialize", "load_config", "ConfigError", "Engine"):
        assert hasattr(zero_engine, name)


def test_docs_list_every_key() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
    from make_config_docs import DOC, render

    text = DOC.read_text()
    assert render(text) == text, "docs/config.md is stale: run python scripts/make_config_docs.py"


def test_cli_estimate_prints_the_formula(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    assert cli_main(["estimate", str(config), "--params", "1e9", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    # 2Ψ + 14Ψ/N at stage 2 in mixed precision with Adam: 2 + 3.5 = 5.5 GB for a billion.
    total_gib = float(out.split("total")[1].split()[0])
    assert total_gib == pytest.approx(5.5e9 / 2**30, abs=1e-3)
    assert "two gradient buckets" in out


def test_deepspeed_keys_without_effect_are_named_when_set(caplog: pytest.LogCaptureFixture) -> None:
    """Accepted so that DeepSpeed configs load, but never ignored in silence: at a non-default
    value `initialize` logs each one, with why it changes nothing here."""
    import torch

    from zero_engine.config import NO_EFFECT

    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    settings = {
        "fp16": {"auto_cast": True},
        "bf16": {"loss_scale": 128, "loss_scale_window": 10, "initial_scale_power": 8, "hysteresis": 3,
                 "min_loss_scale": 2, "immediate_grad_update": True, "check_grad_overflow": False},
        "disable_python_gc": True, "log_level": "debug",
        "vocabulary_size": 50257, "dist_backend": "nccl", "cuda_visible_devices": "0,1",
        "wall_clock_breakdown": True,
        "zero_allow_untested_optimizer": True,
        "prescale_gradients": True, "gradient_predivide_factor": 2.0, "zero_force_ds_cpu_optimizer": False,
        "memory_breakdown": True, "dump_state": True, "disable_allgather": True, "dataloader_drop_last": True,
        "graph_harvesting": True, "seq_parallel_communication_data_type": "bf16",
        "zero_optimization": {
            "contiguous_gradients": False, "reduce_scatter": False, "allgather_partitions": False,
            "allgather_bucket_size": 123, "round_robin_gradients": True, "sub_group_size": 7,
            "stage3_max_reuse_distance": 9, "stage3_gather_16bit_weights_on_model_save": True,
            "model_persistence_threshold": 5, "memory_efficient_linear": False,
            "stage3_module_granularity_threshold": 5, "stage3_use_all_reduce_for_fetch_params": True,
            "mics_hierarchical_params_gather": True, "use_multi_rank_bucket_allreduce": False,
            "log_trace_cache_warnings": True, "zero_quantized_nontrainable_weights": True,
            "ignore_unused_parameters": False, "elastic_checkpoint": True, "load_from_fp32_weights": False,
            "compute_grad_norm": False, "allgather_sequential": True, "legacy_stage1": True,
            "parameter_alignment": True, "pipeline_loading_checkpoint": True, "override_module_apply": False,
            "enable_sanity_checks": True, "save_muon_momentum_buffer_in_memory": True,
            "leaf_module": {"classes": ["Block"]},
            "offload_optimizer": {"pipeline_read": True, "pipeline_write": True, "cpuadam_cores_perc": 0.5},
            "offload_param": {"buffer_size": 10, "max_in_cpu": 10},
        },
    }
    with caplog.at_level("WARNING", logger="zero_engine"):
        zero_engine.initialize(torch.nn.Linear(2, 2), base).close()
    assert not [r for r in caplog.records if "has no effect here" in r.getMessage()]  # defaults: silent
    with caplog.at_level("WARNING", logger="zero_engine"):
        zero_engine.initialize(torch.nn.Linear(2, 2), {**base, **settings}).close()
    named = [r.getMessage().split(" = ")[0] for r in caplog.records if "has no effect here" in r.getMessage()]
    assert sorted(named) == sorted(NO_EFFECT)


def test_deepspeed_only_sections_are_named_unless_switched_off(caplog: pytest.LogCaptureFixture) -> None:
    import torch

    from zero_engine.config import DEEPSPEED_SECTIONS

    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    sections = {name: {"enabled": True, "output_path": "x"} for name in DEEPSPEED_SECTIONS}
    sections["wandb"] = {"enabled": False, "project": "p"}  # switched off: silent
    sections["activation_checkpointing"] = {"partition_activations": True}  # no switch: named
    sections["amp"] = sections["torch_autocast"] = {"enabled": False}  # refused when on: silent when off
    sections["expert_parallel"] = {"enabled": False}
    with caplog.at_level("WARNING", logger="zero_engine"):
        zero_engine.initialize(torch.nn.Linear(2, 2), {**base, **sections}).close()
    named = {r.getMessage().split(" section")[0].removeprefix("the ") for r in caplog.records
             if "section has no effect here" in r.getMessage()}
    assert named == set(DEEPSPEED_SECTIONS) - {"wandb", "amp", "torch_autocast", "expert_parallel"}
    for refused, match in (
        ({"tensor_parallel": {"autotp_size": 2}}, r"tensor_parallel.autotp_size = 2 \(tensor parallelism"),
        ({"pipeline": {"pipeline_parallel_size": 4}}, r"pipeline.pipeline_parallel_size = 4 \(pipeline"),
        ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}, r"zero_hpz_partition_size = 8 .*shard_group_size"),
        ({"amp": {"enabled": True, "opt_level": "O1"}}, r"amp.enabled = true \(use bf16 or fp16 instead\)"),
        ({"sparse_gradients": True}, r"sparse_gradients = true"),
        ({"expert_parallel": {"enabled": True, "autoep_size": 2, "route_scale": 2.0}},
         r"expert_parallel.route_scale \(not read here"),
        ({"use_data_before_expert_parallelism": True}, r"use_data_before_expert_parallelism = true"),
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, r"bf16.bf16_master_weights_and_grads"),
        ({"bfloat16": {"enabled": True, "bf16_optimizer_states": True}}, r"bf16.bf16_optimizer_states = true"),
        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, r"fp16.fp16_master_weights_and_grads"),
        ({"managed_gradient_accumulation": False}, r"managed_gradient_accumulation = false"),
        ({"gradient_allreduce_op": "sum"}, r"gradient_allreduce_op = 'sum' \(gradients are averaged"),
        ({"zero_optimization": {"stage": 3, "zenflow": {"topk_ratio": 0.1}}}, r"zero_optimization.zenflow"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "super_offload": True}}},
         r"offload_optimizer.super_offload = true"),
    ):
        with pytest.raises(NotImplementedError, match=match):
            zero_engine.initialize(torch.nn.Linear(2, 2), {**base, **refused})


def test_shard_group_size_resolves_and_names_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    zero = load_config({"zero_optimization": {"shard_group_size": 2}}).zero_optimization
    assert zero.shard_group_size_for(6) == 2
    assert load_config({}).zero_optimization.shard_group_size_for(6) == 6, "default: one group of every rank"
    auto = load_config({"zero_optimization": {"shard_group_size": "auto"}}).zero_optimization
    assert auto.shard_group_size_for(8, local_world_size=4) == 4
    assert auto.shard_group_size_for(3) == 3, "'auto' without torchrun: one group"
    alias = load_config({"zero_optimization": {"mics_shard_size": 3}}).zero_optimization
    assert alias.shard_group_size_for(6) == 3, "DeepSpeed's mics_shard_size is the same setting"
    with pytest.raises(ConfigError, match=r"zero_optimization.shard_group_size = 4 does not divide the world size 6"):
        zero.model_copy(update={"shard_group_size": 4}).shard_group_size_for(6)
    with pytest.raises(ConfigError, match=r"mics_shard_size = 4 does not divide the world size 6"):
        load_config({"zero_optimization": {"mics_shard_size": 4}}).zero_optimization.shard_group_size_for(6)
    assert "disagree" in _error({"zero_optimization": {"shard_group_size": 2, "mics_shard_size": 4}})
    assert "zero_optimization.shard_group_size" in _error({"zero_optimization": {"shard_group_size": 0}})
    with pytest.raises(ConfigError, match="shard_group_size = 2 does not divide the world size 1"):
        zero_engine.initialize(torch.nn.Linear(2, 2), {"zero_optimization": {"shard_group_size": 2}})

    config = tmp_path / "c.json"
    config.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    assert cli_main(["estimate", str(config), "--params", "1e9", "--world-size", "8", "--shard-group-size", "2"]) == 0
    out = capsys.readouterr().out
    # 2Ψ + 14Ψ/G at stage 2 in mixed precision with Adam, G = 2 whatever the world size: 9 GB.
    assert float(out.split("total")[1].split()[0]) == pytest.approx(9e9 / 2**30, abs=1e-3)
    assert "groups of 2, 4 replicas" in out
    assert cli_main(["estimate", str(config), "--params", "1e9", "--world-size", "8", "--shard-group-size", "3"]) == 1


def test_a_key_given_twice_is_refused_with_its_lines(tmp_path: Path) -> None:
    # PyYAML and json keep the last value silently: a second zero_optimization block turned
    # stage 3 into stage 1.
    twice = tmp_path / "twice.yaml"
    twice.write_text("zero_optimization:\n  stage: 3\noptimizer:\n  type: AdamW\nzero_optimization:\n  stage: 1\n")
    assert f"{twice}:5: key 'zero_optimization' given twice in one mapping (first on line 1)" in _error(twice)
    nested = tmp_path / "nested.yml"
    nested.write_text("zero_optimization:\n  stage: 3\n  stage: 1\n")
    assert f"{nested}:3: key 'stage' given twice" in _error(nested)
    as_json = tmp_path / "twice.json"
    as_json.write_text('{"zero_optimization": {"stage": 3, "stage": 1}}')
    assert f"{as_json}: key 'stage' given twice in one object" in _error(as_json)
    # YAML merge keys may still be overridden: that is not a key given twice.
    merged = tmp_path / "merged.yaml"
    merged.write_text("zero_optimization:\n  <<: {stage: 2, overlap_comm: false}\n  stage: 3\n")
    zero = load_config(merged).zero_optimization
    assert (zero.stage, zero.overlap_comm) == (3, False)


def test_an_empty_config_file_is_refused(tmp_path: Path) -> None:
    for text in ("", "# only a comment\n\n"):
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        assert f"{empty}: the config file is empty" in _error(empty)


# -- DeepSpeed's spellings (issue 27) ----------------------------------------------------------


def test_both_spellings_of_stage3_keys_and_deprecated_names(recwarn: pytest.WarningsRecorder) -> None:
    short = zero_engine.load_config({"zero_optimization": {
        "stage": 3, "max_live_parameters": 7, "prefetch_bucket_size": 5, "param_persistence_threshold": 3,
        "max_reuse_distance": 2, "gather_16bit_weights_on_model_save": True,
    }}).zero_optimization
    assert (short.stage3_max_live_parameters, short.stage3_prefetch_bucket_size) == (7, 5)
    assert (short.stage3_param_persistence_threshold, short.stage3_max_reuse_distance) == (3, 2)
    assert short.stage3_gather_16bit_weights_on_model_save is True
    assert not recwarn.list  # DeepSpeed's current spellings: no warning
    with pytest.raises(ConfigError, match=r"max_live_parameters = 7 and zero_optimization.stage3_max_live_parameters = 8 "
                       r"are two spellings of one key and disagree"):
        zero_engine.load_config({"zero_optimization": {"max_live_parameters": 7, "stage3_max_live_parameters": 8}})
    with pytest.warns(FutureWarning, match=r"stage3_gather_fp16_weights_on_model_save is DeepSpeed's deprecated name: "
                      r"use zero_optimization.stage3_gather_16bit_weights_on_model_save"):
        old = zero_engine.load_config({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}})
    assert old.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    with pytest.warns(FutureWarning, match=r"cpu_offload is DeepSpeed's deprecated name: use "
                      r"zero_optimization.offload_optimizer.device"):
        offload = zero_engine.load_config({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert offload.zero_optimization.offload_optimizer.device == "cpu"


def test_comments_hjson_and_errors_with_lines(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(
        '{\n  "_comment": "a note",\n  // DeepSpeed reads hjson\n  "train_micro_batch_size_per_gpu": 2\n'
        '  "zero_optimization": {"stage": 2, "_why": "memory",},\n}\n'
    )
    config = zero_engine.load_config(path)
    assert (config.train_micro_batch_size_per_gpu, config.zero_optimization.stage) == (2, 2)
    path.write_text('{\n  "zero_optimization": {\n    "stage": 2,\n    "overlap_comm": \n}')
    with pytest.raises(ConfigError, match=r"ds_config.json: not valid JSON: .*line 5"):
        zero_engine.load_config(path)
    path.write_text('{"steps_per_print": 100, "gradient_clipping": Infinity}')  # strict JSON's Infinity
    with pytest.raises(ConfigError, match=r"gradient_clipping = inf: Input should be a finite number"):
        zero_engine.load_config(path)


def test_fused_adam_keywords_and_deepspeed_optimizers(caplog: pytest.LogCaptureFixture) -> None:
    def optimizer(type_: str, **params: object) -> dict:
        return {"optimizer": {"type": type_, "params": {"lr": 1e-3, **params}}}

    def loaded(type_: str, **params: object) -> tuple[str, dict]:
        config = zero_engine.load_config(optimizer(type_, **params)).optimizer
        return config.type, config.params

    # DeepSpeed 0.19.8's Adam is AdamW unless adam_w_mode is false; its fused Adam decays by 0 unless told
    assert loaded("Adam") == ("AdamW", {"lr": 1e-3, "weight_decay": 0.0})
    assert loaded("Adam", adam_w_mode=True, weight_decay=0.1) == ("AdamW", {"lr": 1e-3, "weight_decay": 0.1})
    assert loaded("Adam", adam_w_mode=False) == ("Adam", {"lr": 1e-3, "weight_decay": 0.0})
    assert loaded("AdamW", adam_w_mode=False) == ("AdamW", {"lr": 1e-3, "weight_decay": 0.0})
    assert loaded("AdamW", torch_adam=True) == ("AdamW", {"lr": 1e-3})  # torch's class, torch's default (0.01)
    assert loaded("SGD") == ("SGD", {"lr": 1e-3})
    assert zero_engine.load_config({}).optimizer.params == {"lr": 1e-3, "weight_decay": 0.0}
    with pytest.raises(ConfigError, match="bias_correction = false: torch's Adam and AdamW always correct"):
        zero_engine.load_config(optimizer("Adam", bias_correction=False))
    for name, nearest in (("Lamb", "AdamW"), ("OneBitAdam", "AdamW"), ("ZeroOneAdam", "AdamW")):
        with pytest.raises(ConfigError, match=rf"optimizer.type = '{name}' is DeepSpeed's own: .*{nearest}"):
            zero_engine.load_config(optimizer(name))
    import torch

    config = optimizer("Adam", torch_adam=True)
    config["train_micro_batch_size_per_gpu"] = 1
    with caplog.at_level("WARNING", logger="zero_engine"):
        engine = zero_engine.initialize(torch.nn.Linear(2, 2), config)
    assert type(engine.optimizer) is torch.optim.AdamW and engine.optimizer.param_groups[0]["weight_decay"] == 0.01
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "optimizer.params.torch_adam = true: torch's defaults apply" in messages
    engine.close()


def test_every_error_of_a_file_in_one_message() -> None:
    with pytest.raises(ConfigError) as info:
        zero_engine.load_config({
            "zero_optimization": {"stage": 5, "sub_group_size": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": -1}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -3}},
        })
    message = str(info.value)
    assert "3 invalid setting(s)" in message, message
    for part in ("zero_optimization.stage = 5", "optimizer.params.lr = -1", "scheduler.params.warmup_num_steps = -3"):
        assert part in message, message
    assert "sub_group_size" not in message  # DeepSpeed allows 0
    # What DeepSpeed's spellings cannot be translated into comes with the field errors too.
    with pytest.raises(ConfigError) as info:
        zero_engine.load_config({
            "gradient_clipping": "auto",
            "zero_optimization": {"stage": 5, "max_live_parameters": 1, "stage3_max_live_parameters": 2},
            "optimizer": {"type": "Adam", "params": {"lr": 0.1, "bias_correction": False}},
        })
    message = str(info.value)
    assert "4 invalid setting(s)" in message, message
    for part in ("give values for gradient_clipping", "two spellings of one key", "bias_correction = false",
                 "zero_optimization.stage = 5"):
        assert part in message, message


def test_auto_values_are_named_all_at_once() -> None:
    """The batch and bucket sizes are filled at initialize (tests/test_auto_values.py); every
    other "auto" needs the Trainer's values and is named when the config loads."""
    with pytest.raises(ConfigError, match=r"'auto' is Hugging Face's placeholder.*give values for gradient_clipping, "
                       r"scheduler.params.warmup_max_lr$"):
        zero_engine.load_config({
            "train_batch_size": "auto", "gradient_clipping": "auto",
            "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "shard_group_size": "auto"},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
        })


@pytest.mark.parametrize(
    "zero, line",
    [
        ({"stage": 4}, "zero_optimization.stage = 4: Input should be less than or equal to 3; or Input should be 'auto'"),
        ({"stage": True}, "zero_optimization.stage = True: a number is expected, not a boolean; or Input should be 'auto'"),
        ({"shard_group_size": 0}, "zero_optimization.shard_group_size = 0: Input should be greater than or equal to 1; "
                                  "or Input should be 'auto'"),
    ],
)
def test_a_value_outside_every_member_of_a_union_is_one_error_in_plain_words(zero: dict, line: str) -> None:
    """pydantic reports each member of ``0-3 | 'auto'`` apart, under its internal name; one line
    per key instead, naming the key path as written."""
    with pytest.raises(ConfigError) as caught:
        load_config({"zero_optimization": zero})
    assert str(caught.value).splitlines() == ["config dict: 1 invalid setting(s)", f"  {line}"]


def test_stage_auto_loads_and_a_budget_without_it_is_named() -> None:
    config = load_config({"zero_optimization": {"stage": "auto", "memory_budget_gib": 2}})
    assert config.zero_optimization.stage == "auto" and auto_keys(config) == []
    config = load_config({"zero_optimization": {"stage": 1, "memory_budget_gib": 2}})
    assert any("memory_budget_gib = 2.0 has no effect" in note for note in no_effect_settings(config))


@pytest.mark.parametrize("key, section, field, value", [
    ("cpu_offload", "offload_optimizer", "device", "cpu"),
    ("cpu_offload_param", "offload_param", "device", "cpu"),
    ("cpu_offload_params", "offload_param", "device", "cpu"),
    ("cpu_offload_use_pin_memory", "offload_optimizer", "pin_memory", True),
])
def test_deprecated_offload_switches_land_in_their_sections(key: str, section: str, field: str, value: object) -> None:
    """Each of DeepSpeed's deprecated offload switches sets its key in its section, and nothing in
    the other one, with a warning naming the current key."""
    with pytest.warns(FutureWarning, match=rf"zero_optimization.{key} is DeepSpeed's deprecated name: use "
                      rf"zero_optimization.{section}.{field}"):
        zero = zero_engine.load_config({"zero_optimization": {"stage": 3, key: True}}).zero_optimization
    assert getattr(getattr(zero, section), field) == value
    other = "offload_param" if section == "offload_optimizer" else "offload_optimizer"
    assert getattr(zero, other) is None
    with pytest.warns(FutureWarning):  # switched off: nothing set
        zero = zero_engine.load_config({"zero_optimization": {"stage": 3, key: False}}).zero_optimization
    assert zero.offload_optimizer is None and zero.offload_param is None


def _model_with_hidden_size() -> "torch.nn.Module":
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model.config = type("Config", (), {"hidden_size": 8})()  # a Hugging Face model's, for the bucket sizes
    return model


_BASE = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}
_TRAINER_AUTO = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
                 "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                 "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "train_batch_size": "auto", "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}
AGREEMENT = {  # name: (config, passes)
    "plain": ({**_BASE, "train_micro_batch_size_per_gpu": 2}, True),
    "one batch key auto": ({**_BASE, "train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto"}, True),
    "two batch keys auto": ({**_BASE, "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
                             "train_micro_batch_size_per_gpu": 2}, False),
    "three batch keys auto": ({**_BASE, "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
                               "train_micro_batch_size_per_gpu": "auto"}, False),
    "bucket sizes auto": ({**_BASE, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                          "stage3_prefetch_bucket_size": "auto"}}, True),
    "a Trainer's auto": (_TRAINER_AUTO, False),
    "nvme without a path": ({**_BASE, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, False),
    "nvme parameters": ({**_BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
                                                                                      "nvme_path": DISK}}}, True),
    "not elementwise at stage 1": ({**_BASE, "optimizer": {"type": "Adafactor", "params": {"lr": 1e-3}}}, False),
    "both precisions": ({**_BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, False),
    "batch against one rank": ({**_BASE, "train_batch_size": 6, "train_micro_batch_size_per_gpu": 4}, False),
    "stage auto": ({**_BASE, "train_micro_batch_size_per_gpu": 2,
                    "zero_optimization": {"stage": "auto", "memory_budget_gib": 1}}, True),
}


@pytest.mark.parametrize("name", list(AGREEMENT))
def test_validate_and_initialize_agree(name: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Issue 65: ``zero-engine validate`` runs initialize's own checks, so the two pass and refuse
    the same configs, "auto" ones included (a model with a hidden size, and --hidden-size, for
    the bucket sizes); a summary line comes first."""
    config, passes = AGREEMENT[name]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    validated = cli_main(["validate", str(path), "--hidden-size", "8"]) == 0
    try:
        zero_engine.initialize(_model_with_hidden_size(), config).close()
        initialized = True
    except (ConfigError, NotImplementedError):
        initialized = False
    assert validated == initialized == passes, (validated, initialized, capsys.readouterr().err)
    if passes:
        assert capsys.readouterr().err.splitlines()[0].startswith("stage ")


def test_validate_checks_a_trainers_config_with_stand_ins(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A config for Hugging Face's Trainer (its "auto" values): refused as it is, with the hint;
    passed with --trainer, each stand-in said; the summary names stage, precision, batch and offload."""
    path = tmp_path / "trainer.json"
    path.write_text(json.dumps({**_TRAINER_AUTO, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}))
    assert cli_main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n  ") == 1 and "with --trainer" in err  # one problem, not its echo
    assert cli_main(["validate", str(path), "--trainer", "--world-size", "2"]) == 0
    err = capsys.readouterr().err
    assert err.splitlines()[0] == ("stage 3, fp32, AdamW, micro 1 x accumulation 1 x 2 rank(s) = 2 samples a step, "
                                   "offload: optimizer to cpu")
    assert "optimizer.params.lr is 'auto': the Trainer fills it" in err


def test_a_key_of_another_section_names_where_it_belongs() -> None:
    """Issue 65: a top-level offload_optimizer suggested 'optimizer'; it belongs in zero_optimization."""
    with pytest.raises(ConfigError, match=r"offload_optimizer: not a key here; it belongs at "
                                          r"zero_optimization\.offload_optimizer"):
        load_config({"offload_optimizer": {"device": "cpu"}})
    with pytest.raises(ConfigError, match=r"zero_optimisation: unknown key; did you mean 'zero_optimization'"):
        load_config({"zero_optimisation": {}})


def test_the_command_line_says_its_version_and_helps_in_plain_text(capsys: pytest.CaptureFixture) -> None:
    """Issue 65: ``zero-engine --version``; no reStructuredText markup in any help."""
    with pytest.raises(SystemExit) as done:
        cli_main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith(f"zero-engine {zero_engine.__version__}")
    for command in ([], ["validate"], ["estimate"], ["consolidate"], ["convert"]):
        with pytest.raises(SystemExit):
            cli_main([*command, "--help"])
        assert "``" not in capsys.readouterr().out, command


def test_estimate_says_when_an_auto_shard_group_is_settled(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "shard_group_size": "auto"}}))
    assert cli_main(["estimate", str(path), "--params", "7e9", "--world-size", "16"]) == 0
    assert "shard_group_size: auto is settled at launch" in capsys.readouterr().out


def test_muons_momentum_and_switches_given_as_strings_are_refused_by_name() -> None:
    """Reliability review E7, E10: Muon's momentum is a running average's weight (above 1 its
    buffer grows every step); a switch given as a string or a number is not read as true."""
    import torch

    from zero_engine.muon import takes_muon

    for momentum in (1.5, 1.0):  # below 0: "must be non-negative", as every optimizer's
        with pytest.raises(ConfigError, match=f"momentum = {momentum}: Muon's momentum must be in \\[0, 1\\)"):
            load_config({"optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": momentum}}})
    load_config({"optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.0}}})
    weight = torch.nn.Parameter(torch.zeros(4, 4))
    weight.use_muon = "yes"
    with pytest.raises(TypeError, match="parameter 'w': use_muon = 'yes': must be True or False"):
        takes_muon("w", weight)
    engine = zero_engine.initialize(torch.nn.Linear(2, 2), {"train_micro_batch_size_per_gpu": 1})
    with pytest.raises(TypeError, match=r"named_full_parameters\(rank0_only\) = 'yes'"):
        engine.named_full_parameters(rank0_only="yes")
    with pytest.raises(TypeError, match=r"full_state_dict\(rank0_only\) = 1"):
        engine.full_state_dict(rank0_only=1)
    engine.close()


@pytest.mark.parametrize("optimizer, params, per_param", [
    ("AdamW", {"lr": 1e-3, "amsgrad": True}, 12), ("AdamW", {"lr": 1e-3}, 8),
    ("SGD", {"lr": 0.1, "momentum": 0.9}, 4), ("SGD", {"lr": 0.1}, 0),
    ("RMSprop", {"lr": 0.01, "centered": True}, 8), ("RMSprop", {"lr": 0.01}, 4),
])
def test_the_estimate_counts_each_optimizers_state_as_the_process_holds_it(optimizer: str, params: dict,
                                                                           per_param: int) -> None:
    """Reliability review N13: the optimizer table's bytes per parameter, by the options that
    change them (amsgrad's max, SGD's momentum, RMSprop's centred average), equal to what a first
    step makes (live storages, a few step counters aside) and to memory_report()."""
    import torch

    from zero_engine.memory import estimate_from_config
    from zero_engine.testing.process_memory import live_tensor_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))  # 340 parameters
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": optimizer, "params": params}}
    engine = zero_engine.initialize(model, config)
    engine.backward(engine(torch.randn(2, 16)).pow(2).mean())
    before = live_tensor_bytes()
    engine.step()
    made = live_tensor_bytes() - before
    counters = 2 * 8  # a step counter per parameter tensor
    estimated = estimate_from_config(load_config(config), 340, 1).optimizer_states
    assert estimated == per_param * 340
    assert estimated <= made <= estimated + 4 * counters, (made, estimated)
    assert estimated <= engine.memory_report()["optimizer_states"] <= estimated + 4 * counters
    engine.close()


def test_validate_refuses_the_nvme_directories_initialize_refuses(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Reliability review E4: zero-engine validate runs initialize's checks of an NVMe directory
    (missing, a file, in memory, '~'), with the same message, and notes what needs the model."""
    import torch

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for path, message in ((str(tmp_path / "missing"), "no such directory"), (str(a_file), "is a file, not a directory"),
                          ("/dev/shm", "which is memory, not a disk"), ("~", "'~' is not expanded here")):
        config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": path}},
                  "train_micro_batch_size_per_gpu": 1}
        written = tmp_path / "c.json"
        written.write_text(json.dumps(config))
        assert cli_main(["validate", str(written)]) == 1
        said = capsys.readouterr().err
        assert message in said, said
        with pytest.raises(ConfigError) as refused:
            zero_engine.initialize(torch.nn.Linear(2, 2), config)
        assert message in str(refused.value)
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}},
              "train_micro_batch_size_per_gpu": 1, "tiled_mlp_tokens": 8}
    written.write_text(json.dumps(config))
    assert cli_main(["validate", str(written)]) == 0
    said = capsys.readouterr().err
    assert "the room for the swap files is checked at initialize" in said
    assert "tiled_mlp_tokens: the model must be a model with modules named 'mlp' (checked at initialize)" in said
