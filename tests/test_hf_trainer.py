"""Hugging Face's Trainer on zero_engine (`ZeroEngineTrainer`), against the plain Trainer (DDP)
with the same TrainingArguments, on 2 CPU ranks and a tiny GPT-2: the logged loss, gradient
norm and learning rate at every step and the weights `save_model` writes, at stages 0-3, with
a config full of ``"auto"`` and with the Trainer's own AdamW (weight decay large enough that
its no-decay group matters); resumed mid-run (the plain Trainer first shown to reproduce itself
exactly), at the same stage and at another; ``evaluate()`` at stage 3; ``from_pretrained`` on
the saved model.

All runs share one spawn (importing transformers costs seconds per process); the rank
function returns what each Trainer logged and saved, and the tests compare."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from harness import run_on_ranks

pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[hf]'")  # CI installs it

SEQ, VOCAB, SAMPLES = 16, 64, 44  # 44 samples on 2 ranks, 2 per micro-batch: 11 micro-batches, a short last window
STEPS, SAVE_AT = 6, 3
TOLERANCE = 1e-4  # the issue's: fused and unfused AdamW and the order of float sums differ by ~1e-7


def _arguments(output_dir: str, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    options = dict(
        output_dir=output_dir, per_device_train_batch_size=2, per_device_eval_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.5, max_grad_norm=0.5, warmup_steps=2,
        lr_scheduler_type="linear", num_train_epochs=1, logging_steps=1, save_strategy="steps", save_steps=SAVE_AT,
        report_to=[], seed=0, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )
    options.update(overrides)
    return TrainingArguments(**options)


def _lora_model() -> Any:
    """PEFT's LoRA over the tiny GPT-2 (its attention's Conv1D): a frozen base, trained adapters."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True)
    return get_peft_model(_model(), lora)


def _model(meta: bool = False) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ)  # dropout 0.1 stays on
    if meta:
        with torch.device("meta"):
            return GPT2LMHeadModel(config)
    return GPT2LMHeadModel(config)


class _Tokens:
    """A map-style dataset of fixed random token rows (labels = inputs: causal LM)."""

    def __init__(self, rows: int, seed: int) -> None:
        import torch

        self.ids = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def auto_config(stage: int, deepspeed_schedule: bool = False) -> dict[str, Any]:
    """A Hugging Face-style DeepSpeed config: every value the Trainer decides is "auto". The
    schedule is the Trainer's own (rebound to the engine's optimizer), or with
    ``deepspeed_schedule`` DeepSpeed's WarmupDecayLR, "auto" too, as Hugging Face's DeepSpeed
    path runs it."""
    schedule = {"scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto",
        "warmup_type": "linear",  # the shape of the Trainer's "linear" schedule, one step later (DeepSpeed's count)
    }}}
    return {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "steps_per_print": float("inf"),
        "optimizer": {
            "type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        **(schedule if deepspeed_schedule else {}),
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": stage, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }


def trainer_optimizer_config(stage: int) -> dict[str, Any]:
    """No optimizer or scheduler section: the Trainer's own AdamW, decay groups and schedule."""
    return {"zero_optimization": {"stage": stage}}


def _trained(trainer: Any, directory: Path, resume: str | None = None) -> dict[str, Any]:
    """Train, save the final model, and return what was logged and saved."""
    from safetensors.torch import load_file

    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(directory / "final"))
    logs = [
        {key: entry[key] for key in ("step", "loss", "grad_norm", "learning_rate")}
        for entry in trainer.state.log_history if "loss" in entry
    ]
    saved = directory / "final" / "model.safetensors"  # a PEFT model's plain Trainer saves its adapters alone
    weights = load_file(str(saved)) if trainer.args.process_index == 0 and saved.is_file() else {}
    return {"logs": logs, "weights": weights}


def trainer_runs(rank: int, world_size: int, root: str, cases: list[tuple[str, Any]]) -> dict[str, Any]:
    """Every case on this rank, in order: ``(name, (kind, config, resume_from))``."""
    from transformers import Trainer

    from zero_engine.integrations.transformers import ZeroEngineTrainer

    train, evaluation = _Tokens(SAMPLES, seed=1), _Tokens(8, seed=2)
    results: dict[str, Any] = {}
    for name, (kind, config, resume_from, *overrides) in cases:
        directory = Path(root) / name
        args = _arguments(str(directory), **(overrides[0] if overrides else {}))
        if kind in ("ddp", "ddp-peft"):
            model = _model() if kind == "ddp" else _lora_model()
            trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation)
        elif kind == "zero-peft":
            trainer = ZeroEngineTrainer(
                model=_lora_model(), args=args, train_dataset=train, eval_dataset=evaluation, zero_config=config
            )
        elif kind == "zero":
            trainer = ZeroEngineTrainer(
                model=_model(), args=args, train_dataset=train, eval_dataset=evaluation, zero_config=config
            )
        else:  # built on the meta device, its weights read by the engine (DeepSpeed's zero.Init)
            trainer = ZeroEngineTrainer(
                model=_model(meta=True), args=args, train_dataset=train, eval_dataset=evaluation, zero_config=config,
                zero_weights=str(Path(root) / "initial"),
            )
        resume = str(Path(root) / resume_from / f"checkpoint-{SAVE_AT}") if resume_from else None
        results[name] = _trained(trainer, directory, resume)
        results[name]["eval_loss"] = trainer.evaluate()["eval_loss"]
        if not kind.startswith("ddp"):
            results[name]["logits"] = _engine_logits(trainer, evaluation)
            zero = trainer.zero_engine.config.zero_optimization
            results[name]["recompute"] = (zero.recompute_units, zero.recompute_offload,
                                          trainer.model.is_gradient_checkpointing)
            trainer.zero_engine.close()
    trainer = ZeroEngineTrainer(model=_model(), args=_arguments(str(Path(root) / "from-ddp")), train_dataset=train,
                                zero_config=auto_config(2))
    try:  # a plain Trainer's checkpoint holds no engine state to resume
        trainer.train(resume_from_checkpoint=str(Path(root) / "ddp" / f"checkpoint-{SAVE_AT}"))
    except FileNotFoundError as err:
        results["resume-from-ddp"] = str(err)
    return results


def _engine_logits(trainer: Any, data: _Tokens) -> Any:
    import torch

    engine = trainer.zero_engine
    engine.eval()
    with torch.no_grad():
        return engine(input_ids=data.ids).logits


STAGES = (0, 1, 2, 3)
CASES = [
    ("ddp", ("ddp", None, None)),
    ("ddp-resumed", ("ddp", None, "ddp")),
    *[(f"auto-{stage}", ("zero", auto_config(stage), None)) for stage in STAGES],
    *[(f"trainer-optimizer-{stage}", ("zero", trainer_optimizer_config(stage), None)) for stage in STAGES],
    ("auto-2-resumed", ("zero", auto_config(2), "auto-2")),
    ("auto-3-resumed-from-stage-1", ("zero", auto_config(3), "auto-1")),
    ("meta-3", ("zero-meta", auto_config(3), None)),
    ("bf16-3", ("zero", auto_config(3), None, {"bf16": True})),
    ("deepspeed-schedule-2", ("zero", auto_config(2, deepspeed_schedule=True), None)),
    # Hugging Face's offloaded activation checkpointing: the engine's recompute_offload instead
    ("recompute-3", ("zero", {**auto_config(3), "zero_optimization": {
        **auto_config(3)["zero_optimization"], "recompute_units": True}}, None)),
    ("hf-offload-3", ("zero", auto_config(3), None, {"gradient_checkpointing": True,
                                                     "gradient_checkpointing_kwargs": {"offload": True}})),
    ("ddp-peft", ("ddp-peft", None, None)),
    ("peft-3", ("zero-peft", auto_config(3), None)),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("trainer")
    _model().save_pretrained(root / "initial")  # what the meta-device case starts from
    results = run_on_ranks(2, trainer_runs, str(root), CASES, allow_numpy=True, backend=None, timeout=600)
    return {"rank0": results[0], "root": root}


def _assert_logs_close(got: list[dict], expected: list[dict], what: str) -> None:
    assert [entry["step"] for entry in got] == [entry["step"] for entry in expected], what
    for mine, theirs in zip(got, expected):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert math.isclose(mine[key], theirs[key], rel_tol=TOLERANCE, abs_tol=1e-7), (what, mine, theirs)


def _assert_weights_close(got: dict, expected: dict, what: str) -> None:
    assert sorted(got) == sorted(expected), what
    for key in expected:
        difference = (got[key] - expected[key]).abs().max().item()
        assert difference <= TOLERANCE, f"{what}: {key} differs by {difference:.2e}"


def test_the_plain_trainer_resumed_from_its_checkpoint_reproduces_its_run(runs: dict) -> None:
    ddp, resumed = runs["rank0"]["ddp"], runs["rank0"]["ddp-resumed"]
    assert [entry["step"] for entry in ddp["logs"]] == list(range(1, STEPS + 1))
    assert resumed["logs"] == ddp["logs"]  # exactly (the first steps' logs come from the checkpoint's state)
    for key in ddp["weights"]:
        assert (resumed["weights"][key] == ddp["weights"][key]).all(), key


@pytest.mark.parametrize("config", ["auto", "trainer-optimizer"])
@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_logs_and_saves_what_the_plain_trainer_does(runs: dict, stage: int, config: str) -> None:
    ddp, zero = runs["rank0"]["ddp"], runs["rank0"][f"{config}-{stage}"]
    _assert_logs_close(zero["logs"], ddp["logs"], f"{config} stage {stage}")
    _assert_weights_close(zero["weights"], ddp["weights"], f"{config} stage {stage}")


def test_clipping_and_decay_were_in_play(runs: dict) -> None:
    """The comparisons above would not see clipping or the decay groups if they never acted."""
    logs = runs["rank0"]["ddp"]["logs"]
    assert max(entry["grad_norm"] for entry in logs) > 0.5  # max_grad_norm 0.5 clipped some step
    assert logs[0]["learning_rate"] == 0.0 and logs[2]["learning_rate"] == pytest.approx(3e-3)  # warm-up of 2


def test_a_deepspeed_schedule_runs_as_under_deepspeed(runs: dict) -> None:
    """WarmupDecayLR (linear, its bounds and step counts filled from the arguments) is DeepSpeed's
    schedule, as Hugging Face's DeepSpeed path runs it: the first two steps use warmup_min_lr, and
    every later step the rate the Trainer's own linear schedule gives the step before."""
    plain = [entry["learning_rate"] for entry in runs["rank0"]["ddp"]["logs"]]
    rates = [entry["learning_rate"] for entry in runs["rank0"]["deepspeed-schedule-2"]["logs"]]
    assert plain[:3] == pytest.approx([0.0, 1.5e-3, 3e-3])
    assert rates == pytest.approx([0.0, *plain[:-1]], abs=1e-12)


@pytest.mark.parametrize("name, reference", [("auto-2-resumed", "auto-2"), ("auto-3-resumed-from-stage-1", "auto-1")])
def test_a_resumed_run_reproduces_the_uninterrupted_one(runs: dict, name: str, reference: str) -> None:
    resumed, whole = runs["rank0"][name], runs["rank0"][reference]
    if name == "auto-2-resumed":  # the same stage: exactly, as the plain Trainer does
        assert resumed["logs"] == whole["logs"]
        for key in whole["weights"]:
            assert (resumed["weights"][key] == whole["weights"][key]).all(), key
    else:  # another stage: the shards sum in another order
        _assert_logs_close(resumed["logs"], whole["logs"], name)
        _assert_weights_close(resumed["weights"], whole["weights"], name)


def test_a_model_built_on_the_meta_device_trains_as_the_eager_one(runs: dict) -> None:
    ddp, meta = runs["rank0"]["ddp"], runs["rank0"]["meta-3"]
    _assert_logs_close(meta["logs"], ddp["logs"], "meta stage 3")
    _assert_weights_close(meta["weights"], ddp["weights"], "meta stage 3")


def test_bf16_arguments_switch_the_engine_to_bf16(runs: dict) -> None:
    """``bf16=True`` fills ``bf16.enabled: auto``: the engine computes in bf16 with fp32 masters
    (the plain Trainer autocasts instead, so only bf16's precision is asked of the losses)."""
    ddp, bf16 = runs["rank0"]["ddp"], runs["rank0"]["bf16-3"]
    assert [entry["step"] for entry in bf16["logs"]] == [entry["step"] for entry in ddp["logs"]]
    for mine, theirs in zip(bf16["logs"], ddp["logs"]):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=3e-2)
        assert mine["loss"] != theirs["loss"]  # bf16 did run
    assert {str(tensor.dtype) for tensor in bf16["weights"].values()} == {"torch.float32"}  # the masters are saved


def test_a_peft_lora_model_at_stage_3_trains_as_under_the_plain_trainer(runs: dict) -> None:
    """PEFT's LoRA model as the Trainer gets it: the base sharded and frozen at stage 3, the
    adapters trained, logged and evaluated as the plain Trainer's DDP run."""
    ddp, zero = runs["rank0"]["ddp-peft"], runs["rank0"]["peft-3"]
    _assert_logs_close(zero["logs"], ddp["logs"], "PEFT stage 3")
    assert zero["eval_loss"] == pytest.approx(ddp["eval_loss"], abs=TOLERANCE)
    assert ddp["logs"][-1]["loss"] != runs["rank0"]["ddp"]["logs"][-1]["loss"]  # the adapters alone trained


def test_evaluate_at_every_stage_matches_the_plain_trainer(runs: dict) -> None:
    expected = runs["rank0"]["ddp"]["eval_loss"]
    for stage in STAGES:
        assert runs["rank0"][f"auto-{stage}"]["eval_loss"] == pytest.approx(expected, abs=TOLERANCE), stage


def test_from_pretrained_loads_the_saved_model_with_the_same_logits(runs: dict) -> None:
    import torch
    from transformers import GPT2LMHeadModel

    for stage in (1, 3):
        saved = runs["root"] / f"auto-{stage}" / "final"
        model = GPT2LMHeadModel.from_pretrained(saved).eval()
        assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # tied, saved once
        with torch.no_grad():
            logits = model(input_ids=_Tokens(8, seed=2).ids).logits
        assert torch.allclose(logits, runs["rank0"][f"auto-{stage}"]["logits"], atol=1e-5), stage


def test_resuming_from_a_plain_trainers_checkpoint_says_how_to_start_from_its_weights(runs: dict) -> None:
    message = runs["rank0"]["resume-from-ddp"]
    assert f"ddp/checkpoint-{SAVE_AT}: no zero_engine checkpoint (no 'latest' file)" in message
    assert "zero_weights=" in message


# -- refused when the Trainer is built (one process) -----------------------------------------------


def _build(tmp_path: Path, config: dict | None = None, **overrides: Any) -> Any:
    from zero_engine.integrations.transformers import ZeroEngineTrainer

    trainer_options = {key: overrides.pop(key) for key in ("optimizers",) if key in overrides}
    return ZeroEngineTrainer(
        model=_model(), args=_arguments(str(tmp_path), **overrides), train_dataset=_Tokens(8, seed=1),
        zero_config=config if config is not None else trainer_optimizer_config(1), **trainer_options,
    )


def test_what_the_engine_cannot_honour_is_refused_when_the_trainer_is_built(tmp_path: Path) -> None:
    import torch

    from zero_engine import ConfigError

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizers=\(optimizer, scheduler\) built beforehand"):
        _build(tmp_path, optimizers=(optimizer, None))
    with pytest.raises(ConfigError, match=r"TrainingArguments.optim = 'adafactor' builds transformers\.optimization"):
        _build(tmp_path, optim="adafactor")
    with pytest.raises(ValueError, match="reduce_lr_on_plateau"):
        _build(tmp_path, lr_scheduler_type="reduce_lr_on_plateau")
    with pytest.raises(ConfigError, match="gradient_clipping = 2.0, but TrainingArguments give max_grad_norm = 0.5"):
        _build(tmp_path, {"gradient_clipping": 2.0, "zero_optimization": {"stage": 1}})
    with pytest.raises(ConfigError, match="zero_optimisation: unknown key"):
        _build(tmp_path, {"zero_optimisation": {"stage": 1}})
    with pytest.raises(ConfigError, match="sequence_parallel_size = 2 does not divide the number of processes, 1"):
        _build(tmp_path, {"zero_optimization": {"stage": 1}, "sequence_parallel_size": 2})
    trainer = _build(tmp_path)  # the Trainer's AdamW, as a config section
    assert trainer._zero_raw["optimizer"]["type"] == "AdamW"
    assert trainer._zero_raw["optimizer"]["params"]["lr"] == 3e-3


def test_hugging_faces_offloaded_checkpointing_is_the_engines(runs: dict) -> None:
    """``gradient_checkpointing_kwargs={"offload": True}``: each unit recomputed with its input in
    host memory (``recompute_units`` and ``recompute_offload``), the model's own checkpointing
    left off; it trains as ``recompute_units`` does (the offload's values are bit for bit: here,
    on the host already, nothing moves; tests/test_recompute.py moves them)."""
    rank0 = runs["rank0"]
    assert rank0["hf-offload-3"]["recompute"] == (True, True, False)
    assert rank0["recompute-3"]["recompute"] == (True, False, False)
    assert rank0["hf-offload-3"]["logs"] == rank0["recompute-3"]["logs"]
