"""Accelerate's own loop on zero_engine: a script in the shape of Hugging Face's
``run_clm_no_trainer.py`` (tiny GPT-2, 2 CPU ranks, accumulation 2, clipping, a linear schedule
with warm-up counted in processes, a checkpoint mid-run) trains with plain Accelerate (DDP) and
with `zero_engine.integrations.accelerate.Accelerator` at stages 2 and 3, changing only the
Accelerator. The per-micro-step losses, the logged gradient norms and rates, and the final
weights must agree; each run resumed from its own ``save_state`` must continue as DDP's resumed
run does; the state saved with ``get_state_dict`` + ``save_pretrained`` loads with
``from_pretrained``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from harness import run_on_ranks

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

STEPS, ACCUMULATE, MICRO, SAVE_AT = 6, 2, 2, 3
CASES = [("ddp", None, False), ("zero", 2, False), ("zero", 3, False), ("ddp", None, True), ("zero", 3, True)]


def _batches(rows: list) -> dict[str, torch.Tensor]:
    tokens = torch.stack([row[0] for row in rows])
    return {"input_ids": tokens, "labels": tokens}


def clm_runs(rank: int, world_size: int, root: str, cases: list[tuple]) -> dict[str, Any]:
    """Each case trains the same script; ``resume``: from the case's own uninterrupted run's
    checkpoint at step ``SAVE_AT``."""
    import accelerate
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

    from zero_engine.integrations.accelerate import Accelerator

    torch.set_num_threads(1)
    out = {}
    for mode, stage, resume in cases:
        name = f"{mode}{stage or ''}"
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        options = {"cpu": True, "gradient_accumulation_steps": ACCUMULATE}
        if mode == "ddp":
            accelerator = accelerate.Accelerator(**options)
        else:
            config = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                      "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": "auto",
                      "gradient_accumulation_steps": "auto"}
            accelerator = Accelerator(**options, zero_config=config)
        no_decay = ("bias", "ln_")
        named = list(model.named_parameters())
        groups = [
            {"params": [p for n, p in named if not any(k in n for k in no_decay)], "weight_decay": 0.1},
            {"params": [p for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=3e-3)
        data = torch.randint(0, 64, (STEPS * ACCUMULATE * MICRO * world_size, 16), generator=torch.Generator().manual_seed(1))
        loader = DataLoader(TensorDataset(data), batch_size=MICRO, shuffle=True, collate_fn=_batches)
        scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2 * accelerator.num_processes,
                                                    num_training_steps=STEPS * accelerator.num_processes)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        checkpoint = str(Path(root) / f"{name}-state")
        completed, losses, logged = 0, [], []
        if resume:
            accelerator.load_state(checkpoint)
            completed = SAVE_AT
            loader = accelerator.skip_first_batches(loader, SAVE_AT * ACCUMULATE)
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0) if accelerator.sync_gradients else None
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            if accelerator.sync_gradients:
                completed += 1
                logged.append({"norm": float(norm), "lr": scheduler.get_last_lr()[0]})
                if completed == SAVE_AT and not resume:
                    accelerator.save_state(checkpoint)
        state = accelerator.get_state_dict(model)
        kept = {k: v.clone() for k, v in state.items()}  # save_pretrained empties the dict it is given
        exported = None
        if accelerator.is_main_process:
            exported = str(Path(root) / f"{name}{'-resumed' if resume else ''}-pretrained")
            accelerator.unwrap_model(model).save_pretrained(exported, state_dict=state, save_function=accelerator.save)
        accelerator.wait_for_everyone()
        out[f"{name}{'-resumed' if resume else ''}"] = {
            "losses": losses, "logged": logged, "exported": exported,
            "state": kept if accelerator.is_main_process else None,
        }
        accelerator.free_memory()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("accelerate")
    ranks = run_on_ranks(2, clm_runs, str(root), CASES, backend=None, timeout=300, allow_numpy=True)
    return {"ranks": ranks, "root": root}


def _close(got: list[float], expected: list[float], what: str, tolerance: float = 1e-4) -> None:
    assert len(got) == len(expected), what
    worst = max(abs(a - b) for a, b in zip(got, expected))
    assert worst <= tolerance, (what, worst, got, expected)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_same_script_trains_as_accelerate_ddp(runs: dict, stage: int) -> None:
    for rank, results in enumerate(runs["ranks"]):
        ddp, ours = results["ddp"], results[f"zero{stage}"]
        _close(ours["losses"], ddp["losses"], f"rank {rank} losses")
        _close([s["norm"] for s in ours["logged"]], [s["norm"] for s in ddp["logged"]], f"rank {rank} norms")
        _close([s["lr"] for s in ours["logged"]], [s["lr"] for s in ddp["logged"]], f"rank {rank} lr", 1e-12)
        assert len(ddp["logged"]) == STEPS and ddp["logged"][0]["lr"] < ddp["logged"][1]["lr"]  # warming up
    ddp, ours = runs["ranks"][0]["ddp"]["state"], runs["ranks"][0][f"zero{stage}"]["state"]
    assert set(ours) >= {k for k in ddp if not k.endswith("attn.bias")} and ours
    worst = max((ours[k] - ddp[k]).abs().max().item() for k in ours)
    assert worst <= 1e-4, worst


def test_a_run_resumed_from_its_save_state_continues_as_ddp_resumed(runs: dict) -> None:
    for rank, results in enumerate(runs["ranks"]):
        ddp, ours = results["ddp-resumed"], results["zero3-resumed"]
        assert len(ours["losses"]) == (STEPS - SAVE_AT) * ACCUMULATE
        _close(ours["losses"], ddp["losses"], f"rank {rank} resumed losses")
        _close([s["lr"] for s in ours["logged"]], [s["lr"] for s in ddp["logged"]], f"rank {rank} resumed lr", 1e-12)
        _close(ours["losses"], results["zero3"]["losses"][SAVE_AT * ACCUMULATE:], f"rank {rank} against uninterrupted")


def test_the_exported_model_loads_with_from_pretrained(runs: dict) -> None:
    from transformers import GPT2LMHeadModel

    results = runs["ranks"][0]
    for name in ("zero2", "zero3", "zero3-resumed"):
        model = GPT2LMHeadModel.from_pretrained(results[name]["exported"])
        for key, value in results[name]["state"].items():
            assert torch.equal(model.state_dict()[key], value), (name, key)


def launched_with_deepspeed_flags(rank: int, world_size: int, config_file: str) -> dict[str, Any]:
    """As ``accelerate launch --use_deepspeed --deepspeed_config_file FILE`` leaves the
    environment: the engine takes FILE, Accelerate does not try to run DeepSpeed, and "auto"
    is filled from the script; a value that disagrees is refused naming both."""
    import os

    from torch.utils.data import DataLoader, TensorDataset

    from zero_engine import ConfigError
    from zero_engine.integrations.accelerate import Accelerator

    os.environ.update({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": config_file})
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(4, 1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    prepared, _, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    engine = accelerator.zero_engine
    result = {"stage": engine.stage.level, "micro": engine.batch.micro_batch_size,
              "accumulation": engine.batch.gradient_accumulation_steps, "unwrapped": accelerator.unwrap_model(prepared) is model}
    engine.close()
    try:
        Accelerator(cpu=True, gradient_accumulation_steps=3).prepare(torch.nn.Linear(4, 1), loader)
    except ConfigError as error:
        result["error"] = str(error)
    return result


def test_accelerate_launch_with_a_deepspeed_config_file_needs_only_the_import(tmp_path: Path) -> None:
    import json

    config_file = tmp_path / "ds_config.json"
    config_file.write_text(json.dumps({
        "zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }))
    result = run_on_ranks(1, launched_with_deepspeed_flags, str(config_file), backend=None, allow_numpy=True)[0]
    assert (result["stage"], result["micro"], result["accumulation"], result["unwrapped"]) == (2, 4, 2, True)
    assert "gradient_accumulation_steps = 2, but the Accelerator has gradient_accumulation_steps = 3" in result["error"]
    assert str(config_file) in result["error"]


def test_a_schedule_with_total_steps_steps_as_accelerates_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """OneCycle-like schedules stop at their ``total_steps``: Accelerate's ``AcceleratedScheduler``
    steps one once per process while ``_step_count <= total_steps``, and so must the engine's
    (`_RepeatedSchedule`), to the last step: the rates after every optimizer step are the same."""
    from types import SimpleNamespace

    import accelerate.scheduler

    from zero_engine.integrations.accelerate import _RepeatedSchedule

    monkeypatch.setattr(accelerate.scheduler, "AcceleratorState", lambda: SimpleNamespace(num_processes=2))

    def one_cycle() -> torch.optim.lr_scheduler.OneCycleLR:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        optimizer.step_was_skipped = False
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=7)

    theirs_schedule = one_cycle()
    theirs = accelerate.scheduler.AcceleratedScheduler(
        theirs_schedule, [theirs_schedule.optimizer], step_with_optimizer=True, split_batches=False
    )
    ours = _RepeatedSchedule(one_cycle(), repeats=2)
    for _ in range(5):  # past total_steps: both stop at its end
        theirs.step()
        ours.step()
        assert ours.get_last_lr() == theirs_schedule.get_last_lr()
        assert ours._step_count == theirs_schedule._step_count
    assert theirs_schedule._step_count == 8  # stepped to total_steps, not one short


def split_and_groups(rank: int, world_size: int) -> list[dict[str, Any]]:
    """Per ``split_batches``: the micro-batch the engine's "auto" got from a loader of 8, and
    the engine's optimizer groups' options."""
    from accelerate import DataLoaderConfiguration
    from torch.utils.data import DataLoader, TensorDataset

    from zero_engine.integrations.accelerate import Accelerator

    out = []
    for split in (False, True):
        config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                  "gradient_accumulation_steps": 1}
        accelerator = Accelerator(cpu=True, zero_config=config,
                                  dataloader_config=DataLoaderConfiguration(split_batches=split))
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.AdamW(
            [{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias], "weight_decay": 0.0, "lr": 0.5}],
            lr=0.01,
        )
        loader = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)
        accelerator.prepare(model, optimizer, loader)
        engine = accelerator.zero_engine
        groups = [(g["weight_decay"], g["lr"]) for g in engine.optimizer.param_groups]
        out.append({"split": split, "micro": engine.batch.micro_batch_size, "groups": sorted(groups)})
        engine.close()
    return out


def test_split_batches_and_the_optimizers_groups_reach_the_engine_at_two_ranks() -> None:
    """A loader of 8 is each rank's micro-batch of 8, or with ``split_batches`` the global batch
    split in 4s (one rank cannot tell these apart); the prepared optimizer's groups keep their
    own weight decay and rate in the engine's optimizer."""
    for rank_result in run_on_ranks(2, split_and_groups, backend=None, allow_numpy=True, timeout=300):
        assert [(r["split"], r["micro"]) for r in rank_result] == [(False, 8), (True, 4)], rank_result
        for result in rank_result:
            assert result["groups"] == [(0.0, 0.5), (0.1, 0.01)], result


def clipping_auto_without_the_launcher(rank: int, world_size: int) -> str:
    import os

    from zero_engine import ConfigError
    from zero_engine.integrations.accelerate import Accelerator

    os.environ.pop("ACCELERATE_GRADIENT_CLIPPING", None)
    config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": "auto"}
    model = torch.nn.Linear(2, 1)
    try:
        Accelerator(cpu=True, zero_config=config).prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    except ConfigError as error:
        return str(error)
    return "accepted"


def test_clipping_auto_without_the_launchers_value_names_accelerates_source() -> None:
    """Under Accelerate, ``gradient_clipping: "auto"`` comes from ``accelerate launch
    --gradient_clipping``; without it the error says so, not what the Trainer would fill it from."""
    message = run_on_ranks(1, clipping_auto_without_the_launcher, backend=None, allow_numpy=True)[0]
    assert "gradient_clipping = 'auto' is filled from accelerate launch's --gradient_clipping" in message, message
    assert "TrainingArguments" not in message and "give a number in the config" in message
