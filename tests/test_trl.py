"""TRL's trainers as they are, on zero_engine at stage 3, against their own DDP runs on 2 CPU
ranks: ``SFTTrainer`` with a ``peft_config`` and ``DPOTrainer`` with LoRA (its reference: the
policy with adapters disabled), each as ``class ZeroSFTTrainer(ZeroEngineTrainer, SFTTrainer)``
(docs/guides/rl-and-peft.md). The logged loss at every step within 1e-4 of DDP's; a run resumed
from its mid-run checkpoint reproduces the uninterrupted one; the adapters ``save_model`` writes
are PEFT's layout (``adapter_model.safetensors``, ``adapter_config.json``, no base weight), and
``PeftModel.from_pretrained`` loads the engine's trained adapters from them.

TRL's configs default to ``bf16=True`` (on CPU too) and gradient checkpointing: the runs keep
gradient checkpointing and say ``bf16=False`` to all, so that the comparison is fp32 against fp32.
All runs share one spawn (importing transformers, datasets and TRL costs seconds per process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness import run_on_ranks

pytest.importorskip("trl", reason="the [trl] extra: pip install -e '.[trl]' (the [test] extra includes it)")

STEPS, SAVE_AT, TOLERANCE = 6, 3, 1e-4
WORDS = [f"w{i}" for i in range(60)]


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{word: i + 4 for i, word in enumerate(WORDS)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def base_model() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
        eos_token_id=1, bos_token_id=2,
    ))


def lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def datasets(kind: str) -> Any:
    import torch
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)

    def sentence(n: int) -> str:
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=generator))

    rows = 2 * 2 * STEPS  # 2 ranks, 2 per micro-batch, one epoch of STEPS steps
    if kind == "sft":
        return Dataset.from_dict({"text": [sentence(10) for _ in range(rows)]})
    return Dataset.from_dict({
        "prompt": [sentence(4) for _ in range(rows)],
        "chosen": [sentence(5) for _ in range(rows)],
        "rejected": [sentence(5) for _ in range(rows)],
    })


def trainer(kind: str, engine: bool, directory: str, zero_config: dict[str, Any] | None = None) -> Any:
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from zero_engine.integrations.transformers import ZeroEngineTrainer

    options = dict(
        output_dir=directory, per_device_train_batch_size=2, gradient_accumulation_steps=1, learning_rate=3e-3,
        num_train_epochs=1, logging_steps=1, save_strategy="steps", save_steps=SAVE_AT, report_to=[], seed=0,
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, bf16=False,
    )
    if kind == "sft":
        args, cls = SFTConfig(max_length=16, **options), SFTTrainer
    else:
        args, cls = DPOConfig(**options), DPOTrainer
    arguments = dict(model=base_model(), args=args, train_dataset=datasets(kind), processing_class=tokenizer(),
                     peft_config=lora())
    if not engine:
        return cls(**arguments)
    zero = type(f"Zero{cls.__name__}", (ZeroEngineTrainer, cls), {})  # the documented pattern
    zero_config = zero_config or {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    return zero(**arguments, zero_config=zero_config)


def runs(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch

    results: dict[str, Any] = {}
    for kind in ("sft", "dpo"):
        for name, engine, resume in ((f"{kind}-ddp", False, None), (f"{kind}-zero", True, None),
                                     (f"{kind}-zero-resumed", True, f"{kind}-zero")):
            directory = Path(root) / name
            run = trainer(kind, engine, str(directory))
            checkpoint = str(Path(root) / resume / f"checkpoint-{SAVE_AT}") if resume else None
            run.train(resume_from_checkpoint=checkpoint)
            logs = [(entry["step"], entry["loss"]) for entry in run.state.log_history if "loss" in entry]
            results[name] = {"logs": logs}
            if engine:
                run.save_model(str(directory / "final"))
                full = run.zero_engine.full_state_dict()
                results[name]["adapters"] = {key: value for key, value in full.items() if "lora_" in key}
                if name == "sft-zero-resumed":
                    results[name]["rank0_save"] = save_on_rank0_alone(run, rank, directory)
                run.zero_engine.close()
            torch.distributed.barrier()
    return results


def save_on_rank0_alone(run: Any, rank: int, directory: Path) -> str:
    """The misuse ``if trainer.is_world_process_zero(): trainer.save_model()`` (its stream of
    the adapters is collective), the other rank going on with the engine: every rank raises
    `DivergedRanksError` at once (reliability review D4), not after the 30-minute timeout."""
    import time

    from zero_engine import DivergedRanksError

    started = time.monotonic()
    try:
        if rank == 0:
            run.save_model(str(directory / "rank0-alone"))
        run.zero_engine.full_state_dict()
    except DivergedRanksError:
        return f"raised after {time.monotonic() - started:.0f} s"
    return "no error"


@pytest.fixture(scope="module")
def trl_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("trl")
    results = run_on_ranks(2, runs, str(root), allow_numpy=True, backend=None, timeout=600)
    return {"rank0": results[0], "rank1": results[1], "root": root}


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trl_trainer_at_stage3_logs_what_ddp_logs_and_resumes(trl_runs: dict, kind: str) -> None:
    got = trl_runs["rank0"]
    ddp, zero, resumed = got[f"{kind}-ddp"]["logs"], got[f"{kind}-zero"]["logs"], got[f"{kind}-zero-resumed"]["logs"]
    assert [step for step, _ in zero] == [step for step, _ in ddp] == list(range(1, STEPS + 1))
    for (step, loss), (_, expected) in zip(zero, ddp):
        assert loss == pytest.approx(expected, abs=TOLERANCE), (kind, step)
    resumed = [(step, loss) for step, loss in resumed if step > SAVE_AT]  # the history before comes from the checkpoint
    assert [step for step, _ in resumed] == list(range(SAVE_AT + 1, STEPS + 1))
    for (step, loss), (_, expected) in zip(resumed, zero[SAVE_AT:]):
        assert loss == pytest.approx(expected, abs=TOLERANCE), (kind, "resumed", step)
    assert ddp[-1][1] != ddp[0][1]  # the adapters trained


def test_a_save_model_on_one_rank_raises_on_every_rank_at_once(trl_runs: dict) -> None:
    assert trl_runs["rank0"]["sft-zero-resumed"]["rank0_save"] in ("raised after 0 s", "raised after 1 s")
    assert trl_runs["rank1"]["sft-zero-resumed"]["rank0_save"] in ("raised after 0 s", "raised after 1 s")


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_saved_adapters_are_peft_layout_and_load_with_from_pretrained(trl_runs: dict, kind: str) -> None:
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file

    final = trl_runs["root"] / f"{kind}-zero" / "final"
    assert (final / "adapter_config.json").is_file()
    saved = load_file(str(final / "adapter_model.safetensors"))
    assert saved and all("lora_" in name for name in saved)  # the adapters alone, no base weight
    loaded = PeftModel.from_pretrained(base_model(), str(final))
    engine_adapters = trl_runs["rank0"][f"{kind}-zero"]["adapters"]
    state = loaded.state_dict()
    assert set(engine_adapters) <= set(state)
    for name, value in engine_adapters.items():
        assert torch.equal(state[name], value), name


def test_sequence_parallelism_with_a_loss_read_from_the_logits_is_refused_by_name(tmp_path: Path) -> None:
    """Under the split, TRL's losses from its fused head's per-token outputs train (SFT's and
    DPO's: tests/test_hf_trainer_sequence.py); a loss read from the logits (label smoothing, a
    ``compute_loss_func``), of which a rank holds a slice, is refused when the trainer is built."""
    from trl import SFTConfig, SFTTrainer

    from zero_engine.integrations.transformers import ZeroEngineTrainer

    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False, max_length=16,
                     label_smoothing_factor=0.1)
    zero = type("ZeroSFTTrainer", (ZeroEngineTrainer, SFTTrainer), {})
    with pytest.raises(NotImplementedError, match="sequence_parallel_size = 2 through SFTTrainer .*reads the logits"):
        zero(model=base_model(), args=args, train_dataset=datasets("sft"), processing_class=tokenizer(),
             peft_config=lora(), zero_config={"zero_optimization": {"stage": 3}, "sequence_parallel_size": 2})