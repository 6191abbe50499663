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
from trl_cases import SAVE_AT, STEPS, base_model, datasets, lora, tokenizer, trainer

pytest.importorskip("trl", reason="the [trl] extra: pip install -e '.[trl]' (the [test] extra includes it)")

TOLERANCE = 1e-4
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