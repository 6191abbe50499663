"""Checkpoints: resume across stages and world sizes, atomic saves, safe and strict loading."""

from __future__ import annotations

import json
import math
import os
import signal
from typing import Any
from pathlib import Path

import pytest
import torch
from torch import nn

import zero_engine
from configs import engine_config
from harness import RankFailure, run_on_ranks
from models import VOCAB, decay_groups, make_model, micro_batch, train_engine, train_reference
from resume_cases import (
    FIRST, GLOBAL_BATCH, LR, SECOND, checkpoint_config, global_means, resume_jobs, train_steps,
)
from zero_engine import CheckpointError
from zero_engine.cli import main as cli_main

# (stage, world size) saved -> (stage, world size) resumed, each chain in three spawns: the
# first's checkpoint is resumed by the second, which saves what the third resumes. The fast run
# keeps the sharded chain; the slow run adds the one through a single process.
RESUME_CHAINS = {
    "sharded": {"a": ((3, 4), (1, 2)), "c": ((2, 2), (3, 4))},
    "from and to one process": {"b": ((0, 1), (2, 3)), "d": ((1, 3), (0, 1))},
}


@pytest.mark.parametrize(
    "chain", ["sharded", pytest.param("from and to one process", marks=pytest.mark.slow)]
)
def test_resume_at_another_stage_and_world_size(tmp_path: Path, chain: str) -> None:
    pairs = RESUME_CHAINS[chain]
    (first, ((stage1, world1), (stage2, world2))), (second, ((stage3, world3), (stage4, world4))) = pairs.items()
    assert world2 == world3, "the middle spawn resumes one chain's checkpoint and saves the other's"
    d = {key: str(tmp_path / key) for key in pairs}
    plan = [
        (world1, [("save", stage1, d[first])]),
        (world2, [("load", stage2, d[first]), ("save", stage3, d[second])]),
        (world4, [("load", stage4, d[second])]),
    ]
    outcome: dict[tuple[str, str], list[dict]] = {}
    for world_size, jobs in plan:
        per_rank = run_on_ranks(world_size, resume_jobs, jobs)
        for index, (kind, _, directory) in enumerate(jobs):
            outcome[(kind, Path(directory).name)] = [r[index] for r in per_rank]

    ref_losses, ref_state, _ = train_reference(FIRST + SECOND, GLOBAL_BATCH, lr=LR)
    for key, (saved, resumed) in pairs.items():
        before = global_means(outcome[("save", key)])
        after = global_means(outcome[("load", key)])
        assert before + after == pytest.approx(ref_losses, abs=2e-5), f"{saved} -> {resumed}"
        for rank, result in enumerate(outcome[("load", key)]):
            for name, ref in ref_state.items():
                diff = (result["state"][name] - ref).abs().max().item()
                assert diff <= 2e-5, f"{saved} -> {resumed}, rank {rank}: {name} differs by {diff}"


def save_then_die(rank: int, world_size: int, directory: str) -> None:
    model = make_model()
    engine = zero_engine.initialize(model, checkpoint_config(1, world_size))
    train_steps(engine, rank, world_size, range(1))
    engine.save_checkpoint(directory)
    train_steps(engine, rank, world_size, range(1, 2))
    if rank == 1:
        from zero_engine.state.storage import FileWriter

        class WriteHalfThenDie(FileWriter):
            def write_file(self, path: Path, payload: object) -> dict:
                with open(path, "wb") as handle:
                    handle.write(b"PK\x03\x04 half a file")
                    handle.flush()
                os.kill(os.getpid(), signal.SIGKILL)
                return {}

        engine.checkpoint_writer = WriteHalfThenDie()
    engine.save_checkpoint(directory)


def resume_after_kill(rank: int, world_size: int, directory: str) -> dict:
    model = make_model(seed=5)
    engine = zero_engine.initialize(model, checkpoint_config(2, world_size))
    engine.load_checkpoint(directory)
    step = engine.global_step
    loaded = engine.full_state_dict()
    train_steps(engine, rank, world_size, range(step, step + 1))
    engine.save_checkpoint(directory)  # a later save works and clears the leftovers
    return {"step": step, "loaded": loaded}


def test_a_rank_killed_mid_save_loses_nothing(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    # Either the harness sees rank 1 die first, or rank 0 sees its peer vanish mid-collective
    # (gloo says "Connection reset" or "Connection closed by peer", depending on timing).
    with pytest.raises(RankFailure, match="rank 1 died|rank 0 of 2 raised(.|\n)*Connection (reset|closed by peer)"):
        run_on_ranks(2, save_then_die, directory)
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step1"
    assert not (tmp_path / "ckpt" / "global_step2").exists(), "the kill did not interrupt a save"
    first = zero_engine.load_consolidated(directory)
    results = run_on_ranks(2, resume_after_kill, directory)
    assert [r["step"] for r in results] == [1, 1]
    for name, value in first.items():
        assert torch.equal(results[0]["loaded"][name], value)
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    assert not (tmp_path / "ckpt" / ".tmp-global_step2").exists()
    zero_engine.load_consolidated(directory)


def save_and_die_publishing(rank: int, world_size: int, directory: str, victim: int, point: str) -> None:
    """Save step 1, then die on rank ``victim`` at ``point`` of the save of step 2: "written"
    (its file complete, before the ranks exchange their lists), "publish" (every file of the
    tag written, the moment the tag's directory is renamed into place) or "latest" (the moment
    the ``latest`` pointer is replaced)."""
    engine = zero_engine.initialize(make_model(), checkpoint_config(1, world_size))
    train_steps(engine, rank, world_size, range(1))
    engine.save_checkpoint(directory)
    train_steps(engine, rank, world_size, range(1, 2))
    if rank == victim:
        from zero_engine.state.storage import FileWriter

        def die() -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        class WriteThenDie(FileWriter):
            def write_file(self, path: Path, payload: object) -> dict:
                written = super().write_file(path, payload)
                die()
                return written

        if point == "written":
            engine.checkpoint_writer = WriteThenDie()
        elif point == "publish":
            rename = os.rename
            os.rename = lambda src, dst: die() if ".tmp-" in str(src) else rename(src, dst)
        else:
            replace = os.replace
            os.replace = lambda src, dst: die() if Path(dst).name == "latest" else replace(src, dst)
    engine.save_checkpoint(directory)


@pytest.mark.parametrize(  # one kill point in the fast run, the others with -m slow
    "victim, point",
    [(0, "publish"), pytest.param(0, "latest", marks=pytest.mark.slow), pytest.param(1, "written", marks=pytest.mark.slow)],
)
def test_a_save_killed_while_publishing_leaves_the_previous_checkpoint(
    tmp_path: Path, victim: int, point: str
) -> None:
    """Whatever instant a save dies at, ``latest`` names a complete checkpoint: the previous one
    until the new one is wholly in place, and a resumed job loads it."""
    directory = str(tmp_path / "ckpt")
    with pytest.raises(RankFailure):
        run_on_ranks(2, save_and_die_publishing, directory, victim, point)
    latest = (tmp_path / "ckpt" / "latest").read_text()
    assert latest == "global_step1", f"killed at {point!r} on rank {victim}, latest names {latest!r}"
    assert (tmp_path / "ckpt" / "global_step2").exists() == (point == "latest")
    first = zero_engine.load_consolidated(directory)
    results = run_on_ranks(2, resume_after_kill, directory)
    assert [r["step"] for r in results] == [1, 1]
    for name, value in first.items():
        assert torch.equal(results[0]["loaded"][name], value), name
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    zero_engine.load_consolidated(directory)


class DropoutModel(nn.Module):
    """Dropout draws from each rank's own generator: a resumed rank must draw what it would have."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.dropout = nn.Dropout(0.5)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.dropout(self.embed(tokens)))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def dropout_run(rank: int, world_size: int, directory: str, resume: bool) -> list[float]:
    """Every rank seeded apart. Uninterrupted: 2 steps, save, 2 more (their losses returned).
    Resumed: seeded apart again, load, the same 2 steps."""
    torch.manual_seed(100 + 7 * rank + (1000 if resume else 0))
    engine = zero_engine.initialize(DropoutModel(), engine_config(2, micro=2, lr=0.5, optimizer="SGD"))
    if resume:
        engine.load_checkpoint(directory)
    else:
        for step in range(2):
            engine.backward(engine(*micro_batch(step, 0, rank, world_size, 2, 1)))
            engine.step()
        engine.save_checkpoint(directory)
    losses = []
    for step in range(2, 4):
        loss = engine(*micro_batch(step, 0, rank, world_size, 2, 1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_each_rank_resumes_its_own_random_numbers(tmp_path: Path) -> None:
    """After a resume every rank draws the dropout masks it would have drawn uninterrupted, so
    the losses go on exactly as before the interruption (on 3 ranks, each seeded apart)."""
    uninterrupted = run_on_ranks(3, dropout_run, str(tmp_path), False)
    resumed = run_on_ranks(3, dropout_run, str(tmp_path), True)
    assert len({tuple(losses) for losses in uninterrupted}) == 3, "the ranks drew the same masks"
    assert resumed == uninterrupted


# -- one process ---------------------------------------------------------------------------------


def _trained_engine(stage: int = 1, steps: int = 2, model: nn.Module | None = None):
    model = model or make_model()
    engine = zero_engine.initialize(model, checkpoint_config(stage, 1))
    train_steps(engine, 0, 1, range(steps))
    return engine


def test_corrupted_or_truncated_files_are_named(tmp_path: Path) -> None:
    engine = _trained_engine()
    path = engine.save_checkpoint(tmp_path, tag="good")
    rank_file = path / "rank00000.pt"
    original = rank_file.read_bytes()

    rank_file.write_bytes(original[: len(original) // 2])
    with pytest.raises(CheckpointError, match=r"rank00000.pt: \d+ bytes, the manifest says \d+ \(truncated\?\)"):
        engine.load_checkpoint(tmp_path)

    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0xFF
    rank_file.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="rank00000.pt: checksum does not match the manifest"):
        engine.load_checkpoint(tmp_path)

    rank_file.write_bytes(original)
    (path / "extra.pt").unlink()
    with pytest.raises(CheckpointError, match="extra.pt: listed in the manifest but missing"):
        zero_engine.load_consolidated(tmp_path)
    with pytest.raises(FileNotFoundError, match="no 'latest' file"):
        engine.load_checkpoint(tmp_path / "nowhere")


class Renamed(nn.Module):
    """The trap model with one parameter renamed and another re-shaped."""

    def __init__(self) -> None:
        super().__init__()
        base = make_model()
        self.embed, self.frozen, self.norm, self.fc2, self.head = base.embed, base.frozen, base.norm, base.fc2, base.head
        self.first = base.fc1  # renamed: fc1 -> first
        self.unused = nn.Parameter(torch.zeros(2, 5))  # re-shaped: (1, 5) -> (2, 5)
        self.register_buffer("temperature", torch.tensor(1.5))


def test_a_checkpoint_that_does_not_fit_lists_the_mismatches(tmp_path: Path) -> None:
    engine = _trained_engine()
    engine.save_checkpoint(tmp_path)
    other = zero_engine.initialize(Renamed(), checkpoint_config(1, 1))
    with pytest.raises(CheckpointError) as info:
        other.load_checkpoint(tmp_path)
    message = str(info.value)
    assert "missing: first.bias, first.weight" in message
    assert "unexpected: fc1.bias, fc1.weight" in message
    assert "re-shaped: unused (checkpoint [1, 5], model [2, 5])" in message
    with pytest.warns(UserWarning, match="loaded what matches"):
        other.load_checkpoint(tmp_path, strict=False)
    assert torch.equal(other.module.embed.weight, engine.module.embed.weight)
    assert torch.equal(other.module.unused, torch.zeros(2, 5))


def test_fine_tuning_can_skip_optimizer_state(tmp_path: Path) -> None:
    engine = _trained_engine()
    engine.save_checkpoint(tmp_path)
    fresh = zero_engine.initialize(make_model(seed=3), checkpoint_config(1, 1))
    fresh.load_checkpoint(tmp_path, load_optimizer_states=False)
    assert len(fresh.optimizer.state) == 0
    assert torch.equal(fresh.module.fc1.weight, engine.module.fc1.weight)
    resumed = zero_engine.initialize(make_model(seed=3), checkpoint_config(1, 1))
    resumed.load_checkpoint(tmp_path)
    assert len(resumed.optimizer.state) == len(engine.optimizer.state)


def test_rng_state_is_restored(tmp_path: Path) -> None:
    engine = _trained_engine()
    engine.save_checkpoint(tmp_path)
    expected = torch.rand(4)
    torch.rand(100)
    engine.load_checkpoint(tmp_path)
    assert torch.equal(torch.rand(4), expected)


def test_saving_inside_an_accumulation_window_is_refused(tmp_path: Path) -> None:
    engine = zero_engine.initialize(make_model(), checkpoint_config(1, 1))  # accumulation 3
    engine.backward(engine(*micro_batch(0, 0, 0, 1, 4, 3)))
    engine.step()
    with pytest.raises(RuntimeError, match=r"micro-step 1 of 3"):
        engine.save_checkpoint(tmp_path)
    assert not any(tmp_path.iterdir()), "a refused save left files behind"



@pytest.mark.parametrize("stage", [1, 3])
def test_a_save_asked_for_inside_a_window_holds_the_last_boundary_and_the_window_goes_on(
    tmp_path: Path, stage: int
) -> None:
    """``within_window=True`` (Lightning saves between micro-batches): the checkpoint holds the
    state of the last optimizer step, as a DDP checkpoint holds no gradients, and this run's
    window keeps the gradients it has: its step equals an uninterrupted run's."""
    def engine_after_one_step() -> Any:
        engine = zero_engine.initialize(make_model(), checkpoint_config(stage, 1))  # accumulation 3
        train_steps(engine, 0, 1, range(1))
        engine.backward(engine(*micro_batch(1, 0, 0, 1, 4, 3)))
        engine.step()
        return engine

    engine, uninterrupted = engine_after_one_step(), engine_after_one_step()
    boundary = engine.full_state_dict()
    engine.save_checkpoint(tmp_path, within_window=True)
    for trained in (engine, uninterrupted):
        for micro in (1, 2):
            trained.backward(trained(*micro_batch(1, micro, 0, 1, 4, 3)))
            trained.step()
    for name, value in uninterrupted.full_state_dict().items():
        assert torch.equal(engine.full_state_dict()[name], value), name
    saved = zero_engine.load_consolidated(tmp_path)
    assert all(torch.equal(saved[name], value) for name, value in boundary.items())


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_consolidate_round_trip_into_a_fresh_model(tmp_path: Path, suffix: str) -> None:
    engine = _trained_engine(stage=2)
    engine.save_checkpoint(tmp_path / "ckpt")
    out = tmp_path / f"model{suffix}"
    assert cli_main(["consolidate", str(tmp_path / "ckpt"), str(out)]) == 0
    if suffix == ".pt":
        state = torch.load(out, weights_only=True)
    else:
        from safetensors.torch import load_file

        state = load_file(out)
    fresh = make_model(seed=7)
    fresh.load_state_dict(state, strict=True)
    expected = engine.full_state_dict()
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert fresh.head.weight is fresh.embed.weight


def test_manifest_documents_the_checkpoint(tmp_path: Path) -> None:
    engine = _trained_engine()
    path = engine.save_checkpoint(tmp_path, tag="t1")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "zero_engine/1" and manifest["global_step"] == 2
    assert manifest["params"]["embed.weight"]["aliases"] == ["embed.weight", "head.weight"]
    assert set(manifest["files"]) == {"rank00000.pt", "extra.pt"}
    assert (tmp_path / "latest").read_text() == "t1"


def test_scheduler_loss_scale_and_fp32_masters_survive_a_round_trip(tmp_path: Path) -> None:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "fp16": {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 2},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": LR, "warmup_num_steps": 10}},
        "zero_optimization": {"stage": 2},
    }
    engine = zero_engine.initialize(make_model(), config)
    for step in range(3):
        engine.backward(engine(*micro_batch(step, 0, 0, 1, 4, 1)))
        engine.step()
    engine.save_checkpoint(tmp_path)
    resumed = zero_engine.initialize(make_model(seed=9), {**config, "zero_optimization": {"stage": 0}})
    resumed.load_checkpoint(tmp_path)
    assert resumed.loss_scale == engine.loss_scale == 2.0**11, "the scale grew once in 3 clean steps (window 2)"
    assert resumed.get_lr() == engine.get_lr()
    assert resumed.lr_scheduler.last_batch_iteration == 2  # DeepSpeed's count: -1 before the first step
    saved, loaded = engine.full_state_dict(), resumed.full_state_dict()
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), f"{name}: fp32 masters must round-trip exactly"
    assert zero_engine.load_consolidated(tmp_path)["fc1.weight"].dtype == torch.float32


def test_the_step_counters_survive_a_resume(tmp_path: Path) -> None:
    """global_step and skipped_steps (fp16 overflows at a loss scale of 2**40) come back as saved."""
    config = {
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "fp16": {"enabled": True, "initial_scale_power": 40, "hysteresis": 1}, "zero_optimization": {"stage": 1},
    }
    engine = zero_engine.initialize(make_model(), config)
    for step in range(3):
        engine.backward(engine(*micro_batch(step, 0, 0, 1, 4, 1)))
        engine.step()
    assert engine.skipped_steps == 3
    engine.save_checkpoint(tmp_path)
    resumed = zero_engine.initialize(make_model(seed=9), config)
    resumed.load_checkpoint(tmp_path)
    assert (resumed.global_step, resumed.skipped_steps) == (3, 3)
    engine.close()
    resumed.close()


def test_restored_optimizer_state_sits_where_torch_keeps_it() -> None:
    """``step`` stays on the host unless the group is capturable or fused (on a GPU a device
    ``step`` makes every update wait for the device); other state goes beside the parameter.
    A meta tensor stands for a parameter on a device that is not the host."""
    from zero_engine.sharding.optimizer_side.optimizer_shard import state_device as _state_device

    on_device = torch.empty(3, device="meta")
    assert _state_device("step", {"capturable": False, "fused": None}, on_device) == torch.device("cpu")
    assert _state_device("step", {"capturable": True}, on_device) == torch.device("meta")
    assert _state_device("step", {"fused": True}, on_device) == torch.device("meta")
    assert _state_device("momentum_buffer", {}, on_device) == torch.device("meta")


# -- what is read from disk is checked before it is used -------------------------------------------


def _malformed_copies(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """A valid 2-rank checkpoint copied and damaged one way per case: (directory, what the error
    must say). Each copy is a checkpoint directory of its own."""
    import shutil

    good = tmp_path / "good"
    run_on_ranks(2, save_one, str(good))
    outside = tmp_path / "outside"
    shutil.copytree(good / "global_step1", outside / "a")
    cases: dict[str, tuple[Path, str]] = {}

    def copy(name: str) -> Path:
        shutil.copytree(good, tmp_path / name, symlinks=True)
        return tmp_path / name

    def latest(name: str, value: str, message: str) -> None:
        root = copy(name)
        (root / "latest").write_text(value)
        cases[name] = (root, message)

    latest("dotdot", "../outside/a", r"latest names tag '../outside/a': a tag is a plain name")
    latest("absolute", str(outside / "a"), r"latest names tag '/.*': a tag is a plain name")
    nested = copy("nested")
    shutil.copytree(good / "global_step1", nested / "a" / "b")
    (nested / "latest").write_text("a/b")
    cases["nested"] = (nested, r"latest names tag 'a/b': a tag is a plain name")
    linked = copy("symlink")
    (linked / "elsewhere").symlink_to(outside / "a", target_is_directory=True)
    (linked / "latest").write_text("elsewhere")
    cases["symlink"] = (linked, r"latest names tag 'elsewhere': .*elsewhere leads outside")

    def manifest(name: str, change: Any, message: str) -> None:
        root = copy(name)
        path = root / "global_step1" / "manifest.json"
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))
        cases[name] = (root, "manifest.json: malformed: " + message)

    manifest("no_files", lambda m: m.pop("files"), r"'files' is missing")
    manifest("more_ranks", lambda m: m.update(world_size=4),
             r"world_size 4 needs rank00002.pt, rank00003.pt in files, which lists \['extra.pt', 'rank00000.pt', "
             r"'rank00001.pt'\]")
    manifest("params_a_list", lambda m: m.update(params=[]), r"'params' is list, not dict")
    manifest("file_outside", lambda m: m["files"].update({"../x": m["files"]["extra.pt"]}),
             r"files lists '../x', not a file of this directory")
    manifest("bad_shape", lambda m: m["params"]["fc1.weight"].update(shape="11x7"),
             r"params\['fc1.weight'\] is .*not \{'shape': \[int\], 'aliases': \[str\]\}")
    return cases


def save_one(rank: int, world_size: int, directory: str) -> None:
    engine = zero_engine.initialize(make_model(), checkpoint_config(1, world_size))
    train_steps(engine, rank, world_size, range(1))
    engine.save_checkpoint(directory)
    engine.close()


def load_each(rank: int, world_size: int, roots: list[str]) -> list[tuple[str, str]]:
    engine = zero_engine.initialize(make_model(), checkpoint_config(1, world_size))
    outcomes = []
    for root in roots:
        try:
            engine.load_checkpoint(root)
            outcomes.append(("", ""))
        except Exception as err:  # noqa: BLE001 (each rank reports what it raised)
            outcomes.append((type(err).__name__, str(err)))
    engine.close()
    return outcomes


def test_malformed_checkpoints_are_refused_on_every_rank_naming_what_is_wrong(tmp_path: Path) -> None:
    """``latest`` leaving its directory (``..``, an absolute path, a nested path, a symbolic link)
    and manifests that are missing keys, hold wrong types or disagree with the files: every rank
    raises a CheckpointError naming the file and the fault, before any tensor is read; the
    one-process reader (load_consolidated, zero-engine consolidate) says the same."""
    import re

    cases = _malformed_copies(tmp_path)
    per_rank = run_on_ranks(2, load_each, [str(root) for root, _ in cases.values()])
    for index, (name, (root, message)) in enumerate(cases.items()):
        for rank, outcomes in enumerate(per_rank):
            kind, text = outcomes[index]
            assert kind == "CheckpointError", (name, rank, kind, text)
            assert re.search(message, text) and "failed on 2 of 2 ranks" in text, (name, rank, text)
        with pytest.raises(CheckpointError, match=message):
            zero_engine.load_consolidated(root)


def test_a_checkpoint_directory_that_is_a_file_is_refused(tmp_path: Path) -> None:
    engine = _trained_engine()
    target = tmp_path / "a-file"
    target.write_text("not a directory")
    for call in (lambda: engine.save_checkpoint(target), lambda: engine.load_checkpoint(target),
                 lambda: zero_engine.load_consolidated(target)):
        with pytest.raises(CheckpointError, match="a-file: is a file, not a checkpoint directory"):
            call()
    with pytest.raises(CheckpointError, match=r"tag '\.\./x': a tag is a plain name"):
        engine.load_checkpoint(tmp_path, tag="../x")
    engine.close()


def test_a_checkpoint_written_by_an_earlier_version_still_loads() -> None:
    """``tests/data/checkpoints/stage2_bf16_2ranks`` was written before the structural change of
    issue 42 (its script beside it): it loads, consolidates to the values saved beside it, and a
    stage 3 engine in one process resumes from it and trains."""
    from safetensors.torch import load_file

    root = Path(__file__).parent / "data" / "checkpoints"
    expected = load_file(str(root / "stage2_bf16_2ranks.expected.safetensors"))
    consolidated = zero_engine.load_consolidated(root / "stage2_bf16_2ranks")
    assert sorted(consolidated) == sorted([*expected, "head.weight"])
    for name, value in expected.items():
        assert torch.equal(consolidated[name], value), name
    model = make_model()
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    engine = zero_engine.initialize(model, engine_config(3, micro=2, lr=0.05, accum=2, dtype="bf16"),
                                    param_groups=decay_groups(model))
    assert engine.load_checkpoint(root / "stage2_bf16_2ranks") == {"note": "written before issue 42"}
    assert engine.global_step == 3 and len(engine.optimizer.state) > 0
    state = engine.full_state_dict()
    for name, value in expected.items():  # frozen weights are held in bf16 under bf16 (no fp32 copy)
        assert torch.equal(state[name], value.to(torch.bfloat16).float() if name in frozen else value), name
    assert frozen and all(state[name].dtype == torch.float32 for name in frozen)
    _train_losses = train_engine(engine, 0, 1, range(3, 4), 4, 2)[0]
    assert all(math.isfinite(loss) for window in _train_losses for loss in window)
    engine.close()


def test_a_tag_being_resaved_stays_readable_while_its_new_copy_moves_into_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader of tag "last" while ``save_checkpoint(dir, tag="last")`` runs again: the new copy
    is complete before it moves into place, but a reader that resolved it just before the move
    found its files gone ("not a complete checkpoint"). Here the move happens in the middle of
    the read, deterministically: the reader must resolve again and read the new copy whole."""
    from zero_engine.state import storage

    engine = zero_engine.initialize(make_model(), engine_config(1, micro=2, lr=0.1))
    engine.save_checkpoint(tmp_path, tag="last")
    real_finish = storage.finish_publish
    monkeypatch.setattr(storage, "finish_publish", lambda root, tag: None)  # the re-save stops, pending
    engine.backward(engine(*micro_batch(0, 0, 0, 1, 2, 1)))
    engine.step()
    engine.save_checkpoint(tmp_path, tag="last")
    monkeypatch.setattr(storage, "finish_publish", real_finish)
    assert storage.tag_path(tmp_path, "last") == storage.pending_path(tmp_path, "last")

    real_sha, moved = storage.sha256_of, []

    def sha_while_the_writer_moves_it(file: Path, *descriptor: int) -> str:
        if not moved:  # the writer's renames land while the reader checks its first file
            moved.append(file)
            real_finish(tmp_path, "last")
        return real_sha(file, *descriptor)

    monkeypatch.setattr(storage, "sha256_of", sha_while_the_writer_moves_it)
    checkpoint = storage.open_checkpoint(tmp_path, "last")
    assert moved and moved[0].parent == storage.pending_path(tmp_path, "last")
    assert checkpoint.path == tmp_path / "last" and checkpoint.manifest["global_step"] == 1
    engine.close()


def test_a_refused_load_leaves_the_engine_as_it_was(tmp_path: Path) -> None:
    """Reliability review D1: a load refused for its optimizer state (another number of param
    groups, or a checkpoint of an engine without an optimizer) refuses before it restores
    anything: the weights, the counters and the optimizer state stay the engine's own."""
    saved = _trained_engine()  # one param group
    saved.save_checkpoint(tmp_path, tag="one_group")
    model = make_model(seed=3)
    engine = zero_engine.initialize(model, checkpoint_config(1, 1), param_groups=decay_groups(model))
    train_steps(engine, 0, 1, range(1))
    before = engine.full_state_dict()
    moments = {key: value.clone() for key, value in next(iter(engine.optimizer.state.values())).items()}
    with pytest.raises(CheckpointError, match="the checkpoint has 1 optimizer param groups, the engine 2"):
        engine.load_checkpoint(tmp_path, tag="one_group")
    after = engine.full_state_dict()
    assert all(torch.equal(after[name], value) for name, value in before.items())
    assert engine.global_step == 1
    assert all(torch.equal(value, moments[key]) for key, value in next(iter(engine.optimizer.state.values())).items())

    def sequential(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))

    frozen = sequential(4).requires_grad_(False)
    reference = zero_engine.initialize(frozen, engine_config(1, micro=2, lr=0.1))
    reference.save_checkpoint(tmp_path, tag="no_optimizer")
    trained = zero_engine.initialize(sequential(5), engine_config(1, micro=2, lr=0.1))
    trained.backward(trained(torch.randn(2, 4)).sum())
    trained.step()
    before = trained.full_state_dict()
    with pytest.raises(CheckpointError, match="saved by an engine without an optimizer.*load_optimizer_states=False"):
        trained.load_checkpoint(tmp_path, tag="no_optimizer")
    assert all(torch.equal(trained.full_state_dict()[name], value) for name, value in before.items())
    trained.load_checkpoint(tmp_path, tag="no_optimizer", load_optimizer_states=False)
    assert torch.equal(trained.full_state_dict()["0.weight"], reference.full_state_dict()["0.weight"])


def test_a_reader_reads_the_bytes_it_verified_while_the_tag_is_resaved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reliability review D2: the tag is re-saved (trained on, frozen weights left out: another
    layout of extra.pt) and moved into place after a reader verified the old copy and before it
    read the files. Reopened by name, the reader paired the old manifest with the new copy's
    files (garbage, or a missing file read as "no checkpoint yet"); read through the descriptors
    verification opened, it gets the old copy whole."""
    from zero_engine.state import storage

    engine = _trained_engine()
    engine.save_checkpoint(tmp_path, tag="rolling")
    first = zero_engine.load_consolidated(tmp_path, "rolling")
    train_steps(engine, 0, 1, range(2, 3))
    real_read, resaved = storage.Checkpoint.read, []

    def read_after_a_resave(self: storage.Checkpoint, name: str) -> Any:
        if not resaved:  # the writer's whole re-save lands between verification and the first read
            resaved.append(engine.save_checkpoint(tmp_path, tag="rolling", exclude_frozen_parameters=True))
        return real_read(self, name)

    monkeypatch.setattr(storage.Checkpoint, "read", read_after_a_resave)
    read = zero_engine.load_consolidated(tmp_path, "rolling")
    assert resaved and set(read) == set(first)
    assert all(torch.equal(read[name], value) for name, value in first.items())
    monkeypatch.setattr(storage.Checkpoint, "read", real_read)
    second = zero_engine.load_consolidated(tmp_path, "rolling")  # the new copy, now in place
    assert not torch.equal(second["fc1.weight"], first["fc1.weight"]) and "frozen.weight" not in second


def test_a_checkpoint_of_the_trainable_state_only_says_so_when_consolidated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Reliability review D6: a checkpoint saved with ``exclude_frozen_parameters=True`` holds no
    base: consolidating it warns naming what it lacks, and a Hugging Face export of it (a model
    whose base would load at random) is refused, naming what to do instead."""
    engine = _trained_engine()
    engine.save_checkpoint(tmp_path, tag="adapters", exclude_frozen_parameters=True)
    with pytest.warns(UserWarning, match=r"trainable state only.*frozen\.bias, frozen\.weight"):
        state = zero_engine.load_consolidated(tmp_path, "adapters")
    assert "frozen.weight" not in state and "fc1.weight" in state
    assert cli_main(["consolidate", str(tmp_path), str(tmp_path / "out.safetensors"), "--tag", "adapters"]) == 0
    assert "note: " in capsys.readouterr().err
    assert cli_main(["consolidate", str(tmp_path), str(tmp_path / "hf"), "--tag", "adapters", "--format", "hf"]) == 1
    error = capsys.readouterr().err
    assert "trainable state only" in error and "save_pretrained" in error
    assert not (tmp_path / "hf" / "model.safetensors").exists()
